"""Qwen2-MoE (``qwen2_moe``): softmax top-k (renormalized only with ``norm_topk_prob``), a
shared expert behind a sigmoid gate, q/k/v biases.

mbridge 0.15.1's bridge never sets the shared expert's gate (``moe_shared_expert_gate``) and
always renormalizes the top-k (ignoring ``norm_topk_prob``); it maps MoE layers only, so dense
layers (``mlp_only_layers``, ``decoder_sparse_step != 1``) are refused.
"""

from __future__ import annotations

from typing import Any

from .spec import FamilyConfigError, FamilySpec, get, register_family, tiny_base


def tiny_config():
    """Softmax top-2 of 4 experts without renormalization, a sigmoid-gated shared expert, q/k/v
    biases; every layer MoE (mbridge's bridge maps no dense Qwen2-MoE layers)."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **tiny_base(
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
        )
    )


def shared_expert_size(hf_config: Any) -> int:
    return int(get(hf_config, "shared_expert_intermediate_size", 0))


def check(hf_config: Any) -> None:
    dense = list(get(hf_config, "mlp_only_layers", []) or [])
    step = int(get(hf_config, "decoder_sparse_step", 1))
    if dense or step != 1:
        raise FamilyConfigError(
            f"qwen2_moe with dense layers (mlp_only_layers={dense}, decoder_sparse_step={step}) is not "
            "supported: mbridge 0.15.1's Qwen2-MoE bridge maps MoE layers only"
        )
    if shared_expert_size(hf_config) <= 0:
        raise FamilyConfigError("qwen2_moe needs shared_expert_intermediate_size > 0 (its shared expert)")


def config_overrides(hf_config: Any, on_gpu_te: bool) -> dict[str, Any]:
    return {
        "moe_shared_expert_gate": True,
        # HF Qwen2-MoE renormalizes the top-k softmax probabilities only with norm_topk_prob.
        "moe_router_pre_softmax": not bool(get(hf_config, "norm_topk_prob", False)),
    }


SPEC = register_family(FamilySpec(
    model_type="qwen2_moe",
    title="Qwen2-MoE",
    tiny_config=tiny_config,
    check=check,
    config_overrides=config_overrides,
    sliding_window="by_layer_type",
    # transformers' Qwen2-MoE biases q/k/v too (its config's `qkv_bias`); the memory plan has
    # never counted them (a few thousand parameters per layer): kept as it was.
    qkv_bias=False,
    shared_expert_size=shared_expert_size,
    tiny_router_std=0.3,
))
