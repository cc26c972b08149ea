"""Rewards read only what the policy wrote (issue 15, class 2).

The agent loop runs with a scripted policy against the real BM25 retrieval server; the
trainer's scoring path (``collect_rollouts``) scores the episodes. Tags inside environment
messages and retrieved passages must never count as the policy's answer or format.
"""

from __future__ import annotations

import asyncio

import pytest

from sorl_megatron.common.protocol import GenerateOutput
from sorl_megatron.data.qa import make_row
from sorl_megatron.data.tokenizer import train_tokenizer
from sorl_megatron.retrieval import BM25Index, Passage, RetrievalClient
from sorl_megatron.retrieval.server import start_retrieval_server
from sorl_megatron.rewards import ACTION_TAG_RE, RewardRegistry, exact_match, extract_answer, is_well_formed
from sorl_megatron.rollout.agent import (
    INVALID_ACTION_MESSAGE,
    SEARCH_FAILED_MESSAGE,
    SEARCH_REJECTED_MESSAGE,
    AgentConfig,
    SearchAgent,
)
from sorl_megatron.trainer.groups.rollouts import collect_rollouts


@pytest.fixture(scope="module")
def tok():
    texts = ["<think> x </think> <search> who wrote it </search> <answer> Romeo and Juliet </answer>",
             "<information> Doc 1(Title: Play) Shakespeare wrote Romeo and Juliet. </information>",
             "Answer the given question. Question: who wrote Romeo and Juliet? I am not sure."] * 30
    return train_tokenizer(texts, vocab_size=320)


class Scripted:
    """Turn t of every episode replies ``script[t]`` (the last entry repeats)."""

    def __init__(self, tok, script):
        self.tok, self.script, self.turn = tok, script, {}

    async def generate(self, input_ids, sampling, return_logprob=True, return_routed_experts=False,
                       routed_experts_start_len=0, rid=None):
        key = tuple(input_ids[:8])
        t = self.turn.get(key, 0)
        self.turn[key] = t + 1
        ids = self.tok.encode(self.script[min(t, len(self.script) - 1)], add_special_tokens=False)
        ids = ids[: sampling.max_new_tokens]
        return [GenerateOutput(output_ids=ids, finish_reason={"type": "length", "length": len(ids)},
                               prompt_tokens=len(input_ids), completion_tokens=len(ids), weight_version="v",
                               output_logprobs=[-0.1] * len(ids))]


def score(tok, script, retriever, target, **registry):
    row = make_row("who wrote Romeo and Juliet?", [target], "nq", "train", 0)
    agent = SearchAgent(Scripted(tok, script), retriever, tok,
                        AgentConfig(max_turns=3, max_turn_tokens=40, max_total_tokens=2048, max_obs_tokens=200))
    res = asyncio.run(collect_rollouts(agent, tok, [row], [0], n=1, rewards=RewardRegistry(**registry)))
    return res.rewards[0].item(), res.trajectories[0]


class NoRetriever:
    async def retrieve(self, queries, topk=None):
        raise AssertionError("no search expected")


def test_invalid_action_message_is_not_an_answer(tok):
    """Issue reproducer: the correction message used to contain <answer> and </answer>, so an
    episode that never answered got the answer "and" (F1 0.5 vs "Romeo and Juliet") and the
    format reward."""
    reward, traj = score(tok, ["I am not sure."], NoRetriever(), "Romeo and Juliet", metric_override="f1",
                         format_weight=0.2)
    assert traj.finish_reason == "max_turns" and traj.answer is None
    assert "My previous action is invalid" in traj.response_text  # the message is in the episode ...
    assert reward == 0.0  # ... but scores nothing


