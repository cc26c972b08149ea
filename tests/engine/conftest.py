"""Fixtures: tiny random HF models and the grouped worker launches (1, 2 and 4 processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VENV_BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="session")
def engine_models(tmp_path_factory):
    sys.path.insert(0, os.path.join(ROOT, "tests", "bridge"))
    from tiny_models import save_tiny_model

    root = tmp_path_factory.mktemp("engine_models")
    save_tiny_model("qwen3_moe", str(root / "qwen3_moe"))
    register_moe_4l()
    save_tiny_model(MODEL_4L, str(root / MODEL_4L))
    for kind in FAMILIES:  # issue 20's MoE families (MLA, shared experts, sigmoid routing)
        save_tiny_model(kind, str(root / kind))
    return str(root)


FAMILIES = ("deepseek_v3", "glm4_moe", "qwen2_moe")


MODEL_4L = "qwen3_moe_4l"  # four layers: PP=2 x VPP=2 gives every virtual stage one


def register_moe_4l() -> None:
    """Add the four-layer tiny Qwen3-MoE to tests/bridge/tiny_models' registry (in this process)."""
    import tiny_models

    def config():
        cfg = tiny_models.qwen3_moe_config()
        cfg.num_hidden_layers = 4
        return cfg

    tiny_models.CONFIGS.setdefault(MODEL_4L, config)


