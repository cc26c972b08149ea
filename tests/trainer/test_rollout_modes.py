"""Rollout modes (issue 19): partial rollouts across a weight update, one_step_off, async with
its staleness bound, dynamic sampling, and kill -9 / resume of an async run.

Real embedded servers on 127.0.0.1 and the tiny synthetic Qwen3-MoE of test_e2e.py. The
staleness bound is asserted from what the run logs (``episodes.jsonl``: every group a step drew,
each episode's per-turn weight versions and the trainer's version), never from timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sorl_megatron.common.hf_build import HF_BUILD_LOCK
from sorl_megatron.rewards.registry import RewardRegistry

from .e2e_helpers import (
    BASE_RECIPE,
    ROOT,
    abs_tol,
    assert_finite,
    comparable,
    make_tiny_data,
    read_metrics,
    run_overrides,
    shared_embedded_servers,
    subprocess_env,
)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return make_tiny_data(tmp_path_factory.mktemp("modes_data"))


@pytest.fixture(scope="module")
def servers(tiny_data, tmp_path_factory):
    """One rollout server (routed experts on, for R3) and one retrieval server."""
    with shared_embedded_servers(tiny_data, tmp_path_factory.mktemp("modes_servers")) as servers:
        yield servers


class HalfConstantReward(RewardRegistry):
    """Crafted: prompts whose first target has an even length always score 0.5 (a group with no
    GRPO signal, which dynamic sampling drops); the others score the response length mod 5."""

    def score(self, data_source, response, ground_truth):
        target = ground_truth["target"]
        first = str(target[0] if isinstance(target, (list, tuple, np.ndarray)) else target)
        if len(first) % 2 == 0:
            return 0.5
        return (len("".join(response)) % 5) / 4


def _episodes(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "episodes.jsonl").read_text().splitlines() if x.strip()]


# ------------------------------------------------------------- 1. a partial rollout, token by token


def _reference_model(path: Path, state: dict):
    """transformers' model of a checkpoint (tied LM head), checked against the file."""
    from transformers import AutoModelForCausalLM

    with HF_BUILD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loaded = model.state_dict()
    differ = [k for k, v in state.items() if k in loaded and not torch.equal(loaded[k], v)]
    assert not differ, f"transformers loaded {path} with tensors unlike the file: {differ[:5]}"
    assert model.lm_head.weight is model.model.embed_tokens.weight, f"transformers left {path}'s LM head untied"
    return model


