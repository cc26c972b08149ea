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
    token_scale,
)
from .clip_bias import ClipBiasTerms, clip_bias_norm, clip_bias_terms, normalization_factor, param_grad_clip_bias_norm
from .config import PolicyLossConfig, SAPOConfig
from .diagnostics import turn_ratio_spread, turn_ratio_spread_of
from .is_correction import is_correction_weights
from .kl import kl_penalty
from .loss_registry import PolicyLossSpec
from .mismatch import clip_counts
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
        surrogate=normalize and config.clip_bias.mode == "param_grad" and config.spec.clip_normalized,
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
        if terms.bias is not None:
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
    return _policy_terms(logprobs, old_logprobs, advantages, loss_mask, config, surrogate=True, **kwargs).bias.surrogate


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
    if config.spec.sapo_penalty and config.sapo.variant == "listing":
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
    bias: ClipBiasTerms | None  # None when neither the loss nor the diagnostics need it
    metrics: dict[str, torch.Tensor]


def _policy_terms(
    logprobs, old_logprobs, advantages, loss_mask, config: PolicyLossConfig, *,
    rollout_logprobs=None, ref_logprobs=None, entropy=None, turn_ids=None, denominator=None, surrogate=False,
) -> _PolicyTerms:
    """The loss and its metrics, computing only what the configuration needs (the lean path).

    Every ``[B, T]`` intermediate that is exactly 0 (log-ratios) or 1 (ratios) off the mask is
    reduced over the whole tensor, so the metrics are whole-tensor sums and one ``aminmax``
    rather than a masked pass each; the aggregation weights are folded into the advantages
    (``a_t = g_t A_t``, ``g_t > 0`` on policy tokens), so the surrogate's sum is the loss.
    """
    spec = config.spec
    advantages = _check_inputs(
        logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, ref_logprobs, entropy, turn_ids
    )
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("loss.kl_coef > 0 needs ref_logprobs")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("loss.entropy_coef > 0 needs entropy")
    is_cfg = config.is_correction
    if is_cfg.mode != "off" and rollout_logprobs is None:
        raise ValueError(f"loss.is_correction.mode={is_cfg.mode!r} needs rollout_logprobs")

    sapo_denominator = None
    if isinstance(denominator, LossDenominators):
        denominator, sapo_denominator = denominator.aggregation, denominator.sapo
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask.bool()
    clamp = config.log_ratio_clamp
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    advantages = torch.where(mask, advantages.float(), zero).detach()
    scale = token_scale(mask, config.loss_agg, denominator, config.norm_length)
    weighted_adv = advantages * scale  # a_t = g_t A_t: 0 off the mask
    weights = None  # g_t itself, for the optional terms below
    if spec.sapo_penalty or config.kl_coef > 0 or config.entropy_coef > 0:
        weights = mask.to(torch.float32) * scale
    diagnostics = config.diagnostics

    # Turn segments: for turn ratios, turn-level IS weights, or the spread diagnostic.
    # (with turn ids, always: the turn clip fraction is logged for every loss)
    need_turns = (spec.ratio_level == "turn" or (is_cfg.mode != "off" and is_cfg.level == "turn") or diagnostics
                  or turn_ids is not None)
    turns = segment_turns(mask, turn_ids) if need_turns else None
    level_segments = segments_for_level(spec.ratio_level, mask, turns)

    token_lr_raw = masked_log_ratio(logprobs, old_logprobs, mask)  # 0 off the mask
    token_lr = token_lr_raw.clamp(-clamp, clamp)
    token_ratio = torch.exp(token_lr)  # 1 off the mask
    if spec.ratio_level == "token":
        level_lr_raw, ratio = token_lr_raw, token_ratio
    else:
        level_lr_raw = level_log_ratio(token_lr_raw, spec.ratio_level, level_segments, clamp=None)
        if spec.token_gradient:  # GSPO-token: the value of s_i, the gradient of token t alone (times s_i)
            level_lr_raw = level_lr_raw.detach() + token_lr_raw - token_lr_raw.detach()
        ratio = torch.exp(level_lr_raw.clamp(-clamp, clamp))

    # Clipped surrogate and the indicators of B^c; dispatched (fused Triton kernel on CUDA). With
    # a_t = g_t A_t in place of A_t the per-token terms come out weighted and the indicators the same.
    per_token, clip_high, clip_low, dual = dispatch.clipped_surrogate(
        ratio, weighted_adv, mask, config.clip_low, config.clip_high, config.dual_clip
    )

    is_weights, is_metrics = None, {}
    if is_cfg.mode != "off" or rollout_logprobs is not None:  # without mu there is no mismatch to report
        is_corr = is_correction_weights(old_logprobs, rollout_logprobs, mask, is_cfg, turns, clamp)
        is_metrics = is_corr.metrics
        if is_cfg.mode != "off":
            is_weights = is_corr.weights
    pg_loss = (per_token if is_weights is None else per_token * is_weights).sum()
    loss = pg_loss

    # Clip bias (SORL eq. 7/8/14), for every loss: ||C|| (clip_bias/sq_sum) is a logged leading indicator,
    # and an engine measuring ||C|| in parameter space reads it (0 means C = 0, no backward).
    # Indicators from the loss ratio, or token ratios on request.
    clipped = clip_high | clip_low | dual
    indicator = clipped
    if config.clip_bias.indicator == "token_ratio" and spec.ratio_level != "token":
        indicator = (
            ((advantages > 0) & (token_ratio > config.clip_high))
            | ((advantages < 0) & (token_ratio < config.clip_low))
        ) & mask
    # d ratio_t / d log pi_j: spread over the unit (turn / sequence ratios) or token t's own (GSPO-token)
    grad_segments = None if spec.token_gradient else level_segments
    bias_adv = weighted_adv if is_weights is None else weighted_adv * is_weights
    bias = clip_bias_terms(ratio, level_lr_raw, clamp, indicator, bias_adv, grad_segments, surrogate=surrogate)

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
        tokens = mask.sum(dtype=torch.float64)
        count = tokens.clamp(min=1)
        n_high, n_low, n_dual = (t.sum(dtype=torch.float64) for t in (clip_high, clip_low, dual))
        lr_sum = token_lr.sum(dtype=torch.float64)
        ratio_sum = _sum_off_ones(token_ratio, tokens)  # sum of r over the mask (r = 1 off it)
        lo, hi = _masked_extremes(token_lr_raw.detach(), mask, tokens)
        metrics.update(
            {
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
        )
        if bias is not None:
            metrics["clip_bias/scalar"] = bias.scalar
            metrics["clip_bias/sq_sum"] = bias.sq_sum
        if turns is not None:
            if spec.ratio_level == "turn" and not spec.token_gradient:
                # the loss's own turn ratios, read at each turn's first token (their clamped value)
                spread, multi_turn_rows = turn_ratio_spread_of(turns.per_segment(ratio.detach()), turns)
            else:
                spread, multi_turn_rows = turn_ratio_spread(token_lr_raw, turns, clamp)
            metrics["turn_ratio/spread_sum"] = spread  # sums: an engine adds them over micro-batches
            metrics["turn_ratio/multi_turn_rows"] = multi_turn_rows
            metrics["turn_ratio/spread"] = spread / multi_turn_rows.clamp(min=1)
        if spec.ratio_level != "token":
            prefix = "turn_ratio" if spec.ratio_level == "turn" else "seq_ratio"
            level_lo, level_hi = _masked_extremes(level_lr_raw.detach(), mask, tokens)
            metrics[f"{prefix}/mean"] = (_sum_off_ones(ratio.detach(), tokens) / count).float()
            metrics[f"{prefix}/min"] = _ratio_of(level_lo, clamp, tokens)
            metrics[f"{prefix}/max"] = _ratio_of(level_hi, clamp, tokens)
        metrics.update(is_metrics)
        # leading indicators: tokens clipped by their own ratio, turns by their turn ratio (SORL eq. 4)
        counts = clip_counts(token_lr_raw, advantages, mask, config.clip_low, config.clip_high, turns, clamp)
        metrics["clip_frac/token"] = (counts["tokens_clipped"] / count).float()
        if turns is not None:  # sums: an engine adds them over micro-batches (clip_frac/turn)
            metrics["clip/turns_clipped"] = counts["turns_clipped"]
            metrics["clip/turns"] = counts["turns"]
    return _PolicyTerms(spec=spec, loss=loss, bias=bias, metrics=metrics)


def _sum_off_ones(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Sum over the mask of a tensor that is exactly 1 off the mask (a ratio), in float64."""
    return values.sum(dtype=torch.float64) - (values.numel() - tokens)


def _masked_extremes(
    values: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` over the mask of a tensor that is exactly 0 off it: one ``aminmax`` over
    the whole tensor, and a masked pass only when an extreme is that 0 (it may be off the mask);
    ``(0, 0)`` without policy tokens."""
    if not bool(tokens > 0):
        z = torch.zeros((), dtype=values.dtype, device=values.device)
        return z, z
    lo, hi = torch.aminmax(values)
    if bool(tokens < values.numel()):
        if not bool(hi > 0):
            hi = masked_max(values, mask)
        if not bool(lo < 0):
            lo = masked_min(values, mask)
    return lo, hi


def _ratio_of(log_ratio: torch.Tensor, clamp: float, tokens: torch.Tensor) -> torch.Tensor:
    """``exp(clamp(log r))`` of an extreme log-ratio (exp and clamp are monotone); 0 without tokens."""
    return torch.where(tokens > 0, torch.exp(log_ratio.clamp(-clamp, clamp)), torch.zeros((), dtype=log_ratio.dtype,
                                                                                           device=log_ratio.device))


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
