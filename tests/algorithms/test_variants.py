"""Paper- and framework-faithful variants: verl's ``seq-mean-token-sum-norm``, GSPO-token,
SAPO's code-listing penalty. Each against a hand computation of its source's formula."""

import math

import pytest
import torch

from sorl_megatron.algorithms import (
    PolicyLossConfig,
    SAPOConfig,
    aggregation_denominator,
    compute_policy_loss,
    loss_denominators,
    token_weights,
)
from sorl_megatron.algorithms.aggregation import aggregate


def verl_agg_loss_sum_norm(loss_mat, loss_mask, loss_scale_factor=None):
    """verl/trainer/ppo/core_algos.py ``agg_loss(..., "seq-mean-token-sum-norm")``, transcribed."""
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    if loss_scale_factor is None:
        loss_scale_factor = loss_mask.shape[-1]
    return torch.sum(seq_losses) / loss_scale_factor


@pytest.mark.parametrize("norm_length", [None, 7])
def test_seq_mean_token_sum_norm_is_verls_agg_loss(norm_length):
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(5, 9, generator=g) < 0.6).float()
    mask[2] = 0  # an empty row changes nothing in verl's formula
    loss_mat = torch.randn(5, 9, generator=g)
    w = token_weights(mask, "seq-mean-token-sum-norm", norm_length=norm_length)
    expected = verl_agg_loss_sum_norm(loss_mat, mask, norm_length)
    assert aggregate(loss_mat, w).item() == pytest.approx(expected.item(), rel=1e-6)
    # no mean over sequences: doubling the batch doubles the loss (it would not with 1 / N_seqs)
    w2 = token_weights(torch.cat([mask, mask]), "seq-mean-token-sum-norm", norm_length=norm_length)
    assert aggregate(torch.cat([loss_mat, loss_mat]), w2).item() == pytest.approx(2 * expected.item(), rel=1e-6)


def test_seq_mean_token_sum_norm_policy_loss_and_micro_batches():
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(4, 6, generator=g) < 0.7).long()
    old = -torch.rand(4, 6, generator=g) * 2
    lp = old.clone().requires_grad_()  # on-policy: the surrogate is -A per token
    adv = torch.randn(4, 6, generator=g)
    cfg = PolicyLossConfig(name="grpo", loss_agg="seq-mean-token-sum-norm", norm_length=10)
    loss, _ = compute_policy_loss(lp, old, adv, mask, cfg)
    assert loss.item() == pytest.approx(verl_agg_loss_sum_norm(-adv, mask.float(), 10).item(), rel=1e-6)
    denom = aggregation_denominator(mask, cfg.loss_agg)
    halves = sum(compute_policy_loss(lp[s], old[s], adv[s], mask[s], cfg, denominator=denom)[0]
                 for s in (slice(0, 1), slice(1, 4)))
    assert halves.item() == pytest.approx(loss.item(), rel=1e-6)
    assert math.isfinite(loss.item())


# ---------------------------------------------------------------- GSPO-token


def _gspo_batch(per_token: bool, seed=3):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 8
    mask = (torch.rand(B, T, generator=g) < 0.75).long()
    mask[:, 0] = 1
    old = -torch.rand(B, T, generator=g) * 2
    # sequence log-ratios around +-1e-3: beyond GSPO's 3e-4 / 4e-4 range for some rows
    lp = (old + 2e-3 * torch.randn(B, T, generator=g)).requires_grad_()
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    if per_token:
        adv = adv + torch.randn(B, T, generator=g)
    return lp, old, adv, mask


