"""Trajectories of the search agent and their collation into ``[batch, seq]`` tensors.

Conventions shared with ``sorl_megatron.algorithms``: ``loss_mask`` is 1 on policy tokens and
0 on prompt, observation and padding tokens; ``turn_ids`` is the 0-based turn index on policy
tokens and -1 elsewhere; ``rollout_logprobs`` holds the sampler's log-prob of each policy
token at that token's position and 0 elsewhere; ``routed_experts`` holds, for every position
that the rollout engine fed through the model, the experts it chose (-1 where none: the last
token, which no engine feeds, and padding).

``token_versions`` holds, on policy tokens, the weight version (an integer, see
:func:`version_number`) that sampled each token and -1 elsewhere; ``routing_versions`` the
version whose forward pass chose each position's ``routed_experts`` (-1 where no routes). A
*partial rollout* (an episode in flight across a weight update) has several versions; its
``rollout_logprobs`` are still each token's behaviour log-prob under the version that sampled it.

``turn_texts`` are the decoded policy turns (one per loss-mask-1 span): what rewards read.
``response_text`` also holds the observations between them and is for logs only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..engine.rl_batch import RoutedRows

_VERSION_DIGITS = re.compile(r"(\d+)$")


def version_number(version: str | int | None) -> int:
    """The integer of a weight version label: the trainer names them ``step_<k>``; a label
    without trailing digits (an embedded server's initial ``default``, or None) is version 0,
    the weights the servers started with."""
    if isinstance(version, int):
        return version
    m = _VERSION_DIGITS.search(version or "")
    return int(m.group(1)) if m else 0


@dataclass
class Trajectory:
    """One multi-turn episode, token-aligned (all arrays have length ``len(token_ids)``)."""

    token_ids: np.ndarray  # int64 [N]
    loss_mask: np.ndarray  # int8 [N]
    turn_ids: np.ndarray  # int32 [N]
    rollout_logprobs: np.ndarray  # float32 [N]
    prompt_len: int
    finish_reason: str  # answer | max_turns | max_length | eos | error
    num_turns: int
    num_searches: int  # search actions of the policy (failed ones included)
    routed_experts: np.ndarray | None = None  # [N, layers, top_k], the smallest integer type (compact_route_dtype)
    answer: str | None = None
    response_text: str = ""  # decoded response incl. observations: for logs, never for rewards
    turn_texts: list[str] = field(default_factory=list)  # decoded policy turns: what rewards read
    retrieval_errors: int = 0  # searches that got no passages (rejected or failed), see retrieval_rejected
    retrieval_rejected: int = 0  # of those, rejected by the server (HTTP 4xx: a bad query)
    weight_versions: list[str | None] = field(default_factory=list)  # per turn, as the server reported them
    token_versions: np.ndarray | None = None  # int64 [N]: version that sampled each policy token, -1 elsewhere
    routing_versions: np.ndarray | None = None  # int64 [N]: version that routed each position, -1 without routes
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "turn_ids", "rollout_logprobs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trajectory.{name} has length {len(getattr(self, name))}, token_ids has {n}")
        for name in ("token_versions", "routing_versions"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ValueError(f"trajectory.{name} has length {len(getattr(self, name))}, token_ids has {n}")
        if self.routed_experts is not None and self.routed_experts.shape[0] != n:
            raise ValueError(
                f"trajectory.routed_experts covers {self.routed_experts.shape[0]} tokens, token_ids has {n}"
            )

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_policy_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def oldest_version(self) -> int | None:
        """The oldest weight version of any policy token (None: no policy token)."""
        if self.token_versions is None:
            return None
        v = self.token_versions[np.asarray(self.loss_mask) != 0]
        return int(v.min()) if v.size else None

    def policy_spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each maximal run of ``loss_mask == 1``: the policy's turns."""
        mask = np.r_[0, np.asarray(self.loss_mask, dtype=np.int8) != 0, 0].astype(np.int8)
        edges = np.flatnonzero(np.diff(mask))
        return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def collate(
    trajectories: Sequence[Trajectory], pad_token_id: int, pad_to_multiple_of: int = 1
) -> dict[str, torch.Tensor]:
    """Right-pad trajectories into a batch.

    Returns ``input_ids``, ``attention_mask``, ``position_ids``, ``loss_mask`` (long),
    ``turn_ids`` (long, -1 off-policy), ``rollout_logprobs`` (float32), ``prompt_lens``,
    ``seq_lens``, ``num_searches``, ``num_turns`` (``[batch]`` long) and, when every trajectory
    has routing, ``routed_experts``: a :class:`~..engine.rl_batch.RoutedRows` standing for int32
    ``[batch, seq, layers, top_k]`` (-1 padding), packed (each row's real tokens, no padding) in the
    trajectories' compact integer type, so the step's routes are never held dense.
    """
    if not trajectories:
        raise ValueError("collate: no trajectories")
    lens = torch.tensor([len(t) for t in trajectories], dtype=torch.long)
    width = int(lens.max())
    width += -width % pad_to_multiple_of
    valid = torch.arange(width)[None, :] < lens[:, None]

    def pad(name: str, value: float, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((len(trajectories), width), value, dtype=dtype)
        flat = torch.from_numpy(np.concatenate([np.asarray(getattr(t, name)) for t in trajectories]))
        out[valid] = flat.to(dtype)
        return out

    batch = {
        "input_ids": pad("token_ids", pad_token_id, torch.long),
        "attention_mask": valid.long(),
        "position_ids": torch.arange(width).expand(len(trajectories), width).clone(),
        "loss_mask": pad("loss_mask", 0, torch.long),
        "turn_ids": pad("turn_ids", -1, torch.long),
        "rollout_logprobs": pad("rollout_logprobs", 0.0, torch.float32),
        "prompt_lens": torch.tensor([t.prompt_len for t in trajectories], dtype=torch.long),
        "seq_lens": lens,
        "num_searches": torch.tensor([t.num_searches for t in trajectories], dtype=torch.long),
        "num_turns": torch.tensor([t.num_turns for t in trajectories], dtype=torch.long),
    }
    if all(t.routed_experts is not None for t in trajectories):
        shapes = {t.routed_experts.shape[1:] for t in trajectories}  # type: ignore[union-attr]
        if len(shapes) != 1:
            raise ValueError(f"collate: trajectories disagree on routed_experts shape {sorted(shapes)}")
        values = torch.from_numpy(np.concatenate([t.routed_experts for t in trajectories]))  # type: ignore[misc]
        batch["routed_experts"] = RoutedRows(rows=torch.arange(len(trajectories)), lengths=lens, values=values,
                                             batch_size=len(trajectories), seq_len=width, dtype=torch.int32)
    return batch