def test_partial_rollout_across_a_weight_update(tiny_data, servers, tmp_path):
    """Weights change between an episode's turns (what a weight update in the middle of an
    async step does to an episode in flight): each turn's tokens carry the version that sampled
    them, their behaviour log-probs are that version's (recomputed here with transformers), and
    R3's routes of each turn's positions carry the version that routed them."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from sorl_megatron.bridge.families import routing_shape
    from sorl_megatron.bridge.hf_config import load_hf_config
    from sorl_megatron.data.qa import encode_prompt, read_parquet
    from sorl_megatron.retrieval.client import RetrievalClient
    from sorl_megatron.rollout.agent import AgentConfig, SearchAgent
    from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig
    from sorl_megatron.weight_sync.tensor import send_tensors

    tok = AutoTokenizer.from_pretrained(tiny_data / "model")
    src = tiny_data / "model"
    state0 = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}  # HF names
    gen = torch.Generator().manual_seed(0)
    state1 = {k: v + torch.randn(v.shape, generator=gen) * 0.05 for k, v in state0.items()}
    perturbed = tmp_path / "model1"
    shutil.copytree(src, perturbed)
    for f in perturbed.glob("*.safetensors"):
        f.unlink()
    save_file(state1, perturbed / "model.safetensors")
    model0, model1 = _reference_model(src, state0), _reference_model(perturbed, state1)
    rows = read_parquet(str(tiny_data / "train.parquet"))

    def weights(state):
        return sorted(state.items())

    class UpdateAfterFirstTurn:
        """The policy: the real client, which pushes version 1 after the episode's first turn."""

        def __init__(self, client):
            self.client, self.calls = client, 0

        async def generate(self, *args, **kwargs):
            out = await self.client.generate(*args, **kwargs)
            self.calls += 1
            if self.calls == 1:
                await send_tensors(self.client, weights(state1), "step_1")
            return out

    async def episode(seed):
        shape = routing_shape(load_hf_config(str(tiny_data / "model")))  # R3's shape: the model's config.json
        client = RolloutClient(RolloutClientConfig(urls=(servers["rollout"],), routing_shape=shape))
        retriever = RetrievalClient(servers["retrieval"], topk=2)
        try:
            await send_tensors(client, weights(state0), "step_0")
            agent = SearchAgent(UpdateAfterFirstTurn(client), retriever, tok, AgentConfig(
                max_turns=2, max_turn_tokens=12, max_total_tokens=340, max_obs_tokens=32, topk=2,
                return_routed_experts=True))
            return await agent.run(encode_prompt(tok, rows[seed % len(rows)]), seed=seed)
        finally:
            await client.close()
            await retriever.close()

    two_turns = None
    for seed in range(8):  # the random policy sometimes ends at its first turn (EOS): take one that goes on
        traj = asyncio.run(episode(seed))
        if traj.num_turns == 2:
            two_turns = traj
            break
    assert two_turns is not None, "no two-turn episode in 8 seeds"
    t = two_turns
    assert t.weight_versions == ["step_0", "step_1"]
    (a0, b0), (a1, b1) = t.policy_spans()
    assert (t.token_versions[a0:b0] == 0).all() and (t.token_versions[a1:b1] == 1).all()
    assert (t.token_versions[t.loss_mask == 0] == -1).all() and t.oldest_version == 0
    ids = torch.as_tensor(t.token_ids)[None]
    with torch.no_grad():
        lp = {v: torch.log_softmax(m(ids).logits[0].float(), -1) for v, m in ((0, model0), (1, model1))}
    behaviour = torch.as_tensor(t.rollout_logprobs)
    for (a, b), v in (((a0, b0), 0), ((a1, b1), 1)):
        pos = torch.arange(a, b)
        truth = lp[v][pos - 1, ids[0, pos]]
        other = lp[1 - v][pos - 1, ids[0, pos]]
        assert torch.allclose(behaviour[a:b], truth, atol=1e-3), (v, behaviour[a:b], truth)
        assert not torch.allclose(behaviour[a:b], other, atol=1e-3)  # the versions really differ
    # R3: the first request routed positions [0, b0 - 1) under version 0; the second, fed
    # from there to the end of turn 1 (observation included), under version 1
    rv = t.routing_versions
    assert (rv[: b0 - 1] == 0).all() and (rv[b0 - 1 : b1 - 1] == 1).all() and (rv[b1 - 1 :] == -1).all()
    assert (t.routed_experts[: b1 - 1] >= 0).all()


# ------------------------------------------------- 2. one_step_off, with dynamic sampling and PVPO


def test_one_step_off_lags_one_version_with_dynamic_sampling(tiny_data, servers, tmp_path, monkeypatch):
    """Step k+1's batch is generated while step k trains, on step k's weights: step 1 trains on a
    fresh batch (lag 0), every later step on a batch exactly one version old (the bound). Dynamic
    sampling drops the groups whose rewards are all equal and refills the batch; its counts agree
    with the logged groups; overlong episodes are penalized."""
    monkeypatch.setattr("sorl_megatron.trainer.rl_loop.RewardRegistry", HalfConstantReward)
    from sorl_megatron.trainer.recipe.loader import load_recipe
    from sorl_megatron.trainer.rl_loop import RLTrainer

    name = "one_step_off"
    trainer = RLTrainer(load_recipe(BASE_RECIPE, run_overrides(
        tiny_data, tmp_path, name, "schedule.total_steps=3", "rollout.mode=one_step_off",
        "rollout.dynamic_sampling=true", "rollout.overlong=penalty", "rollout.overlong_buffer=16",
        "algorithm.loss.name=grpo", "algorithm.advantage.estimator=grpo",
        "algorithm.loss.is_correction.mode=tis", *servers["overrides"])))
    trainer.run()
    metrics = read_metrics(tmp_path / name)
    rows = _episodes(tmp_path / name)
    for step in (1, 2, 3):
        m = metrics[step]
        assert_finite(m, f"step {step}")
        mine = [r for r in rows if r["step"] == step]
        trained = [r for r in mine if r["status"] == "trained"]
        assert len(trained) == 2 and all(len(r["turn_versions"]) == 2 for r in trained)
        lags = {r["trainer_version"] - v for r in trained for turns in r["turn_versions"] for v in turns}
        assert lags == ({0} if step == 1 else {1}), (step, lags)
        assert m["rollout/version_lag_max"] == (0 if step == 1 else 1)
        assert m["rollout/version_lag_frac_0" if step == 1 else "rollout/version_lag_frac_1"] == 1.0
        equal = [r for r in mine if r["status"] == "equal_reward"]
        assert all(len(set(r["rewards"])) == 1 for r in equal)
        assert m["rollout/groups_dropped_equal_reward"] == len(equal)
        assert m["rollout/groups_drawn"] == len(mine)
        if not m["rollout/groups_refilled_equal_reward"]:
            assert all(len(set(r["rewards"])) > 1 for r in trained)
        assert m["time/trainer_idle"] >= 0 and m["time/server_idle"] >= 0 and "time/step_wall" in m
    assert sum(metrics[s]["rollout/groups_dropped_equal_reward"] for s in (1, 2, 3)) > 0  # the filter ran
    groups = [r["group"] for r in rows]
    assert len(groups) == len(set(groups))  # no group drawn twice
    assert sorted(groups) == list(range(len(groups)))  # nor any skipped


