"""Rank 0's RL batch to every rank, as tensors: each field whole, the routed experts per row.

Rank 0 alone rolls out, so it alone holds a step's batch. :func:`share_batch` sends it:

- a small description (each field's shape, dtype and wire dtype) with ``comm.broadcast_object``;
- every per-token / per-row field but the routed experts whole, with ``comm.broadcast``, each in
  the smallest integer type that holds its values (token ids in int32, masks in int8) and cast
  back on arrival, so the values are exact (every tensor travels as its bytes, ``as_bytes``).
  They are whole because the engines read them across rows: the micro-batch plans (every
  row's length), the mini-batch loss denominators (``loss_mask`` and ``advantages`` of the whole
  mini-batch), the advantages (a prompt's group) and the update's advantage statistics;
- the routed experts (``[B, S, L, K]``, about 98% of the bytes under R3: ``L x K`` numbers per
  token) only for the rows that rank's data-parallel passes read (``EngineBase.dp_rows``: the
  forward pass's plan and every mini-batch's of the update, computed identically on every rank
  from the rows' lengths and the seeded shuffle), only for real tokens (not the padding), in
  int8 (int16 past 127 experts), rank 0 to each rank with ``comm.send`` / ``comm.recv``. A rank
  holds them as a :class:`~.rl_batch.RoutedRows`, which reads -1 anywhere else, as the dense
  tensor's padding does.

Every engine sees the same values in the same micro-batches as with the whole batch, so
losses, gradients and weights are bit-identical; at world size 1 the batch is returned as it is.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..common import comm
from .rl_batch import RLBatch, RoutedRows

_INT_TYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def wire_dtype(t: torch.Tensor) -> torch.dtype:
    """The smallest integer type holding every value of ``t`` (integer tensors); else its own."""
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex or not t.numel():
        return t.dtype
    lo, hi = int(t.min()), int(t.max())
    for dtype in _INT_TYPES:
        info = torch.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return dtype
    return t.dtype


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a flat uint8 view (sent this way: NCCL has no int16 and gloo refuses it;
    every backend moves bytes, and a view of a receive buffer is filled in place)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def describe(batch: RLBatch) -> dict:
    """What the other ranks allocate: ``fields`` name -> (shape, dtype, wire dtype) of every
    field but the routed experts; ``routes`` (shape, dtype, wire dtype) or None."""
    fields = {name: (tuple(t.shape), t.dtype, wire_dtype(t))
              for name, t in batch.tensors().items() if name != "routed_experts"}
    r = batch.routed_experts
    if r is not None and not isinstance(r, (torch.Tensor, RoutedRows)):
        raise TypeError(f"share_batch: rank 0's routed_experts must be a tensor or RoutedRows, got {type(r).__name__}")
    wire = None if r is None else wire_dtype(r.values if isinstance(r, RoutedRows) else r)
    routes = None if r is None else (tuple(r.shape), r.dtype, wire)
    return {"fields": fields, "routes": routes}


def route_payload(routes: torch.Tensor | RoutedRows, attention_mask: torch.Tensor, rows: torch.Tensor,
                  wire: torch.dtype) -> torch.Tensor:
    """The routes of ``rows``' real tokens, ``[tokens, L, K]`` in ``wire`` (row by row, in order)."""
    if isinstance(routes, RoutedRows):  # collated packed: its rows' lengths are their real tokens
        return routes.tokens_of(rows).to(wire)
    return routes[rows][attention_mask[rows].bool()].to(wire)


def routed_rows(payload: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor,
                shape: tuple, dtype: torch.dtype) -> RoutedRows:
    """Undo :func:`route_payload`: the rows' routes, packed as they came (-1 read on padding)."""
    b, s = shape[:2]
    return RoutedRows(rows=rows, lengths=attention_mask[rows].sum(1), values=payload, batch_size=b, seq_len=s,
                      dtype=dtype)


def share_batch(batch: Optional[RLBatch], dp_rows: Callable[[RLBatch], list[torch.Tensor]],
                dp_rank: int) -> RLBatch:
    """Rank 0's ``batch`` (None elsewhere) on every rank; every rank calls it.

    ``dp_rows(batch)`` -> per data-parallel rank the global ids of the rows whose routes it reads
    (the engine's :meth:`~.base.EngineBase.dp_rows`, given the batch without routes); ``dp_rank``
    is this rank's data-parallel rank. Rank 0 keeps its own batch's tensors (routes included,
    as a :class:`RoutedRows` of its rows, so every rank runs the same code)."""
    if comm.world_size() == 1:
        return batch
    rank0 = comm.rank() == 0
    if rank0 and batch is None:
        raise ValueError("share_batch: rank 0 has no batch to send")
    meta = comm.broadcast_object(describe(batch) if rank0 else None)
    fields = {}
    for name, (shape, dtype, wire) in meta["fields"].items():
        if rank0:
            fields[name] = getattr(batch, name)
            comm.broadcast(as_bytes(fields[name].to(wire)), src=0)
        else:
            buf = torch.empty(shape, dtype=wire)
            comm.broadcast(as_bytes(buf), src=0)
            fields[name] = buf.to(dtype)
    light = RLBatch(**fields)
    if meta["routes"] is None:
        return light
    shape, dtype, wire = meta["routes"]
    plan = dp_rows(light)
    owner = comm.all_gather_object(dp_rank)  # each global rank's data-parallel rank
    att = light.filled().attention_mask
    mine = plan[dp_rank]
    if rank0:
        for dst in range(1, comm.world_size()):
            comm.send(as_bytes(route_payload(batch.routed_experts, att, plan[owner[dst]], wire)), dst)
        payload = route_payload(batch.routed_experts, att, mine, wire)
    else:
        payload = torch.empty((int(att[mine].sum()),) + tuple(shape[2:]), dtype=wire)
        comm.recv(as_bytes(payload), src=0)
    return light.replace(routed_experts=routed_rows(payload, att, mine, shape, dtype))
