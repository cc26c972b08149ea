"""Mixtral (``mixtral``): softmax top-k routing, always renormalized; ``head_dim: null`` in
its configs (filled in by hf_config.normalize_hf_config)."""

from __future__ import annotations

from typing import Any

from .spec import FamilySpec, register_family, tiny_base


def tiny_config():
    """Top-2 of 4 experts (``num_local_experts``)."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **tiny_base(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    )


def demo_config(common: dict, *, head_dim: int, intermediate_size: int, num_experts: int, top_k: int):
    from transformers import MixtralConfig

    return MixtralConfig(
        **common,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
    )


def config_overrides(hf_config: Any, on_gpu_te: bool) -> dict[str, Any]:
    # HF Mixtral renormalizes the top-k probabilities; mbridge's pre-softmax does not.
    return {"moe_router_pre_softmax": False}


SPEC = register_family(FamilySpec(
    model_type="mixtral",
    title="Mixtral",
    tiny_config=tiny_config,
    config_overrides=config_overrides,
    sliding_window="every_layer",
    demo_config=demo_config,
))
