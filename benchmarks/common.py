"""Shared helpers of the benchmark scripts (not tests: they print numbers, assert only
that the compared paths agree).

Timing rule: implementations are timed *in alternation* (:func:`interleaved`), so a change of
the machine's load during the run hits all of them alike, and the scripts report ratios
(median of the per-repeat ratios, and the ratio of the minimum times) with the load average
(:func:`report`). Absolute times on a shared machine mean little; the ratios much more.
"""

from __future__ import annotations

import os
import statistics
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


def interleaved(
    fns: dict[str, Callable[[], object]],
    repeats: int = 7,
    warmup: int = 1,
    prepare: dict[str, Callable[[], object]] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Wall times in seconds of each of ``fns`` over ``repeats`` rounds; every round runs each
    once, in alternating order (forward, then reversed), so that drifting load and cache
    effects fall on all of them alike. ``prepare[name]``, if given, runs untimed right before
    each call of ``fns[name]``. ``clock``: wall time by default; ``time.thread_time`` counts
    the thread's CPU seconds only (less disturbed by other processes on a loaded machine)."""
    names = list(fns)
    prepare = prepare or {}

    def call(name: str) -> float:
        if name in prepare:
            prepare[name]()
        start = clock()
        fns[name]()
        return clock() - start

    for _ in range(warmup):
        for name in names:
            call(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(call(name))
    return times


def load() -> str:
    """The 1 / 5 / 15-minute load averages and the core count, for the printout."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} on {os.cpu_count()} cores"


def report(times: dict[str, list[float]], baseline: str, targets: dict[str, float] | None = None) -> dict[str, float]:
    """Print each implementation's median / min time and its ratio to ``baseline``: the median
    of the per-round ratios and the ratio of the minimum times; returns the median ratios.
    ``targets`` (name -> ratio) adds a met / missed column."""
    base = times[baseline]
    out = {}
    print(f"{'':24s} {'median':>10s} {'min':>10s} {'ratio (median)':>15s} {'ratio (min)':>12s}")
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base)]
        med = statistics.median(ratios)
        out[name] = med
        line = (f"{name:24s} {statistics.median(ts) * 1e3:8.1f}ms {min(ts) * 1e3:8.1f}ms "
                f"{med:14.2f}x {min(ts) / min(base):11.2f}x")
        if targets and name in targets:
            line += f"   target <= {targets[name]:.2f}x: {'met' if med <= targets[name] else 'MISSED'}"
        print(line)
    print(f"({len(base)} interleaved rounds; {load()})")
    return out
