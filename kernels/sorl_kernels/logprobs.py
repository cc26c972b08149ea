"""Vocabulary-chunked log-prob / entropy kernels (partials forward, local backward).

The math, the partials' definition and the tensor-parallel combine live in
``sorl_megatron.algorithms.logprobs`` (eq. 1-4 there); these kernels compute the same two
things as its torch reference, with the same signatures, so both plug into one autograd
function:

- :func:`vocab_partials`: one program per row streams the row's shard in ``BLOCK_V`` columns
  and keeps the online max / sum-exp / shifted first moment in registers (no ``[N, V]`` fp32
  buffer at all, not even a chunk of it in global memory);
- :func:`logprob_entropy_grad`: one program per (row, column block) recomputes
  ``p = exp(z - lse)`` and writes ``dL/dlogits`` (eq. 3-4) in the logits dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK_V: int = 1024


class Partials(NamedTuple):
    max: torch.Tensor
    sum_exp: torch.Tensor
    sum_exp_shift: torch.Tensor
    target: torch.Tensor


@triton.jit
def _partials_kernel(
    logits_ptr, row_stride, targets_ptr, m_ptr, s_ptr, u_ptr, t_ptr, width, vocab_start, temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    target = tl.load(targets_ptr + row) - vocab_start
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    u = tl.zeros((), tl.float32)
    picked = tl.zeros((), tl.float32)
    for start in range(0, width, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < width
        z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        shift = tl.where(valid, z - m_new, 0.0)
        e = tl.where(valid, tl.exp(shift), 0.0)
        scale = tl.exp(m - m_new)
        moved = tl.where(s > 0, m - m_new, 0.0) * s  # s = 0, m = -inf before the first block
        u = scale * (u + moved) + tl.sum(tl.where(e > 0, e * shift, 0.0), axis=0)  # -inf logits: 0, not NaN
        s = scale * s + tl.sum(e, axis=0)
        m = m_new
        picked += tl.sum(tl.where(valid & (cols == target), z, 0.0), axis=0)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(u_ptr + row, u)
    tl.store(t_ptr + row, picked)


@triton.jit
def _grad_kernel(
    logits_ptr, row_stride, grad_ptr, grad_row_stride, targets_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr,
    width, vocab_start, temperature, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < width
    target = tl.load(targets_ptr + row) - vocab_start
    lse = tl.load(lse_ptr + row)
    ent = tl.load(ent_ptr + row)
    g_lp = tl.load(g_lp_ptr + row)
    g_ent = tl.load(g_ent_ptr + row)
    z = tl.load(logits_ptr + row * row_stride + cols, mask=valid, other=0.0).to(tl.float32) / temperature
    logp = z - lse
    p = tl.exp(logp)
    onehot = tl.where(cols == target, 1.0, 0.0)
    ent_term = tl.where(p > 0, p * (logp + ent), 0.0)  # p log p -> 0 as p -> 0
    g = (g_lp * (onehot - p) - g_ent * ent_term) / temperature
    tl.store(grad_ptr + row * grad_row_stride + cols, g.to(grad_ptr.dtype.element_ty), mask=valid)


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be [N, V_local] with unit column stride")


def vocab_partials(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    temperature: float = 1.0,
    chunk_size: int = BLOCK_V,
) -> Partials:
    """Per-row ``(max, sum_exp, sum_exp_shift, target)`` fp32 partials of a ``[N, V_local]`` shard.

    ``chunk_size`` is the column block ``BLOCK_V`` (rounded up to a power of two).
    """
    _check(logits)
    n, width = logits.shape
    stats = torch.empty(4, n, dtype=torch.float32, device=logits.device)
    if n:
        block = triton.next_power_of_2(max(1, min(chunk_size, width)))
        _partials_kernel[(n,)](
            logits, logits.stride(0), targets.long().contiguous(), stats[0], stats[1], stats[2], stats[3],
            width, vocab_start, float(temperature), BLOCK_V=block,
        )
    return Partials(*stats.unbind(0))


def logprob_entropy_grad(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
    grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor, vocab_start: int = 0, temperature: float = 1.0,
    chunk_size: int = BLOCK_V,
) -> torch.Tensor:
    """``dL/dlogits`` of the shard (eq. 3-4 of the algorithms module), in the logits dtype."""
    _check(logits)
    n, width = logits.shape
    grad = torch.empty_like(logits)
    if n and width:
        block = triton.next_power_of_2(max(1, min(chunk_size, width)))
        f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
        _grad_kernel[(n, triton.cdiv(width, block))](
            logits, logits.stride(0), grad, grad.stride(0), targets.long().contiguous(), f32(lse), f32(entropy),
            f32(grad_logprobs), f32(grad_entropy), width, vocab_start, float(temperature), BLOCK_V=block,
        )
    return grad


class TritonLogProbKernels:
    """Backend object for ``sorl_megatron.algorithms.logprobs.token_logprobs_entropy(kernels=...)``."""

    partials = staticmethod(vocab_partials)
    grad = staticmethod(logprob_entropy_grad)
