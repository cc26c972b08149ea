"""Log-probs of target tokens and entropy from logits, chunked over the vocabulary.

``log_softmax(logits.float())`` costs ``T x V x 4`` bytes (4.9 GB for T = 8k, V = 152k) and
autograd keeps it for the backward. Here only ``[T, chunk]`` fp32 temporaries exist: the
forward streams over vocabulary chunks with an online log-sum-exp, the backward recomputes
each chunk's softmax from the saved per-row ``lse`` and entropy.

With ``z = logits / temperature`` (one row; ``p = softmax(z)``, ``lse = log sum_j exp z_j``)::

    log p(y)  = z_y - lse                                                    (1)
    H         = lse - sum_j p_j z_j = -sum_j p_j log p_j                     (2)
    d log p(y) / d z_j = 1[j = y] - p_j                                      (3)
    d H / d z_j        = -p_j (z_j - sum_k p_k z_k) = -p_j (log p_j + H)     (4)

Tensor-parallel vocabulary: each rank holds columns ``[vocab_start, vocab_start + V_local)``
and computes *partials* of its shard (:class:`VocabPartials`): the local max ``m``, the
sum-exp ``s = sum exp(z - m)``, the shifted first moment ``u = sum exp(z - m) (z - m)`` and
the target logit (0 when the target lives on another rank). The caller's ``all_reduce(x, op)``
hook (``op`` in ``"max"``, ``"sum"``; e.g. ``torch.distributed.all_reduce`` over the TP group)
combines them (:func:`combine_partials`). Given the global ``lse`` and ``H``, eq. 3-4 are
local to each column, so the backward needs no communication. This module imports nothing
distributed; the hook is the only seam.

The reference kernels here are pure torch (a Python loop over vocabulary chunks only); the
Triton kernels in ``sorl_kernels.logprobs`` compute the same partials and gradient and plug
into the same autograd function (see ``dispatch.py``).
"""

from __future__ import annotations

from typing import Callable, Literal, NamedTuple, Protocol

import torch

AllReduce = Callable[[torch.Tensor, Literal["max", "sum"]], torch.Tensor]
"""``all_reduce(tensor, op) -> reduced tensor`` across the tensor-parallel vocabulary shards."""

DEFAULT_CHUNK: int = 4096


class VocabPartials(NamedTuple):
    """Per-row statistics of one vocabulary shard, all ``[N]`` fp32 (fp64 for fp64 logits)."""

    max: torch.Tensor  # m = max_j z_j
    sum_exp: torch.Tensor  # s = sum_j exp(z_j - m)
    sum_exp_shift: torch.Tensor  # u = sum_j exp(z_j - m) (z_j - m)
    target: torch.Tensor  # z_y if y is on this shard, else 0


class LogProbKernels(Protocol):
    """The two kernels a backend supplies (torch reference below, Triton in ``sorl_kernels``)."""

    def partials(
        self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, temperature: float, chunk_size: int
    ) -> VocabPartials: ...

    def grad(
        self, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
        grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor, vocab_start: int, temperature: float, chunk_size: int,
    ) -> torch.Tensor: ...


def _acc_dtype(logits: torch.Tensor) -> torch.dtype:
    # fp32 accumulation for 16/32-bit logits; fp64 stays fp64 so gradcheck can run in double.
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _chunk(logits: torch.Tensor, start: int, chunk_size: int, temperature: float) -> torch.Tensor:
    """``z`` of one chunk in the accumulator dtype: a view of the logits where they are already in
    it and there is no temperature (read only: no copy of the chunk), else a fresh tensor."""
    z = logits[:, start : start + chunk_size]
    if z.dtype == _acc_dtype(logits) and temperature == 1.0:
        return z
    z = z.to(_acc_dtype(logits), copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


def _finite_floor(t: torch.Tensor) -> torch.Tensor:
    """``t`` with -inf raised to the dtype's lowest finite value, in place: a term ``x * e`` with
    ``e = exp(x) = 0`` is then 0 instead of ``-inf * 0 = NaN`` (every finite value unchanged)."""
    return t.clamp_(min=torch.finfo(t.dtype).min)


def _pick(z: torch.Tensor, local_target: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose target column lies in this chunk, and that column (chunk coordinates)."""
    col = local_target - start
    rows = ((col >= 0) & (col < z.shape[1])).nonzero().flatten()
    return rows, col[rows]


def vocab_partials_torch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
) -> VocabPartials:
    """Partials of a ``[N, V_local]`` shard with ``[N, chunk]`` temporaries only.

    Online update when the running max moves from ``m`` to ``m'`` (scale ``a = exp(m - m')``):
    ``s' = a s + sum exp(z - m')`` and ``u' = a (u + (m - m') s) + sum exp(z - m') (z - m')``.
    In-place ops keep the live temporaries to two float chunks.
    """
    n, width = logits.shape
    m = torch.full((n,), float("-inf"), dtype=_acc_dtype(logits), device=logits.device)
    s, u, target = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
    local_target = targets.long() - vocab_start
    for start in range(0, width, chunk_size):
        z = _chunk(logits, start, chunk_size, temperature)
        rows, cols = _pick(z, local_target, start)
        target[rows] += z[rows, cols]
        m_new = torch.maximum(m, z.amax(dim=1))
        shift = torch.sub(z, m_new[:, None])
        e = torch.exp(shift)
        chunk_s, chunk_u = e.sum(dim=1), _finite_floor(shift).mul_(e).sum(dim=1)
        scale = torch.exp(m - m_new)
        # (m - m') s is 0 before the first chunk (s = 0, m = -inf would give NaN).
        moved = torch.where(s > 0, m - m_new, torch.zeros_like(s)) * s
        u = scale * (u + moved) + chunk_u
        s = scale * s + chunk_s
        m = m_new
    return VocabPartials(m, s, u, target)


def combine_partials(
    partials: VocabPartials, all_reduce: AllReduce | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global ``(lse, entropy, target_logit)`` per row from each shard's partials.

    With ``M = max_r m_r`` and ``b_r = exp(m_r - M)``: ``S = sum_r b_r s_r``,
    ``U = sum_r b_r (u_r + (m_r - M) s_r)`` (moments re-centred at ``M``), then
    ``lse = M + log S`` and ``H = log S - U / S`` (eq. 2 with ``z - M`` in place of ``z``).
    ``all_reduce=None`` means a single shard.
    """
    m, s, u, target = partials
    if all_reduce is None:
        big_m = m
    else:
        big_m = all_reduce(m.clone(), "max")
    b = torch.exp(m - big_m)
    stacked = torch.stack([b * s, b * (u + (m - big_m) * s), target])
    if all_reduce is not None:
        stacked = all_reduce(stacked, "sum")
    big_s, big_u, target = stacked.unbind(0)
    log_s = torch.log(big_s)
    return big_m + log_s, log_s - big_u / big_s, target


