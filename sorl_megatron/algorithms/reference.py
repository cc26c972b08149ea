"""Pure-torch references of the Triton kernels in ``sorl_kernels`` (the ``torch`` backend).

They take plain tensors, sit below :mod:`.dispatch` (which picks them or the kernels) and
import nothing else from the algorithm core, so the core's imports all point one way:
``turns`` / ``policy_loss`` -> ``dispatch`` -> ``reference`` / ``logprobs``.
"""

from __future__ import annotations

import torch


def segment_mean_broadcast_torch(
    values: torch.Tensor, segment_index: torch.Tensor, segment_length: torch.Tensor
) -> torch.Tensor:
    """Mean of ``values`` over each token's segment, broadcast back (SORL eq. 4 in log space).

    ``segment_index`` / ``segment_length`` are those of :class:`.turns.TurnSegments`: tokens
    outside every segment hold ``len(segment_length)`` and get 0. One ``index_add`` + gather.
    """
    num = segment_length.numel()
    inside = segment_index < num
    flat = torch.where(inside, values, torch.zeros((), dtype=values.dtype, device=values.device)).reshape(-1)
    sums = values.new_zeros(num + 1).index_add(0, segment_index.reshape(-1), flat)[:num]
    means = torch.cat([sums / segment_length.to(values.dtype), values.new_zeros(1)])
    return means[segment_index]


def clipped_surrogate_torch(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    clip_low: float, clip_high: float, dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate (module docstring; SORL eq. 1/3) and the indicators of
    ``B^c``, the tokens whose gradient the clip removed: ``(per_token, clip_high, clip_low,
    dual)``. The reference of ``sorl_kernels.surrogate``."""
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(clip_low, clip_high)
    per_token = torch.maximum(pg_unclipped, pg_clipped)
    high = (advantages > 0) & (ratio > clip_high) & mask
    low = (advantages < 0) & (ratio < clip_low) & mask
    dual = torch.zeros_like(mask)
    if dual_clip is not None:
        dual = (advantages < 0) & (ratio > dual_clip) & mask
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * dual_clip), per_token)
    return per_token, high, low, dual
