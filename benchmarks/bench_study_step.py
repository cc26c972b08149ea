"""Seconds per RL step of one stability-study cell, this tree against another checkout (an older
commit), run in alternation; and whether the two produced the same run.

    python benchmarks/bench_study_step.py --old-src /tmp/old_checkout [--data runs/tiny]
        [--policy runs/tiny_search/so_grpo/sft_model] [--loss so_grpo] [--stress low] [--seed 1]
        [--steps 4] [--rounds 3] [key=value ...]

Each run is the study's own command for the cell (``sorl_megatron.study.cell_overrides`` on
``recipes/study/tiny_stability.yaml``: the demo's recipe from ``--policy`` with the loss's and the
stress level's overrides, validation every 4 steps, one torch thread as the study gives each of
its two cells), cut to ``--steps`` RL steps, with the CLI ``python -m sorl_megatron.train`` of
each tree (``PYTHONPATH`` its root). The two trees run in alternation (old first in even rounds,
new first in odd ones), so a change of the machine's load hits both alike; reported per tree:
the median over rounds of the mean ``time/step_wall`` (rollout + log-probs + update + weight
sync of a step) and of the process's wall time per step (with start-up, validations and
checkpoints), the per-round ratios old / new, the load average, and whether every non-timing
metric (rewards, lengths, losses, validation EM) of each step is the same in both trees, i.e.
whether the change left the run's numbers alone.
"""

from __future__ import annotations

import argparse
import json
import os
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


def cell_command(src: Path, data: Path, policy: Path, out: Path, args: argparse.Namespace) -> tuple[list[str], Path]:
    """The study's command line for the cell (run from ``src``) and its run directory."""
    from sorl_megatron.study import Cell, cell_overrides, load_study

    study = load_study(STUDY, [f"data={data}", f"start_policy={policy}"])
    cell = Cell(args.loss, args.stress, args.seed)
    overrides = [*cell_overrides(study, cell, out), "checkpoint.resume=none", f"schedule.total_steps={args.steps}",
                 *args.overrides]
    recipe = src / "recipes" / "tiny_search_so_grpo.yaml"  # each tree runs its own recipe
    return [sys.executable, "-m", "sorl_megatron.train", "--config", str(recipe), *overrides], out / "runs" / cell.name


def run(src: Path, cmd: list[str], run_dir: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{src / 'kernels'}", OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{src} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0 and "time/step_wall" in r]
    numbers = [{k: v for k, v in r.items() if not k.startswith("time") and k != "time"} for r in rows]
    return {"step_s": statistics.mean(r["time/step_wall"] for r in steps), "process_s": wall / len(steps),
            "rollout_s": statistics.mean(r["time/rollout"] for r in steps), "numbers": numbers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-src", required=True, help="root of the checkout to compare with (e.g. a git worktree)")
    ap.add_argument("--data", default="runs/tiny", help="the demo's data (tools/demo.py generates it)")
    ap.add_argument("--policy", default=None, help="policy to start from (default: <data>/model)")
    ap.add_argument("--loss", default="so_grpo")
    ap.add_argument("--stress", default="low")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="recipe overrides for every run")
    args = ap.parse_args()
    data = Path(args.data).resolve()
    policy = Path(args.policy).resolve() if args.policy else data / "model"
    trees = {"old": Path(args.old_src).resolve(), "new": ROOT}
    print(f"start: {load()}; policy {policy}; cell {args.loss}/{args.stress}/s{args.seed}, {args.steps} steps x "
          f"{args.rounds} rounds", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="bench_study_step_") as tmp:
        for r in range(args.rounds):
            for name in list(trees) if r % 2 == 0 else list(reversed(trees)):
                out = Path(tmp) / f"{name}_r{r}"
                cmd, run_dir = cell_command(trees[name], data, policy, out, args)
                res = run(trees[name], cmd, run_dir)
                results[name].append(res)
                print(f"round {r} {name}: step {res['step_s']:6.1f}s (rollout {res['rollout_s']:5.1f}s)  "
                      f"process {res['process_s']:6.1f}s per step  ({load()})", flush=True)
    print(f"\nend: {load()}")
    print(f"{'tree':5s} {'step (s)':>9s} {'rollout (s)':>12s} {'process/step (s)':>17s}")
    for name, rs in results.items():
        med = {key: statistics.median(x[key] for x in rs) for key in ("step_s", "rollout_s", "process_s")}
        print(f"{name:5s} {med['step_s']:9.1f} {med['rollout_s']:12.1f} {med['process_s']:17.1f}")
    for key in ("step_s", "rollout_s", "process_s"):
        ratios = [o[key] / n[key] for o, n in zip(results["old"], results["new"])]
        print(f"old / new {key:10s}: median {statistics.median(ratios):.2f}x  per round "
              + " ".join(f"{x:.2f}x" for x in ratios))
    same = all(x["numbers"] == results["old"][0]["numbers"] for rs in results.values() for x in rs)
    print(f"every non-timing metric of every step identical in all runs (old and new): {same}")


if __name__ == "__main__":
    main()
