"""The supported HF model families: one module per ``model_type``, each registering a
`FamilySpec` (spec.py), and the functions the rest of the package asks about a config.

Building (build.py), the layout checks (layout.py), config loading (hf_config.py), checkpoint
loading and FP8 (hf_checkpoint.py), conversion and the memory plan (trainer/memory_plan.py)
consult the spec through these functions; none of them compares ``model_type`` strings
(tests/bridge/test_family_registry.py fails if one does). To add a family: a module here, its
import below, and nothing else (docs/how-to/add-a-model-family.md).

Pure Python (no megatron import), so `validate_layout` can run these checks before any process
group exists. `family_config_overrides` returns TransformerConfig fields that make megatron
compute what transformers computes for that family; `check_family` raises `FamilyConfigError`
(naming the config key) for configurations megatron 0.16.1 / mbridge 0.15.1 cannot reproduce
exactly. Refused for every family (mbridge builds the model but its logits differ from
transformers'): a sliding attention window that drops a position, and ``attention_bias=True``
where transformers then biases o_proj too (`FamilySpec.attention_bias_biases_o_proj`).
"""

from __future__ import annotations

from typing import Any, Optional

from .spec import FAMILIES, FamilyConfigError, FamilySpec, family_of, get, register_family, tiny_base

# One module per family; each registers its spec when imported, in this order (the order the
# supported families are listed in: messages, docs).
# isort: off
from . import qwen2, qwen3, llama  # noqa: E402, F401
from . import qwen3_moe, mixtral  # noqa: E402, F401
from . import deepseek_v3, qwen2_moe, glm4_moe  # noqa: E402, F401
# isort: on

__all__ = [
    "FAMILIES", "FamilyConfigError", "FamilySpec", "SUPPORTED_MODEL_TYPES", "block_fp8_families", "bridge_class",
    "check_family",
    "family_config_overrides", "family_of", "first_k_dense", "has_qk_norm", "has_qkv_bias", "is_supported",
    "local_spec_layout_problem", "mtp_layers", "reads_block_fp8", "register_family", "rope_scaling_allowed",
    "rope_scaling_note", "routing_shape", "shared_expert_size", "sliding_window_in_use", "supported_model_types",
    "tiny_base",
]


def supported_model_types() -> tuple[str, ...]:
    """The registered ``model_type`` values, in registration order."""
    return tuple(FAMILIES)


# The families registered here (a family registered later is supported too: `is_supported`).
SUPPORTED_MODEL_TYPES = supported_model_types()


def is_supported(model_type: Any) -> bool:
    return model_type in FAMILIES


def first_k_dense(hf_config: Any) -> int:
    """Leading dense (non-MoE) layers: DeepSeek-V3 / GLM-4.5 `first_k_dense_replace`."""
    spec = family_of(hf_config)
    if spec is None or spec.dense_prefix_key is None:
        return 0
    return min(int(get(hf_config, spec.dense_prefix_key, 0)), int(hf_config.num_hidden_layers))


def routing_shape(hf_config: Any) -> tuple[int, int]:
    """``(rows, top_k)`` of the routed experts a server returns for this model: SGLang captures
    one row per decoder layer (``num_hidden_layers``; the leading dense layers, see
    :func:`first_k_dense`, are never routed) of ``num_experts_per_tok`` ids."""
    top_k = int(get(hf_config, "num_experts_per_tok", 0) or 0)
    if top_k < 1:
        raise FamilyConfigError(
            f"{hf_config.model_type}: config.json has no num_experts_per_tok: not a MoE model, it returns no "
            "routed experts (algorithm.routing_replay r3 needs one)")
    return int(hf_config.num_hidden_layers), top_k


def mtp_layers(hf_config: Any) -> int:
    """Multi-token-prediction modules the HF checkpoint carries (never built here)."""
    return int(get(hf_config, "num_nextn_predict_layers", 0) or 0)


def shared_expert_size(hf_config: Any) -> int:
    """The FFN size of one MoE layer's shared experts (0: none)."""
    spec = family_of(hf_config)
    return 0 if spec is None or spec.shared_expert_size is None else spec.shared_expert_size(hf_config)


def has_qkv_bias(hf_config: Any) -> bool:
    """Whether the q/k/v projections carry biases (the family's always, else ``attention_bias``)."""
    spec = family_of(hf_config)
    return bool(spec is not None and spec.qkv_bias) or bool(get(hf_config, "attention_bias", False))


