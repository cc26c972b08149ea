"""GLM-4.5 (``glm4_moe``): partial rotary (``partial_rotary_factor``, lifted out of
``rope_parameters`` by hf_config.normalize_hf_config), q/k/v biases when ``attention_bias``,
optional q/k norms (``use_qk_norm``), and DeepSeek-V3's routing (sigmoid_routing.py).

mbridge 0.15.1's bridge always turns the q/k/v biases on (``attention_bias`` ignored), sizes the
shared experts ``moe_intermediate_size`` whatever ``n_shared_experts``, and turns the sequence
aux loss on; all set from the config here.
"""

from __future__ import annotations

from typing import Any

from . import sigmoid_routing
from .spec import FamilySpec, get, register_family, tiny_base


def tiny_config():
    """GLM-4.5: half-rotary heads, q/k/v biases, q/k norms, 1 leading dense layer, sigmoid
    routing with a correction bias over 4 experts (one group), one shared expert, an MTP module
    declared (its weights skipped as DeepSeek-V3's)."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        **tiny_base(
            intermediate_size=96,
            moe_intermediate_size=32,
            head_dim=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
            num_nextn_predict_layers=1,
            tie_word_embeddings=False,
        )
    )


def config_overrides(hf_config: Any, on_gpu_te: bool) -> dict[str, Any]:
    over = sigmoid_routing.config_overrides(hf_config)
    over["add_qkv_bias"] = bool(get(hf_config, "attention_bias", False))
    return over


SPEC = register_family(FamilySpec(
    model_type="glm4_moe",
    title="GLM-4.5",
    tiny_config=tiny_config,
    check=sigmoid_routing.check,
    config_overrides=config_overrides,
    # q/k norms come with use_qk_norm; the memory plan has never counted them (2 x head_dim per
    # layer): kept as it was.
    qk_norm=False,
    dense_prefix_key=sigmoid_routing.DENSE_PREFIX_KEY,
    shared_expert_size=sigmoid_routing.shared_expert_size,
    tiny_router_std=0.3,
))
