"""MoE routing replay (MiniRL R2 / R3) on top of megatron-core's built-in ``RouterReplay``.

Build the model with ``TransformerConfig.moe_enable_routing_replay=True`` (the engine does it):
every ``TopKRouter`` then owns a ``RouterReplay`` whose ``get_replay_topk`` megatron calls
for the top-k selection. :func:`install` gives each instance of *this* model a replacement
``get_replay_topk`` (an instance attribute: other models in the process and megatron's own
class are untouched) that adds what RL needs on top of megatron's record/replay:

- per-token fallback: a token whose replayed row has a -1 (prompt tokens SGLang did not
  return, padding, the last token) uses the live router's choice;
- a record *list* per micro-batch (megatron keeps only the last call's indices);
- statistics: how many replayed (token, layer) pairs the live router would have routed
  differently (``routing/replay_mismatch_frac``);
- activation recompute: a forward re-run inside autograd's backward pops the FIFO that
  megatron's ``set_target_indices`` fills (its ``REPLAY_BACKWARD`` semantics), so
  recomputed layers see the same routing as the forward.

Indices are addressed by *global* layer number (``router.layer_number - 1``), so every
pipeline stage / virtual chunk takes its own layers' slice of ``routed_experts [B, S, L, K]``,
and under sequence parallelism each TP rank takes its own slice of positions: the router
sees tokens in megatron's ``[s, b]`` order, flattened.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Optional

import torch

from .rl_batch import BatchError


@dataclass
class RouterSlot:
    chunk: int  # model chunk (virtual stage) index on this rank
    layer: int  # global 0-based layer index
    replay: object  # megatron RouterReplay


def _replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
    mode = getattr(self, "_sorl_mode", None)
    live_probs, live_idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    if mode is None:
        return live_probs, live_idx
    if mode == "record":
        self._sorl_records.append(live_idx.detach().clone())
        return live_probs, live_idx
    in_backward = torch._C._current_graph_task_id() != -1  # activation recompute
    if in_backward:
        if not self.replay_backward_list:
            raise RuntimeError("routing replay: recompute found no replay indices (FIFO empty)")
        target = self.replay_backward_list.pop(0)
    else:
        target = self.target_topk_idx
    if target is None:  # no routing for this micro-batch: live routing
        return live_probs, live_idx
    target = target.to(device=scores.device, dtype=torch.long)
    if target.shape != live_idx.shape:
        raise BatchError(
            f"routed_experts slice for layer {self._sorl_layer} has {tuple(target.shape)} "
            f"(tokens, topk) but the router sees {tuple(live_idx.shape)}"
        )
    given = (target >= 0).all(dim=1, keepdim=True)
    idx = torch.where(given, target, live_idx)
    probs = scores.gather(1, idx)
    if not in_backward and getattr(self, "_sorl_keep", False):
        self._sorl_records.append(idx.detach().clone())  # the routing actually used
    if not in_backward:
        with torch.no_grad():
            differs = (torch.sort(idx, dim=1).values != torch.sort(live_idx, dim=1).values).any(dim=1)
            counts = torch.stack([given.sum(), (differs & given.squeeze(1)).sum()])
            # on the router's device: no host synchronization per layer and micro-batch; the pass
            # reads the sum once (RoutingReplay.end)
            self._sorl_stats = counts if self._sorl_stats is None else self._sorl_stats + counts
    return probs, idx


def router_slots(chunks: list[torch.nn.Module]) -> list[RouterSlot]:
    """Every routing-replay-enabled router in the (unwrapped) chunks, with its global layer."""
    from megatron.core.transformer.moe.router import TopKRouter

    slots = []
    for ci, chunk in enumerate(chunks):
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                if module.router_replay is None:
                    raise ValueError("routing replay needs the model built with moe_enable_routing_replay=True")
                if module.layer_number is None:
                    raise RuntimeError("a MoE router has no layer_number; cannot map routed_experts layers")
                slots.append(RouterSlot(ci, int(module.layer_number) - 1, module.router_replay))
    return slots


def install(chunks: list[torch.nn.Module]) -> list[RouterSlot]:
    """Give this model's RouterReplay instances the RL replay behaviour (idempotent)."""
    slots = router_slots(chunks)
    for slot in slots:
        rr = slot.replay
        if not getattr(rr, "_sorl_installed", False):
            rr.get_replay_topk = types.MethodType(_replay_topk, rr)
            rr._sorl_installed = True
        rr._sorl_layer = slot.layer
        rr._sorl_mode = None
        rr._sorl_records = []
        rr._sorl_stats = None  # [replayed, mismatched] pairs, int64 on the router's device
    return slots