def test_retrieved_answer_tag_does_not_score():
    """Issue reproducer: a retrieved passage with <answer>X</answer> scored EM 1.0 although the
    policy never answered. Real retrieval server, real client."""
    texts = ["<search> who wrote it </search> Shakespeare <answer> William Shakespeare </answer>"] * 30
    tok = train_tokenizer(texts + ["Answer the given question. Question: who wrote Romeo and Juliet? hm"] * 30,
                          vocab_size=320)
    index = BM25Index([Passage("0", '"Play"\nWho wrote it? <answer>William Shakespeare</answer>'),
                       Passage("1", '"Other"\nnothing here')])
    server = start_retrieval_server(index)

    async def go(script):
        async with RetrievalClient(server.url) as retriever:
            row = make_row("who wrote Romeo and Juliet?", ["William Shakespeare"], "nq", "train", 0)
            agent = SearchAgent(Scripted(tok, script), retriever, tok, AgentConfig(max_turns=2, max_turn_tokens=40))
            return await collect_rollouts(agent, tok, [row], [0], n=1, rewards=RewardRegistry(format_weight=0.2))

    try:
        searched = asyncio.run(go(["<search> who wrote it </search>"]))
        answered = asyncio.run(go(["<search> who wrote it </search>", "<answer> William Shakespeare </answer>"]))
    finally:
        server.stop()
    traj = searched.trajectories[0]
    assert traj.num_searches == 1 and "<answer>William Shakespeare</answer>" in traj.response_text
    assert traj.finish_reason == "max_turns" and searched.rewards.tolist() == [0.0]
    assert answered.rewards.tolist() == [1.0]  # the policy's own answer (and format) still score


def test_turn_texts_are_the_policy_spans(tok):
    _, traj = score(tok, ["<search> who wrote it </search>", "I am not sure.", "<answer> Romeo </answer>"],
                    FixedRetriever(), "Romeo")
    spans = traj.policy_spans()
    assert len(spans) == traj.num_turns == len(traj.turn_texts) == 3
    assert [tok.decode(traj.token_ids[s:e].tolist(), skip_special_tokens=False) for s, e in spans] == traj.turn_texts
    assert traj.turn_texts[-1] == "<answer> Romeo </answer>" and traj.answer == "Romeo"


class FixedRetriever:
    async def retrieve(self, queries, topk=None):
        return [[Passage("0", '"T"\n<answer>Romeo</answer> <search>x</search>')] for _ in queries]


def test_environment_messages_carry_no_action_tags():
    for message in (INVALID_ACTION_MESSAGE, SEARCH_REJECTED_MESSAGE, SEARCH_FAILED_MESSAGE):
        assert not ACTION_TAG_RE.search(message), message


def test_answer_and_format_come_from_policy_turns_only():
    # an <answer> cut off by one turn's budget and a </answer> in the next is no answer
    assert extract_answer(["<answer> Par", "is </answer>"]) is None
    assert extract_answer(["<search>q</search>", "<answer> Paris </answer>"]) == "Paris"
    assert is_well_formed(["<think>a</think> <search>q</search>", "<answer>x</answer>"])
    assert not is_well_formed(["<search>q</search>"])  # never answered
    assert not is_well_formed(["I am not sure.", "<answer>x</answer>"])  # an invalid turn
    assert not is_well_formed(["<information>fake</information><answer>x</answer>"])  # policy fakes an observation
    assert not is_well_formed(["<answer>x</answer>", "<answer>y</answer>"])
    assert not is_well_formed(["<search>q</search><answer>x</answer>"])  # two actions in one turn
    assert not is_well_formed([])


def test_empty_answers_never_match():
    assert exact_match("", [""]) == 0.0 and exact_match("the", ["a"]) == 0.0
    assert RewardRegistry().score("nq", ["<answer> </answer>"], {"target": [""]}) == 0.0


@pytest.mark.parametrize("source", [None, 3, ""])
def test_null_or_numeric_data_source_is_an_error_even_with_a_default(source):
    with pytest.raises(KeyError, match="data_source must be a non-empty string"):
        RewardRegistry(default="em").score(source, ["<answer>x</answer>"], ["x"])
