"""DeepSeek-V3 (``deepseek_v3``; also its descendants with that ``model_type``, e.g. Moonlight):
multi-latent attention (MLA, with or without the q LoRA, YaRN), sigmoid routing
(sigmoid_routing.py), block-FP8 checkpoints.

mbridge 0.15.1's bridge leaves out, fixed here: group-limited top-k (``n_group``,
``topk_group``) is never set; MTP is built from ``num_nextn_predict_layers`` (TE spec and 61
layers only); the expert bias is updated during training; the shared expert overlaps on a CUDA
side stream; YaRN is read from transformers 4's ``rope_scaling`` (plain RoPE under transformers
5). Its bridge class passes ``max_position_embeddings`` to megatron-core 0.16.1's
MLATransformerConfig (TypeError) and reads every checkpoint through its FP8-dequantizing reader
(bf16 on CUDA only): `bridge_class` fixes both.
"""

from __future__ import annotations

from typing import Any, Optional

from . import sigmoid_routing
from .spec import FamilyConfigError, FamilySpec, get, register_family, tiny_base


def tiny_config():
    """MLA with a q LoRA, interleaved rope dims, 1 leading dense layer, 8 routed experts in 2
    groups (1 group per token, top-2: megatron's top-(topk/group_topk) = HF's top-2 per group),
    one shared expert, sigmoid scores with a correction bias, routed scaling 2.5, and an MTP
    module declared (its weights are written by `save_tiny_model` and must be skipped)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **tiny_base(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_key_value_heads=4,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            rope_interleave=True,
            num_nextn_predict_layers=1,
            tie_word_embeddings=False,
        )
    )


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


def check(hf_config: Any) -> None:
    sigmoid_routing.check(hf_config)
    _mla_yarn(hf_config)  # raises for YaRN variants megatron lacks
    if bool(get(hf_config, "attention_bias", False)):
        raise FamilyConfigError("deepseek_v3 with attention_bias=True: megatron's MLA has no projection biases")


def config_overrides(hf_config: Any, on_gpu_te: bool) -> dict[str, Any]:
    over = sigmoid_routing.config_overrides(hf_config)
    over.update(_mla_yarn(hf_config))
    if not on_gpu_te:
        # mbridge asks for TE's fused attention backend; megatron records the choice in the
        # process-wide NVTE_* variables and then refuses any later model built with the default
        # 'auto' backend in the same process (language_module.py:102). Without TE the local
        # attention runs whatever the flag says, so keep the default.
        over["attention_backend"] = "auto"
    return over


def local_spec_problem(hf_config: Any, tp: int) -> Optional[str]:
    """The CPU (local) spec's MLA splits the q / kv down projections over TP (TE's spec
    replicates them), so TP must divide their output sizes."""
    q_rank = get(hf_config, "q_lora_rank")
    kv = int(hf_config.kv_lora_rank) + int(hf_config.qk_rope_head_dim)
    if q_rank is not None and int(q_rank) % tp:
        return f"TP={tp} does not divide q_lora_rank={q_rank} (the local spec splits MLA's q down projection)"
    if kv % tp:
        return (f"TP={tp} does not divide kv_lora_rank + qk_rope_head_dim = {kv} "
                "(the local spec splits MLA's kv down projection)")
    return None


def _mla_config_class(*args, **kwargs):
    """mbridge 0.15.1 passes `max_position_embeddings` (the YaRN original length) to megatron's
    MLATransformerConfig, which 0.16.1 calls `original_max_position_embeddings`: TypeError."""
    from megatron.core.transformer import MLATransformerConfig

    if "max_position_embeddings" in kwargs:  # an explicit override (YaRN, config_overrides) wins
        value = kwargs.pop("max_position_embeddings")
        kwargs.setdefault("original_max_position_embeddings", value)
    return MLATransformerConfig(*args, **kwargs)


def _plain_safetensor_io(self, weights_path: str):
    """mbridge's DeepSeek-V3 bridge reads weights only through its FP8-dequantizing reader
    (bf16 and CUDA only; any other dtype raises `NotImplemented(...)`: TypeError). A checkpoint
    without block-FP8 weights is read as every other family's; an FP8 one keeps mbridge's reader."""
    from mbridge.core.safetensor_io import SafeTensorIO

    quant = getattr(self.hf_config, "quantization_config", None) or {}
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        return type(self).__mro__[1]._get_safetensor_io(self, weights_path)
    return SafeTensorIO(self._get_actual_hf_path(weights_path))


def bridge_class(cls: type) -> type:
    return type(
        "DeepseekV3BridgeFixed",
        (cls,),
        {"TransformerConfigClass": staticmethod(_mla_config_class), "_get_safetensor_io": _plain_safetensor_io},
    )


SPEC = register_family(FamilySpec(
    model_type="deepseek_v3",
    title="DeepSeek-V3",
    tiny_config=tiny_config,
    bridge_class=bridge_class,
    check=check,
    config_overrides=config_overrides,
    local_spec_problem=local_spec_problem,
    dense_prefix_key=sigmoid_routing.DENSE_PREFIX_KEY,
    shared_expert_size=sigmoid_routing.shared_expert_size,
    rope_scaling=("yarn",),
    reads_block_fp8=True,
    tiny_router_std=0.3,
))
