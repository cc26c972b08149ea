"""Policy losses: one registry, one entry point.

``compute_policy_loss(logprobs, old_logprobs, advantages, loss_mask, config)`` returns
``(loss, metrics)``. Each registered loss is a :class:`PolicyLossSpec`: the level of the
importance ratio, whether clipping-triggered normalization applies, and whether SAPO's
conditional KL is added. Every option composes with every loss: asymmetric / dual clip,
aggregation mode, KL to a reference policy, entropy bonus, MiniRL's IS correction.

The clipped surrogate (PPO; SORL eq. 1, 3; GRPO eq. 13; GSPO) per token, with ``w`` the
loss ratio and ``A`` the advantage::

    l_t = max(-A w, -A clip(w, 1 - eps_low, 1 + eps_high))        (then, if A < 0 and dual
    l_t = min(l_t, -A c)                                            clip c is set)
    loss = sum_t g_t * w_IS,t * l_t                                 (g: aggregation weights)

Signs: losses are minimized, so ``loss = -J`` of the papers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from . import dispatch
from .aggregation import (
    aggregate,
    aggregation_denominator,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
    token_weights,
)
from .clip_bias import ClipBiasTerms, clip_bias_norm, clip_bias_terms, normalization_factor, param_grad_clip_bias_norm
from .config import PolicyLossConfig, SAPOConfig
from .diagnostics import turn_ratio_spread
from .is_correction import is_correction_weights
from .kl import kl_penalty
from .loss_registry import POLICY_LOSSES, PolicyLossSpec
from .ratios import level_log_ratio, masked_log_ratio, segments_for_level
from .turns import segment_turns


def compute_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
    denominator: float | torch.Tensor | LossDenominators | None = None,
    normalize: bool = True,
    params: Iterable[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Compute a registered policy loss and its metrics.

    Args:
        logprobs: ``[B, T]`` log pi_theta of the sampled tokens (with gradient).
        old_logprobs: ``[B, T]`` log pi_old (the trainer's old-policy pass).
        advantages: ``[B, T]`` per-token advantages, or ``[B]`` per-sequence (broadcast).
        loss_mask: ``[B, T]``, 1 on policy tokens.
        config: the loss configuration (``config.name`` picks the registered loss).
        rollout_logprobs: ``[B, T]`` log mu from the rollout engine, for the IS correction.
        ref_logprobs: ``[B, T]`` reference-policy log-probs, needed when ``kl_coef > 0``.
        entropy: ``[B, T]`` per-token entropy, needed when ``entropy_coef > 0``.
        turn_ids: optional explicit ``[B, T]`` turn ids (else turns = runs of the mask).
        denominator: the whole mini-batch's counts: :func:`loss_denominators` (or just the
            aggregation count, see ``aggregation``); ``None`` uses this call's own counts.
        normalize: apply the clipping-triggered factor here (True) or leave it to the caller
            (False: an engine applies it to the mini-batch's accumulated gradient).
        params: parameters for the ``param_grad`` clip-bias mode when ``normalize`` is True.

    Returns:
        ``(loss, metrics)``; metrics are detached scalars (means over this call's policy
        tokens; ``clip_bias/scalar`` and ``clip_bias/sq_sum`` are sums, additive over
        micro-batches, see ``clip_bias.py``).
    """
    terms = _policy_terms(
        logprobs, old_logprobs, advantages, loss_mask, config,
        rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, entropy=entropy,
        turn_ids=turn_ids, denominator=denominator,
    )
    loss, metrics = terms.loss, terms.metrics
    factor = torch.ones((), device=logprobs.device)
    if terms.spec.clip_normalized:
        mode = config.clip_bias.mode
        norm = None
        if mode != "param_grad":
            norm = clip_bias_norm(terms.bias.scalar, terms.bias.sq_sum, mode)
        elif normalize:
            if params is None:
                raise ValueError(
                    "loss.clip_bias.mode='param_grad' needs params here (or normalize=False and an engine)"
                )
            norm = param_grad_clip_bias_norm(terms.bias.surrogate, params)
        if normalize:
            if config.clip_bias.form != "absolute":
                raise ValueError("loss.clip_bias.form='relative' keeps a running mean across mini-batches: "
                                 "use an engine (normalize=False) or form='absolute'")
            factor = normalization_factor(norm.to(logprobs.device), config.clip_bias.delta)
            loss = loss * factor
        if norm is not None:
            metrics["clip_bias/norm"] = norm.detach()
    metrics["loss"] = loss.detach()
    if normalize:  # otherwise the engine takes both for the whole mini-batch (mini_batch_normalization)
        metrics["clip_bias/logprob_norm"] = terms.bias.sq_sum.sqrt()
        metrics["clip_bias/factor"] = factor.detach()
    return loss, metrics


def clip_bias_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: PolicyLossConfig,
    **kwargs,
) -> torch.Tensor:
    """The clip-bias surrogate ``S`` whose parameter gradient is ``C`` (``param_grad`` mode).

    Accepts the keyword arguments of :func:`compute_policy_loss` (but ``normalize`` and
    ``params``). An engine backpropagates it over the same micro-batches as the loss, with
    the same mini-batch ``denominator``, and reduces the squared gradient norm like the
    gradient norm.
    """
    return _policy_terms(logprobs, old_logprobs, advantages, loss_mask, config, **kwargs).bias.surrogate


