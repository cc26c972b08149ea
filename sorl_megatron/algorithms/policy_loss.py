"""Policy losses: one registry, one entry point.

``compute_policy_loss(logprobs, old_logprobs, advantages, loss_mask, config)`` returns
``(loss, metrics)``. Each registered loss is a :class:`PolicyLossSpec`: its surrogate (the
per-token objective, ``surrogate.py``), the level of the importance ratio, whether
clipping-triggered normalization applies, and whether SAPO's conditional KL is added. Every
option composes with every loss: asymmetric / dual clip, aggregation mode, KL to a reference
policy, entropy bonus, MiniRL's IS correction.

A loss is computed in stages, each a typed function below: the inputs, the aggregation
weights ``g_t``, the ratio, the surrogate, the corrections (IS weights, clip bias and its
normalization), the penalties (SAPO, KL, entropy) and the metrics. With PPO's clipped
surrogate (SORL eq. 1, 3; GRPO eq. 13; GSPO), per token, ``w`` the loss ratio and ``A`` the
advantage::

    l_t = max(-A w, -A clip(w, 1 - eps_low, 1 + eps_high))        (then, if A < 0 and dual
    l_t = min(l_t, -A c)                                            clip c is set)
    loss = sum_t g_t * w_IS,t * l_t                                 (g: aggregation weights)

Signs: losses are minimized, so ``loss = -J`` of the papers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from .aggregation import (
    aggregate,
    aggregation_denominator,
    masked_mean,
    masked_sum,
    token_scale,
)
from .clip_bias import ClipBiasTerms, clip_bias_norm, clip_bias_terms, normalization_factor, param_grad_clip_bias_norm
from .config import PolicyLossConfig, SAPOConfig
from .is_correction import is_correction_weights
from .kl import kl_penalty
from .loss_metrics import loss_metrics
from .loss_registry import PolicyLossSpec
from .loss_state import LossInputs, Ratios
from .ratios import level_log_ratio, masked_log_ratio, segments_for_level, unit_ratio
from .surrogate import SurrogateInputs, SurrogateTerms
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
        bias_surrogate=normalize and config.clip_bias.mode == "param_grad" and config.spec.clip_normalized,
    )
    loss, metrics = terms.loss, terms.metrics
    factor = torch.ones((), device=logprobs.device)
    if terms.spec.clip_normalized:
        norm = _clip_bias_norm(terms.bias, config, normalize, params)
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
    terms = _policy_terms(logprobs, old_logprobs, advantages, loss_mask, config, bias_surrogate=True, **kwargs)
    return terms.bias.surrogate


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


@dataclass(frozen=True)
class _PolicyTerms:
    spec: PolicyLossSpec
    loss: torch.Tensor  # before clipping-triggered normalization
    bias: ClipBiasTerms | None  # None when neither the loss nor the diagnostics need it
    metrics: dict[str, torch.Tensor]


def _policy_terms(
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
    bias_surrogate: bool = False,
) -> _PolicyTerms:
    """The loss and its metrics, computing only what the configuration needs (the lean path).

    Stages, each a function below: inputs -> aggregation weights -> ratio -> surrogate (the
    registered loss's own) -> corrections (IS weights) -> aggregation -> corrections (clip
    bias) -> penalties (SAPO, KL, entropy) -> metrics. ``bias_surrogate`` asks for the
    clip-bias surrogate ``S`` with gradient.

    Every ``[B, T]`` intermediate that is exactly 0 (log-ratios) or 1 (ratios) off the mask is
    reduced over the whole tensor, so the metrics are whole-tensor sums and one ``aminmax``
    rather than a masked pass each; the aggregation weights are folded into the advantages
    (``a_t = g_t A_t``, ``g_t > 0`` on policy tokens), so the surrogate's sum is the loss.
    """
    spec = config.spec
    inputs = _loss_inputs(
        logprobs, old_logprobs, advantages, loss_mask, config,
        rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, entropy=entropy, turn_ids=turn_ids,
    )
    weights = _aggregation_weights(inputs, config, spec, denominator)
    ratios = _ratios(inputs, config, spec)
    terms = _surrogate(inputs, config, spec, ratios, weights)
    is_weights, is_metrics = _is_correction(inputs, config, ratios)
    pg_loss = _aggregate(terms, is_weights)
    bias = _clip_bias(inputs, config, spec, ratios, terms, weights, is_weights, bias_surrogate)
    loss, metrics = _penalties(pg_loss, inputs, config, spec, ratios, weights)
    metrics.update(loss_metrics(inputs, config, spec, ratios, terms, pg_loss, bias, is_metrics))
    return _PolicyTerms(spec=spec, loss=loss, bias=bias, metrics=metrics)


# ------------------------------------------------------------------------------------------ inputs


def _loss_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    rollout_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    turn_ids: torch.Tensor | None,
) -> LossInputs:
    """Shapes checked, per-sequence advantages broadcast, and the inputs each option needs present."""
    advantages = _check_inputs(
        logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, ref_logprobs, entropy, turn_ids
    )
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("loss.kl_coef > 0 needs ref_logprobs")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("loss.entropy_coef > 0 needs entropy")
    if config.is_correction.mode != "off" and rollout_logprobs is None:
        raise ValueError(f"loss.is_correction.mode={config.is_correction.mode!r} needs rollout_logprobs")
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    advantages = torch.where(mask, advantages.float(), zero).detach()
    return LossInputs(logprobs, old_logprobs, advantages, mask, rollout_logprobs, ref_logprobs, entropy, turn_ids)


# ------------------------------------------------------------------------------------- aggregation


@dataclass(frozen=True)
class _Aggregation:
    """The aggregation mode's weights ``g_t`` (``aggregation.py``): folded into the advantages
    (``a_t = g_t A_t``, 0 off the mask) so the surrogate's sum is the loss; ``weights`` is
    ``g_t`` itself when a penalty aggregates a term of its own (else ``None``);
    ``sapo_denominator`` the mini-batch count of SAPO's listing variant, if given."""

    weighted_advantages: torch.Tensor
    weights: torch.Tensor | None
    sapo_denominator: float | torch.Tensor | None


