"""Rollout precision: fp32, bf16, or emulated FP8 (block-quantized e4m3 weights).

``fp8`` reproduces the weight error of an FP8 inference server (DeepSeek-V3 / Qwen3-FP8
style 128x128 blocks, one fp32 scale per block, values in float8_e4m3fn) by quantizing and
immediately dequantizing the linear weights, then computing in bf16 as such servers do.
Embeddings, the LM head, norms and MoE routers stay unquantized, as in those checkpoints.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..common.fp8 import dequantize_block_fp8, quantize_block_fp8
from ..common.protocol import PRECISIONS

Precision = Literal["fp32", "bf16", "fp8"]


def fp8_block_roundtrip(weight: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Quantize the last two dims of ``weight`` to e4m3 in ``block x block`` tiles and back.

    Works on 2-D linear weights and on 3-D fused expert weights ``[E, out, in]`` alike (one
    2-D quantization per expert); the quantizer is the one the FP8 checkpoint export uses
    (``sorl_megatron.common.fp8``), so the embedded server sees exactly the weights an FP8
    server would load from that export.
    """
    tiles = (block, block)
    mats = weight.detach().reshape(-1, *weight.shape[-2:])
    out = torch.stack([dequantize_block_fp8(*quantize_block_fp8(m, tiles), torch.float32, tiles) for m in mats])
    return out.reshape(weight.shape).to(weight.dtype)


def _is_quantized_weight(name: str, param: torch.Tensor) -> bool:
    if param.ndim < 2:
        return False
    skip = ("embed_tokens", "lm_head", "norm", ".gate.weight", "router")
    return not any(s in name for s in skip)


@torch.no_grad()
def apply_precision(model: torch.nn.Module, precision: Precision, block: int = 128) -> torch.nn.Module:
    """Cast (and for fp8, quantize-dequantize) ``model`` in place; returns it."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not one of {list(PRECISIONS)}")
    if precision == "fp32":
        return model.float()
    if precision == "fp8":
        for name, param in model.named_parameters():
            if _is_quantized_weight(name, param):
                param.copy_(fp8_block_roundtrip(param, block))
    return model.to(torch.bfloat16)