def test_a_lagged_run_resumes_as_the_uninterrupted_one(tiny_data, servers, tmp_path):
    """lag 2, 4 steps, R3. Run A uninterrupted; run B stopped after its step-2 checkpoint (the
    batches of steps 3 and 4, generated on the weights of steps 1 and 2, wait in its pipeline) and
    resumed: steps 3-4 train on A's groups with A's tokens, versions (lag 2, not the 0 and 1 of a
    refilled pipeline), rewards and every logged number; nothing pickled is in the checkpoint."""
    from sorl_megatron.trainer.recipe.loader import load_recipe
    from sorl_megatron.trainer.rl_loop import RLTrainer
    from sorl_megatron.trainer.sources.pending_batches import ARRAYS_FILE, JSON_FILE

    def trainer(name):
        return RLTrainer(load_recipe(BASE_RECIPE, run_overrides(
            tiny_data, tmp_path, name, "schedule.total_steps=4", "rollout.mode=lagged", "rollout.lagged.lag=2",
            "rollout.staleness.max=2", "algorithm.routing_replay=r3", "checkpoint.save_every=1",
            "checkpoint.keep_last=4", "algorithm.loss.name=grpo", "algorithm.advantage.estimator=grpo",
            *servers["overrides"])))

    trainer("full").run()
    stopped = trainer("resumed")
    original = stopped.step

    def stop_at_step_3(step):
        if step == 2:
            raise KeyboardInterrupt  # after step 2's checkpoint, before step 3 takes its batch
        return original(step)

    stopped.step = stop_at_step_3
    with pytest.raises(KeyboardInterrupt):
        stopped.run()
    ckpt = tmp_path / "resumed" / "ckpt" / "step_2"
    assert (ckpt / JSON_FILE).is_file() and (ckpt / ARRAYS_FILE).is_file()
    assert not list(ckpt.rglob("*.pkl")) and not list((ckpt / "rollout").glob("*.pt"))
    pending = json.loads((ckpt / JSON_FILE).read_text())
    assert len(pending["batches"]) == 2  # steps 3 and 4
    trainer("resumed").run()

    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "resumed")
    assert sorted(full) == sorted(resumed) == [0, 1, 2, 3, 4]
    a_rows, b_rows = _episodes(tmp_path / "full"), _episodes(tmp_path / "resumed")
    assert [r for r in a_rows if r["step"] >= 3] == [r for r in b_rows if r["step"] >= 3]
    for step in (1, 2, 3, 4):
        assert full[step]["rollout/version_lag_max"] == resumed[step]["rollout/version_lag_max"] == min(step - 1, 2)
        a, b = comparable(full[step]), comparable(resumed[step])
        assert a.keys() == b.keys(), (step, a.keys() ^ b.keys())
        diff = {k: (a[k], b[k]) for k in a if not np.isclose(a[k], b[k], rtol=1e-6, atol=abs_tol(k))}
        assert not diff, f"step {step} differs from the uninterrupted run: {diff}"


# --------------------------------------------- 3. async: staleness, R3, kill -9 and resume


