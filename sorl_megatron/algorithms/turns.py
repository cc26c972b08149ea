"""Turn segmentation of multi-turn trajectories (SORL appendix A.4).

A *turn* is a maximal run of policy tokens (``loss_mask == 1``) in a row; runs of zeros are
prompts, tool observations or padding. Alternatively the rollout supplies explicit turn ids
per token: then all policy tokens of a row with the same id form one turn.

Segments are numbered globally (row-major: all turns of row 0, then row 1, ...), so segment
reductions are single ``index_add`` / gather operations over the flattened batch, with no
Python loop over rows or turns. Non-policy tokens point to one extra "dummy" segment whose
values are discarded; that keeps every scatter unmasked and branch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import dispatch


@dataclass(frozen=True)
class TurnSegments:
    """Turn structure of a ``[batch, seq]`` batch.

    Attributes:
        segment_index: ``[B, T]`` long, global segment id of each policy token; non-policy
            tokens hold ``num_segments`` (the dummy segment).
        turn_index: ``[B, T]`` long, turn number within its row (0-based); -1 off-policy.
        segment_row: ``[S]`` long, the row of each segment.
        segment_length: ``[S]`` float, number of tokens in each segment (>= 1).
        turns_per_row: ``[B]`` long.
        mask: ``[B, T]`` bool, the policy-token mask the segments were built from.
    """

    segment_index: torch.Tensor
    turn_index: torch.Tensor
    segment_row: torch.Tensor
    segment_length: torch.Tensor
    turns_per_row: torch.Tensor
    mask: torch.Tensor

    @property
    def num_segments(self) -> int:
        return int(self.segment_row.numel())

    @property
    def max_turns(self) -> int:
        return int(self.turns_per_row.max().item()) if self.turns_per_row.numel() else 0

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


def segment_turns(loss_mask: torch.Tensor, turn_ids: torch.Tensor | None = None) -> TurnSegments:
    """Segment each row into turns.

    Args:
        loss_mask: ``[B, T]``, 1 on policy tokens.
        turn_ids: optional ``[B, T]`` integer turn ids from the rollout; must be >= 0 on
            policy tokens (values elsewhere are ignored). Policy tokens of a row sharing an id
            form one turn, numbered in increasing id order.
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [batch, seq], got shape {tuple(loss_mask.shape)}")
    mask = loss_mask.bool()
    batch, seq = mask.shape
    device = mask.device
    rows = torch.arange(batch, device=device).unsqueeze(1).expand(batch, seq)

    if turn_ids is None:
        prev = torch.zeros_like(mask)
        prev[:, 1:] = mask[:, :-1]
        starts = mask & ~prev
        # Row-major cumsum of run starts numbers every run globally; a run never crosses rows
        # because a policy token at t == 0 always starts a run.
        global_id = torch.cumsum(starts.reshape(-1).long(), 0).reshape(batch, seq) - 1
        num_segments = int(starts.sum().item())
        segment_row = rows[starts]
    else:
        if turn_ids.shape != mask.shape:
            raise ValueError(f"turn_ids shape {tuple(turn_ids.shape)} != loss_mask shape {tuple(mask.shape)}")
        ids = turn_ids.long()
        if bool((ids[mask] < 0).any()):
            raise ValueError("turn_ids must be >= 0 on every policy token (loss_mask == 1)")
        span = int(ids[mask].max().item()) + 1 if bool(mask.any()) else 1
        keys = rows * span + ids  # unique per (row, turn id); sorted by row, then id
        uniq, inverse = torch.unique(keys[mask], return_inverse=True)
        global_id = torch.full_like(ids, -1)
        global_id[mask] = inverse
        num_segments = int(uniq.numel())
        segment_row = torch.div(uniq, span, rounding_mode="floor")

    segment_index = torch.where(mask, global_id, torch.full_like(global_id, num_segments))
    counts = torch.zeros(num_segments + 1, device=device, dtype=torch.float32)
    counts.index_add_(0, segment_index.reshape(-1), mask.reshape(-1).to(torch.float32))
    turns_per_row = (
        torch.bincount(segment_row, minlength=batch)
        if num_segments
        else torch.zeros(batch, dtype=torch.long, device=device)
    )
    first = torch.cumsum(turns_per_row, 0) - turns_per_row
    turn_index = torch.where(mask, global_id - first[rows], torch.full_like(global_id, -1))
    return TurnSegments(
        segment_index=segment_index,
        turn_index=turn_index,
        segment_row=segment_row,
        segment_length=counts[:num_segments],
        turns_per_row=turns_per_row,
        mask=mask,
    )


def row_segments(loss_mask: torch.Tensor) -> TurnSegments:
    """Each non-empty row as a single segment (the sequence level used by GSPO)."""
    return segment_turns(loss_mask, turn_ids=torch.zeros_like(loss_mask, dtype=torch.long))


def segment_sum(values: torch.Tensor, segments: TurnSegments) -> torch.Tensor:
    """``[S]`` sums of ``values`` over each segment's tokens (non-policy tokens ignored)."""
    flat = torch.where(segments.mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).reshape(-1)
    out = values.new_zeros(segments.num_segments + 1)
    out = out.index_add(0, segments.segment_index.reshape(-1), flat)
    return out[: segments.num_segments]


def broadcast_segments(per_segment: torch.Tensor, segments: TurnSegments, fill: float = 0.0) -> torch.Tensor:
    """``[B, T]`` tensor holding each token's segment value (``fill`` on non-policy tokens)."""
    padded = torch.cat([per_segment, per_segment.new_full((1,), fill)])
    return padded[segments.segment_index]


def segment_mean_broadcast(values: torch.Tensor, segments: TurnSegments) -> torch.Tensor:
    """Mean of ``values`` over each token's turn, broadcast back to the turn's tokens.

    This is the turn-ratio hot path (SORL eq. 4: ``log w_k = mean_{t in k} log r_t``).
    Gradients flow to every token of the turn with weight ``1 / |y^k|``. Routed through
    ``dispatch``: the Triton kernel on CUDA, :func:`.reference.segment_mean_broadcast_torch` otherwise.
    """
    return dispatch.segment_mean_broadcast(values, segments.segment_index, segments.segment_length)
