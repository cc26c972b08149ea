"""The RL batch the Megatron engine consumes: tensors, validation, splitting.

Every rank holds the whole batch's per-token fields (CPU tensors are fine); the engine picks the
rows of its data-parallel rank, so the caller never needs to know the layout. The routed experts
(``[B, S, L, K]``, by far the largest field) may instead be a :class:`RoutedRows`: only the rows
this rank's passes read (what the trainer's batch transfer sends, ``batch_transfer.py``). Alignment (the same as
the rollout trajectories):

    logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])      (0 at t = 0 and off the mask)

so ``loss_mask[:, t] = 1`` marks ``input_ids[:, t]`` as a token the policy sampled, and every
per-token tensor (old/ref/rollout log-probs, advantages, returns, values, turn ids, routed
experts) is indexed by the position of the token it is about. Sequences are right padded;
``attention_mask`` is 1 on real tokens.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

# Per-token float tensors [B, S] (advantages may also be [B]).
TOKEN_FLOAT_FIELDS = ("old_logprobs", "ref_logprobs", "rollout_logprobs", "advantages", "returns", "values")


class BatchError(ValueError):
    """An RL batch the engine cannot use; the message names the field."""


@dataclass
class RoutedRows:
    """Routed experts of some rows of a ``[batch_size, seq_len, L, K]`` batch, packed: the routes
    of global row ``rows[i]`` (sorted) at its first ``lengths[i]`` positions are
    ``values[offsets[i]:offsets[i + 1]]`` (``[lengths[i], L, K]``, a compact integer type), rows
    after one another with no padding. Rank 0 collates a step's routes this way from the start
    (``rollout.trajectory.collate``: 1 byte per route below 128 experts), and each rank receives
    its rows' share this way (``batch_transfer``).

    Indexed by global row ids like the dense tensor it stands for (``[len(ids), seq_len, L, K]``
    in ``dtype``): -1 (no route: the live router decides) for ids at or past ``batch_size`` (the
    engine's dummy rows) and positions at or past a row's length (sequence padding). Asking for a
    row it does not hold is an error: the transfer's row plan and the engine's passes disagree.
    """

    rows: torch.Tensor
    lengths: torch.Tensor
    values: torch.Tensor
    batch_size: int
    seq_len: int
    dtype: torch.dtype = torch.int32

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.batch_size, self.seq_len) + tuple(self.values.shape[1:])

    def dim(self) -> int:
        return 4

    def with_seq_len(self, seq_len: int) -> "RoutedRows":
        return dataclasses.replace(self, seq_len=seq_len)

    def _positions(self, want: torch.Tensor) -> torch.Tensor:
        """Where each of the global row ids ``want`` (all below ``batch_size``) is held."""
        pos = torch.searchsorted(self.rows, want).clamp(max=max(len(self.rows) - 1, 0))
        held = self.rows[pos] == want if len(self.rows) else torch.zeros_like(want, dtype=torch.bool)
        if not held.all():
            missing = want[~held].tolist()
            raise BatchError(f"routed_experts: rows {missing[:8]} were not sent to this rank (it holds "
                             f"{len(self.rows)} of {self.batch_size} rows): the transfer's row plan and the "
                             "engine's passes disagree")
        return pos

    def _token_index(self, pos: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices into ``values`` of the held rows ``pos``' first ``min(length, limit)`` tokens,
        row after row; those per-row counts), with no loop over rows."""
        starts = torch.cumsum(self.lengths, 0) - self.lengths
        lens = self.lengths[pos].clamp(max=limit)
        first = torch.cumsum(lens, 0) - lens
        within = torch.arange(int(lens.sum())) - torch.repeat_interleave(first, lens)
        return torch.repeat_interleave(starts[pos], lens) + within, lens

    def tokens_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The routes of rows ``ids``' real tokens, ``[tokens, L, K]`` row after row (its dtype)."""
        index, _ = self._token_index(self._positions(torch.as_tensor(ids, dtype=torch.long)), self.seq_len)
        return self.values[index]

    def __getitem__(self, ids: torch.Tensor | slice) -> torch.Tensor:
        if isinstance(ids, slice):
            ids = torch.arange(self.batch_size)[ids]
        ids = torch.as_tensor(ids)
        if ids.dtype == torch.bool:  # a row mask, as the dense tensor takes one
            ids = ids.nonzero().flatten()
        ids = ids.to(torch.long)
        out = torch.full((len(ids), self.seq_len) + tuple(self.values.shape[1:]), -1, dtype=self.dtype)
        real = ids < self.batch_size
        want = ids[real]
        if not len(want):
            return out
        index, lens = self._token_index(self._positions(want), self.seq_len)
        held = torch.full((len(want), self.seq_len) + tuple(self.values.shape[1:]), -1, dtype=self.dtype)
        held[torch.arange(self.seq_len)[None, :] < lens[:, None]] = self.values[index].to(self.dtype)
        out[real] = held
        return out


@dataclass
class RLBatch:
    """One RL batch (rows = trajectories, right padded to a common length S).

    Attributes:
        input_ids: [B, S] int token ids (prompt + response + tool observations).
        attention_mask: [B, S] 1 on real tokens, 0 on right padding (default: all ones).
        loss_mask: [B, S] 1 on tokens the policy sampled (the tokens a loss is taken on).
        position_ids: [B, S] optional; default ``arange(S)`` per row.
        old_logprobs / ref_logprobs / rollout_logprobs: [B, S] log pi_old / pi_ref / mu.
        advantages: [B, S] per token or [B] per sequence.
        returns: [B, S] value targets (critic); values: [B, S] old values (clipped value loss).
        routed_experts: [B, S, L, K] int, experts of token t at layer l (top-k, -1 = missing:
            the live router decides), for routing replay (R2 records it, R3 is given it); or a
            :class:`RoutedRows` holding only the rows this rank's passes read.
        group_ids: [B] prompt group of each row (GRPO/PVPO bookkeeping; carried, not used).
        turn_ids: [B, S] explicit turn ids for turn-level losses (else turns = mask runs).
    """

    input_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor] = None
    loss_mask: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    routed_experts: Optional[torch.Tensor] = None
    group_ids: Optional[torch.Tensor] = None
    turn_ids: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def replace(self, **changes) -> "RLBatch":
        return dataclasses.replace(self, **changes)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def select(self, rows: torch.Tensor | slice) -> "RLBatch":
        """The sub-batch of `rows` (a slice or an index tensor)."""
        return RLBatch(**{k: v[rows] for k, v in self.tensors().items()})

    def filled(self) -> "RLBatch":
        """With the defaults made explicit (attention_mask, loss_mask, position_ids)."""
        b, s = self.input_ids.shape
        att = self.attention_mask if self.attention_mask is not None else torch.ones(b, s, dtype=torch.long)
        loss = self.loss_mask if self.loss_mask is not None else torch.zeros(b, s, dtype=torch.long)
        pos = self.position_ids if self.position_ids is not None else torch.arange(s).unsqueeze(0).expand(b, s)
        return self.replace(attention_mask=att, loss_mask=loss, position_ids=pos)

    def padded_rows(self, multiple: int) -> tuple["RLBatch", int]:
        """Append dummy rows (one attended token, empty loss mask) up to a multiple of `multiple`.
        Returns the padded batch and the original row count."""
        b = self.batch_size
        extra = (-b) % multiple
        if extra == 0:
            return self, b
        out = {}
        for name, t in self.filled().tensors().items():
            if isinstance(t, RoutedRows):  # dummy rows (ids >= its batch_size) read -1 already
                out[name] = t
                continue
            pad = torch.zeros((extra,) + tuple(t.shape[1:]), dtype=t.dtype)
            if name == "attention_mask":
                pad[:, 0] = 1
            elif name == "position_ids":
                pad = t[:1].expand_as(pad).clone()
            elif name == "routed_experts":
                pad.fill_(-1)
            out[name] = torch.cat([t, pad], dim=0)
        return RLBatch(**out), b

    def padded_seq(self, multiple: int) -> "RLBatch":
        """Right-pad the sequence dimension to a multiple of `multiple` (sequence parallelism
        needs S divisible by TP)."""
        s = self.seq_len
        extra = (-s) % multiple
        if extra == 0:
            return self
        out = {}
        for name, t in self.filled().tensors().items():
            if isinstance(t, RoutedRows):  # positions past its own length read -1
                out[name] = t.with_seq_len(s + extra)
                continue
            if t.dim() < 2 or name == "group_ids" or (name == "advantages" and t.dim() == 1):
                out[name] = t
                continue
            pad = torch.zeros((t.shape[0], extra) + tuple(t.shape[2:]), dtype=t.dtype)
            if name == "position_ids":
                pad = t[:, -1:] + torch.arange(1, extra + 1, dtype=t.dtype).unsqueeze(0)
            elif name == "routed_experts":
                pad.fill_(-1)
            out[name] = torch.cat([t, pad], dim=1)
        return RLBatch(**out)


