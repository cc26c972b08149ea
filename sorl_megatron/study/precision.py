"""The precision stress's report (results/study/round3/PREREGISTRATION-bf16.md): each bf16 run's
train/inference mismatch and outcomes beside its fp32 counterpart of the same seed, and the
pre-registered predictions P1-P4 checked.

    python -m sorl_megatron.study.precision --record results/study/round3_bf16 \\
        --record results/study/round2 --out results/study/round3/bf16.md
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any, Optional

from .confirm import run_outcomes
from .indicators import load_record, series

# bf16 stress -> its fp32 counterpart in round two's record
COUNTERPART = {"bf16": "control", "bf16_lag2": "lag2"}
LOSSES = ("grpo", "grpo_r3")
SEEDS = (1, 2, 3)
KL, FLIP = "mismatch/kl_k3", "mismatch/route_flip_rate"
# the pre-registered thresholds
NATURAL_MIN, INJECTED_MAX = 1e-6, 0.01


def _median(rows: list[dict[str, Any]], key: str) -> float:
    values = list(series(rows, key).values())
    return statistics.median(values) if values else math.nan


def run_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """One run: the medians over its steps of the mismatch KL and the route-flip rate (NaN where
    not logged), and its outcomes (``confirm.run_outcomes``)."""
    return {"kl": _median(rows, KL), "flip": _median(rows, FLIP), **run_outcomes(rows)}


def predictions(runs: dict[str, dict[str, float]]) -> list[tuple[str, bool, str]]:
    """``(name, held, evidence)`` for P1-P4 over the ``bf16`` cells of ``runs`` (cell -> summary)."""
    def at(loss: str, seed: int) -> dict[str, float]:
        return runs[f"{loss}__bf16__s{seed}"]

    kl = {(loss, s): at(loss, s)["kl"] for loss in LOSSES for s in SEEDS}
    p1 = all(kl["grpo", s] > NATURAL_MIN for s in SEEDS)
    p2 = all(NATURAL_MIN < kl["grpo_r3", s] < kl["grpo", s] for s in SEEDS)
    p3 = all(at("grpo_r3", s)["flip"] > 0 for s in SEEDS)
    p4 = all(v < INJECTED_MAX for v in kl.values())
    shown = ", ".join(f"{loss} s{s} {kl[loss, s]:.3g}" for loss in LOSSES for s in SEEDS)
    flips = ", ".join(f"s{s} {at('grpo_r3', s)['flip']:.3g}" for s in SEEDS)
    return [("P1: grpo's median KL at bf16 > 1e-6 in each seed", p1, shown),
            ("P2: grpo_r3's median KL below grpo's in each pair, and > 1e-6", p2, shown),
            ("P3: grpo_r3's median route-flip rate at bf16 > 0 in each seed", p3, flips),
            ("P4: every median KL at bf16 < 0.01", p4, shown)]


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3g}"


def report(record: dict[str, list[dict[str, Any]]]) -> list[str]:
    runs = {name: run_summary(rows) for name, rows in record.items()}
    lines = ["| cell | median KL | median route flips | fell | irreversible | final EM | EM area | fp32 counterpart: "
             "median KL, fell, final EM |", "|---|---|---|---|---|---|---|---|"]
    for stress, fp32 in COUNTERPART.items():
        for loss in LOSSES:
            for seed in SEEDS:
                name = f"{loss}__{stress}__s{seed}"
                if name not in runs:
                    lines.append(f"| {name} | not run | | | | | | |")
                    continue
                r = runs[name]
                base: Optional[dict[str, float]] = runs.get(f"{loss}__{fp32}__s{seed}")
                other = (f"{_fmt(base['kl'])}, {int(base['fell'])}, {base['final_em']:.4g}" if base
                         else "not in the record")
                lines.append(f"| {name} | {_fmt(r['kl'])} | {_fmt(r['flip'])} | {int(r['fell'])} | "
                             f"{int(r['irreversible'])} | {r['final_em']:.4g} | {r['em_area']:.4g} | {other} |")
    if all(f"{loss}__bf16__s{s}" in runs for loss in LOSSES for s in SEEDS):
        lines += ["", "| prediction | held | medians |", "|---|---|---|"]
        lines += [f"| {name} | {'yes' if held else 'no'} | {evidence} |" for name, held, evidence in predictions(runs)]
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", action="append", required=True, help="a record directory (its runs/); repeatable")
    ap.add_argument("--out", help="write the table here too")
    args = ap.parse_args(argv)
    text = "\n".join(report(load_record(args.record))) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