def _loss_grad(name, lp, old, adv, mask, agg="seq-mean-token-mean"):
    cfg = PolicyLossConfig(name=name, eps_low=3e-4, eps_high=4e-4, loss_agg=agg, diagnostics=True)  # C of every loss
    loss, m = compute_policy_loss(lp, old, adv, mask, cfg)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad, m


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gspo_token_equals_gspo_with_sequence_advantages(agg):
    lp, old, adv, mask = _gspo_batch(per_token=False)
    l_seq, g_seq, m_seq = _loss_grad("gspo", lp, old, adv, mask, agg)
    l_tok, g_tok, m_tok = _loss_grad("gspo_token", lp, old, adv, mask, agg)
    assert 0 < m_seq["clip_frac"].item() < 1  # some rows clipped, some not
    assert l_tok.item() == pytest.approx(l_seq.item(), rel=1e-6)
    assert torch.allclose(g_tok, g_seq, atol=1e-8, rtol=1e-5)
    for key in ("clip_bias/scalar", "clip_bias/sq_sum", "clip_frac", "seq_ratio/mean"):
        assert m_tok[key].item() == pytest.approx(m_seq[key].item(), rel=1e-5, abs=1e-12), key


def test_gspo_token_with_token_advantages_differs_and_matches_its_hand_gradient():
    lp, old, adv, mask = _gspo_batch(per_token=True)
    l_seq, g_seq, _ = _loss_grad("gspo", lp, old, adv, mask)
    l_tok, g_tok, m_tok = _loss_grad("gspo_token", lp, old, adv, mask)
    assert l_tok.item() == pytest.approx(l_seq.item(), rel=1e-6)  # same ratio values, same loss
    assert (g_tok - g_seq).abs().max() > 1e-3  # but not the same gradient
    # hand: d/d log pi_t of g_t * max(-A_t s_i, -A_t clip(s_i)) with s_i,t = sg[s_i] pi_t / sg[pi_t]
    m = mask.bool()
    n = m.sum(-1, keepdim=True).float()
    s = torch.exp(((lp.detach() - old) * m).sum(-1, keepdim=True) / n)
    clipped = ((adv > 0) & (s > 1 + 4e-4)) | ((adv < 0) & (s < 1 - 3e-4))
    g_t = m.float() / (n * mask.shape[0])
    expected = torch.where(m, -g_t * adv * s * (~clipped).float(), torch.zeros(()))
    assert torch.allclose(g_tok, expected, atol=1e-9, rtol=1e-5)
    # the clip bias C is the part of the unclipped gradient the clip removed: its log-prob-space
    # norm is the closed form g_t 1[B^c] s_i A_t
    c = torch.where(m & clipped, g_t * adv * s, torch.zeros(()))
    assert m_tok["clip_bias/sq_sum"].item() == pytest.approx(float((c * c).sum()), rel=1e-5)
    assert 0 < m_tok["clip_frac"].item() < 1


# ---------------------------------------------------------------- SAPO: eq. 11 and the code listing


def _sapo_batch():
    """Three rows (padding marked by ratio None): A = +1, -1, 0."""
    ratios = [[0.5, 2.0, 1.0, None], [0.7, 1.1, None, None], [0.9, 1.5, 1.0, 1.0]]
    mask = torch.tensor([[r is not None for r in row] for row in ratios], dtype=torch.long)
    r = torch.tensor([[x if x is not None else 1.0 for x in row] for row in ratios])
    old = torch.full((3, 4), math.log(0.5))
    lp = (old + torch.log(r)).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.0]).unsqueeze(1).expand(3, 4).clone()
    return lp, old, adv, mask