def test_pending_batches_round_trip_without_pickle(tmp_path):
    """What a lagged run's checkpoint keeps of the batches generated ahead comes back equal:
    arrays (routes included), absent arrays, texts, meta, rewards, PVPO marks, dropped groups
    with why, counts and the next group id; another format is refused naming the file."""
    from sorl_megatron.rollout.trajectory import Trajectory
    from sorl_megatron.trainer.groups.producer import Group
    from sorl_megatron.trainer.sources.pending_batches import ARRAYS_FILE, JSON_FILE, decode, encode

    def traj(n, routes):
        return Trajectory(token_ids=np.arange(n, dtype=np.int64),
                          loss_mask=np.r_[np.zeros(2), np.ones(n - 2)].astype(np.int8),
                          turn_ids=np.zeros(n, dtype=np.int32),
                          rollout_logprobs=np.linspace(-3, -0.1, n).astype(np.float32),
                          prompt_len=2, finish_reason="answer", num_turns=1, num_searches=0, answer="Ada",
                          routed_experts=np.arange(n * 4, dtype=np.int32).reshape(n, 2, 2) if routes else None,
                          turn_texts=["<answer>Ada</answer>"], weight_versions=["step_3", None],
                          token_versions=np.full(n, 3, dtype=np.int64),
                          meta={"group": 7, "prompt": np.int64(11), "ground_truth": False})

    kept = Group(7, 11, [traj(5, True), traj(6, False)], rewards=torch.tensor([1.0, 0.25]),
                 injected=torch.tensor([False, True]), finished_at=12.5)
    stale = Group(8, 12, [traj(4, False)])
    batches = [([kept], [(stale, "stale")], {"rollout/groups_drawn": 2.0}), ([], [], {})]
    for rel, data in encode(batches, next_gid=9).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    (back, next_gid) = decode(tmp_path)
    assert next_gid == 9 and len(back) == 2 and back[1] == ([], [], {})
    (accepted, dropped, counts), _ = back
    assert counts == {"rollout/groups_drawn": 2.0} and [(g.gid, why) for g, why in dropped] == [(8, "stale")]
    assert dropped[0][0].rewards is None and dropped[0][0].injected is None
    [group] = accepted
    assert (group.gid, group.prompt, group.finished_at) == (7, 11, 12.5)
    assert torch.equal(group.rewards, kept.rewards) and torch.equal(group.injected, kept.injected)
    for a, b in zip(kept.trajectories, group.trajectories):
        for name in ("token_ids", "loss_mask", "turn_ids", "rollout_logprobs", "token_versions"):
            x, y = getattr(a, name), getattr(b, name)
            assert np.array_equal(x, y) and x.dtype == y.dtype
        assert (b.routed_experts is None) == (a.routed_experts is None) and b.routing_versions is None
        for name in ("answer", "turn_texts", "weight_versions", "meta"):
            assert getattr(b, name) == getattr(a, name), name
    assert np.array_equal(group.trajectories[0].routed_experts, kept.trajectories[0].routed_experts)
    assert group.trajectories[0].meta["prompt"] == 11  # a numpy index saved as the number
    assert decode(tmp_path / "none") == ([], 0)  # a checkpoint without pending batches
    kept.trajectories[0].meta["handle"] = object()
    with pytest.raises(TypeError, match="object is not JSON"):
        encode(batches, next_gid=9)
    assert (tmp_path / ARRAYS_FILE).read_bytes()[:8] != b"\x80\x04\x95"  # not a pickle
    body = json.loads((tmp_path / JSON_FILE).read_text())
    (tmp_path / JSON_FILE).write_text(json.dumps({**body, "format": 99}))
    with pytest.raises(ValueError, match=r"pending.json: pending batches of format 99"):
        decode(tmp_path)


