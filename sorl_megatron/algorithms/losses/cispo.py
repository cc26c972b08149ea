"""CISPO: the clipped importance-sampling weight, detached, on the log-prob's gradient.

"MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv 2506.13585,
eq. 4-5, with ``r_t = pi_theta(o_t) / pi_old(o_t)`` the token ratio and ``A_t`` GRPO's
group-relative advantage::

    J(theta) = E[ 1 / sum_i |o_i|  sum_i sum_t  sg(r^_t) A_t log pi_theta(o_t) ]
    r^_t     = clip(r_t, 1 - eps_low^IS, 1 + eps_high^IS)

so ``grad J = E[ sum_t g_t r^_t A_t grad log pi_theta(o_t) ]``. Unlike PPO's clip, which drops
the gradient of a token once its ratio leaves the range, every token keeps its gradient; the
clip bounds its importance weight only. Losses are minimized, so the per-token term is
``l_t = -g_t sg(r^_t) A_t log pi_theta(o_t)`` (its value is the formula's, with ``log pi_theta``
itself, not ``log r_t``).

Configuration (``loss:``): ``eps_low`` / ``eps_high`` are ``eps_low^IS`` / ``eps_high^IS``.
The paper imposes no lower bound (a large ``eps_low^IS``) and tunes only ``eps_high^IS``;
here ``eps_low < 1`` keeps the lower bound ``1 - eps_low`` above 0, so its "no lower bound" is
``eps_low`` close to 1 (``0.999`` raises only weights below 0.001, to 0.001). ``eps_high``
defaults to ``eps_low`` as for every loss; the paper gives no value to copy. Its normalizer
``1 / sum_i |o_i|`` is ``loss_agg: token-mean`` (the default). ``dual_clip`` has no effect: the
weight is already at most ``1 + eps_high``. Pair it with an outcome-based estimator (grpo).

Metrics: ``clip_frac_high`` / ``clip_frac_low`` count the tokens whose weight the clip changed
(``r_t`` above / below the range, whatever the sign of ``A_t``). The clip bias is the gradient
the clip removed from the unclipped importance-weighted one, ``g_t (r_t - r^_t) A_t`` per
clipped token (``bias_share = 1 - r^_t / r_t``), so ``grad loss = -(PG - C)`` as for PPO.
"""

from __future__ import annotations

import torch

from ..loss_registry import PolicyLossSpec, register_policy_loss
from ..surrogate import SurrogateInputs, SurrogateTerms


def cispo_surrogate(inputs: SurrogateInputs) -> SurrogateTerms:
    """``l_t = -a_t sg(clip(w_t, clip_low, clip_high)) log pi_t`` with ``a_t = g_t A_t``."""
    ratio = inputs.ratio.detach()
    weight = ratio.clamp(inputs.clip_low, inputs.clip_high)
    zero = torch.zeros((), dtype=torch.float32, device=ratio.device)
    logprobs = torch.where(inputs.mask, inputs.logprobs.float(), zero)  # padding may hold -inf
    per_token = -(inputs.advantages * weight) * logprobs
    high = (ratio > inputs.clip_high) & inputs.mask
    low = (ratio < inputs.clip_low) & inputs.mask
    return SurrogateTerms(
        per_token=per_token, clip_high=high, clip_low=low, dual=torch.zeros_like(inputs.mask),
        bias_share=1.0 - weight / ratio,
    )


CISPO = register_policy_loss(
    PolicyLossSpec(
        "cispo", "token", surrogate=cispo_surrogate,
        reference="CISPO, MiniMax-M1 (arXiv 2506.13585) eq. 4-5: sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi",
    )
)