def validate_batch(
    batch: RLBatch,
    *,
    need: tuple[str, ...] = (),
    vocab_size: Optional[int] = None,
    num_layers: Optional[int] = None,
    topk: Optional[int] = None,
    num_experts: Optional[int] = None,
) -> RLBatch:
    """Check shapes, dtypes and padding; return the batch with defaults filled in.

    Raises :class:`BatchError` naming the offending field. Runs on every rank on the same
    data, so every rank raises together (no rank is left waiting in a collective).
    """
    if not isinstance(batch, RLBatch):
        raise BatchError(f"expected an RLBatch, got {type(batch).__name__}")
    ids = batch.input_ids
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise BatchError(f"input_ids must be a [batch, seq] tensor, got {getattr(ids, 'shape', type(ids))}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise BatchError(f"input_ids must be an integer tensor, got {ids.dtype}")
    b, s = ids.shape
    if b == 0 or s == 0:
        raise BatchError(f"empty batch: input_ids has shape {tuple(ids.shape)}")
    if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise BatchError(f"input_ids out of range [0, {vocab_size}): min {int(ids.min())}, max {int(ids.max())}")
    for name in need:
        if getattr(batch, name) is None:
            raise BatchError(f"{name} is required for this call but is None")
    for name in ("attention_mask", "loss_mask", "position_ids", "turn_ids", *TOKEN_FLOAT_FIELDS):
        t = getattr(batch, name)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise BatchError(f"{name} must be a tensor, got {type(t).__name__}")
        if name == "advantages" and t.dim() == 1:
            if t.shape[0] != b:
                raise BatchError(f"advantages shape {tuple(t.shape)} must be ({b},) or ({b}, {s})")
            continue
        if tuple(t.shape) != (b, s):
            raise BatchError(f"{name} shape {tuple(t.shape)} != input_ids shape {(b, s)}")
        if name in TOKEN_FLOAT_FIELDS and not torch.isfinite(t.float()).all():
            raise BatchError(f"{name} has non-finite entries")
    batch = batch.filled()
    att = batch.attention_mask.bool()
    if not att[:, 0].all():
        row = int((~att[:, 0]).nonzero()[0])
        raise BatchError(f"attention_mask[{row}, 0] is 0: rows must start with a real token (right padding only)")
    # Right padding: once 0, stays 0 (a non-increasing mask).
    if (att[:, 1:] & ~att[:, :-1]).any():
        row = int((att[:, 1:] & ~att[:, :-1]).any(dim=1).nonzero()[0])
        raise BatchError(f"attention_mask row {row} is not right padded (a 1 follows a 0)")
    if (batch.loss_mask.bool() & ~att).any():
        raise BatchError("loss_mask is 1 on padding (attention_mask == 0)")
    if batch.loss_mask.bool()[:, 0].any():
        raise BatchError("loss_mask[:, 0] must be 0: the first token has no log-prob (nothing precedes it)")
    if batch.group_ids is not None and tuple(batch.group_ids.shape) != (b,):
        raise BatchError(f"group_ids shape {tuple(batch.group_ids.shape)} must be ({b},)")
    if batch.routed_experts is not None:
        validate_routed_experts(batch.routed_experts, b, s, num_layers, topk, num_experts)
    return batch


def validate_routed_experts(
    routed: torch.Tensor, b: int, s: int, num_layers: Optional[int], topk: Optional[int], num_experts: Optional[int]
) -> None:
    if not isinstance(routed, (torch.Tensor, RoutedRows)) or routed.dim() != 4:
        raise BatchError(
            f"routed_experts must be [batch, seq, layers, topk], got shape {tuple(getattr(routed, 'shape', ()))}"
        )
    want = (
        b,
        s,
        num_layers if num_layers is not None else routed.shape[2],
        topk if topk is not None else routed.shape[3],
    )
    if tuple(routed.shape) != want:
        raise BatchError(f"routed_experts shape {tuple(routed.shape)} != expected {want} (batch, seq, layers, topk)")
    values = routed.values if isinstance(routed, RoutedRows) else routed
    if routed.dtype.is_floating_point or values.dtype.is_floating_point:
        raise BatchError(f"routed_experts must be an integer tensor, got {routed.dtype}")
    if num_experts is not None and values.numel():
        lo, hi = int(values.min()), int(values.max())
        if lo < -1 or hi >= num_experts:
            raise BatchError(f"routed_experts values must be in [-1, {num_experts}) (-1 = missing), got [{lo}, {hi}]")


def split_rows(n_rows: int, parts: int, what: str) -> list[slice]:
    """`parts` equal contiguous slices of range(n_rows); error naming `what` if not divisible."""
    if parts <= 0 or n_rows % parts:
        raise BatchError(f"{what}: {n_rows} rows do not split into {parts} equal parts")
    size = n_rows // parts
    return [slice(i * size, (i + 1) * size) for i in range(parts)]


def routed_experts_from_sglang(
    encoded: str | bytes,
    *,
    num_layers: int,
    topk: int,
    seq_len: int,
    start_len: int = 0,
) -> torch.Tensor:
    """Decode SGLang's ``meta_info.routed_experts`` (base64 of little-endian int32
    ``[prompt+completion-1-start_len, layers, topk]``) into ``[seq_len, layers, topk]`` aligned
    to token positions: row t = routing of the token at position t. Positions before
    ``start_len``, the last (never fed) token and padding get -1 (the live router decides)."""
    raw = base64.b64decode(encoded) if isinstance(encoded, (str, bytes)) else encoded
    arr = np.frombuffer(raw, dtype="<i4")
    per_token = num_layers * topk
    if arr.size % per_token:
        raise BatchError(f"routed_experts: {arr.size} int32 values are not a multiple of layers*topk={per_token}")
    n = arr.size // per_token
    if start_len + n > seq_len:
        raise BatchError(f"routed_experts covers positions [{start_len}, {start_len + n}) beyond seq_len={seq_len}")
    out = torch.full((seq_len, num_layers, topk), -1, dtype=torch.int32)
    out[start_len:start_len + n] = torch.from_numpy(arr.reshape(n, num_layers, topk).copy())
    return out
