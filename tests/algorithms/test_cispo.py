"""CISPO against its paper (MiniMax-M1, arXiv 2506.13585, eq. 4-5), by autograd: the loss is
``-1/N sum_t sg(clip(r_t)) A_t log pi_t``, so its gradient with respect to the log-probs is
``-clip(r_t) A_t / N`` on every policy token, those whose ratio left the range included
(where PPO's clip gives them none)."""

import math

import pytest
import torch

from sorl_megatron.algorithms import (
    POLICY_LOSSES,
    ISCorrectionConfig,
    PolicyLossConfig,
    clip_bias_surrogate,
    compute_policy_loss,
    token_weights,
)

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _batch():
    """Ratios inside, above and below ``[0.8, 1.28]`` for both signs of ``A``; padding at -inf."""
    ratios = [[0.5, 1.0, 2.0, 1.1, 0.9, 3.0], [0.7, 1.5, 1.2, 0.6, 1.0, 1.0]]
    adv = [[1.0, -0.5, 1.5, 2.0, -1.0, -2.0], [-1.5, -1.0, 0.5, 1.0, 0.3, 0.3]]
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    old = torch.log(torch.tensor([[0.5, 0.4, 0.2, 0.3, 0.6, 0.1], [0.3, 0.5, 0.4, 0.6, 0.5, 0.5]]))
    lp = old + torch.log(torch.tensor(ratios))
    lp[1, 4:] = float("-inf")  # padding log-probs never reach the loss or its gradient
    return lp.requires_grad_(), old, torch.tensor(adv), mask


def _loss_grad(name, lp, old, adv, mask, **cfg):
    x = lp.detach().clone().requires_grad_()
    config = PolicyLossConfig(name=name, eps_low=EPS_LOW, eps_high=EPS_HIGH, **cfg)
    loss, metrics = compute_policy_loss(x, old, adv, mask, config)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, metrics


def test_cispo_is_registered_as_a_token_level_group_relative_loss():
    spec = PolicyLossConfig(name="cispo").spec
    assert spec is POLICY_LOSSES["cispo"] and spec.ratio_level == "token"
    assert not (spec.critic or spec.clip_normalized or spec.token_gradient or spec.sapo_penalty)
    assert "2506.13585" in spec.reference


def test_gradient_is_the_detached_clipped_weight_times_the_advantage_on_every_token():
    lp, old, adv, mask = _batch()
    loss, grad, m = _loss_grad("cispo", lp, old, adv, mask)
    sel = mask.bool()
    n = sel.sum()
    r = torch.exp(lp.detach() - old)
    weight = torch.where(sel, r.clamp(1 - EPS_LOW, 1 + EPS_HIGH), torch.zeros(()))
    expected = -weight * adv / n
    assert torch.allclose(grad, expected, atol=1e-7, rtol=1e-6)
    assert torch.all(grad[~sel] == 0)
    # the value is the formula's: -1/N sum_t sg(clip(r_t)) A_t log pi_t
    value = -(weight * adv * torch.where(sel, lp.detach(), torch.zeros(()))).sum() / n
    assert loss.item() == pytest.approx(value.item(), rel=1e-5)
    assert m["pg_loss"].item() == pytest.approx(value.item(), rel=1e-5)
    # clip metrics: the tokens whose weight the clip changed, whatever the sign of A
    outside_high, outside_low = (r > 1 + EPS_HIGH) & sel, (r < 1 - EPS_LOW) & sel
    assert m["clip_frac_high"].item() == pytest.approx(outside_high.sum().item() / n.item())
    assert m["clip_frac_low"].item() == pytest.approx(outside_low.sum().item() / n.item())
    assert m["dual_clip_frac"].item() == 0.0


def test_tokens_beyond_the_clip_keep_their_gradient_where_ppo_drops_it():
    lp, old, adv, mask = _batch()
    _, g_cispo, _ = _loss_grad("cispo", lp, old, adv, mask)
    _, g_grpo, _ = _loss_grad("grpo", lp, old, adv, mask)
    r = torch.exp(lp.detach() - old)
    # PPO's B^c: A > 0 with r > 1 + eps_high, A < 0 with r < 1 - eps_low
    dropped = (((adv > 0) & (r > 1 + EPS_HIGH)) | ((adv < 0) & (r < 1 - EPS_LOW))) & mask.bool()
    assert dropped.sum() == 2
    assert torch.all(g_grpo[dropped] == 0)
    assert torch.all(g_cispo[dropped] != 0)
    n = mask.sum()
    assert g_cispo[0, 2].item() == pytest.approx(-(1 + EPS_HIGH) * 1.5 / n.item(), rel=1e-6)  # r = 2, A > 0
    assert g_cispo[1, 0].item() == pytest.approx((1 - EPS_LOW) * 1.5 / n.item(), rel=1e-6)  # r = 0.7, A < 0


