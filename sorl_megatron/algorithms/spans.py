"""Segment reductions over intervals of the flattened batch, without a per-token index.

When every segment (a turn, a row's policy tokens) is an interval of the row-major flattened
``[B, T]`` batch and the intervals do not overlap, which holds for turns found as runs of the
mask and for explicit turn ids that never decrease along a row, the batch is a sequence of
alternating pieces (gap, segment, gap, ..., segment, gap): a segment's sum is one reduction
over the pieces, and broadcasting a per-segment value back is one ``repeat_interleave`` over
them. Neither builds the ``[B, T]`` int64 segment index that ``index_add`` and
a gather need, and each op's backward is the other one, written as autograd functions.

A sum reduces every piece (``torch.segment_reduce`` over the piece lengths) and keeps the
segments' pieces: the gaps' values (prompts, observations, padding, whatever they hold) land in
pieces of their own and are dropped, and each segment accumulates in the values' dtype as
``index_add`` did.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Spans:
    """Non-overlapping intervals of the flattened ``[B, T]`` batch, in increasing order.

    Attributes:
        first: ``[S]`` long, flat index of each segment's first token.
        last: ``[S]`` long, flat index of each segment's last token.
        mask: ``[B, T]`` bool, the tokens that belong to a segment (an interval may hold tokens
            outside the mask: a turn id shared across a tool observation).
        runs_of_mask: the intervals are exactly the runs of ``mask`` (no gap inside one).
    """

    first: torch.Tensor
    last: torch.Tensor
    mask: torch.Tensor
    runs_of_mask: bool

    @functools.cached_property
    def piece_lengths(self) -> torch.Tensor:
        """``[2S + 1]`` lengths of gap, segment, gap, ..., segment, gap (gaps may be 0)."""
        total = self.mask.numel()
        ends = torch.cat([self.first.new_zeros(1), self.last + 1])  # one past the previous segment
        gaps = torch.cat([self.first, self.first.new_full((1,), total)]) - ends
        spans = self.last - self.first + 1
        lengths = gaps.new_empty(2 * spans.numel() + 1)
        lengths[0::2] = gaps
        lengths[1::2] = spans
        return lengths


def span_sum(values: torch.Tensor, spans: Spans) -> torch.Tensor:
    """``[S]`` sums of ``values`` (``[B, T]``) over each segment's tokens, with gradient."""
    return _SpanSum.apply(values, spans)


def span_broadcast(per_segment: torch.Tensor, spans: Spans, fill: float = 0.0) -> torch.Tensor:
    """``[B, T]`` tensor holding each token's segment value (``fill`` elsewhere), with gradient
    to ``per_segment``."""
    return _SpanBroadcast.apply(per_segment, spans, fill)


def span_values(per_segment: torch.Tensor, spans: Spans, fill: float | int) -> torch.Tensor:
    """:func:`span_broadcast` without autograd, for any dtype (an integer segment index)."""
    return _broadcast(per_segment, spans, fill)


def _sum(values: torch.Tensor, spans: Spans) -> torch.Tensor:
    if not spans.runs_of_mask:  # an interval holds tokens outside the mask: they add nothing
        values = torch.where(spans.mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    pieces = torch.segment_reduce(values.reshape(-1), "sum", lengths=spans.piece_lengths)
    return pieces[1::2]


def _broadcast(per_segment: torch.Tensor, spans: Spans, fill: float) -> torch.Tensor:
    pieces = per_segment.new_full((2 * per_segment.numel() + 1,), fill)
    pieces[1::2] = per_segment
    out = torch.repeat_interleave(pieces, spans.piece_lengths, output_size=spans.mask.numel())
    out = out.reshape(spans.mask.shape)
    if not spans.runs_of_mask:  # an interval holds tokens outside the mask: they get `fill`
        out = torch.where(spans.mask, out, torch.full((), fill, dtype=out.dtype, device=out.device))
    return out


class _SpanSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, spans: Spans) -> torch.Tensor:
        ctx.spans = spans
        return _sum(values, spans)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _broadcast(grad, ctx.spans, 0.0), None


class _SpanBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, per_segment: torch.Tensor, spans: Spans, fill: float) -> torch.Tensor:
        ctx.spans = spans
        return _broadcast(per_segment, spans, fill)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum(grad, ctx.spans), None, None
