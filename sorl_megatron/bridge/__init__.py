"""Megatron-core models from HuggingFace checkpoints, on CPU and GPU.

Public API (what the RL training engine and the conversion CLI build on):

    layout = ParallelLayout(tp=2, pp=1, ep=1)
    init_parallel(layout)                        # gloo on CPU, nccl on GPU (optional:
                                                 # build_model initializes when needed)
    model = build_model("/path/to/hf", layout)   # MegatronModel: .chunks, .bridge, .config
    logits = forward_logits(model, tokens)       # [b, s, V], any layout
    for bucket in iter_hf_weight_buckets(model, bucket_bytes=...): ...   # HF tensors in buckets
    save_hf_checkpoint(model, out_dir, fp8=False)
    save_megatron_checkpoint(model, ckpt_dir); load_megatron_checkpoint(ckpt_dir, other_layout)

Names are imported lazily: megatron is imported when a model is built or groups are
initialized, torch/transformers when the first name that needs them is used.
"""

import importlib
from typing import Any

# name -> submodule. Resolved on first use (PEP 562) so that `import sorl_megatron.bridge`
# and `tools/convert.py --help` do not pay for torch/transformers/megatron imports.
_EXPORTS = {
    "apply_cpu_compat": "cpu_compat",
    "applied_patches": "cpu_compat",
    "load_megatron_checkpoint": "dist_ckpt",
    "load_megatron_checkpoint_into": "dist_ckpt",
    "read_checkpoint_meta": "dist_ckpt",
    "save_megatron_checkpoint": "dist_ckpt",
    "dequantize_block_fp8": "..common.fp8",
    "dequantize_hf_state_dict": "..common.fp8",
    "quantize_block_fp8": "..common.fp8",
    "causal_attention_mask": "forward",
    "forward_logits": "forward",
    "CheckpointContentError": "hf_config",
    "CheckpointFileError": "hf_config",
    "load_hf_config": "hf_config",
    "SUPPORTED_MODEL_TYPES": "layout",
    "LayoutError": "layout",
    "ParallelLayout": "layout",
    "UnsupportedModelError": "layout",
    "validate_layout": "layout",
    "MegatronModel": "model",
    "ModelOptions": "model",
    "ScalarValueHead": "model",
    "build_model": "build",
    "current_layout": "parallel",
    "destroy_parallel": "parallel",
    "init_distributed": "parallel",
    "init_parallel": "parallel",
    "iter_hf_weight_buckets": "weights",
    "iter_hf_weights": "weights",
    "load_hf_weights": "weights",
    "save_hf_checkpoint": "weights",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module if module.startswith(".") else f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted(_EXPORTS)
