"""The rollout phase of an RL step: prompts -> multi-turn trajectories -> rewards.

Trajectories are prompt-major (the ``n`` samples of prompt 0, then prompt 1, ...), and
``group_ids`` holds each trajectory's prompt id (its dataset index), which GRPO and PVPO
advantages group by.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...data.qa import QARow, encode_prompt
from ...engine.rl_batch import RLBatch
from ...rewards.registry import RewardRegistry
from ...rollout.agent import SearchAgent, parse_action
from ...rollout.trajectory import Trajectory, collate


@dataclass
class RolloutResult:
    trajectories: list[Trajectory]
    rows: list[QARow]  # the prompt row of each trajectory
    group_ids: torch.Tensor  # [N] long: dataset index of each trajectory's prompt
    rewards: torch.Tensor  # [N] float32
    metrics: dict[str, float]


def check_prompt_length(ids: list[int], row_id: int, max_prompt_tokens: int) -> None:
    """A prompt longer than ``data.max_prompt_tokens`` is an error naming its row."""
    if len(ids) > max_prompt_tokens:
        raise ValueError(
            f"data row {row_id}: prompt has {len(ids)} tokens > data.max_prompt_tokens={max_prompt_tokens}"
        )


async def collect_rollouts(
    agent: SearchAgent,
    tokenizer: Any,
    rows: Sequence[QARow],
    prompt_ids: Sequence[int],
    n: int,
    rewards: RewardRegistry,
    seed: int | None = None,
    progress: bool = False,
    max_prompt_tokens: int | None = None,
) -> RolloutResult:
    """``n`` episodes per row, scored by the row's ``data_source`` reward.

    A prompt longer than ``max_prompt_tokens`` is an error naming its row (``data.max_prompt_tokens``).
    """
    if len(rows) != len(prompt_ids):
        raise ValueError(f"{len(rows)} rows but {len(prompt_ids)} prompt ids")
    prompts = [encode_prompt(tokenizer, row) for row in rows]
    if max_prompt_tokens is not None:
        for ids, row_id in zip(prompts, prompt_ids):
            check_prompt_length(ids, row_id, max_prompt_tokens)
    trajs = await agent.run_many(prompts, n=n, seed=seed, progress=progress)
    traj_rows = [rows[i] for i in range(len(rows)) for _ in range(n)]
    scores = score_trajectories(trajs, traj_rows, rewards)
    groups = torch.tensor([int(prompt_ids[i]) for i in range(len(rows)) for _ in range(n)], dtype=torch.long)
    return RolloutResult(trajs, traj_rows, groups, scores, rollout_metrics(trajs, scores))


def score_trajectories(trajs: Sequence[Trajectory], rows: Sequence[QARow], rewards: RewardRegistry) -> torch.Tensor:
    """Reward of each trajectory against its row's targets, read from the policy's own turns
    (``turn_texts``): observations and environment messages never count as the answer."""
    out = []
    for i, (traj, row) in enumerate(zip(trajs, rows)):
        try:
            out.append(rewards.score(row.data_source, traj.turn_texts, {"target": row.targets}))
        except (KeyError, ValueError) as err:
            raise ValueError(f"reward of trajectory {i} (data_source={row.data_source!r}): {err}") from None
    return torch.tensor(out, dtype=torch.float32)


def rollout_metrics(trajs: Sequence[Trajectory], scores: torch.Tensor, prefix: str = "rollout") -> dict[str, float]:
    """Reward, searches, turns, lengths and finish reasons of a set of trajectories.

    ``retrieval_errors`` counts the searches that got no passages (``retrieval_rejected``:
    of those, the ones the server refused as bad requests); ``finish_error`` is the share of
    episodes the rollout server refused to continue. ``valid_action_ratio`` (SORL Fig. 2b):
    each episode's share of turns that parse as a search or an answer, averaged over episodes
    (Search-R1's ``env/ratio_of_valid_action``; a search on the last allowed turn counts,
    though it is never run); ``valid_action_turn_frac``: the same share over all the turns.
    """
    if not trajs:
        return {}
    n = len(trajs)
    turns = sum(t.num_turns for t in trajs)
    parsed = [sum(parse_action(text)[0] is not None for text in t.turn_texts) for t in trajs]
    valid = sum(p / max(t.num_turns, 1) for p, t in zip(parsed, trajs))
    metrics = {
        f"{prefix}/reward": float(scores.mean()),
        f"{prefix}/searches": sum(t.num_searches for t in trajs) / n,
        f"{prefix}/turns": turns / n,
        f"{prefix}/valid_action_ratio": valid / n,
        f"{prefix}/valid_action_turn_frac": sum(parsed) / max(turns, 1),  # over all turns, not per episode
        f"{prefix}/response_length": sum(t.response_len for t in trajs) / n,
        f"{prefix}/policy_tokens": sum(t.num_policy_tokens for t in trajs) / n,
        f"{prefix}/sequence_length": sum(len(t) for t in trajs) / n,
        f"{prefix}/retrieval_errors": float(sum(t.retrieval_errors for t in trajs)),
        f"{prefix}/retrieval_rejected": float(sum(t.retrieval_rejected for t in trajs)),
    }
    for reason, count in Counter(t.finish_reason for t in trajs).items():
        metrics[f"{prefix}/finish_{reason}"] = count / n
    return metrics


def step_batch(res: RolloutResult, pad_id: int, replay_routes: bool, held: dict) -> RLBatch:
    """The step's batch of a rollout (with R3, ``replay_routes``: the rollout's routes in it);
    without R3, the routes the rollout returned are kept in ``held["rollout_routes"]`` (the
    route flip rate's)."""
    t = collate(res.trajectories, pad_token_id=pad_id)
    if not replay_routes and t.get("routed_experts") is not None:
        held["rollout_routes"] = t["routed_experts"]
    return RLBatch(
        input_ids=t["input_ids"], attention_mask=t["attention_mask"], loss_mask=t["loss_mask"],
        rollout_logprobs=t["rollout_logprobs"], turn_ids=t["turn_ids"], group_ids=res.group_ids,
        routed_experts=t.get("routed_experts") if replay_routes else None,
    )
