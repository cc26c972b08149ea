"""The policy loss's metric stage (``policy_loss.py``): detached means over one call's policy
tokens, plus the additive sums an engine adds over micro-batches."""

from __future__ import annotations

import torch

from .aggregation import count64, host_reads_free, masked_max, masked_min, sum64
from .clip_bias import ClipBiasTerms
from .config import PolicyLossConfig
from .diagnostics import turn_ratio_spread, turn_ratio_spread_of
from .loss_registry import PolicyLossSpec
from .loss_state import LossInputs, Ratios
from .mismatch import clip_counts
from .surrogate import SurrogateTerms, ppo_clipped_surrogate


@torch.no_grad()
def loss_metrics(
    inputs: LossInputs,
    config: PolicyLossConfig,
    spec: PolicyLossSpec,
    ratios: Ratios,
    terms: SurrogateTerms,
    pg_loss: torch.Tensor,
    bias: ClipBiasTerms | None,
    is_metrics: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The detached metrics of one call: means over its policy tokens, plus additive sums
    (``clip_bias/scalar``, ``sq_sum``, the turn counts) an engine adds over micro-batches."""
    tokens = count64(inputs.mask)
    clipped = tuple(count64(t) for t in (terms.clip_high, terms.clip_low, terms.dual))  # the surrogate's B^c
    metrics = _ratio_and_clip_metrics(inputs, config, ratios, clipped, pg_loss, tokens)
    if bias is not None:
        metrics["clip_bias/scalar"] = bias.scalar
        metrics["clip_bias/sq_sum"] = bias.sq_sum
    if ratios.turns is not None:
        metrics.update(_turn_spread_metrics(config, spec, ratios))
    if spec.ratio_level != "token":
        metrics.update(_level_ratio_metrics(inputs, config, spec, ratios, tokens))
    metrics.update(is_metrics)
    metrics.update(_clip_count_metrics(inputs, config, spec, ratios, clipped, tokens))
    return metrics


def _ratio_and_clip_metrics(
    inputs: LossInputs,
    config: PolicyLossConfig,
    ratios: Ratios,
    clipped: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pg_loss: torch.Tensor,
    tokens: torch.Tensor,
) -> dict[str, torch.Tensor]:
    clamp = config.log_ratio_clamp
    count = tokens.clamp(min=1)
    n_high, n_low, n_dual = clipped
    lr_sum = sum64(ratios.clamped_log_ratio)
    ratio_sum = _sum_off_ones(ratios.token_ratio, tokens)  # sum of r over the mask (r = 1 off it)
    lo, hi = _masked_extremes(ratios.token_log_ratio.detach(), inputs.mask)
    return {
        "pg_loss": pg_loss.detach(),
        # B^c's three parts are disjoint: A > 0 (high) and A < 0 with r < 1 - eps or r > c > 1
        "clip_frac": ((n_high + n_low + n_dual) / count).float(),
        "clip_frac_high": (n_high / count).float(),
        "clip_frac_low": (n_low / count).float(),
        "dual_clip_frac": (n_dual / count).float(),
        # KL(pi_old || pi_theta) estimated on tokens sampled from pi_old (k1, k3 of Schulman)
        "approx_kl_k1": (-lr_sum / count).float(),
        "approx_kl_k3": ((ratio_sum - tokens - lr_sum) / count).float(),
        "ratio/mean": (ratio_sum / count).float(),
        "ratio/min": _ratio_of(lo, clamp, tokens),
        "ratio/max": _ratio_of(hi, clamp, tokens),
        "abs_log_ratio/max": torch.maximum(lo.abs(), hi.abs()),
        "policy_tokens": tokens.float(),
    }


def _turn_spread_metrics(config: PolicyLossConfig, spec: PolicyLossSpec, ratios: Ratios) -> dict[str, torch.Tensor]:
    turns = ratios.turns
    if spec.ratio_level == "turn" and not spec.token_gradient:
        # the loss's own turn ratios, read at each turn's first token (their clamped value)
        spread, multi_turn_rows = turn_ratio_spread_of(turns.per_segment(ratios.ratio.detach()), turns)
    else:
        spread, multi_turn_rows = turn_ratio_spread(ratios.token_log_ratio, turns, config.log_ratio_clamp)
    return {
        "turn_ratio/spread_sum": spread,  # sums: an engine adds them over micro-batches
        "turn_ratio/multi_turn_rows": multi_turn_rows,
        "turn_ratio/spread": spread / multi_turn_rows.clamp(min=1),
    }


def _level_ratio_metrics(
    inputs: LossInputs, config: PolicyLossConfig, spec: PolicyLossSpec, ratios: Ratios, tokens: torch.Tensor
) -> dict[str, torch.Tensor]:
    prefix = "turn_ratio" if spec.ratio_level == "turn" else "seq_ratio"
    clamp = config.log_ratio_clamp
    if spec.token_gradient:  # GSPO-token's log-ratio carries each token's own gradient: read per token
        level_lo, level_hi = _masked_extremes(ratios.level_log_ratio.detach(), inputs.mask)
        ratio_sum = _sum_off_ones(ratios.ratio.detach(), tokens)
    else:  # constant over each unit: one value per unit, weighted by its length
        segments = ratios.segments
        unit_lr = segments.per_segment(ratios.level_log_ratio.detach())
        ratio_sum = (segments.per_segment(ratios.ratio.detach()).double() * segments.segment_length.double()).sum()
        level_lo, level_hi = torch.aminmax(unit_lr) if unit_lr.numel() else (unit_lr.new_zeros(()),) * 2
    return {
        f"{prefix}/mean": (ratio_sum / tokens.clamp(min=1)).float(),
        f"{prefix}/min": _ratio_of(level_lo, clamp, tokens),
        f"{prefix}/max": _ratio_of(level_hi, clamp, tokens),
    }


def _clip_count_metrics(
    inputs: LossInputs, config: PolicyLossConfig, spec: PolicyLossSpec, ratios: Ratios,
    clipped: tuple[torch.Tensor, torch.Tensor, torch.Tensor], tokens: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Leading indicators: tokens clipped by their own ratio, turns by their turn ratio (SORL eq. 4).
    A turn-level loss's own turn log-ratios (the same float32 sums) are read, not summed again; a
    token-level loss with PPO's clipped surrogate and no turns counts its own indicators (its
    ratio is the token ratio: ``clip_high | clip_low`` is the token clip)."""
    if spec.ratio_level == "token" and spec.surrogate is ppo_clipped_surrogate and ratios.turns is None:
        n_high, n_low, _ = clipped
        return {"clip_frac/token": ((n_high + n_low) / tokens.clamp(min=1)).float()}
    own = None
    if (spec.ratio_level == "turn" and not spec.token_gradient and ratios.turns is not None
            and ratios.token_log_ratio.dtype == torch.float32):
        own = ratios.turns.per_segment(ratios.level_log_ratio)
    counts = clip_counts(ratios.token_log_ratio, inputs.advantages, inputs.mask, config.clip_low, config.clip_high,
                         ratios.turns, config.log_ratio_clamp, turn_log_ratio=own)
    metrics = {"clip_frac/token": (counts["tokens_clipped"] / tokens.clamp(min=1)).float()}
    if ratios.turns is not None:  # sums: an engine adds them over micro-batches (clip_frac/turn)
        metrics["clip/turns_clipped"] = counts["turns_clipped"]
        metrics["clip/turns"] = counts["turns"]
    return metrics


def _sum_off_ones(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Sum over the mask of a tensor that is exactly 1 off the mask (a ratio), in float64."""
    return sum64(values) - (values.numel() - tokens)


def _masked_extremes(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` over the mask of a tensor that is exactly 0 off it; ``(0, 0)`` without
    policy tokens. Both ways give the same numbers (min and max are exact)."""
    if values.numel() == 0:  # a shape, not a value
        return values.new_zeros(()), values.new_zeros(())
    if host_reads_free(values):
        return _extremes_branching(values, mask)
    return _extremes_on_device(values, mask)


def _extremes_branching(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``aminmax`` over the whole tensor, and a masked pass only when an extreme is the 0
    that may come from off the mask."""
    lo, hi = torch.aminmax(values)
    tokens = int(torch.count_nonzero(mask))
    if tokens == 0:
        return torch.zeros_like(lo), torch.zeros_like(hi)
    if tokens < values.numel():
        if not bool(hi > 0):
            hi = masked_max(values, mask)
        if not bool(lo < 0):
            lo = masked_min(values, mask)
    return lo, hi


def _extremes_on_device(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """No host read: off the mask each entry takes the value of the first policy token, so one
    ``aminmax`` sees the masked values only (without policy tokens the first entry, off the mask,
    holds the 0 it gives)."""
    flat = values.reshape(-1)
    at = mask.reshape(-1).to(torch.uint8).argmax().view(1)  # the first policy token (argmax: the first max)
    first = flat.index_select(0, at).view(())  # a tensor index: ``flat[at]`` would read ``at`` on the host
    return torch.aminmax(torch.where(mask, values, first))


def _ratio_of(log_ratio: torch.Tensor, clamp: float, tokens: torch.Tensor) -> torch.Tensor:
    """``exp(clamp(log r))`` of an extreme log-ratio (exp and clamp are monotone); 0 without tokens."""
    return torch.where(tokens > 0, torch.exp(log_ratio.clamp(-clamp, clamp)), torch.zeros((), dtype=log_ratio.dtype,
                                                                                           device=log_ratio.device))
