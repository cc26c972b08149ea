"""PNG training curves of one run or several overlaid (like SORL Figs. 5-8).

Every panel has an x axis of whole steps (RL steps, or SFT steps for the cold start's curve)
and a y axis labelled with what the metric counts, over a range that fits it: fractions and
rates (exact match, reward, clip ratio, routing mismatch) on [0, 1], non-negative metrics from
0, and small quantities (KL, the train/inference mismatch) up to at least a floor, so that
float noise of 1e-7 stays a flat line instead of filling the panel.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from .metrics_log import read_metrics


@dataclass(frozen=True)
class Axis:
    """How a metric's y axis is drawn."""

    label: str
    unit_interval: bool = False  # a fraction or a rate: [0, 1] (widened if a value falls outside)
    floor: float = 0.0  # non-negative: from 0 up to at least this


# One owner of how each metric is read (the run plots here, the study's figures).
METRIC_AXES: dict[str, Axis] = {
    "rollout/reward": Axis("reward (mean over trajectories)", unit_interval=True),
    "val/em": Axis("exact match (fraction of questions)", unit_interval=True),
    "actor/clip_frac": Axis("fraction of tokens clipped", unit_interval=True),
    "actor/approx_kl_k3": Axis("KL (nats per token)", floor=1e-3),
    "actor/kl_ref": Axis("KL (nats per token)", floor=1e-3),
    "actor/grad_norm": Axis("L2 norm before clipping"),
    "actor/clip_bias/norm": Axis("||C||"),
    "actor/clip_bias/logprob_norm": Axis("||C|| (log-prob space)"),
    "actor/clip_bias/factor": Axis("factor 1 / max(||C||, delta)", unit_interval=True),
    "actor/is/mismatch_abs_mean": Axis("|log pi_old - log mu| (nats per token)", floor=1e-3),
    "old/routing/replay_mismatch_frac": Axis("fraction of routing decisions", unit_interval=True),
    "actor/routing/replay_mismatch_frac": Axis("fraction of replayed routes", unit_interval=True),
    "rollout/searches": Axis("searches per trajectory"),
    "rollout/response_length": Axis("tokens per trajectory"),
    "sft/nll": Axis("NLL (nats per policy token)"),
}

# (metric key, panel title); a panel is drawn when any run logged the key. ``sft/*`` keys come
# from the run's SFT stage (``<run>/sft/metrics.jsonl``) and are drawn against SFT steps.
DEFAULT_PANELS: tuple[tuple[str, str], ...] = (
    ("rollout/reward", "training reward"),
    ("val/em", "validation exact match"),
    ("actor/clip_frac", "clipping ratio"),
    ("actor/approx_kl_k3", "KL(pi_old || pi) (k3)"),
    ("actor/kl_ref", "KL to reference"),
    ("actor/grad_norm", "policy gradient norm"),
    ("actor/clip_bias/norm", "clip-bias norm ||C||"),
    ("actor/is/mismatch_abs_mean", "train/inference mismatch"),
    ("old/routing/replay_mismatch_frac", "R3: trainer vs rollout-engine routing"),
    ("actor/routing/replay_mismatch_frac", "replayed routes the live router changed"),
    ("rollout/searches", "searches per trajectory"),
    ("rollout/response_length", "response length"),
    ("sft/nll", "SFT cold start: loss"),
)