def _sp_slice(seq_len: int, sequence_parallel: bool) -> slice:
    """The positions this rank's routers see: a contiguous 1/TP slice under sequence parallelism."""
    from megatron.core import parallel_state as mpu

    tp = mpu.get_tensor_model_parallel_world_size()
    if not (sequence_parallel and tp > 1):
        return slice(0, seq_len)
    local = seq_len // tp
    r = mpu.get_tensor_model_parallel_rank()
    return slice(r * local, (r + 1) * local)


class RoutingReplay:
    """Record/replay control for one model's routers during one engine pass."""

    def __init__(self, chunks: list[torch.nn.Module], sequence_parallel: bool):
        self.slots = install(chunks)
        self.sequence_parallel = sequence_parallel
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._actions = RouterReplayAction

    @property
    def enabled(self) -> bool:
        return bool(self.slots)

    def begin(self, mode: Optional[str], keep_used: bool = False) -> None:
        """mode: None (live routing), 'record' or 'replay'; `keep_used` also records the routing
        used while replaying (for :meth:`collect_records`)."""
        action = {None: None, "record": self._actions.RECORD, "replay": self._actions.REPLAY_FORWARD}[mode]
        for s in self.slots:
            rr = s.replay
            rr.clear_indices()
            rr._sorl_mode = mode
            rr._sorl_keep = keep_used
            rr._sorl_records = []
            rr._sorl_stats = None
            if action is None:
                rr.clear_router_replay_action()
            else:
                rr.set_router_replay_action(action)

    def end(self) -> torch.Tensor:
        """Stop; returns this rank's [replayed pairs, mismatched pairs] (float64, on the host:
        the one read of the pass's counts, which stayed on the routers' device until here)."""
        counts = [s.replay._sorl_stats for s in self.slots if s.replay._sorl_stats is not None]
        stats = torch.stack(counts).sum(0).to("cpu", torch.float64) if counts else torch.zeros(2, dtype=torch.float64)
        for s in self.slots:
            rr = s.replay
            rr._sorl_stats = None
            rr._sorl_mode = None
            rr._sorl_keep = False
            rr.clear_indices()
            rr.clear_router_replay_action()
            rr._sorl_records = []
        return stats

    def set_targets(self, chunk: int, routed: Optional[torch.Tensor]) -> None:
        """Before a chunk's forward of one micro-batch: routed [b, s, L, K] (or None = live)."""
        for s in self.slots:
            if s.chunk != chunk:
                continue
            if routed is None:
                s.replay.target_topk_idx = None
                continue
            sl = _sp_slice(routed.shape[1], self.sequence_parallel)
            local = routed[:, sl, s.layer, :].transpose(0, 1).reshape(-1, routed.shape[-1])
            s.replay.set_target_indices(local.to(torch.long))

    def collect_records(self, chunk: int, out: torch.Tensor, token_rows: torch.Tensor, token_pos: torch.Tensor) -> None:
        """After a chunk's forward in record mode: write the recorded indices (+1, so that 0
        means 'not written') into ``out[row, position, layer, :]`` of every token this rank's
        routers saw. ``token_rows`` / ``token_pos`` ``[b, s]`` give each model position's row
        and position in ``out`` (-1 for packing padding, never written)."""
        seq_len = token_rows.shape[1]
        sl = _sp_slice(seq_len, self.sequence_parallel)
        rows, pos = token_rows[:, sl], token_pos[:, sl]
        keep = rows >= 0
        layers, records = [], []
        for s in self.slots:
            if s.chunk == chunk and s.replay._sorl_records:
                layers.append(s.layer)
                records.append(s.replay._sorl_records.pop(0))
        if not records:
            return
        # one copy to the host for all of the chunk's layers, not one per layer
        idx = torch.stack(records).to("cpu")  # [layers, tokens (sequence-major), K]
        idx = idx.view(len(records), rows.shape[1], rows.shape[0], -1).transpose(1, 2)  # [layers, b, s, K]
        where = torch.tensor(layers).unsqueeze(1)
        out[rows[keep].unsqueeze(0), pos[keep].unsqueeze(0), where, :] = idx[:, keep].to(out.dtype) + 1
