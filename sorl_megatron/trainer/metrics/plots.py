"""PNG training curves of one run or several overlaid (like SORL Figs. 5-8).

Every panel has an x axis of whole steps (RL steps, or SFT steps for the cold start's curve;
a tick on each step drawn when there are few, such as the validation steps) and a y axis
labelled with what the metric counts, over a range that fits it: scores (exact match, reward,
the clip-bias factor) on [0, 1]; other non-negative metrics from 0 to their largest value (a
clip ratio of 0.001-0.008 fills the panel), small quantities (KL, the train/inference
mismatch) up to at least a floor, so that float noise of 1e-7 stays a flat line; KL, gradient
and clip-bias norms spread over two decades or more on a log axis. Every symbol a figure uses
(``||C||``, ``k3``, ``pi_old``, ...) is explained in a note under it; curves differ in line style
and marker as well as colour, a curve identical to another is named in the panel's title (it
hides the other), and legends sit beside the panels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from .logger import read_metrics


@dataclass(frozen=True)
class Axis:
    """How a metric's y axis is drawn."""

    label: str
    unit_interval: bool = False  # a score on [0, 1] (widened if a value falls outside)
    floor: float = 0.0  # non-negative: from 0 up to the data's largest value, at least this
    log_when_spread: bool = False  # positive values spanning LOG_SPREAD x or more: a log axis
    symbols: tuple[str, ...] = ()  # the SYMBOLS the label and title use (explained under the figure)


LOG_SPREAD = 100.0

# Every symbol a label or title uses, explained in a note under each figure that shows it.
SYMBOLS: dict[str, str] = {
    "pi_old": "pi_old: the policy that sampled the batch (before this RL step's updates); pi: the policy trained",
    "k3": "k3: the KL estimate mean(r - 1 - log r) over sampled tokens, r = pi / pi_old",
    "||C||": ("||C||: norm of the clipping bias C, the part of the policy gradient PPO's clip removes "
              "(SORL, arXiv 2511.20718, eq. 7; measured as algorithm.loss.clip_bias.mode says)"),
    "||C|| log-prob": ("log-prob space: ||C|| taken over the tokens' clip-bias terms (C's gradient with respect to "
                       "each token's log-probability), not over the parameters"),
    "delta": "delta: clip_bias.delta, the floor of the clip-bias normalization (SORL eqs. 9, 12, 15)",
    "mu": "mu: the rollout engine's sampling distribution (train/inference mismatch, MiniRL arXiv 2512.01374)",
    "R3": "R3: rollout routing replay, the trainer replaying the experts the rollout engine chose",
    "NLL": "NLL: negative log-likelihood of the gold trajectories' policy tokens",
}

