"""The registry: a config names its loss once (``PolicyLossConfig.spec``)."""

import pytest

from sorl_megatron.algorithms import POLICY_LOSSES, PolicyLossConfig


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_config_spec_is_the_registered_loss(name):
    assert PolicyLossConfig(name=name).spec is POLICY_LOSSES[name]


def test_config_spec_of_a_name_changed_after_validation_names_the_field():
    cfg = PolicyLossConfig()
    cfg.name = "ppo3"
    with pytest.raises(ValueError, match=r"loss.name: unknown policy loss 'ppo3'; registered: \["):
        _ = cfg.spec


def test_a_registered_surrogate_is_the_loss_and_composes_with_the_other_stages(monkeypatch):
    """A loss that brings its own surrogate (here the unclipped importance-weighted one,
    ``-a_t w_t``) gets the shared stages around it: aggregation, IS weights, KL, metrics."""
    import torch

    from sorl_megatron.algorithms import (
        ISCorrectionConfig,
        PolicyLossSpec,
        SurrogateInputs,
        SurrogateTerms,
        compute_policy_loss,
        token_weights,
    )

    seen = []

    def unclipped(inputs: SurrogateInputs) -> SurrogateTerms:
        seen.append(inputs)
        none = torch.zeros_like(inputs.mask)
        return SurrogateTerms(per_token=-inputs.advantages * inputs.ratio, clip_high=none, clip_low=none, dual=none)

    monkeypatch.setitem(POLICY_LOSSES, "unclipped", PolicyLossSpec("unclipped", "token", surrogate=unclipped))
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(3, 7, generator=g) < 0.8).long()
    old = -torch.rand(3, 7, generator=g)
    lp = (old + 0.5 * torch.randn(3, 7, generator=g)).requires_grad_()
    adv, mu, ref = torch.randn(3, 7, generator=g), old - 0.1, old + 0.2
    cfg = PolicyLossConfig(name="unclipped", loss_agg="seq-mean-token-mean", eps_low=0.1, kl_coef=0.3,
                           is_correction=ISCorrectionConfig(mode="tis", cap=1.05))
    loss, m = compute_policy_loss(lp, old, adv, mask, cfg, rollout_logprobs=mu, ref_logprobs=ref)
    (inputs,) = seen
    assert inputs.clip_low == 0.9 and inputs.clip_high == 1.1 and inputs.dual_clip is None
    assert inputs.logprobs is lp and inputs.mask.dtype == torch.bool
    w = token_weights(mask, cfg.loss_agg)
    assert torch.allclose(inputs.advantages, w * adv)  # a_t = g_t A_t
    r = torch.exp(lp - old)
    pg = -(w * adv * r * torch.exp(old - mu).clamp(max=1.05)).sum()
    kl = (w * (torch.exp(ref - lp) - (ref - lp) - 1)).sum()  # k3
    assert torch.allclose(loss, pg + 0.3 * kl, atol=1e-6)
    assert m["clip_frac"].item() == 0.0 and m["pg_loss"].item() == pytest.approx(pg.item(), abs=1e-6)
