"""The per-step diagnostics (SORL Figs. 2 and 4): each against a direct computation."""

import math

import pytest
import torch

from sorl_megatron.algorithms import PolicyLossConfig, compute_policy_loss, segment_turns
from sorl_megatron.algorithms.diagnostics import (
    ABS_LOG_RATIO_EDGES,
    BINS_PER_DECADE,
    abs_log_ratio_histogram,
    advantage_stats,
    turn_advantage_sign_mixing,
    turn_ratio_spread,
)

BIN = 10 ** (1 / BINS_PER_DECADE) - 1  # relative width of one bin


def test_advantage_stats_are_over_policy_tokens():
    adv = torch.tensor([[1.0, 3.0, 100.0], [-2.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    s = advantage_stats(adv, mask)
    assert s["advantage/mean"] == pytest.approx(2 / 3)
    assert s["advantage/var"] == pytest.approx(((1 - 2 / 3) ** 2 + (3 - 2 / 3) ** 2 + (-2 - 2 / 3) ** 2) / 3)
    assert advantage_stats(torch.tensor([1.0, 5.0]), mask)["advantage/mean"] == pytest.approx((1 + 1 + 5) / 3)


def test_abs_log_ratio_histogram_quantiles_max_and_merging():
    g = torch.Generator().manual_seed(0)
    B, T = 40, 500
    mask = torch.rand(B, T, generator=g) < 0.8
    old = -torch.rand(B, T, generator=g) * 3
    old[~mask] = float("-inf")  # off-mask garbage never counts
    lr = torch.randn(B, T, generator=g) * torch.exp(torch.randn(B, T, generator=g) * 2)  # heavy-tailed
    lp = old.nan_to_num(neginf=-1.0) + lr
    h = abs_log_ratio_histogram(lp, old, mask)
    values = (lp.double() - old.double())[mask].abs()
    assert h.num == values.numel() and h.counts.shape == (len(ABS_LOG_RATIO_EDGES) - 1,)
    assert float(h.maximum) == float(values.max()) and float(h.minimum) == float(values.min())
    assert float(h.total) == pytest.approx(float(values.sum()))
    assert float(h.total_squares) == pytest.approx(float((values**2).sum()))
    m = h.metrics("abs_log_ratio")
    for q in (0.5, 0.9, 0.99):
        exact = float(torch.quantile(values, q))
        assert m[f"abs_log_ratio/p{int(q * 100)}"] == pytest.approx(exact, rel=BIN), q
    assert m["abs_log_ratio/max"] == float(values.max())
    # counts, sums and extremes merge exactly (micro-batches, ranks, mini-batches)
    halves = abs_log_ratio_histogram(lp[:15], old[:15], mask[:15]).merge(
        abs_log_ratio_histogram(lp[15:], old[15:], mask[15:]))
    assert torch.equal(halves.counts, h.counts) and float(halves.maximum) == float(h.maximum)
    assert float(halves.total) == pytest.approx(float(h.total))


def test_histogram_of_nothing_and_of_zeros():
    empty = abs_log_ratio_histogram(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    assert empty.num == 0 and math.isnan(empty.quantile(0.5))
    on_policy = abs_log_ratio_histogram(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))
    assert on_policy.counts[0] == 6 and on_policy.metrics("x") == {"x/p50": 0.0, "x/p90": 0.0, "x/p99": 0.0,
                                                                     "x/max": 0.0}


def test_turn_ratio_spread_hand_example():
    # row 0: turns with mean log-ratios log 2, log 0.5, 0 -> ratios 2, 0.5, 1: spread 1.5
    # row 1: one turn (not counted); row 2: no policy token
    mask = torch.tensor([[1, 1, 0, 1, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0], [0] * 7])
    lr = torch.tensor([[math.log(4), 0.0, 9.0, math.log(0.5), 9.0, 0.3, -0.3],
                       [5.0, 5.0, 5.0, 0, 0, 0, 0], [0.0] * 7])
    spread, rows = turn_ratio_spread(lr * mask, segment_turns(mask), clamp=20.0)
    assert spread.item() == pytest.approx(1.5) and rows.item() == 1
    # the same through a loss's metrics: a turn-level loss's own turn ratios, and a token-level loss
    # with diagnostics on (the lean path leaves it out); explicit turn ids regroup turns
    old = torch.zeros(3, 7)
    lp = (lr * mask).requires_grad_()
    _, m = compute_policy_loss(lp, old, torch.ones(3, 7), mask, PolicyLossConfig(name="turn_ppo"))
    assert m["turn_ratio/spread"].item() == pytest.approx(1.5) and m["turn_ratio/multi_turn_rows"].item() == 1
    _, m = compute_policy_loss(lp, old, torch.ones(3, 7), mask, PolicyLossConfig(name="grpo"))
    assert "turn_ratio/spread" not in m  # (without turn ids; ||C|| is always measured: a leading indicator)
    assert "clip_bias/sq_sum" in m
    grpo = PolicyLossConfig(name="grpo", diagnostics=True)
    _, m = compute_policy_loss(lp, old, torch.ones(3, 7), mask, grpo)
    assert m["turn_ratio/spread"].item() == pytest.approx(1.5) and m["turn_ratio/multi_turn_rows"].item() == 1
    ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1], [0, 0, 1, 0, 0, 0, 0], [0] * 7])  # row 0: 2 turns, row 1: 2
    _, m = compute_policy_loss(lp, old, torch.ones(3, 7), mask, grpo, turn_ids=ids)
    # row 0: exp(mean(log 4, 0, log .5)) = exp(log 2 / 3) vs 1; row 1: 1 vs 1
    assert m["turn_ratio/spread_sum"].item() == pytest.approx(2 ** (1 / 3) - 1, rel=1e-5)
    assert m["turn_ratio/multi_turn_rows"].item() == 2


