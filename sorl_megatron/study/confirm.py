"""Round three's confirmation analysis (results/study/round3/PREREGISTRATION.md): from a run record
(``{cell name: metrics rows}``, the study's ``--export`` record) to the table the
pre-registration fixes, with nothing chosen after the runs.

    python -m sorl_megatron.study.confirm --record results/study/round2 --record results/study/round2_mechanism \
        --record results/study/round3 --out results/study/round3/confirmation.md

Per run (:func:`run_outcomes`), from its validation EM alone:

- **fell**: some validation after step 0 is below ``COLLAPSE_FRACTION`` x the best validation EM
  before it (that best >= 0.05): the study's collapse rule (``indicators.collapse_step``);
- **irreversible collapse**: the run is down at its final validation: the final EM is below
  ``COLLAPSE_FRACTION`` x the best validation EM before it (that best >= 0.05);
- **transient dip**: it fell and is not down at its final validation;
- **final EM**: the EM of the last validation; **EM area**: the mean EM over the run (trapezoids
  over the validation steps, ``runner.cell_statistics``'s ``em_auc``).

Per comparison (an arm against its baseline at one stress level, paired by seed), per outcome
(:func:`paired_test`): the mean paired difference (arm - baseline; for a 0/1 outcome the
difference of the two rates), its standardized size ``d_z`` (mean / sd of the differences), the
exact two-sided sign-flip permutation p-value over the seeds, a 95% percentile bootstrap interval
over seeds (``BOOTSTRAP`` resamples of the pairs, seeded: the same record gives the same table),
and Holm's adjustment within each question's family. The verdict of the primary outcome
(:func:`verdict`) is the pre-registration's rule.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from .indicators import collapse_step, load_record
from .indicators import series as metric_series

COLLAPSE_FRACTION = 0.5  # the study's collapse_fraction (every round-two grid's)
MIN_BEST = 0.05  # a best EM below this cannot fall (indicators.collapse_step's)
ALPHA = 0.05  # two-sided, after Holm's adjustment within a question
BOOTSTRAP = 10_000
BOOTSTRAP_SEED = 20261207
MAX_EXACT_PAIRS = 22  # 2^22 sign patterns; the design has 16 pairs
COMMITTED_SEEDS = (1, 2, 3)  # the seeds round two ran: the confirmation also reads the new ones alone
SEEDS = tuple(range(1, 17))  # the pre-registered seeds: 1-3 committed, 4-16 new
OUTCOMES = ("fell", "irreversible", "transient", "final_em", "em_area")  # "fell" is the primary
BINARY = {"fell", "irreversible", "transient"}


@dataclass(frozen=True)
class Comparison:
    """``arm`` against ``baseline`` (loss names of the grid) at ``stress``; ``question`` is Holm's
    family; ``expected`` is the sign of the arm-minus-baseline difference in the primary outcome
    (``fell``) that the pattern under test predicts (+1: the arm falls more often)."""

    question: str
    arm: str
    baseline: str
    stress: str
    expected: int
    steps: int  # the runs' last step (a shorter run is incomplete)

    @property
    def name(self) -> str:
        return f"{self.arm} vs {self.baseline} at {self.stress}"


# The pre-registered comparisons (PREREGISTRATION.md, "Questions")
COMPARISONS: tuple[Comparison, ...] = (
    Comparison("Q1", "turn_ppo", "ppo", "mid", +1, 12),
    Comparison("Q1", "turn_ppo", "ppo", "route_lag2", +1, 60),
    Comparison("Q2", "grpo_tis", "grpo", "route_lag2", -1, 60),
    Comparison("Q2", "grpo_mis", "grpo", "route_lag2", -1, 60),
    Comparison("Q2", "sapo", "grpo", "route_lag2", -1, 60),
    Comparison("Q2", "so_grpo_relative", "grpo", "route_lag2", -1, 60),
)


def run_outcomes(rows: list[dict[str, Any]], collapse_fraction: float = COLLAPSE_FRACTION) -> dict[str, float]:
    """The outcomes of one run (the module doc), as floats (0/1 for the binary ones), with
    ``fell_at`` (the first validation step that fell, or NaN) and ``last_val`` (its last
    validation step)."""
    em = sorted(metric_series(rows, "val/em").items())
    if len(em) < 2:
        raise ValueError("a run needs validations at step 0 and after it")
    steps, values = zip(*em)
    fell_at = collapse_step(rows, collapse_fraction)
    best_before_last = max(values[:-1])
    down_at_end = best_before_last >= MIN_BEST and values[-1] < collapse_fraction * best_before_last
    span = steps[-1] - steps[0]
    area = sum((steps[i + 1] - steps[i]) * (values[i] + values[i + 1]) / 2 for i in range(len(em) - 1)) / span
    fell = fell_at is not None
    return {"fell": float(fell), "irreversible": float(down_at_end), "transient": float(fell and not down_at_end),
            "final_em": float(values[-1]), "em_area": float(area),
            "fell_at": float(fell_at) if fell else math.nan, "last_val": float(steps[-1])}


@dataclass(frozen=True)
class PairedTest:
    n: int
    arm_mean: float
    base_mean: float
    diff: float  # mean of arm - baseline over the pairs
    d_z: float  # diff / sd of the differences (nan when they do not vary)
    p: float  # exact two-sided sign-flip permutation p
    ci: tuple[float, float]  # 95% percentile bootstrap interval of diff


def sign_flip_p(diffs: Sequence[float]) -> float:
    """Exact two-sided p of the paired sign-flip permutation test of mean ``diffs`` = 0: the share
    of the 2^k sign patterns of the k nonzero differences whose |sum| is at least the observed."""
    nonzero = [d for d in diffs if d != 0]
    if not nonzero:
        return 1.0
    if len(nonzero) > MAX_EXACT_PAIRS:
        raise ValueError(f"{len(nonzero)} nonzero pairs: the exact test enumerates at most 2^{MAX_EXACT_PAIRS}")
    observed = abs(sum(nonzero)) - 1e-9 * max(1.0, sum(abs(d) for d in nonzero))
    hits = sum(1 for signs in itertools.product((1, -1), repeat=len(nonzero))
               if abs(sum(s * d for s, d in zip(signs, nonzero))) >= observed)
    return hits / 2 ** len(nonzero)


def bootstrap_ci(diffs: Sequence[float], resamples: int = BOOTSTRAP, seed: int = BOOTSTRAP_SEED,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the mean of ``diffs`` over ``resamples`` resamples of the pairs."""
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    lo = means[int(math.floor(tail * (resamples - 1)))]
    hi = means[int(math.ceil((1 - tail) * (resamples - 1)))]
    return lo, hi


