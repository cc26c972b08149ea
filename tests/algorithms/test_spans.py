"""Segment reductions over spans (``spans.py``) against the per-token index path they replace on
the CPU: the same sums, broadcasts, turn means and gradients, for runs of the mask, explicit
ids that never decrease along a row (spans holding tool observations) and whole rows."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sorl_megatron.algorithms import PolicyLossConfig, compute_policy_loss
from sorl_megatron.algorithms.mismatch import clip_counts
from sorl_megatron.algorithms.turns import (
    broadcast_segments,
    row_segments,
    segment_mean_broadcast,
    segment_sum,
    segment_turns,
)


def _index_path(seg):
    """The same segments without spans: the reductions take index_add / gather."""
    return dataclasses.replace(seg, spans=None, index=seg.segment_index)


def _cases(rows, ids):
    mask = torch.tensor(rows)
    yield segment_turns(mask)
    yield row_segments(mask)
    if ids:  # ids that never decrease along a row, shared across gaps: spans with gaps inside
        turn_ids = torch.cumsum(torch.tensor(rows) * (torch.rand(mask.shape) < 0.3), dim=1)
        yield segment_turns(mask, turn_ids)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1), min_size=9, max_size=9), min_size=1, max_size=5), st.booleans())
def test_span_reductions_equal_the_index_path(rows, ids):
    for seg in _cases(rows, ids):
        assert seg.spans is not None
        ref = _index_path(seg)
        vals = torch.randn(seg.mask.shape, dtype=torch.float64)
        torch.testing.assert_close(segment_sum(vals, seg), segment_sum(vals, ref))
        per = torch.randn(seg.num_segments, dtype=torch.float64)
        assert torch.equal(broadcast_segments(per, seg, fill=1.0), broadcast_segments(per, ref, fill=1.0))
        # the index built from the spans: policy tokens in row-major order run through the
        # segments in order, each as many times as it has tokens; every other token the dummy
        index = seg.segment_index
        want = torch.repeat_interleave(torch.arange(seg.num_segments), seg.segment_length.long())
        assert torch.equal(index[seg.mask], want) and bool((index[~seg.mask] == seg.num_segments).all())

        a = vals.clone().requires_grad_()
        b = vals.clone().requires_grad_()
        out_a, out_b = segment_mean_broadcast(a, seg), segment_mean_broadcast(b, ref)
        torch.testing.assert_close(out_a, out_b)
        weights = torch.randn(seg.mask.shape, dtype=torch.float64)
        (out_a * weights).sum().backward()
        (out_b * weights).sum().backward()
        torch.testing.assert_close(a.grad, b.grad)


def test_span_ops_pass_gradcheck():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 1, 0, 1]])
    seg = segment_turns(mask)
    x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: segment_mean_broadcast(v, seg), (x,))
    p = torch.randn(seg.num_segments, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: broadcast_segments(v, seg, fill=1.0), (p,))


def test_values_off_the_mask_never_reach_a_sum():
    """Padding may hold -inf or NaN (log-probs past a row's end): a gap is a piece of its own."""
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 0, 0, 1, 1, 1]])
    vals = torch.tensor([[float("nan"), 1.0, 2.0, float("-inf"), 4.0, float("inf")],
                         [5.0, float("nan"), 0.0, 1.0, 1.0, 1.0]])
    for seg in (segment_turns(mask), row_segments(mask), segment_turns(mask, torch.tensor([[0, 0, 0, 0, 0, 0],
                                                                                             [0, 0, 0, 1, 1, 1]]))):
        sums = segment_sum(vals, seg)
        assert torch.isfinite(sums).all(), sums
        assert float(sums.sum()) == 15.0


def test_a_token_level_loss_counts_its_own_clipped_tokens():
    """``clip_frac/token`` of ``ppo`` comes from its surrogate's indicators: the same count as
    comparing each token's log-ratio with the band (``clip_counts``)."""
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(16, 64, generator=g) * 3
    old = lp + 0.3 * torch.randn(16, 64, generator=g)
    adv = torch.randn(16, 1, generator=g).expand(16, 64).contiguous()
    mask = torch.rand(16, 64, generator=g) < 0.7
    cfg = PolicyLossConfig(name="ppo", eps_low=0.2, eps_high=0.28)
    _, metrics = compute_policy_loss(lp.clone().requires_grad_(), old, adv, mask, cfg)
    counts = clip_counts(lp - old, adv, mask, cfg.clip_low, cfg.clip_high)
    assert counts["tokens_clipped"] > 0
    assert float(metrics["clip_frac/token"]) == float((counts["tokens_clipped"] / counts["tokens"]).float())