def test_async_staleness_and_resume_after_kill(tiny_data, tmp_path):
    """An async run (R3, rollout.staleness.max 1) in a subprocess, SIGKILLed once its step-2 checkpoint is
    complete while groups are in flight, then resumed to step 4. No trained group is beyond the
    bound; the checkpoint lists as settled exactly the groups steps 1-2 drew; the resumed run
    draws none of them again and regenerates the ones that were in flight or waiting."""
    name = "async"
    args = run_overrides(tiny_data, tmp_path, name, "schedule.total_steps=4", "rollout.mode=async",
                         "rollout.staleness.max=1", "algorithm.routing_replay=r3", "checkpoint.save_every=1",
                         "checkpoint.keep_last=4", "algorithm.loss.is_correction.mode=tis")
    ckpt = tmp_path / name / "ckpt"
    cmd = [sys.executable, "-m", "sorl_megatron.train", "--config", BASE_RECIPE, *args]
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (ckpt / "step_2" / "trainer.json").is_file():
            assert proc.poll() is None, f"the run exited early:\n{(tmp_path / 'killed.log').read_text()[-4000:]}"
            assert time.monotonic() < deadline, "the run did not reach its step-2 checkpoint"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its servers, as a node failure would
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    settled = json.loads((ckpt / "step_2" / "trainer.json").read_text())["extra"]["producer"]
    before = _episodes(tmp_path / name)
    drawn_12 = {r["group"] for r in before if r["step"] <= 2}
    frontier, above = settled["frontier"], set(settled["above"])
    assert {g for g in range(frontier)} | above == drawn_12, (settled, sorted(drawn_12))

    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "resuming run async from step 2 of 4" in proc.stdout + proc.stderr
    metrics = read_metrics(tmp_path / name)
    assert sorted(metrics) == [0, 1, 2, 3, 4]
    rows = _episodes(tmp_path / name)
    assert [r for r in rows if r["step"] <= 2] == [r for r in before if r["step"] <= 2]  # kept as they were
    later = {r["group"] for r in rows if r["step"] > 2}
    assert not later & drawn_12, "the resumed run drew a group a checkpointed step had settled"
    first_unsettled = min(g for g in range(frontier, frontier + len(above) + 1) if g not in above)
    assert first_unsettled in later  # the groups in flight at the kill are drawn again
    for r in rows:  # the bound, from the logged versions
        if r["status"] == "trained":
            assert r["trainer_version"] - r["oldest"] <= 1, r
            assert all(0 <= r["trainer_version"] - v <= 1 for turns in r["turn_versions"] for v in turns), r
        else:
            assert r["status"] == "stale" and r["trainer_version"] - r["oldest"] > 1, r
    for step in (1, 2, 3, 4):
        m = metrics[step]
        assert_finite(m, f"step {step}")
        assert m["rollout/version_lag_max"] <= 1 and m["old/routing/replayed_pairs"] > 0
        assert m["rollout/groups_drawn"] == 2 + m["rollout/groups_dropped_stale"]
        assert m["rollout/episodes_dropped_stale"] == 2 * m["rollout/groups_dropped_stale"]
        assert m["time/trainer_idle"] >= 0 and m["time/server_idle"] >= 0


# ------------------------------------------------------- 4. the batch rules, without servers


def test_async_window_counts_the_groups_a_step_trains_until_released():
    """The producer's window holds a step's taken groups until the trainer releases them (after
    the weight sync that follows the step): with window = (K + 1) x batch, K = 1, batch 2, a
    fast producer has at most 2 groups ahead while a step trains, so the next step's groups were
    started before the previous sync (lag 1), never two syncs back (which the staleness rule
    would drop). A dropped group's slot is released at once, and taken back if it fills the batch."""
    from sorl_megatron.trainer.groups.producer import AsyncProducer, Group

    started: list[int] = []

    async def open_loop():
        async def run_group(gid):
            started.append(gid)
            return Group(gid, prompt=gid, trajectories=[])

        async def close():
            return None

        return run_group, close

    def settle(n):
        deadline = time.monotonic() + 10
        while len(started) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # and nothing more starts
        return sorted(started)

    producer = AsyncProducer(open_loop, iter(range(100)), window=4).start()
    try:
        assert settle(4) == [0, 1, 2, 3]  # the first window
        taken = [producer.take(5).gid for _ in range(2)]
        assert taken == [0, 1] and producer.pending() == (0, 2, 2)
        assert settle(4) == [0, 1, 2, 3]  # the step trains: its groups keep their slots
        producer.release([1])  # e.g. dropped (stale, equal rewards): reused at once
        assert settle(5) == [0, 1, 2, 3, 4]
        producer.hold([1])  # the dropped group fills the batch after all: its slot is taken back
        producer.release([0])
        assert settle(5) == [0, 1, 2, 3, 4] and producer.pending() == (0, 3, 1)
        producer.release()  # after the weight sync
        assert settle(6) == [0, 1, 2, 3, 4, 5]
        assert [producer.take(5).gid for _ in range(2)] == [2, 3]
    finally:
        producer.close()


