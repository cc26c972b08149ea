"""Megatron-core models from HuggingFace checkpoints, on CPU and GPU.

Public API (what the RL training engine and the conversion CLI build on):

    layout = ParallelLayout(tp=2, pp=1, ep=1)
    init_parallel(layout)                        # gloo on CPU, nccl on GPU (optional:
                                                 # build_model initializes when needed)
    model = build_model("/path/to/hf", layout)   # MegatronModel: .chunks, .bridge, .config
    logits = forward_logits(model, tokens)       # [b, s, V], any layout
    for bucket in iter_hf_weight_buckets(model, bucket_bytes=...): ...   # weight sync
    save_hf_checkpoint(model, out_dir, fp8=False)
    save_megatron_checkpoint(model, ckpt_dir); load_megatron_checkpoint(ckpt_dir, other_layout)

Importing this package does not import megatron (only torch/transformers); megatron is
imported when a model is built or groups are initialized.
"""

from .cpu_compat import apply_cpu_compat, applied_patches
from .dist_ckpt import (
    load_megatron_checkpoint,
    load_megatron_checkpoint_into,
    read_checkpoint_meta,
    save_megatron_checkpoint,
)
from .fp8 import dequantize_block_fp8, dequantize_hf_state_dict, quantize_block_fp8
from .forward import causal_attention_mask, forward_logits
from .hf_config import CheckpointFileError, load_hf_config
from .layout import (
    SUPPORTED_MODEL_TYPES,
    LayoutError,
    ParallelLayout,
    UnsupportedModelError,
    validate_layout,
)
from .model import MegatronModel, ModelOptions, ScalarValueHead, build_model
from .parallel import current_layout, destroy_parallel, init_distributed, init_parallel
from .weights import (
    iter_hf_weight_buckets,
    iter_hf_weights,
    load_hf_weights,
    save_hf_checkpoint,
)

__all__ = [
    "CheckpointFileError",
    "LayoutError",
    "MegatronModel",
    "ModelOptions",
    "ParallelLayout",
    "SUPPORTED_MODEL_TYPES",
    "ScalarValueHead",
    "UnsupportedModelError",
    "apply_cpu_compat",
    "applied_patches",
    "build_model",
    "causal_attention_mask",
    "current_layout",
    "dequantize_block_fp8",
    "dequantize_hf_state_dict",
    "destroy_parallel",
    "forward_logits",
    "init_distributed",
    "init_parallel",
    "iter_hf_weight_buckets",
    "iter_hf_weights",
    "load_hf_config",
    "load_hf_weights",
    "load_megatron_checkpoint",
    "load_megatron_checkpoint_into",
    "quantize_block_fp8",
    "read_checkpoint_meta",
    "save_hf_checkpoint",
    "save_megatron_checkpoint",
    "validate_layout",
]
