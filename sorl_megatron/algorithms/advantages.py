"""Advantage estimators: GAE, GRPO group normalization, PVPO static baseline, whitening.

Multi-turn trajectories interleave policy tokens with tool observations (``loss_mask == 0``).
GAE runs over the policy tokens only: an observation token is not an action, so the "next
state value" of the last token of a turn is the value at the first token of the next turn.

``ADVANTAGE_ESTIMATORS`` is the registry the trainer dispatches on (next to the loss
registry): ``compute_advantages(name, inputs, ...)`` turns outcome rewards into per-token
advantages (and GAE's returns) for any registered estimator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .aggregation import masked_whiten

_GAE_CHUNK = 256


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over policy tokens (SORL uses ``gamma = lam = 1``).

    Args:
        rewards: ``[B, T]`` token rewards (the outcome reward sits on the last policy token;
            entries off the mask are ignored).
        values: ``[B, T]`` critic values.
        loss_mask: ``[B, T]``, 1 on policy tokens.

    Returns:
        ``(advantages, returns)``, each ``[B, T]`` and 0 off the mask;
        ``returns = advantages + values``.

    ``delta_t = r_t + gamma V_{t'} - V_t`` with ``t'`` the next policy token (0 after the last)
    and ``A_t = sum_l (gamma lam)^l delta_{t+l}`` over policy tokens. Computed on the
    left-compacted policy tokens with a chunked discounted reverse cumulative sum: one matrix
    product per chunk of 256 tokens, no loop over tokens.
    """
    if not (rewards.shape == values.shape == loss_mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and loss_mask "
            f"{tuple(loss_mask.shape)} must be equal [batch, seq] shapes"
        )
    mask = loss_mask.bool()
    batch, seq = mask.shape
    if batch == 0 or seq == 0:
        return torch.zeros_like(rewards, dtype=torch.float32), torch.zeros_like(values, dtype=torch.float32)
    # Left-compact policy tokens, keeping their order (stable sort of "is observation").
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    cmask = torch.gather(mask, 1, order)
    zero = torch.zeros((), dtype=torch.float64, device=rewards.device)
    r = torch.where(cmask, torch.gather(rewards.double(), 1, order), zero)
    v = torch.where(cmask, torch.gather(values.double(), 1, order), zero)
    v_next = torch.cat([v[:, 1:], v.new_zeros(batch, 1)], dim=1)  # 0 past the last policy token
    delta = torch.where(cmask, r + gamma * v_next - v, zero)
    adv = _discounted_reverse_cumsum(delta, gamma * lam)
    adv = torch.where(cmask, adv, zero)
    # Scatter back to original positions.
    out = torch.zeros_like(adv)
    out.scatter_(1, order, adv)
    advantages = out.to(torch.float32)
    returns = torch.where(mask, advantages + values.float(), torch.zeros_like(advantages))
    return advantages, returns


def _discounted_reverse_cumsum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """``y_t = sum_{l >= 0} discount^l x_{t+l}`` along the last dim, chunk by chunk."""
    batch, seq = x.shape
    chunk = min(_GAE_CHUNK, seq)
    idx = torch.arange(chunk, device=x.device, dtype=torch.float64)
    # within[j, i] = discount^(j - i) for j >= i: y_i = sum_j x_j * within[j, i]
    power = idx.unsqueeze(1) - idx.unsqueeze(0)
    within = torch.where(
        power >= 0,
        torch.pow(torch.tensor(discount, dtype=torch.float64), power.clamp(min=0)),
        torch.zeros((), dtype=torch.float64),
    )
    out = torch.empty_like(x)
    carry = x.new_zeros(batch)  # y at the first position of the following chunk
    for end in range(seq, 0, -chunk):  # loop over chunks (seq / 256 iterations), not tokens
        start = max(0, end - chunk)
        n = end - start
        block = x[:, start:end] @ within[:n, :n]
        tail = torch.pow(
            torch.tensor(discount, dtype=torch.float64), torch.arange(n, 0, -1, device=x.device, dtype=torch.float64)
        )
        block = block + carry.unsqueeze(1) * tail
        out[:, start:end] = block
        carry = block[:, 0]
    return out


def compute_grpo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group-relative advantages ``(r_i - mean_g) / (std_g + eps)`` (SORL §4.3).

    ``normalize_std=False`` gives ``r_i - mean_g`` (Dr. GRPO). ``std`` is the unbiased
    standard deviation; singleton groups get advantage 0.
    """
    _check_group_inputs(scores, group_ids, "scores")
    scores = scores.double()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n = counts.double()
    sums = torch.zeros_like(n).index_add_(0, inverse, scores)
    mean = sums / n
    centered = scores - mean[inverse]
    if not normalize_std:
        return centered.float()
    sq = torch.zeros_like(n).index_add_(0, inverse, centered * centered)
    std = torch.sqrt(sq / (n - 1).clamp(min=1))
    return (centered / (std[inverse] + eps)).float()


def compute_pvpo_advantages(scores: torch.Tensor, static_values: torch.Tensor) -> torch.Tensor:
    """PVPO advantage ``r_i - V_static`` (PVPO eq. 10), no std normalization.

    ``static_values[i]`` is the Monte Carlo mean reward of trajectory ``i``'s prompt under the
    reference (static) policy, ``(1/M) sum_j r_{sta, j}``.
    """
    if scores.shape != static_values.shape or scores.dim() != 1:
        raise ValueError(
            f"scores {tuple(scores.shape)} and static_values {tuple(static_values.shape)} must be equal 1-D shapes"
        )
    return (scores.float() - static_values.float())


def static_values_from_rollouts(scores: torch.Tensor, group_ids: torch.Tensor) -> dict[int, float]:
    """Per-prompt static V (PVPO eq. 10): the mean reward of each group of M reference rollouts."""
    _check_group_inputs(scores, group_ids, "scores")
    uniq, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, scores.double())
    means = sums / counts.double()
    return {int(g): float(m) for g, m in zip(uniq.tolist(), means.tolist())}


def broadcast_to_tokens(per_sequence: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Give every policy token its sequence's advantage (0 elsewhere)."""
    if per_sequence.dim() != 1 or per_sequence.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"per-sequence values {tuple(per_sequence.shape)} do not match batch {loss_mask.shape[0]}")
    return per_sequence.float().unsqueeze(1) * loss_mask.float()


