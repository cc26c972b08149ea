"""Reward functions selected by a row's ``data_source`` (verl / Search-R1 convention).

A reward function maps ``(response_text, ground_truth)`` to a float, where ``ground_truth``
is the parquet's ``reward_model.ground_truth`` (``{"target": [answer, alias, ...]}``; a bare
string or list is accepted too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .qa import exact_match, extract_answer, is_well_formed, multiple_choice, substring_match, token_f1

Metric = Literal["em", "f1", "substring", "mc"]
RewardFn = Callable[[str, Any], float]

_METRICS: dict[str, Callable[[str, Iterable[str]], float]] = {
    "em": exact_match,
    "f1": token_f1,
    "substring": substring_match,
    "mc": multiple_choice,
}

# Data sources of Search-R1's QA mixture and the medical multiple-choice sets SORL uses.
DEFAULT_SOURCES: dict[str, Metric] = {
    **{s: "em" for s in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")},
    **{s: "mc" for s in ("medqa", "medmcqa", "mmlu_med", "pubmedqa")},
    "synthetic_single": "em",
    "synthetic_multi": "em",
}


def targets_of(ground_truth: Any) -> list[str]:
    """The target strings of a ``ground_truth`` value (dict with ``target``, list or str)."""
    if isinstance(ground_truth, Mapping):
        if "target" not in ground_truth:
            raise KeyError(f"ground_truth has no 'target' key (keys: {sorted(ground_truth)})")
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, str):
        return [ground_truth]
    out = [str(t) for t in ground_truth]
    if not out:
        raise ValueError("ground_truth has an empty target list")
    return out


@dataclass(frozen=True)
class QAReward:
    """Score of the last ``<answer>`` block against the targets.

    ``format_weight`` mixes in a structure reward: ``(1 - w) * metric + w * well_formed``.
    Responses without an answer score 0 (plus nothing: a missing answer is malformed).
    """

    metric: Metric = "em"
    format_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.metric not in _METRICS:
            raise ValueError(f"reward.metric: {self.metric!r} is not one of {sorted(_METRICS)}")
        if not 0.0 <= self.format_weight <= 1.0:
            raise ValueError(f"reward.format_weight must be in [0, 1], got {self.format_weight}")

    def __call__(self, response: str, ground_truth: Any) -> float:
        answer = extract_answer(response)
        score = 0.0 if answer is None else _METRICS[self.metric](answer, targets_of(ground_truth))
        if self.format_weight:
            score = (1 - self.format_weight) * score + self.format_weight * float(is_well_formed(response))
        return score


@dataclass
class RewardRegistry:
    """``data_source`` -> reward function.

    ``metric_override`` replaces the metric of every QA source (SAPO trains on F1);
    ``default`` is used for unknown sources (None: unknown sources are an error).
    """

    format_weight: float = 0.0
    metric_override: Metric | None = None
    default: Metric | None = None
    _custom: dict[str, RewardFn] = field(default_factory=dict)

    def register(self, data_source: str, fn: RewardFn) -> None:
        self._custom[data_source] = fn

    def get(self, data_source: str) -> RewardFn:
        if data_source in self._custom:
            return self._custom[data_source]
        metric = DEFAULT_SOURCES.get(data_source, self.default)
        if metric is None:
            known = sorted(set(DEFAULT_SOURCES) | set(self._custom))
            raise KeyError(f"no reward registered for data_source {data_source!r} (known: {known})")
        if self.metric_override is not None and metric != "mc":
            metric = self.metric_override
        return QAReward(metric=metric, format_weight=self.format_weight)

    def score(self, data_source: str, response: str, ground_truth: Any) -> float:
        return self.get(data_source)(response, ground_truth)


def compute_score(data_source: str, response: str, ground_truth: Any, **registry_kwargs: Any) -> float:
    """verl-style entry point: one response's reward."""
    return RewardRegistry(**registry_kwargs).score(data_source, response, ground_truth)
