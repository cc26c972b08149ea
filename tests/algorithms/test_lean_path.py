"""The lean loss path (``diagnostics: false``, the default) computes the same loss and gradient
as the full path and a subset of its metrics, with the same values."""

import dataclasses

import pytest
import torch

from sorl_megatron.algorithms import POLICY_LOSSES, ISCorrectionConfig, PolicyLossConfig, compute_policy_loss
from sorl_megatron.algorithms.aggregation import LOSS_AGG_MODES

from .conftest import random_batch

OPTIONS = {
    "plain": {},
    "dual_kl_entropy": {"dual_clip": 3.0, "kl_coef": 0.1, "entropy_coef": 0.01},
    "tis_turn": {"is_correction": ISCorrectionConfig(mode="tis", level="turn")},
    "mis_token": {"is_correction": ISCorrectionConfig(mode="mis", level="token", low=0.8, high=1.2)},
    "token_ratio_indicator": {"clip_bias": {"indicator": "token_ratio"}},
}


def _batch():
    lp, old, adv, mask = random_batch(batch=6, seq=16, scale=0.5, seed=11)
    old = old + torch.tensor([0.5, 0.0, -0.6, 0.4, -0.3, 1.5]).unsqueeze(1)  # units leave the clip range too
    g = torch.Generator().manual_seed(3)
    extra = {"rollout_logprobs": old + 0.1 * torch.randn(old.shape, generator=g),
             "ref_logprobs": old - 0.05, "entropy": torch.rand(old.shape, generator=g)}
    return lp, old, adv, mask, extra


def _run(cfg, lp, old, adv, mask, **kw):
    x = lp.detach().clone().requires_grad_()
    loss, metrics = compute_policy_loss(x, old, adv, mask, cfg, **kw)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_lean_path_equals_full_path(name, option):
    lp, old, adv, mask, extra = _batch()
    kw = dict(OPTIONS[option])
    if isinstance(kw.get("clip_bias"), dict):
        kw["clip_bias"] = dataclasses.replace(PolicyLossConfig().clip_bias, **kw["clip_bias"])
    lean_cfg = PolicyLossConfig(name=name, loss_agg="seq-mean-token-mean", **kw)
    full_cfg = dataclasses.replace(lean_cfg, diagnostics=True)
    lean = _run(lean_cfg, lp, old, adv, mask, **extra)
    full = _run(full_cfg, lp, old, adv, mask, **extra)
    assert torch.equal(lean[0], full[0]) and torch.equal(lean[1], full[1])  # bit-identical loss and gradient
    assert full[2]["clip_frac"] > 0
    assert set(lean[2]) <= set(full[2])
    for key, value in lean[2].items():
        assert torch.equal(value, full[2][key]), key
    # what the full path adds: the turn-ratio spread of every loss (||C||'s statistics, a leading
    # indicator, are always there)
    spec = POLICY_LOSSES[name]
    assert "clip_bias/sq_sum" in lean[2]
    has_turns = spec.ratio_level == "turn" or option == "tis_turn"  # the spread comes with the turn segments
    assert ("turn_ratio/spread" in lean[2]) == has_turns
    assert {"clip_bias/sq_sum", "turn_ratio/spread"} <= set(full[2])


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_lean_metrics_equal_their_masked_definitions(agg):
    lp, old, adv, mask, _ = _batch()
    lp = lp.detach()
    lp[2, 3] = float("-inf")  # padding log-probs off the mask never reach a metric
    mask[2, 3] = 0
    _, m = compute_policy_loss(lp.requires_grad_(), old, adv, mask, PolicyLossConfig(name="ppo", loss_agg=agg))
    sel = mask.bool()
    lr = (lp.detach() - old)[sel]
    r = lr.exp()
    a = adv[sel]
    high, low = ((a > 0) & (r > 1.2)), ((a < 0) & (r < 0.8))
    expected = {"approx_kl_k1": -lr.mean(), "approx_kl_k3": (r - 1 - lr).mean(), "ratio/mean": r.mean(),
                "ratio/min": r.min(), "ratio/max": r.max(), "abs_log_ratio/max": lr.abs().max(),
                "clip_frac": (high | low).float().mean(), "clip_frac_high": high.float().mean(),
                "clip_frac_low": low.float().mean(), "policy_tokens": sel.sum().float()}
    for key, value in expected.items():
        assert m[key].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-7), key
    assert "is/mismatch_abs_mean" not in m  # no rollout log-probs: no mismatch to report


def test_extremes_when_all_policy_log_ratios_share_a_sign():
    # every policy token has r < 1: the whole-tensor max is an off-mask 0, so the masked pass decides
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 0]])
    old = torch.zeros(2, 4)
    lp = torch.tensor([[-0.5, -0.2, 0.0, 0.0], [0.0, -0.1, 0.0, 0.0]], requires_grad=True)
    _, m = compute_policy_loss(lp, old, torch.ones(2, 4), mask, PolicyLossConfig(name="gspo"))
    assert m["ratio/max"].item() == pytest.approx(float(torch.exp(torch.tensor(-0.1))))
    assert m["ratio/min"].item() == pytest.approx(float(torch.exp(torch.tensor(-0.5))))
    assert m["seq_ratio/max"].item() == pytest.approx(float(torch.exp(torch.tensor(-0.1))))
    _, m = compute_policy_loss(lp, old, torch.ones(2, 4), torch.zeros(2, 4, dtype=torch.long), PolicyLossConfig())
    assert m["ratio/max"].item() == 0.0 and m["policy_tokens"].item() == 0.0 and m["loss"].item() == 0.0


def test_mismatch_metrics_with_rollout_logprobs_and_correction_off():
    lp, old, adv, mask, extra = _batch()
    _, m = compute_policy_loss(lp, old, adv, mask, PolicyLossConfig(), rollout_logprobs=extra["rollout_logprobs"])
    sel = mask.bool()
    gap = (old - extra["rollout_logprobs"])[sel]
    assert m["is/mismatch_abs_mean"].item() == pytest.approx(gap.abs().mean().item(), rel=1e-6)
    assert m["is/mismatch_abs_max"].item() == pytest.approx(gap.abs().max().item(), rel=1e-6)
    assert "is/mismatch_kl_k3" not in m  # the trainer's mismatch/kl_k3 owns it (tests/algorithms/test_mismatch.py)
    assert m["is/weight_mean"].item() == 1.0
