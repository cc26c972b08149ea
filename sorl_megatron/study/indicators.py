"""Which per-step indicator warned first: for every collapsed run of a study, the step at which
each indicator crossed its threshold and how many steps that was before validation EM fell; and
the indicators that crossed in every collapsed run and in no stable one.

An indicator is a ``metrics.jsonl`` key with a threshold, fixed (``above`` / ``below``) or relative
to the run's own start (``rel_above`` / ``rel_below``: a multiple of the median of its first
``baseline_steps`` logged values). The thresholds are chosen before the runs they judge
(docs/study.md lists them); a study recipe may replace them (``indicators:``).

"Fell" is the collapse step of :func:`collapse_step` (the study's definition). A crossing counts
when it happens at or before that step; the lead is ``collapse step - crossing step``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Literal, Optional

Kind = Literal["above", "below", "rel_above", "rel_below"]


@dataclass(frozen=True)
class Indicator:
    """``metric`` crosses when it goes ``kind`` ``threshold`` (see the module doc)."""

    metric: str
    kind: Kind
    threshold: float
    baseline_steps: int = 3

    def __post_init__(self) -> None:
        if self.kind not in ("above", "below", "rel_above", "rel_below"):
            raise ValueError(f"indicator {self.metric}: kind must be above, below, rel_above or rel_below, "
                             f"got {self.kind!r}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"indicator {self.metric}: threshold must be finite, got {self.threshold}")
        if self.kind.startswith("rel_") and (self.threshold <= 0 or self.baseline_steps < 1):
            raise ValueError(f"indicator {self.metric}: a relative threshold needs threshold > 0 and "
                             f"baseline_steps >= 1")

    def describe(self) -> str:
        rel = self.kind.startswith("rel_")
        side = ">" if self.kind.endswith("above") else "<"
        return (f"{self.metric} {side} {self.threshold:g} x its median over the first {self.baseline_steps} steps"
                if rel else f"{self.metric} {side} {self.threshold:g}")

    def first_crossing(self, series: dict[int, float]) -> Optional[int]:
        """The first step whose value crosses (None: never, or no values)."""
        steps = sorted(series)
        if not steps:
            return None
        limit = self.threshold
        if self.kind.startswith("rel_"):
            base = statistics.median(series[t] for t in steps[: self.baseline_steps])
            limit = self.threshold * base
            steps = steps[self.baseline_steps:]  # the baseline cannot cross itself
        above = self.kind.endswith("above")
        return next((t for t in steps if (series[t] > limit if above else series[t] < limit)), None)


# Chosen before the second study's runs (docs/study.md, "Round two"): MiniRL reads a train/inference
# KL above ~1e-1 as a failure signature; the others mark a clear departure from the demo's
# low-stress runs of round one (KL(old || new) <= 0.005, clip ratio <= 0.02).
DEFAULT_INDICATORS: dict[str, Indicator] = {
    "train_inference_kl": Indicator("mismatch/kl_k3", "above", 0.1),
    "ess": Indicator("mismatch/ess_frac", "below", 0.5),
    "kl_old_new": Indicator("actor/approx_kl_k3", "above", 0.05),
    "clip_frac": Indicator("actor/clip_frac", "above", 0.1),
    "grad_norm": Indicator("actor/grad_norm", "rel_above", 5.0),
    "entropy": Indicator("actor/entropy/mean", "rel_below", 0.5),
}


def series(rows: list[dict[str, Any]], key: str) -> dict[int, float]:
    """``step -> value`` of ``key`` over a run's metrics rows (finite numbers only)."""
    return {int(r["step"]): float(r[key]) for r in rows if isinstance(r.get(key), (int, float))
            and not isinstance(r.get(key), bool) and math.isfinite(float(r[key]))}


def collapse_step(rows: list[dict[str, Any]], collapse_fraction: float) -> Optional[int]:
    """The first validation step whose EM is below ``collapse_fraction`` x the best EM before it
    (that best >= 0.05); None when the run did not collapse."""
    best: Optional[float] = None
    for step, value in sorted(series(rows, "val/em").items()):
        if best is not None and best >= 0.05 and value < collapse_fraction * best:
            return step
        best = value if best is None else max(best, value)
    return None


@dataclass
class RunWarnings:
    run: str
    collapsed_at: Optional[int]
    crossed_at: dict[str, Optional[int]]  # indicator name -> first crossing step

    def leads(self) -> dict[str, Optional[int]]:
        """Steps from each indicator's crossing to the collapse (None: no crossing at or before it)."""
        if self.collapsed_at is None:
            return {name: None for name in self.crossed_at}
        return {name: (self.collapsed_at - t if t is not None and t <= self.collapsed_at else None)
                for name, t in self.crossed_at.items()}

    def first(self) -> list[str]:
        """The indicators with the largest lead (ties all named); empty when none warned."""
        leads = {n: v for n, v in self.leads().items() if v is not None}
        if not leads:
            return []
        top = max(leads.values())
        return sorted(n for n, v in leads.items() if v == top)


def run_warnings(name: str, rows: list[dict[str, Any]], indicators: dict[str, Indicator],
                 collapse_fraction: float) -> RunWarnings:
    return RunWarnings(name, collapse_step(rows, collapse_fraction),
                       {n: ind.first_crossing(series(rows, ind.metric)) for n, ind in indicators.items()})


def separating(warnings: list[RunWarnings]) -> list[str]:
    """Indicators that crossed (at or before the collapse) in every collapsed run and never in a
    stable one; empty when there is no collapsed or no stable run to tell apart."""
    collapsed = [w for w in warnings if w.collapsed_at is not None]
    stable = [w for w in warnings if w.collapsed_at is None]
    if not collapsed or not stable:
        return []
    names = collapsed[0].crossed_at
    return sorted(n for n in names if all(w.leads()[n] is not None for w in collapsed)
                  and all(w.crossed_at[n] is None for w in stable))


def indicator_report(warnings: list[RunWarnings], indicators: dict[str, Indicator]) -> list[str]:
    """The summary's section: thresholds, a row per collapsed run (lead per indicator), the verdict."""
    names = list(indicators)
    lines = ["## Leading indicators", "",
             "Thresholds: " + "; ".join(f"{n}: {ind.describe()}" for n, ind in indicators.items()) + ". "
             "Per collapsed run: the steps from each indicator's first crossing to the validation step at "
             "which EM fell (`-`: it did not cross at or before it).", ""]
    collapsed = [w for w in warnings if w.collapsed_at is not None]
    if not collapsed:
        return lines + ["No run collapsed.", ""]
    lines += ["| run | EM fell at step | " + " | ".join(names) + " | first |",
              "|---|---|" + "---|" * (len(names) + 1)]
    for w in collapsed:
        leads = w.leads()
        lines.append(f"| {w.run} | {w.collapsed_at} | "
                     + " | ".join("-" if leads[n] is None else str(leads[n]) for n in names)
                     + f" | {', '.join(w.first()) or '-'} |")
    sep = separating(warnings)
    stable = len(warnings) - len(collapsed)
    lines += ["", (f"Crossed in all {len(collapsed)} collapsed runs and in none of the {stable} stable ones: "
                   + (", ".join(f"**{n}**" for n in sep) if sep else "no indicator") + "."), ""]
    return lines