def _fake_group(gid: int, versions: list[int], rewards: list[float]):
    from sorl_megatron.rollout.trajectory import Trajectory
    from sorl_megatron.trainer.groups.producer import Group

    trajs = []
    for v in versions:  # a prompt token, then two policy turns sampled by versions v and v + 1
        trajs.append(Trajectory(
            token_ids=np.arange(5), loss_mask=np.array([0, 1, 1, 0, 1], np.int8),
            turn_ids=np.array([-1, 0, 0, -1, 1], np.int32), rollout_logprobs=np.zeros(5, np.float32),
            prompt_len=1, finish_reason="max_length" if v < 0 else "answer", num_turns=2, num_searches=0,
            token_versions=np.array([-1, v, v, -1, v + 1]), meta={"reward": rewards[len(trajs)]}))
    return Group(gid, prompt=gid % 3, trajectories=trajs)


def _collect_with(overrides, groups, version):
    from sorl_megatron.trainer.groups.prompts import DataStream
    from sorl_megatron.trainer.recipe.loader import load_recipe
    from sorl_megatron.trainer.sources.modes import make_rollout_source

    cfg = load_recipe(BASE_RECIPE, [*overrides, "model.path=x", "data.train=x", "retrieval.url=http://127.0.0.1:1"])
    source = make_rollout_source(cfg, DataStream([0, 1, 2], cfg.schedule.batch_size, 0), [None] * 3, None,
                                 conn=None, pvpo=None, run_dir=None)

    def score(group):
        group.rewards = torch.tensor([t.meta["reward"] for t in group.trajectories])
        return 0

    source.score_group = score
    feed = iter(groups)
    return source.collect(version, lambda k: [next(feed) for _ in range(k)])


def test_batch_rules_staleness_and_dynamic_sampling():
    """The staleness rule (oldest token more than K versions behind: dropped, or kept and
    counted), dynamic sampling (equal rewards dropped, refilled, and dropped ones filling the
    batch when the draws run out) and the settled bookkeeping a checkpoint saves."""
    from sorl_megatron.trainer.groups.producer import SettledGroups, apply_overlong, version_lag_metrics

    base = ["schedule.batch_size=2", "rollout.group_size=2", "schedule.mini_batch_size=2",
            "schedule.micro_batch_size=1", "rollout.staleness.max=1", "rollout.mode=async"]
    groups = [_fake_group(0, [3, 3], [0, 1]), _fake_group(1, [1, 3], [0, 1]),  # group 1: oldest 1 at version 4
              _fake_group(2, [3, 3], [1, 0])]
    accepted, dropped, counts = _collect_with(base, groups, version=4)
    assert [g.gid for g in accepted] == [0, 2] and [(g.gid, why) for g, why in dropped] == [(1, "stale")]
    assert counts["rollout/groups_dropped_stale"] == 1 and counts["rollout/episodes_dropped_stale"] == 2
    assert counts["rollout/groups_drawn"] == 3
    lag = version_lag_metrics(accepted, 4, 1)  # each episode's tokens at lags 1, 1, 0
    assert lag["rollout/version_lag_max"] == 1 and lag["rollout/partial_episodes"] == 4

    groups = [_fake_group(0, [3, 3], [0, 1]), _fake_group(1, [1, 3], [0, 1]), _fake_group(2, [4, 4], [1, 0])]
    keep = [*base, "rollout.staleness.stale_groups=keep", "algorithm.loss.is_correction.mode=tis"]
    accepted, dropped, counts = _collect_with(keep, groups, version=4)
    assert [g.gid for g in accepted] == [0, 1] and counts["rollout/groups_kept_stale"] == 1 and not dropped

    groups = [_fake_group(g, [4, 4], r) for g, r in enumerate([[1, 1], [0, 1], [0, 0], [0.5, 0.5], [1, 0]])]
    accepted, dropped, counts = _collect_with([*base, "rollout.dynamic_sampling=true"], groups, version=4)
    assert [g.gid for g in accepted] == [1, 4]
    assert [(g.gid, why) for g, why in dropped] == [(0, "equal_reward"), (2, "equal_reward"), (3, "equal_reward")]
    assert counts["rollout/groups_dropped_equal_reward"] == 3 and counts["rollout/groups_drawn"] == 5

    groups = [_fake_group(g, [4, 4], r) for g, r in enumerate([[1, 1], [0, 1], [0, 0], [0.5, 0.5]])]
    accepted, dropped, counts = _collect_with(
        [*base, "rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_groups=3"], groups, version=4)
    assert [g.gid for g in accepted] == [1, 0]  # out of draws: an equal-reward group fills the batch
    assert counts["rollout/groups_refilled_equal_reward"] == 1 and counts["rollout/groups_dropped_equal_reward"] == 1
    assert [g.gid for g, _ in dropped] == [2]

    cut = _fake_group(0, [-1, 4], [1.0, 1.0])  # episode 0 was cut by the token budget
    cut.rewards = torch.tensor([1.0, 1.0])
    assert apply_overlong(cut, "penalty", max_total_tokens=5, buffer=2, penalty=0.5) == 2  # 0 cut, 1 in the buffer
    assert cut.rewards.tolist() == [0.5, 0.5]
    assert apply_overlong(cut, "filter", 5, 2, 0.5) == 1 and cut.trajectories[0].num_policy_tokens == 0

    settled = SettledGroups()
    settled.add([0, 1, 3, 5])
    assert settled.to_json() == {"frontier": 2, "above": [3, 5]}
    again = SettledGroups.from_json(settled.to_json())
    gids = again.unsettled_from(0)
    assert [next(gids) for _ in range(4)] == [2, 4, 6, 7]


