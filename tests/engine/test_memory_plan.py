"""The memory plan (trainer/recipe/memory_plan.py, ``train --print-memory``), parallelism.recompute and
model.offload_idle: arithmetic on the GPU recipes, and on CPU a built engine (memory_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sorl_megatron.trainer.recipe.config import RecipeError
from sorl_megatron.trainer.recipe.loader import load_recipe
from sorl_megatron.trainer.recipe.memory_plan import (
    check_memory_for_launch,
    count_params,
    model_config_for,
    plan_memory,
    read_model_config,
)

ROOT = Path(__file__).resolve().parents[2]
GPU_RECIPES = sorted((ROOT / "recipes" / "gpu").glob("*.yaml"))
CONFIGS = ROOT / "recipes" / "gpu" / "model_configs"


@pytest.mark.parametrize("name, billions", [
    ("qwen2.5_7b", 7.62), ("qwen2.5_3b", 3.09), ("qwen3_30b_a3b", 30.5), ("qwen3_235b_a22b", 235.1),
    ("deepseek_v3", 671.0), ("moonlight_16b_a3b", 16.0),
])
def test_model_configs_have_the_published_sizes(name, billions):
    n = count_params(read_model_config(str(CONFIGS / f"{name}.json")))
    assert (n.dense + n.experts + n.vocab) / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.stem)
def test_every_gpu_recipe_fits_an_80gb_h100(recipe, monkeypatch):
    """Against an H100's reported 79.2 GiB (no GPU here, no parallelism.gpu_memory_gib), the NCCL
    communicators of the layout counted. DeepSeek-V3 fits with TE's fused Adam (its GPU path) by
    a stated margin; without one it is refused, and the change its header names fits with room."""
    from sorl_megatron.trainer.recipe import memory_plan

    cfg = load_recipe(recipe)
    assert cfg.parallelism.gpu_memory_gib is None
    c, critic, source = model_config_for(cfg)
    assert "config_for_planning" in source  # the recipes' model paths do not exist here
    plan = plan_memory(cfg, c, critic)
    assert plan.budget_gib == 79.2 and "no GPU here" in plan.budget_source
    assert any(i.name == "NCCL communicators" and (i.gib > 0) == (cfg.parallelism.model_parallel_size > 1 or
               cfg.rollout.weight_sync.transport == "distributed") for i in plan.items)
    if recipe.stem != "minirl_deepseek_v3_r3":
        assert plan.fits, plan.report()
        return
    assert not plan.fits and any(i.name == "actor optimizer step" for i in plan.items)
    monkeypatch.setattr(memory_plan, "megatron_adam_is_fused", lambda: True)
    assert 2.5 < plan_memory(cfg, c, critic).margin_gib < 3.0  # the header's 2.7 GiB
    monkeypatch.undo()
    roomy = load_recipe(recipe, ["parallelism.pp=8", "parallelism.first_stage_layers=5"])
    assert plan_memory(roomy, c, critic).margin_gib > 13


def test_the_budget_is_the_devices_reported_memory(monkeypatch):
    import torch

    from sorl_megatron.trainer.recipe.memory_plan import memory_budget

    class Props:
        name, total_memory = "NVIDIA H200", int(139.8 * 2**30)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # mocked: the device query only
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    cfg = load_recipe(ROOT / "recipes/gpu/minirl_deepseek_v3_r3.yaml")
    assert memory_budget(cfg) == pytest.approx((139.8, "the memory NVIDIA H200 reports"))
    pinned = load_recipe(ROOT / "recipes/gpu/minirl_deepseek_v3_r3.yaml", ["parallelism.gpu_memory_gib=70"])
    assert memory_budget(pinned) == (70, "parallelism.gpu_memory_gib")


def test_the_reserve_counts_the_layouts_nccl_groups():
    from sorl_megatron.trainer.recipe.memory_plan import nccl_groups

    cfg = load_recipe(ROOT / "recipes/gpu/minirl_deepseek_v3_r3.yaml")
    assert nccl_groups(cfg, (8, 2), routed=True) == ["TP", "PP", "DP", "TP x PP", "embedding", "EP", "expert-DP",
                                                     "weight update"]
    one = load_recipe(ROOT / "recipes/tiny_search_base.yaml", ["rollout.weight_sync.transport=tensor"])
    assert nccl_groups(one, (1, 1), routed=True) == []


def test_the_old_7b_ppo_settings_are_refused_on_gpu_only():
    """The issue's case: actor, reference and critic resident, 8 x 4,096 tokens, no recompute."""
    cfg = load_recipe(ROOT / "recipes/gpu/sorl_qwen2.5_7b_ppo.yaml", [
        "parallelism.recompute=none", "model.offload_idle=false", "schedule.max_tokens_per_micro_batch=null"])
    assert check_memory_for_launch(cfg, 8, on_gpu=False) is None  # CPU runs: never refused
    with pytest.raises(RecipeError) as err:
        check_memory_for_launch(cfg, 8, on_gpu=True)
    text = str(err.value)
    assert "exceeds 79.2 GiB (an 80 GB H100's reported memory" in text
    assert "actor activations" in text and "parallelism.recompute=full" in text
    plan = plan_memory(cfg, *model_config_for(cfg)[:2], world_size=8)
    items = {i.name: i.gib for i in plan.items}
    # 3.81B parameters per GPU at TP 2: bf16 weights, fp32 gradients, Adam sharded over DP 4
    assert items["actor weights"] == pytest.approx(3.808e9 * 2 / 2**30, rel=0.01)
    assert items["actor optimizer"] == pytest.approx(3.808e9 * 12 / 4 / 2**30, rel=0.01)
    assert items["reference weights"] > 7 and items["critic optimizer"] > 9  # resident without offload
    assert items["logits fp32 copy"] == pytest.approx(32768 * 76032 * 4 / 2**30, rel=1e-6)
    # the recipe as shipped fits, and each key lowers its items
    fixed = load_recipe(ROOT / "recipes/gpu/sorl_qwen2.5_7b_ppo.yaml")
    assert check_memory_for_launch(fixed, 8, on_gpu=True).fits