def launch(models: str, work: str, cases: list[dict], nproc: int, name: str, timeout: int = 400) -> dict:
    """Run the worker on `cases`; returns {tag: result}. A failed launch fails with its output."""
    os.makedirs(work, exist_ok=True)
    spec = os.path.join(work, f"{name}_spec.json")
    out = os.path.join(work, f"{name}_out.json")
    with open(spec, "w") as f:
        json.dump({"models_dir": models, "work_dir": work, "cases": cases, "timeout_s": 120}, f)
    worker = os.path.join(HERE, "worker.py")
    if nproc == 1:
        cmd = [sys.executable, worker, spec, out]
    else:
        torchrun = os.path.join(VENV_BIN, "torchrun")
        cmd = [torchrun, "--standalone", f"--nproc_per_node={nproc}", worker, spec, out]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not os.path.isfile(out):
        raise AssertionError(
            f"worker launch {name} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    with open(out) as f:
        results = json.load(f)
    return {r["case"]["tag"]: r for r in results}


@pytest.fixture(scope="session")
def engine_work(tmp_path_factory):
    return str(tmp_path_factory.mktemp("engine_work"))


MODEL = "qwen3_moe"


@pytest.fixture(scope="session")
def ws1(engine_models, engine_work):
    cases = [
        {"op": "actor", "model": MODEL, "layout": "tp=1", "tag": "actor_ws1"},
        {"op": "replay", "model": MODEL, "layout": "tp=1", "tag": "replay_ws1"},
        {"op": "critic", "model": MODEL, "layout": "tp=1", "tag": "critic_ws1"},
        {"op": "losses", "model": MODEL, "layout": "tp=1", "tag": "losses_ws1"},
        {"op": "bad_input", "model": MODEL, "layout": "tp=1", "tag": "bad_ws1"},
        {"op": "compat", "model": MODEL, "layout": "tp=1", "tag": "compat_ws1"},
        {"op": "recompute", "model": MODEL, "layout": "tp=1", "tag": "recompute_ws1"},
        {"op": "sft", "model": MODEL, "layout": "tp=1", "tag": "sft_ws1"},
        {"op": "placement", "model": MODEL, "layout": "tp=1", "tag": "placement_ws1"},
        {"op": "ckpt_safety", "model": MODEL, "layout": "tp=1", "tag": "ckpt_safety_ws1"},
        {"op": "diagnostics", "model": MODEL, "layout": "tp=1", "tag": "diagnostics_ws1"},
        {"op": "old_from_forward", "model": MODEL, "layout": "tp=1", "tag": "old_from_forward_ws1"},
        {"op": "old_from_forward", "model": MODEL, "layout": "tp=1", "tag": "old_from_forward_r3_ws1", "replay": "r3"},
        {"op": "bf16", "model": MODEL, "layout": "tp=1", "tag": "bf16_ws1", "replay": "r2", "resume": True,
         "critic": True},
        {"op": "actor", "model": MODEL_4L, "layout": "tp=1", "tag": "actor_4l_ws1", "steps": 1},
        # issue 20's families: the update (light: no per-mode autograd references); DeepSeek-V3's
        # random-route R2/R3 (MLA, a dense first layer, grouped sigmoid routing with a bias); every
        # family's rollout R3
        *[{"op": "actor", "model": k, "layout": "tp=1", "tag": f"actor_{k}_ws1", "light": True} for k in FAMILIES],
        *[{"op": "replay", "model": k, "layout": "tp=1", "tag": f"replay_{k}_ws1"} for k in FAMILIES],
        *[{"op": "rollout_r3", "model": k, "layout": "tp=1", "tag": f"rollout_r3_{k}_ws1"} for k in FAMILIES],
    ]
    return launch(engine_models, engine_work, cases, 1, "ws1")


@pytest.fixture(scope="session")
def ws2(engine_models, engine_work):
    cases = [
        {"op": "actor", "model": MODEL, "layout": "tp=2", "tag": "actor_tp2"},
        {"op": "actor", "model": MODEL, "layout": "ep=2", "tag": "actor_ep2"},
        {"op": "actor", "model": MODEL, "layout": "pp=2", "tag": "actor_pp2"},
        {"op": "actor", "model": MODEL, "layout": "tp=1", "tag": "actor_dp2"},
        {"op": "actor", "model": MODEL, "layout": "tp=1", "tag": "actor_dp2_distopt", "dist_opt": True},
        {"op": "old_from_forward", "model": MODEL, "layout": "tp=1", "tag": "old_from_forward_dp2"},
        {"op": "old_from_forward", "model": MODEL, "layout": "pp=2", "tag": "old_from_forward_pp2"},
        {"op": "old_from_forward", "model": MODEL, "layout": "ep=2", "tag": "old_from_forward_r3_ep2", "replay": "r3"},
        {"op": "replay", "model": MODEL, "layout": "ep=2", "tag": "replay_ep2"},
        {"op": "replay", "model": MODEL, "layout": "tp=2", "tag": "replay_tp2"},
        {"op": "critic", "model": MODEL, "layout": "tp=2", "tag": "critic_tp2"},
        {"op": "critic", "model": MODEL, "layout": "pp=2", "tag": "critic_pp2"},
        {"op": "losses", "model": MODEL, "layout": "ep=2", "tag": "losses_ep2"},
        {"op": "resume", "model": MODEL, "layout": "tp=2", "resume_layout": "tp=2", "tag": "resume_same"},
        {"op": "resume", "model": MODEL, "layout": "tp=2", "resume_layout": "pp=2", "tag": "resume_tp2_to_pp2"},
        {"op": "bad_input", "model": MODEL, "layout": "ep=2", "tag": "bad_ep2"},
        {"op": "sft", "model": MODEL, "layout": "tp=2", "tag": "sft_tp2"},
        {"op": "bf16", "model": MODEL, "layout": "tp=2", "tag": "bf16_tp2", "replay": "r2"},
        {"op": "bf16", "model": MODEL, "layout": "tp=1", "tag": "bf16_dp2_distopt", "replay": "r2", "dist_opt": True,
         "resume": True},
        # expert TP 1 under TP 2 (MiniRL's ETP != TP), and the interleaved schedule (VPP)
        {"op": "actor", "model": MODEL, "layout": "tp=2,ep=2,etp=1", "tag": "actor_tp2_etp1_ep2", "steps": 1},
        {"op": "actor", "model": MODEL_4L, "layout": "pp=2,vpp=2", "tag": "actor_4l_pp2_vpp2", "steps": 1},
        # uneven pipeline stages (parallelism.first_stage_layers): layers 0 | 1, 2, 3
        {"op": "actor", "model": MODEL_4L, "layout": "pp=2,first_stage_layers=1", "tag": "actor_4l_pp2_first1",
         "steps": 1},
        {"op": "compat_uneven", "model": MODEL, "layout": "tp=1", "tag": "compat_uneven_2"},
        *[{"op": "actor", "model": k, "layout": "ep=2", "tag": f"actor_{k}_ep2", "light": True} for k in FAMILIES],
        {"op": "rollout_r3", "model": "deepseek_v3", "layout": "ep=2", "tag": "rollout_r3_deepseek_v3_ep2"},
        # the batch transfer (rank 0's batch as tensors, routes per DP rank) vs the whole batch pickled
        {"op": "transfer", "model": MODEL, "layout": "tp=1", "tag": "transfer_dp2"},
        {"op": "transfer", "model": MODEL, "layout": "tp=1", "tag": "transfer_dp2_packed", "pack": True},
    ]
    return launch(engine_models, engine_work, cases, 2, "ws2")


@pytest.fixture(scope="session")
def ws4(engine_models, engine_work):
    """Four processes: TP2 x EP2 (expert TP 2, expert-DP 1) and TP2 x EP4 with expert TP 1;
    issue 20's families' logits vs transformers at TP2 x EP2 (the bridge's check, in the only
    four-process launch of the suite); the batch transfer at DP 4 and TP 2 x DP 2."""
    cases = [
        {"op": "actor", "model": MODEL, "layout": "tp=2,ep=2", "tag": "actor_tp2_ep2_4r", "steps": 1},
        {"op": "actor", "model": MODEL, "layout": "tp=2,ep=4,etp=1", "tag": "actor_tp2_etp1_ep4_4r", "steps": 1},
        *[{"op": "logits", "model": k, "layout": "tp=2,ep=2", "tag": f"logits_{k}_tp2_ep2_4r"} for k in FAMILIES],
        {"op": "transfer", "model": MODEL, "layout": "tp=1", "tag": "transfer_dp4"},
        {"op": "transfer", "model": MODEL, "layout": "tp=2", "tag": "transfer_tp2_dp2_4r"},
    ]
    return launch(engine_models, engine_work, cases, 4, "ws4")
