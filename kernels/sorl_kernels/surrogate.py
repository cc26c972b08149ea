"""Fused clipped surrogate: per-token loss, clip indicators and the gradient, one pass.

Reference: ``sorl_megatron.algorithms.reference.clipped_surrogate_torch`` (PPO / SORL eq.
1 and 3 with asymmetric and dual clip). With ``w`` the loss ratio (token, turn or sequence
level, already broadcast to tokens) and ``A`` the (detached) advantage::

    l = max(-A w, -A clip(w, lo, hi));  l = min(l, -A c) where A < 0     (dual clip c)

The torch version runs about a dozen elementwise ops, each writing a ``[B, T]`` tensor, and
autograd keeps several of them. This kernel reads ``w``, ``A`` and the mask once and writes
``l``, the three indicators and ``dl/dw``; the backward is one multiply.

``dl/dw`` reproduces torch autograd's subgradients exactly, ties included: ``max``/``min``
split the gradient in half between equal operands and ``clamp`` passes it on the closed
interval ``[lo, hi]``, so the Triton and torch losses have the same gradient everywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK: int = 1024


@triton.jit
def _surrogate_kernel(
    ratio_ptr, adv_ptr, mask_ptr, loss_ptr, dldw_ptr, high_ptr, low_ptr, dual_ptr,
    n, clip_low, clip_high, dual_clip, HAS_DUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    w = tl.load(ratio_ptr + offs, mask=valid, other=1.0).to(tl.float32)
    a = tl.load(adv_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    on = tl.load(mask_ptr + offs, mask=valid, other=0) != 0
    neg_a = -a
    unclipped = neg_a * w
    clipped = neg_a * tl.minimum(tl.maximum(w, clip_low), clip_high)
    inside = (w >= clip_low) & (w <= clip_high)
    loss = tl.maximum(unclipped, clipped)
    # torch.maximum's backward: the larger operand gets the gradient, ties split it in half.
    share_u = tl.where(unclipped > clipped, 1.0, tl.where(unclipped == clipped, 0.5, 0.0))
    dldw = share_u * neg_a + (1.0 - share_u) * tl.where(inside, neg_a, 0.0)
    if HAS_DUAL:
        bound = neg_a * dual_clip
        share = tl.where(loss < bound, 1.0, tl.where(loss == bound, 0.5, 0.0))  # torch.minimum's backward
        dldw = tl.where(a < 0, share * dldw, dldw)
        loss = tl.where(a < 0, tl.minimum(loss, bound), loss)
        dual = on & (a < 0) & (w > dual_clip)
    else:
        dual = tl.zeros((BLOCK,), tl.int1)
    tl.store(loss_ptr + offs, loss.to(loss_ptr.dtype.element_ty), mask=valid)
    tl.store(dldw_ptr + offs, dldw, mask=valid)
    tl.store(high_ptr + offs, (on & (a > 0) & (w > clip_high)).to(tl.uint8), mask=valid)
    tl.store(low_ptr + offs, (on & (a < 0) & (w < clip_low)).to(tl.uint8), mask=valid)
    tl.store(dual_ptr + offs, dual.to(tl.uint8), mask=valid)


class ClippedSurrogate(torch.autograd.Function):
    """``(l, clip_high, clip_low, dual)``; differentiable in ``ratio`` only (advantages are
    constants of the loss, detached by the caller)."""

    @staticmethod
    def forward(ctx, ratio, advantages, mask, clip_low, clip_high, dual_clip):
        shape = ratio.shape
        w = ratio.contiguous()
        a = advantages.to(w.dtype).contiguous()
        m = mask.to(torch.bool).contiguous()
        loss = torch.empty_like(w)
        dldw = torch.empty(shape, dtype=torch.float32, device=w.device)
        high, low, dual = (torch.empty(shape, dtype=torch.bool, device=w.device) for _ in range(3))
        n = w.numel()
        if n:
            as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731  (bool storage, no copy)
            _surrogate_kernel[(triton.cdiv(n, BLOCK),)](
                w, a, as_bytes(m), loss, dldw, as_bytes(high), as_bytes(low), as_bytes(dual), n,
                float(clip_low), float(clip_high), float(dual_clip) if dual_clip is not None else 0.0,
                HAS_DUAL=dual_clip is not None, BLOCK=BLOCK,
            )
        ctx.save_for_backward(dldw)
        ctx.mark_non_differentiable(high, low, dual)
        return loss, high, low, dual

    @staticmethod
    def backward(ctx, grad_loss, *_flag_grads):
        (dldw,) = ctx.saved_tensors
        grad = (grad_loss.float() * dldw).to(grad_loss.dtype)
        return grad, None, None, None, None, None


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    clip_low: float, clip_high: float, dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ``(per_token, clip_high, clip_low, dual)``; same contract as the torch reference."""
    return ClippedSurrogate.apply(ratio, advantages, mask, clip_low, clip_high, dual_clip)