def test_kl_entropy_and_ratio_metrics_of_every_loss():
    lr = torch.tensor([[math.log(2.0), math.log(0.5), 0.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    old = torch.full((1, 4), -1.0)
    lp = (old + lr).requires_grad_()
    ent = torch.tensor([[1.0, 2.0, 6.0, 100.0]])
    for name in ("ppo", "gspo", "so_grpo"):
        _, m = compute_policy_loss(lp, old, torch.ones(1, 4), mask, PolicyLossConfig(name=name), entropy=ent)
        # KL(pi_old || pi_theta) on samples of pi_old: k1 = mean(-log r), k3 = mean(r - 1 - log r)
        assert m["approx_kl_k1"].item() == pytest.approx(0.0, abs=1e-7)
        assert m["approx_kl_k3"].item() == pytest.approx((1 - math.log(2) + (-0.5 + math.log(2))) / 3, rel=1e-6)
        assert m["entropy/mean"].item() == pytest.approx(3.0)  # token mean without an entropy bonus
        assert "entropy" not in m  # the bonus term is absent
        assert m["abs_log_ratio/max"].item() == pytest.approx(math.log(2))


def test_turn_advantage_sign_mixing_counts_turns_holding_both_signs():
    # row 0: turns [A, A] (+, -: mixed) and [B] (+); row 1: one turn (+, 0, +: not mixed; 0 is no sign)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 0, 0]])
    adv = torch.tensor([[0.5, -0.2, 9.0, 0.3, 9.0], [0.1, 0.0, 0.4, -7.0, -7.0]])  # off-mask values ignored
    assert turn_advantage_sign_mixing(adv, mask) == {"advantage/turn_sign_mixed_frac": pytest.approx(1 / 3)}
    # explicit turn ids: row 1 split into (+) and (0, +): still none mixed; row 0 as one turn: mixed
    ids = torch.tensor([[0, 0, 0, 0, 0], [0, 1, 1, 0, 0]])
    assert turn_advantage_sign_mixing(adv, mask, ids)["advantage/turn_sign_mixed_frac"] == pytest.approx(1 / 3)
    # per-sequence advantages (GRPO) cannot mix within a turn
    assert turn_advantage_sign_mixing(torch.tensor([1.0, -1.0]), mask)["advantage/turn_sign_mixed_frac"] == 0.0
    assert turn_advantage_sign_mixing(adv, torch.zeros_like(mask))["advantage/turn_sign_mixed_frac"] == 0.0
