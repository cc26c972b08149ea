"""What each supported HF family needs beyond mbridge's defaults, and what it refuses.

Pure Python (no megatron import), so `validate_layout` can run these checks before any process
group exists. `family_config_overrides` returns TransformerConfig fields that make megatron
compute what transformers computes for that family; `check_family` raises
`UnsupportedModelError` (naming the config key) for configurations megatron 0.16.1 / mbridge
0.15.1 cannot reproduce exactly.

What mbridge 0.15.1's bridges leave out, fixed here:

- deepseek_v3: group-limited top-k (`n_group`, `topk_group`) is never set; MTP is built from
  `num_nextn_predict_layers` (TE spec and 61 layers only); the expert bias is updated during
  training; the shared expert overlaps on a CUDA side stream.
- glm4_moe: q/k/v biases always on (`attention_bias` ignored); the shared experts sized
  `moe_intermediate_size` whatever `n_shared_experts`; sequence aux loss on; group-limited
  top-k never set. (`partial_rotary_factor`: hf_config.py.)
- qwen2_moe: the shared expert's sigmoid gate (`moe_shared_expert_gate`) is never set; top-k
  renormalization always on (`norm_topk_prob` ignored).

Refused for every family (mbridge builds the model but its logits differ from transformers'):
a sliding attention window; `attention_bias=True` for qwen3 / qwen3_moe / llama (transformers
also biases o_proj); `mlp_bias=True` for llama.
"""

from __future__ import annotations

from typing import Any, Optional

SIGMOID_FAMILIES = ("deepseek_v3", "glm4_moe")
SHARED_EXPERT_FAMILIES = ("deepseek_v3", "glm4_moe", "qwen2_moe")


class FamilyConfigError(ValueError):
    """A config value of a supported family that this package cannot reproduce exactly."""


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    value = getattr(cfg, name, None)
    return default if value is None else value


def first_k_dense(hf_config: Any) -> int:
    """Leading dense (non-MoE) layers: DeepSeek-V3 / GLM-4.5 `first_k_dense_replace`."""
    if hf_config.model_type in SIGMOID_FAMILIES:
        return min(int(_get(hf_config, "first_k_dense_replace", 0)), int(hf_config.num_hidden_layers))
    return 0


def routing_shape(hf_config: Any) -> tuple[int, int]:
    """``(rows, top_k)`` of the routed experts a server returns for this model: SGLang captures
    one row per decoder layer (``num_hidden_layers``; the leading dense layers, see
    :func:`first_k_dense`, are never routed) of ``num_experts_per_tok`` ids."""
    top_k = int(_get(hf_config, "num_experts_per_tok", 0) or 0)
    if top_k < 1:
        raise FamilyConfigError(
            f"{hf_config.model_type}: config.json has no num_experts_per_tok: not a MoE model, it returns no "
            "routed experts (algorithm.routing_replay r3 needs one)")
    return int(hf_config.num_hidden_layers), top_k


def mtp_layers(hf_config: Any) -> int:
    """Multi-token-prediction modules the HF checkpoint carries (never built here)."""
    return int(_get(hf_config, "num_nextn_predict_layers", 0) or 0)


def shared_expert_size(hf_config: Any) -> int:
    mt = hf_config.model_type
    if mt == "qwen2_moe":
        return int(_get(hf_config, "shared_expert_intermediate_size", 0))
    if mt in ("deepseek_v3", "glm4_moe"):
        return int(hf_config.moe_intermediate_size) * int(_get(hf_config, "n_shared_experts", 0))
    return 0


# transformers' attention of these families reads `sliding_window`: per layer (`layer_types`) for
# the first three, on every layer whenever it is set for the last two; the other families ignore it.
WINDOW_BY_LAYER_TYPE = ("qwen2", "qwen3", "qwen2_moe")
WINDOW_ON_EVERY_LAYER = ("qwen3_moe", "mixtral")


def sliding_window_in_use(hf_config: Any) -> Optional[int]:
    """The attention window transformers applies to some layer, or None (full causal attention
    everywhere). A window of at least max_position_embeddings never drops a position."""
    mt = getattr(hf_config, "model_type", None)
    if mt not in WINDOW_BY_LAYER_TYPE + WINDOW_ON_EVERY_LAYER:
        return None
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None) if mt in WINDOW_BY_LAYER_TYPE else None
    if not window or (types is not None and "sliding_attention" not in types):
        return None
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    return None if max_pos is not None and int(window) >= int(max_pos) else int(window)


