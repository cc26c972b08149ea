"""PNG training curves of one run or several overlaid (like SORL Figs. 5-8)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .metrics_log import read_metrics

# (metric key, panel title); a panel is drawn when any run logged the key.
DEFAULT_PANELS: tuple[tuple[str, str], ...] = (
    ("rollout/reward", "training reward"),
    ("val/em", "validation exact match"),
    ("actor/clip_frac", "clipping ratio"),
    ("actor/approx_kl_k3", "KL(pi_old || pi) (k3)"),
    ("actor/kl_ref", "KL to reference"),
    ("actor/grad_norm", "policy gradient norm"),
    ("actor/clip_bias/norm", "clip-bias norm ||C||"),
    ("actor/is/mismatch_abs_mean", "train/inference mismatch |log pi_old - log mu|"),
    ("old/routing/replay_mismatch_frac", "R3: trainer vs rollout-engine routing"),
    ("actor/routing/replay_mismatch_frac", "replayed routes the live router changed"),
    ("rollout/searches", "searches per trajectory"),
    ("rollout/response_length", "response length"),
)


def plot_runs(runs: Sequence[str | Path], out_dir: str | Path, panels: Sequence[tuple[str, str]] = DEFAULT_PANELS,
              labels: Sequence[str] | None = None) -> list[Path]:
    """Write one PNG per available metric plus ``summary.png``; returns the written paths."""
    import matplotlib  # only plotting pays for it; the file backend is chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("no runs given")
    labels = list(labels) if labels else [Path(r).name for r in runs]
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    data = [read_metrics(r) for r in runs]
    present = [(k, t) for k, t in panels if any(any(row.get(k) is not None for row in rows) for rows in data)]
    if not present:
        raise ValueError(f"none of the metrics {[k for k, _ in panels]} were logged in {list(map(str, runs))}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def draw(ax, key, title):
        for rows, label in zip(data, labels):
            pts = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=7)

    for key, title in present:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        draw(ax, key, title)
        fig.tight_layout()
        path = out / (key.replace("/", "_") + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    cols = min(3, len(present))
    rows_n = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.4 * rows_n), squeeze=False)
    for ax, (key, title) in zip(axes.flat, present):
        draw(ax, key, title)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.tight_layout()
    summary = out / "summary.png"
    fig.savefig(summary, dpi=100)
    plt.close(fig)
    written.append(summary)
    return written