def test_an_sft_micro_batch_larger_than_rls_is_what_the_plan_sizes():
    from sorl_megatron.trainer.recipe.memory_plan import micro_batch_tokens

    base = ROOT / "recipes" / "tiny_search_base.yaml"
    rl = micro_batch_tokens(load_recipe(base, ["sft.micro_batch_size=null"]))
    assert rl == 8 * 640  # schedule.micro_batch_size x rollout.max_total_tokens
    assert micro_batch_tokens(load_recipe(base, ["sft.micro_batch_size=16"])) == 16 * 640
    assert micro_batch_tokens(load_recipe(base, ["sft.micro_batch_size=16", "sft.enabled=false"])) == rl
    assert micro_batch_tokens(load_recipe(base, ["sft.micro_batch_size=2"])) == rl


def test_print_memory_cli(capsys):
    from sorl_megatron.train import main

    assert main(["--config", str(ROOT / "recipes/gpu/sorl_qwen2.5_7b_ppo.yaml"), "--print-memory"]) == 0
    out = capsys.readouterr().out
    assert "peak phase: critic update" in out and "GiB to spare in 79.2 GiB" in out
    over = ["parallelism.recompute=none", "model.offload_idle=false"]
    assert main(["--config", str(ROOT / "recipes/gpu/sorl_qwen2.5_7b_ppo.yaml"), "--print-memory", *over]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    tiny = ["--config", str(ROOT / "recipes/gpu/sapo_qwen2.5_3b.yaml"), "--print-memory",
            "--model-config", str(CONFIGS / "qwen2.5_7b.json")]
    assert main(tiny) == 0
    assert "--model-config=" in capsys.readouterr().out


# ------------------------------------------------------------ a built engine on CPU (one process)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory_plan")
    sys.path.insert(0, str(ROOT / "tests" / "bridge"))
    import tiny_models
    from transformers import Qwen2Config

    tiny_models.save_tiny_model("qwen2", str(root / "qwen2"))
    tiny_models.CONFIGS["qwen2_mem"] = lambda: Qwen2Config(**tiny_models._common(
        vocab_size=1024, hidden_size=256, intermediate_size=768, tie_word_embeddings=False, rope_theta=10000.0))
    tiny_models.save_tiny_model("qwen2_mem", str(root / "qwen2_mem"))
    out = root / "out.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'kernels'}", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests/engine/memory_worker.py"), str(root), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, json.loads(out.read_text())


def test_recompute_trains_like_none(worker):
    r = worker[1]["recompute"]
    assert r["granularity"] == [None, "selective", "full"]  # wired into megatron's TransformerConfig
    assert r["losses"][1:] == pytest.approx([r["losses"][0]] * 2, abs=1e-6)
    assert r["grad_diff"] <= 1e-6


def test_offload_idle_moves_the_reference_and_critic_not_the_actor(worker):
    r = worker[1]["offload"]
    assert r["offloads"] == [False, True, True, False]  # actor, reference, critic, reference without the key
    assert r["ref_moves"] == ["cuda:0", "cpu"] and r["ref_during"] == "cuda:0" and r["ref_after"] == "cpu"
    assert r["critic_moves"] == ["cuda:0", "cpu", "cuda:0", "cpu"] and r["critic_after"] == "cpu"
    assert r["plain_after"] == "cuda:0"  # without the key the model stays where it computes
    assert r["logprob_diff"] == 0.0


def test_estimate_matches_the_measured_cpu_peak_within_25_percent(worker):
    """torch.profiler's CPU memory events over building an engine and one update, against the
    plan's items (fp32 on CPU: weights, gradients, Adam moments, logits, activations)."""
    root, r = worker
    m = r["measured"]
    cfg = load_recipe(ROOT / "recipes/tiny_search_grpo.yaml", [
        f"model.path={root / 'qwen2_mem'}", "model.dtype=float32", "algorithm.loss.kl_coef=0",
        f"schedule.max_tokens_per_micro_batch={m['tokens']}", "rollout.max_total_tokens=128",
        "rollout.max_obs_tokens=64", "data.max_prompt_tokens=16"])
    plan = plan_memory(cfg, *model_config_for(cfg)[:2], world_size=1, on_gpu=False)
    items = {i.name: i.gib * 2**30 for i in plan.items}
    assert items["actor weights"] == pytest.approx(m["params"] * 4)  # the count is megatron's
    assert plan.total_gib * 2**30 == pytest.approx(m["peak_bytes"], rel=0.25), (plan.report(), m)


def test_torch_adams_step_temporaries_are_planned_net_of_the_freed_activations(monkeypatch):
    """Without a fused Adam (no TransformerEngine or apex: megatron uses torch's AdamW) the step
    allocates 4 bytes per parameter it updates (measured on an H100 at three model sizes,
    docs/how-to/gpu-check.md); activations and logits are freed by then, so only the excess is added."""
    from sorl_megatron.trainer.recipe import memory_plan

    cfg = load_recipe(GPU_RECIPES[0])
    c, critic, _ = model_config_for(cfg)
    monkeypatch.setattr(memory_plan, "megatron_adam_is_fused", lambda: True)
    fused = {i.name: i.gib for i in plan_memory(cfg, c, critic).items}
    monkeypatch.setattr(memory_plan, "megatron_adam_is_fused", lambda: False)
    plan = plan_memory(cfg, c, critic)
    items = {i.name: i.gib for i in plan.items}
    who = "critic" if plan.phase == "critic update" else "actor"
    assert f"{who} optimizer step" not in fused
    per = 12 if cfg.model.dtype in ("bfloat16", "auto") else 8
    step = items[f"{who} optimizer"] / per * 4  # one fp32 tensor per updated parameter
    freed = sum(v for k, v in items.items() if k.startswith(("logits", "log-softmax")) or k == f"{who} activations")
    assert items[f"{who} optimizer step"] == pytest.approx(max(0.0, step - freed))
    assert sum(items.values()) == pytest.approx(sum(fused.values()) + items[f"{who} optimizer step"])
    assert not any(k.endswith("optimizer step") and not k.startswith(who) for k in items)  # the idle model's: none
    # CPU runs plan no GPU and no step temporaries
    assert not any(i.name.endswith("optimizer step") for i in plan_memory(cfg, c, critic, on_gpu=False).items)


def test_a_recipes_repository_relative_config_is_found_from_another_directory(tmp_path, monkeypatch):
    """``model.config_for_planning`` names a repository-relative file: found from any working directory."""
    cfg = load_recipe(GPU_RECIPES[0])
    monkeypatch.chdir(tmp_path)
    c, _, source = model_config_for(cfg)
    assert c is not None and "config_for_planning" in source
