"""Rule rewards for search agents: EM / token F1 (SQuAD normalization), multiple choice,
format reward, and a registry keyed by ``data_source``."""

from .qa import (
    exact_match,
    extract_answer,
    is_well_formed,
    multiple_choice,
    normalize_answer,
    substring_match,
    token_f1,
)
from .registry import DEFAULT_SOURCES, QAReward, RewardRegistry, compute_score, targets_of

__all__ = [
    "DEFAULT_SOURCES",
    "QAReward",
    "RewardRegistry",
    "compute_score",
    "exact_match",
    "extract_answer",
    "is_well_formed",
    "multiple_choice",
    "normalize_answer",
    "substring_match",
    "targets_of",
    "token_f1",
]
