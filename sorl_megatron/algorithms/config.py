"""Typed configuration of the policy losses.

Every field is validated on construction; errors name the offending field (``loss.eps_low``),
so a bad recipe fails before any process starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ..common.typed_config import build_dataclass
from .aggregation import LOSS_AGG_MODES
from .loss_registry import POLICY_LOSSES, PolicyLossSpec

ClipBiasMode = Literal["logprob", "scalar", "param_grad"]
ClipBiasApply = Literal["grad", "clipped_grad", "lr"]
ClipBiasForm = Literal["absolute", "relative"]
ClipBiasIndicator = Literal["loss_ratio", "token_ratio"]
KLEstimator = Literal["k1", "k2", "k3"]
ISMode = Literal["off", "tis", "mis"]
ISLevel = Literal["token", "turn", "sequence"]
SAPOAdvCondition = Literal["positive", "nonnegative"]
SAPOVariant = Literal["eq11", "listing"]


def _choice(prefix: str, name: str, value: Any, options: tuple) -> None:
    if value not in options:
        raise ValueError(f"{prefix}.{name}: {value!r} is not one of {list(options)}")


def _positive(prefix: str, name: str, value: Any, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{prefix}.{name} must be a finite number {bound}, got {value!r}")


@dataclass
class ClipBiasConfig:
    """Clipping-triggered normalization (SORL eq. 9/12/15).

    Attributes:
        mode: the space in which ``||C||`` is measured: ``logprob`` (norm of the per-token
            clip-bias vector, i.e. the gradient of the clip-bias surrogate with respect to the
            token log-probs), ``scalar`` (|C| of eq. 8 read as a scalar), or ``param_grad``
            (norm of the parameter gradient of the clip-bias surrogate; needs a second
            backward, done by the engine or via ``params`` in ``compute_policy_loss``).
        delta: lower bound of the normaliser, ``factor = 1 / max(||C||, delta)`` (paper: 1;
            ``form: absolute``).
        form: ``absolute`` is eq. 12 as written: ``1 / max(||C||, delta)``, which amplifies
            steps whenever ``||C|| < 1`` and whose threshold means something different at every
            model scale; ``relative`` only ever shrinks a step, by
            ``min(1, relative_threshold * m / ||C||)`` with ``m`` a running mean of ``||C||``
            (``ema_decay``; an engine keeps it), so it engages on spikes of the clipping bias
            whatever its typical size.
        relative_threshold: ``k`` of the ``relative`` form: a mini-batch's step shrinks once its
            ``||C||`` exceeds ``k * m``; > 0.
        ema_decay: decay ``d`` of the ``relative`` form's running mean, ``m <- d * m + (1 - d) *
            min(||C||, k * m)`` after each mini-batch with a clipped token; in [0, 1).
        apply_to: where an engine applies the factor: ``lr`` (that optimizer step's learning
            rate: under Adam the parameter update scales by exactly the factor; the default),
            ``clipped_grad`` (the gradient after global clipping, before Adam) or ``grad`` (the
            gradient before clipping: eq. 12 literally; ``clip_grad`` and Adam's normalization
            largely undo it, docs/concepts/algorithms.md).
        indicator: which ratio decides the clipping indicators ``1[t in B^c]``:
            ``loss_ratio`` (the ratio the loss clips, eq. 5/8 as written) or ``token_ratio``
            (token-level indicators even for turn-level losses, the ST-PPO summary's reading).
        diagnostics: an engine also measures ``||C||`` in parameter space (one extra backward
            per mini-batch) for *any* loss and logs it as ``clip_bias/param_norm``; the update
            itself is unchanged (the factor still follows ``mode``, and only for the
            normalized losses).
    """

    mode: ClipBiasMode = "logprob"
    delta: float = 1.0
    form: ClipBiasForm = "absolute"
    relative_threshold: float = 2.0
    ema_decay: float = 0.9
    apply_to: ClipBiasApply = "lr"
    indicator: ClipBiasIndicator = "loss_ratio"
    diagnostics: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "clip_bias") -> None:
        _choice(prefix, "mode", self.mode, get_args(ClipBiasMode))
        _positive(prefix, "delta", self.delta)
        _choice(prefix, "form", self.form, get_args(ClipBiasForm))
        _positive(prefix, "relative_threshold", self.relative_threshold)
        if not (math.isfinite(self.ema_decay) and 0 <= self.ema_decay < 1):
            raise ValueError(f"{prefix}.ema_decay must be a finite number in [0, 1), got {self.ema_decay}")
        _choice(prefix, "apply_to", self.apply_to, get_args(ClipBiasApply))
        _choice(prefix, "indicator", self.indicator, get_args(ClipBiasIndicator))
        if not isinstance(self.diagnostics, bool):
            raise ValueError(f"{prefix}.diagnostics must be true or false, got {self.diagnostics!r}")


@dataclass
class SAPOConfig:
    """SAPO conditional KL: ``gamma * (-log r_t)`` on drifting tokens of good trajectories.

    Attributes:
        gamma: SAPO's penalty coefficient ``gamma`` (``loss.name: sapo``); >= 0.
        tau: SAPO's ratio threshold ``tau``: the penalty acts on tokens whose ``r_t = pi / pi_old`` is
            below it (``listing``: at or below it); > 0.
        variant: ``eq11``: eq. 9-11 as written: tokens with ``r_t < tau`` and ``A_t > 0``, the
            penalty aggregated with the loss's own weights (inside eq. 9's sum). ``listing``:
            the paper's code listing (appendix A.6): rows whose advantage (at their first
            policy token, the listing's ``advantages[:, 0]``) is ``>= 0``, tokens with
            ``r_t <= tau``, and the penalty averaged over *all* policy tokens of those rows
            (its own denominator); the surrogate is a token mean (``loss_agg: token-mean``).
        adv_condition: ``positive`` (A > 0) or ``nonnegative`` (A >= 0); ``None`` takes the
            variant's own (eq11: positive, listing: nonnegative).
    """

    gamma: float = 0.1
    tau: float = 1.0
    adv_condition: SAPOAdvCondition | None = None
    variant: SAPOVariant = "eq11"

    def __post_init__(self) -> None:
        self.validate()

    @property
    def nonnegative(self) -> bool:
        """Whether the advantage test is ``A >= 0`` (else ``A > 0``)."""
        if self.adv_condition is None:
            return self.variant == "listing"
        return self.adv_condition == "nonnegative"

    def validate(self, prefix: str = "sapo") -> None:
        _positive(prefix, "gamma", self.gamma, allow_zero=True)
        _positive(prefix, "tau", self.tau)
        if self.adv_condition is not None:
            _choice(prefix, "adv_condition", self.adv_condition, get_args(SAPOAdvCondition))
        _choice(prefix, "variant", self.variant, get_args(SAPOVariant))


@dataclass
class ISCorrectionConfig:
    """Train/inference importance-sampling correction (MiniRL): tokens are weighted by the
    detached ``pi_old / mu`` (``mu`` = rollout engine).

    Attributes:
        mode: ``off`` (weight 1; the mismatch metrics are still logged), ``tis`` (truncated IS:
            the weight capped at ``cap``) or ``mis`` (masked IS: a token whose weight lies outside
            ``[low, high]`` gets 0, the others keep theirs).
        level: ``token`` (each token's own ratio), ``turn`` or ``sequence`` (one weight per turn /
            row, so a whole turn or row is truncated or masked together).
        geometric: turn / sequence weights are geometric means of the token ratios; false: their
            products, which collapse towards 0 over a long turn or episode (``is_correction.py``'s
            module doc).
        cap: the ``tis`` bound, ``min(w, cap)``; > 0.
        low / high: the ``mis`` interval a weight is kept in, ``low <= w <= high``; ``0 <= low < high``.
    """

    mode: ISMode = "off"
    level: ISLevel = "token"
    geometric: bool = True
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "is_correction") -> None:
        _choice(prefix, "mode", self.mode, get_args(ISMode))
        _choice(prefix, "level", self.level, get_args(ISLevel))
        _positive(prefix, "cap", self.cap)
        _positive(prefix, "low", self.low, allow_zero=True)
        _positive(prefix, "high", self.high)
        if self.low >= self.high:
            raise ValueError(f"{prefix}.low ({self.low}) must be < {prefix}.high ({self.high})")


@dataclass
class PolicyLossConfig:
    """Configuration of :func:`sorl_megatron.algorithms.compute_policy_loss`.

    Attributes:
        name: registered loss name (see ``POLICY_LOSSES``).
        eps_low / eps_high: clip range ``[1 - eps_low, 1 + eps_high]``; ``eps_high`` defaults
            to ``eps_low`` (symmetric clipping).
        dual_clip: dual-clip constant ``c > 1`` bounding the loss of negative-advantage tokens
            at ``-c * A``; ``None`` disables it.
        loss_agg: aggregation mode (``aggregation.py``).
        norm_length: the constant ``L``, in tokens, of ``seq-mean-token-sum-norm`` (``g_t = 1 / L``,
            verl's ``loss_scale_factor``); None: the padded sequence length. Other modes ignore it.
        log_ratio_clamp: log-ratios are clamped to ``[-c, c]`` before ``exp``.
        kl_coef / kl_estimator: KL-to-reference loss ``kl_coef * agg(k)``, k in k1/k2/k3.
        entropy_coef: entropy bonus ``- entropy_coef * agg(H)``.
        diagnostics: also compute what the configured loss does not need itself (the lean path
            computes only what the loss and the standard metrics need, docs/concepts/algorithms.md): the
            clip-bias statistics (``clip_bias/scalar``, ``sq_sum``, ``logprob_norm``) of losses
            that are not clip-normalized, and the turn-ratio spread (``turn_ratio/*``) of losses
            without turn ratios (it segments every row into turns). Loss and gradient are the same.
    """

    name: str = "ppo"
    eps_low: float = 0.2
    eps_high: float | None = None
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    norm_length: int | None = None
    log_ratio_clamp: float = 20.0
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    diagnostics: bool = False
    clip_bias: ClipBiasConfig = field(default_factory=ClipBiasConfig)
    sapo: SAPOConfig = field(default_factory=SAPOConfig)
    is_correction: ISCorrectionConfig = field(default_factory=ISCorrectionConfig)

    def __post_init__(self) -> None:
        if self.eps_high is None:
            self.eps_high = self.eps_low
        self.validate()

    @property
    def spec(self) -> PolicyLossSpec:
        """The registered loss ``name`` names (the one lookup of ``POLICY_LOSSES`` by name)."""
        spec = POLICY_LOSSES.get(self.name)
        if spec is None:
            raise ValueError(f"loss.name: unknown policy loss {self.name!r}; registered: {sorted(POLICY_LOSSES)}")
        return spec

    @property
    def clip_low(self) -> float:
        return 1.0 - self.eps_low

    @property
    def clip_high(self) -> float:
        return 1.0 + float(self.eps_high)

    def validate(self, prefix: str = "loss") -> None:
        if self.name not in POLICY_LOSSES:
            raise ValueError(f"{prefix}.name: unknown policy loss {self.name!r}; registered: {sorted(POLICY_LOSSES)}")
        _positive(prefix, "eps_low", self.eps_low)
        if self.eps_low >= 1.0:
            raise ValueError(
                f"{prefix}.eps_low must be < 1 (the lower clip bound 1 - eps_low must stay > 0), got {self.eps_low}"
            )
        _positive(prefix, "eps_high", self.eps_high)
        if self.dual_clip is not None:
            _positive(prefix, "dual_clip", self.dual_clip)
            if self.dual_clip <= 1.0:
                raise ValueError(f"{prefix}.dual_clip must be > 1 (or null to disable), got {self.dual_clip}")
        _choice(prefix, "loss_agg", self.loss_agg, LOSS_AGG_MODES)
        if self.norm_length is not None and (not isinstance(self.norm_length, int) or self.norm_length <= 0):
            raise ValueError(f"{prefix}.norm_length must be a positive integer or null, got {self.norm_length!r}")
        _positive(prefix, "log_ratio_clamp", self.log_ratio_clamp)
        _positive(prefix, "kl_coef", self.kl_coef, allow_zero=True)
        _choice(prefix, "kl_estimator", self.kl_estimator, get_args(KLEstimator))
        _positive(prefix, "entropy_coef", self.entropy_coef, allow_zero=True)
        if not isinstance(self.diagnostics, bool):
            raise ValueError(f"{prefix}.diagnostics must be true or false, got {self.diagnostics!r}")
        for sub in ("clip_bias", "sapo", "is_correction"):
            getattr(self, sub).validate(f"{prefix}.{sub}")
        if self.spec.sapo_penalty and self.sapo.variant == "listing" and self.loss_agg != "token-mean":
            raise ValueError(
                f"{prefix}.sapo.variant='listing' averages the surrogate over all policy tokens (the listing's "
                f"masked_mean): set {prefix}.loss_agg=token-mean, not {self.loss_agg!r} (or sapo.variant=eq11)"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any], prefix: str = "loss") -> "PolicyLossConfig":
        """Build from a plain mapping (e.g. a recipe section); unknown keys are errors."""
        return build_dataclass(cls, values, prefix)