def test_per_token_versions_from_the_server_and_the_routes_they_made():
    """A server that lands a weight update between decode steps reports each token's version
    (``meta_info.output_token_weight_versions``): the trajectory keeps them token by token, and
    each routed position gets the version of the pass that fed it (the prefill: the first
    token's; output token i, fed to sample token i + 1: token i + 1's)."""
    from sorl_megatron.common.protocol import GenerateOutput
    from sorl_megatron.rollout.agent import _Builder
    from sorl_megatron.rollout.trajectory import version_number

    b = _Builder([1, 2, 3], routed=True)
    routes = np.arange(5 * 2 * 1, dtype=np.int32).reshape(5, 2, 1)  # 3 prompt + 3 output - 1 positions
    b.add_policy(GenerateOutput(output_ids=[5, 6, 7], finish_reason={}, prompt_tokens=3, completion_tokens=3,
                                weight_version="step_2", output_logprobs=[-1.0, -2.0, -3.0], routed_experts=routes,
                                meta_info={"output_token_weight_versions": ["step_1", "step_2", "step_2"]}), turn=0)
    assert np.concatenate(b.versions).tolist() == [-1, -1, -1, 1, 2, 2]
    assert b.routing_version_array().tolist() == [1, 1, 1, 2, 2, -1]
    b.add_observation([9, 9])
    b.add_policy(GenerateOutput(output_ids=[4], finish_reason={}, prompt_tokens=8, completion_tokens=1,
                                weight_version="step_3", output_logprobs=[-0.5],
                                routed_experts=np.zeros((3, 2, 1), np.int32)), turn=1)  # no per-token list
    assert np.concatenate(b.versions).tolist()[-3:] == [-1, -1, 3]
    assert b.routing_version_array().tolist() == [1, 1, 1, 2, 2, 3, 3, 3, -1]
    assert [version_number(v) for v in ("default", None, "step_12", 7)] == [0, 0, 12, 7]


