"""Autograd proofs of the papers' algebra (SORL Lemma 4.1, Lemma 4.2, eq. 12/15) and the
reductions between losses."""

import pytest
import torch

from sorl_megatron.algorithms import (
    ClipBiasConfig,
    PolicyLossConfig,
    clip_bias_surrogate,
    compute_policy_loss,
    segment_turns,
    token_weights,
)
from sorl_megatron.algorithms.clip_bias import ClipNormalization, mini_batch_normalization

from .conftest import random_batch


def grad_of(loss_name, lp, old, adv, mask, **cfg):
    lp = lp.detach().requires_grad_()
    loss, metrics = compute_policy_loss(lp, old, adv, mask, PolicyLossConfig(name=loss_name, **cfg))
    (g,) = torch.autograd.grad(loss, lp)
    return g, loss.detach(), metrics


def test_turn_ppo_gradient_is_lemma_4_1_closed_form():
    lp, old, adv, mask = random_batch(batch=5, seq=16, scale=0.4, seed=3)
    eps = 0.2
    g, _, metrics = grad_of("turn_ppo", lp, old, adv, mask, eps_low=eps, loss_agg="seq-mean-token-mean")
    assert metrics["clip_frac"] > 0  # some tokens are clipped, so the indicator matters
    seg = segment_turns(mask)
    expected = torch.zeros_like(g)
    n_rows = int((mask.sum(1) > 0).sum())
    log_r = (lp.detach() - old)
    for b in range(mask.shape[0]):
        y_len = int(mask[b].sum())
        for k in range(int(seg.turns_per_row[b])):
            idx = (seg.turn_index[b] == k).nonzero().flatten()
            w_k = torch.exp(log_r[b, idx].mean())
            a = adv[b, idx]
            unclipped = ((a >= 0) & (w_k <= 1 + eps)) | ((a < 0) & (w_k >= 1 - eps))
            a_hat_k = (a * unclipped).sum()
            # Lemma 4.1: each token of turn k gets w_k * A^k / (|y| |y^k|); loss = -J, mean over rows
            expected[b, idx] = -(w_k * a_hat_k / (y_len * len(idx))) / n_rows
    assert torch.allclose(g, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["ppo", "turn_ppo", "gspo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_is_policy_gradient_minus_clip_bias_lemma_4_2(name, agg):
    lp, old, adv, mask = random_batch(batch=6, seq=14, scale=0.5, seed=7)
    # shift whole rows so that sequence- and turn-level ratios leave the clip range too
    old = old + torch.tensor([0.5, 0.0, -0.6, 0.4, -0.3, 1.5]).unsqueeze(1)
    g, _, metrics = grad_of(name, lp, old, adv, mask, loss_agg=agg, dual_clip=3.0, diagnostics=True)
    assert metrics["clip_frac"] > 0
    # Unclipped importance-weighted policy gradient (the first term of eq. 7), in loss sign.
    lp2 = lp.detach().requires_grad_()
    cfg = PolicyLossConfig(name=name, loss_agg=agg)
    weights = token_weights(mask, agg)
    seg = segment_turns(mask) if name == "turn_ppo" else None
    from sorl_megatron.algorithms.ratios import level_log_ratio, masked_log_ratio, segments_for_level

    level = {"ppo": "token", "turn_ppo": "turn", "gspo": "sequence"}[name]
    ratio = torch.exp(
        level_log_ratio(
            masked_log_ratio(lp2, old, mask), level, segments_for_level(level, mask, seg), cfg.log_ratio_clamp
        )
    )
    (g_pg,) = torch.autograd.grad(-(weights * ratio * adv * mask).sum(), lp2)
    # Clipping bias C: gradient of the clip-bias surrogate (objective sign).
    lp3 = lp.detach().requires_grad_()
    (c,) = torch.autograd.grad(
        clip_bias_surrogate(lp3, old, adv, mask, PolicyLossConfig(name=name, loss_agg=agg, dual_clip=3.0)), lp3
    )
    # grad(loss) = -(PG - C)
    assert torch.allclose(g, g_pg + c, atol=1e-6)
    # the closed-form logprob-space norm equals the autograd one
    assert torch.allclose(metrics["clip_bias/logprob_norm"], c.norm(), rtol=1e-5, atol=1e-7)
    assert c.abs().sum() > 0


@pytest.mark.parametrize("base,normalized", [("turn_ppo", "so_ppo"), ("ppo", "s_ppo"), ("grpo", "so_grpo")])
@pytest.mark.parametrize("mode", ["logprob", "scalar"])
def test_so_losses_scale_gradient_by_inverse_clip_bias_norm(base, normalized, mode):
    lp, old, adv, mask = random_batch(batch=6, seq=14, scale=0.6, seed=11, adv_scale=40.0)
    delta = 0.05
    g_base, _, _ = grad_of(base, lp, old, adv, mask)
    g_norm, _, metrics = grad_of(normalized, lp, old, adv, mask, clip_bias=ClipBiasConfig(mode=mode, delta=delta))
    norm = metrics["clip_bias/norm"]
    expected_norm = metrics["clip_bias/logprob_norm"] if mode == "logprob" else metrics["clip_bias/scalar"].abs()
    assert torch.allclose(norm, expected_norm)
    assert norm > delta  # the normalization is actually triggered
    factor = 1.0 / max(float(norm), delta)
    assert torch.allclose(metrics["clip_bias/factor"], torch.tensor(factor))
    assert torch.allclose(g_norm, g_base * factor, atol=1e-7, rtol=1e-5)
    # what an engine gets from the same (additive) statistics of a whole mini-batch
    engine = mini_batch_normalization(
        float(metrics["clip_bias/scalar"]), float(metrics["clip_bias/sq_sum"]), ClipBiasConfig(mode=mode, delta=delta)
    )
    assert engine.norm == pytest.approx(float(norm), rel=1e-6) and engine.factor == pytest.approx(factor, rel=1e-6)
    pg = ClipBiasConfig(mode="param_grad", delta=delta)
    assert mini_batch_normalization(0.0, 0.0, pg, param_grad_norm=2.0) == ClipNormalization(2.0, 0.5)
    with pytest.raises(ValueError, match="param_grad' needs the measured"):
        mini_batch_normalization(0.0, 0.0, pg)


def test_relative_form_only_shrinks_and_follows_the_scale_of_c():
    """min(1, k m / ||C||) with m a running mean of capped norms: 1 while ||C|| stays near its
    usual size (whatever that size is), < 1 on a spike, and the spike barely moves m."""
    cfg = ClipBiasConfig(mode="param_grad", form="relative", relative_threshold=2.0, ema_decay=0.5)

    def run(norms):
        running, out = None, []
        for n in norms:
            r = mini_batch_normalization(0.0, 0.0, cfg, param_grad_norm=n, running=running)
            running = r.running
            out.append((r.factor, r.running))
        return out

    for scale in (1e-3, 1.0, 1e3):  # the same behaviour at every scale of ||C||
        steps = run([scale, 1.5 * scale, 0.8 * scale, 10 * scale, scale])
        assert [f for f, _ in steps[:3]] == [1.0, 1.0, 1.0]
        m = steps[2][1]
        assert steps[3][0] == pytest.approx(2.0 * m / (10 * scale))  # the spike is shrunk to k m
        assert steps[3][1] == pytest.approx(0.5 * m + 0.5 * 2.0 * m)  # and enters m capped at k m
        assert steps[4][0] == 1.0
    assert steps[0] == (1.0, 1e3)  # the first mini-batch only starts the mean
    assert all(f <= 1.0 for f, _ in run([1.0, 100.0, 1e4, 1e-6, 1e9]))
    # on-policy mini-batches clip nothing: they neither start nor drag down the running mean
    assert run([0.0, 1.0, 0.0, 0.0, 1.5]) == [(1.0, None), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.25)]
    with pytest.raises(ValueError, match="form='relative' keeps a running mean"):
        lp, old, adv, mask = random_batch(batch=2, seq=5, scale=0.6, seed=1)
        relative = PolicyLossConfig(name="so_grpo", clip_bias=ClipBiasConfig(form="relative"))
        compute_policy_loss(lp, old, adv, mask, relative)


def test_param_grad_mode_uses_parameter_space_norm():
    torch.manual_seed(0)
    batch, seq, hidden, vocab = 4, 10, 6, 9
    x = torch.randn(batch, seq, hidden)
    tokens = torch.randint(0, vocab, (batch, seq))
    w = torch.nn.Parameter(torch.randn(hidden, vocab))

    def logprobs():
        return torch.log_softmax(x @ w, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    old = logprobs().detach() + 0.5 * torch.randn(batch, seq)
    adv = 30 * torch.randn(batch, seq)
    mask = (torch.rand(batch, seq) < 0.8).long()
    cfg = PolicyLossConfig(name="so_ppo", clip_bias=ClipBiasConfig(mode="param_grad", delta=1e-3))
    # reference: ||grad_theta S|| computed directly
    (gs,) = torch.autograd.grad(clip_bias_surrogate(logprobs(), old, adv, mask, cfg), w)
    norm = gs.norm()
    assert norm > 1e-3
    (g_base,) = torch.autograd.grad(
        compute_policy_loss(logprobs(), old, adv, mask, PolicyLossConfig(name="turn_ppo"))[0], w
    )
    loss, metrics = compute_policy_loss(logprobs(), old, adv, mask, cfg, params=[w])
    (g_so,) = torch.autograd.grad(loss, w)
    assert torch.allclose(metrics["clip_bias/norm"], norm, rtol=1e-5)
    assert torch.allclose(g_so, g_base / norm, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="param_grad"):
        compute_policy_loss(logprobs(), old, adv, mask, cfg)
    # an engine defers normalization and gets the unnormalized loss
    deferred, _ = compute_policy_loss(logprobs(), old, adv, mask, cfg, normalize=False)
    assert torch.allclose(
        deferred, compute_policy_loss(logprobs(), old, adv, mask, PolicyLossConfig(name="turn_ppo"))[0]
    )


def test_one_turn_per_row_gives_sequence_ratio():
    lp, old, adv, _ = random_batch(batch=4, seq=10, scale=0.3, seed=5)
    mask = torch.ones(4, 10, dtype=torch.long)
    mask[:, :3] = 0  # prompt, then one contiguous turn
    g_turn, l_turn, m_turn = grad_of("turn_ppo", lp, old, adv, mask)
    g_seq, l_seq, m_seq = grad_of("gspo", lp, old, adv, mask)
    assert torch.allclose(l_turn, l_seq) and torch.allclose(g_turn, g_seq)
    assert torch.allclose(m_turn["turn_ratio/mean"], m_seq["seq_ratio/mean"])


def test_one_token_per_turn_gives_token_ppo():
    lp, old, adv, _ = random_batch(batch=4, seq=12, scale=0.5, seed=6)
    mask = torch.zeros(4, 12, dtype=torch.long)
    mask[:, ::2] = 1  # every policy token is its own turn (observations in between)
    g_turn, l_turn, m_turn = grad_of("turn_ppo", lp, old, adv, mask)
    g_tok, l_tok, m_tok = grad_of("ppo", lp, old, adv, mask)
    assert m_tok["clip_frac"] > 0
    assert torch.allclose(l_turn, l_tok) and torch.allclose(g_turn, g_tok)


def test_so_grpo_with_clip_bias_below_delta_equals_grpo():
    lp, old, adv, mask = random_batch(batch=4, seq=12, scale=0.4, seed=8)
    g_grpo, l_grpo, _ = grad_of("grpo", lp, old, adv, mask)
    g_so, l_so, m_so = grad_of("so_grpo", lp, old, adv, mask, clip_bias=ClipBiasConfig(delta=1.0))
    assert 0 < m_so["clip_bias/norm"] < 1.0  # below delta
    assert torch.allclose(l_so, l_grpo) and torch.allclose(g_so, g_grpo)
    assert m_so["clip_bias/factor"] == 1.0


def test_token_ratio_indicator_option_for_turn_losses():
    lp, old, adv, mask = random_batch(batch=5, seq=16, scale=0.5, seed=9)
    _, _, by_turn = grad_of("so_ppo", lp, old, adv, mask)
    _, _, by_token = grad_of("so_ppo", lp, old, adv, mask, clip_bias=ClipBiasConfig(indicator="token_ratio"))
    assert not torch.allclose(by_turn["clip_bias/sq_sum"], by_token["clip_bias/sq_sum"])
