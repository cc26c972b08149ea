"""What the sync planner is asked for each GPU recipe (``trainer.recipe.sync_plan.plan_job``): the
memory plan's config, the recipe's whole layout and planned world, the FP8 format for FP8
rollouts, the recipe's bucket size."""

from __future__ import annotations

import os

import pytest

from sorl_megatron.bridge.layout import ParallelLayout
from sorl_megatron.trainer.recipe.loader import load_recipe
from sorl_megatron.trainer.recipe.sync_plan import plan_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("recipe, config, layout, world, fmt", [
    ("minirl_deepseek_v3_r3.yaml", "deepseek_v3.json",
     ParallelLayout(tp=8, pp=4, ep=32, etp=1, sequence_parallel=True, first_stage_layers=16), 256, "block_fp8"),
    ("minirl_qwen3_235b_a22b_r3.yaml", "qwen3_235b_a22b.json",
     ParallelLayout(tp=4, pp=2, ep=32, etp=1, sequence_parallel=True), 128, "block_fp8"),
    ("minirl_qwen3_30b_a3b_r3.yaml", "qwen3_30b_a3b.json",
     ParallelLayout(tp=2, pp=2, ep=8, etp=1, sequence_parallel=True), 32, "block_fp8"),
    ("minirl_moonlight_16b_a3b_r3.yaml", "moonlight_16b_a3b.json", ParallelLayout(tp=1, pp=1, ep=8, etp=1), 8,
     "block_fp8"),
    ("search_r1_base.yaml", "qwen2.5_7b.json", ParallelLayout(tp=2), 8, "bf16"),
])
def test_each_gpu_recipe_is_planned_at_its_layout(recipe, config, layout, world, fmt):
    job = plan_job(load_recipe(os.path.join(ROOT, "recipes", "gpu", recipe)))
    assert os.path.basename(job["config"]) == config
    got = ParallelLayout.from_string(job["layout"])
    assert effective(got) == effective(layout)
    assert (job["world"], job["format"], job["bucket_mb"]) == (world, fmt, 512)


def effective(p: ParallelLayout) -> tuple:
    return (p.tp, p.pp, p.vpp, p.ep, p.expert_tp, p.cp, p.use_sequence_parallel, p.first_stage_layers,
            p.last_stage_layers)


@pytest.mark.slow
def test_print_sync_plan_shows_the_recipes_sync_at_full_size(capsys):
    """``train --print-sync-plan``: the 7B recipe's one weight-update group (one pipeline stage) and
    its sender's stream: every tensor of Qwen2.5-7B, gathered over TP 2, in 512 MiB buckets."""
    from sorl_megatron.train import main

    assert main(["--config", os.path.join(ROOT, "recipes", "gpu", "sorl_qwen2.5_7b_grpo.yaml"),
                 "--print-sync-plan"]) == 0
    out = capsys.readouterr().out
    assert "qwen2 at TP=2 PP=1 EP=1 ETP=2 SP on 8 ranks, bf16, buckets of 512 MiB: 1 weight-update groups" in out
    assert "rank 0 (stage 0" in out and "339 tensors, 30 buckets, 14.185 GiB" in out
