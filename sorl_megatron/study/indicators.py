"""Which per-step indicator warned first: for every collapsed run of a study, the step at which
each indicator crossed its threshold and how many steps that was before validation EM fell; and
the indicators that crossed in every collapsed run and in no stable one.

An indicator is a ``metrics.jsonl`` key with a threshold, fixed (``above`` / ``below``) or relative
to the run's own start (``rel_above`` / ``rel_below``: a multiple of the median of its first
``baseline_steps`` logged values). The thresholds are chosen before the runs they judge
(docs/study.md lists them); a study recipe may replace them (``indicators:``).

"Fell" is the collapse step of :func:`collapse_step` (the study's definition). A crossing counts
when it happens at or before that step; the lead is ``collapse step - crossing step``.

Round three (issue 47, item 2; ``study/early_warning.py`` writes results/study/round3/indicators.md)
asks whether an indicator *predicts* a fall: falls timed by validation EM and by the training
reward (:func:`reward_fall_step`), scores read from step 2 on as values and as the rise from the
run's own step-1 value (:class:`Score`), an ROC AUC per lead window over (run, step) samples
(:func:`window_samples`, :func:`auc`) and a threshold fitted on all seeds but one and judged on
that one (:func:`leave_one_seed_out`, :func:`usable`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

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


# ----------------------------------------------------------------------------- round three
# The indicators as predictors (issue 47, item 2; results/study/round3/indicators.md): per step,
# does an indicator's value say that a fall follows within a window of steps? Events are timed
# by validation EM (``collapse_step``) and by the per-step training reward
# (``reward_fall_step``); scores are read from step 2 on, as the value itself and as the change
# from the run's own step-1 value; each (indicator, score, window) gets an ROC AUC over all its
# (run, step) samples and a leave-one-seed-out check of the threshold fitted on the other seeds.

EventKind = Literal["validation", "reward"]
REWARD_WINDOW = 3  # trailing mean of the training reward (its batch-to-batch swing is 2x)
FIRST_SCORED_STEP = 2  # step 1's batch is the same in every run of a seed (module doc of round three)


def reward_fall_step(rows: list[dict[str, Any]], collapse_fraction: float, window: int = REWARD_WINDOW,
                     key: str = "rollout/reward") -> Optional[int]:
    """The first step whose trailing mean of the training reward over ``window`` steps is below
    ``collapse_fraction`` x the best such mean before it (that best >= 0.05): the collapse rule
    on the per-step reward. None when it never falls (or the run is shorter than the window)."""
    values = sorted(series(rows, key).items())
    best: Optional[float] = None
    for i in range(window - 1, len(values)):
        mean = sum(v for _, v in values[i - window + 1: i + 1]) / window
        if best is not None and best >= 0.05 and mean < collapse_fraction * best:
            return values[i][0]
        best = mean if best is None else max(best, mean)
    return None


def event_step(rows: list[dict[str, Any]], kind: EventKind, collapse_fraction: float) -> Optional[int]:
    if kind == "validation":
        return collapse_step(rows, collapse_fraction)
    if kind == "reward":
        return reward_fall_step(rows, collapse_fraction)
    raise ValueError(f"event kind must be validation or reward, got {kind!r}")


@dataclass(frozen=True)
class Score:
    """An indicator read as an alarm score, higher = more alarming: ``direction`` +1 for a metric
    that rises before trouble (KL, clip fraction), -1 for one that falls (ESS, entropy); ``rise``
    scores the change from the run's own step-1 value (``scale`` ``diff``: x_t - x_1, ``log``:
    log(x_t / x_1), for quantities measured by their ratio), else the value itself."""

    metric: str
    direction: int
    scale: Literal["diff", "log"] = "diff"

    def scores(self, rows: list[dict[str, Any]], rise: bool, start: int = FIRST_SCORED_STEP) -> dict[int, float]:
        values = series(rows, self.metric)
        base = values.get(1)
        out = {}
        for t, x in values.items():
            if t < start:
                continue
            if rise:
                if base is None:
                    continue
                if self.scale == "log":
                    if x <= 0 or base <= 0:
                        continue
                    x = math.log(x / base)
                else:
                    x = x - base
            out[t] = self.direction * x
        return out


ROC_SCORES: dict[str, Score] = {
    "train_inference_kl": Score("mismatch/kl_k3", +1),
    "ess": Score("mismatch/ess_frac", -1),
    "ess_seq": Score("mismatch/ess_frac_seq", -1),
    "route_flip": Score("mismatch/route_flip_rate", +1),
    "kl_old_new": Score("actor/approx_kl_k3", +1),
    "clip_frac": Score("actor/clip_frac", +1),
    "clip_frac_token": Score("actor/clip_frac/token", +1),
    "clip_frac_turn": Score("actor/clip_frac/turn", +1),
    "grad_norm": Score("actor/grad_norm", +1, "log"),
    "entropy": Score("actor/entropy/mean", -1, "log"),
}
LEAD_WINDOWS: tuple[tuple[int, int], ...] = ((1, 4), (5, 9), (10, 19))


@dataclass(frozen=True)
class Sample:
    run: str
    seed: int
    step: int
    score: float
    label: int  # 1: the event follows within the window; 0: no event within it


def run_seed(name: str) -> int:
    """The seed of a cell name ``<loss>__<stress>__s<seed>``."""
    tail = name.rsplit("__", 1)[-1]
    if not tail.startswith("s") or not tail[1:].isdigit():
        raise ValueError(f"{name!r} is not a cell name <loss>__<stress>__s<seed>")
    return int(tail[1:])


def window_samples(name: str, scores: dict[int, float], event: Optional[int], last_step: int,
                   window: tuple[int, int]) -> list[Sample]:
    """One sample per scored step t before the event: positive when the event is ``lo..hi``
    steps after t, negative when no event falls within ``hi`` steps after t (and the run lasts
    that long). Steps at or after the event, steps whose event is nearer than ``lo`` and steps
    whose window runs past the run's end without an event are left out."""
    lo, hi = window
    seed = run_seed(name)
    out = []
    for t in sorted(scores):
        if event is not None and t >= event:
            break
        lead = None if event is None else event - t
        if lead is not None and lo <= lead <= hi:
            out.append(Sample(name, seed, t, scores[t], 1))
        elif lead is not None and lead < lo:
            continue
        elif t + hi <= last_step:
            out.append(Sample(name, seed, t, scores[t], 0))
    return out