def _aggregation_weights(
    inputs: LossInputs,
    config: PolicyLossConfig,
    spec: PolicyLossSpec,
    denominator: float | torch.Tensor | LossDenominators | None,
) -> _Aggregation:
    sapo_denominator = None
    if isinstance(denominator, LossDenominators):
        denominator, sapo_denominator = denominator.aggregation, denominator.sapo
    scale = token_scale(inputs.mask, config.loss_agg, denominator, config.norm_length)
    weighted = inputs.advantages * scale  # a_t = g_t A_t: 0 off the mask
    weights = None
    if spec.sapo_penalty or config.kl_coef > 0 or config.entropy_coef > 0:
        weights = inputs.mask.to(torch.float32) * scale
    return _Aggregation(weighted, weights, sapo_denominator)


def _aggregate(terms: SurrogateTerms, is_weights: torch.Tensor | None) -> torch.Tensor:
    """``sum_t w_IS,t l_t``: the per-token terms carry ``g_t`` already, so the sum is the
    aggregated surrogate loss."""
    per_token = terms.per_token if is_weights is None else terms.per_token * is_weights
    return per_token.sum()


# ------------------------------------------------------------------------------------------- ratio


def _ratios(inputs: LossInputs, config: PolicyLossConfig, spec: PolicyLossSpec) -> Ratios:
    is_cfg = config.is_correction
    # with turn ids, always: the turn clip fraction is logged for every loss
    need_turns = (spec.ratio_level == "turn" or (is_cfg.mode != "off" and is_cfg.level == "turn")
                  or config.diagnostics or inputs.turn_ids is not None)
    turns = segment_turns(inputs.mask, inputs.turn_ids) if need_turns else None
    segments = segments_for_level(spec.ratio_level, inputs.mask, turns)
    clamp = config.log_ratio_clamp
    token_lr_raw = masked_log_ratio(inputs.logprobs, inputs.old_logprobs, inputs.mask)  # 0 off the mask
    token_lr = token_lr_raw.clamp(-clamp, clamp)
    token_ratio = torch.exp(token_lr)  # 1 off the mask
    if spec.ratio_level == "token":
        level_lr_raw, ratio = token_lr_raw, token_ratio
    elif spec.token_gradient:  # GSPO-token: the value of s_i, the gradient of token t alone (times s_i)
        level_lr_raw = level_log_ratio(token_lr_raw, spec.ratio_level, segments, clamp=None)
        level_lr_raw = level_lr_raw.detach() + token_lr_raw - token_lr_raw.detach()
        ratio = torch.exp(level_lr_raw.clamp(-clamp, clamp))
    else:
        level_lr_raw, ratio = unit_ratio(token_lr_raw, segments, clamp)
    return Ratios(turns, segments, token_lr_raw, token_lr, token_ratio, level_lr_raw, ratio)


