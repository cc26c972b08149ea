"""Block-wise FP8 (e4m3) weights in the HF format SGLang and vLLM load for FP8 inference.

Each 2-D linear weight W [out, in] becomes
  `<name>`              float8_e4m3fn [out, in]
  `<name>_scale_inv`    float32 [ceil(out/128), ceil(in/128)]   (W ~= q * scale_inv per block)
and config.json gets quantization_config = {quant_method: fp8, fmt: e4m3,
activation_scheme: dynamic, weight_block_size: [128, 128]} (DeepSeek-V3's layout).
Embeddings, lm_head, norms, biases and MoE router gates stay in high precision.
"""

from __future__ import annotations

import math
import re
from typing import Iterator

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
FP8_BLOCK = (128, 128)

# Linear projections inside decoder layers (with MLA's latent projections, quantized in
# DeepSeek-V3's own FP8 checkpoint too); routers (`mlp.gate`, `block_sparse_moe.gate`,
# `shared_expert_gate`) and the expert-score bias are matched out because they decide routing.
_QUANTIZED = re.compile(
    r"^model\.layers\.\d+\..*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3"
    r"|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight$"
)


def fp8_quantization_config(block: tuple[int, int] = FP8_BLOCK) -> dict:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [int(block[0]), int(block[1])],
    }


def is_fp8_target(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and tensor.is_floating_point() and bool(_QUANTIZED.match(name))


def _block_view(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """Pad W to whole blocks and view it as [rows/b0, b0, cols/b1, b1]."""
    out_dim, in_dim = w.shape
    b0, b1 = block
    rows, cols = math.ceil(out_dim / b0), math.ceil(in_dim / b1)
    padded = torch.zeros(rows * b0, cols * b1, dtype=torch.float32, device=w.device)
    padded[:out_dim, :in_dim] = w.float()
    return padded.view(rows, b0, cols, b1), rows, cols


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (q float8_e4m3fn [out, in], scale_inv float32 [ceil(out/b0), ceil(in/b1)])."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    out_dim, in_dim = w.shape
    if w.is_meta:  # no values to quantize (the sync planner's full-size export): the pair's shapes and dtypes
        rows, cols = math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1])
        return (torch.empty(out_dim, in_dim, dtype=FP8_DTYPE, device="meta"),
                torch.empty(rows, cols, dtype=torch.float32, device="meta"))
    blocks, rows, cols = _block_view(w, block)
    amax = blocks.abs().amax(dim=(1, 3))  # [rows, cols]
    # An all-zero block gets scale 1 (any scale reproduces zeros exactly).
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(rows * block[0], cols * block[1])[:out_dim, :in_dim].contiguous()
    return q, scale_inv.contiguous()


def dequantize_block_fp8(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32, block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """Inverse of quantize_block_fp8 (up to FP8 rounding)."""
    out_dim, in_dim = q.shape
    rows, cols = math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1])
    if tuple(scale_inv.shape) != (rows, cols):
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(q.shape)} "
            f"with {block[0]}x{block[1]} blocks (expected {(rows, cols)})"
        )
    scale = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (q.float() * scale[:out_dim, :in_dim]).to(dtype)


def quantize_hf_tensor(
    name: str, tensor: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) -> FP8 pair for linear weights, unchanged otherwise."""
    if is_fp8_target(name, tensor):
        q, scale_inv = quantize_block_fp8(tensor, block)
        yield name, q
        yield f"{name}_scale_inv", scale_inv
    else:
        yield name, tensor


def dequantize_hf_state_dict(
    state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32, block: tuple[int, int] = FP8_BLOCK
) -> dict[str, torch.Tensor]:
    """An FP8 HF state dict (as written by save_hf_checkpoint(fp8=True)) back to `dtype`."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == FP8_DTYPE:
            scale_name = f"{name}_scale_inv"
            if scale_name not in state:
                raise KeyError(f"FP8 tensor {name!r} has no {scale_name!r}")
            out[name] = dequantize_block_fp8(tensor, state[scale_name], dtype, block)
        else:
            out[name] = tensor
    return out