@dataclass(frozen=True)
class LossDenominators:
    """The counts a loss divides by, taken once over a whole mini-batch.

    An engine computes them from the mini-batch (:func:`loss_denominators`) and passes them to
    every micro-batch's call, so the micro-batch losses add up to the mini-batch loss.

    Attributes:
        aggregation: ``aggregation_denominator`` of ``loss_agg`` (tokens or non-empty rows).
        sapo: policy tokens of the rows SAPO's listing variant averages its penalty over
            (``None`` unless the loss is ``sapo`` with ``sapo.variant: listing``).
    """

    aggregation: torch.Tensor
    sapo: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> "LossDenominators":
        return LossDenominators(self.aggregation.to(device), None if self.sapo is None else self.sapo.to(device))


def loss_denominators(loss_mask: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig) -> LossDenominators:
    """The mini-batch counts of ``config``'s loss for the rows of ``loss_mask`` / ``advantages``."""
    sapo = None
    if POLICY_LOSSES[config.name].sapo_penalty and config.sapo.variant == "listing":
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1).expand(loss_mask.shape)
        sapo = _sapo_listing_tokens(advantages, loss_mask.bool(), config.sapo).sum().to(torch.float32)
    return LossDenominators(aggregation_denominator(loss_mask, config.loss_agg), sapo)


def _sapo_listing_tokens(advantages: torch.Tensor, mask: torch.Tensor, sapo: SAPOConfig) -> torch.Tensor:
    """Policy tokens of the rows SAPO's listing keeps: ``advantages[:, 0] >= 0``, read as the
    advantage at each row's first policy token (verl's response tensors start there)."""
    first = mask.float().argmax(dim=-1, keepdim=True)  # the first policy token (argmax returns the first max)
    row_adv = advantages.float().gather(1, first)
    keep = row_adv >= 0 if sapo.nonnegative else row_adv > 0
    return mask & keep


@dataclass
class _PolicyTerms:
    spec: PolicyLossSpec
    loss: torch.Tensor  # before clipping-triggered normalization
    bias: ClipBiasTerms
    metrics: dict[str, torch.Tensor]


