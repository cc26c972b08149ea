"""PVPO group sampling, static V and ground-truth trajectory injection (PVPO §3).

Before training, ``M`` rollouts per prompt with a reference checkpoint give each prompt's
accuracy and its static value ``V_static = (1/M) sum_j r_j`` (eq. 10). Prompts the reference
always solves (accuracy 1) are dropped; the rest are kept; for accuracy-0 prompts a
ground-truth trajectory may replace one rollout of a group whose rollouts are all incorrect.
Its behaviour log-probs are those of the policy that produced it (eq. 6:
``r = pi_theta / pi_gt``), not the current policy's, so the trainer must use them as that
row's ``old_logprobs``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ...algorithms.advantages import static_values_from_rollouts
from ...rollout.trajectory import Trajectory

SOLVED = 1.0 - 1e-6  # a reward of 1 (up to float error) counts as a correct rollout


@dataclass
class PVPOState:
    """Per-prompt reference statistics, keyed by dataset index."""

    static_v: dict[int, float] = field(default_factory=dict)
    accuracy: dict[int, float] = field(default_factory=dict)
    refreshed_at_step: int = 0

    def values_for(self, group_ids: torch.Tensor) -> torch.Tensor:
        """``V_static`` of each trajectory's prompt (a clear error for an unknown prompt)."""
        missing = sorted({int(g) for g in group_ids.tolist()} - set(self.static_v))
        if missing:
            raise KeyError(
                f"PVPO static V has no entry for prompt(s) {missing[:10]}: run the reference pass on them first"
            )
        return torch.tensor([self.static_v[int(g)] for g in group_ids.tolist()], dtype=torch.float32)


def reference_statistics(rewards: torch.Tensor, group_ids: torch.Tensor, step: int = 0) -> PVPOState:
    """Static V (mean reward) and accuracy (fraction of rewards == 1) per prompt."""
    static_v = static_values_from_rollouts(rewards, group_ids)
    solved = static_values_from_rollouts((rewards >= SOLVED).float(), group_ids)
    return PVPOState(static_v=static_v, accuracy=solved, refreshed_at_step=step)


@dataclass(frozen=True)
class GroupSampling:
    keep: list[int]  # dataset indices kept for training (accuracy < 1, or all if not dropping)
    dropped: list[int]  # accuracy 1
    unsolved: list[int]  # accuracy 0: candidates for ground-truth injection


def group_sampling(state: PVPOState, drop_solved: bool = True) -> GroupSampling:
    """Split prompts by reference accuracy (PVPO group sampling)."""
    ids = sorted(state.accuracy)
    dropped = [i for i in ids if state.accuracy[i] >= SOLVED] if drop_solved else []
    keep = [i for i in ids if i not in set(dropped)]
    unsolved = [i for i in keep if state.accuracy[i] <= 0.0]
    return GroupSampling(keep=keep, dropped=dropped, unsolved=unsolved)


def inject_ground_truth(
    trajectories: list[Trajectory],
    group_ids: torch.Tensor,
    rewards: torch.Tensor,
    ground_truth: dict[int, Trajectory],
    unsolved: Sequence[int],
) -> tuple[list[Trajectory], torch.Tensor]:
    """Replace one rollout of a group by its prompt's ground-truth trajectory where the
    reference pass never solved the prompt (accuracy 0, ``unsolved``) and none of this step's
    rollouts solved it either (PVPO Fig. 2: "for samples with all incorrect rollouts, a ground
    truth trajectory replaces one existing rollout"). The last rollout of the group is replaced.

    Returns the new trajectory list and a ``[N]`` bool tensor marking injected rows. The GT
    trajectory keeps its own ``rollout_logprobs`` (the generating policy's, eq. 6) and gets
    ``meta["ground_truth"] = True``.
    """
    out = list(trajectories)
    injected = torch.zeros(len(out), dtype=torch.bool)
    solved_now = set(group_ids[rewards >= SOLVED].tolist())
    unsolved_set = set(int(u) for u in unsolved) - solved_now
    last_of_group: dict[int, int] = {}
    for i, g in enumerate(group_ids.tolist()):
        last_of_group[int(g)] = i
    for g, i in last_of_group.items():
        if g in unsolved_set and g in ground_truth:
            gt = ground_truth[g]
            if out[i].routed_experts is not None and gt.routed_experts is None:
                # keep the batch's routing layout: GT tokens have no routes (live router fallback)
                gt = _with_empty_routes(gt, out[i].routed_experts.shape[1:])
            gt.meta = {
                **gt.meta,
                **{k: v for k, v in out[i].meta.items() if k in ("prompt_index", "sample_index")},
                "ground_truth": True,
            }
            out[i] = gt
            injected[i] = True
    return out, injected


def _with_empty_routes(traj: Trajectory, shape: tuple[int, ...]) -> Trajectory:
    routes = np.full((len(traj), *shape), -1, dtype=np.int32)
    return dataclasses.replace(traj, routed_experts=routes)
