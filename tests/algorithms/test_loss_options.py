"""Hand-computed examples (SAPO, MiniRL correction, dual clip, KL, entropy), micro-batch
additivity, bad configuration and robustness on random masks and extreme ratios."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sorl_megatron.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ClipBiasConfig,
    ISCorrectionConfig,
    PolicyLossConfig,
    SAPOConfig,
    aggregation_denominator,
    compute_policy_loss,
)


def _batch(ratios, adv):
    old = torch.log(torch.full((1, len(ratios)), 0.5))
    lp = (old + torch.log(torch.tensor([ratios]))).requires_grad_()
    return lp, old, torch.tensor([adv]), torch.ones(1, len(ratios), dtype=torch.long)


def test_sapo_hand_example():
    lp, old, adv, mask = _batch([0.5, 2.0, 0.8, 1.0], [1.0, 1.0, -1.0, 1.0])
    loss, m = compute_policy_loss(
        lp, old, adv, mask, PolicyLossConfig(name="sapo", sapo=SAPOConfig(gamma=0.1, tau=1.0))
    )
    # clipped surrogate per token: -0.5 (r=0.5<0.8 but A>0: unclipped), -1.2, 0.8, -1.0
    pg = (-0.5 - 1.2 + 0.8 - 1.0) / 4
    # only token 0 has r < tau with A > 0: penalty -log(0.5), token-mean over 4 tokens
    penalty = -math.log(0.5) / 4
    assert loss.item() == pytest.approx(pg + 0.1 * penalty, abs=1e-6)
    assert m["sapo/penalty_frac"].item() == pytest.approx(0.25)
    (g,) = torch.autograd.grad(loss, lp)
    # token 0: d(-A r)/dlp = -0.5/4 from the surrogate, d(0.1 * -lp/4) = -0.025 from SAPO
    assert g[0, 0].item() == pytest.approx(-0.5 / 4 - 0.025, abs=1e-6)


def test_sapo_advantage_condition_zero_advantage():
    lp, old, adv, mask = _batch([0.5, 0.5], [0.0, 1.0])
    _, strict = compute_policy_loss(lp, old, adv, mask, PolicyLossConfig(name="sapo"))
    _, listing = compute_policy_loss(
        lp, old, adv, mask, PolicyLossConfig(name="sapo", sapo=SAPOConfig(adv_condition="nonnegative"))
    )
    assert strict["sapo/penalty_frac"].item() == pytest.approx(0.5)
    assert listing["sapo/penalty_frac"].item() == pytest.approx(1.0)


def test_dual_clip_bounds_negative_advantage_loss():
    lp, old, adv, mask = _batch([5.0, 1.0], [-1.0, -1.0])
    loss, m = compute_policy_loss(lp, old, adv, mask, PolicyLossConfig(name="ppo", dual_clip=3.0))
    assert loss.item() == pytest.approx((3.0 + 1.0) / 2, abs=1e-6)  # min(5, 3) for token 0
    assert m["dual_clip_frac"].item() == pytest.approx(0.5)
    (g,) = torch.autograd.grad(loss, lp)
    assert g[0, 0].item() == 0.0  # dual-clipped tokens carry no gradient


def test_asymmetric_clip():
    lp, old, adv, mask = _batch([1.25, 0.85], [1.0, -1.0])
    _, sym = compute_policy_loss(lp, old, adv, mask, PolicyLossConfig(name="ppo", eps_low=0.2))
    _, asym = compute_policy_loss(lp, old, adv, mask, PolicyLossConfig(name="ppo", eps_low=0.1, eps_high=0.28))
    assert sym["clip_frac_high"].item() == 0.5 and sym["clip_frac_low"].item() == 0.0
    assert asym["clip_frac_high"].item() == 0.0 and asym["clip_frac_low"].item() == 0.5


@pytest.mark.parametrize(
    "mode,level,geometric,expected",
    [
        ("tis", "token", False, [2.0, 0.25, 1.5, 1.0]),
        ("mis", "token", False, [0.0, 0.0, 1.5, 1.0]),
        ("tis", "sequence", False, [1.125] * 4),  # product 3 * 0.25 * 1 * 1.5
        ("tis", "turn", False, [0.75, 0.75, 1.5, 1.5]),  # turns {0,1} and {2,3}: 0.75, 1.5
        (
            "mis",
            "turn",
            True,
            [0.0, 0.0, 1.2247449, 1.2247449],
        ),  # geometric: sqrt(0.75) < low is masked, sqrt(1.5) kept
    ],
)
def test_minirl_is_correction_hand_example(mode, level, geometric, expected):
    old = torch.log(torch.tensor([[0.3, 0.1, 0.2, 0.6, 0.5]]))
    mu = old - torch.log(torch.tensor([[3.0, 0.25, 1.0, 1.5, 1.0]]))  # pi_old / mu per token
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    mask_tokens = [0, 1, 3, 4]
    cfg = ISCorrectionConfig(mode=mode, level=level, geometric=geometric, cap=2.0, low=0.9, high=2.0)
    lp = old.clone().requires_grad_()
    adv = torch.ones(1, 5)
    loss, m = compute_policy_loss(
        lp, old, adv, mask, PolicyLossConfig(name="ppo", is_correction=cfg), rollout_logprobs=mu
    )
    # at lp == old the surrogate is -A * 1 per token, so the loss is -mean(weights)
    w = torch.tensor(expected)
    assert loss.item() == pytest.approx(-w.mean().item(), abs=1e-5)
    gaps = torch.log(torch.tensor([3.0, 0.25, 1.5, 1.0])).abs()
    assert m["is/mismatch_abs_mean"].item() == pytest.approx(gaps.mean().item(), abs=1e-6)
    assert m["is/mismatch_abs_max"].item() == pytest.approx(math.log(4.0), abs=1e-6)
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(g[0, mask_tokens], -w / 4, atol=1e-6)  # weights are detached multipliers


def test_kl_and_entropy_terms():
    lp, old, adv, mask = _batch([1.0, 1.0], [0.0, 0.0])
    ref = lp.detach() - torch.tensor([[0.5, -0.5]])
    ent = torch.tensor([[1.0, 3.0]])
    for est, per_token in {
        "k1": [0.5, -0.5],
        "k2": [0.125, 0.125],
        "k3": [math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1],
    }.items():
        cfg = PolicyLossConfig(name="grpo", kl_coef=0.2, kl_estimator=est, entropy_coef=0.01)
        loss, m = compute_policy_loss(lp, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent)
        assert m["kl_ref"].item() == pytest.approx(sum(per_token) / 2, abs=1e-6)
        assert loss.item() == pytest.approx(0.2 * sum(per_token) / 2 - 0.01 * 2.0, abs=1e-6)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["so_ppo", "gspo", "sapo"])
def test_micro_batches_with_global_denominator_add_up(agg, name):
    g = torch.Generator().manual_seed(2)
    B, T = 6, 10
    mask = (torch.rand(B, T, generator=g) < 0.7).long()
    mask[3] = 0
    old = -torch.rand(B, T, generator=g) * 2
    lp = (old + 0.4 * torch.randn(B, T, generator=g)).requires_grad_()
    adv = torch.randn(B, T, generator=g) * 5
    cfg = PolicyLossConfig(name=name, loss_agg=agg, clip_bias=ClipBiasConfig(delta=1e-4), diagnostics=True)
    full, m_full = compute_policy_loss(lp, old, adv, mask, cfg, normalize=False)
    (g_full,) = torch.autograd.grad(full, lp)
    denom = aggregation_denominator(mask, agg)
    parts, scalar, sq = [], 0.0, 0.0
    for sl in (slice(0, 2), slice(2, 5), slice(5, 6)):
        loss, m = compute_policy_loss(lp[sl], old[sl], adv[sl], mask[sl], cfg, denominator=denom, normalize=False)
        parts.append(loss)
        scalar, sq = scalar + m["clip_bias/scalar"], sq + m["clip_bias/sq_sum"]
    total = sum(parts)
    (g_parts,) = torch.autograd.grad(total, lp)
    assert torch.allclose(total, full, atol=1e-6)
    assert torch.allclose(g_parts, g_full, atol=1e-7)
    assert torch.allclose(scalar, m_full["clip_bias/scalar"], atol=1e-6)
    assert torch.allclose(sq, m_full["clip_bias/sq_sum"], rtol=1e-5, atol=1e-9)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="loss.name"):
        PolicyLossConfig(name="ppo2")
    with pytest.raises(ValueError, match="loss.eps_low"):
        PolicyLossConfig(eps_low=0.0)
    with pytest.raises(ValueError, match="loss.eps_high"):
        PolicyLossConfig(eps_high=-0.1)
    with pytest.raises(ValueError, match="loss.dual_clip"):
        PolicyLossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="loss.loss_agg"):
        PolicyLossConfig(loss_agg="mean")
    with pytest.raises(ValueError, match="clip_bias.delta"):
        ClipBiasConfig(delta=0.0)
    with pytest.raises(ValueError, match="loss.clip_bias.delta"):
        PolicyLossConfig.from_dict({"name": "so_ppo", "clip_bias": {"delta": -1}})
    with pytest.raises(ValueError, match=r"loss.eps_hgh \(did you mean loss.eps_high\?\)"):
        PolicyLossConfig.from_dict({"eps_hgh": 0.3})
    with pytest.raises(ValueError, match="is_correction.low"):
        ISCorrectionConfig(mode="mis", low=2.0, high=1.0)
    cfg = PolicyLossConfig.from_dict({"name": "so_ppo", "clip_bias": {"mode": "scalar"}, "eps_high": 0.28})
    assert cfg.clip_bias.mode == "scalar" and cfg.clip_high == pytest.approx(1.28)


def test_bad_inputs_raise_clear_errors():
    lp, old, adv, mask = _batch([1.0, 1.0], [1.0, 1.0])
    cfg = PolicyLossConfig()
    with pytest.raises(ValueError, match="old_logprobs shape"):
        compute_policy_loss(lp, old[:, :1], adv, mask, cfg)
    with pytest.raises(ValueError, match="advantages shape"):
        compute_policy_loss(lp, old, adv[:, :1], mask, cfg)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        compute_policy_loss(lp, old, adv, mask, PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        compute_policy_loss(lp, old, adv, mask, PolicyLossConfig(is_correction=ISCorrectionConfig(mode="tis")))
    # per-sequence advantages broadcast
    loss, _ = compute_policy_loss(lp, old, torch.tensor([2.0]), mask, cfg)
    assert loss.item() == pytest.approx(-2.0)


_rows = st.lists(st.lists(st.integers(0, 1), min_size=6, max_size=6), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(
    rows=_rows,
    name=st.sampled_from(sorted(POLICY_LOSSES)),
    agg=st.sampled_from(LOSS_AGG_MODES),
    extreme=st.floats(-50, 50),
    seed=st.integers(0, 10_000),
)
def test_every_loss_is_finite_on_random_masks_and_extreme_ratios(rows, name, agg, extreme, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor(rows)
    B, T = mask.shape
    old = -torch.rand(B, T, generator=g) * 3
    old[mask == 0] = float("-inf")  # garbage off the mask must not leak
    delta = torch.randn(B, T, generator=g)
    delta[:, 0] = extreme  # log-ratios up to +-50
    lp = (old.nan_to_num(neginf=-1.0) + delta).requires_grad_()
    mu = old.nan_to_num(neginf=-2.0) + 0.1 * torch.randn(B, T, generator=g)
    cfg = PolicyLossConfig(
        name=name,
        loss_agg=agg,
        dual_clip=3.0,
        kl_coef=0.01,
        entropy_coef=0.01,
        clip_bias=ClipBiasConfig(mode="logprob"),
        is_correction=ISCorrectionConfig(mode="tis", level="turn"),
    )
    loss, metrics = compute_policy_loss(
        lp, old, torch.randn(B, T, generator=g) * 3, mask, cfg,
        rollout_logprobs=mu, ref_logprobs=lp.detach() + 40.0, entropy=torch.rand(B, T, generator=g),
    )
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss)
    assert torch.isfinite(grad).all()
    assert (grad[mask == 0] == 0).all()
    for key, value in metrics.items():
        assert torch.isfinite(value).all(), key
    if mask.sum() == 0:
        assert loss.item() == 0.0