# the clipped surrogate (eps 0.2), token mean over the 9 policy tokens:
#   row 0 (A=+1): -0.5 (r 0.5, unclipped), -1.2 (r 2 clipped), -1.0;  row 1 (A=-1): 0.8 (r 0.7 clipped), 1.1
#   row 2 (A=0): 0
PG = (-0.5 - 1.2 - 1.0 + 0.8 + 1.1) / 9
PG_GRAD = torch.tensor([[-0.5, 0.0, -1.0, 0.0], [0.0, 1.1, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]) / 9


def test_sapo_eq11_hand_example():
    lp, old, adv, mask = _sapo_batch()
    loss, m = compute_policy_loss(lp, old, adv, mask, PolicyLossConfig(name="sapo", loss_agg="token-mean"))
    # eq. 11: r < 1 and A > 0 -> row 0's first token only, inside the token mean over 9 tokens
    assert loss.item() == pytest.approx(PG + 0.1 * -math.log(0.5) / 9, abs=1e-6)
    assert m["sapo/penalty_frac"].item() == pytest.approx(1 / 9)
    (g,) = torch.autograd.grad(loss, lp)
    penalty_grad = torch.zeros(3, 4)
    penalty_grad[0, 0] = -0.1 / 9
    assert torch.allclose(g, PG_GRAD + penalty_grad, atol=1e-6)


def test_sapo_listing_hand_example():
    lp, old, adv, mask = _sapo_batch()
    cfg = PolicyLossConfig.from_dict({"name": "sapo", "loss_agg": "token-mean", "sapo": {"variant": "listing"}})
    loss, m = compute_policy_loss(lp, old, adv, mask, cfg)
    # listing: rows with A >= 0 (rows 0 and 2: 7 policy tokens), tokens with r <= 1 (r = 1 included)
    penalty = -(math.log(0.5) + math.log(0.9)) / 7
    assert loss.item() == pytest.approx(PG + 0.1 * penalty, abs=1e-6)
    assert m["sapo/penalty"].item() == pytest.approx(penalty, abs=1e-6)
    assert m["sapo/penalty_frac"].item() == pytest.approx(5 / 9)
    (g,) = torch.autograd.grad(loss, lp)
    active = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 1, 1]], dtype=torch.float32)
    assert torch.allclose(g, PG_GRAD - 0.1 / 7 * active, atol=1e-6)
    # on-policy (r = 1 everywhere) eq. 11's term is inert while the listing's still pulls A >= 0 rows up
    on = old.clone().requires_grad_()
    (g_list,) = torch.autograd.grad(compute_policy_loss(on, old, adv, mask, cfg)[0], on)
    (g_eq11,) = torch.autograd.grad(
        compute_policy_loss(on, old, adv, mask, PolicyLossConfig(name="sapo", loss_agg="token-mean"))[0], on
    )
    assert g_eq11[2].abs().max() == 0 and torch.allclose(g_list[2], torch.full((4,), -0.1 / 7))


def test_sapo_listing_micro_batches_add_up_with_mini_batch_denominators():
    g = torch.Generator().manual_seed(4)
    B, T = 6, 7
    mask = (torch.rand(B, T, generator=g) < 0.7).long()
    mask[3] = 0
    old = -torch.rand(B, T, generator=g) * 2
    lp = (old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_()
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    cfg = PolicyLossConfig.from_dict({"name": "sapo", "loss_agg": "token-mean", "sapo": {"variant": "listing"}})
    full, m_full = compute_policy_loss(lp, old, adv, mask, cfg)
    (g_full,) = torch.autograd.grad(full, lp)
    den = loss_denominators(mask, adv, cfg)
    assert den.sapo.item() == float(mask[adv[:, 0] >= 0].sum())
    parts = [compute_policy_loss(lp[s], old[s], adv[s], mask[s], cfg, denominator=den)
             for s in (slice(0, 2), slice(2, 5), slice(5, 6))]
    total = sum(p[0] for p in parts)
    (g_parts,) = torch.autograd.grad(total, lp)
    assert torch.allclose(total, full, atol=1e-6) and torch.allclose(g_parts, g_full, atol=1e-7)
    assert sum(p[1]["sapo/penalty"] for p in parts).item() == pytest.approx(m_full["sapo/penalty"].item(), abs=1e-6)


def test_sapo_variant_config():
    with pytest.raises(ValueError, match=r"loss.sapo.variant='listing' .* set loss.loss_agg=token-mean"):
        PolicyLossConfig.from_dict({"name": "sapo", "loss_agg": "seq-mean-token-mean", "sapo": {"variant": "listing"}})
    with pytest.raises(ValueError, match=r"loss.sapo.variant: 'code' is not one of"):
        PolicyLossConfig.from_dict({"name": "sapo", "sapo": {"variant": "code"}})
    assert not SAPOConfig().nonnegative and SAPOConfig(variant="listing").nonnegative
    assert not SAPOConfig(variant="listing", adv_condition="positive").nonnegative
    # the listing's loss_agg requirement binds only the sapo loss
    PolicyLossConfig.from_dict({"name": "grpo", "loss_agg": "seq-mean-token-mean", "sapo": {"variant": "listing"}})
