"""Paper- and framework-faithful variants: verl's ``seq-mean-token-sum-norm``, GSPO-token,
SAPO's code-listing penalty. Each against a hand computation of its source's formula."""

import math

import pytest
import torch

from sorl_megatron.algorithms import (
    PolicyLossConfig,
    aggregation_denominator,
    compute_policy_loss,
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
    cfg = PolicyLossConfig(name=name, eps_low=3e-4, eps_high=4e-4, loss_agg=agg)
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
