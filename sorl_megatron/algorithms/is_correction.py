"""Train/inference importance-sampling correction (MiniRL, "Stabilizing RL with LLMs").

The rollout engine samples from ``mu`` (e.g. an FP8 SGLang server) while the trainer's
old-policy pass computes ``pi_old`` (BF16 Megatron). MiniRL's token-level objective weights
each token by the *detached* ratio ``pi_old / mu`` and keeps PPO-style clipping of
``pi_theta / pi_old`` separate ("decoupled" clipping), so the two discrepancies (engine
mismatch and policy staleness) are handled by different mechanisms.

Modes:
- ``tis`` (truncated IS): weight ``min(pi_old / mu, cap)``.
- ``mis`` (masked IS): weight ``pi_old / mu`` inside ``[low, high]``, 0 outside.

Levels: ``token`` uses each token's ratio; ``turn`` / ``sequence`` use the geometric mean of the
token ratios of the token's turn / row (the default, ``geometric=True``) or, with
``geometric=False``, their product (the unit's exact likelihood ratio), so a whole turn or sequence
is truncated or masked together. The product of n token ratios is ``exp(sum log r_t)``: with the
rollout sampling from ``mu``, ``E_mu[log r_t] = -KL(mu || pi_old)`` per token, so over a 40-60-turn
episode of ~1000 policy tokens a per-token KL of 0.003 already puts the weight near
``exp(-3) = 0.05`` (the collapse NeMo-RL's pull request 2269 reports, ~0.06), and a turn of a few
hundred tokens goes the same way; the geometric mean stays near ``exp(-KL) ~ 1``
(tests/algorithms/test_is_long_episodes.py).

Metrics: besides the mismatch's size and what the mode truncated or masked, Kish's effective
sample size over N, ``(sum w)^2 / (N sum w^2)``, of the raw weights ``pi_old / mu`` at each
granularity the batch has: ``is/ess_token`` over the policy tokens, ``is/ess_turn`` over the turns
(when the loss has turn segments) and ``is/ess_sequence`` over the rows, the turn and sequence
weights in the configured form (geometric mean or product): 1 when every unit has the same
weight, 1/N when one unit holds it all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aggregation import masked_max, masked_mean
from .config import ISCorrectionConfig
from .ratios import level_log_ratio, masked_log_ratio, segments_for_level
from .turns import TurnSegments, segment_sum


@dataclass(frozen=True)
class ISCorrection:
    """Detached per-token weights ``[B, T]`` and the mismatch metrics."""

    weights: torch.Tensor
    metrics: dict[str, torch.Tensor]


def is_correction_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    config: ISCorrectionConfig,
    turn_segments: TurnSegments | None = None,
    clamp: float = 20.0,
) -> ISCorrection:
    """Weights ``w_IS`` for each token (1 where the correction is off or off-mask)."""
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask.bool()
    with torch.no_grad():
        log_gap = masked_log_ratio(old_logprobs, rollout_logprobs, mask)  # log pi_old - log mu, 0 off the mask
        count = mask.sum(dtype=torch.float64).clamp(min=1)
        flat = log_gap.reshape(-1)
        # whole-tensor reductions: every entry off the mask is exactly 0 and adds nothing. The
        # k3 KL(mu || pi_old) is the trainer's mismatch/kl_k3 (trainer/metrics/indicators.py), once a step
        metrics = {
            "is/mismatch_abs_mean": (torch.linalg.vector_norm(flat, 1, dtype=torch.float64) / count).float(),
            "is/mismatch_abs_max": torch.linalg.vector_norm(flat, float("inf")),
            **ess_by_granularity(log_gap, mask, config.geometric, turn_segments),
        }
        if config.mode == "off":
            weights = mask.to(torch.float32)
            metrics["is/weight_mean"] = mask.any().float()  # the mean of 1 over the policy tokens
            return ISCorrection(weights=weights, metrics=metrics)

        segments = segments_for_level(config.level, mask, turn_segments)
        log_w = level_log_ratio(log_gap, config.level, segments, clamp, reduce="mean" if config.geometric else "sum")
        raw = torch.exp(log_w)
        zero = torch.zeros((), dtype=raw.dtype, device=raw.device)
        if config.mode == "tis":
            weights = raw.clamp(max=config.cap)
            metrics["is/truncated_frac"] = masked_mean((raw > config.cap).float(), mask)
        else:
            keep = (raw >= config.low) & (raw <= config.high)
            weights = torch.where(keep, raw, zero)
            metrics["is/masked_frac"] = masked_mean((~keep).float(), mask)
        weights = torch.where(mask, weights, zero)
        metrics["is/weight_mean"] = masked_mean(weights, mask)
        metrics["is/raw_weight_max"] = masked_max(raw, mask)
    return ISCorrection(weights=weights, metrics=metrics)


def kish_ess_frac(log_w: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Kish's ``(sum w)^2 / (N sum w^2)`` of the weights ``exp(log_w)`` of the units where ``valid``
    (all of them when None), in float64 with the largest log-weight factored out (the ratio is
    scale-free, so no weight over- or underflows); 1 without units. Whole-tensor ops, no sync."""
    lw = log_w.double()
    valid = torch.ones_like(lw, dtype=torch.bool) if valid is None else valid.bool()
    neg = torch.full((), float("-inf"), dtype=lw.dtype, device=lw.device)
    top = torch.where(valid, lw, neg).amax() if lw.numel() else torch.zeros((), dtype=lw.dtype, device=lw.device)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.where(valid, torch.exp(lw - top), torch.zeros_like(lw))
    n = valid.sum(dtype=lw.dtype)
    ess = w.sum() ** 2 / (n * (w * w).sum()).clamp(min=1e-300)
    return torch.where(n > 0, ess, torch.ones_like(ess)).float()


def ess_by_granularity(log_gap: torch.Tensor, mask: torch.Tensor, geometric: bool,
                       turn_segments: TurnSegments | None = None) -> dict[str, torch.Tensor]:
    """``is/ess_token``, ``is/ess_sequence`` and (with turn segments) ``is/ess_turn``: Kish's ESS over
    N of the raw weights ``exp(log_gap)`` per token, per row and per turn, a row's or turn's
    log-weight the mean of its tokens' log-ratios (``geometric``) or their sum (module doc).
    ``log_gap`` is 0 off the mask."""
    gap = log_gap.double()
    length = mask.sum(dim=-1, dtype=torch.float64)
    row_lw = gap.sum(dim=-1)
    if geometric:
        row_lw = row_lw / length.clamp(min=1)
    out = {"is/ess_token": kish_ess_frac(gap, mask), "is/ess_sequence": kish_ess_frac(row_lw, length > 0)}
    if turn_segments is not None:
        turn_lw = segment_sum(gap, turn_segments)
        if geometric:
            turn_lw = turn_lw / turn_segments.segment_length.double()
        out["is/ess_turn"] = kish_ess_frac(turn_lw)
    return out
