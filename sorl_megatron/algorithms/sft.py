"""Supervised cold start: cross-entropy on the policy tokens of gold trajectories.

Masked like RL (``loss_mask`` = tokens the policy would have produced; prompts and tool
observations excluded) and aggregated with the same modes and mini-batch denominators as the
policy losses, so an engine micro-batches it exactly like them.
"""

from __future__ import annotations

import torch

from .aggregation import aggregate, masked_mean, token_weights


def sft_loss(
    logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg: str = "token-mean",
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``-agg(log pi(y_t))`` over policy tokens; metrics ``sft/nll`` and ``policy_tokens``."""
    if logprobs.shape != loss_mask.shape:
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != logprobs shape {tuple(logprobs.shape)}")
    mask = loss_mask.bool()
    nll = torch.where(mask, -logprobs.float(), torch.zeros((), dtype=torch.float32, device=logprobs.device))
    loss = aggregate(nll, token_weights(mask, loss_agg, denominator))
    return loss, {"sft/nll": masked_mean(nll.detach(), mask), "policy_tokens": mask.float().sum()}
