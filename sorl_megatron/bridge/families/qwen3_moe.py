"""Qwen3-MoE (``qwen3_moe``): softmax top-k routing, renormalized only with ``norm_topk_prob``;
q/k RMS norms; no shared experts."""

from __future__ import annotations

from typing import Any

from .spec import FamilySpec, register_family, tiny_base


def tiny_config():
    """Top-2 of 4 experts, renormalized; every layer MoE."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **tiny_base(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            head_dim=16,
            tie_word_embeddings=False,
        )
    )


def demo_config(common: dict, *, head_dim: int, intermediate_size: int, num_experts: int, top_k: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **common,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        moe_intermediate_size=intermediate_size // 2,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )


def config_overrides(hf_config: Any, on_gpu_te: bool) -> dict[str, Any]:
    # HF Qwen3-MoE renormalizes top-k only when norm_topk_prob is set.
    return {"moe_router_pre_softmax": not bool(getattr(hf_config, "norm_topk_prob", False))}


SPEC = register_family(FamilySpec(
    model_type="qwen3_moe",
    title="Qwen3-MoE",
    tiny_config=tiny_config,
    config_overrides=config_overrides,
    sliding_window="every_layer",
    attention_bias_biases_o_proj=True,
    qk_norm=True,
    demo_config=demo_config,
))