def paired_test(arm: Sequence[float], base: Sequence[float]) -> PairedTest:
    if len(arm) != len(base) or not arm:
        raise ValueError("paired_test needs two equally long, non-empty lists (one value per seed)")
    diffs = [a - b for a, b in zip(arm, base)]
    diff = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if len(diffs) > 1 else math.nan
    d_z = diff / sd if sd and math.isfinite(sd) else math.nan
    return PairedTest(len(diffs), statistics.fmean(arm), statistics.fmean(base), diff, d_z, sign_flip_p(diffs),
                      bootstrap_ci(diffs))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted = [0.0] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


@dataclass
class ComparisonResult:
    comparison: Comparison
    seeds: list[int]  # the pairs analysed
    missing: list[str]  # cells absent or incomplete (their pairs are left out and named)
    tests: dict[str, PairedTest]  # outcome -> test over all pairs
    new_only: dict[str, PairedTest]  # outcome -> test over the pairs of the new seeds alone
    holm_p: dict[str, float]  # outcome -> Holm-adjusted p within the question


def _cell(loss: str, stress: str, seed: int) -> str:
    return f"{loss}__{stress}__s{seed}"


def compare(record: dict[str, list[dict[str, Any]]], comparisons: Sequence[Comparison] = COMPARISONS,
            seeds: Sequence[int] = SEEDS, committed: Sequence[int] = COMMITTED_SEEDS) -> list[ComparisonResult]:
    """Every comparison over the seeds whose two cells are in ``record`` and complete (their last
    validation at the comparison's ``steps``); Holm within each question, per outcome."""
    results = []
    for comp in comparisons:
        used, missing, arm_out, base_out = [], [], [], []
        for seed in seeds:
            names = [_cell(loss, comp.stress, seed) for loss in (comp.arm, comp.baseline)]
            outs = []
            for name in names:
                rows = record.get(name)
                out = run_outcomes(rows) if rows else None
                if out is None or out["last_val"] != comp.steps:
                    missing.append(name if out is None else f"{name} (last validation {out['last_val']:g})")
                outs.append(out)
            if all(o is not None and o["last_val"] == comp.steps for o in outs):
                used.append(seed)
                arm_out.append(outs[0])
                base_out.append(outs[1])
        tests, new_only = {}, {}
        if used:
            for outcome in OUTCOMES:
                tests[outcome] = paired_test([o[outcome] for o in arm_out], [o[outcome] for o in base_out])
                new = [i for i, s in enumerate(used) if s not in committed]
                if new:
                    new_only[outcome] = paired_test([arm_out[i][outcome] for i in new],
                                                    [base_out[i][outcome] for i in new])
        results.append(ComparisonResult(comp, used, missing, tests, new_only, {}))
    for question in sorted({r.comparison.question for r in results}):
        family = [r for r in results if r.comparison.question == question and r.tests]
        for outcome in OUTCOMES:
            for r, p in zip(family, holm([r.tests[outcome].p for r in family])):
                r.holm_p[outcome] = p
    return results


def verdict(result: ComparisonResult, alpha: float = ALPHA, outcome: str = "fell") -> str:
    """The pre-registered reading of one comparison's ``outcome`` (PREREGISTRATION.md, "What each
    outcome means"): ``confirmed`` (Holm p < alpha, the predicted sign over all pairs and over the
    new seeds alone), ``opposite`` (Holm p < alpha, the other sign), ``not confirmed`` otherwise."""
    test = result.tests.get(outcome)
    if test is None:
        return "no pairs"
    sign = (test.diff > 0) - (test.diff < 0)
    if result.holm_p[outcome] >= alpha or sign == 0:
        return "not confirmed"
    if sign != result.comparison.expected:
        return "opposite"
    new = result.new_only.get(outcome)
    new_sign = 0 if new is None else (new.diff > 0) - (new.diff < 0)
    return "confirmed" if new_sign == result.comparison.expected else "not confirmed (new seeds alone disagree)"


