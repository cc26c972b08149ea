import pytest
import torch

from sorl_megatron.algorithms import (
    broadcast_to_tokens,
    compute_gae,
    compute_grpo_advantages,
    compute_pvpo_advantages,
    static_values_from_rollouts,
    whiten_advantages,
)


def reference_gae(rewards, values, mask, gamma, lam):
    """Textbook backward recursion over policy tokens only (observations skipped)."""
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        idx = mask[b].nonzero().flatten().tolist()
        last, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            last = delta + gamma * lam * last
            adv[b, t] = last
            next_v = values[b, t].item()
    return adv.float()


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
@pytest.mark.parametrize("seq", [9, 600])  # 600 crosses the 256-token chunks
def test_gae_matches_recursion_over_policy_tokens(gamma, lam, seq):
    g = torch.Generator().manual_seed(seq)
    mask = (torch.rand(3, seq, generator=g) < 0.6).long()
    mask[2] = 0
    rewards = torch.randn(3, seq, generator=g)
    values = torch.randn(3, seq, generator=g)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    ref = reference_gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(adv, ref, atol=1e-4, rtol=1e-5)
    assert torch.allclose(ret, (ref + values) * mask, atol=1e-4, rtol=1e-5)
    assert (adv[mask == 0] == 0).all()


def test_gae_with_unit_gamma_lambda_is_return_minus_value():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]])
    rewards = torch.zeros(1, 8)
    rewards[0, 6] = 1.0  # outcome reward on the last policy token
    values = torch.tensor([[9.0, 0.2, 0.4, 9.0, 9.0, 0.5, 0.7, 9.0]])
    adv, _ = compute_gae(rewards, values, mask)
    assert torch.allclose(adv, torch.tensor([[0, 0.8, 0.6, 0, 0, 0.5, 0.3, 0]]), atol=1e-6)


def test_gae_shape_errors():
    with pytest.raises(ValueError, match="equal"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3))


def test_grpo_group_normalization():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2])
    groups = torch.tensor([7, 7, 7, 7, 3, 9])
    adv = compute_grpo_advantages(scores, groups)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as in GRPO implementations
    assert torch.allclose(adv[:4], (torch.tensor([1.0, 0, 0, 1]) - 0.5) / (std + 1e-6))
    assert adv[4].item() == 0.0 and adv[5].item() == 0.0  # singleton groups
    no_std = compute_grpo_advantages(scores, groups, normalize_std=False)
    assert torch.allclose(no_std[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match=r"scores\[1\] is not finite"):
        compute_grpo_advantages(torch.tensor([0.0, float("nan")]), torch.tensor([0, 0]))


def test_pvpo_static_value_baseline_hand_example():
    # M = 4 reference rollouts of prompt 0 (acc 0.5) and prompt 1 (acc 0.25)
    ref_scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    ref_groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    static_v = static_values_from_rollouts(ref_scores, ref_groups)
    assert static_v == {0: 0.5, 1: 0.25}
    # training rollouts: A = r - V_static (eq. 10), no std normalization
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0])
    groups = [0, 1, 1, 0]
    adv = compute_pvpo_advantages(scores, torch.tensor([static_v[g] for g in groups]))
    assert adv.tolist() == [0.5, 0.75, -0.25, -0.5]
    tokens = broadcast_to_tokens(adv, torch.tensor([[1, 0, 1], [1, 1, 0], [0, 0, 1], [1, 1, 1]]))
    assert tokens[1].tolist() == [0.75, 0.75, 0.0]


def test_whitening_over_policy_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])
    w = whiten_advantages(adv, mask)
    sel = w[mask.bool()]
    assert sel.mean().abs() < 1e-6 and (sel.std() - 1).abs() < 1e-5
    assert w[0, 2] == 0


def test_estimator_registry_matches_the_direct_functions():
    from sorl_megatron.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, compute_advantages

    assert {n: s.critic for n, s in ADVANTAGE_ESTIMATORS.items()} == {"gae": True, "grpo": False, "pvpo": False}
    torch.manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    rewards, values = torch.tensor([1.0, 0.0, 0.5]), torch.randn(3, 6)
    groups, static = torch.tensor([0, 0, 1]), torch.tensor([0.25, 0.25, 0.75])
    inputs = AdvantageInputs(rewards, mask, values, groups, static)
    token_rewards = torch.zeros(3, 6)
    token_rewards[0, 4], token_rewards[1, 3], token_rewards[2, 5] = 1.0, 0.0, 0.5  # each row's last policy token
    adv, ret = compute_advantages("gae", inputs, gamma=0.9, lam=0.8)
    want_adv, want_ret = compute_gae(token_rewards, values, mask, 0.9, 0.8)
    assert torch.equal(adv, want_adv) and torch.equal(ret, want_ret)
    adv, ret = compute_advantages("grpo", inputs, normalize_std=False)
    assert ret is None and torch.equal(adv, broadcast_to_tokens(compute_grpo_advantages(rewards, groups, False), mask))
    adv, _ = compute_advantages("pvpo", inputs, whiten=True)
    pvpo = broadcast_to_tokens(compute_pvpo_advantages(rewards, static), mask)
    assert torch.allclose(adv, whiten_advantages(pvpo, mask))
    with pytest.raises(ValueError, match="advantage estimator 'gae' needs values"):
        compute_advantages("gae", AdvantageInputs(rewards, mask))
    with pytest.raises(ValueError, match="unknown advantage estimator 'vtrace'"):
        compute_advantages("vtrace", inputs)
