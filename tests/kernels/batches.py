"""Small ragged multi-turn batches for the kernel tests."""

from __future__ import annotations

import torch


def ragged_mask(batch: int = 6, seq: int = 40, seed: int = 0) -> torch.Tensor:
    """Random turn structure plus the edge cases: an all-masked row, a single-turn row,
    single-token turns, and a turn that ends at the last position."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, seq, generator=g) < 0.6).long()
    mask[0] = 1  # one turn covering the row
    mask[1] = 0  # empty row
    mask[2] = 0
    mask[2, ::3] = 1  # single-token turns
    mask[3, -1] = 1
    return mask


def explicit_turn_ids(mask: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Turn ids that interleave within a row (segment ids not in token order)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, mask.shape, generator=g) * mask
