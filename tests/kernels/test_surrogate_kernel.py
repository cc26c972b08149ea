"""Fused clipped surrogate (Triton, interpreted) vs the torch reference in policy_loss."""

from __future__ import annotations

import pytest
import torch

from sorl_kernels.surrogate import clipped_surrogate as triton_surrogate
from sorl_megatron.algorithms import PolicyLossConfig, compute_policy_loss, dispatch
from sorl_megatron.algorithms.reference import clipped_surrogate_torch

from .batches import ragged_mask

LO, HI = 0.8, 1.28


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = ragged_mask(seed=seed)
    ratio = torch.exp(0.5 * torch.randn(mask.shape, generator=g))
    # Ties on purpose: ratios exactly at the clip bounds / the dual bound, and zero advantages.
    mask[3, :5] = 1
    ratio[3, :5] = torch.tensor([LO, HI, 3.0, 1.0, 4.0])
    adv = torch.randn(mask.shape, generator=g)
    adv[3, :5] = torch.tensor([-1.0, 1.0, -1.0, 0.0, -2.0])
    return ratio, adv * mask, mask.bool()


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_values_indicators_and_grads_equal_torch(dual_clip):
    ratio, adv, mask = _inputs()
    r_t, r_k = ratio.clone().requires_grad_(), ratio.clone().requires_grad_()
    ref = clipped_surrogate_torch(r_t, adv, mask, LO, HI, dual_clip)
    out = triton_surrogate(r_k, adv, mask, LO, HI, dual_clip)
    torch.testing.assert_close(out[0], ref[0], atol=0, rtol=0)  # same fp32 ops: bitwise
    for got, want in zip(out[1:], ref[1:]):
        assert got.dtype == torch.bool and torch.equal(got, want)
    assert bool(ref[1].any()) and bool(ref[2].any())  # both clip sides occur in the data
    if dual_clip is not None:
        assert bool(ref[3].any())
    g = torch.randn(ratio.shape)
    (gt,) = torch.autograd.grad(ref[0], r_t, g)
    (gk,) = torch.autograd.grad(out[0], r_k, g)
    torch.testing.assert_close(gk, gt, atol=0, rtol=0)  # subgradients at the ties included


def test_empty_and_all_masked():
    for shape in [(0, 5), (3, 7)]:
        ratio = torch.rand(shape) + 0.5
        out = triton_surrogate(ratio, torch.zeros(shape), torch.zeros(shape, dtype=torch.bool), LO, HI, 2.0)
        ref = clipped_surrogate_torch(ratio, torch.zeros(shape), torch.zeros(shape, dtype=torch.bool), LO, HI, 2.0)
        for got, want in zip(out, ref):
            assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("name", ["so_ppo", "ppo", "sapo"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_whole_loss_with_both_kernels_forced(name, dual_clip, monkeypatch):
    import sorl_kernels.surrogate as module

    calls = []
    original = module.clipped_surrogate
    monkeypatch.setattr(module, "clipped_surrogate", lambda *a: calls.append(1) or original(*a))
    mask = ragged_mask(seed=5)
    lp = (-torch.rand(mask.shape) * 3).requires_grad_()
    old = lp.detach() + 0.4 * torch.randn(mask.shape)
    adv = torch.randn(mask.shape)
    cfg = PolicyLossConfig(name=name, eps_low=0.2, eps_high=0.28, dual_clip=dual_clip, loss_agg="token-mean")
    runs = {}
    for which in ("torch", "triton"):
        with dispatch.backend(which):
            loss, metrics = compute_policy_loss(lp, old, adv, mask, cfg)
            (grad,) = torch.autograd.grad(loss, lp)
        runs[which] = (loss.detach(), metrics, grad)
    assert len(calls) == 1  # the forced run used the fused kernel (once), the torch run did not
    (lt, mt, gt), (lk, mk, gk) = runs["torch"], runs["triton"]
    assert float(mt["clip_frac"]) > 0
    torch.testing.assert_close(lk, lt, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gk, gt, atol=1e-6, rtol=1e-6)
    for key in mt:
        torch.testing.assert_close(mk[key], mt[key], atol=1e-6, rtol=1e-6, msg=key)