def check_family(hf_config: Any) -> None:
    """Raise FamilyConfigError for family features the Megatron model would compute differently."""
    mt = getattr(hf_config, "model_type", None)
    window = sliding_window_in_use(hf_config)
    if window is not None:
        raise FamilyConfigError(
            f"{mt} with sliding-window attention (sliding_window={window}, use_sliding_window / layer_types): "
            "mbridge 0.15.1 builds full causal attention on every layer"
        )
    if mt in ("qwen3", "qwen3_moe", "llama") and bool(_get(hf_config, "attention_bias", False)):
        raise FamilyConfigError(
            f"{mt} with attention_bias=True: transformers then biases the output projection (o_proj) too, "
            "which megatron can bias only together with the MLP (add_bias_linear)"
        )
    if mt == "llama" and bool(_get(hf_config, "mlp_bias", False)):
        raise FamilyConfigError("llama with mlp_bias=True: mbridge 0.15.1 builds and maps no MLP biases")
    if mt == "qwen2_moe":
        dense = list(_get(hf_config, "mlp_only_layers", []) or [])
        step = int(_get(hf_config, "decoder_sparse_step", 1))
        if dense or step != 1:
            raise FamilyConfigError(
                f"qwen2_moe with dense layers (mlp_only_layers={dense}, decoder_sparse_step={step}) is not "
                "supported: mbridge 0.15.1's Qwen2-MoE bridge maps MoE layers only"
            )
        if int(_get(hf_config, "shared_expert_intermediate_size", 0)) <= 0:
            raise FamilyConfigError("qwen2_moe needs shared_expert_intermediate_size > 0 (its shared expert)")
    if mt in SIGMOID_FAMILIES:
        if not bool(_get(hf_config, "norm_topk_prob", True)) and int(hf_config.num_experts_per_tok) > 1:
            raise FamilyConfigError(
                f"{mt} with norm_topk_prob=False: megatron's sigmoid router always renormalizes the top-k "
                "scores (moe_utils.topk_routing_with_score_function)"
            )
        groups, group_topk = int(_get(hf_config, "n_group", 1)), int(_get(hf_config, "topk_group", 1))
        topk, experts = int(hf_config.num_experts_per_tok), int(hf_config.n_routed_experts)
        if groups > 1:
            if experts % groups:
                raise FamilyConfigError(f"{mt}: n_group={groups} does not divide n_routed_experts={experts}")
            # HF scores a group by its top-2 experts; megatron by its top-(topk // group_topk).
            if group_topk < 1 or topk % group_topk or topk // group_topk != 2:
                raise FamilyConfigError(
                    f"{mt}: group-limited routing with num_experts_per_tok={topk}, topk_group={group_topk}: "
                    "HF sums each group's top-2 scores, megatron its top-(num_experts_per_tok // topk_group) "
                    "(moe_utils.group_limited_topk); they agree only when that is 2"
                )
        if mt == "deepseek_v3":
            _mla_yarn(hf_config)  # raises for YaRN variants megatron lacks
        if mt == "deepseek_v3" and bool(_get(hf_config, "attention_bias", False)):
            raise FamilyConfigError("deepseek_v3 with attention_bias=True: megatron's MLA has no projection biases")


def local_spec_layout_problem(hf_config: Any, tp: int) -> Optional[str]:
    """Layout limits of the CPU (local) layer spec only: its MLA splits the q / kv down
    projections over TP (TE's spec replicates them), so TP must divide their output sizes.
    Returns what is wrong (build_model raises it as a LayoutError on `tp`), or None."""
    if getattr(hf_config, "model_type", None) != "deepseek_v3" or tp == 1:
        return None
    q_rank = _get(hf_config, "q_lora_rank")
    kv = int(hf_config.kv_lora_rank) + int(hf_config.qk_rope_head_dim)
    if q_rank is not None and int(q_rank) % tp:
        return f"TP={tp} does not divide q_lora_rank={q_rank} (the local spec splits MLA's q down projection)"
    if kv % tp:
        return (f"TP={tp} does not divide kv_lora_rank + qk_rope_head_dim = {kv} "
                "(the local spec splits MLA's kv down projection)")
    return None


def _mla_yarn(hf_config: Any) -> dict[str, Any]:
    """MLA's YaRN fields from transformers 5's `rope_parameters` (mbridge reads the transformers 4
    `rope_scaling` attribute, which no longer holds them, and builds plain RoPE)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "yarn":
        return {}
    out = {"rope_type": "yarn", "rotary_scaling_factor": float(rope["factor"]),
           "original_max_position_embeddings": int(rope["original_max_position_embeddings"])}
    for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if rope.get(key) is not None:
            out[key] = float(rope[key])
    if rope.get("attention_factor") is not None or rope.get("truncate") is False:
        raise FamilyConfigError("deepseek_v3 YaRN with attention_factor or truncate=False: megatron's YaRN has neither")
    return out


def family_config_overrides(hf_config: Any, on_gpu_te: bool) -> dict[str, Any]:
    """TransformerConfig overrides (applied after mbridge's) for the MoE families that need them."""
    mt = hf_config.model_type
    over: dict[str, Any] = {}
    if mt == "qwen2_moe":
        over["moe_shared_expert_gate"] = True
        # HF Qwen2-MoE renormalizes the top-k softmax probabilities only with norm_topk_prob.
        over["moe_router_pre_softmax"] = not bool(_get(hf_config, "norm_topk_prob", False))
    if mt in SIGMOID_FAMILIES:
        groups = int(_get(hf_config, "n_group", 1))
        if groups > 1:
            over["moe_router_num_groups"] = groups
            over["moe_router_group_topk"] = int(_get(hf_config, "topk_group", 1))
        over["moe_router_topk_scaling_factor"] = float(_get(hf_config, "routed_scaling_factor", 1.0))
        # RL keeps the load-balancing bias the checkpoint has (the rollout engine routes with it).
        over["moe_router_bias_update_rate"] = 0.0
        over["moe_router_load_balancing_type"] = "none"
        over["moe_shared_expert_intermediate_size"] = shared_expert_size(hf_config)
        over["mtp_num_layers"] = None  # MTP weights are skipped on load (see docs/conversion.md)
    if mt == "deepseek_v3":
        over.update(_mla_yarn(hf_config))
    if mt == "glm4_moe":
        over["add_qkv_bias"] = bool(_get(hf_config, "attention_bias", False))
    if mt == "deepseek_v3" and not on_gpu_te:
        # mbridge asks for TE's fused attention backend; megatron records the choice in the
        # process-wide NVTE_* variables and then refuses any later model built with the default
        # 'auto' backend in the same process (language_module.py:102). Without TE the local
        # attention runs whatever the flag says, so keep the default.
        over["attention_backend"] = "auto"
    if mt in SHARED_EXPERT_FAMILIES and not on_gpu_te:
        # Overlapping the shared expert with the dispatcher runs it on a side CUDA stream.
        over["moe_shared_expert_overlap"] = False
    return over