# One owner of how each metric is read (the run plots here, the study's figures). Fractions
# that stay small (clip ratio 0.001-0.008) are drawn from 0 to their largest value, not on
# [0, 1], where they would be a flat line at the bottom.
METRIC_AXES: dict[str, Axis] = {
    "rollout/reward": Axis("reward (mean over trajectories)", unit_interval=True),
    "val/em": Axis("exact match (fraction of questions)", unit_interval=True),
    "actor/clip_frac": Axis("fraction of tokens clipped", floor=1e-3),
    "actor/approx_kl_k3": Axis("KL(pi_old || pi), nats/token", floor=1e-3, log_when_spread=True,
                               symbols=("pi_old", "k3")),
    "actor/kl_ref": Axis("KL to the reference policy (nats per token)", floor=1e-3, log_when_spread=True),
    "actor/grad_norm": Axis("L2 norm before clipping", log_when_spread=True),
    "actor/clip_bias/norm": Axis("||C||", log_when_spread=True, symbols=("||C||",)),
    "actor/clip_bias/logprob_norm": Axis("||C|| (log-prob space)", log_when_spread=True,
                                         symbols=("||C||", "||C|| log-prob")),
    "actor/clip_bias/factor": Axis("factor 1 / max(||C||, delta)", unit_interval=True, symbols=("||C||", "delta")),
    "actor/is/mismatch_abs_mean": Axis("|log pi_old - log mu| (nats per token)", floor=1e-3, symbols=("pi_old", "mu")),
    "old/routing/replay_mismatch_frac": Axis("fraction of routing decisions", floor=1e-3, symbols=("R3",)),
    "actor/routing/replay_mismatch_frac": Axis("fraction of replayed routes", floor=1e-3, symbols=("R3",)),
    "rollout/searches": Axis("searches per trajectory"),
    "rollout/response_length": Axis("tokens per trajectory"),
    "sft/nll": Axis("NLL (nats per policy token)", symbols=("NLL",)),
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

# Curves told apart without colour: the i-th curve of a panel (a run, a loss) gets the i-th.
LINE_STYLES: tuple[tuple[object, str], ...] = (
    ("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1)), "v"), ((0, (3, 1, 1, 1, 1, 1)), "P"),
    ((0, (1, 1)), "X"), ((0, (8, 2, 2, 2)), "*"), ((0, (4, 2, 1, 2)), "h"),
)
MAX_TICKED_STEPS = 13  # at most this many distinct steps: a tick on each (validation every k steps)


def line_style(i: int) -> dict[str, object]:
    linestyle, marker = LINE_STYLES[i % len(LINE_STYLES)]
    return {"linestyle": linestyle, "marker": marker}


def identical_curves(curves: Sequence[tuple[str, Sequence[float], Sequence[float]]]) -> dict[str, str]:
    """Each curve equal, point for point, to an earlier one -> that earlier one's label (the
    later curve hides the earlier, so a figure must say so)."""
    seen: dict[tuple, str] = {}
    same: dict[str, str] = {}
    for label, xs, ys in curves:
        key = (tuple(xs), tuple(ys))
        if key in seen:
            same[label] = seen[key]
        else:
            seen[key] = label
    return same


def identical_note(same: dict[str, str]) -> str:
    """``identical curves: b = a, d = c`` (empty without any)."""
    return ("identical curves: " + ", ".join(f"{a} = {b}" for a, b in same.items())) if same else ""


def symbol_notes(keys: Sequence[str], width: int = 130) -> str:
    """The explanations of every symbol the metrics ``keys`` use, in order, wrapped to ``width``."""
    import textwrap

    names = list(dict.fromkeys(n for k in keys if k in METRIC_AXES for n in METRIC_AXES[k].symbols))
    return "\n".join(textwrap.fill(SYMBOLS[n], width) for n in names)


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


def style_axis(ax, key: str, values: Sequence[float], xlabel: str = "RL step", ylabel: Optional[str] = None,
               steps: Sequence[float] = ()) -> None:
    """Step ticks (one on each drawn step when there are few, such as validation steps; whole
    numbers otherwise), axis labels and the y range :data:`METRIC_AXES` gives ``key``: [0, 1]
    for scores, 0 to the data for other non-negative metrics, a log axis for positive values
    spread over two decades or more (unknown keys: labels and ticks only)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(xlabel)
    distinct = sorted(set(steps))
    if 0 < len(distinct) <= MAX_TICKED_STEPS:
        ax.set_xticks(distinct)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis = METRIC_AXES.get(key)
    label = ylabel or (axis.label if axis else key)
    ax.set_ylabel(label)
    if axis is None or not values:
        return
    low, high = min(values), max(values)
    if low == high and not axis.unit_interval:  # a flat line says nothing its value does not
        ax.text(0.5, 0.5, f"{low:g} at every step", transform=ax.transAxes, ha="center", va="center",
                fontsize=9, color="0.3")
    if axis.unit_interval:
        low, high = min(0.0, low), max(1.0, high)
    elif low > 0 and axis.log_when_spread and high / low >= LOG_SPREAD:
        ax.set_yscale("log")  # KL from 1e-3 to 2 on one axis: the early steps are not a line at 0
        ax.set_ylabel(f"{label} (log)")
        return
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

    def draw(ax, key, title, alone: bool) -> list:
        """One metric's panel; returns its curves (for a legend outside the panels)."""
        drawn: list[float] = []
        steps: list[float] = []
        curves, handles = [], []
        for i, (rows, label) in enumerate(zip(data[source(key)], labels)):
            pts = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
            if not pts:
                continue
            xs, ys = zip(*pts)
            style = {**line_style(i), "markersize": 3 if len(pts) < 30 else 0}
            if smooth > 0:
                line = ax.plot(xs, ys, alpha=0.3, linewidth=1, linestyle=style["linestyle"])[0]
                handles.append(ax.plot(xs, smooth_ema(ys, smooth), color=line.get_color(), label=label,
                                       linestyle=style["linestyle"])[0])
            else:
                handles.append(ax.plot(xs, ys, label=label, **style)[0])
            curves.append((label, xs, ys))
            drawn += ys
            steps += xs
        same = identical_note(identical_curves(curves)) if len(runs) > 1 else ""
        heading = f"{title} ({labels[0]})" if alone and len(runs) == 1 else title
        ax.set_title(heading + (f"\n{same}" if same else ""), fontsize=10 if not same else 9)
        style_axis(ax, key, drawn, xlabel="SFT step" if source(key) == "sft" else "RL step", steps=steps)
        ax.grid(alpha=0.3)
        return handles

    def notes(fig, keys) -> None:
        text = symbol_notes(keys)
        if text:
            fig.text(0.01, 0.0, text, fontsize=7, va="top", ha="left")

    for key, title in present:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        handles = draw(ax, key, title, alone=True)
        if len(runs) > 1:  # beside the panel: it never hides a curve
            ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
        fig.tight_layout()
        notes(fig, [key])
        path = out / (key.replace("/", "_") + ".png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    cols = min(3, len(present))
    rows_n = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.4 * rows_n + 0.4), squeeze=False)
    legend: dict[str, object] = {}
    for ax, (key, title) in zip(axes.flat, present):
        for handle in draw(ax, key, title, alone=False):
            legend.setdefault(handle.get_label(), handle)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.suptitle(heading + (f" (smoothed, weight {smooth:g})" if smooth > 0 else ""), fontsize=11)
    fig.tight_layout()
    if len(runs) > 1:
        fig.legend(handles=list(legend.values()), fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 0.95))
    notes(fig, [k for k, _ in present])
    summary = out / "summary.png"
    fig.savefig(summary, dpi=100, bbox_inches="tight")
    plt.close(fig)
    written.append(summary)
    return written