def auc(samples: list[Sample]) -> Optional[float]:
    """The ROC area (Mann-Whitney, ties half): the chance that a positive sample scores above a
    negative one. None without both."""
    pos = [s.score for s in samples if s.label]
    neg = [s.score for s in samples if not s.label]
    if not pos or not neg:
        return None
    ranked = sorted([(v, 1) for v in pos] + [(v, 0) for v in neg])
    rank_sum, i = 0.0, 0
    while i < len(ranked):
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        mid = (i + 1 + j) / 2  # the average rank of the tie block (1-based)
        rank_sum += mid * sum(label for _, label in ranked[i:j])
        i = j
    return (rank_sum - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


@dataclass(frozen=True)
class Rates:
    tpr: float
    fpr: float
    precision: Optional[float]  # of the alarms, the share followed by the event (None: no alarm)
    alarms: int


def rates(samples: list[Sample], threshold: float) -> Rates:
    """An alarm is ``score >= threshold``."""
    pos = sum(s.label for s in samples)
    neg = len(samples) - pos
    tp = sum(1 for s in samples if s.label and s.score >= threshold)
    fp = sum(1 for s in samples if not s.label and s.score >= threshold)
    return Rates(tp / pos if pos else math.nan, fp / neg if neg else math.nan,
                 tp / (tp + fp) if tp + fp else None, tp + fp)


def youden_threshold(samples: list[Sample]) -> Optional[float]:
    """The threshold (one of the scores) with the largest TPR - FPR; ties: the highest (fewest
    alarms). None without positives and negatives."""
    pos = sum(s.label for s in samples)
    neg = len(samples) - pos
    if not pos or not neg:
        return None
    best, best_j = None, -math.inf
    tp = fp = 0
    ordered = sorted(samples, key=lambda s: -s.score)
    for i, s in enumerate(ordered):
        tp += s.label
        fp += 1 - s.label
        if i + 1 < len(ordered) and ordered[i + 1].score == s.score:
            continue  # a threshold takes the whole tie block
        j = tp / pos - fp / neg
        if j > best_j + 1e-12:
            best, best_j = s.score, j
    return best


@dataclass(frozen=True)
class Fold:
    seed: int  # held out
    flipped: bool  # the other seeds ranked the steps before a fall low: the score is read reversed
    threshold: Optional[float]  # fitted on the other seeds (on the score as read)
    auc: Optional[float]  # on the held-out seed, the score as read
    rates: Optional[Rates]  # of the fitted threshold on the held-out seed
    positives: int
    negatives: int


def _flip(samples: list[Sample]) -> list[Sample]:
    return [Sample(s.run, s.seed, s.step, -s.score, s.label) for s in samples]


def leave_one_seed_out(samples: list[Sample]) -> list[Fold]:
    """Per held-out seed: the direction (the indicator's own, or reversed when the other seeds'
    AUC is below 0.5) and the threshold fitted on the other seeds, judged on the held-out one."""
    folds = []
    for seed in sorted({s.seed for s in samples}):
        train = [s for s in samples if s.seed != seed]
        test = [s for s in samples if s.seed == seed]
        train_auc = auc(train)
        flipped = train_auc is not None and train_auc < 0.5
        if flipped:
            train, test = _flip(train), _flip(test)
        thr = youden_threshold(train)
        pos = sum(s.label for s in test)
        folds.append(Fold(seed, flipped, thr, auc(test), rates(test, thr) if thr is not None else None, pos,
                          len(test) - pos))
    return folds


# A rule is usable when, on every held-out seed, the indicator ranks the steps before a fall
# above the others (AUC >= 0.75) and the threshold fitted on the other seeds catches at least half
# of the held-out seed's pre-fall steps with at most a fifth of its other steps alarmed.
USABLE_AUC, USABLE_TPR, USABLE_FPR = 0.75, 0.5, 0.2


def usable(folds: list[Fold]) -> bool:
    return bool(folds) and all(
        f.auc is not None and f.auc >= USABLE_AUC and f.rates is not None and f.rates.tpr >= USABLE_TPR
        and f.rates.fpr <= USABLE_FPR for f in folds)


def load_record(dirs: Sequence[str | Path]) -> dict[str, list[dict[str, Any]]]:
    """``{cell: rows}`` of every ``<dir>/runs/<cell>/metrics.jsonl``; a cell in two records with
    different rows is an error (the same cell must be one run)."""
    from ..trainer.metrics.logger import read_metrics

    record: dict[str, list[dict[str, Any]]] = {}
    for d in dirs:
        runs = Path(d) / "runs"
        if not runs.is_dir():
            raise FileNotFoundError(f"no record at {runs}")
        for cell_dir in sorted(p for p in runs.iterdir() if p.is_dir()):
            rows = read_metrics(cell_dir)
            if cell_dir.name in record and record[cell_dir.name] != rows:
                raise ValueError(f"{cell_dir.name} is in two records with different numbers")
            record[cell_dir.name] = rows
    return record