def whiten_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Batch whitening over policy tokens (PPO's advantage normalization option)."""
    return masked_whiten(advantages.float(), loss_mask, shift_mean=shift_mean)


def _check_group_inputs(scores: torch.Tensor, group_ids: torch.Tensor, name: str) -> None:
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"{name} {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D shapes"
        )
    if not torch.isfinite(scores.double()).all():
        bad = int((~torch.isfinite(scores.double())).nonzero()[0].item())
        raise ValueError(f"{name}[{bad}] is not finite ({scores[bad].item()})")


def terminal_token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` token rewards with each outcome reward on its row's last policy token (the
    action that ended the episode), 0 elsewhere: GAE's input for outcome-rewarded episodes."""
    if rewards.dim() != 1 or rewards.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"rewards {tuple(rewards.shape)} do not match batch {loss_mask.shape[0]}")
    positions = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    last = (loss_mask.bool() * positions).argmax(dim=1)
    out = torch.zeros(loss_mask.shape, dtype=torch.float32, device=loss_mask.device)
    out[torch.arange(loss_mask.shape[0], device=loss_mask.device), last] = rewards.float()
    return out


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read. ``rewards``: ``[B]`` outcome rewards; ``loss_mask``:
    ``[B, T]``; ``values``: ``[B, T]`` critic values (critic estimators); ``group_ids``: ``[B]``
    prompt of each trajectory; ``static_values``: ``[B]`` PVPO's reference baseline per row."""

    rewards: torch.Tensor
    loss_mask: torch.Tensor
    values: Optional[torch.Tensor] = None
    group_ids: Optional[torch.Tensor] = None
    static_values: Optional[torch.Tensor] = None

    def need(self, name: str, estimator: str) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"advantage estimator {estimator!r} needs {name}")
        return value


Estimate = tuple[torch.Tensor, Optional[torch.Tensor]]  # ([B, T] advantages, [B, T] returns or None)


@dataclass(frozen=True)
class AdvantageEstimatorSpec:
    """A registered estimator: ``critic`` ones need a value model (and give returns to fit it)."""

    name: str
    critic: bool
    estimate: Callable[[AdvantageInputs, float, float, bool], Estimate]  # (inputs, gamma, lam, normalize_std)
    reference: str = ""


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimatorSpec] = {}


def register_advantage_estimator(spec: AdvantageEstimatorSpec) -> AdvantageEstimatorSpec:
    """Add an estimator to the registry (names are unique)."""
    if spec.name in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage estimator {spec.name!r} is already registered")
    ADVANTAGE_ESTIMATORS[spec.name] = spec
    return spec


def _gae(x: AdvantageInputs, gamma: float, lam: float, normalize_std: bool) -> Estimate:
    return compute_gae(terminal_token_rewards(x.rewards, x.loss_mask), x.need("values", "gae"), x.loss_mask, gamma, lam)


def _grpo(x: AdvantageInputs, gamma: float, lam: float, normalize_std: bool) -> Estimate:
    per_row = compute_grpo_advantages(x.rewards, x.need("group_ids", "grpo"), normalize_std)
    return broadcast_to_tokens(per_row, x.loss_mask), None


def _pvpo(x: AdvantageInputs, gamma: float, lam: float, normalize_std: bool) -> Estimate:
    per_row = compute_pvpo_advantages(x.rewards, x.need("static_values", "pvpo"))
    return broadcast_to_tokens(per_row, x.loss_mask), None


for _spec in (
    AdvantageEstimatorSpec("gae", True, _gae, "GAE over policy tokens, outcome reward on the last one (SORL A.4)"),
    AdvantageEstimatorSpec("grpo", False, _grpo, "GRPO group normalization (SORL eq. 13; Dr. GRPO without std)"),
    AdvantageEstimatorSpec("pvpo", False, _pvpo, "PVPO static value baseline (PVPO eq. 10)"),
):
    register_advantage_estimator(_spec)


def compute_advantages(
    name: str,
    inputs: AdvantageInputs,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    normalize_std: bool = True,
    whiten: bool = False,
) -> Estimate:
    """Per-token advantages (and returns for critic estimators) of the registered ``name``."""
    spec = ADVANTAGE_ESTIMATORS.get(name)
    if spec is None:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGE_ESTIMATORS)}")
    advantages, returns = spec.estimate(inputs, gamma, lam, normalize_std)
    if whiten:
        advantages = whiten_advantages(advantages, inputs.loss_mask)
    return advantages, returns