def smooth_ema(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average with ``weight`` on the past,
    debiased so that the first points are not pulled towards 0. ``weight`` 0 leaves the
    values as they are."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out, last = [], 0.0
    for i, value in enumerate(values, 1):  # a curve of at most a few thousand points
        last = weight * last + (1 - weight) * value
        out.append(last / (1 - weight**i))
    return out


def style_axis(ax, key: str, values: Sequence[float], xlabel: str = "RL step", ylabel: Optional[str] = None) -> None:
    """Integer step ticks, axis labels and the y range :data:`METRIC_AXES` gives ``key``
    (unknown keys: labels and ticks only)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis = METRIC_AXES.get(key)
    ax.set_ylabel(ylabel or (axis.label if axis else key))
    if axis is None or not values:
        return
    low, high = min(values), max(values)
    if axis.unit_interval:
        low, high = min(0.0, low), max(1.0, high)
    elif low >= 0:
        low, high = 0.0, max(high, axis.floor) or 1.0  # all zeros: a flat line at the bottom, not mid-panel
    else:
        return  # a signed quantity: matplotlib's own range
    if high > low:
        pad = 0.03 * (high - low)
        ax.set_ylim(low - pad, high + pad)


def run_description(run: str | Path) -> Optional[str]:
    """A short account of a run's recipe from the ``config.yaml`` it wrote (None without one)."""
    path = Path(run)
    path = path / "config.yaml" if path.is_dir() else path.parent / "config.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        c = OmegaConf.to_container(OmegaConf.load(path))
        a, s = c["algorithm"], c["schedule"]
        return (f"{a['loss']['name']} with {a['advantage']['estimator']} advantages; {s['batch_size']} prompts x "
                f"{c['rollout']['group_size']}, mini-batch {s['mini_batch_size']}, lr {c['optimizer']['lr']:g}, "
                f"seed {s['seed']}")
    except Exception:  # an older or hand-edited config: the title goes without it
        return None


def _read(run: str | Path, source: str) -> list[dict[str, Any]]:
    if source == "rl":
        return read_metrics(run)
    sft = Path(run) / "sft" / "metrics.jsonl"
    return read_metrics(sft) if sft.is_file() else []


def plot_runs(runs: Sequence[str | Path], out_dir: str | Path, panels: Sequence[tuple[str, str]] = DEFAULT_PANELS,
              labels: Sequence[str] | None = None, smooth: float = 0.0) -> list[Path]:
    """Write one PNG per available metric plus ``summary.png`` (titled with the run names and,
    for one run, its recipe); returns the written paths. ``smooth`` > 0 draws each curve
    faintly and its :func:`smooth_ema` over it."""
    import matplotlib  # only plotting pays for it; the file backend is chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("no runs given")
    if not 0 <= smooth < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {smooth}")
    labels = list(labels) if labels else [Path(r).name for r in runs]
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    data = {"rl": [read_metrics(r) for r in runs], "sft": [_read(r, "sft") for r in runs]}

    def source(key: str) -> str:
        return "sft" if key.startswith("sft/") else "rl"

    present = [(k, t) for k, t in panels
               if any(any(row.get(k) is not None for row in rows) for rows in data[source(k)])]
    if not present:
        raise ValueError(f"none of the metrics {[k for k, _ in panels]} were logged in {list(map(str, runs))}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if len(runs) == 1:
        what = run_description(runs[0])
        heading = f"run {labels[0]}" + (f": {what}" if what else "")
    else:
        heading = "runs " + ", ".join(labels)

    def draw(ax, key, title, alone: bool):
        drawn: list[float] = []
        for rows, label in zip(data[source(key)], labels):
            pts = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
            if not pts:
                continue
            xs, ys = zip(*pts)
            marker = "o" if len(pts) < 30 else None
            if smooth > 0:
                line = ax.plot(xs, ys, alpha=0.3, linewidth=1)[0]
                ax.plot(xs, smooth_ema(ys, smooth), color=line.get_color(), label=label)
            else:
                ax.plot(xs, ys, marker=marker, markersize=3, label=label)
            drawn += ys
        ax.set_title(f"{title} ({labels[0]})" if alone and len(runs) == 1 else title, fontsize=10)
        style_axis(ax, key, drawn, xlabel="SFT step" if source(key) == "sft" else "RL step")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=7)

    for key, title in present:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        draw(ax, key, title, alone=True)
        fig.tight_layout()
        path = out / (key.replace("/", "_") + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    cols = min(3, len(present))
    rows_n = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.4 * rows_n + 0.4), squeeze=False)
    for ax, (key, title) in zip(axes.flat, present):
        draw(ax, key, title, alone=False)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.suptitle(heading + (f" (smoothed, weight {smooth:g})" if smooth > 0 else ""), fontsize=11)
    fig.tight_layout()
    summary = out / "summary.png"
    fig.savefig(summary, dpi=100)
    plt.close(fig)
    written.append(summary)
    return written
