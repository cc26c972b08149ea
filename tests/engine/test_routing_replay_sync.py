"""The update and log-prob passes read nothing back to the host per layer or micro-batch.

Routing replay, the policy loss with its metrics, the |log r| histogram and the metric
accumulation of a micro-batch, and the TE-less packed attention of a layer: each keeps its
results on the device, and the pass reads them once.

On a GPU every copy to the host waits for the device. The replay statistics stay on the router's
device (checked with ``meta`` tensors, which cannot be copied to the host at all: a copy per call
raises) and are read once when the pass ends; the recorded routes of a chunk's layers go to the
host in one copy per micro-batch, whatever the number of layers. No GPU here: the device is
``meta`` for the statistics, and copies are counted by wrapping ``Tensor.to`` / ``Tensor.cpu``.
"""

from __future__ import annotations

import sys
import types
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from sorl_megatron.algorithms import PolicyLossConfig, aggregation, compute_policy_loss, loss_denominators, loss_metrics
from sorl_megatron.algorithms.diagnostics import abs_log_ratio_histogram
from sorl_megatron.bridge.local_spec import LocalDotProductAttention
from sorl_megatron.engine import routing_replay
from sorl_megatron.engine.base import accumulate_metrics, metrics_to_host
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


class _HostReads(TorchDispatchMode):
    """Counts the ops that make the host wait for the device: a scalar read (``.item()``,
    ``bool(t)``, ``float(t)``, an index given as a 0-d tensor), ``nonzero`` and boolean
    indexing (a data-dependent shape), ``equal``; and, wrapped, ``Tensor.cpu`` / ``tolist``."""

    SCALAR = {torch.ops.aten._local_scalar_dense.default: "scalar", torch.ops.aten.nonzero.default: "nonzero",
              torch.ops.aten.masked_select.default: "nonzero", torch.ops.aten.equal.default: "scalar"}

    def __init__(self):
        super().__init__()
        self.reads = Counter()
        self._methods = {name: getattr(torch.Tensor, name) for name in ("cpu", "tolist")}

    def __enter__(self):
        for name, fn in self._methods.items():
            setattr(torch.Tensor, name, self._counting(name, fn))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._methods.items():  # the next count starts from torch's own methods
            setattr(torch.Tensor, name, fn)
        return super().__exit__(*exc)

    def _counting(self, name, fn):
        def wrapped(t, *args, **kwargs):
            self.reads[name] += 1
            return fn(t, *args, **kwargs)
        return wrapped

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SCALAR:
            self.reads[self.SCALAR[func]] += 1
        if func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.reads["nonzero"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """The loss's GPU path on the CPU: no device type whose values the host reads for free."""
    monkeypatch.setattr(aggregation, "HOST_READ_FREE_DEVICES", ())


def _update_bookkeeping(loss: str, micro: int, diagnostics: bool = False) -> Counter:
    """What the actor's update does per micro-batch besides the model (``ActorEngine._train_mini_batch``'s
    ``loss_fn``: the loss and its metrics, the clipping flag, the metric partials, the histogram),
    then the one read of the partials; the host reads it made (the GPU path: ``as_on_a_gpu``)."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    from common import multi_turn_batch

    cfg = PolicyLossConfig(name=loss, diagnostics=diagnostics)
    acc, clipping = {}, torch.zeros(micro)
    batches = [multi_turn_batch(4, 48, 3, seed=i) for i in range(micro)]
    # the engine's denominators: the mini-batch's, counted on the host before the pass
    dens = [loss_denominators(mask, adv, cfg) for _, _, adv, mask in batches]
    with _HostReads() as mode:
        for i, ((lp, old, adv, mask), den) in enumerate(zip(batches, dens)):
            lp = lp.clone().requires_grad_()
            value, metrics = compute_policy_loss(lp, old, adv, mask, cfg, normalize=False, denominator=den)
            if "clip_bias/sq_sum" in metrics:
                clipping[i] = (metrics["clip_bias/sq_sum"] > 0).float()
            accumulate_metrics(acc, metrics, weight=metrics["policy_tokens"])
            abs_log_ratio_histogram(lp, old, mask)
            value.backward()
        host = metrics_to_host(acc)
    assert host["policy_tokens"][0] > 0
    return mode.reads


@pytest.mark.parametrize("loss", ["ppo", "grpo", "sapo", "cispo"])
def test_a_token_level_update_reads_its_metrics_once_whatever_the_micro_batches(as_on_a_gpu, loss):
    for micro in (1, 4):
        assert _update_bookkeeping(loss, micro) == Counter(cpu=1, tolist=1), (loss, micro)


@pytest.mark.parametrize("loss,diagnostics", [("so_ppo", False), ("turn_ppo", False), ("gspo", False),
                                              ("ppo", True)])
def test_turn_and_sequence_losses_read_only_their_segment_counts(as_on_a_gpu, loss, diagnostics):
    """Turn / sequence segmentation (of the loss, or of ``loss.diagnostics``' turn-ratio spread)
    sizes its tensors by the number of segments: a shape the host must know (``nonzero``), once
    or twice per micro-batch. Nothing else is read per micro-batch."""
    one, four = (_update_bookkeeping(loss, m, diagnostics) for m in (1, 4))
    assert one["scalar"] == four["scalar"] == 0 and one["cpu"] == four["cpu"] == 1
    assert four["nonzero"] == 4 * one["nonzero"] <= 8


class _CausalBlocks(torch.nn.Module):
    """The TE-less packed attention with a plain causal ``_attend`` (no megatron config)."""

    forward = LocalDotProductAttention.forward

    def _attend(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None):
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask.logical_not())
        return out.permute(2, 0, 1, 3).flatten(2)


@pytest.mark.parametrize("layers", [1, 4])
@pytest.mark.parametrize("planned", [True, False])
def test_packed_attention_reads_its_segments_once_per_micro_batch(layers, planned):
    from megatron.core.packed_seq_params import PackedSeqParams

    from sorl_megatron.bridge.local_spec import PLAN_ATTR, build_attention_plan

    lengths = [5, 12, 1, 19, 0, 7]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(int(cu[-1]), 2, 8, generator=g) for _ in range(3))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=19, max_seqlen_kv=19)
    if planned:  # as MicroBatcher builds it, from the host's boundaries, before the pass
        setattr(params, PLAN_ATTR, build_attention_plan(cu, torch.device("cpu")))
    attention = _CausalBlocks()
    first_layer = Counter()
    if not planned:  # the first layer builds the plan from a host copy of the boundaries; the others reuse it
        with _HostReads() as one:
            attention(q, k, v, None, packed_seq_params=PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=19, max_seqlen_kv=19))
        first_layer = Counter(one.reads)
    with _HostReads() as mode:
        outs = [attention(q, k, v, None, packed_seq_params=params) for _ in range(layers)]
    assert mode.reads == first_layer and (planned or first_layer["cpu"] == 2), mode.reads
    a, b = cu[:-1].tolist(), cu[1:].tolist()
    causal = [attention._attend(q[i:j, None], k[i:j, None], v[i:j, None],
                                torch.triu(torch.ones(j - i, j - i, dtype=torch.bool), 1), None)[:, 0]
              for i, j in zip(a, b) if j > i]
    assert all(torch.allclose(out, torch.cat(causal), atol=1e-6) for out in outs)


@pytest.mark.parametrize("case", ["mixed", "all_negative", "all_positive", "full", "empty", "zero_extreme"])
def test_the_loss_extremes_are_the_same_on_either_path(case):
    """The CPU's branching extremes (one ``aminmax``, a masked pass when an extreme is an
    off-mask 0) and the GPU's branch-free ones give the same numbers (min / max are exact)."""
    g = torch.Generator().manual_seed(7)
    mask = torch.rand(6, 9, generator=g) < 0.6
    values = torch.randn(6, 9, generator=g)
    if case == "all_negative":
        values = -values.abs() - 0.1
    elif case == "all_positive":
        values = values.abs() + 0.1
    elif case == "full":
        mask[:] = True
    elif case == "empty":
        mask[:] = False
    elif case == "zero_extreme":  # a policy token's 0 is the max; the off-mask 0s may not decide it
        values = -values.abs()
        values[mask.nonzero()[0].tolist()] = 0.0
    values = torch.where(mask, values, torch.zeros(()))
    branching = loss_metrics._extremes_branching(values, mask)
    on_device = loss_metrics._extremes_on_device(values, mask)
    assert [t.item() for t in branching] == [t.item() for t in on_device]
    want = (values[mask].min().item(), values[mask].max().item()) if mask.any() else (0.0, 0.0)
    assert tuple(t.item() for t in on_device) == want