# --------------------------------------------------------------------------------------- surrogate


def _surrogate(
    inputs: LossInputs, config: PolicyLossConfig, spec: PolicyLossSpec, ratios: Ratios, weights: _Aggregation
) -> SurrogateTerms:
    """The registered loss's surrogate on the loss ratio and ``a_t = g_t A_t``: its per-token
    terms come out weighted, its clip indicators the same as with ``A_t``."""
    return spec.surrogate(
        SurrogateInputs(
            ratio=ratios.ratio, logprobs=inputs.logprobs, advantages=weights.weighted_advantages, mask=inputs.mask,
            clip_low=config.clip_low, clip_high=config.clip_high, dual_clip=config.dual_clip,
        )
    )


# ------------------------------------------------------------------------------------- corrections


def _is_correction(
    inputs: LossInputs, config: PolicyLossConfig, ratios: Ratios
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """MiniRL's detached ``pi_old / mu`` weights (``None`` when the correction is off) and the
    mismatch metrics (none without rollout log-probs: no mismatch to report)."""
    is_cfg = config.is_correction
    if is_cfg.mode == "off" and inputs.rollout_logprobs is None:
        return None, {}
    corr = is_correction_weights(
        inputs.old_logprobs, inputs.rollout_logprobs, inputs.mask, is_cfg, ratios.turns, config.log_ratio_clamp
    )
    return (None if is_cfg.mode == "off" else corr.weights), corr.metrics


def _clip_bias(
    inputs: LossInputs,
    config: PolicyLossConfig,
    spec: PolicyLossSpec,
    ratios: Ratios,
    terms: SurrogateTerms,
    weights: _Aggregation,
    is_weights: torch.Tensor | None,
    bias_surrogate: bool,
) -> ClipBiasTerms:
    """Clip bias (SORL eq. 7/8/14), for every loss: ``||C||`` (``clip_bias/sq_sum``) is a logged
    leading indicator, and an engine measuring ``||C||`` in parameter space reads it (0 means
    C = 0, no backward). Indicators from the surrogate, or from token ratios on request."""
    indicator = terms.clip_high | terms.clip_low | terms.dual
    if config.clip_bias.indicator == "token_ratio" and spec.ratio_level != "token":
        adv, token_ratio = inputs.advantages, ratios.token_ratio
        indicator = (
            ((adv > 0) & (token_ratio > config.clip_high)) | ((adv < 0) & (token_ratio < config.clip_low))
        ) & inputs.mask
    # d ratio_t / d log pi_j: spread over the unit (turn / sequence ratios) or token t's own (GSPO-token)
    grad_segments = None if spec.token_gradient else ratios.segments
    bias_adv = weights.weighted_advantages if is_weights is None else weights.weighted_advantages * is_weights
    if terms.bias_share is not None:
        bias_adv = bias_adv * terms.bias_share
    return clip_bias_terms(
        ratios.ratio, ratios.level_log_ratio, config.log_ratio_clamp, indicator, bias_adv, grad_segments,
        surrogate=bias_surrogate,
    )


def _clip_bias_norm(
    bias: ClipBiasTerms, config: PolicyLossConfig, normalize: bool, params: Iterable[torch.Tensor] | None
) -> torch.Tensor | None:
    """``||C||`` of a clip-normalized loss in ``clip_bias.mode``'s space; ``None`` for
    ``param_grad`` left to an engine (``normalize=False``)."""
    if config.clip_bias.mode != "param_grad":
        return clip_bias_norm(bias.scalar, bias.sq_sum, config.clip_bias.mode)
    if not normalize:
        return None
    if params is None:
        raise ValueError("loss.clip_bias.mode='param_grad' needs params here (or normalize=False and an engine)")
    return param_grad_clip_bias_norm(bias.surrogate, params)


# --------------------------------------------------------------------------------------- penalties


def _penalties(
    pg_loss: torch.Tensor,
    inputs: LossInputs,
    config: PolicyLossConfig,
    spec: PolicyLossSpec,
    ratios: Ratios,
    weights: _Aggregation,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``pg_loss`` plus SAPO's conditional KL, the KL to the reference and minus the entropy
    bonus, each aggregated with the loss's weights; their metrics."""
    loss, metrics = pg_loss, {}
    if spec.sapo_penalty:
        sapo_term, active = _sapo_penalty(inputs, config.sapo, ratios, weights)
        loss = loss + config.sapo.gamma * sapo_term
        metrics["sapo/penalty"] = sapo_term.detach()
        metrics["sapo/penalty_frac"] = masked_mean(active.float(), inputs.mask)
    if config.kl_coef > 0:
        kl = aggregate(kl_penalty(inputs.logprobs, inputs.ref_logprobs, config.kl_estimator, config.log_ratio_clamp),
                       weights.weights)
        loss = loss + config.kl_coef * kl
        metrics["kl_ref"] = kl.detach()
    if config.entropy_coef > 0:
        ent = aggregate(inputs.entropy.float(), weights.weights)
        loss = loss - config.entropy_coef * ent
        metrics["entropy"] = ent.detach()
    if inputs.entropy is not None:  # a diagnostic for every loss: the token mean, whatever the aggregation
        metrics["entropy/mean"] = masked_mean(inputs.entropy.detach().float(), inputs.mask)
    return loss, metrics


def _sapo_penalty(
    inputs: LossInputs, sapo: SAPOConfig, ratios: Ratios, weights: _Aggregation
) -> tuple[torch.Tensor, torch.Tensor]:
    """SAPO's ``-log r_t`` on its active tokens (its gradient pushes ``r_t`` back up towards
    ``tau``): ``(term, active tokens)``."""
    mask, advantages, token_lr = inputs.mask, inputs.advantages, ratios.clamped_log_ratio
    if sapo.variant == "listing":
        # appendix A.6: masked_mean(log(r).masked_fill(r > tau, 0)[A[:, 0] >= 0], mask[A[:, 0] >= 0])
        rows = _sapo_listing_tokens(advantages, mask, sapo)
        active = (rows & (ratios.token_ratio <= sapo.tau)).detach()
        count = rows.sum() if weights.sapo_denominator is None else weights.sapo_denominator
        count = torch.as_tensor(count, dtype=torch.float32, device=inputs.logprobs.device).clamp(min=1.0)
        return masked_sum(-token_lr, active) / count, active
    # eq. 11, inside eq. 9's aggregation
    positive = advantages >= 0 if sapo.nonnegative else advantages > 0
    active = (positive & (ratios.token_ratio < sapo.tau) & mask).detach()
    zero = torch.zeros((), dtype=torch.float32, device=inputs.logprobs.device)
    return aggregate(torch.where(active, -token_lr, zero), weights.weights), active


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
