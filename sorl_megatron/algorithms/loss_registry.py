"""The policy-loss registry: what each named loss is (surrogate, ratio level, normalization,
penalty).

Below both the configs (which validate names against it) and the loss math. The losses here
share PPO's clipped surrogate; a loss with a surrogate of its own lives in a file of
``losses/`` together with its :func:`register_policy_loss` call, and importing this module
registers those too.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ratios import RatioLevel
from .surrogate import Surrogate, ppo_clipped_surrogate


@dataclass(frozen=True)
class PolicyLossSpec:
    """A registered policy loss.

    Attributes:
        name: config name.
        surrogate: the per-token objective (``surrogate.py``); PPO's clipped one by default.
        ratio_level: ``token``, ``turn`` or ``sequence`` importance ratio.
        clip_normalized: scale by ``1 / max(||C||, delta)`` (SORL clipping-triggered norm).
        token_gradient: the ratio's value is the ``ratio_level`` one but its gradient is each
            token's own: ``sg[s] * pi_t / sg[pi_t]`` (the GSPO paper's GSPO-token), so per-token
            advantages weigh per-token gradients.
        sapo_penalty: add SAPO's conditional KL term.
        critic: trained on a critic's advantages (PPO family, GAE), as its paper defines it;
            the group-relative losses take outcome-based estimators (GRPO, PVPO). A recipe
            pairing a loss with an estimator of the other kind is an error
            (``advantages.ADVANTAGE_ESTIMATORS``).
        reference: paper and equations.
    """

    name: str
    ratio_level: RatioLevel
    clip_normalized: bool = False
    token_gradient: bool = False
    sapo_penalty: bool = False
    critic: bool = False
    reference: str = ""
    surrogate: Surrogate = ppo_clipped_surrogate


POLICY_LOSSES: dict[str, PolicyLossSpec] = {}


def register_policy_loss(spec: PolicyLossSpec) -> PolicyLossSpec:
    """Add a loss to the registry (names are unique)."""
    if spec.name in POLICY_LOSSES:
        raise ValueError(f"policy loss {spec.name!r} is already registered")
    POLICY_LOSSES[spec.name] = spec
    return spec


for _spec in (
    PolicyLossSpec("ppo", "token", critic=True, reference="PPO; SORL eq. 1-2"),
    PolicyLossSpec("turn_ppo", "turn", critic=True, reference="SORL eq. 3-4 (Turn-PPO), Lemma 4.1"),
    PolicyLossSpec(
        "s_ppo",
        "token",
        clip_normalized=True,
        critic=True,
        reference="SORL S-PPO: eq. 1 + clipping-triggered normalization (eq. 7, 12)",
    ),
    PolicyLossSpec(
        "so_ppo", "turn", clip_normalized=True, critic=True, reference="SORL SO-PPO / ST-PPO: eq. 3-4, 8, 9, 12"
    ),
    PolicyLossSpec("grpo", "token", reference="GRPO; SORL eq. 13"),
    PolicyLossSpec("so_grpo", "token", clip_normalized=True, reference="SORL SO-GRPO: eq. 13-15"),
    PolicyLossSpec("gspo", "sequence", reference="GSPO: sequence ratio exp(mean log w_t)"),
    PolicyLossSpec(
        "gspo_token", "sequence", token_gradient=True,
        reference="GSPO-token: s_i,t = sg[s_i] pi_t / sg[pi_t], per-token advantages",
    ),
    PolicyLossSpec("sapo", "token", sapo_penalty=True, reference="SAPO eq. 9-11 (GRPO surrogate + conditional KL)"),
):
    register_policy_loss(_spec)
