"""Sequence- and turn-level IS weights on long multi-turn episodes (issue 47, item 5).

A synthetic batch of 24 episodes of 40-60 turns (about 1000 policy tokens each) whose tokens the
rollout engine sampled from ``mu``, a slightly perturbed copy of the trainer's ``pi_old``
(per-token KL(mu || pi_old) about 0.004; the study's injected routing mismatch gives 0.01-0.05).
The product of a row's token ratios, ``exp(sum log r_t)``, falls to a median of ~0.01 (NeMo-RL's
pull request 2269 reports ~0.06 on such episodes), weights nearly every row down, and its spread
across rows leaves few effective samples (ESS / N over rows ~0.07). The geometric mean stays
within 1% of 1, and is the default (``is_correction.geometric``). At turn level (10-30 tokens a
turn) the product spreads the turns' weights (0.3 to 4) where the geometric mean keeps them
within 10% of 1.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from sorl_megatron.algorithms import ISCorrectionConfig, PolicyLossConfig, compute_policy_loss, is_correction_weights
from sorl_megatron.algorithms.is_correction import ess_by_granularity, kish_ess_frac
from sorl_megatron.algorithms.ratios import level_log_ratio
from sorl_megatron.algorithms.turns import row_segments, segment_turns

VOCAB = 16


def _long_episodes(rows: int = 24, noise: float = 0.1, seed: int = 0):
    """``(old_logprobs, rollout_logprobs, loss_mask, turns_per_row)``: each row 40-60 turns of 10-30
    policy tokens, each turn followed by 4 observation tokens (mask 0); every policy token sampled
    from ``mu`` (the trainer's logits plus Gaussian noise of std ``noise``)."""
    g = torch.Generator().manual_seed(seed)
    layouts = []
    for _ in range(rows):
        turns = int(torch.randint(40, 61, (1,), generator=g))
        layouts.append([int(n) for n in torch.randint(10, 31, (turns,), generator=g)])
    length = max(sum(n + 4 for n in layout) for layout in layouts)
    old = torch.zeros(rows, length)
    mu = torch.zeros(rows, length)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for r, layout in enumerate(layouts):
        pos = 0
        for n in layout:
            logits = 1.5 * torch.randn(n, VOCAB, generator=g)
            p_old = torch.log_softmax(logits, -1)
            p_mu = torch.log_softmax(logits + noise * torch.randn(n, VOCAB, generator=g), -1)
            y = torch.multinomial(p_mu.exp(), 1, generator=g).squeeze(-1)
            old[r, pos: pos + n] = p_old.gather(-1, y[:, None]).squeeze(-1)
            mu[r, pos: pos + n] = p_mu.gather(-1, y[:, None]).squeeze(-1)
            mask[r, pos: pos + n] = True
            pos += n + 4
    return old, mu, mask, [len(layout) for layout in layouts]


@pytest.fixture(scope="module")
def episodes():
    return _long_episodes()


def test_the_synthetic_mismatch_is_small_per_token(episodes):
    old, mu, mask, turns = episodes
    assert all(40 <= t <= 60 for t in turns)
    gap = (old - mu)[mask]
    kl = (gap.exp() - 1 - gap).mean().item()  # k3 of KL(mu || pi_old), as mismatch/kl_k3
    assert 0.002 < kl < 0.006
    assert 700 < mask.sum(-1).float().mean().item() < 1300  # policy tokens per episode


def test_sequence_level_product_collapses_and_the_geometric_mean_does_not(episodes):
    old, mu, mask, _ = episodes
    gap = torch.where(mask, old - mu, torch.zeros(()))
    rows = row_segments(mask)
    product = level_log_ratio(gap, "sequence", rows, clamp=20.0, reduce="sum").exp()
    geometric = level_log_ratio(gap, "sequence", rows, clamp=20.0, reduce="mean").exp()
    per_row_product = [product[r, mask[r]][0].item() for r in range(mask.shape[0])]
    per_row_geometric = [geometric[r, mask[r]][0].item() for r in range(mask.shape[0])]
    assert statistics.median(per_row_product) <= 0.06, per_row_product
    assert all(0.98 < w < 1.02 for w in per_row_geometric), per_row_geometric


def test_is_correction_defaults_to_the_geometric_mean_at_turn_and_sequence_level(episodes):
    old, mu, mask, _ = episodes
    assert ISCorrectionConfig().geometric is True
    turns = segment_turns(mask)

    def raw(level: str, **kw):  # TIS with a cap no weight reaches: the raw weights
        return is_correction_weights(old, mu, mask, ISCorrectionConfig(mode="tis", level=level, cap=1e6, **kw), turns)

    # sequence level (~1000 policy tokens a row): the product collapses, the default stays near 1
    default, product = raw("sequence"), raw("sequence", geometric=False)
    rows = [product.weights[r, mask[r]][0].item() for r in range(mask.shape[0])]
    assert statistics.median(rows) <= 0.06, rows
    assert 0.97 < default.weights[mask].min().item() and default.weights[mask].max().item() < 1.03
    assert product.metrics["is/ess_sequence"].item() < 0.2 < 0.99 < default.metrics["is/ess_sequence"].item()
    # turn level (10-30 tokens a turn): the product spreads the turns' weights, the default keeps them near 1
    default, product = raw("turn"), raw("turn", geometric=False)
    assert 0.9 < default.weights[mask].min().item() and default.weights[mask].max().item() < 1.1
    assert product.weights[mask].min().item() < 0.5 and product.weights[mask].max().item() > 2.0
    assert product.metrics["is/ess_turn"].item() < 0.95 < 0.99 < default.metrics["is/ess_turn"].item()
    # MIS with the product masks most long episodes (weight below low = 0.5); the default keeps them all
    mis_product = is_correction_weights(old, mu, mask, ISCorrectionConfig(mode="mis", level="sequence",
                                                                          geometric=False))
    mis_default = is_correction_weights(old, mu, mask, ISCorrectionConfig(mode="mis", level="sequence"))
    assert mis_product.metrics["is/masked_frac"].item() > 0.8
    assert mis_default.metrics["is/masked_frac"].item() == 0.0


def test_ess_per_granularity_is_reported_by_the_loss(episodes):
    old, mu, mask, _ = episodes
    lp = old.clone().requires_grad_()
    adv = torch.ones_like(old)
    _, m = compute_policy_loss(lp, old, adv, mask, PolicyLossConfig(name="grpo"), rollout_logprobs=mu)
    assert {"is/ess_token", "is/ess_sequence"} <= set(m) and "is/ess_turn" not in m  # no turn segments
    assert 0.9 < m["is/ess_token"].item() <= 1.0
    _, m = compute_policy_loss(lp, old, adv, mask, PolicyLossConfig(name="turn_ppo"), rollout_logprobs=mu)
    assert 0.99 < m["is/ess_turn"].item() <= 1.0  # turn segments: the turn-level ESS too
    _, m = compute_policy_loss(lp, old, adv, mask, PolicyLossConfig(name="grpo"))  # no mu: no mismatch metrics
    assert not any(k.startswith("is/") for k in m)


def test_kish_ess():
    assert kish_ess_frac(torch.zeros(5)).item() == pytest.approx(1.0)
    assert kish_ess_frac(torch.tensor([0.0, -50.0, -50.0, -50.0])).item() == pytest.approx(0.25)
    assert kish_ess_frac(torch.tensor([1000.0, 1000.0])).item() == pytest.approx(1.0)  # no overflow
    assert kish_ess_frac(torch.tensor([0.0, 5.0]), torch.tensor([True, False])).item() == pytest.approx(1.0)
    assert kish_ess_frac(torch.zeros(3), torch.zeros(3, dtype=torch.bool)).item() == 1.0  # no units
    w = torch.tensor([1.0, 2.0, 4.0])
    assert kish_ess_frac(w.log()).item() == pytest.approx(49 / (3 * 21))
    # by granularity, on a hand example: two rows, the second with two turns
    gap = torch.tensor([[math.log(2.0), math.log(2.0), 0.0], [math.log(0.5), 0.0, math.log(8.0)]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    turns = segment_turns(mask)  # row 0: one turn of 2 tokens; row 1: two turns of 1 token
    out = ess_by_granularity(gap, mask, geometric=False, turn_segments=turns)
    assert out["is/ess_token"].item() == pytest.approx(kish_ess_frac(torch.tensor([2.0, 2.0, 0.5, 8.0]).log()).item())
    assert out["is/ess_sequence"].item() == pytest.approx(kish_ess_frac(torch.tensor([4.0, 4.0]).log()).item())
    assert out["is/ess_turn"].item() == pytest.approx(kish_ess_frac(torch.tensor([4.0, 0.5, 8.0]).log()).item())
    geo = ess_by_granularity(gap, mask, geometric=True, turn_segments=turns)
    assert geo["is/ess_sequence"].item() == pytest.approx(kish_ess_frac(torch.tensor([2.0, 2.0]).log()).item())
