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
