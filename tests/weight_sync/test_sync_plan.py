"""The sync plan (``weight_sync.plan``: the model built on the meta device, each rank played under
torch's fake process-group backend) against the real export: a small model of each family built
at each layout in 4 real processes over gloo, every rank exporting as a distributed sync does.
Both give, per rank, the same stream of (HF name, shape, dtype) in the same order with the same
bucket ends, and the same ranks send. What the plan adds at full size is only the size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORLD = 4

# (model, layout, weight format): dense and MoE, TP / PP / VPP / EP / ETP, uneven stages, MLA, FP8
CASES = [
    ("qwen2_tied", "tp=2,pp=2", "bf16"),
    ("qwen2_4l", "pp=2,vpp=2", "bf16"),
    ("qwen3_moe", "tp=2,pp=2,sp=1", "block_fp8"),
    ("qwen3_moe", "ep=2,pp=2", "bf16"),
    ("qwen3_moe", "ep=4", "block_fp8"),
    ("qwen3_moe", "tp=2,ep=2,etp=1,sp=1", "bf16"),
    ("deepseek_v3", "tp=2,ep=2,etp=1,sp=1", "block_fp8"),
    ("deepseek_v3_3l", "pp=2,ep=2,first_stage_layers=1", "block_fp8"),
]
BUCKET_BYTES = 24 * 1024  # small: every case has several buckets


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    return env


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    sys.path.insert(0, os.path.join(ROOT, "tests", "bridge"))
    from tiny_models import CONFIGS

    work = tmp_path_factory.mktemp("sync_plan")
    jobs = []
    for model, layout, fmt in CASES:
        config = work / model
        if not config.exists():
            CONFIGS[model]().save_pretrained(config)
        jobs.append({"config": str(config), "layout": layout, "world": WORLD, "format": fmt,
                     "bucket_bytes": BUCKET_BYTES})
    spec = work / "jobs.json"
    spec.write_text(json.dumps(jobs))
    plan_cmd = [sys.executable, "-m", "sorl_megatron.weight_sync.plan", "--jobs", str(spec), "--json",
                str(work / "plans.json")]
    real_cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
                f"--nproc_per_node={WORLD}", os.path.join(HERE, "plan_worker.py"), str(spec), str(work / "real.json")]
    for cmd in (plan_cmd, real_cmd):
        run = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1500)
        assert run.returncode == 0, f"{cmd[:4]} failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    return json.loads((work / "plans.json").read_text()), json.loads((work / "real.json").read_text())


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(c) for c in CASES])
def test_the_plan_is_the_real_export(both, case):
    plans, real = both
    plan, ranks = plans[case], real[case]
    planned = {s["rank"]: s for s in plan["senders"]}
    sending = {r["rank"]: r for r in ranks if r["entries"]}
    assert sorted(planned) == sorted(sending)
    for rank, r in sending.items():
        p = planned[rank]
        assert p["roles"] == r["roles"], rank
        assert p["entries"] == r["entries"], rank  # names, shapes, dtypes, in order
        assert p["bucket_ends"] == r["bucket_ends"], rank


def test_every_case_has_buckets_to_compare(both):
    plans, _ = both
    for plan, (model, layout, _) in zip(plans, CASES):
        assert sum(len(s["bucket_ends"]) for s in plan["senders"]) > len(plan["senders"]), (model, layout)
