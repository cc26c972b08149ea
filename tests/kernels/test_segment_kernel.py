"""Triton segmented mean + broadcast vs the torch path (CPU, TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from sorl_kernels.segment import segment_mean_broadcast as triton_smb
from sorl_megatron.algorithms import PolicyLossConfig, compute_policy_loss, dispatch
from sorl_megatron.algorithms.reference import segment_mean_broadcast_torch
from sorl_megatron.algorithms.turns import segment_turns

from .batches import explicit_turn_ids, ragged_mask

TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}


def _segments(kind: str):
    mask = ragged_mask()
    if kind == "runs":
        return segment_turns(mask)
    if kind == "turn_ids":
        return segment_turns(mask, explicit_turn_ids(mask))
    return segment_turns(torch.zeros_like(mask))  # all-masked batch: no segment at all


@pytest.mark.parametrize("kind", ["runs", "turn_ids", "empty"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_forward_backward_match_torch(kind, dtype):
    seg = _segments(kind)
    x = (torch.randn(seg.mask.shape) * 2).to(dtype)
    x = torch.where(seg.mask, x, torch.full_like(x, float("nan")))  # padding garbage must not leak
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    ya, yb = (
        triton_smb(a, seg.segment_index, seg.segment_length),
        segment_mean_broadcast_torch(b, seg.segment_index, seg.segment_length),
    )
    assert ya.dtype == dtype and ya.shape == x.shape
    # The torch path returns 0 off the mask; so must the kernel (NaN inputs there included).
    assert torch.equal(ya[~seg.mask], torch.zeros_like(ya[~seg.mask]))
    torch.testing.assert_close(ya, yb, atol=TOL[dtype], rtol=TOL[dtype])
    g = torch.randn(x.shape).to(dtype)
    (ga,) = torch.autograd.grad(ya, a, g)
    (gb,) = torch.autograd.grad(yb, b, g)
    torch.testing.assert_close(ga, gb, atol=TOL[dtype], rtol=TOL[dtype])
    if kind != "empty":
        # Every token of a turn sees the turn mean: a real check that the segments were used.
        k = seg.segment_index[seg.mask]
        first = torch.zeros(seg.num_segments + 1, dtype=ya.dtype).index_put_((k,), ya[seg.mask].detach())
        torch.testing.assert_close(ya[seg.mask].detach(), first[k])


def test_gradcheck_double():
    mask = ragged_mask(batch=4, seq=9)  # small: gradcheck launches the kernel twice per input
    seg = segment_turns(mask, explicit_turn_ids(mask))
    x = torch.randn(seg.mask.shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: triton_smb(v, seg.segment_index, seg.segment_length), (x,))


@pytest.mark.parametrize("name", ["so_ppo", "turn_ppo", "gspo"])
def test_policy_loss_through_triton_equals_torch(name, monkeypatch):
    """The whole loss with the dispatch forced to Triton (interpreted) equals the torch run."""
    import sorl_kernels.segment as seg_module

    calls = []
    original = seg_module.segment_mean_broadcast
    monkeypatch.setattr(seg_module, "segment_mean_broadcast", lambda *a: calls.append(1) or original(*a))
    mask = ragged_mask(seed=3)
    lp = (-torch.rand(mask.shape) * 3).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(mask.shape)
    adv = torch.randn(mask.shape)
    cfg = PolicyLossConfig(name=name, eps_low=0.1, eps_high=0.2, dual_clip=3.0, loss_agg="seq-mean-token-mean")
    results = {}
    for which in ("torch", "triton"):
        with dispatch.backend(which):
            loss, metrics = compute_policy_loss(lp, old, adv, mask, cfg)
            (grad,) = torch.autograd.grad(loss, lp)
        results[which] = (loss.detach(), metrics, grad)
    assert calls, "the forced Triton run never reached the kernel"
    (lt, mt, gt), (lk, mk, gk) = results["torch"], results["triton"]
    assert gt.abs().sum() > 0  # the comparison is not vacuous
    torch.testing.assert_close(lk, lt, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gk, gt, atol=1e-6, rtol=1e-6)
    assert mt.keys() == mk.keys()
    for key in mt:
        torch.testing.assert_close(mk[key], mt[key], atol=1e-6, rtol=1e-6, msg=key)