def logprob_entropy_grad_torch(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
    grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor, vocab_start: int = 0, temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """``dL/dlogits`` of a shard from eq. 3-4, recomputing ``p`` chunk by chunk. The output
    (logits dtype) is the only full-vocab tensor; temporaries are two float chunks (one chunk
    covering the whole shard in the logits' dtype is itself the output)."""
    acc = _acc_dtype(logits)
    whole = 0 < logits.shape[1] <= chunk_size and logits.dtype == acc
    grad = None if whole else torch.empty_like(logits)
    local_target = targets.long() - vocab_start
    g_lp, g_h = grad_logprobs.to(acc), grad_entropy.to(acc)[:, None]
    lse, entropy = lse.to(acc)[:, None], entropy.to(acc)[:, None]
    for start in range(0, logits.shape[1], chunk_size):
        logp = torch.sub(_chunk(logits, start, chunk_size, temperature), lse)
        p = torch.exp(logp)
        # p (log p + H), with p log p -> 0 where p == 0.
        ent_term = _finite_floor(logp.add_(entropy)).mul_(p)
        g = p.mul_(-g_lp[:, None]).addcmul_(ent_term, g_h, value=-1.0)  # -g_lp p - g_H p (log p + H)
        rows, cols = _pick(g, local_target, start)
        g[rows, cols] += g_lp[rows]  # the one-hot of eq. 3
        if temperature != 1.0:
            g.div_(temperature)
        if whole:
            return g
        grad[:, start : start + g.shape[1]] = g
    return grad


class TorchLogProbKernels:
    """The pure-torch reference backend."""

    partials = staticmethod(vocab_partials_torch)
    grad = staticmethod(logprob_entropy_grad_torch)


class _LogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, kernels, vocab_start, temperature, chunk_size, all_reduce):
        with torch.no_grad():
            partials = kernels.partials(logits, targets, vocab_start, temperature, chunk_size)
            lse, entropy, target_logit = combine_partials(partials, all_reduce)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.kernels, ctx.vocab_start, ctx.temperature, ctx.chunk_size = kernels, vocab_start, temperature, chunk_size
        return target_logit - lse, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(lse)
        grad = ctx.kernels.grad(
            logits, targets, lse, entropy, grad_logprobs.contiguous(), grad_entropy.contiguous(),
            ctx.vocab_start, ctx.temperature, ctx.chunk_size,
        )
        return grad, None, None, None, None, None, None


def token_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_start: int = 0,
    all_reduce: AllReduce | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    kernels: LogProbKernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token (eq. 1) and the entropy (eq. 2) of ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V_local]`` (any float dtype, finite; a TP rank's vocabulary shard).
        targets: ``[...]`` global token ids. An id on no shard (e.g. an ignore index) gives
            ``-lse``: mask such positions downstream.
        temperature: sampling temperature the log-probs refer to.
        vocab_start: first global id of this shard (0 without TP).
        all_reduce: TP combine hook (module docstring); ``None`` for a full vocabulary.
        chunk_size: vocabulary columns per fp32 temporary (torch backend).
        kernels: backend (``None`` = torch reference; :mod:`..dispatch` passes Triton on CUDA).

    Returns:
        ``(logprobs, entropy)``, each fp32 (fp64 for fp64 logits) with the shape of ``targets``; both differentiable
        with respect to ``logits``.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must be logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    lead = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    lp, ent = _LogProbEntropy.apply(
        flat,
        targets.reshape(-1),
        kernels or TorchLogProbKernels,
        vocab_start,
        float(temperature),
        chunk_size,
        all_reduce,
    )
    return lp.reshape(lead), ent.reshape(lead)


def log_softmax_logprobs_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The materializing baseline (full ``[..., V]`` fp32 log-softmax): tests and benchmarks only."""
    logp = torch.log_softmax(logits.to(_acc_dtype(logits)) / temperature, dim=-1)
    lp = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(dim=-1)
