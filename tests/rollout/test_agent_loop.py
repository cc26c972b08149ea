"""The search agent loop on scripted policies, and end to end on the embedded servers."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from sorl_megatron.common.http import RequestRejectedError, RetryPolicy, ServerUnavailableError
from sorl_megatron.common.protocol import GenerateOutput
from sorl_megatron.retrieval import BM25Index, Passage
from sorl_megatron.retrieval.client import RetrievalClient
from sorl_megatron.retrieval.server import start_retrieval_server
from sorl_megatron.rollout.agent import (
    INVALID_ACTION_MESSAGE,
    SEARCH_FAILED_MESSAGE,
    SEARCH_REJECTED_MESSAGE,
    AgentConfig,
    SearchAgent,
    parse_action,
)
from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig
from sorl_megatron.rollout.trajectory import collate

LAYERS, TOPK = 2, 2


def fake_logprob(pos: np.ndarray) -> np.ndarray:
    return -(pos.astype(np.float32) + 1) / 1000


def fake_routing(pos: np.ndarray) -> np.ndarray:
    return (pos[:, None, None] * 10 + np.arange(LAYERS)[None, :, None] * 2 + np.arange(TOPK)[None, None, :]).astype(
        np.int32
    )


class ScriptedPolicy:
    """Replies with scripted texts, one per turn; log-prob and routing encode the position."""

    def __init__(self, tokenizer, script: list[str | list[int]], delay: float = 0.0):
        self.tok, self.script, self.delay = tokenizer, script, delay
        self.calls: list[dict] = []
        self.active = self.max_active = 0

    async def generate(
        self,
        input_ids,
        sampling,
        return_logprob=True,
        return_routed_experts=False,
        routed_experts_start_len=0,
        rid=None,
    ):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        await asyncio.sleep(self.delay)
        self.active -= 1
        item = self.script[min(self._turn(input_ids), len(self.script) - 1)]
        ids = item if isinstance(item, list) else self.tok.encode(item, add_special_tokens=False)
        self.calls.append({"input_ids": list(input_ids), "sampling": sampling, "start": routed_experts_start_len})
        finish = {"type": "length", "length": sampling.max_new_tokens}
        if len(ids) > sampling.max_new_tokens:
            ids = ids[: sampling.max_new_tokens]
        elif ids and ids[-1] == self.tok.eos_token_id:
            finish = {"type": "stop", "matched": ids[-1]}
        else:
            text = self.tok.decode(ids)
            hit = next((s for s in sampling.stop if text.endswith(s)), None)
            if hit:
                finish = {"type": "stop", "matched": hit}
        p = len(input_ids)
        pos = np.arange(p, p + len(ids))
        fed = np.arange(routed_experts_start_len, p + len(ids) - 1)
        return [
            GenerateOutput(
                output_ids=ids,
                finish_reason=finish,
                prompt_tokens=p,
                completion_tokens=len(ids),
                weight_version="v7",
                output_logprobs=fake_logprob(pos).tolist(),
                routed_experts=fake_routing(fed) if return_routed_experts else None,
            )
        ]

    def _turn(self, input_ids) -> int:
        # one observation follows every earlier turn of this episode
        text = self.tok.decode(list(input_ids))
        return text.count("</information>") + text.count("My previous action is invalid")


class FakeRetriever:
    def __init__(self):
        self.queries: list[str] = []

    async def retrieve(self, queries, topk=None):
        self.queries.extend(queries)
        return [
            [Passage(str(i), f'"T{i}"\npassage {i} about {q}', 1.0 / (i + 1)) for i in range(topk or 3)]
            for q in queries
        ]


@pytest.fixture
def prompt(tokenizer):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "Question: capital of France?"}], add_generation_prompt=True, return_dict=False
    )


def run_agent(tokenizer, script, prompt, **cfg):
    policy, retriever = ScriptedPolicy(tokenizer, script), FakeRetriever()
    agent = SearchAgent(policy, retriever, tokenizer, AgentConfig(return_routed_experts=True, **cfg))
    traj = asyncio.run(agent.run(prompt, seed=0, meta={"data_source": "nq"}))
    return traj, policy, retriever, agent


def segments(traj):
    """Runs of (loss_mask, turn_id) as (mask, turn, start, end)."""
    out, start = [], 0
    key = list(zip(traj.loss_mask.tolist(), traj.turn_ids.tolist()))
    for i in range(1, len(key) + 1):
        if i == len(key) or key[i] != key[start]:
            out.append((key[start][0], key[start][1], start, i))
            start = i
    return out


def check_alignment(traj, policy):
    pos = np.arange(len(traj))
    pol = traj.loss_mask == 1
    assert np.allclose(traj.rollout_logprobs[pol], fake_logprob(pos[pol]))
    assert (traj.rollout_logprobs[~pol] == 0).all()
    assert np.array_equal(traj.routed_experts[:-1], fake_routing(pos[:-1]))
    assert (traj.routed_experts[-1] == -1).all()
    # every call saw exactly the trajectory's prefix, and asked routing only for positions it lacked
    ends = [len(c["input_ids"]) for c in policy.calls]
    for i, call in enumerate(policy.calls):
        assert call["input_ids"] == traj.token_ids[: ends[i]].tolist()
        if i:
            prev_turn_end = ends[i - 1] + int((traj.turn_ids == i - 1).sum())
            assert call["start"] == prev_turn_end - 1


def test_parse_action():
    assert parse_action("<think>hm</think><search> a b </search>") == ("search", "a b")
    assert parse_action("x <answer>Paris</answer>") == ("answer", "Paris")
    assert parse_action("<search>   </search>") == (None, "")
    assert parse_action("no tags") == (None, "")


def test_the_agent_and_the_reward_read_the_same_answer():
    """Several answer blocks in one turn (a server that ignored the stop strings): the episode's
    answer is the one the reward scores, the last."""
    from sorl_megatron.rewards.qa import extract_answer

    text = "<answer>Lyon</answer> on second thought <answer> Paris </answer><search>x</search>"
    assert parse_action(text) == ("answer", "Paris")
    assert extract_answer(text) == "Paris"
    assert parse_action("<search>a</search><search>b</search>") == ("search", "a")
    assert parse_action("<search>unclosed") == (None, "")


def test_search_then_answer(tokenizer, prompt):
    script = ["<think> look it up </think> <search> capital of France </search>", " <answer> Paris </answer>"]
    traj, policy, retriever, agent = run_agent(tokenizer, script, prompt)
    assert traj.finish_reason == "answer" and traj.answer == "Paris"
    assert traj.num_turns == 2 and traj.num_searches == 1 and retriever.queries == ["capital of France"]
    segs = segments(traj)
    assert [(m, t) for m, t, _, _ in segs] == [(0, -1), (1, 0), (0, -1), (1, 1)]
    assert segs[0][3] == traj.prompt_len == len(prompt)
    obs = tokenizer.decode(traj.token_ids[segs[2][2] : segs[2][3]].tolist())
    assert obs.startswith("\n\n<information>Doc 1(Title: \"T0\") passage 0 about capital of France\n")
    assert obs.endswith("</information>\n\n") and "Doc 3(Title:" in obs
    assert tokenizer.decode(traj.token_ids[segs[1][2] : segs[1][3]].tolist()).endswith("</search>")
    check_alignment(traj, policy)
    assert policy.calls[1]["start"] == segs[1][3] - 1  # routing of turn 0 already known up to its last token
    assert "<answer> Paris </answer>" in traj.response_text and traj.weight_versions == ["v7", "v7"]


def test_invalid_action_gets_correction(tokenizer, prompt):
    traj, policy, retriever, _ = run_agent(
        tokenizer, ["I am not sure.", "<answer> x </answer>"], prompt, max_turn_tokens=50
    )
    assert traj.finish_reason == "answer" and traj.num_searches == 0 and retriever.queries == []
    segs = segments(traj)
    assert tokenizer.decode(traj.token_ids[segs[2][2] : segs[2][3]].tolist()) == INVALID_ACTION_MESSAGE
    check_alignment(traj, policy)


def test_max_turns_last_search_not_executed(tokenizer, prompt):
    traj, policy, retriever, _ = run_agent(tokenizer, ["<search> q </search>"], prompt, max_turns=3)
    assert traj.finish_reason == "max_turns" and traj.num_turns == 3 and traj.num_searches == 2
    assert len(retriever.queries) == 2 and traj.loss_mask[-1] == 1  # ends on a policy turn
    assert [t for m, t, _, _ in segments(traj) if m == 1] == [0, 1, 2]
    check_alignment(traj, policy)


def test_eos_ends_episode(tokenizer, prompt):
    traj, policy, _, _ = run_agent(tokenizer, [tokenizer.encode("hello") + [tokenizer.eos_token_id]], prompt)
    assert traj.finish_reason == "eos" and traj.num_turns == 1 and traj.answer is None


def test_turn_budget_and_total_length_truncation(tokenizer, prompt):
    long_text = "the quick brown fox " * 40
    traj, policy, _, _ = run_agent(
        tokenizer, [long_text], prompt, max_turn_tokens=16, max_total_tokens=len(prompt) + 80, max_turns=10
    )
    assert traj.finish_reason == "max_length" and len(traj) <= len(prompt) + 80
    budgets = [c["sampling"].max_new_tokens for c in policy.calls]
    assert budgets[0] == 16 and all(b <= 16 for b in budgets)
    lens = [e - s for m, _, s, e in segments(traj) if m == 1]
    assert lens[0] == 16  # a turn cut by its budget is an invalid action -> correction follows
    check_alignment(traj, policy)


def test_observation_truncated_with_tags(tokenizer, prompt):
    traj, _, _, agent = run_agent(tokenizer, ["<search> q </search>", "<answer>a</answer>"], prompt, max_obs_tokens=30)
    obs_seg = segments(traj)[2]
    assert obs_seg[3] - obs_seg[2] == 30
    text = tokenizer.decode(traj.token_ids[obs_seg[2] : obs_seg[3]].tolist())
    assert text.startswith("\n\n<information>") and text.endswith("</information>\n\n")


def test_run_many_concurrent_and_collate(tokenizer, prompt):
    policy = ScriptedPolicy(tokenizer, ["<search> q </search>", "<answer> a </answer>"], delay=0.05)
    agent = SearchAgent(policy, FakeRetriever(), tokenizer, AgentConfig(return_routed_experts=True))
    prompts = [prompt, prompt[:-3] + prompt[-3:], tokenizer.encode("short")]
    trajs = asyncio.run(agent.run_many(prompts, n=2, seed=1, metas=[{"i": 0}, {"i": 1}, {"i": 2}]))
    assert len(trajs) == 6 and policy.max_active > 1
    assert [(t.meta["prompt_index"], t.meta["sample_index"]) for t in trajs] == [
        (i, j) for i in range(3) for j in range(2)
    ]
    batch = collate(trajs, pad_token_id=tokenizer.pad_token_id)
    width = max(len(t) for t in trajs)
    assert batch["input_ids"].shape == (6, width) and batch["routed_experts"].shape == (6, width, LAYERS, TOPK)
    short = int(np.argmin([len(t) for t in trajs]))
    n = len(trajs[short])
    assert (batch["input_ids"][short, n:] == tokenizer.pad_token_id).all()
    assert (batch["loss_mask"][short, n:] == 0).all() and (batch["turn_ids"][short, n:] == -1).all()
    assert (batch["rollout_logprobs"][short, n:] == 0).all()
    # the routes are packed (each row's real tokens, in the smallest type that holds them: the fake
    # ids here reach 1013, so int16) and read as the dense int32 tensor they stand for: -1 past each row's end
    routes = batch["routed_experts"]
    assert routes.values.dtype == torch.int16 and routes.values.shape == (sum(len(t) for t in trajs), LAYERS, TOPK)
    dense = torch.full((6, width, LAYERS, TOPK), -1, dtype=torch.int32)
    for i, t in enumerate(trajs):
        dense[i, : len(t)] = torch.from_numpy(t.routed_experts.astype(np.int32))
    assert torch.equal(routes[torch.arange(6)], dense) and (dense[short, n - 1 :] == -1).all()
    assert torch.equal(routes[torch.tensor([5, 2])], dense[[5, 2]])
    assert torch.equal(batch["loss_mask"][short, :n], torch.from_numpy(trajs[short].loss_mask).long())
    assert batch["seq_lens"].tolist() == [len(t) for t in trajs] and batch["num_searches"].tolist() == [1] * 6
    assert batch["attention_mask"].sum().item() == sum(len(t) for t in trajs)


def test_end_to_end_on_embedded_servers(moe_server, moe_model, tokenizer, prompt, teacher_forced):
    """Real HTTP: tiny MoE server + BM25 server; log-probs and routing align with a forward pass."""
    index = BM25Index(
        [Passage("0", '"Paris"\nParis is the capital of France.'), Passage("1", '"Rome"\nRome is in Italy.')]
    )
    retrieval = start_retrieval_server(index)

    async def go():
        async with (
            RolloutClient(RolloutClientConfig(urls=(moe_server.url,), routing_shape=(2, 2))) as policy,
            RetrievalClient(retrieval.url) as retr,
        ):
            agent = SearchAgent(
                policy,
                retr,
                tokenizer,
                AgentConfig(max_turns=3, max_turn_tokens=12, topk=2, return_routed_experts=True),
            )
            return await agent.run_many([prompt, prompt[:5]], n=2, seed=3)

    try:
        trajs = asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        retrieval.stop()
    assert any(t.num_turns > 1 for t in trajs)  # random policy: invalid actions, corrections, more turns
    for traj in trajs:
        assert traj.num_turns >= 1 and traj.finish_reason in {"answer", "eos", "max_turns", "max_length"}
        ids = traj.token_ids.tolist()
        ref_lp, routing = teacher_forced(moe_model, ids)
        pol = np.flatnonzero(traj.loss_mask)
        assert np.abs(ref_lp.numpy()[pol - 1] - traj.rollout_logprobs[pol]).max() <= 1e-5
        assert np.array_equal(traj.routed_experts[:-1], routing.numpy())
        if traj.num_turns > 1:  # an observation sits between turns
            assert (traj.loss_mask[traj.prompt_len :] == 0).any()


# -- the loop survives its environment (issue 15, class 4) ---------------------------------

FAST_RETRY = RetryPolicy(timeout_s=5.0, connect_timeout_s=1.0, retries=1, backoff_s=0.05, retry_on_timeout=True)


class ByPromptPolicy:
    """One ScriptedPolicy per prompt (keyed by its first token); an exception in a script is raised."""

    def __init__(self, tokenizer, scripts: dict[int, list], delay: float = 0.0):
        self.policies = {k: ScriptedPolicy(tokenizer, v, delay) for k, v in scripts.items()}
        self.calls: list[int] = []

    async def generate(self, input_ids, sampling, **kw):
        policy = self.policies[input_ids[0]]
        self.calls.append(input_ids[0])
        item = policy.script[min(policy._turn(input_ids), len(policy.script) - 1)]
        if isinstance(item, Exception):
            raise item
        return await policy.generate(input_ids, sampling, **kw)


def _paris_index():
    return BM25Index(
        [Passage("0", '"Paris"\nParis is the capital of France.'), Passage("1", '"Rome"\nRome is in Italy.')]
    )


def test_rejected_and_failed_searches_become_observations(tokenizer):
    """A query over the real retrieval server's 4096-character limit gets HTTP 400: that
    episode sees a rejection observation and goes on; the other episodes are untouched. Then
    the server is gone: the search fails after the client's retries, also as an observation.
    Neither ends run_many; both are counted."""
    retrieval = start_retrieval_server(_paris_index())
    long_query = "capital of France " * 300  # 5400 characters
    a, b = tokenizer.encode("Question: long"), tokenizer.encode("entity 3 lives")
    scripts = {
        a[0]: [f"<search> {long_query} </search>", "<answer> Paris </answer>"],
        b[0]: ["<search> capital of France </search>", "<answer> Paris </answer>"],
    }
    assert a[0] != b[0]
    cfg = AgentConfig(max_turns=3, max_turn_tokens=4000, max_total_tokens=8192, topk=1)

    async def go():
        async with RetrievalClient(retrieval.url, policy=FAST_RETRY) as retr:
            agent = SearchAgent(ByPromptPolicy(tokenizer, scripts), retr, tokenizer, cfg)
            return await agent.run_many([a, b], n=2, seed=0)

    try:
        trajs = asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        retrieval.stop()
    rejected, served = trajs[:2], trajs[2:]
    for t in rejected:
        assert t.finish_reason == "answer" and t.num_searches == 1
        assert (t.retrieval_errors, t.retrieval_rejected) == (1, 1)
        assert "HTTP 400" in t.meta["retrieval_error"] and "max-query-chars" in t.meta["retrieval_error"]
        obs = tokenizer.decode(t.token_ids[segments(t)[2][2] : segments(t)[2][3]].tolist())
        assert obs == f"\n\n<information>{SEARCH_REJECTED_MESSAGE}</information>\n\n"
    for t in served:
        assert t.finish_reason == "answer" and t.retrieval_errors == 0
        assert "Paris is the capital of France" in t.response_text

    # the retrieval server is stopped now: connection refused, after the retries
    async def dead():
        async with RetrievalClient(retrieval.url, policy=FAST_RETRY) as retr:
            agent = SearchAgent(ByPromptPolicy(tokenizer, scripts), retr, tokenizer, cfg)
            return await agent.run_many([b], n=2, seed=0)

    t0 = time.monotonic()
    trajs = asyncio.run(asyncio.wait_for(dead(), 60))
    assert time.monotonic() - t0 < 30  # bounded by the retry policy, generous
    for t in trajs:
        assert t.finish_reason == "answer" and (t.retrieval_errors, t.retrieval_rejected) == (1, 0)
        assert "ServerUnavailableError" in t.meta["retrieval_error"]
        assert SEARCH_FAILED_MESSAGE in t.response_text


def test_retrieval_server_errors_after_retries_are_counted_in_rollout_metrics(tokenizer):
    """A retrieval server that answers 500: after the retries, each search is a failed
    observation, and the rollout phase reports rollout/retrieval_errors."""
    from aiohttp import web

    from sorl_megatron.common.background import BackgroundServer
    from sorl_megatron.data.qa import QARow
    from sorl_megatron.rewards import RewardRegistry
    from sorl_megatron.trainer.groups.rollouts import collect_rollouts

    calls = []

    async def broken(request):
        calls.append(1)
        return web.json_response({"error": "index on fire"}, status=500)

    app = web.Application()
    app.router.add_post("/retrieve", broken)
    server = BackgroundServer(app, "127.0.0.1", 0).start()
    # (a prompt without the instruction's tags: ScriptedPolicy counts turns by tags)
    rows = [QARow("nq", [{"role": "user", "content": "Question: capital of France?"}], ["Paris"])]
    policy = ScriptedPolicy(tokenizer, ["<search> capital of France </search>", "<answer> Paris </answer>"])

    async def go():
        async with RetrievalClient(server.url, policy=FAST_RETRY) as retr:
            agent = SearchAgent(policy, retr, tokenizer, AgentConfig(max_turns=3, max_turn_tokens=50))
            return await collect_rollouts(agent, tokenizer, rows, [0], n=3, rewards=RewardRegistry())

    try:
        res = asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        server.stop()
    assert len(calls) == 3 * 2  # each search tried twice (retries=1)
    assert res.metrics["rollout/retrieval_errors"] == 3.0 and res.metrics["rollout/retrieval_rejected"] == 0.0
    assert res.metrics["rollout/finish_answer"] == 1.0 and res.rewards.tolist() == [1.0] * 3
    assert all("HTTP 500" in t.meta["retrieval_error"] for t in res.trajectories)


def test_a_rejected_generation_fails_only_its_episode(tokenizer):
    a, b = tokenizer.encode("Question: long"), tokenizer.encode("entity 3 lives")
    scripts = {
        a[0]: ["<search> q </search>", RequestRejectedError("POST /generate -> HTTP 400: too long", 400)],
        b[0]: ["<answer> Paris </answer>"],
    }
    agent = SearchAgent(ByPromptPolicy(tokenizer, scripts), FakeRetriever(), tokenizer, AgentConfig())
    trajs = asyncio.run(agent.run_many([a, b], n=1))
    assert trajs[0].finish_reason == "error" and "HTTP 400" in trajs[0].meta["error"]
    assert trajs[0].num_turns == 1 and trajs[0].turn_texts == ["<search> q </search>"]
    assert trajs[1].finish_reason == "answer"


def test_refused_episodes_are_logged_and_a_run_all_refused_raises_the_first(tokenizer, caplog):
    """A refusal that hits every episode (a server flag, a protocol mismatch) is the run's error,
    never a batch of silent zero-turn episodes; some refused among others are logged."""
    a, b = tokenizer.encode("Question: long"), tokenizer.encode("entity 3 lives")
    refusal = RequestRejectedError("POST /generate -> HTTP 400: stop strings need a tokenizer", 400)
    scripts = {a[0]: [refusal], b[0]: [refusal]}
    agent = SearchAgent(ByPromptPolicy(tokenizer, scripts), FakeRetriever(), tokenizer, AgentConfig())
    with pytest.raises(RequestRejectedError, match=r"every episode \(2\) ended with a refused /generate.*stop strings"):
        asyncio.run(agent.run_many([a, b], n=1))
    scripts = {a[0]: [refusal], b[0]: ["<answer> Paris </answer>"]}
    agent = SearchAgent(ByPromptPolicy(tokenizer, scripts), FakeRetriever(), tokenizer, AgentConfig())
    with caplog.at_level("WARNING"):
        trajs = asyncio.run(agent.run_many([a, b], n=1))
    assert [t.finish_reason for t in trajs] == ["error", "answer"]
    assert "1 of 2 episodes ended with a refused /generate request" in caplog.text


def test_a_dead_rollout_server_ends_run_many_and_cancels_the_rest(tokenizer):
    a, b = tokenizer.encode("Question: long"), tokenizer.encode("entity 3 lives")
    scripts = {a[0]: [ServerUnavailableError("POST /generate is unreachable")], b[0]: ["<search> q </search>"]}
    policy = ByPromptPolicy(tokenizer, scripts, delay=0.2)
    agent = SearchAgent(policy, FakeRetriever(), tokenizer, AgentConfig(max_turns=50))

    async def go():
        with pytest.raises(ServerUnavailableError, match="unreachable"):
            await agent.run_many([a, b], n=2)
        calls = len(policy.calls)
        await asyncio.sleep(0.5)  # the other episodes were cancelled: no more calls
        return calls

    calls = asyncio.run(go())
    assert len(policy.calls) == calls == 4  # the first turn of each episode, nothing after
    assert policy.policies[b[0]].calls == []  # the slow episodes were cancelled inside their first turn


def test_a_wrong_retrieval_url_is_a_setup_error_not_an_observation(tokenizer):
    """404 refuses every query alike (wrong URL): raised, naming the URL, not hidden in observations."""
    from aiohttp import web

    from sorl_megatron.common.background import BackgroundServer

    server = BackgroundServer(web.Application(), "127.0.0.1", 0).start()  # no /retrieve route
    policy = ScriptedPolicy(tokenizer, ["<search> capital of France </search>", "<answer> Paris </answer>"])

    async def go():
        async with RetrievalClient(server.url + "/v1", policy=FAST_RETRY) as retr:
            agent = SearchAgent(policy, retr, tokenizer, AgentConfig(max_turns=3, max_turn_tokens=50))
            return await agent.run_many([tokenizer.encode("Question: capital of France?")], n=2)

    try:
        with pytest.raises(RequestRejectedError, match=r"/v1/retrieve -> HTTP 404"):
            asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        server.stop()
