"""Segmented mean + broadcast (the turn-ratio hot path), forward and backward.

For a flattened ``[N]`` tensor ``x`` with a segment id per token (``S`` = the dummy segment of
non-policy tokens) the operator is::

    y_i = (1 / |k(i)|) * sum_{j : k(j) = k(i)} x_j      if k(i) < S      (SORL eq. 4, in log space)
    y_i = 0                                              otherwise

In matrix form ``y = P x`` with ``P = M^T D^{-1} M`` (``M`` the token-to-segment incidence
restricted to policy tokens, ``D`` the segment lengths). ``P`` is symmetric, so the backward
is the same operator applied to the incoming gradient: ``dL/dx = P^T g = P g`` (the
``w_k / |y^k|`` factor of SORL eq. 23 comes from the ``exp`` that follows, not from here).

Two launches per application: a scatter-add of tokens into per-segment sums (fp32, fp64 for
fp64 inputs; ``atomic_add`` because ids may come in any order, e.g. explicit rollout turn
ids), then a gather that divides by the length and writes each token's mean. Results equal
the torch path up to the order of the fp32 additions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK: int = 1024


@triton.jit
def _segment_sum_kernel(values_ptr, seg_ptr, sums_ptr, n_tokens, n_segments, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n_tokens
    seg = tl.load(seg_ptr + offs, mask=in_range, other=n_segments)
    policy = in_range & (seg < n_segments)
    # Non-policy tokens are never loaded, so NaN/-inf at padding cannot leak into a sum.
    x = tl.load(values_ptr + offs, mask=policy, other=0.0).to(sums_ptr.dtype.element_ty)
    tl.atomic_add(sums_ptr + seg, x, mask=policy)


@triton.jit
def _segment_broadcast_kernel(sums_ptr, length_ptr, seg_ptr, out_ptr, n_tokens, n_segments, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n_tokens
    seg = tl.load(seg_ptr + offs, mask=in_range, other=n_segments)
    policy = in_range & (seg < n_segments)
    total = tl.load(sums_ptr + seg, mask=policy, other=0.0)
    length = tl.load(length_ptr + seg, mask=policy, other=1.0)
    y = tl.where(policy, total / length, 0.0)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=in_range)


def _apply(values: torch.Tensor, segment_index: torch.Tensor, segment_length: torch.Tensor) -> torch.Tensor:
    """One application of ``P`` (no autograd)."""
    x = values.contiguous().reshape(-1)
    seg = segment_index.contiguous().reshape(-1)
    if seg.numel() != x.numel():
        raise ValueError(f"segment_index has {seg.numel()} entries, values {x.numel()}")
    n_segments = int(segment_length.numel())
    length = segment_length.to(device=x.device, dtype=torch.float32).contiguous()
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # fp32 accumulation for 16-bit inputs
    length = length.to(acc)
    sums = torch.zeros(max(n_segments, 1), dtype=acc, device=x.device)
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out.reshape(values.shape)
    grid = (triton.cdiv(n, BLOCK),)
    _segment_sum_kernel[grid](x, seg, sums, n, n_segments, BLOCK=BLOCK)
    _segment_broadcast_kernel[grid](sums, length if n_segments else sums, seg, out, n, n_segments, BLOCK=BLOCK)
    return out.reshape(values.shape)


class SegmentMeanBroadcast(torch.autograd.Function):
    """``y = P x`` with ``P`` the symmetric segment-mean-broadcast operator (module docstring)."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, segment_index: torch.Tensor, segment_length: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(segment_index, segment_length)
        return _apply(values, segment_index, segment_length)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        segment_index, segment_length = ctx.saved_tensors
        return _apply(grad_out, segment_index, segment_length), None, None


def segment_mean_broadcast(
    values: torch.Tensor, segment_index: torch.Tensor, segment_length: torch.Tensor
) -> torch.Tensor:
    """Triton segmented mean + broadcast with autograd.

    Args:
        values: ``[B, T]`` (any float dtype; sums accumulate in fp32, fp64 for fp64 inputs; the output has this dtype).
        segment_index: ``[B, T]`` int64 global segment ids; ``>= S`` marks non-policy tokens.
        segment_length: ``[S]`` token count of each segment (>= 1).
    """
    return SegmentMeanBroadcast.apply(values, segment_index, segment_length)
