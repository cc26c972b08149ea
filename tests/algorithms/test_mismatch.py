"""Leading indicators (issue 30) against hand-computed values."""

import math

import pytest
import torch

from sorl_megatron.algorithms import PolicyLossConfig, compute_policy_loss
from sorl_megatron.algorithms.kl import kl_penalty
from sorl_megatron.algorithms.mismatch import clip_counts, importance_ess, k3_kl, route_flip_counts
from sorl_megatron.algorithms.turns import segment_turns


def test_ess_hand_example():
    # row 0: weights 1, 1, 2 -> ESS = 16 / 6; row 1: weight 3 alone -> 1; row 2: no token
    lw = torch.tensor([[0.0, 0.0, math.log(2)], [math.log(3), 5.0, 5.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    batch, per_seq = importance_ess(lw, mask)
    # batch: weights 1, 1, 2, 3 -> (7)^2 / (1 + 1 + 4 + 9) / 4
    assert batch.item() == pytest.approx(49 / 15 / 4)
    assert per_seq.item() == pytest.approx(((16 / 6) / 3 + 1.0) / 2)
    # scale-free and overflow-safe: a huge common log-weight changes nothing
    b2, s2 = importance_ess(lw.double() + 800.0, mask)
    assert b2.item() == pytest.approx(batch.item()) and s2.item() == pytest.approx(per_seq.item())
    # equal weights: 1; no tokens: 1
    assert importance_ess(torch.zeros(2, 3), torch.ones(2, 3))[0].item() == pytest.approx(1.0)
    assert importance_ess(torch.zeros(2, 3), torch.zeros(2, 3))[1].item() == 1.0


def test_k3_hand_example():
    lp = torch.tensor([[math.log(2), math.log(0.5), 9.0]])
    mu = torch.zeros(1, 3)
    mask = torch.tensor([[1, 1, 0]])
    want = ((2 - 1 - math.log(2)) + (0.5 - 1 - math.log(0.5))) / 2
    assert k3_kl(lp, mu, mask).item() == pytest.approx(want)
    assert k3_kl(mu, mu, mask).item() == 0.0
    assert k3_kl(lp, mu, torch.zeros(1, 3)).item() == 0.0
    # kl_penalty's k3 (one owner), in float64: a gap of fp32 rounding (~1e-7 nats) still registers
    per_token = kl_penalty(mu, lp, "k3", dtype=torch.float64)
    assert per_token.dtype == torch.float64 and k3_kl(lp, mu, mask).item() == per_token[0, :2].mean().item()
    gap = torch.full((1, 3), 1e-7)
    assert k3_kl(gap, torch.zeros(1, 3), mask).item() == pytest.approx(0.5e-14, rel=0.05)
    assert kl_penalty(torch.zeros(1, 3), gap, "k3").dtype == torch.float32  # the loss's default


def test_route_flip_counts_compare_sets():
    a = torch.tensor([[[[0, 1], [2, 3]], [[1, 0], [-1, -1]]]])  # [1, 2 positions, 2 layers, k=2]
    b = torch.tensor([[[[1, 0], [2, 1]], [[1, 2], [0, 1]]]])
    flips, pairs = route_flip_counts(a, b)
    # (0,0): same set; (0,1): differs; (1,0): differs; (1,1): no rollout route, not compared
    assert (flips.item(), pairs.item()) == (2.0, 3.0)
    with pytest.raises(ValueError, match="shapes"):
        route_flip_counts(a, b[..., :1])


def test_clip_counts_token_and_turn():
    # one row, two turns: tokens 0-1 (log r = log 1.5, 0 -> turn ratio sqrt(1.5) = 1.22) and 3-4
    # (log r = log 0.5 both -> 0.5); advantages +1 then -1; range [0.8, 1.2]
    lr = torch.tensor([[math.log(1.5), 0.0, 0.0, math.log(0.5), math.log(0.5)]])
    adv = torch.tensor([[1.0, 1.0, 0.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    c = clip_counts(lr, adv, mask, 0.8, 1.2, segment_turns(mask))
    assert c["tokens_clipped"].item() == 3 and c["tokens"].item() == 4
    assert c["turns_clipped"].item() == 2 and c["turns"].item() == 2
    c = clip_counts(lr, adv, mask, 0.8, 1.3, segment_turns(mask))  # sqrt(1.5) = 1.22 < 1.3: turn 1 not clipped
    assert c["tokens_clipped"].item() == 3 and c["turns_clipped"].item() == 1
    assert "turns" not in clip_counts(lr, adv, mask, 0.8, 1.2)


def test_loss_logs_the_clip_fractions():
    lr = torch.tensor([[math.log(1.5), 0.0, 0.0, math.log(0.5), math.log(0.5)]])
    adv = torch.tensor([[1.0, 1.0, 0.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    ids = torch.tensor([[0, 0, 0, 1, 1]])
    _, m = compute_policy_loss(lr.clone().requires_grad_(), torch.zeros(1, 5), adv, mask,
                               PolicyLossConfig(name="grpo", eps_low=0.2), turn_ids=ids)
    assert m["clip_frac/token"].item() == pytest.approx(0.75)
    assert m["clip/turns_clipped"].item() == 2 and m["clip/turns"].item() == 2
