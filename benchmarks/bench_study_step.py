"""Seconds per RL step of one stability-study cell, this tree against another checkout (an older
commit), run in alternation; and whether the two produced the same run.

    python benchmarks/bench_study_step.py --old-src /tmp/old_checkout [--data runs/tiny]
        [--policy runs/tiny_search/so_grpo/sft_model] [--study recipes/study/tiny_stability.yaml]
        [--loss so_grpo] [--stress low] [--seed 1] [--steps 4] [--rounds 3] [key=value ...]

Each run is the study's own command for the cell (``sorl_megatron.study.runner.cell_overrides`` on
``--study``, by default ``recipes/study/tiny_stability.yaml``; round two's grids, e.g.
``recipes/study/round2_replay.yaml`` with ``--loss grpo --stress control``, work the same way:
the demo's recipe from ``--policy`` with the loss's, the stress level's and the study's
overrides, one torch thread as the study gives each of its two cells), cut to ``--steps`` RL
steps, with the CLI ``python -m sorl_megatron.train`` of each tree (``PYTHONPATH`` its root).
The two trees run in alternation (old first in even rounds, new first in odd ones), so a change
of the machine's load hits both alike; reported per tree: the median over rounds of the mean
``time/step_wall`` (rollout + log-probs + update + weight sync of a step), of each of those
phases, of the process's wall time per step (with start-up, validations and checkpoints) and
of its CPU time per step (the trainer's and its servers' user + system seconds: on a loaded
machine less noisy than wall time), the per-round ratios old / new, the load average, and
whether every non-timing metric (rewards, lengths, losses, validation EM) of each step is the
same in both trees, i.e. whether the change left the run's numbers alone, and if not, how far apart
and from which step (metrics only one tree writes, e.g. an indicator added since the old commit,
are named and not compared); each tree's rounds are also compared with each other, which must be
exact (the run is deterministic).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STUDY = ROOT / "recipes" / "study" / "tiny_stability.yaml"


def cell_command(src: Path, data: Path, policy: Path, out: Path, args: argparse.Namespace,
                 without: tuple[str, ...] = ()) -> tuple[list[str], Path]:
    """The study's command line for the cell (run from ``src``) and its run directory; overrides of the
    keys in ``without`` are left out (keys a tree older than them does not know)."""
    from sorl_megatron.study.runner import Cell, cell_overrides, load_study

    study = load_study(Path(args.study), [f"data={data}", f"start_policy={policy}"])
    cell = Cell(args.loss, args.stress, args.seed)
    overrides = [*cell_overrides(study, cell, out), "checkpoint.resume=none", f"schedule.total_steps={args.steps}",
                 *args.overrides]
    overrides = [o for o in overrides if o.split("=", 1)[0] not in without]
    recipe = src / "recipes" / "tiny_search_so_grpo.yaml"  # each tree runs its own recipe
    return [sys.executable, "-m", "sorl_megatron.train", "--config", str(recipe), *overrides], out / "runs" / cell.name


PHASES = ("rollout", "old_logprobs", "actor_update", "weight_sync")


def children_cpu() -> float:
    """CPU seconds (user + system) of the finished child processes of this one, theirs included."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(src: Path, cmd: list[str], run_dir: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{src / 'kernels'}", OMP_NUM_THREADS="1")
    t0, c0 = time.perf_counter(), children_cpu()
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, children_cpu() - c0
    if proc.returncode != 0:
        raise RuntimeError(f"{src} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0 and "time/step_wall" in r]
    numbers = [{k: v for k, v in r.items() if not k.startswith("time") and k != "time"} for r in rows]
    out = {"step_s": statistics.mean(r["time/step_wall"] for r in steps), "process_s": wall / len(steps),
           "cpu_s": cpu / len(steps), "numbers": numbers}
    out.update({f"{p}_s": statistics.mean(r.get(f"time/{p}", 0.0) for r in steps) for p in PHASES})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-src", required=True, help="root of the checkout to compare with (e.g. a git worktree)")
    ap.add_argument("--data", default="runs/tiny", help="the demo's data (tools/demo.py generates it)")
    ap.add_argument("--policy", default=None, help="policy to start from (default: <data>/model)")
    ap.add_argument("--study", default=str(STUDY), help="the study whose cell runs (its losses and stress levels)")
    ap.add_argument("--loss", default="so_grpo")
    ap.add_argument("--stress", default="low")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old-without", action="append", default=[], metavar="KEY",
                    help="leave this key's overrides out of the old tree's command: a key added since that commit, "
                         "whose value here must be what the old tree did (e.g. model.local_attention, whose "
                         "'unfused' every tree before it ran); repeatable")
    ap.add_argument("overrides", nargs="*", help="recipe overrides for every run")
    args = ap.parse_args()
    data = Path(args.data).resolve()
    policy = Path(args.policy).resolve() if args.policy else data / "model"
    trees = {"old": Path(args.old_src).resolve(), "new": ROOT}
    print(f"start: {load()}; policy {policy}; cell {args.loss}/{args.stress}/s{args.seed}, {args.steps} steps x "
          f"{args.rounds} rounds" + (f"; left out of the old tree's command: {', '.join(args.old_without)}"
                                     if args.old_without else ""), flush=True)
    results: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="bench_study_step_") as tmp:
        for r in range(args.rounds):
            for name in list(trees) if r % 2 == 0 else list(reversed(trees)):
                out = Path(tmp) / f"{name}_r{r}"
                without = tuple(args.old_without) if name == "old" else ()
                cmd, run_dir = cell_command(trees[name], data, policy, out, args, without)
                res = run(trees[name], cmd, run_dir)
                results[name].append(res)
                print(f"round {r} {name}: step {res['step_s']:6.1f}s ("
                      + ", ".join(f"{p} {res[f'{p}_s']:.1f}s" for p in PHASES)
                      + f")  process {res['process_s']:6.1f}s, CPU {res['cpu_s']:6.1f}s per step  ({load()})",
                      flush=True)
    print(f"\nend: {load()}")
    keys = ("step_s", *(f"{p}_s" for p in PHASES), "process_s", "cpu_s")
    print("medians over rounds, seconds per RL step (process: wall time of the whole run; cpu: its CPU time, "
          "servers included)")
    print(f"{'tree':5s} " + " ".join(f"{k[:-2]:>13s}" for k in keys))
    for name, rs in results.items():
        print(f"{name:5s} " + " ".join(f"{statistics.median(x[k] for x in rs):13.2f}" for k in keys))
    for key in keys:
        ratios = [o[key] / n[key] for o, n in zip(results["old"], results["new"])]
        print(f"old / new {key:10s}: median {statistics.median(ratios):.2f}x  per round "
              + " ".join(f"{x:.2f}x" for x in ratios))
    # metrics one tree writes and the other does not (an indicator added since) are named, not compared
    runs = {name: [x["numbers"] for x in rs] for name, rs in results.items()}
    ref = runs["old"][0]
    only = sorted({k for rs in runs.values() for run in rs for a, b in zip(ref, run) for k in set(a) ^ set(b)})
    for name, rs in runs.items():  # a tree against itself: the run is deterministic, so this must be exact
        print(f"{name} against itself, every round: {describe(compare(rs[0], rs[1:]))}")
    print(f"old against new: {describe(compare(ref, runs['new']))}")
    if only:
        print("written by one tree only (not compared): " + ", ".join(only))


