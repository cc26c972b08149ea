"""The surrogate stage of a policy loss: a typed callable from ratios and advantages to the
per-token loss and the tokens it clipped.

A registered loss (:class:`.loss_registry.PolicyLossSpec`) carries one; the other stages of
``policy_loss.py`` (ratio, corrections, penalties, aggregation, metrics) are shared. The
aggregation weights ``g_t`` are folded into the advantages a surrogate receives
(``a_t = g_t A_t``, ``g_t > 0`` on policy tokens), so the sum of its per-token terms is the
surrogate part of the loss, whatever the aggregation mode. Losses are minimized: a per-token
term is ``-`` the paper's objective.

The default is PPO's clipped surrogate (:func:`ppo_clipped_surrogate`); another lives in its
own file under ``losses/`` with its registration (``losses/cispo.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from . import dispatch


@dataclass(frozen=True)
class SurrogateInputs:
    """What a surrogate sees; every tensor is ``[B, T]``.

    Attributes:
        ratio: the loss ratio ``w_t`` at the loss's level (token, turn or sequence; GSPO-token's
            per-token gradient), with gradient; exactly 1 off the mask.
        logprobs: ``log pi_theta`` of the sampled tokens, with gradient, as the caller gave them
            (any value off the mask, ``-inf`` included: mask before use).
        advantages: ``a_t = g_t A_t``, the advantages times the aggregation weights; float32,
            detached, exactly 0 off the mask.
        mask: bool, the policy tokens.
        clip_low / clip_high: ``1 - eps_low`` and ``1 + eps_high``.
        dual_clip: the dual-clip constant ``c > 1``, or ``None``.
    """

    ratio: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    clip_low: float
    clip_high: float
    dual_clip: float | None


@dataclass(frozen=True)
class SurrogateTerms:
    """A surrogate's output; every tensor is ``[B, T]``.

    Attributes:
        per_token: the loss term of each token (already weighted by ``g_t``), 0 off the mask;
            its sum is the surrogate loss.
        clip_high / clip_low / dual: bool indicators of the tokens the surrogate clipped
            (disjoint, policy tokens only): they give ``clip_frac*`` and the clip-bias
            statistics (``clip_bias.py``).
        bias_share: ``None``, or the detached share of an indicated token's importance-weighted
            gradient ``g_t A_t w_t grad log pi_t`` that the surrogate removed; ``None`` means
            all of it (PPO's clip drops the token). The clip bias ``C`` of each indicated token
            is scaled by it, so ``grad loss = -(PG - C)`` holds for the surrogate.
    """

    per_token: torch.Tensor
    clip_high: torch.Tensor
    clip_low: torch.Tensor
    dual: torch.Tensor
    bias_share: torch.Tensor | None = None


class Surrogate(Protocol):
    """The per-token objective of a loss: :class:`SurrogateInputs` in, :class:`SurrogateTerms` out."""

    def __call__(self, inputs: SurrogateInputs, /) -> SurrogateTerms: ...


def ppo_clipped_surrogate(inputs: SurrogateInputs) -> SurrogateTerms:
    """PPO's clipped surrogate (SORL eq. 1/3, GRPO eq. 13, GSPO), with the dual clip::

        l_t = max(-a_t w_t, -a_t clip(w_t, 1 - eps_low, 1 + eps_high)),  then  min(l_t, -a_t c) if a_t < 0

    Dispatched: a fused Triton kernel on CUDA, :func:`.reference.clipped_surrogate_torch`
    otherwise. The clipped tokens (``B^c``) carry no gradient.
    """
    per_token, high, low, dual = dispatch.clipped_surrogate(
        inputs.ratio, inputs.advantages, inputs.mask, inputs.clip_low, inputs.clip_high, inputs.dual_clip
    )
    return SurrogateTerms(per_token=per_token, clip_high=high, clip_low=low, dual=dual)
