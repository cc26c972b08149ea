"""Reward functions selected by a row's ``data_source`` (verl / Search-R1 convention).

A reward function maps ``(response, ground_truth)`` to a float. ``response`` is what the
policy wrote: the list of its turn texts (``Trajectory.turn_texts``; a bare string is one
turn), never a text with the environment's observations in it. ``ground_truth`` is the
parquet's ``reward_model.ground_truth`` (``{"target": [answer, alias, ...]}``; a bare string
or list is accepted too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .qa import (
    PolicyResponse,
    exact_match,
    extract_answer,
    is_well_formed,
    multiple_choice,
    substring_match,
    token_f1,
)

Metric = Literal["em", "f1", "substring", "mc"]
RewardFn = Callable[[PolicyResponse, Any], float]

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
    """Score of the policy's last ``<answer>`` block against the targets.

    ``format_weight`` mixes in a structure reward: ``(1 - w) * metric + w * well_formed``,
    both read from the policy's turns only. Responses without an answer score 0 (plus
    nothing: a missing answer is malformed).
    """

    metric: Metric = "em"
    format_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.metric not in _METRICS:
            raise ValueError(f"reward.metric: {self.metric!r} is not one of {sorted(_METRICS)}")
        if not 0.0 <= self.format_weight <= 1.0:
            raise ValueError(f"reward.format_weight must be in [0, 1], got {self.format_weight}")

    def __call__(self, response: PolicyResponse, ground_truth: Any) -> float:
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
        if not isinstance(data_source, str) or not data_source:
            # before ``default``: a null or numeric source is a broken row, not an unknown data set
            raise KeyError(f"data_source must be a non-empty string naming the data set, got {data_source!r}")
        if data_source in self._custom:
            return self._custom[data_source]
        metric = DEFAULT_SOURCES.get(data_source, self.default)
        if metric is None:
            raise KeyError(f"no reward registered for data_source {data_source!r} (known: {self.known()})")
        if self.metric_override is not None and metric != "mc":
            metric = self.metric_override
        return QAReward(metric=metric, format_weight=self.format_weight)

    def known(self) -> list[str]:
        """The data sources with a reward (``default`` covers any other string)."""
        return sorted(set(DEFAULT_SOURCES) | set(self._custom))

    def score(self, data_source: str, response: PolicyResponse, ground_truth: Any) -> float:
        return self.get(data_source)(response, ground_truth)


def compute_score(data_source: str, response: PolicyResponse, ground_truth: Any, **registry_kwargs: Any) -> float:
    """verl-style entry point: one response's reward (``response``: the policy's turn texts)."""
    return RewardRegistry(**registry_kwargs).score(data_source, response, ground_truth)
