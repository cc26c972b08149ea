"""The embedded server's scheduler over real HTTP: continuous batching (joins and leaves), the
prefix cache (hits, flushes), seeded output independent of what else runs (deterministic mode),
pause / continue around weight updates, and the weight version of every output token."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from sorl_megatron.common.protocol import decode_routed_experts
from sorl_megatron.sglang_cpu.options import EngineConfig
from sorl_megatron.sglang_cpu.server import start_rollout_server
from tests.hf_checkpoints import perturbed_checkpoint
from tests.http_calls import call

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def generate(url: str, prompt: list[int], max_new: int, seed: int | None = 1, **extra) -> dict:
    sp = {"max_new_tokens": max_new, "ignore_eos": True, "no_stop_trim": True}
    if seed is not None:
        sp["sampling_seed"] = seed
    status, obj = call(url, "POST", "/generate", {"input_ids": prompt, "sampling_params": sp,
                                                  "return_logprob": True, **extra})
    assert status == 200, obj
    return obj


def in_background(fn, *args, **kw):
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=fn(*args, **kw)))
    t.start()
    return t, box


def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def logprobs(obj: dict) -> torch.Tensor:
    return torch.tensor([t[0] for t in obj["meta_info"]["output_token_logprobs"]])


@pytest.fixture(scope="module")
def server(moe_dir):
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir), enable_return_routed_experts=True))
    yield srv
    srv.stop()


def test_a_request_joins_the_running_batch_and_leaves_first(server, moe_model, teacher_forced):
    eng = server.engine
    steps0 = eng.num_steps
    t, box = in_background(generate, server.url, PROMPT, 200, seed=3)
    wait_for(lambda: eng.num_steps >= steps0 + 20)  # the long one is decoding
    short_prompt = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]  # longer prompt: KV rows get padded
    short = generate(server.url, short_prompt, 8, seed=4)
    long_done_when_short_was = "r" in box
    t.join(120)
    long = box["r"]
    assert not long_done_when_short_was  # the short request did not wait for the long one
    assert len(short["output_ids"]) == 8 and len(long["output_ids"]) == 200
    assert eng.max_batch >= 2 and eng.num_steps - steps0 < 200 + 8  # they shared decode steps
    # Both are exact despite joining, padding and leaving: equal to a teacher-forced forward.
    for prompt, obj in ((short_prompt, short), (PROMPT, long)):
        ref, _ = teacher_forced(moe_model, prompt + obj["output_ids"])
        assert (ref[len(prompt) - 1 :] - logprobs(obj)).abs().max().item() <= 1e-5
        assert obj["meta_info"]["output_token_weight_versions"] == ["default"] * len(obj["output_ids"])


def test_prefix_cache_hit_is_exact_and_flushed(server, moe_dir, moe_model, teacher_forced):
    url = server.url
    assert call(url, "POST", "/flush_cache")[0] == 200
    prompt = [60 + i for i in range(20)]
    first = generate(url, prompt, 10, return_routed_experts=True)
    assert first["meta_info"]["cached_tokens"] == 0
    # the next turn: the previous context, its answer, an observation
    turn2 = prompt + first["output_ids"] + [70, 71, 72]
    second = generate(url, turn2, 10, return_routed_experts=True, routed_experts_start_len=5)
    meta = second["meta_info"]
    assert meta["cached_tokens"] == len(prompt) + len(first["output_ids"]) - 1  # all fed positions reused
    ids = turn2 + second["output_ids"]
    ref, routing = teacher_forced(moe_model, ids)
    assert (ref[len(turn2) - 1 :] - logprobs(second)).abs().max().item() <= 1e-5
    assert np.array_equal(decode_routed_experts(meta["routed_experts"], 2, 2), routing[5:].numpy())
    info = call(url, "GET", "/server_info")[1]["prefix_cache"]
    assert info["hits"] >= 1 and info["entries"] >= 1
    # flushed by /flush_cache ...
    assert call(url, "POST", "/flush_cache")[0] == 200
    assert generate(url, turn2, 4)["meta_info"]["cached_tokens"] == 0
    assert generate(url, turn2 + [73], 4)["meta_info"]["cached_tokens"] == len(turn2)  # cached again
    # ... and by a weight update (the same checkpoint: the cache is dropped all the same)
    status, obj = call(url, "POST", "/update_weights_from_disk", {"model_path": str(moe_dir)})
    assert status == 200 and obj["success"]
    assert generate(url, turn2 + [73], 4)["meta_info"]["cached_tokens"] == 0


def test_seeded_output_is_the_same_alone_and_among_16(moe_dir):
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir), deterministic=True))
    try:
        target = [(7 * i) % 300 + 3 for i in range(45)]  # > one deterministic chunk (32)
        alone = generate(srv.url, target, 40, seed=11)
        others = [[(13 * i + j) % 300 + 3 for i in range(5 + 3 * j)] for j in range(15)]

        def one(j):
            if j == 7:
                return generate(srv.url, target, 40, seed=11)
            return generate(srv.url, others[j if j < 7 else j - 1], 20 + j, seed=100 + j)

        with ThreadPoolExecutor(16) as pool:
            outs = list(pool.map(one, range(16)))
        crowd = outs[7]
        assert srv.engine.max_batch >= 8  # it really ran among others
        assert crowd["meta_info"]["cached_tokens"] == 32  # and from the prefix cache (chunk-aligned)
        assert crowd["output_ids"] == alone["output_ids"]
        assert logprobs(crowd).tolist() == logprobs(alone).tolist()  # bit for bit
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def new_weights(moe_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("v1")
    return path, perturbed_checkpoint(moe_dir, path, 0.05, seed=1)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_update_continue_tags_every_token(moe_dir, new_weights, teacher_forced, mode):
    path, new_model = new_weights
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir)))
    url, eng = srv.url, srv.engine
    try:
        t, box = in_background(generate, url, PROMPT, 300, seed=5)
        wait_for(lambda: eng.num_steps >= 30)
        status, obj = call(url, "POST", "/pause_generation", {"mode": mode})
        assert status == 200 and obj["success"]
        steps = eng.num_steps
        late_t, late = in_background(generate, url, [20, 21, 22], 5, seed=6)  # arrives while paused
        # The update runs while the request is in flight (not drained: it would wait for it).
        status, obj = call(url, "POST", "/update_weights_from_disk", {"model_path": str(path), "weight_version": "v1"},
                           timeout=30)
        assert status == 200 and obj["success"]
        time.sleep(0.2)
        assert eng.num_steps == steps and "r" not in box and "r" not in late  # nothing decoded while paused
        assert call(url, "POST", "/continue_generation", {})[1]["success"]
        t.join(120)
        late_t.join(120)
        out = box["r"]
        meta = out["meta_info"]
        versions = meta["output_token_weight_versions"]
        assert len(out["output_ids"]) == 300 and len(versions) == 300
        k = versions.index("v1")
        assert 30 <= k < 300 and versions == ["default"] * k + ["v1"] * (300 - k)
        assert meta["weight_version"] == "v1"
        assert late["r"]["meta_info"]["output_token_weight_versions"] == ["v1"] * 5
        if mode == "retract":  # the KV was recomputed with the new weights: later tokens are exactly v1's
            ref, _ = teacher_forced(new_model, PROMPT + out["output_ids"])
            diff = (ref[len(PROMPT) - 1 :] - logprobs(out)).abs()
            assert diff[k:].max().item() <= 1e-5 < diff[:k].max().item()
    finally:
        srv.stop()


def test_pause_abort_mode_ends_requests_and_update_without_pause_waits(moe_dir, new_weights):
    path, _ = new_weights
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir)))
    url, eng = srv.url, srv.engine
    try:
        t, box = in_background(generate, url, PROMPT, 3000, seed=5)
        wait_for(lambda: eng.num_steps >= 5)
        assert call(url, "POST", "/pause_generation")[1]["success"]  # default mode: abort
        t.join(60)
        meta = box["r"]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 3000
        assert call(url, "GET", "/server_info")[1]["paused"] == "abort"
        queued_t, queued = in_background(generate, url, PROMPT, 5)  # waits while paused ...
        wait_for(lambda: len(eng.scheduler._pending) == 1)
        assert call(url, "POST", "/pause_generation", {"mode": "abort"})[1]["success"]
        queued_t.join(60)  # ... and a second abort-mode pause ends it too, with no tokens
        assert queued["r"]["meta_info"]["finish_reason"]["type"] == "abort" and queued["r"]["output_ids"] == []
        assert call(url, "POST", "/pause_generation", {"mode": "later"})[0] == 400
        assert call(url, "POST", "/continue_generation")[1]["success"]
        # Without a pause an update drains the running requests: each answer has one version.
        t, box = in_background(generate, url, PROMPT, 200, seed=5)
        wait_for(lambda: len(eng.scheduler._batch) == 1)
        status, obj = call(url, "POST", "/update_weights_from_disk", {"model_path": str(path), "weight_version": "v1"})
        assert status == 200 and obj["success"]
        t.join(60)
        assert len(box["r"]["output_ids"]) == 200
        assert set(box["r"]["meta_info"]["output_token_weight_versions"]) == {"default"}
        assert generate(url, PROMPT, 3)["meta_info"]["output_token_weight_versions"] == ["v1"] * 3
    finally:
        srv.stop()


def test_random_joins_leaves_and_prefix_hits_stay_exact(server, moe_model, teacher_forced):
    """40 concurrent requests of random lengths, n, temperatures, routing and prompt log-probs,
    half of them continuing an earlier context (prefix-cache hits with padding gaps): every
    log-prob and every routed expert equals a teacher-forced forward."""
    bases = [[random.Random(b).randrange(3, 390) for _ in range(5 + 11 * b)] for b in range(4)]
    ctxs: dict[int, list[int]] = {}
    lock = threading.Lock()

    def job(i):
        r = random.Random(i)
        b = r.randrange(4)
        with lock:
            prev = ctxs.get(b)
        base = prev if prev and r.random() < 0.7 else bases[b]
        prompt = base + [r.randrange(3, 390) for _ in range(r.randrange(1, 9))]
        temp, rstart = r.choice([1.0, 0.7, 0]), r.randrange(0, len(prompt) + 1)
        body = {"input_ids": prompt, "return_logprob": True, "return_routed_experts": r.random() < 0.6,
                "routed_experts_start_len": rstart, "logprob_start_len": r.choice([-1, -1, r.randrange(len(prompt))]),
                "sampling_params": {"max_new_tokens": r.randrange(1, 24), "ignore_eos": True, "no_stop_trim": True,
                                    "sampling_seed": i, "n": r.choice([1, 2]), "temperature": temp}}
        status, obj = call(server.url, "POST", "/generate", body)
        assert status == 200, obj
        objs = obj if isinstance(obj, list) else [obj]
        for o in objs:
            meta = o["meta_info"]
            ref, routing = teacher_forced(moe_model, prompt + o["output_ids"], temp or 1.0)
            assert (ref[len(prompt) - 1 :] - logprobs(o)).abs().max().item() <= 1e-5
            s0 = body["logprob_start_len"]
            if s0 >= 0 and len(prompt) > 1:
                got = [x[0] for x in meta["input_token_logprobs"]][1 if s0 == 0 else 0 :]
                want = ref[max(s0, 1) - 1 : len(prompt) - 1]
                assert (want - torch.tensor(got)).abs().max().item() <= 1e-5
            if body["return_routed_experts"]:
                assert np.array_equal(decode_routed_experts(meta["routed_experts"], 2, 2), routing[rstart:].numpy())
        with lock:
            ctxs[b] = prompt + objs[0]["output_ids"]
        return objs[0]["meta_info"]["cached_tokens"]

    with ThreadPoolExecutor(8) as pool:
        cached = list(pool.map(job, range(40)))
    assert sum(c > 0 for c in cached) >= 10  # the cache was really used


def test_control_calls_are_bounded_and_say_why_when_the_scheduler_is_busy_or_dead(moe_dir):
    """/flush_cache, /pause_generation, /continue_generation wait for the scheduler at most
    --control-timeout-s (504 naming it; the call is then not run late), and answer 503 at once
    when the scheduler thread is dead (it used to hang them until the client's timeout)."""
    from sorl_megatron.sglang_cpu.options import ServerOptions

    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir)), options=ServerOptions(control_timeout_s=1.0))
    url, eng = srv.url, srv.engine
    gate = threading.Event()
    try:
        assert eng.alive
        blocker = eng.call(lambda: gate.wait(60))  # the scheduler is busy inside a control call
        wait_for(lambda: blocker.running())
        for path in ("/flush_cache", "/pause_generation", "/continue_generation"):
            t0 = time.monotonic()
            status, obj = call(url, "POST", path, {"mode": "in_place"} if path == "/pause_generation" else None,
                               timeout=30)
            assert status == 504 and "--control-timeout-s" in str(obj) and path in str(obj), (path, status, obj)
            assert time.monotonic() - t0 < 10
        gate.set()
        blocker.result(30)
        assert call(url, "GET", "/server_info")[1]["paused"] is None  # the pause that timed out never ran
        assert len(generate(url, PROMPT, 2)["output_ids"]) == 2  # and the server serves on
        eng.stop()  # the scheduler thread ends (as after a crash of the thread)
        assert not eng.alive
        for path in ("/flush_cache", "/pause_generation", "/continue_generation", "/update_weight_version"):
            t0 = time.monotonic()
            status, obj = call(url, "POST", path, {"new_version": "x"} if path == "/update_weight_version" else None,
                               timeout=30)
            assert status == 503 and "scheduler thread is not running" in str(obj), (path, status, obj)
            assert time.monotonic() - t0 < 5
        assert call(url, "GET", "/health")[0] == 503
    finally:
        gate.set()
        srv.stop()
