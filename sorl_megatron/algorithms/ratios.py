"""Importance ratios at token, turn and sequence level.

- token (PPO, SORL eq. 2):      ``w_t = pi_theta(y_t) / pi_old(y_t)``
- turn  (SORL eq. 4):           ``w_k = exp(mean_{t in turn k} log w_t)``, broadcast to turn k
- sequence (GSPO):              ``s_i = exp(mean_{t in y_i} log w_t)``, broadcast to row i

All functions work in log space on masked tensors: entries off the mask never enter a
reduction (so ``-inf`` log-probs at padding are harmless), and log-ratios are clamped to
``[-clamp, clamp]`` before ``exp`` so the ratios stay finite. Gradients flow exactly as the
formulas say: a turn ratio's gradient reaches each token of the turn with weight
``w_k / |y^k|`` (the factor in SORL Lemma 4.1's proof, eq. 23).
"""

from __future__ import annotations

from typing import Literal

import torch

from . import dispatch
from .turns import TurnSegments, broadcast_segments, row_segments, segment_mean_broadcast, segment_sum

RatioLevel = Literal["token", "turn", "sequence"]


def masked_log_ratio(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``log pi - log pi_ref`` on the mask, exactly 0 elsewhere (unclamped)."""
    mask = loss_mask.bool()
    diff = logprobs.float() - ref_logprobs.float()
    return torch.where(mask, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))


def level_log_ratio(
    token_log_ratio: torch.Tensor,
    level: RatioLevel,
    segments: TurnSegments | None,
    clamp: float | None,
    reduce: Literal["mean", "sum"] = "mean",
) -> torch.Tensor:
    """Log-ratio of each token's unit (token, turn or sequence), broadcast to its tokens, and
    clamped to ``[-clamp, clamp]`` unless ``clamp`` is None.

    ``reduce="mean"`` gives the geometric-mean ratios of SORL eq. 4 / GSPO; ``"sum"`` gives
    the product of token ratios (the exact likelihood ratio of the unit).
    """
    if level == "token":
        out = token_log_ratio
    else:
        if segments is None:
            raise ValueError(f"ratio level {level!r} needs turn segments")
        if reduce == "mean":
            out = segment_mean_broadcast(token_log_ratio, segments)
        else:
            out = broadcast_segments(segment_sum(token_log_ratio, segments), segments)
    return out if clamp is None else out.clamp(-clamp, clamp)


def unit_ratio(
    token_log_ratio: torch.Tensor, segments: TurnSegments, clamp: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_ratio, ratio)`` of each token's unit (turn or row; geometric mean), broadcast to
    its tokens: the log unclamped, the ratio ``exp`` of it clamped, with gradient (1 off the
    mask).

    The unit's log and ratio are taken once per unit and broadcast (the log detached: nothing
    differentiates it); on the Triton device the fused mean-and-broadcast kernel gives the log
    per token, with gradient, and the ratio follows from it. The same values either way.
    """
    if dispatch.use_triton(token_log_ratio):
        log_ratio = segment_mean_broadcast(token_log_ratio, segments)
        return log_ratio, torch.exp(log_ratio.clamp(-clamp, clamp))
    unit = segment_sum(token_log_ratio, segments) / segments.segment_length.to(token_log_ratio.dtype)
    ratio = broadcast_segments(torch.exp(unit.clamp(-clamp, clamp)), segments, fill=1.0)
    with torch.no_grad():
        log_ratio = broadcast_segments(unit.detach(), segments)
    return log_ratio, ratio


def segments_for_level(
    level: RatioLevel, loss_mask: torch.Tensor, turn_segments: TurnSegments | None
) -> TurnSegments | None:
    """The segments a ratio level reduces over (``None`` for token level)."""
    if level == "turn":
        if turn_segments is None:
            raise ValueError("turn-level ratios need turn segments")
        return turn_segments
    if level == "sequence":
        return row_segments(loss_mask)
    return None
