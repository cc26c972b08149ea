"""Family-specific checks for DeepSeek-V3, Qwen2-MoE and GLM-4.5 (pure Python, no megatron):
configurations megatron would compute differently are refused naming the key; the layouts'
divisibility checks cover the shared experts and the leading dense layers."""

from __future__ import annotations

import pytest

from sorl_megatron.bridge import LayoutError, ParallelLayout, UnsupportedModelError, validate_layout
from sorl_megatron.bridge.families import family_config_overrides, first_k_dense, mtp_layers, shared_expert_size
from sorl_megatron.bridge.hf_config import load_hf_config

from .tiny_models import (
    deepseek_v3_config,
    glm4_moe_config,
    llama_config,
    mixtral_config,
    qwen2_config,
    qwen2_moe_config,
    qwen3_config,
    qwen3_moe_config,
)


def _with(config, **kw):
    for k, v in kw.items():
        setattr(config, k, v)
    return config


@pytest.mark.parametrize(
    "config,needle",
    [
        (_with(qwen2_moe_config(), mlp_only_layers=[0]), "mlp_only_layers=[0]"),
        (_with(qwen2_moe_config(), decoder_sparse_step=2), "decoder_sparse_step=2"),
        (_with(deepseek_v3_config(), norm_topk_prob=False), "norm_topk_prob=False"),
        (_with(glm4_moe_config(), norm_topk_prob=False), "norm_topk_prob=False"),
        # HF scores a group by its top-2 experts, megatron by top-(topk // topk_group)
        (_with(deepseek_v3_config(), num_experts_per_tok=4, topk_group=1), "topk_group=1"),
        (_with(deepseek_v3_config(), n_group=3), "n_group=3 does not divide n_routed_experts=8"),
        (_with(deepseek_v3_config(), attention_bias=True), "attention_bias=True"),
        # measured on the tiny models before these refusals: logits off by 0.6-0.9 (mbridge builds them anyway)
        (_with(qwen3_config(), attention_bias=True), "attention_bias=True"),
        (_with(qwen3_moe_config(), attention_bias=True), "attention_bias=True"),
        (_with(llama_config(), attention_bias=True), "attention_bias=True"),
        (_with(llama_config(), mlp_bias=True), "mlp_bias=True"),
        (_with(qwen3_config(), sliding_window=4, layer_types=["sliding_attention"] * 2), "sliding_window=4"),
        (_with(qwen2_config(), sliding_window=4, layer_types=["full_attention", "sliding_attention"]),
         "sliding_window=4"),
        (_with(mixtral_config(), sliding_window=64), "sliding_window=64"),
    ],
)
def test_unreproducible_family_configs_are_refused(config, needle):
    with pytest.raises(UnsupportedModelError) as info:
        validate_layout(ParallelLayout(), config)
    assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "config",
    [
        qwen3_config(),
        llama_config(),
        _with(qwen3_config(), sliding_window=4, layer_types=["full_attention"] * 2),  # no layer uses it
        _with(mixtral_config(), sliding_window=128),  # the window holds max_position_embeddings
        qwen2_config(use_sliding_window=False, sliding_window=4),  # as Qwen2.5's config.json (window off)
        _with(llama_config(), sliding_window=4),  # a stray key: transformers' Llama attention never reads it
    ],
)
def test_windows_that_drop_nothing_are_accepted(config):
    validate_layout(ParallelLayout(), load_hf_config(config))


@pytest.mark.parametrize(
    "config,layout,needle",
    [
        (deepseek_v3_config(), ParallelLayout(ep=3), "EP=3 does not divide num_experts=8"),
        (_with(qwen2_moe_config(), shared_expert_intermediate_size=49), ParallelLayout(tp=2),
         "TP=2 does not divide the shared-expert ffn size 49"),
        # the leading dense layer's FFN must split too
        (_with(glm4_moe_config(), intermediate_size=97), ParallelLayout(tp=2), "intermediate_size=97"),
    ],
)
def test_family_layout_checks(config, layout, needle):
    with pytest.raises(LayoutError) as info:
        validate_layout(layout, config)
    assert needle in str(info.value), str(info.value)


def test_local_spec_mla_needs_tp_to_divide_the_latent_sizes():
    from sorl_megatron.bridge.families import local_spec_layout_problem

    assert local_spec_layout_problem(deepseek_v3_config(), 2) is None  # 32 and 32 + 8
    assert "q_lora_rank=32" in local_spec_layout_problem(deepseek_v3_config(), 3)
    no_q = _with(deepseek_v3_config(), q_lora_rank=None)
    assert "kv_lora_rank + qk_rope_head_dim = 40" in local_spec_layout_problem(no_q, 3)
    assert local_spec_layout_problem(glm4_moe_config(), 3) is None  # not MLA


def test_tiny_family_configs_pass_the_two_rank_layouts():
    for make in (deepseek_v3_config, qwen2_moe_config, glm4_moe_config):
        for layout in (ParallelLayout(tp=2), ParallelLayout(ep=2), ParallelLayout(pp=2)):
            validate_layout(layout, make(), world_size=2)


def test_family_facts_and_overrides():
    ds, glm, qm = deepseek_v3_config(), glm4_moe_config(), qwen2_moe_config()
    assert (first_k_dense(ds), mtp_layers(ds), shared_expert_size(ds)) == (1, 1, 32)
    assert (first_k_dense(qm), mtp_layers(qm), shared_expert_size(qm)) == (0, 0, 48)
    assert (first_k_dense(glm), mtp_layers(glm), shared_expert_size(glm)) == (1, 1, 32)
    over = family_config_overrides(ds, on_gpu_te=False)
    assert over["moe_router_num_groups"] == 2 and over["moe_router_group_topk"] == 1
    assert over["mtp_num_layers"] is None and over["moe_router_bias_update_rate"] == 0.0
    assert over["moe_shared_expert_overlap"] is False and over["attention_backend"] == "auto"
    on_gpu = family_config_overrides(ds, on_gpu_te=True)
    assert "moe_shared_expert_overlap" not in on_gpu and "attention_backend" not in on_gpu
    assert "moe_router_num_groups" not in family_config_overrides(glm, on_gpu_te=False)  # n_group=1
    assert family_config_overrides(qm, on_gpu_te=False)["moe_shared_expert_gate"] is True


def test_deepseek_yarn_is_passed_to_megatron_and_other_rope_scaling_refused():
    from .tiny_models import deepseek_v3_yarn_config

    over = family_config_overrides(load_hf_config(deepseek_v3_yarn_config()), on_gpu_te=True)
    assert over["rope_type"] == "yarn" and over["rotary_scaling_factor"] == 4.0
    assert over["original_max_position_embeddings"] == 32 and over["mscale_all_dim"] == 1.0
    glm = glm4_moe_config()
    glm.rope_parameters = {**glm.rope_parameters, "rope_type": "yarn", "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type='yarn' .rope scaling. is not supported"):
        load_hf_config(glm)
    odd = deepseek_v3_yarn_config()
    odd.rope_parameters = {**odd.rope_parameters, "attention_factor": 0.7}
    with pytest.raises(UnsupportedModelError, match="attention_factor"):
        validate_layout(ParallelLayout(), load_hf_config(odd))


def test_glm_partial_rotary_is_lifted_from_rope_parameters():
    # transformers 5 keeps it in rope_parameters; mbridge reads hf_config.partial_rotary_factor
    cfg = load_hf_config(glm4_moe_config())
    assert cfg.partial_rotary_factor == 0.5
