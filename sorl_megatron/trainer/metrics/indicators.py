"""The step's train/inference mismatch indicators (``mismatch/*`` in metrics.jsonl), from the
batch every rank holds after the old-policy pass; the math is ``algorithms/mismatch.py``.

- ``mismatch/ess_frac``, ``mismatch/ess_frac_seq``: effective sample size over N of the weights
  ``pi_old / mu`` (trainer over rollout engine), over the batch's policy tokens and averaged
  over sequences;
- ``mismatch/kl_k3``: the k3 estimate of ``KL(mu || pi_old)``, mean over policy tokens;
- ``mismatch/route_flip_rate``: the share of (token, MoE layer) top-k sets where the rollout
  engine's routes differ from the trainer's own router on the same tokens (with R3, the old
  pass's ``routing/replay_mismatch_frac``; otherwise the rollout's returned routes against the
  old pass's recorded ones, when the rollout returns routes: ``TrainConfig.rollout_routes``).

PVPO's injected ground-truth rows (whose old log-probs are the rollout's own) are left out.
Every rank holds the whole batch, so no reduction is needed and every rank gets the same values.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...algorithms.mismatch import importance_ess, k3_kl, route_flip_counts


def mismatch_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                     injected: torch.Tensor) -> dict[str, float]:
    """ESS / N and the k3 KL of the step's policy tokens (``[B, T]``; ``injected [B]``)."""
    mask = loss_mask.bool() & ~injected.bool()[:, None]
    ess, ess_seq = importance_ess(old_logprobs - rollout_logprobs, mask)
    return {"mismatch/ess_frac": float(ess), "mismatch/ess_frac_seq": float(ess_seq),
            "mismatch/kl_k3": float(k3_kl(old_logprobs, rollout_logprobs, mask))}


def route_flip_metrics(rollout_routes: Optional[torch.Tensor], trainer_routes: Optional[torch.Tensor],
                       injected: torch.Tensor, replay_metrics: dict[str, float]) -> dict[str, float]:
    """``mismatch/route_flip_rate`` (and the pairs compared) when both routings are known."""
    if "routing/replay_mismatch_frac" in replay_metrics:  # R3: the live router against the replayed routes
        return {"mismatch/route_flip_rate": replay_metrics["routing/replay_mismatch_frac"],
                "mismatch/route_pairs": replay_metrics["routing/replayed_pairs"]}
    if rollout_routes is None or trainer_routes is None:
        return {}
    keep = ~injected.bool()
    flips, pairs = route_flip_counts(rollout_routes[keep], trainer_routes[keep].to(rollout_routes.dtype))
    if pairs <= 0:
        return {}
    return {"mismatch/route_flip_rate": float(flips / pairs), "mismatch/route_pairs": float(pairs)}
