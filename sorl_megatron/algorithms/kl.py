"""Per-token KL estimators between the current policy and a reference policy.

With ``x = log pi_ref - log pi_theta`` on tokens sampled from the policy (Schulman's notes):

- ``k1 = -x``                      unbiased, high variance, can be negative
- ``k2 = x^2 / 2``                 low variance, biased
- ``k3 = exp(x) - x - 1``          unbiased and non-negative (the GRPO choice)

``x`` is clamped before ``exp`` so ``k3`` stays finite. The one owner of these estimators: the
loss's KL penalty computes them in float32, the train/inference mismatch diagnostic
(``mismatch.k3_kl``) in float64, where gaps of fp32 rounding (~1e-7 nats) still register.
"""

from __future__ import annotations

import torch


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str, clamp: float = 20.0,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token estimate, in ``dtype``, of ``KL(pi_theta || pi_ref)`` from tokens sampled by
    ``pi_theta`` (``logprobs``); gradients flow to ``logprobs``."""
    x = (ref_logprobs.to(dtype) - logprobs.to(dtype)).clamp(-clamp, clamp)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return torch.exp(x) - x - 1.0
    raise ValueError(f"kl_estimator: unknown estimator {estimator!r}; choose k1, k2 or k3")
