"""Gold trajectories: a scripted policy that plays a :class:`GoldPlan` through the real agent loop.

Running the plan through :class:`~sorl_megatron.rollout.agent.SearchAgent` with the real
retriever gives token sequences in exactly the rollout format (masks, turn ids, the same
observation tokens), for SFT cold start or PVPO's ground-truth trajectory injection. Gold
tokens carry log-prob 0 (they were not sampled).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ..common.protocol import GenerateOutput, SamplingParams
from .synthetic import GoldPlan


class GoldPolicy:
    """Answers turn ``t`` of an episode with the plan's text for turn ``t``."""

    def __init__(self, tokenizer: Any, plan: GoldPlan):
        self.tokenizer = tokenizer
        self.turn_ids = [tokenizer.encode(t, add_special_tokens=False) for t in plan.turns()]
        self.turn = 0

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        rid: str | None = None,
    ) -> list[GenerateOutput]:
        if return_routed_experts:
            raise ValueError("gold trajectories have no routing: run the agent with return_routed_experts=False")
        ids = self.turn_ids[min(self.turn, len(self.turn_ids) - 1)][: sampling.max_new_tokens]
        self.turn += 1
        finish = {"type": "stop", "matched": sampling.stop[0] if sampling.stop else None}
        return [
            GenerateOutput(
                output_ids=list(ids),
                finish_reason=finish,
                prompt_tokens=len(input_ids),
                completion_tokens=len(ids),
                weight_version="gold",
                output_logprobs=[0.0] * len(ids),
            )
        ]


async def gold_trajectory(
    agent_factory, tokenizer: Any, prompt_ids: Sequence[int], plan: GoldPlan, meta: dict | None = None
):
    """Play ``plan``; ``agent_factory(policy)`` builds a SearchAgent around the gold policy."""
    agent = agent_factory(GoldPolicy(tokenizer, plan))
    return await agent.run(prompt_ids, meta={**(meta or {}), "gold": True})


def gold_plan(row: Any) -> GoldPlan | None:
    """The row's ideal episode (``extra_info["gold_searches"]`` then its first target), or None."""
    searches = row.extra_info.get("gold_searches")
    return None if searches is None else GoldPlan(searches=list(searches), answer=row.targets[0])


def cold_start_plans(rows: Sequence[Any], direct_answer_fraction: float = 0.0, seed: int = 0) -> dict[int, GoldPlan]:
    """SFT demonstrations, by row index, for the rows with a gold plan.

    A seeded ``direct_answer_fraction`` of them answer at once, without searching, with the
    answer of a random row: a teacher that sometimes guesses instead of looking it up. Those
    demonstrations are usually wrong, so the cold-start policy mixes both behaviours and RL,
    rewarded by EM alone, has to learn that searching pays (the CPU demo's setting, see
    docs/how-to/write-a-recipe.md). With 0 every demonstration is the gold plan."""
    if not 0.0 <= direct_answer_fraction < 1.0:
        raise ValueError(f"direct_answer_fraction must be in [0, 1), got {direct_answer_fraction}")
    rng = random.Random(seed)
    out = {}
    for i, row in enumerate(rows):
        plan = gold_plan(row)
        if plan is None:
            continue
        if rng.random() < direct_answer_fraction:
            plan = GoldPlan(searches=[], answer=rows[rng.randrange(len(rows))].targets[0])
        out[i] = plan
    return out