def has_qk_norm(hf_config: Any) -> bool:
    spec = family_of(hf_config)
    return spec is not None and spec.qk_norm


def sliding_window_in_use(hf_config: Any) -> Optional[int]:
    """The attention window transformers applies to some layer, or None (full causal attention
    everywhere). A window of at least max_position_embeddings never drops a position."""
    spec = family_of(hf_config)
    if spec is None or spec.sliding_window is None:
        return None
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None) if spec.sliding_window == "by_layer_type" else None
    if not window or (types is not None and "sliding_attention" not in types):
        return None
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    return None if max_pos is not None and int(window) >= int(max_pos) else int(window)


def check_family(hf_config: Any) -> None:
    """Raise FamilyConfigError for family features the Megatron model would compute differently."""
    mt = getattr(hf_config, "model_type", None)
    spec = family_of(hf_config)
    window = sliding_window_in_use(hf_config)
    if window is not None:
        raise FamilyConfigError(
            f"{mt} with sliding-window attention (sliding_window={window}, use_sliding_window / layer_types): "
            "mbridge 0.15.1 builds full causal attention on every layer"
        )
    if spec is None:
        return
    if spec.attention_bias_biases_o_proj and bool(get(hf_config, "attention_bias", False)):
        raise FamilyConfigError(
            f"{mt} with attention_bias=True: transformers then biases the output projection (o_proj) too, "
            "which megatron can bias only together with the MLP (add_bias_linear)"
        )
    if spec.check is not None:
        spec.check(hf_config)


def local_spec_layout_problem(hf_config: Any, tp: int) -> Optional[str]:
    """Layout limits of the CPU (local) layer spec only (DeepSeek-V3's MLA splits its q / kv down
    projections over TP, TE's spec replicates them). Returns what is wrong (build_model raises
    it as a LayoutError on `tp`), or None."""
    spec = family_of(hf_config)
    if spec is None or spec.local_spec_problem is None or tp == 1:
        return None
    return spec.local_spec_problem(hf_config, tp)


def family_config_overrides(hf_config: Any, on_gpu_te: bool) -> dict[str, Any]:
    """TransformerConfig overrides (applied after mbridge's) for the families that need them."""
    spec = family_of(hf_config)
    if spec is None:
        return {}
    over = dict(spec.config_overrides(hf_config, on_gpu_te)) if spec.config_overrides is not None else {}
    if spec.shared_expert_size is not None and not on_gpu_te:
        # Overlapping the shared expert with the dispatcher runs it on a side CUDA stream.
        over["moe_shared_expert_overlap"] = False
    return over


def bridge_class(hf_config: Any, registry: dict[str, type]) -> type:
    """The bridge class to build ``hf_config`` with: mbridge's registered one (``registry``,
    mbridge's ``_MODEL_REGISTRY``) as the family's spec fixes it."""
    spec = family_of(hf_config)
    if spec is None:
        return registry[hf_config.model_type]
    cls = registry[spec.mbridge_name]
    return cls if spec.bridge_class is None else spec.bridge_class(cls)


def rope_scaling_allowed(hf_config: Any, rope_type: Optional[str]) -> bool:
    """Whether ``rope_parameters['rope_type']`` loads: default RoPE everywhere, a scaling only
    where the family passes it to megatron (`FamilySpec.rope_scaling`)."""
    if rope_type in (None, "default"):
        return True
    spec = family_of(hf_config)
    return spec is not None and rope_type in spec.rope_scaling


def rope_scaling_note(rope_type: Optional[str]) -> str:
    """The families that load ``rope_type``, for the refusal's message ("" when none does)."""
    names = [mt for mt, spec in FAMILIES.items() if rope_type in spec.rope_scaling]
    if not names:
        return ""
    label = "YaRN" if rope_type == "yarn" else repr(rope_type)
    return f" (and {label} for {', '.join(names)})"


def reads_block_fp8(hf_config: Any) -> bool:
    """Whether the bridge reads ``hf_config``'s checkpoint as block-FP8 with its scales (the
    family's reader dequantizes, and the config says ``quant_method: fp8``)."""
    spec = family_of(hf_config)
    quant = getattr(hf_config, "quantization_config", None) or {}
    return spec is not None and spec.reads_block_fp8 and isinstance(quant, dict) and quant.get("quant_method") == "fp8"


def block_fp8_families() -> list[str]:
    return [mt for mt, spec in FAMILIES.items() if spec.reads_block_fp8]
