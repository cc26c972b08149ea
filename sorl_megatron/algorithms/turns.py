"""Turn segmentation of multi-turn trajectories (SORL appendix A.4).

A *turn* is a maximal run of policy tokens (``loss_mask == 1``) in a row; runs of zeros are
prompts, tool observations or padding. Alternatively the rollout supplies explicit turn ids
per token: then all policy tokens of a row with the same id form one turn.

Segments are numbered globally (row-major: all turns of row 0, then row 1, ...), with no
Python loop over rows or turns. Where the segments are intervals of the flattened batch (runs
of the mask, explicit ids that never decrease along a row, a row's policy tokens) their sums
and broadcasts are cumulative sums and ``repeat_interleave`` over those intervals
(``spans.py``); otherwise (explicit ids out of order) they are ``index_add`` / gather over a
per-token segment index, in which non-policy tokens point to one extra "dummy" segment whose
values are discarded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import dispatch
from .spans import Spans, span_broadcast, span_sum, span_values


@dataclass(frozen=True)
class TurnSegments:
    """Turn structure of a ``[batch, seq]`` batch.

    Attributes:
        segment_row: ``[S]`` long, the row of each segment.
        segment_length: ``[S]`` float, number of tokens in each segment (>= 1).
        turns_per_row: ``[B]`` long.
        mask: ``[B, T]`` bool, the policy-token mask the segments were built from.
        segment_start: ``[S]`` long, flat index (into ``B * T``) of each segment's first token,
            to read a value that is constant over a segment (a turn ratio) without a scatter.
        spans: the segments as intervals of the flattened batch, when they are (``None`` for
            explicit ids out of order along a row): the reductions below then need no index.
        index: the segment index, when it was built anyway (explicit ids); else
            :attr:`segment_index` builds it on first use.
    """

    segment_row: torch.Tensor
    segment_length: torch.Tensor
    turns_per_row: torch.Tensor
    mask: torch.Tensor
    segment_start: torch.Tensor
    spans: Spans | None = None
    index: torch.Tensor | None = None

    @functools.cached_property
    def segment_index(self) -> torch.Tensor:
        """``[B, T]`` long, global segment id of each policy token; non-policy tokens hold
        ``num_segments`` (the dummy segment). Built on first use from the spans (the Triton
        kernel and :attr:`turn_index` read it; the CPU reductions do not)."""
        if self.index is not None:
            return self.index
        ids = torch.arange(self.num_segments, device=self.mask.device)
        return span_values(ids, self.spans, self.num_segments)

    @property
    def num_segments(self) -> int:
        return int(self.segment_row.numel())

    @property
    def max_turns(self) -> int:
        return int(self.turns_per_row.max().item()) if self.turns_per_row.numel() else 0

    @property
    def turn_index(self) -> torch.Tensor:
        """``[B, T]`` long, turn number of each policy token within its row (0-based); -1
        off-policy. Built on request (no hot path needs it)."""
        first = torch.cumsum(self.turns_per_row, 0) - self.turns_per_row  # first segment of each row
        return torch.where(self.mask, self.segment_index - first.unsqueeze(1), torch.full_like(self.segment_index, -1))

    def turn_lengths(self) -> torch.Tensor:
        """``[B, max_turns]`` lengths of each row's turns (0 past a row's last turn)."""
        return self.to_dense(self.segment_length)

    def to_dense(self, per_segment: torch.Tensor) -> torch.Tensor:
        """Lay per-segment values out as ``[B, max_turns]`` (0 where a row has no such turn)."""
        batch = self.turns_per_row.numel()
        dense = per_segment.new_zeros(batch, max(self.max_turns, 1))
        first = torch.cumsum(self.turns_per_row, 0) - self.turns_per_row  # first segment of each row
        local = torch.arange(self.num_segments, device=per_segment.device) - first[self.segment_row]
        dense[self.segment_row, local] = per_segment
        return dense[:, : self.max_turns]

    def per_segment(self, values: torch.Tensor) -> torch.Tensor:
        """``[S]`` values of a ``[B, T]`` tensor that is constant over each segment (read at
        its first token)."""
        return values.reshape(-1)[self.segment_start]


def segment_turns(loss_mask: torch.Tensor, turn_ids: torch.Tensor | None = None) -> TurnSegments:
    """Segment each row into turns.

    Args:
        loss_mask: ``[B, T]``, 1 on policy tokens.
        turn_ids: optional ``[B, T]`` integer turn ids from the rollout; must be >= 0 on
            policy tokens (values elsewhere are ignored). Policy tokens of a row sharing an id
            form one turn, numbered in increasing id order.

    Whole-tensor work only: runs of the mask (or of the ids) are found from their boundaries,
    in one ``nonzero`` over the tokens; explicit ids that are not non-decreasing along a row (ids
    shared by separate runs) take a sort of the policy tokens' (row, id) keys instead.
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [batch, seq], got shape {tuple(loss_mask.shape)}")
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask.bool()
    batch, seq = mask.shape
    device = mask.device
    if turn_ids is not None and turn_ids.shape != mask.shape:
        raise ValueError(f"turn_ids shape {tuple(turn_ids.shape)} != loss_mask shape {tuple(mask.shape)}")
    if turn_ids is None:
        segment_start, segment_last, segment_row = _runs(mask)
        num_segments = int(segment_start.numel())
        lengths = segment_last - segment_start + 1
        spans, index = Spans(segment_start, segment_last, mask, runs_of_mask=True), None
    else:
        index, segment_row, lengths, segment_start, spans = _segments_from_ids(mask, turn_ids.long())
        num_segments = int(segment_row.numel())
    turns_per_row = (
        torch.bincount(segment_row, minlength=batch)
        if num_segments
        else torch.zeros(batch, dtype=torch.long, device=device)
    )
    return TurnSegments(
        segment_row=segment_row,
        segment_length=lengths.to(torch.float32),
        turns_per_row=turns_per_row,
        mask=mask,
        segment_start=segment_start,
        spans=spans,
        index=index,
    )