def test_the_weight_is_detached():
    """Were the weight not detached, unclipped tokens would get ``(1 + log pi_t)`` times it."""
    lp, old, adv, mask = _batch()
    _, grad, _ = _loss_grad("cispo", lp, old, adv, mask)
    r = torch.exp(lp.detach() - old)
    inside = (r >= 1 - EPS_LOW) & (r <= 1 + EPS_HIGH) & mask.bool()
    assert torch.allclose(grad[inside], -(r * adv)[inside] / mask.sum(), rtol=1e-6)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_other_aggregations_and_the_is_correction_scale_each_token(agg):
    lp, old, adv, mask = _batch()
    mu = old - 0.3 * torch.arange(6.0)  # rollout-engine log-probs: TIS weights exp(0.3 k) capped at 2
    x = lp.detach().clone().requires_grad_()
    cfg = PolicyLossConfig(name="cispo", eps_low=EPS_LOW, eps_high=EPS_HIGH, loss_agg=agg,
                           is_correction=ISCorrectionConfig(mode="tis", cap=2.0))
    loss, _ = compute_policy_loss(x, old, adv, mask, cfg, rollout_logprobs=mu)
    (grad,) = torch.autograd.grad(loss, x)
    sel = mask.bool()
    r = torch.exp(lp.detach() - old)
    is_w = torch.exp(old - mu).clamp(max=2.0)
    expected = -token_weights(mask, agg) * is_w * r.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * adv
    assert torch.allclose(grad, torch.where(sel, expected, torch.zeros(())), atol=1e-7, rtol=1e-6)


def test_clip_bias_is_what_the_clip_removed_from_the_importance_weighted_gradient():
    """``grad loss = -(PG - C)`` with ``PG`` the unclipped importance-weighted gradient and
    ``C`` the clip-bias surrogate's gradient, as for PPO (SORL Lemma 4.2)."""
    lp, old, adv, mask = _batch()
    _, grad, m = _loss_grad("cispo", lp, old, adv, mask, diagnostics=True)
    sel = mask.bool()
    r = torch.exp(lp.detach() - old)
    pg = torch.where(sel, r * adv, torch.zeros(())) / mask.sum()
    x = lp.detach().clone().requires_grad_()
    cfg = PolicyLossConfig(name="cispo", eps_low=EPS_LOW, eps_high=EPS_HIGH)
    (c,) = torch.autograd.grad(clip_bias_surrogate(x, old, adv, mask, cfg), x)
    assert c.abs().sum() > 0
    assert torch.allclose(grad, -(pg - c), atol=1e-7)
    assert m["clip_bias/sq_sum"].item() == pytest.approx((c * c).sum().item(), rel=1e-5)


def test_no_lower_bound_reading_keeps_small_weights():
    """The paper's no lower bound: ``eps_low`` near 1 leaves ratios down to ``1 - eps_low`` as they are."""
    lp, old, adv, mask = _batch()
    x = lp.detach().clone().requires_grad_()
    cfg = PolicyLossConfig(name="cispo", eps_low=0.999, eps_high=EPS_HIGH)
    loss, m = compute_policy_loss(x, old, adv, mask, cfg)
    (grad,) = torch.autograd.grad(loss, x)
    r = torch.exp(lp.detach() - old)
    expected = torch.where(mask.bool(), -r.clamp(max=1 + EPS_HIGH) * adv, torch.zeros(())) / mask.sum()
    assert torch.allclose(grad, expected, atol=1e-7, rtol=1e-6)
    assert m["clip_frac_low"].item() == 0.0 and math.isfinite(loss.item())


@pytest.mark.parametrize("extreme", [-50.0, 50.0])
def test_finite_with_extreme_ratios_padding_and_every_option(extreme):
    g = torch.Generator().manual_seed(5)
    mask = (torch.rand(4, 9, generator=g) < 0.7).long()
    mask[1] = 0
    old = -torch.rand(4, 9, generator=g) * 3
    lp = old + torch.randn(4, 9, generator=g)
    lp[:, 0] = old[:, 0] + extreme
    old = old.masked_fill(mask == 0, float("-inf"))
    lp = lp.masked_fill(mask == 0, float("-inf")).requires_grad_()
    finite_old = old.nan_to_num(neginf=-1.0)
    cfg = PolicyLossConfig(name="cispo", loss_agg="seq-mean-token-mean", dual_clip=3.0, kl_coef=0.01,
                           entropy_coef=0.01, diagnostics=True,
                           is_correction=ISCorrectionConfig(mode="tis", level="turn"))
    loss, metrics = compute_policy_loss(lp, old, torch.randn(4, 9, generator=g), mask, cfg,
                                        rollout_logprobs=finite_old - 0.1, ref_logprobs=finite_old,
                                        entropy=torch.rand(4, 9, generator=g))
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()
    assert all(torch.isfinite(v).all() for v in metrics.values())
