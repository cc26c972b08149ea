"""Clipping bias and clipping-triggered normalization (SORL Lemma 4.2, eq. 7/8/12/14/15).

PPO's gradient splits into the unclipped importance-weighted policy gradient minus a
*clipping bias* ``C``: the contribution of tokens whose gradient the clip removed
(``t in B^c``, SORL eq. 7 for token PPO, eq. 8 for turn PPO, eq. 14 for GRPO)::

    C = E[ sum_t g_t * 1[t in B^c] * w_t * A_t * grad log pi(y_t) ]

with ``g_t`` the aggregation weight (``1/|y|`` in the paper) and ``w_t`` the ratio the loss
uses (token, turn or sequence level). SO-PPO / SO-GRPO / S-PPO scale the gradient by
``1 / max(||C||, delta)`` (eq. 12/15). The paper leaves the space of ``||C||`` open, so three
modes are offered, all built from the surrogate ``S = sum_t g_t 1[t in B^c] w_t(theta) A_t``
(indicator, advantage and weights detached):

- ``logprob``: ``||dS / d log pi||_2``, the norm of the per-token clip-bias vector ``c_t``;
  closed form below, no extra backward pass.
- ``scalar``: ``|S|``, eq. 7/8 read literally as a scalar.
- ``param_grad``: ``||dS / d theta||_2``, the parameter-space norm (what Fig. 4 plots next to
  the gradient norm); needs a second backward of ``S``.

Both ``S`` and ``sum_t c_t^2`` are sums over tokens, so an engine that splits a mini-batch
across micro-batches and ranks adds them up (with mini-batch aggregation denominators) and
takes the norm once: the factor belongs to the whole mini-batch (eq. 12: the same sampled
trajectories as the gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from .aggregation import host_reads_free
from .config import ClipBiasConfig
from .turns import TurnSegments, segment_sum


@dataclass(frozen=True)
class ClipBiasTerms:
    """Clip-bias statistics of one call.

    Attributes:
        surrogate: ``S`` with gradient through the ratio (``d S / d theta`` is ``C``); ``None``
            unless asked for (the ``param_grad`` mode and :func:`clip_bias_surrogate` need it).
        scalar: ``S`` detached (additive over micro-batches).
        sq_sum: ``sum_t c_t^2`` with ``c_t = dS / d log pi_t`` (additive over micro-batches).
    """

    surrogate: torch.Tensor | None
    scalar: torch.Tensor
    sq_sum: torch.Tensor


def clip_bias_terms(
    ratio: torch.Tensor,
    raw_level_log_ratio: torch.Tensor,
    clamp: float,
    clipped: torch.Tensor,
    weighted_advantages: torch.Tensor,
    segments: TurnSegments | None,
    *,
    surrogate: bool = False,
) -> ClipBiasTerms:
    """Surrogate ``S``, its value and the squared norm of the closed-form per-token clip-bias
    vector ``c``.

    ``ratio`` is the loss ratio broadcast to tokens (with gradient), ``raw_level_log_ratio``
    its unclamped log (to know where the clamp cut the gradient), ``clipped`` the indicator
    ``1[t in B^c]`` (policy tokens only), ``weighted_advantages`` ``g_t A_t w_IS,t``
    (detached, 0 off the mask) and ``segments`` the turn/row segments of a turn/sequence-level
    ratio (``None`` at token level). A unit's ratio is constant over the unit, so ``c`` is too
    (SORL eq. 23: ``c_t = (w_k / |y^k|) sum_{j in k} coef_j``) and both statistics are read
    per unit: one segment sum, no ``[B, T]`` vector.
    """
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    coef = torch.where(clipped, weighted_advantages.to(ratio.dtype), zero).detach()
    s = (coef * ratio).sum() if surrogate else None
    with torch.no_grad():
        if segments is None:
            prod = coef * ratio.detach()
            scalar = prod.sum() if s is None else s.detach()
            vector = prod
            if not _within_clamp(raw_level_log_ratio, clamp):  # the clamp passes gradient where |log r| <= clamp
                vector = torch.where(raw_level_log_ratio.abs() <= clamp, prod, zero)
            sq_sum = torch.dot(vector.reshape(-1), vector.reshape(-1))
        else:
            unit_coef = segment_sum(coef, segments)
            w = segments.per_segment(ratio.detach())
            live = segments.per_segment(raw_level_log_ratio.detach()).abs() <= clamp
            scalar = (unit_coef * w).sum() if s is None else s.detach()
            length = segments.segment_length.to(ratio.dtype)
            per_token = torch.where(live, unit_coef * w / length, zero)  # c_t of every token of the unit
            sq_sum = (per_token * per_token * length).sum()
    return ClipBiasTerms(surrogate=s, scalar=scalar, sq_sum=sq_sum)


def _within_clamp(log_ratio: torch.Tensor, clamp: float) -> bool:
    """Whether no log-ratio reaches past the clamp, where the host reads that for free (one
    ``aminmax`` instead of a masked pass); ``False`` elsewhere (the branch-free pass runs)."""
    if not host_reads_free(log_ratio) or log_ratio.numel() == 0:
        return False
    lo, hi = torch.aminmax(log_ratio.detach())
    return bool(lo >= -clamp) and bool(hi <= clamp)


def clip_bias_norm(scalar: torch.Tensor, sq_sum: torch.Tensor, mode: str) -> torch.Tensor:
    """``||C||`` from (possibly accumulated) statistics, for the ``logprob`` or ``scalar`` mode."""
    if mode == "logprob":
        return sq_sum.clamp(min=0).sqrt()
    if mode == "scalar":
        return scalar.abs()
    raise ValueError(f"clip_bias.mode {mode!r} is not computable from statistics; param_grad needs a backward")


def param_grad_clip_bias_norm(surrogate: torch.Tensor, params: Iterable[torch.Tensor]) -> torch.Tensor:
    """``||dS / d theta||_2`` over ``params`` (the ``param_grad`` mode at world size 1)."""
    params = [p for p in params if p.requires_grad]
    if surrogate is None or not surrogate.requires_grad:
        return torch.zeros((), dtype=torch.float32)
    grads = torch.autograd.grad(surrogate, params, retain_graph=True, allow_unused=True)
    total = sum((g.float() ** 2).sum() for g in grads if g is not None)
    return torch.as_tensor(total, dtype=torch.float32).sqrt()


def normalization_factor(norm: torch.Tensor, delta: float) -> torch.Tensor:
    """Clipping-triggered normalization factor ``1 / max(||C||, delta)`` (SORL eq. 12)."""
    return 1.0 / torch.clamp(norm.detach().float(), min=delta)


@dataclass(frozen=True)
class ClipNormalization:
    """One mini-batch's clipping-triggered normalization: ``norm`` = ``||C||``, the ``factor``
    to apply and the ``running`` mean of ``||C||`` to carry to the next mini-batch (relative
    form; ``None`` for the absolute form)."""

    norm: float
    factor: float
    running: float | None = None


def mini_batch_normalization(
    scalar: float,
    sq_sum: float,
    config: ClipBiasConfig,
    param_grad_norm: float | None = None,
    running: float | None = None,
) -> ClipNormalization:
    """``||C||`` and the factor of a whole mini-batch, for an engine.

    The engine sums the additive statistics (``clip_bias/scalar``, ``clip_bias/sq_sum``) over
    its micro-batches and ranks, or measures ``||dS/dtheta||`` with a second backward in the
    ``param_grad`` mode, and asks here. ``absolute`` form: eq. 12, ``1 / max(||C||, delta)``.
    ``relative`` form: ``min(1, k * m / ||C||)`` with ``m`` the running mean of earlier
    mini-batches' norms (``running``; the first mini-batch with a non-zero norm only starts it,
    factor 1; a mini-batch with nothing clipped leaves it as it is). The mean
    takes each norm capped at ``k * m``, so one spike does not lift the threshold while a
    lasting change of scale still moves it (by at most ``(1 - ema_decay) (k - 1)`` per step).
    """
    if config.mode == "param_grad":
        if param_grad_norm is None:
            raise ValueError("clip_bias.mode='param_grad' needs the measured parameter-space norm")
        norm = float(param_grad_norm)
    else:
        norm = float(clip_bias_norm(torch.tensor(float(scalar)), torch.tensor(float(sq_sum)), config.mode))
    if config.form == "absolute":
        return ClipNormalization(norm, float(normalization_factor(torch.tensor(norm), config.delta)))
    if norm == 0.0:  # nothing clipped (e.g. the on-policy first mini-batch): no news of the scale
        return ClipNormalization(norm, 1.0, running)
    if running is None:
        return ClipNormalization(norm, 1.0, norm)
    threshold = config.relative_threshold * running
    factor = 1.0 if norm <= threshold else threshold / norm
    return ClipNormalization(norm, factor, config.ema_decay * running + (1 - config.ema_decay) * min(norm, threshold))
