"""Rollout phase (scripted policy through the real agent loop, real rewards) and PVPO group
sampling, static V and ground-truth injection on a crafted data set."""

import asyncio

import numpy as np
import pytest
import torch

from sorl_megatron.common.protocol import GenerateOutput
from sorl_megatron.data.qa import make_row
from sorl_megatron.data.tokenizer import train_tokenizer
from sorl_megatron.retrieval.corpus import Passage
from sorl_megatron.rewards.registry import RewardRegistry
from sorl_megatron.rollout.agent import AgentConfig, SearchAgent
from sorl_megatron.rollout.trajectory import Trajectory
from sorl_megatron.trainer.groups.rollouts import collect_rollouts
from sorl_megatron.trainer.stages.pvpo import group_sampling, inject_ground_truth, reference_statistics


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["<think> x </think> <search> where </search> <answer> Paris </answer> <information> Doc </information>",
             "Answer the given question. Question: capital of France? Rome Oslo"] * 30
    return train_tokenizer(texts, vocab_size=300)


class AnswerPolicy:
    """Answers each prompt's question by a fixed table: answers[question] (cycled per call)."""

    def __init__(self, tok, answers):
        self.tok, self.answers, self.calls = tok, answers, {}

    async def generate(self, input_ids, sampling, return_logprob=True, return_routed_experts=False,
                       routed_experts_start_len=0, rid=None):
        text = self.tok.decode(list(input_ids))
        key = next(q for q in self.answers if q in text)
        k = self.calls.get(key, 0)
        self.calls[key] = k + 1
        choice = self.answers[key][k % len(self.answers[key])]
        ids = self.tok.encode(f"<answer> {choice} </answer>", add_special_tokens=False)
        return [GenerateOutput(output_ids=ids, finish_reason={"type": "stop", "matched": "</answer>"},
                               prompt_tokens=len(input_ids), completion_tokens=len(ids), weight_version="v1",
                               output_logprobs=[-0.5] * len(ids))]


class NoRetriever:
    async def retrieve(self, queries, topk=None):
        return [[Passage("0", '"t"\nx', 1.0)] for _ in queries]


def test_collect_rollouts_scores_and_groups(tokenizer):
    rows = [make_row("capital of France?", ["Paris"], "nq", "train", 0),
            make_row("capital of Italy?", ["Rome"], "nq", "train", 1)]
    policy = AnswerPolicy(tokenizer, {"France": ["Paris", "Oslo"], "Italy": ["Oslo"]})
    agent = SearchAgent(
        policy, NoRetriever(), tokenizer, AgentConfig(max_turns=2, max_turn_tokens=16, max_total_tokens=4096)
    )
    res = asyncio.run(collect_rollouts(agent, tokenizer, rows, [10, 11], n=2, rewards=RewardRegistry()))
    assert res.group_ids.tolist() == [10, 10, 11, 11]
    # prompt 10 is answered Paris once and Oslo once (either order); prompt 11 always wrongly
    assert sorted(res.rewards[:2].tolist()) == [0.0, 1.0] and res.rewards[2:].tolist() == [0.0, 0.0]
    assert res.metrics["rollout/reward"] == pytest.approx(0.25)
    assert res.metrics["rollout/finish_answer"] == 1.0 and res.metrics["rollout/searches"] == 0.0
    assert [r.targets for r in res.rows] == [["Paris"], ["Paris"], ["Rome"], ["Rome"]]
    with pytest.raises(ValueError, match=r"data row 10: prompt has \d+ tokens > data.max_prompt_tokens=5"):
        asyncio.run(
            collect_rollouts(agent, tokenizer, rows, [10, 11], n=1, rewards=RewardRegistry(), max_prompt_tokens=5)
        )


