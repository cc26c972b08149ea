"""Masked reductions and loss aggregation over ``[batch, seq]`` tensors.

Every loss in this package is a weighted sum ``sum_t g_t * l_t`` of per-token terms ``l_t``.
The weights ``g_t`` encode the aggregation mode, so the same weights give both the loss and
the exact per-token gradient coefficients the clip-bias statistics need (see
``clip_bias.py``). Aggregation modes (names as in verl / NeMo-RL):

- ``token-mean``: ``g_t = 1 / N_tokens`` (PVPO eq. 5, DAPO).
- ``seq-mean-token-mean``: ``g_t = 1 / (N_seqs * |y_i|)`` (SORL eq. 1/3, GRPO eq. 13).
- ``seq-mean-token-sum``: ``g_t = 1 / N_seqs``.
- ``seq-mean-token-sum-norm``: ``g_t = 1 / L`` with a constant ``L`` (``norm_length``, or
  the padded sequence length): verl's ``agg_loss`` (``sum(loss * mask) / loss_scale_factor``,
  Dr. GRPO's constant normalizer). Despite the name there is no mean over sequences, so the
  loss grows with the mini-batch; verl defines it so and the name is kept for verl users.

``N_tokens`` / ``N_seqs`` default to the counts in the given tensors. An engine that splits a
mini-batch into micro-batches (and data-parallel ranks) passes the mini-batch totals as
``denominator`` so that the summed micro-batch losses equal the mini-batch loss exactly.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1. Masked entries never propagate NaN/Inf."""
    masked = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean over entries where ``mask`` is 1; 0 (not NaN) when nothing is selected."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the selected entries (0 when fewer than two are selected)."""
    count = mask.to(values.dtype).sum()
    mean = masked_mean(values, mask)
    sq = masked_sum((values - mean) ** 2, mask)
    denom = (count - 1) if unbiased else count
    return sq / denom.clamp(min=1)


# Device types whose values the host reads without waiting for a queue of work: there a metric or
# statistic may branch on a value (the cheapest pass); elsewhere the branch-free passes run.
HOST_READ_FREE_DEVICES = ("cpu",)


def host_reads_free(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values on the host costs no wait (:data:`HOST_READ_FREE_DEVICES`)."""
    return tensor.device.type in HOST_READ_FREE_DEVICES


def count64(indicator: torch.Tensor) -> torch.Tensor:
    """The number of true entries of a bool tensor as a float64 scalar: the value of
    ``indicator.sum(dtype=torch.float64)`` (counts are exact in float64), by an integer count,
    10x cheaper on the CPU."""
    return torch.count_nonzero(indicator).to(torch.float64)


def sum64(values: torch.Tensor) -> torch.Tensor:
    """``values.sum(dtype=torch.float64)``, bit for bit. On the CPU the cast first and the sum in
    float64 after: the same cascade of float64 additions (tests/algorithms/test_sum64.py),
    3x cheaper than the sum that casts as it reads."""
    if values.device.type == "cpu":
        return values.to(torch.float64).sum()
    return values.sum(dtype=torch.float64)


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over selected entries; 0 when nothing is selected (no host read)."""
    m = mask.bool()
    top = torch.where(m, values, torch.full_like(values, float("-inf"))).max()
    return torch.where(m.any(), top, torch.zeros_like(top))


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min over selected entries; 0 when nothing is selected (no host read)."""
    m = mask.bool()
    low = torch.where(m, values, torch.full_like(values, float("inf"))).min()
    return torch.where(m.any(), low, torch.zeros_like(low))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalize selected entries to unit variance (and zero mean if ``shift_mean``)."""
    mean = masked_mean(values, mask)
    std = masked_var(values, mask).sqrt()
    out = (values - mean) / (std + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def aggregation_denominator(loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The count a mode divides by, for the rows in ``loss_mask``: tokens or non-empty rows
    (``seq-mean-token-sum-norm`` divides by its constant ``L`` only and ignores it).

    An engine sums this over micro-batches and data-parallel ranks of one mini-batch and
    passes the total back as ``denominator`` to :func:`token_weights`.
    """
    _check_mode(mode)
    mask = loss_mask.to(torch.float32)
    if mode == "token-mean":
        return mask.sum()
    return (mask.sum(dim=-1) > 0).to(torch.float32).sum()


def token_weights(
    loss_mask: torch.Tensor,
    mode: str,
    denominator: float | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Per-token aggregation weights ``g`` such that ``loss = sum(g * per_token_loss)``.

    Rows or tokens with ``loss_mask == 0`` get weight 0; empty rows never divide by zero.
    """
    return loss_mask.to(torch.float32) * token_scale(loss_mask, mode, denominator, norm_length)


def token_scale(
    loss_mask: torch.Tensor,
    mode: str,
    denominator: float | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """The weights of :func:`token_weights` on policy tokens, without the mask: a scalar tensor,
    or ``[B, 1]`` for ``seq-mean-token-mean`` (``g = loss_mask * token_scale``)."""
    _check_mode(mode)
    device = loss_mask.device
    if mode == "seq-mean-token-sum-norm":
        # verl: a plain token sum over the (mini-)batch divided by the constant L, no 1 / N_seqs
        length = float(norm_length if norm_length is not None else loss_mask.shape[-1])
        return torch.tensor(1.0 / max(length, 1.0), dtype=torch.float32, device=device)
    if denominator is None:
        denominator = aggregation_denominator(loss_mask, mode)
    denominator = torch.as_tensor(denominator, dtype=torch.float32, device=device).clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        lengths = loss_mask.sum(dim=-1, keepdim=True, dtype=torch.float32).clamp(min=1.0)
        return 1.0 / (lengths * denominator)
    return 1.0 / denominator


def aggregate(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum(weights * per_token)`` with masked (zero-weight) entries never propagating NaN."""
    return masked_sum(per_token * weights.to(per_token.dtype), weights != 0)


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg: unknown aggregation mode {mode!r}; choose one of {list(LOSS_AGG_MODES)}")
