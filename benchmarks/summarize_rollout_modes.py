"""Validation EM of the rollout modes, paired by seed, from the runs ``bench_rollout_modes.py --out`` kept.

    python benchmarks/summarize_rollout_modes.py runs/bench_modes_async runs/bench_modes runs/bench_modes_s23 ...

Each directory holds runs named ``<mode>_r<round>_s<seed>`` (``metrics.jsonl``,
``episodes.jsonl``, ``config.yaml``); a mode and seed found twice is taken from the first
directory given (list re-runs first). Printed per mode, over the seeds every mode ran:
the final validation EM, the mean of the evaluations after step 0 and of the last three (the
final one alone moves by a question or two between neighbouring evaluations), each with its
difference from sync paired by seed (mean, per seed, and the paired t statistic), and
async's from one_step_off (the same one-version lag). For ``async``: how many groups were
trained at another step than the draw order would put them (its batches fill in the order
groups finish) and their mean turns, against the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path

RUN_NAME = re.compile(r"^(?P<mode>[a-z_]+)_r\d+_s(?P<seed>\d+)$")


def read_runs(dirs: list[Path]) -> dict[tuple[str, int], Path]:
    runs: dict[tuple[str, int], Path] = {}
    for d in dirs:
        for run in sorted(p for p in d.iterdir() if p.is_dir()):
            m = RUN_NAME.match(run.name)
            if m and (run / "metrics.jsonl").exists():
                key = (m["mode"], int(m["seed"]))
                if key in runs:
                    print(f"note: {run} skipped: {runs[key]} (listed first) is {key[0]} at seed {key[1]}")
                    continue
                runs[key] = run
    return runs


def val_em(run: Path) -> list[float]:
    with open(run / "metrics.jsonl") as f:
        return [row["val/em"] for row in map(json.loads, f) if "val/em" in row]


def groups_per_step(run: Path) -> int:
    """``schedule.batch_size`` of the run's resolved recipe (prompts, i.e. groups, per step)."""
    from omegaconf import OmegaConf

    return int(OmegaConf.load(run / "config.yaml").schedule.batch_size)


def out_of_order(run: Path) -> dict[str, list[float]]:
    """Mean turns per trained group: trained earlier, later, or at the step draw order gives it."""
    per_step = groups_per_step(run)
    turns: dict[str, list[float]] = {"earlier": [], "later": [], "in order": []}
    with open(run / "episodes.jsonl") as f:
        for g in map(json.loads, f):
            if g["status"] != "trained":  # a dropped group shifts draw order: this count is then approximate
                print(f"note: {run.name}: group {g['group']} {g['status']}")
                continue
            drawn_for = g["group"] // per_step + 1
            where = "earlier" if g["step"] < drawn_for else "later" if g["step"] > drawn_for else "in order"
            turns[where].append(statistics.mean(len(t) for t in g["turn_versions"]))
    return turns


def paired(diffs: list[float]) -> str:
    mean = statistics.mean(diffs)
    if len(diffs) < 2 or statistics.stdev(diffs) == 0:
        return f"{mean:+.4f}"
    t = mean / (statistics.stdev(diffs) / math.sqrt(len(diffs)))
    return f"{mean:+.4f} (t = {t:+.2f}, {len(diffs) - 1} df)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path)
    args = ap.parse_args()
    runs = read_runs(args.dirs)
    modes = [m for m in ("sync", "one_step_off", "async") if any(k[0] == m for k in runs)]
    seeds = sorted(s for s in {k[1] for k in runs} if all((m, s) in runs for m in modes))
    if "sync" not in modes or not seeds:
        raise SystemExit("need sync and the other modes at the same seeds")
    curves = {(m, s): val_em(runs[m, s]) for m in modes for s in seeds}
    for s in seeds:  # the same evaluation steps in every mode, step 0 first
        if len({len(curves[m, s]) for m in modes}) != 1 or len(curves["sync", s]) < 2:
            raise SystemExit(f"seed {s}: the modes' runs have different evaluations: "
                             + ", ".join(f"{m} {len(curves[m, s])}" for m in modes))
    print(f"seeds {seeds}; validation EM at each evaluation:")
    for s in seeds:
        for m in modes:
            print(f"  seed {s:5d} {m:13s} " + " ".join(f"{x:.4f}" for x in curves[m, s]))
    stats = {"final": lambda c: c[-1], "mean after step 0": lambda c: statistics.mean(c[1:]),
             "mean of last 3": lambda c: statistics.mean(c[-3:])}
    for name, stat in stats.items():
        print(f"\n{name}:")
        for m in modes:
            xs = [stat(curves[m, s]) for s in seeds]
            line = f"  {m:13s} mean {statistics.mean(xs):.4f} (std {statistics.stdev(xs) if len(xs) > 1 else 0:.4f})"
            if m != "sync":
                diffs = [stat(curves[m, s]) - stat(curves["sync", s]) for s in seeds]
                line += f"  minus sync {paired(diffs)}  per seed " + " ".join(f"{d:+.4f}" for d in diffs)
            print(line)
        if "async" in modes and "one_step_off" in modes:  # the same lag; batches differ by a few groups
            diffs = [stat(curves["async", s]) - stat(curves["one_step_off", s]) for s in seeds]
            print(f"  async minus one_step_off {paired(diffs)}, mean |difference| "
                  f"{statistics.mean(abs(d) for d in diffs):.4f}")
    if "async" in modes:
        print("\nasync batches (filled in finish order):")
        pooled: dict[str, list[float]] = {}
        for s in seeds:
            turns = out_of_order(runs["async", s])
            for k, v in turns.items():
                pooled.setdefault(k, []).extend(v)
            print(f"  seed {s:5d}: groups trained " + ", ".join(
                f"{k} {len(v)}" + (f" ({statistics.mean(v):.2f} turns)" if v else "") for k, v in turns.items()))
        print("  all seeds: mean turns per episode of the groups trained " + ", ".join(
            f"{k} {statistics.mean(v):.2f} ({len(v)} groups)" for k, v in pooled.items() if v))


if __name__ == "__main__":
    main()