class ScriptedTurns:
    """Plays each prompt's list of turn texts in order (a text without an action is cut by length)."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, {}

    async def generate(self, input_ids, sampling, return_logprob=True, return_routed_experts=False,
                       routed_experts_start_len=0, rid=None):
        text = self.tok.decode(list(input_ids))
        key = next(q for q in self.script if q in text)
        k = self.calls.get(key, 0)
        self.calls[key] = k + 1
        out = self.script[key][k]
        ids = self.tok.encode(out, add_special_tokens=False)
        tag = "</answer>" if "</answer>" in out else "</search>" if "</search>" in out else None
        finish = {"type": "stop", "matched": tag} if tag else {"type": "length", "length": len(ids)}
        return [GenerateOutput(output_ids=ids, finish_reason=finish, prompt_tokens=len(input_ids),
                               completion_tokens=len(ids), weight_version="v1", output_logprobs=[-0.5] * len(ids))]


def test_valid_action_ratio_is_search_r1s(tokenizer):
    rows = [make_row("capital of France?", ["Paris"], "nq", "train", 0),
            make_row("capital of Italy?", ["Rome"], "nq", "train", 1)]
    script = {
        "France": ["<answer> Paris </answer>"],  # 1 valid action of 1
        # invalid, invalid, a search on the last allowed turn (valid, though never run): 1 of 3
        "Italy": ["<think> x </think>", "<think> y </think>", "<search> where </search>"],
    }
    agent = SearchAgent(ScriptedTurns(tokenizer, script), NoRetriever(), tokenizer,
                        AgentConfig(max_turns=3, max_turn_tokens=16, max_total_tokens=4096))
    res = asyncio.run(collect_rollouts(agent, tokenizer, rows, [0, 1], n=1, rewards=RewardRegistry()))
    assert [t.num_turns for t in res.trajectories] == [1, 3]
    # Search-R1's env/ratio_of_valid_action: per-episode ratios, averaged (not 2 / 4 pooled)
    assert res.metrics["rollout/valid_action_ratio"] == pytest.approx((1 + 1 / 3) / 2)
    assert res.metrics["rollout/reward"] == pytest.approx(0.5)  # the EM success rate of the batch


def _traj(n, lp=-1.0, routed=False, meta=None):
    return Trajectory(token_ids=np.arange(n), loss_mask=np.r_[np.zeros(2, np.int8), np.ones(n - 2, np.int8)],
                      turn_ids=np.r_[np.full(2, -1, np.int32), np.zeros(n - 2, np.int32)],
                      rollout_logprobs=np.full(n, lp, np.float32), prompt_len=2, finish_reason="answer",
                      num_turns=1, num_searches=0,
                      routed_experts=np.zeros((n, 2, 1), np.int32) if routed else None, meta=meta or {})


def test_pvpo_statistics_filtering_and_gt_injection():
    # M = 4 reference rollouts for prompts 7 (solved), 8 (half), 9 (never solved)
    rewards = torch.tensor([1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0], dtype=torch.float32)
    groups = torch.tensor([7] * 4 + [8] * 4 + [9] * 4)
    state = reference_statistics(rewards, groups)
    assert state.static_v == {7: 1.0, 8: 0.5, 9: 0.0}
    assert state.accuracy == {7: 1.0, 8: 0.5, 9: 0.0}
    split = group_sampling(state)
    assert split.keep == [8, 9] and split.dropped == [7] and split.unsolved == [9]
    assert group_sampling(state, drop_solved=False).keep == [7, 8, 9]
    assert state.values_for(torch.tensor([9, 8])).tolist() == [0.0, 0.5]
    with pytest.raises(KeyError, match="no entry for prompt"):
        state.values_for(torch.tensor([42]))

    # a training batch of 2 rollouts per kept prompt; GT replaces the last rollout of prompt 9
    batch = [_traj(5, routed=True, meta={"prompt_index": i // 2, "sample_index": i % 2}) for i in range(4)]
    gt = _traj(6, lp=0.0, meta={"gold": True})  # scripted gold plan: deterministic, log-prob 0
    groups = torch.tensor([8, 8, 9, 9])
    out, injected = inject_ground_truth(batch, groups, torch.tensor([1.0, 0.0, 0.0, 0.0]), {9: gt}, split.unsolved)
    assert injected.tolist() == [False, False, False, True]
    assert out[3].meta["ground_truth"] and out[3].meta["sample_index"] == 1
    assert (out[3].rollout_logprobs == 0.0).all()  # behaviour log-probs of its generator (eq. 6)
    assert out[3].routed_experts.shape == (6, 2, 1) and (out[3].routed_experts == -1).all()
    assert out[:3] == batch[:3]
    # PVPO injects only where all of this step's rollouts are incorrect: a solved one stays
    out, injected = inject_ground_truth(batch, groups, torch.tensor([0.0, 0.0, 1.0, 0.0]), {9: gt}, split.unsolved)
    assert not injected.any() and out == batch