def _fmt(x: float, digits: int = 3) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.{digits}f}"


def table(results: Sequence[ComparisonResult]) -> list[str]:
    """The confirmation's table (Markdown): a row per comparison and outcome."""
    lines = ["| question | comparison | outcome | pairs (seeds) | arm | baseline | difference [95% CI] | d_z "
             "| p (exact) | Holm p | new seeds alone: difference (pairs) | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if not r.tests:
            lines.append(f"| {r.comparison.question} | {r.comparison.name} | - | 0 | | | | | | | | no pairs |")
            continue
        seeds = _seed_ranges(r.seeds)
        for outcome in OUTCOMES:
            t = r.tests[outcome]
            new = r.new_only.get(outcome)
            lines.append(
                f"| {r.comparison.question} | {r.comparison.name} | {outcome} | {t.n} ({seeds}) | {_fmt(t.arm_mean)} "
                f"| {_fmt(t.base_mean)} | {t.diff:+.3f} [{t.ci[0]:+.3f}, {t.ci[1]:+.3f}] | {_fmt(t.d_z, 2)} "
                f"| {t.p:.4f} | {r.holm_p[outcome]:.4f} | "
                + (f"{new.diff:+.3f} ({new.n})" if new else "-") + " | "
                + (verdict(r, outcome=outcome) if outcome == "fell" else "(secondary)") + " |")
    return lines


def runs_table(record: dict[str, list[dict[str, Any]]], results: Sequence[ComparisonResult]) -> list[str]:
    """Every run the comparisons read, with its outcomes: the pre-registration reports every run."""
    names = sorted({_cell(loss, r.comparison.stress, s) for r in results for s in r.seeds
                    for loss in (r.comparison.arm, r.comparison.baseline)}, key=_cell_key)
    lines = ["| run | fell (step) | irreversible | transient | final EM | EM area |", "|---|---|---|---|---|---|"]
    for name in names:
        o = run_outcomes(record[name])
        fell = f"yes ({o['fell_at']:g})" if o["fell"] else "no"
        lines.append(f"| {name} | {fell} | {'yes' if o['irreversible'] else 'no'} | "
                     f"{'yes' if o['transient'] else 'no'} | {o['final_em']:.3f} | {o['em_area']:.3f} |")
    return lines


def _missing_summary(missing: Sequence[str]) -> str:
    """``loss__stress`` with the seed ranges whose cell is absent; incomplete cells by name."""
    absent: dict[str, set[int]] = {}
    incomplete = []
    for m in missing:
        if " " in m:
            incomplete.append(m)
            continue
        cell, _, seed = m.rpartition("__s")
        absent.setdefault(cell, set()).add(int(seed))
    parts = [f"{cell} seeds {_seed_ranges(sorted(seeds))}" for cell, seeds in sorted(absent.items())]
    return "; ".join(parts + sorted(set(incomplete)))


def _cell_key(name: str) -> tuple:
    loss, stress, seed = name.rsplit("__", 2)
    return stress, loss, int(seed[1:])


def _seed_ranges(seeds: Sequence[int]) -> str:
    out, run = [], []
    for s in sorted(seeds):
        if run and s != run[-1] + 1:
            out.append(run)
            run = []
        run.append(s)
    if run:
        out.append(run)
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)


def report(record: dict[str, list[dict[str, Any]]], seeds: Sequence[int] = SEEDS) -> list[str]:
    results = compare(record, seeds=seeds)
    lines = ["# Round three: the confirmation's table", "",
             "Computed by `python -m sorl_megatron.study.confirm` (sorl_megatron/study/confirm.py) as "
             "results/study/round3/PREREGISTRATION.md fixes it. Primary outcome: `fell`; the others are "
             "secondary. Differences are arm - baseline (a rate difference for yes/no outcomes).", ""]
    lines += table(results) + [""]
    missing = _missing_summary([m for r in results for m in r.missing])
    if missing:
        lines += [f"Pairs left out (a cell missing or incomplete): {missing}.", ""]
    lines += ["## Every run", ""] + runs_table(record, results) + [""]
    return lines


def _seeds_arg(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sorl_megatron.study.confirm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="append", required=True,
                        help="a study record directory (holding runs/<cell>/metrics.jsonl); repeat to merge")
    parser.add_argument("--seeds", default=f"{SEEDS[0]}-{SEEDS[-1]}", help="seeds to pair, e.g. 1-16 or 1,2,3")
    parser.add_argument("--out", default=None, help="write the Markdown here (default: print it)")
    args = parser.parse_args(argv)
    try:
        text = "\n".join(report(load_record(args.record), _seeds_arg(args.seeds)))
    except (FileNotFoundError, ValueError) as err:
        print(f"confirm: {err}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"[confirm] table: {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
