"""Shared helpers of the benchmark scripts (not tests: they print numbers, assert only
that the compared paths agree)."""

from __future__ import annotations

import time
from typing import Callable

import torch


def multi_turn_batch(
    batch: int, seq: int, turns: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs, old_logprobs, advantages, loss_mask)`` of agent trajectories: a prompt, then
    ``turns`` assistant turns separated by tool observations, then padding; lengths random.

    Built with tensor ops (cumulative boundaries per row), so building is cheap at any size.
    """
    g = torch.Generator().manual_seed(seed)
    # 2 * turns + 2 pieces per row: prompt, (turn, observation) x turns, padding; random weights.
    pieces = torch.rand(batch, 2 * turns + 2, generator=g) + 0.2
    bounds = (torch.cumsum(pieces, 1) / pieces.sum(1, keepdim=True) * seq).long()  # end of each piece
    pos = torch.arange(seq)
    piece = torch.searchsorted(bounds, pos.expand(batch, seq).contiguous(), right=True)  # piece of each token
    mask = ((piece % 2 == 1) & (piece < 2 * turns + 1)).long()  # odd pieces are assistant turns
    lp = -torch.rand(batch, seq, generator=g) * 3
    # Token noise plus a per-row policy drift, so that some turn ratios leave the clip range.
    old = lp + 0.2 * torch.randn(batch, seq, generator=g) + 0.2 * torch.randn(batch, 1, generator=g)
    adv = torch.randn(batch, 1, generator=g).expand(batch, seq).contiguous()
    return lp, old, adv, mask


def best_of(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Minimum wall time in seconds over ``repeats`` runs (least disturbed by other load)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
