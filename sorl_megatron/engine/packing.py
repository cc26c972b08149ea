"""Micro-batch plans: fixed-size, token-budget and packed micro-batches, balanced over DP ranks.

A pass (one mini-batch of an update, or a whole forward-only batch) hands these functions the
global ids of its rows and their lengths (real tokens); they return a :class:`MicroBatchPlan`:
for every data-parallel rank the same number of micro-batches, each a list of row ids. Every
rank computes the same plan from the same batch, so nothing is communicated. Three kinds:

- **fixed** (the default): a mini-batch's rows split contiguously over the DP ranks, then into
  micro-batches of ``micro_batch_size`` right-padded rows ``[b, S]``.
- **token budget** (``max_tokens_per_micro_batch``, no packing): each rank's rows in
  micro-batches of ``b = max_tokens // S`` padded rows (at least one), the micro-batch size
  following the batch's length ``S``; rows are spread evenly over as few micro-batches as that
  allows (a short last micro-batch is topped up with dummy rows, id -1, which carry no loss).
- **packed** (``pack_sequences``): trajectories packed into single rows of at most
  ``max_tokens`` tokens (first-fit decreasing gives the number of rows, then longest-first
  greedy balancing into that many rows per rank, over more rows if balancing overfills one),
  the rows dealt to the DP ranks in snake order of their loads, so every rank gets the same
  number of micro-batches and about the same number of tokens. Every packed row of a pass is
  padded to the longest one (a multiple of ``multiple``, the TP size under sequence
  parallelism), so the pipeline schedule sees one shape.

The loss denominators stay those of the whole mini-batch (the engine computes them before
cutting it), so any plan gives the same mini-batch gradient: only how the work is cut changes.

:class:`PackedRow` is one packed micro-batch: where each row's tokens sit in the packed row, the
``cu_seqlens`` of megatron's THD format (the tail padding is a segment of its own), and
gather-based ``pack`` / ``unpack`` of any per-token tensor, with no loop over tokens.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .config import BatchingConfig
from .rl_batch import BatchError, split_rows

DUMMY = -1  # row id of a dummy row (one attended token, no loss) in a plan


@dataclass
class MicroBatchPlan:
    """The micro-batches of one pass.

    micro: ``micro[r][i]`` = global row ids (``DUMMY`` = a dummy row) of micro-batch ``i`` of
        DP rank ``r``; every rank has the same number of micro-batches.
    packed: each micro-batch is one packed row of ``seq_len`` tokens (else ``[rows, seq_len]``
        right-padded rows).
    seq_len: tokens per row the model sees (``T`` packed, ``S`` padded).
    real_tokens: real tokens of the pass's rows (all ranks).
    """

    micro: list[list[torch.Tensor]]
    packed: bool
    seq_len: int
    real_tokens: int

    @property
    def micro_batches_per_rank(self) -> int:
        return len(self.micro[0]) if self.micro else 0

    @property
    def token_slots(self) -> int:
        """Token positions the model computes over all ranks (real tokens plus padding)."""
        if self.packed:
            return sum(len(rank) for rank in self.micro) * self.seq_len
        return sum(len(mb) for rank in self.micro for mb in rank) * self.seq_len

    @property
    def padding_frac(self) -> float:
        slots = self.token_slots
        return 1.0 - self.real_tokens / slots if slots else 0.0

    @property
    def has_dummy(self) -> bool:
        return any(bool((mb == DUMMY).any()) for rank in self.micro for mb in rank)


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of indices into ``lengths``) of total length <= ``capacity``, first fit in
    order of decreasing length (ties by index). Every length must be <= ``capacity``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def balanced_bins(lengths: list[int], n_bins: int) -> list[list[int]]:
    """``n_bins`` bins with loads as equal as greedy allows: longest first, each into the
    currently lightest bin (ties by bin index). Bins may be empty when items are few."""
    heap = [(0, b) for b in range(n_bins)]
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return bins


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_budget(rows: torch.Tensor, lengths: torch.Tensor, budget: int, key: str) -> None:
    longest = int(lengths.max())
    if longest > budget:
        row = int(rows[int(lengths.argmax())])
        raise BatchError(
            f"{key}={budget} is below the longest trajectory ({longest} tokens, row {row}): a trajectory is "
            "never split across micro-batches; raise the budget"
        )


def plan_fixed(rows: torch.Tensor, lengths: torch.Tensor, dp: int, mbs: int, seq_len: int, what: str) -> MicroBatchPlan:
    """Contiguous DP split, micro-batches of ``mbs`` rows (the engine's original cut)."""
    n = len(rows)
    if n % (dp * mbs):
        raise BatchError(
            f"{what}: {n} rows are not a multiple of data-parallel size {dp} x micro_batch_size {mbs} = {dp * mbs}"
        )
    micro = []
    for sl in split_rows(n, dp, what):
        mine = rows[sl]
        micro.append([mine[s] for s in split_rows(len(mine), len(mine) // mbs, "micro_batch_size")])
    return MicroBatchPlan(micro, packed=False, seq_len=seq_len, real_tokens=int(lengths.sum()))


def plan_token_budget(
    rows: torch.Tensor, lengths: torch.Tensor, dp: int, budget: int, seq_len: int, key: str, what: str,
    micro_multiple: int = 1,
) -> MicroBatchPlan:
    """Padded rows ``[b, S]`` with ``b = max(1, budget // S)``: each rank's rows (a contiguous
    share) over ``ceil(n / b)`` micro-batches (rounded up to ``micro_multiple``) of equal size,
    topped up with dummy rows."""
    _check_budget(rows, lengths, budget, key)
    n = len(rows)
    if n % dp:
        raise BatchError(f"{what}: {n} rows are not a multiple of data-parallel size {dp}")
    per_rank = n // dp
    b = min(max(1, budget // seq_len), per_rank)
    k = _round_up(math.ceil(per_rank / b), micro_multiple)
    b = math.ceil(per_rank / k)
    micro = []
    for sl in split_rows(n, dp, what):
        mine = torch.cat([rows[sl], torch.full((k * b - per_rank,), DUMMY, dtype=rows.dtype)])
        micro.append(list(mine.view(k, b).unbind(0)))
    return MicroBatchPlan(micro, packed=False, seq_len=seq_len, real_tokens=int(lengths.sum()))


def plan_packed(
    rows: torch.Tensor, lengths: torch.Tensor, dp: int, budget: int, multiple: int, key: str,
    micro_multiple: int = 1,
) -> MicroBatchPlan:
    """Trajectories packed into rows of <= ``budget`` tokens, ``k`` rows per DP rank with the
    smallest ``k`` (a multiple of ``micro_multiple``) at which the balanced packing fits (at least
    first-fit decreasing's count / dp).

    An empty packed row (fewer trajectories than rows) gets one dummy row. The packed length is
    the longest packed row rounded up to ``multiple``.
    """
    _check_budget(rows, lengths, budget, key)
    lens = [int(x) for x in lengths.tolist()]
    k = _round_up(max(1, math.ceil(len(first_fit_decreasing(lens, budget)) / dp)), micro_multiple)
    while True:
        bins = balanced_bins(lens, dp * k)
        loads = [sum(lens[i] for i in b) for b in bins]
        if max(loads) <= budget:
            break
        k += micro_multiple  # terminates: with dp * k >= len(rows) every row has a bin of its own
    order = sorted(range(len(bins)), key=lambda b: (-loads[b], b))
    micro: list[list[torch.Tensor]] = [[] for _ in range(dp)]
    for j, b in enumerate(order):  # snake: 0..dp-1, dp-1..0, ...
        lap, pos = divmod(j, dp)
        rank = pos if lap % 2 == 0 else dp - 1 - pos
        members = sorted(bins[b], key=lambda i: int(rows[i]))
        ids = rows[members] if members else torch.tensor([DUMMY], dtype=rows.dtype)
        micro[rank].append(ids)
    longest = max(max(loads), 1)
    return MicroBatchPlan(micro, packed=True, seq_len=_round_up(longest, multiple), real_tokens=sum(lens))


def make_plan(
    rows: torch.Tensor,
    lengths: torch.Tensor,
    *,
    dp: int,
    micro_batch_size: int,
    seq_len: int,
    pack: bool,
    max_tokens: Optional[int],
    multiple: int,
    key: str,
    what: str,
    micro_multiple: int = 1,
) -> MicroBatchPlan:
    """The plan of one pass over ``rows`` (global ids) with ``lengths`` (their real tokens).

    ``seq_len`` is the padded length ``S`` of the batch; with ``pack`` and no ``max_tokens``
    the budget is ``micro_batch_size x S`` (a packed row holds what a padded micro-batch did).
    ``multiple`` rounds the packed length (TP under sequence parallelism), ``micro_multiple``
    the number of micro-batches per rank of the packed and budget plans (PP under the
    interleaved schedule, which wants whole groups of PP micro-batches). ``key`` names the
    budget's setting in errors, ``what`` the row count's.
    """
    if pack:
        budget = max_tokens if max_tokens is not None else micro_batch_size * seq_len
        return plan_packed(rows, lengths, dp, budget, multiple, key, micro_multiple)
    if max_tokens is not None:
        return plan_token_budget(rows, lengths, dp, max_tokens, seq_len, key, what, micro_multiple)
    return plan_fixed(rows, lengths, dp, micro_batch_size, seq_len, what)


def update_rows(n: int, batching: BatchingConfig, step: int) -> list[torch.Tensor]:
    """The rows of every mini-batch of an update of ``n`` rows starting at optimizer step
    ``step``, in order: ``epochs`` passes over the rows, each in an order seeded by the step it
    starts at (one optimizer step per mini-batch), the same on every rank."""
    mini = batching.mini_batch_size or n
    if n % mini:
        raise BatchError(f"batching.mini_batch_size={mini} does not divide the batch size {n}")
    out = []
    for epoch in range(batching.epochs):
        order = torch.arange(n)
        if batching.shuffle:
            seed = batching.seed * 1_000_003 + (step + epoch * (n // mini)) * 1009 + epoch
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        out += [order[m * mini:(m + 1) * mini] for m in range(n // mini)]
    return out


def rows_by_rank(plans: list[MicroBatchPlan], dp: int, n_rows: int) -> list[torch.Tensor]:
    """Per DP rank (of ``dp``), the sorted ids (below ``n_rows``: no dummy rows) of the rows its
    micro-batches read in any of ``plans``."""
    used = torch.zeros(dp, n_rows, dtype=torch.bool)
    for plan in plans:
        for r, micro in enumerate(plan.micro):
            for ids in micro:  # a loop over micro-batches, not tokens
                used[r, ids[(ids >= 0) & (ids < n_rows)]] = True
    return [u.nonzero().flatten() for u in used]


@dataclass
class PackedRow:
    """Rows ``rows`` (global ids into a ``[B, S]`` batch, lengths ``lengths``) packed back to
    back into one row of ``seq_len`` tokens; the tail is padding.

    token_row / token_pos: ``[T]`` global row and position of each packed token (-1 on the tail).
    cu_seqlens: ``[segments + 1]`` int32 boundaries for megatron's THD format: one segment per
        row, plus the tail padding as a segment of its own (so ``cu_seqlens[-1] == T``).
    max_seqlen: the longest segment.
    """

    rows: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    seq_len: int
    token_row: torch.Tensor
    token_pos: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @classmethod
    def build(cls, rows: torch.Tensor, lengths: torch.Tensor, seq_len: int) -> "PackedRow":
        lengths = lengths.to(torch.long)
        total = int(lengths.sum())
        if total > seq_len:
            raise BatchError(f"packed rows hold {total} tokens, more than the packed length {seq_len}")
        ends = torch.cumsum(lengths, 0)
        starts = ends - lengths
        doc = torch.repeat_interleave(torch.arange(len(rows)), lengths)  # [total] local row of each token
        tail = seq_len - total
        token_row = torch.full((seq_len,), -1, dtype=torch.long)
        token_pos = torch.full((seq_len,), -1, dtype=torch.long)
        token_row[:total] = rows.to(torch.long)[doc]
        token_pos[:total] = torch.arange(total) - starts[doc]
        bounds = [torch.zeros(1, dtype=torch.long), ends] + ([torch.tensor([seq_len])] if tail else [])
        cu = torch.cat(bounds).to(torch.int32)
        max_seqlen = max(int(lengths.max()) if len(lengths) else 0, tail)
        return cls(rows, lengths, starts, seq_len, token_row, token_pos, cu, max_seqlen)

    def to(self, device) -> "PackedRow":
        return PackedRow(
            self.rows, self.lengths.to(device), self.starts.to(device), self.seq_len, self.token_row.to(device),
            self.token_pos.to(device), self.cu_seqlens.to(device), self.max_seqlen,
        )

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    def pack(self, t: torch.Tensor, fill=0) -> torch.Tensor:
        """``t [B, S, ...]`` (indexed by global row) -> ``[1, T, ...]``, ``fill`` on the tail."""
        real = self.token_row >= 0
        out = torch.full((self.seq_len,) + tuple(t.shape[2:]), fill, dtype=t.dtype, device=t.device)
        rows, pos = self.token_row[real].to(t.device), self.token_pos[real].to(t.device)
        out[real.to(t.device)] = t[rows, pos]
        return out.unsqueeze(0)

    def pack_positions(self) -> torch.Tensor:
        """``[1, T]`` positions restarting at 0 for every row (and for the tail)."""
        pos = self.token_pos.clone()
        real = int(self.lengths.sum())
        pos[real:] = torch.arange(self.seq_len - real, device=pos.device)
        return pos.unsqueeze(0)

    def _row_index(self, width: int, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(width, device=self.starts.device).unsqueeze(0)
        valid = (t >= shift) & (t < self.lengths.unsqueeze(1))
        src = (self.starts.unsqueeze(1) + t - shift).clamp(0, self.seq_len - 1)
        return src, valid

    def unpack(self, packed: torch.Tensor, width: int, fill=0.0) -> torch.Tensor:
        """``[1, T, ...]`` -> ``[n, width, ...]`` in the order of ``rows``: token t of row i from
        packed position ``starts[i] + t``; ``fill`` past each row's end. Differentiable."""
        src, valid = self._row_index(width, 0)
        return self._gather(packed, src, valid, fill)

    def unpack_predictions(self, packed: torch.Tensor, width: int, fill=0.0) -> torch.Tensor:
        """Per-prediction values ``[1, T]`` (from the output at position p, about token p+1) ->
        ``[n, width]`` aligned to token positions: position t of row i gets the prediction made at
        ``starts[i] + t - 1``; ``fill`` at t = 0 and past the row's end (the batch contract, the
        packed twin of ``shift_to_token_positions``). Differentiable."""
        src, valid = self._row_index(width, 1)
        return self._gather(packed, src, valid, fill)

    @staticmethod
    def _gather(packed: torch.Tensor, src: torch.Tensor, valid: torch.Tensor, fill) -> torch.Tensor:
        flat = packed.reshape((packed.shape[1],) + tuple(packed.shape[2:]))
        src, valid = src.to(flat.device), valid.to(flat.device)
        out = flat[src]
        mask = valid.view(valid.shape + (1,) * (out.dim() - 2))
        return torch.where(mask, out, torch.full((), fill, dtype=out.dtype, device=out.device))