def _runs(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(first, last, row)`` of each run of ones, row-major; ``first`` / ``last`` flat indices
    into ``[B, T]``. One ``nonzero`` over the rows' steps ``m[t] - m[t - 1]`` (``t`` in
    ``0..T``, 0 outside the row): +1 where a run starts, -1 one past where it ends, so they
    alternate, start then stop, and no run crosses a row."""
    batch, seq = mask.shape
    m = mask.to(torch.int8)
    steps = m.new_zeros(batch, seq + 1)
    steps[:, :seq] = m
    steps[:, 1:] -= m
    where = torch.nonzero(steps.reshape(-1)).flatten()  # flat indices into [B, T + 1]
    starts, stops = where[0::2], where[1::2]
    row = torch.div(starts, seq + 1, rounding_mode="floor")
    return starts - row, stops - row - 1, row


def _segments_from_ids(mask: torch.Tensor, ids: torch.Tensor):
    """``(segment_index, segment_row, lengths, segment_start, spans)`` of explicit turn ids
    (``spans`` ``None`` when ids are out of order along a row)."""
    batch, seq = mask.shape
    flat_mask = mask.reshape(-1)
    policy_ids = ids.reshape(-1)[flat_mask]
    if bool((policy_ids < 0).any()):
        raise ValueError("turn_ids must be >= 0 on every policy token (loss_mask == 1)")
    span = int(policy_ids.max().item()) + 1 if policy_ids.numel() else 1
    position = torch.nonzero(flat_mask).flatten()  # flat index of each policy token, row-major
    keys = torch.div(position, seq, rounding_mode="floor") * span + policy_ids  # unique per (row, turn id)
    if keys.numel() < 2 or bool((keys[1:] >= keys[:-1]).all()):  # ids non-decreasing along rows: no sort
        uniq, inverse, counts = torch.unique_consecutive(keys, return_inverse=True, return_counts=True)
        last = torch.cumsum(counts, 0) - 1
        segment_start = position[last - counts + 1]
        spans = Spans(segment_start, position[last], mask, runs_of_mask=False)
    else:
        spans = None
        uniq, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
        segment_start = torch.full((uniq.numel(),), batch * seq, dtype=torch.long, device=mask.device)
        segment_start = segment_start.scatter_reduce(0, inverse, position, "amin")
    num_segments = int(uniq.numel())
    segment_index = torch.full((batch * seq,), num_segments, dtype=torch.long, device=mask.device)
    segment_index[position] = inverse
    segment_row = torch.div(uniq, span, rounding_mode="floor")
    return segment_index.reshape(batch, seq), segment_row, counts, segment_start, spans


def row_segments(loss_mask: torch.Tensor) -> TurnSegments:
    """Each non-empty row as a single segment (the sequence level used by GSPO)."""
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask.bool()
    batch, seq = mask.shape
    counts = mask.sum(dim=-1)
    nonempty = counts > 0
    segment_row = torch.nonzero(nonempty).flatten()
    as_bytes = mask.to(torch.uint8)
    first_token = as_bytes.argmax(dim=-1)  # first policy token (argmax returns the first max)
    last_token = seq - 1 - as_bytes.flip(-1).argmax(dim=-1)
    start = segment_row * seq + first_token[segment_row]
    spans = Spans(start, segment_row * seq + last_token[segment_row], mask, runs_of_mask=False)
    return TurnSegments(
        segment_row=segment_row,
        segment_length=counts[segment_row].to(torch.float32),
        turns_per_row=nonempty.long(),
        mask=mask,
        segment_start=start,
        spans=spans,
    )


def segment_sum(values: torch.Tensor, segments: TurnSegments) -> torch.Tensor:
    """``[S]`` sums of ``values`` over each segment's tokens (non-policy tokens ignored)."""
    if segments.spans is not None:
        return span_sum(values, segments.spans)
    flat = torch.where(segments.mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).reshape(-1)
    out = values.new_zeros(segments.num_segments + 1)
    out = out.index_add(0, segments.segment_index.reshape(-1), flat)
    return out[: segments.num_segments]


def broadcast_segments(per_segment: torch.Tensor, segments: TurnSegments, fill: float = 0.0) -> torch.Tensor:
    """``[B, T]`` tensor holding each token's segment value (``fill`` on non-policy tokens)."""
    if segments.spans is not None:
        return span_broadcast(per_segment, segments.spans, fill)
    padded = torch.cat([per_segment, per_segment.new_full((1,), fill)])
    return padded[segments.segment_index]


def segment_mean_broadcast(values: torch.Tensor, segments: TurnSegments) -> torch.Tensor:
    """Mean of ``values`` over each token's turn, broadcast back to the turn's tokens.

    This is the turn-ratio hot path (SORL eq. 4: ``log w_k = mean_{t in k} log r_t``).
    Gradients flow to every token of the turn with weight ``1 / |y^k|``. The Triton kernel
    where ``dispatch`` picks it (CUDA); otherwise over the spans when the segments are
    intervals, else :func:`.reference.segment_mean_broadcast_torch`.
    """
    if segments.spans is not None and not dispatch.use_triton(values):
        means = span_sum(values, segments.spans) / segments.segment_length.to(values.dtype)
        return span_broadcast(means, segments.spans)
    return dispatch.segment_mean_broadcast(values, segments.segment_index, segments.segment_length)
