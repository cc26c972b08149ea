"""A recipe's distributed weight sync at full size, without its memory: ``weight_sync.plan`` at
the recipe's model, layout and world.

``python -m sorl_megatron.trainer.recipe.sync_plan RECIPE [RECIPE ...] [--json OUT]`` prints, per
recipe, the weight-update groups and, per sending rank, the tensors, buckets and bytes of one
sync (``--json``: every sender's stream of ``(HF name, shape, dtype)`` with its bucket ends).
The model's ``config.json`` is the memory plan's (``model.path``, else ``model.config_for_planning``),
the world ``parallelism.planned_world_size`` (else the smallest the layout needs), the weight
format block-FP8 for ``rollout.precision: fp8`` (the servers then run from an FP8 checkpoint),
the bucket ``rollout.weight_sync.bucket_mb``. The plan is of the distributed transport, whatever
the recipe's transport is.

The planner plays every rank under torch's fake process-group backend, so it runs in a process of
its own (:func:`plan_recipes` starts one for all the recipes it is given).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

from ...weight_sync.plan import SyncPlan, summary
from .config import RecipeError, TrainConfig
from .loader import load_recipe
from .memory_plan import model_config_for


def layout_text(cfg: TrainConfig) -> str:
    """The recipe's layout as ``ParallelLayout.from_string`` reads it."""
    p = cfg.parallelism
    items = [f"tp={p.tp}", f"pp={p.pp}", f"vpp={p.vpp}", f"ep={p.ep}", f"etp={p.expert_tp}", f"cp={p.cp}",
             f"sp={int(p.use_sequence_parallel)}"]
    items += [f"{k}={v}" for k, v in (("first_stage_layers", p.first_stage_layers),
                                      ("last_stage_layers", p.last_stage_layers)) if v is not None]
    return ",".join(items)


def planned_world(cfg: TrainConfig) -> int:
    p = cfg.parallelism
    mp, expert_mp = p.tp * p.pp * p.cp, p.expert_tp * p.ep * p.pp
    return p.planned_world_size or mp * expert_mp // math.gcd(mp, expert_mp)


def plan_job(cfg: TrainConfig) -> dict:
    """The planner's arguments for ``cfg`` (``weight_sync.plan --jobs``)."""
    _, _, source = model_config_for(cfg)
    return {"config": source.split("=", 1)[1], "layout": layout_text(cfg), "world": planned_world(cfg),
            "format": "block_fp8" if cfg.rollout.precision == "fp8" else "bf16",
            "bucket_mb": cfg.rollout.weight_sync.bucket_mb}


def plan_configs(cfgs: Sequence[TrainConfig], timeout_s: float = 3600.0) -> list[SyncPlan]:
    """Each recipe's plan (``--print-memory`` can print :func:`weight_sync.plan.summary` of it),
    from one planner process; recipes sharing a model, layout and format share a plan."""
    jobs: list[dict] = []
    index = []
    for cfg in cfgs:
        job = plan_job(cfg)
        if job not in jobs:
            jobs.append(job)
        index.append(jobs.index(job))
    with tempfile.TemporaryDirectory(prefix="sync_plan_") as tmp:
        spec, out = os.path.join(tmp, "jobs.json"), os.path.join(tmp, "plans.json")
        with open(spec, "w") as f:
            json.dump(jobs, f)
        cmd = [sys.executable, "-m", "sorl_megatron.weight_sync.plan", "--jobs", spec, "--json", out]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if run.returncode != 0:
            tail = "\n".join(run.stderr.strip().splitlines()[-15:])
            raise RecipeError(f"the weight-sync planner failed ({' '.join(cmd[1:4])}):\n{tail}")
        with open(out) as f:
            plans = [SyncPlan.from_json(p) for p in json.load(f)]
    return [plans[i] for i in index]


def plan_recipes(recipes: Sequence[str], timeout_s: float = 3600.0) -> dict[str, SyncPlan]:
    """Each recipe's plan, by recipe path (:func:`plan_configs`)."""
    plans = plan_configs([load_recipe(r) for r in recipes], timeout_s)
    return dict(zip(recipes, plans))


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--json", help="write {recipe: plan} here")
    args = ap.parse_args(argv)
    plans = plan_recipes(args.recipes)
    for recipe, plan in plans.items():
        print(f"{recipe}:\n{summary(plan)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({r: p.to_json() for r, p in plans.items()}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
