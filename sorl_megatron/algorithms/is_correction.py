"""Train/inference importance-sampling correction (MiniRL, "Stabilizing RL with LLMs").

The rollout engine samples from ``mu`` (e.g. an FP8 SGLang server) while the trainer's
old-policy pass computes ``pi_old`` (BF16 Megatron). MiniRL's token-level objective weights
each token by the *detached* ratio ``pi_old / mu`` and keeps PPO-style clipping of
``pi_theta / pi_old`` separate ("decoupled" clipping), so the two discrepancies (engine
mismatch and policy staleness) are handled by different mechanisms.

Modes:
- ``tis`` (truncated IS): weight ``min(pi_old / mu, cap)``.
- ``mis`` (masked IS): weight ``pi_old / mu`` inside ``[low, high]``, 0 outside.

Levels: ``token`` uses each token's ratio; ``turn`` / ``sequence`` use the product of the
token ratios of the token's turn / row (``geometric=True``: their geometric mean), so a whole
turn or sequence is truncated or masked together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aggregation import masked_max, masked_mean
from .config import ISCorrectionConfig
from .ratios import level_log_ratio, masked_log_ratio, segments_for_level
from .turns import TurnSegments


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
