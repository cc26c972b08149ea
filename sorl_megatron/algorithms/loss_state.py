"""What the policy loss's stages hand each other (``policy_loss.py``): one call's checked
inputs and its importance ratios."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .turns import TurnSegments


@dataclass(frozen=True)
class LossInputs:
    """One call's checked ``[B, T]`` tensors: ``advantages`` float32, detached, 0 off the mask;
    ``mask`` bool; the rest as given (``None`` when not given)."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    rollout_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    entropy: torch.Tensor | None
    turn_ids: torch.Tensor | None


@dataclass(frozen=True)
class Ratios:
    """The importance ratios of one call (``ratios.py``).

    Attributes:
        turns: turn segments, when turn ratios, turn-level IS weights, the diagnostics or
            explicit turn ids ask for them (else ``None``).
        segments: the units of the loss ratio (turns or rows; ``None`` at token level).
        token_log_ratio: ``log pi - log pi_old``, unclamped, exactly 0 off the mask.
        clamped_log_ratio: the same clamped to ``[-log_ratio_clamp, log_ratio_clamp]``.
        token_ratio: ``exp`` of the clamped token log-ratio (1 off the mask).
        level_log_ratio: the unclamped log of the loss ratio, detached at turn and sequence
            level off the Triton device (nothing differentiates it); at token level the token's
            own, and GSPO-token's its value with each token's own gradient.
        ratio: the loss ratio, clamped in log space, with gradient (1 off the mask).
    """

    turns: TurnSegments | None
    segments: TurnSegments | None
    token_log_ratio: torch.Tensor
    clamped_log_ratio: torch.Tensor
    token_ratio: torch.Tensor
    level_log_ratio: torch.Tensor
    ratio: torch.Tensor