def compare(ref: list[dict], others: list[list[dict]]) -> dict[str, tuple[float, int]] | None:
    """Per metric both runs write that differs somewhere: (largest relative difference, first step it
    differs at); None when a run has another number of rows."""
    if any(len(run) != len(ref) for run in others):
        return None
    worst: dict[str, tuple[float, int]] = {}
    for run in others:
        for a, b in zip(ref, run):
            for k in (set(a) & set(b)) - {"step"}:
                if a[k] == b[k]:
                    continue
                numeric = all(isinstance(v, (int, float)) for v in (a[k], b[k]))
                rel = abs(a[k] - b[k]) / max(abs(a[k]), abs(b[k]), 1e-30) if numeric else float("inf")
                largest, first = worst.get(k, (0.0, a.get("step", 0)))
                worst[k] = (max(largest, rel), min(first, a.get("step", 0)))
    return worst


def describe(worst: dict[str, tuple[float, int]] | None) -> str:
    """One line: identical, or how far apart and from where (a changed float sum, e.g. the first
    mini-batch's old log-probs from its own forward on a machine whose results depend on the batch,
    differs in the last bits first and then grows over the steps)."""
    if worst is None:
        return "DIFFERENT number of rows"
    if not worst:
        return "every non-timing metric of every step identical"
    top = sorted(worst.items(), key=lambda kv: -kv[1][0])
    first = min(step for _, step in worst.values())
    return (f"{len(worst)} metrics differ, first at step {first}, largest relative difference {top[0][1][0]:.2g}: "
            + "; ".join(f"{k} {rel:.2g} (from step {step})" for k, (rel, step) in top[:8]))


if __name__ == "__main__":
    main()
