"""RL wall time per step in each rollout mode (sync, one_step_off, async) at the same
trajectories per step, with validation EM after the last step (and every ``--val-every`` steps).

    python benchmarks/bench_rollout_modes.py --data runs/tiny [--policy runs/tiny_search/so_grpo/sft_model]
        [--steps 4] [--rounds 1] [--modes sync,one_step_off,async] [--seeds 1234,1]
        [--val-every 4] [--out DIR] [key=value ...]

Each run is the CLI (``python -m sorl_megatron.train``) on the CPU demo's recipe
(``recipes/tiny_search_so_grpo.yaml``: 8 prompts x 8 samples = 64 trajectories per step,
three turns of 32 tokens) from ``--policy`` (the demo's SFT policy, after ``make demo``; default
the random model of ``--data``, whose EM is 0), with its own embedded rollout and retrieval
servers, no checkpoints and one validation at the end. The modes run in alternation, in a
rotated order each round (benchmarks/common.py), so a change of the machine's load hits them
alike. Reported per mode: the median over rounds of the mean ``time/step_wall`` of steps 2..N
(step 1 of one_step_off and async has no batch made ahead), of ``time/trainer_idle`` and
``time/server_idle``, the ratio of step time to sync's (of the medians, and the median of the
per-round ratios), and the last validation EM (mean over runs). With ``--seeds`` each round runs
every mode at each seed (``schedule.seed``); ``--out`` keeps the runs' logs (metrics.jsonl,
episodes.jsonl) and each run's validation EM curve is printed.
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


def run_mode(
    mode: str, data: Path, policy: Path, steps: int, out: Path, name: str, seed: int, val_every: int, extra: list[str]
) -> dict:
    args = [
        sys.executable, "-m", "sorl_megatron.train", "--config", str(ROOT / "recipes" / "tiny_search_so_grpo.yaml"),
        f"model.path={policy}", f"retrieval.corpus={data}/corpus.jsonl", f"data.train={data}/train.parquet",
        f"data.val={data}/validation.parquet", "sft.enabled=false", f"schedule.total_steps={steps}",
        f"schedule.val_every={val_every}", f"schedule.seed={seed}", "checkpoint.save_every=0",
        "logging.progress=none", "logging.tensorboard=false",
        f"logging.dir={out}", f"logging.run_name={name}", f"checkpoint.dir={out / name / 'ckpt'}",
        f"rollout.mode={mode}", "algorithm.loss.is_correction.mode=tis", *extra,
    ]
    if (out / name).exists():  # a finished run would resume, exit at once and be read back as new
        raise SystemExit(f"{out / name} exists: give --out a fresh directory (or remove that run)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = {r["step"]: r for r in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines())}
    later = [rows[s] for s in range(2, steps + 1)]

    def mean(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in later)

    return {
        "step_s": mean("time/step_wall"), "trainer_idle_s": mean("time/trainer_idle"),
        "server_idle_s": mean("time/server_idle"), "lag_mean": mean("rollout/version_lag_mean"),
        "em": rows[steps].get("val/em"), "em_start": rows[0].get("val/em"), "process_s": wall,
        "em_curve": {s: r["val/em"] for s, r in sorted(rows.items()) if r.get("val/em") is not None},
        "groups_dropped_stale": sum(r.get("rollout/groups_dropped_stale", 0) for r in later),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="runs/tiny", help="the demo's data (tools/demo.py generates it)")
    ap.add_argument("--policy", default=None, help="policy to start from (default: <data>/model)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--modes", default="sync,one_step_off,async")
    ap.add_argument("--round-offset", type=int, default=0, help="first round's rotation (to continue a series)")
    ap.add_argument("--seeds", default="1234", help="comma-separated schedule.seed values, each run in every mode")
    ap.add_argument("--val-every", type=int, default=0, help="validate every N steps too (0: after the last step only)")
    ap.add_argument("--out", default=None, help="keep the runs' logs here (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="recipe overrides for every run")
    args = ap.parse_args()
    data = Path(args.data).resolve()
    if not (data / "model" / "config.json").is_file():
        from sorl_megatron.data.synthetic import main as make_data

        make_data(["--out", str(data), "--make-model", "--hidden-size", "128", "--tie-embeddings"])
    policy = Path(args.policy).resolve() if args.policy else data / "model"
    modes = args.modes.split(",")
    print(f"start: {load()}; policy {policy}; {args.steps} steps x {args.rounds} round(s)", flush=True)
    results: dict[str, list[dict]] = {m: [] for m in modes}
    seeds = [int(x) for x in args.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_modes_") as tmp:
        out = Path(args.out).resolve() if args.out else Path(tmp)
        for r in range(args.round_offset, args.round_offset + args.rounds):
            order = modes[r % len(modes):] + modes[: r % len(modes)]
            for seed in seeds:
                for mode in order:
                    name = f"{mode}_r{r}_s{seed}"
                    res = run_mode(mode, data, policy, args.steps, out, name, seed, args.val_every, args.overrides)
                    results[mode].append(res)
                    curve = " ".join(f"{s}:{em:.4f}" for s, em in res["em_curve"].items())
                    print(f"round {r} seed {seed} {mode:13s} step {res['step_s']:6.1f}s  "
                          f"trainer idle {res['trainer_idle_s']:5.1f}s  server idle {res['server_idle_s']:5.1f}s  "
                          f"lag {res['lag_mean']:.2f}  stale groups dropped {res['groups_dropped_stale']}  "
                          f"EM {curve}  ({res['process_s']:.0f}s in all; {load()})", flush=True)
    base = statistics.median(x["step_s"] for x in results[modes[0]])
    print(f"\nend: {load()}")
    print(f"{'mode':13s} {'step (s)':>9s} {'vs ' + modes[0]:>10s} {'per round':>10s} {'trainer idle':>13s} "
          f"{'server idle':>12s} {'lag':>5s} {'val EM':>7s}")
    for mode, rs in results.items():
        step = statistics.median(x["step_s"] for x in rs)
        per_round = statistics.median(x["step_s"] / b["step_s"] for x, b in zip(rs, results[modes[0]]))
        ems = [x["em"] for x in rs if x["em"] is not None]
        print(f"{mode:13s} {step:9.1f} {step / base:9.2f}x {per_round:9.2f}x "
              f"{statistics.median(x['trainer_idle_s'] for x in rs):13.1f} "
              f"{statistics.median(x['server_idle_s'] for x in rs):12.1f} "
              f"{statistics.median(x['lag_mean'] for x in rs):5.2f} "
              f"{(statistics.mean(ems) if ems else float('nan')):7.3f}")


if __name__ == "__main__":
    main()
