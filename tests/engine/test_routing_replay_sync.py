"""Routing replay reads nothing back to the host per layer or micro-batch.

On a GPU every copy to the host waits for the device. The replay statistics stay on the router's
device (checked with ``meta`` tensors, which cannot be copied to the host at all: a copy per call
raises) and are read once when the pass ends; the recorded routes of a chunk's layers go to the
host in one copy per micro-batch, whatever the number of layers. No GPU here: the device is
``meta`` for the statistics, and copies are counted by wrapping ``Tensor.to`` / ``Tensor.cpu``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch

from sorl_megatron.engine import routing_replay
from sorl_megatron.engine.routing_replay import RoutingReplay, _replay_topk


def _topk(scores, topk, num_groups=None, group_topk=None):
    probs, idx = torch.topk(scores, topk, dim=1)
    return probs, idx


class _Replay:
    """The attributes of megatron's RouterReplay that the hook reads."""

    def __init__(self, layer: int):
        self._sorl_layer, self._sorl_mode, self._sorl_keep = layer, None, False
        self._sorl_records, self._sorl_stats = [], None
        self.replay_backward_list, self.target_topk_idx = [], None
        self.get_replay_topk = types.MethodType(_replay_topk, self)

    def clear_indices(self):
        pass

    def clear_router_replay_action(self):
        pass


@dataclass
class _Slot:
    chunk: int
    layer: int
    replay: _Replay


def _replay(layers: int) -> RoutingReplay:
    rr = RoutingReplay.__new__(RoutingReplay)
    rr.slots = [_Slot(0, i, _Replay(i)) for i in range(layers)]
    rr.sequence_parallel = False
    return rr


def test_the_statistics_stay_on_the_routers_device():
    replay = _replay(3)
    tokens, experts, k = 6, 8, 2
    for s in replay.slots:
        s.replay._sorl_mode = "replay"
        s.replay.target_topk_idx = torch.zeros(tokens, k, dtype=torch.long, device="meta")
        for _ in range(4):  # four micro-batches
            s.replay.get_replay_topk(torch.empty(tokens, experts, device="meta"), k, default_compute_topk=_topk)
        assert s.replay._sorl_stats.device.type == "meta"  # a host copy per call cannot be made from meta


def test_the_statistics_are_read_once_and_sum_every_call(monkeypatch):
    replay = _replay(3)
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.3], [0.2, 0.8, 0.1, 0.7]])
    target = torch.tensor([[0, 2], [3, 0]])  # row 0 as live routing, row 1 differs
    for s in replay.slots:
        s.replay._sorl_mode = "replay"
        s.replay.target_topk_idx = target
        for _ in range(2):
            s.replay.get_replay_topk(scores, 2, default_compute_topk=_topk)
    reads = _count_host_copies(monkeypatch)
    stats = replay.end()
    assert stats.tolist() == [12.0, 6.0]  # 3 layers x 2 calls x 2 tokens replayed, half of them differ
    assert stats.dtype == torch.float64
    assert reads["n"] == 1


def _count_host_copies(monkeypatch) -> dict:
    reads = {"n": 0}
    to, cpu = torch.Tensor.to, torch.Tensor.cpu

    def counting_to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
            reads["n"] += 1
        return to(self, *args, **kwargs)

    def counting_cpu(self, *args, **kwargs):
        reads["n"] += 1
        return cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    return reads


@pytest.mark.parametrize("layers", [2, 5])
def test_recorded_routes_go_to_the_host_in_one_copy_per_micro_batch(monkeypatch, layers):
    monkeypatch.setattr(routing_replay, "_sp_slice", lambda seq_len, sequence_parallel: slice(0, seq_len))
    b, s, k = 2, 3, 2
    replay = _replay(layers)
    g = torch.Generator().manual_seed(layers)
    records = [torch.randint(0, 8, (s * b, k), generator=g) for _ in range(layers)]  # sequence-major, as megatron
    for slot, rec in zip(replay.slots, records):
        slot.replay._sorl_records = [rec]
    token_rows = torch.tensor([[0, 0, -1], [1, 1, 1]])  # one padding position (-1): never written
    token_pos = torch.tensor([[0, 1, 0], [0, 1, 2]])
    out = torch.zeros(2, 3, layers, k, dtype=torch.int16)
    reads = _count_host_copies(monkeypatch)
    replay.collect_records(0, out, token_rows, token_pos)
    assert reads["n"] == 1
    expected = torch.zeros_like(out)
    for layer, rec in enumerate(records):
        by_row = rec.view(s, b, k).transpose(0, 1)
        for r in range(b):
            for p in range(s):
                if token_rows[r, p] >= 0:
                    expected[token_rows[r, p], token_pos[r, p], layer] = by_row[r, p] + 1
    assert torch.equal(out, expected)
    assert all(not slot.replay._sorl_records for slot in replay.slots)
