"""Pure tensor math of the RL objectives: turns, ratios, policy losses, clip bias, advantages.

No distributed or Megatron imports here: the RL engine (``sorl_megatron.engine``) calls these
functions per micro-batch and owns all cross-rank reduction. Equation numbers refer to the
papers (SORL / ST-PPO, arXiv 2511.20718; SAPO, arXiv 2511.20347; MiniRL, arXiv 2512.01374;
PVPO; CISPO of MiniMax-M1, arXiv 2506.13585), cited in full in ``docs/concepts/algorithms.md``.
"""

from . import losses  # noqa: F401  (registers the losses with a surrogate of their own: losses/)
from .advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimatorSpec,
    AdvantageInputs,
    broadcast_to_tokens,
    compute_advantages,
    compute_gae,
    compute_grpo_advantages,
    compute_pvpo_advantages,
    register_advantage_estimator,
    static_values_from_rollouts,
    terminal_token_rewards,
    whiten_advantages,
)
from .aggregation import LOSS_AGG_MODES, aggregation_denominator, masked_mean, masked_sum, token_weights
from .clip_bias import ClipBiasTerms, clip_bias_norm, normalization_factor, param_grad_clip_bias_norm
from .config import ClipBiasConfig, ISCorrectionConfig, PolicyLossConfig, SAPOConfig
from .is_correction import ISCorrection, is_correction_weights
from .kl import kl_penalty
from .loss_registry import POLICY_LOSSES, PolicyLossSpec, register_policy_loss
from .policy_loss import LossDenominators, clip_bias_surrogate, compute_policy_loss, loss_denominators
from .ratios import level_log_ratio, masked_log_ratio
from .sft import sft_loss
from .surrogate import Surrogate, SurrogateInputs, SurrogateTerms, ppo_clipped_surrogate
from .turns import TurnSegments, broadcast_segments, row_segments, segment_mean_broadcast, segment_sum, segment_turns

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimatorSpec",
    "AdvantageInputs",
    "aggregation_denominator",
    "broadcast_segments",
    "broadcast_to_tokens",
    "clip_bias_norm",
    "clip_bias_surrogate",
    "ClipBiasConfig",
    "ClipBiasTerms",
    "compute_advantages",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_policy_loss",
    "compute_pvpo_advantages",
    "is_correction_weights",
    "ISCorrection",
    "ISCorrectionConfig",
    "kl_penalty",
    "level_log_ratio",
    "LOSS_AGG_MODES",
    "loss_denominators",
    "LossDenominators",
    "masked_log_ratio",
    "masked_mean",
    "masked_sum",
    "normalization_factor",
    "param_grad_clip_bias_norm",
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "PolicyLossSpec",
    "ppo_clipped_surrogate",
    "register_advantage_estimator",
    "register_policy_loss",
    "row_segments",
    "SAPOConfig",
    "segment_mean_broadcast",
    "segment_sum",
    "segment_turns",
    "sft_loss",
    "static_values_from_rollouts",
    "Surrogate",
    "SurrogateInputs",
    "SurrogateTerms",
    "terminal_token_rewards",
    "token_weights",
    "TurnSegments",
    "whiten_advantages",
]