def test_pause_and_continue_around_updates_or_the_404_fallback():
    """``pause_generation`` / ``continue_generation`` reach every server with SGLang's bodies; a
    server without them (404) makes ``pause_generation`` answer False, once, with nothing left
    paused; any other refusal is raised."""
    from aiohttp import web

    from sorl_megatron.common.background import BackgroundServer
    from sorl_megatron.common.http import RequestRejectedError
    from sorl_megatron.rollout.client import RolloutClient

    seen: list[tuple[int, str, dict]] = []

    def app(index: int, supported: bool, status: int = 404) -> BackgroundServer:
        async def record(request: web.Request) -> web.Response:
            seen.append((index, request.path, await request.json()))
            if not supported:
                return web.json_response({"error": "no"}, status=status)
            return web.Response(text="ok")

        a = web.Application()
        a.router.add_post("/pause_generation", record)
        a.router.add_post("/continue_generation", record)
        return BackgroundServer(a, "127.0.0.1", 0).start()

    servers = [app(0, True), app(1, True), app(2, False), app(3, False, status=400)]
    try:
        async def go(urls):
            client = RolloutClient(urls)
            try:
                first = await client.pause_generation("retract")
                await client.continue_generation()
                again = await client.pause_generation("retract")
                return first, again
            finally:
                await client.close()

        assert asyncio.run(go([servers[0].url, servers[1].url])) == (True, True)
        assert sorted((i, p) for i, p, _ in seen) == [(0, "/continue_generation"), (0, "/pause_generation"),
                                                       (0, "/pause_generation"), (1, "/continue_generation"),
                                                       (1, "/pause_generation"), (1, "/pause_generation")]
        assert all(body == {"mode": "retract"} for _, p, body in seen if p == "/pause_generation")
        seen.clear()
        assert asyncio.run(go([servers[0].url, servers[2].url])) == (False, False)
        # asked once; the server that did pause is told to continue
        assert sorted((i, p) for i, p, _ in seen) == [(0, "/continue_generation"), (0, "/pause_generation"),
                                                       (2, "/continue_generation"), (2, "/pause_generation")]
        with pytest.raises(RequestRejectedError, match="/pause_generation rejected"):
            asyncio.run(go([servers[3].url]))

        # the trainer: a pause one server refuses raises, and the one that paused is told to go on
        from types import SimpleNamespace

        from sorl_megatron.trainer.serving.connections import Connections

        async def with_client(fn):
            client = RolloutClient([servers[0].url, servers[3].url])
            try:
                return await fn(client)
            finally:
                await client.close()

        rollout = SimpleNamespace(weight_sync=SimpleNamespace(timeout_s=60),
                                  async_=SimpleNamespace(pause_mode="retract"))
        conn = Connections(SimpleNamespace(rollout=rollout, retrieval=SimpleNamespace(url=None)), None, [], None,
                           pauses=True)
        conn.with_client = with_client
        seen.clear()
        with pytest.raises(RequestRejectedError, match="/pause_generation rejected"):
            conn.pause()
        assert [(i, p) for i, p, _ in seen if i == 0] == [(0, "/pause_generation"), (0, "/continue_generation")]
        assert not conn.pause_clock.paused  # the clock runs again with the servers
    finally:
        for s in servers:
            s.stop()


def test_a_paused_turn_waits_out_the_sync_within_the_weight_sync_timeout():
    """While the servers are paused for a weight sync, a /generate call's rollout.timeout_s
    clock stops, for at most rollout.weight_sync.timeout_s (the clock's cap): a turn paused on
    purpose is not timed out by a slow sync, and the wait stays bounded, the error naming both keys."""
    from aiohttp import web

    from sorl_megatron.common.background import BackgroundServer
    from sorl_megatron.common.http import RetryPolicy, ServerTimeoutError
    from sorl_megatron.common.protocol import SamplingParams
    from sorl_megatron.rollout.client import PauseClock, RolloutClient, RolloutClientConfig

    async def slow(request):  # answers after 1.5 s, as a request held by a pause would
        await asyncio.sleep(1.5)
        return web.json_response({"output_ids": [4], "meta_info": {
            "id": "a", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 1, "completion_tokens": 1,
            "cached_tokens": 0, "weight_version": "v", "output_token_logprobs": [[-1.0, 4, None]]}})

    app = web.Application()
    app.router.add_post("/generate", slow)
    server = BackgroundServer(app, "127.0.0.1", 0).start()
    cfg = RolloutClientConfig(urls=(server.url,), generate_retry=RetryPolicy(timeout_s=0.6, retries=0))

    def turn(clock, resume_after=None):
        async def go():
            async with RolloutClient(cfg, pauses=clock) as client:
                if clock is not None:
                    clock.pause()
                    if resume_after is not None:
                        asyncio.get_running_loop().call_later(resume_after, clock.resume)
                t0 = time.monotonic()
                try:
                    return (await client.generate([1], SamplingParams(max_new_tokens=1)))[0], time.monotonic() - t0
                except ServerTimeoutError as err:
                    return err, time.monotonic() - t0

        return asyncio.run(go())

    try:
        err, took = turn(None)  # no clock: 0.6 s and out (the answer would come at 1.5 s)
        assert isinstance(err, ServerTimeoutError)
        out, took = turn(PauseClock(max_credit_s=30), resume_after=1.2)  # paused 1.2 s of its 1.5 s
        assert out.output_ids == [4] and took >= 1.4
        err, took = turn(PauseClock(max_credit_s=0.3))  # a pause longer than the cap: out before the answer
        assert isinstance(err, ServerTimeoutError) and took >= 0.8, took  # 0.6 s plus the 0.3 s credit
        assert "rollout.timeout_s" in str(err) and "rollout.weight_sync.timeout_s" in str(err)
    finally:
        server.stop()