def _policy_terms(
    logprobs, old_logprobs, advantages, loss_mask, config: PolicyLossConfig, *,
    rollout_logprobs=None, ref_logprobs=None, entropy=None, turn_ids=None, denominator=None,
) -> _PolicyTerms:
    spec = POLICY_LOSSES.get(config.name)
    if spec is None:
        raise ValueError(f"loss.name: unknown policy loss {config.name!r}; registered: {sorted(POLICY_LOSSES)}")
    advantages = _check_inputs(
        logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, ref_logprobs, entropy, turn_ids
    )
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("loss.kl_coef > 0 needs ref_logprobs")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("loss.entropy_coef > 0 needs entropy")
    if config.is_correction.mode != "off" and rollout_logprobs is None:
        raise ValueError(f"loss.is_correction.mode={config.is_correction.mode!r} needs rollout_logprobs")

    sapo_denominator = None
    if isinstance(denominator, LossDenominators):
        denominator, sapo_denominator = denominator.aggregation, denominator.sapo
    mask = loss_mask.bool()
    clamp = config.log_ratio_clamp
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    advantages = torch.where(mask, advantages.float(), zero).detach()
    weights = token_weights(mask, config.loss_agg, denominator, config.norm_length)

    turns = segment_turns(mask, turn_ids)  # the turn ratios' spread is reported for every loss
    level_segments = segments_for_level(spec.ratio_level, mask, turns)

    token_lr_raw = masked_log_ratio(logprobs, old_logprobs, mask)
    token_lr = token_lr_raw.clamp(-clamp, clamp)
    token_ratio = torch.exp(token_lr)
    level_lr_raw = level_log_ratio(token_lr_raw, spec.ratio_level, level_segments, clamp=None)
    if spec.token_gradient:  # GSPO-token: the value of s_i, the gradient of token t alone (times s_i)
        level_lr_raw = level_lr_raw.detach() + token_lr_raw - token_lr_raw.detach()
    ratio = torch.exp(level_lr_raw.clamp(-clamp, clamp))

    # Clipped surrogate and the indicators of B^c; dispatched (fused Triton kernel on CUDA).
    per_token, clip_high, clip_low, dual = dispatch.clipped_surrogate(
        ratio, advantages, mask, config.clip_low, config.clip_high, config.dual_clip
    )
    clipped = clip_high | clip_low | dual

    is_corr = is_correction_weights(
        old_logprobs,
        rollout_logprobs if rollout_logprobs is not None else old_logprobs,
        mask,
        config.is_correction,
        turns,
        clamp,
    )
    pg_loss = aggregate(per_token * is_corr.weights, weights)
    loss = pg_loss

    # Clip bias (SORL eq. 7/8/14): indicators from the loss ratio, or token ratios on request.
    indicator = clipped
    if config.clip_bias.indicator == "token_ratio" and spec.ratio_level != "token":
        indicator = (
            ((advantages > 0) & (token_ratio > config.clip_high)) | ((advantages < 0) & (token_ratio < config.clip_low))
        ) & mask
    # d ratio_t / d log pi_j: spread over the unit (turn / sequence ratios) or token t's own (GSPO-token)
    grad_segments = None if spec.token_gradient else level_segments
    bias = clip_bias_terms(
        ratio, level_lr_raw, clamp, indicator, advantages, is_corr.weights, weights, grad_segments, mask
    )

    metrics: dict[str, torch.Tensor] = {}
    if spec.sapo_penalty:
        # -log r_t on active tokens; its gradient pushes r_t back up towards tau.
        sapo = config.sapo
        if sapo.variant == "listing":
            # appendix A.6: masked_mean(log(r).masked_fill(r > tau, 0)[A[:, 0] >= 0], mask[A[:, 0] >= 0])
            rows = _sapo_listing_tokens(advantages, mask, sapo)
            active = (rows & (token_ratio <= sapo.tau)).detach()
            count = rows.sum() if sapo_denominator is None else sapo_denominator
            count = torch.as_tensor(count, dtype=torch.float32, device=logprobs.device).clamp(min=1.0)
            sapo_term = masked_sum(-token_lr, active) / count
        else:  # eq. 11, inside eq. 9's aggregation
            positive = advantages >= 0 if sapo.nonnegative else advantages > 0
            active = (positive & (token_ratio < sapo.tau) & mask).detach()
            sapo_term = aggregate(torch.where(active, -token_lr, zero), weights)
        loss = loss + sapo.gamma * sapo_term
        metrics["sapo/penalty"] = sapo_term.detach()
        metrics["sapo/penalty_frac"] = masked_mean(active.float(), mask)
    if config.kl_coef > 0:
        kl = aggregate(kl_penalty(logprobs, ref_logprobs, config.kl_estimator, clamp), weights)
        loss = loss + config.kl_coef * kl
        metrics["kl_ref"] = kl.detach()
    if config.entropy_coef > 0:
        ent = aggregate(entropy.float(), weights)
        loss = loss - config.entropy_coef * ent
        metrics["entropy"] = ent.detach()
    if entropy is not None:  # a diagnostic for every loss: the token mean, whatever the aggregation
        metrics["entropy/mean"] = masked_mean(entropy.detach().float(), mask)

    with torch.no_grad():
        metrics.update(
            {
                "pg_loss": pg_loss.detach(),
                "clip_frac": masked_mean(clipped.float(), mask),
                "clip_frac_high": masked_mean(clip_high.float(), mask),
                "clip_frac_low": masked_mean(clip_low.float(), mask),
                "dual_clip_frac": masked_mean(dual.float(), mask),
                # KL(pi_old || pi_theta) estimated on tokens sampled from pi_old (k1, k3 of Schulman)
                "approx_kl_k1": masked_mean(-token_lr, mask),
                "approx_kl_k3": masked_mean(token_ratio - 1.0 - token_lr, mask),
                "ratio/mean": masked_mean(token_ratio, mask),
                "ratio/min": masked_min(token_ratio, mask),
                "ratio/max": masked_max(token_ratio, mask),
                "abs_log_ratio/max": masked_max(token_lr_raw.abs(), mask),
                "clip_bias/scalar": bias.scalar,
                "clip_bias/sq_sum": bias.sq_sum,
                "policy_tokens": mask.float().sum(),
            }
        )
        spread, multi_turn_rows = turn_ratio_spread(token_lr_raw, turns, clamp)
        metrics["turn_ratio/spread_sum"] = spread  # sums: an engine adds them over micro-batches
        metrics["turn_ratio/multi_turn_rows"] = multi_turn_rows
        metrics["turn_ratio/spread"] = spread / multi_turn_rows.clamp(min=1)
        if spec.ratio_level != "token":
            prefix = "turn_ratio" if spec.ratio_level == "turn" else "seq_ratio"
            metrics[f"{prefix}/mean"] = masked_mean(ratio, mask)
            metrics[f"{prefix}/min"] = masked_min(ratio, mask)
            metrics[f"{prefix}/max"] = masked_max(ratio, mask)
        metrics.update(is_corr.metrics)
    return _PolicyTerms(spec=spec, loss=loss, bias=bias, metrics=metrics)


def _check_inputs(
    logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, ref_logprobs, entropy, turn_ids
) -> torch.Tensor:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [batch, seq], got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    named = {"old_logprobs": old_logprobs, "loss_mask": loss_mask, "rollout_logprobs": rollout_logprobs,
             "ref_logprobs": ref_logprobs, "entropy": entropy, "turn_ids": turn_ids}
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != logprobs shape {tuple(shape)}")
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        advantages = advantages.unsqueeze(1).expand(shape)
    if advantages.shape != shape:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} must be {tuple(shape)} or ({shape[0]},)")
    return advantages
