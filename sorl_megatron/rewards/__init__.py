"""Rule rewards for search agents: EM / token F1 (SQuAD normalization), multiple choice,
format reward, and a registry keyed by ``data_source``. Rewards read the policy's own turn
texts only, never the observations between them."""

from .qa import (
    ACTION_TAG_RE,
    PolicyResponse,
    exact_match,
    extract_answer,
    is_well_formed,
    multiple_choice,
    normalize_answer,
    policy_turns,
    substring_match,
    token_f1,
)
from .registry import DEFAULT_SOURCES, QAReward, RewardRegistry, compute_score, targets_of

__all__ = [
    "ACTION_TAG_RE",
    "DEFAULT_SOURCES",
    "PolicyResponse",
    "QAReward",
    "RewardRegistry",
    "compute_score",
    "exact_match",
    "extract_answer",
    "is_well_formed",
    "multiple_choice",
    "normalize_answer",
    "policy_turns",
    "substring_match",
    "targets_of",
    "token_f1",
]
