"""Issue 15, class 3: one request never fails another, none can hog the server, bad input is a 400.

Everything runs against real servers on 127.0.0.1: the in-process embedded server for
behaviour, a subprocess server (its own process, so its RSS and event loop are its own) for
body limits, memory, event-loop stalls and --api-key.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import socket
import threading
import time
from urllib.parse import urlparse

import psutil
import pytest
import torch

from sorl_megatron.common.http import RequestRejectedError
from sorl_megatron.common.protocol import GenRequest, SamplingParams
from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig
from sorl_megatron.sglang_cpu.options import EngineConfig, ServerOptions
from sorl_megatron.sglang_cpu.server import start_rollout_server
from tests.http_calls import call
from tests.rollout.server_process import server_process

PROMPT = [5, 6, 7, 8, 9, 10, 11]
KEY = "test-key-0123456789"


class Exploit:
    """Unpickling this runs a shell command: what a hostile 'checkpoint' would carry."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def err(obj) -> str:
    e = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(e, dict):
        return e.get("message", "")
    return str(e if e is not None else obj.get("message"))


@pytest.fixture(scope="module")
def server(moe_dir):
    srv = start_rollout_server(
        EngineConfig(model_path=str(moe_dir), enable_return_routed_experts=True, max_running_requests=8),
        options=ServerOptions(max_prompts_per_request=64, max_tokens_per_request=20_000),
    )
    yield srv
    srv.stop()


# ----- one request never fails another -----


def test_invalid_request_in_a_concurrent_burst_fails_alone(server):
    """The reproducer: three valid requests batched with one whose stop id is outside the vocabulary."""
    good = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 1}}
    bad = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "stop_token_ids": [99999],
                                                    "min_new_tokens": 2}}
    bodies = [good, good, bad, good]
    results: list = [None] * 4

    def go(i):
        results[i] = call(server.url, "POST", "/generate", bodies[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    vocab = server.engine.served.vocab_size
    assert [s for s, _ in results] == [200, 200, 400, 200]
    assert f"stop_token_ids[0] = 99999 is not a token id in [0, {vocab})" in err(results[2][1])
    assert all(len(r[1]["output_ids"]) == 6 for i, r in enumerate(results) if i != 2)


def test_a_failing_step_is_retried_row_by_row(server):
    """Whatever slips past validation fails only its own request: the failing decode step is tried
    row by row, the culprit's request gets the error, the others go on in the same batch."""
    eng = server.engine
    hold, release = threading.Event(), threading.Event()

    def block():
        hold.set()
        release.wait(30)

    eng.call(block)  # keep the scheduler busy so that the four requests are admitted together
    assert hold.wait(30)
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True, sampling_seed=3)
    unchecked = SamplingParams(max_new_tokens=4, stop_token_ids=[99999], min_new_tokens=2)  # IndexError inside
    reqs = [GenRequest(input_ids=PROMPT, params=p) for p in (sp, sp, unchecked, sp)]
    waves = eng.num_waves
    futures = [eng.submit(r) for r in reqs]
    release.set()
    for i, f in enumerate(futures):
        if i == 2:
            with pytest.raises(IndexError):
                f.result(60)
        else:
            assert len(f.result(60)[0]["output_ids"]) == 4
    assert eng.num_waves == waves + 1  # one shared prefill: nobody was restarted
    assert len(eng.requests) == 0 and eng.num_tracked_aborts == 0


@pytest.mark.parametrize(
    "patch,msg",
    [
        ({"sampling_params": {"top_k": 10**30}}, "top_k must be -1 (off) or in [1, 2**30]"),
        ({"sampling_params": {"top_k": 0}}, "top_k must be -1"),
        ({"sampling_params": {"sampling_seed": 10**30}}, "sampling_seed must be in [-2**63, 2**63)"),
        ({"sampling_params": {"max_new_tokens": 2**40}}, "max_new_tokens must be in [0, 2147483647]"),
        ({"sampling_params": {"max_new_tokens": 3, "min_new_tokens": 4}}, "min_new_tokens must be in [0, max_new"),
        ({"sampling_params": {"n": 0}}, "n must be in [1, 1024]"),
        ({"sampling_params": {"temperature": 1e400}}, "not valid JSON"),  # json.dumps writes Infinity
        ({"sampling_params": {"temperature": 10**400}}, "temperature is out of range"),
        ({"sampling_params": {"stop_token_ids": [-1]}}, "stop_token_ids must be a list of token ids"),
        ({"sampling_params": {"stop_token_ids": list(range(300))}}, "at most 256"),
        ({"sampling_params": {"stop": ["\ud800x"]}}, "stop[0] is not valid Unicode text: lone surrogate"),
        ({"input_ids": [1, True]}, "input_ids[1] is True, not an integer token id"),
        ({"input_ids": [1, 10**30]}, "input_ids[1] = 1000000000000000000000000000000 is not a token id"),
        ({"input_ids": [1, -3]}, "input_ids[1] = -3 is not a token id"),
        ({"input_ids": [[1], [2, 3, 99999]]}, "input_ids[1][2] = 99999"),
        ({"input_ids": None, "text": "ok \ud83d"}, "text is not valid Unicode text: lone surrogate '\\ud83d' at char"),
        ({"text": "both"}, "either input_ids or text"),
        ({"top_logprobs_num": 10**9, "return_logprob": True}, "top_logprobs_num must be an integer in [0, 64]"),
        ({"rid": "\udc00"}, "rid is not valid Unicode text"),
    ],
)
def test_out_of_range_fields_get_400_with_the_reason(server, patch, msg):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, **patch}
    body = {k: v for k, v in body.items() if v is not None}
    status, obj = call(server.url, "POST", "/generate", json.dumps(body).encode())
    assert status == 400, obj
    assert msg in err(obj)


def test_bad_element_of_a_batch_rejects_the_batch_naming_it(server):
    body = {
        "input_ids": [PROMPT, PROMPT, PROMPT],
        "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 2}, {"max_new_tokens": 2, "top_k": 10**30}],
    }
    status, obj = call(server.url, "POST", "/generate", body)
    assert status == 400 and "sampling_params[2].top_k" in err(obj)
    body = {"input_ids": [PROMPT, [1, 2, 500]], "sampling_params": {"max_new_tokens": 2}}
    status, obj = call(server.url, "POST", "/generate", body)
    assert status == 400 and "input_ids[1][2] = 500" in err(obj)
    # the server is fine afterwards
    status, obj = call(server.url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(obj["output_ids"]) <= 2


def test_malformed_bodies_get_400_not_500(server):
    deep = b"[" * 100_000 + b"]" * 100_000
    status, obj = call(server.url, "POST", "/generate", deep)
    assert status == 400 and "nested too deeply" in err(obj)
    status, obj = call(server.url, "POST", "/generate", b'{"input_ids": [1], "x": NaN}')
    assert status == 400 and "NaN is not a JSON number" in err(obj)
    status, obj = call(server.url, "POST", "/generate", b"\xff\xfe\x00garbage")
    assert status == 400 and "request body is not" in err(obj)
    status, obj = call(server.url, "POST", "/generate", b"")
    assert status == 400 and "empty" in err(obj)
    status, obj = call(server.url, "POST", "/update_weight_version", deep)
    assert status == 400 and obj["success"] is False and "nested too deeply" in obj["message"]


def test_pickle_named_safetensors_is_refused_with_the_file_named(server, tmp_path):
    d = tmp_path / "evil"
    d.mkdir()
    (d / "config.json").write_text("{}")
    marker = tmp_path / "pwned"
    (d / "model.safetensors").write_bytes(pickle.dumps(Exploit(marker)))
    version = server.engine.served.weight_version
    status, obj = call(server.url, "POST", "/update_weights_from_disk", {"model_path": str(d)})
    assert status == 400 and obj["success"] is False
    assert f"{d / 'model.safetensors'} is not a readable safetensors file" in obj["message"]
    assert not marker.exists() and server.engine.served.weight_version == version
    status, obj = call(server.url, "POST", "/update_weights_from_disk", {"model_path": "/tmp/\ud800"})
    assert status == 400 and "model_path is not valid Unicode text" in obj["message"]


# ----- caps on prompts and tokens -----


def test_caps_on_prompts_and_tokens_per_request(server):
    sp = {"max_new_tokens": 1}
    status, obj = call(server.url, "POST", "/generate", {"input_ids": [[1]] * 65, "sampling_params": sp})
    assert status == 400 and "65 prompts in one request; the limit is 64 (--max-prompts-per-request)" in err(obj)
    status, obj = call(server.url, "POST", "/generate", {"input_ids": [[1]] * 4, "sampling_params": {"n": 17}})
    assert status == 400 and "68 sequences (prompts x n)" in err(obj)
    body = {"input_ids": [[1] * 3000] * 7, "sampling_params": {"max_new_tokens": 10}}
    status, obj = call(server.url, "POST", "/generate", body)
    assert status == 400 and "asks for 21070 tokens" in err(obj) and "--max-tokens-per-request" in err(obj)
    # a long text is only tokenized after the counts are checked, and never on the event loop
    status, obj = call(server.url, "POST", "/generate", {"text": ["hello"] * 65, "sampling_params": sp})
    assert status == 400 and "65 prompts" in err(obj)


def test_n_larger_than_a_wave_is_split_and_keeps_seeds(server):
    sp = {"max_new_tokens": 3, "ignore_eos": True, "sampling_seed": 9}
    status, many = call(server.url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {**sp, "n": 20},
                                                          "rid": "split"})
    assert status == 200 and len(many) == 20  # max_running_requests is 8: three waves
    assert [o["meta_info"]["id"] for o in many] == [f"split-{j}" for j in range(20)]
    status, few = call(server.url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {**sp, "n": 3}})
    assert [o["output_ids"] for o in few] == [o["output_ids"] for o in many[:3]]


def test_prompt_logprobs_from_start_zero(server, moe_model, teacher_forced):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "return_logprob": True,
            "logprob_start_len": 0}
    status, obj = call(server.url, "POST", "/generate", body)
    assert status == 200
    inp = obj["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in inp] == PROMPT and inp[0][0] is None
    ref, _ = teacher_forced(moe_model, PROMPT + obj["output_ids"])
    assert torch.allclose(torch.tensor([t[0] for t in inp[1:]]), ref[: len(PROMPT) - 1], atol=1e-5)


# ----- weight_version is the version of the weights used -----


def test_weight_version_between_begin_and_end_is_the_old_one(server, tmp_path):
    sp = {"max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 4}
    gen = {"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True}
    call(server.url, "POST", "/update_weight_version", {"new_version": "old"})
    _, before = call(server.url, "POST", "/generate", gen)
    name = "lm_head.weight"
    new = server.engine.served.state[name] + 0.5 * torch.randn(server.engine.served.state[name].shape)
    from sorl_megatron.weight_sync.wire import serialize_named_tensors

    payload = serialize_named_tensors([(name, new)])
    assert call(server.url, "POST", "/begin_weight_update", {"selector": "all"})[0] == 200
    status, res = call(server.url, "POST", "/update_weights_from_tensor",
                       {"serialized_named_tensors": [payload], "weight_version": "new"})
    assert status == 200 and res["success"]
    status, res = call(server.url, "POST", "/update_weight_version", {"new_version": "newer"})
    assert status == 200 and "takes effect at /end_weight_update" in res["message"]
    _, during = call(server.url, "POST", "/generate", gen)
    assert during["meta_info"]["weight_version"] == "old"  # sampled with the old weights ...
    assert during["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert call(server.url, "GET", "/model_info")[1]["weight_version"] == "old"
    assert call(server.url, "POST", "/end_weight_update", {})[0] == 200
    _, after = call(server.url, "POST", "/generate", gen)
    assert after["meta_info"]["weight_version"] == "newer"  # ... and the new label with the new weights
    assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]


# ----- abort bookkeeping -----


def test_abort_bookkeeping_is_bounded_and_rids_can_be_reused(server):
    async def many_aborts():
        import aiohttp

        async with aiohttp.ClientSession() as s:
            for i in range(1000):
                async with s.post(f"{server.url}/abort_request", json={"rid": f"ghost-{i}"}) as r:
                    assert r.status == 200

    asyncio.run(many_aborts())
    assert call(server.url, "GET", "/server_info")[1]["num_tracked_aborts"] == 0
    # a rid aborted before its request exists does not cut the later request short
    assert call(server.url, "POST", "/abort_request", {"rid": "reused"})[0] == 200
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}, "rid": "reused"}
    status, obj = call(server.url, "POST", "/generate", body)
    assert status == 200 and obj["meta_info"]["finish_reason"] == {"type": "length", "length": 12}

    # a running request is aborted, and its rid is forgotten afterwards
    box = {}
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}, "rid": "long"}
    t = threading.Thread(target=lambda: box.update(r=call(server.url, "POST", "/generate", long)))
    t.start()
    deadline = time.monotonic() + 60
    while "long" not in server.engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert call(server.url, "POST", "/abort_request", {"rid": "long"})[0] == 200
    t.join(120)
    status, obj = box["r"]
    assert status == 200 and obj["meta_info"]["finish_reason"]["type"] == "abort"
    assert obj["meta_info"]["completion_tokens"] < 3000
    assert server.engine.num_tracked_aborts == 0 and "long" not in server.engine.requests


def disconnect_mid_generation(url: str, headers: dict | None = None) -> None:
    """A client sends a long ``/generate``, waits until the server holds it, and disconnects:
    the server must drop its sequence (aiohttp leaves a handler running when its client goes,
    so the sequence decoded to ``max_new_tokens`` for nobody, a timed-out call holding its
    server's batch), and go back to no live request."""
    headers = headers or {}
    info = lambda: call(url, "GET", "/server_info", headers=headers)[1]  # noqa: E731
    steps_before, budget = info()["num_decode_steps"], 3000
    body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": budget, "ignore_eos": True}})
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\n{head}Content-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    deadline = time.monotonic() + 60
    while info()["num_live_requests"] == 0:
        assert time.monotonic() < deadline, "the request never reached the server"
        time.sleep(0.01)
    sock.close()
    deadline = time.monotonic() + 120
    while (now := info())["num_live_requests"]:
        assert time.monotonic() < deadline, f"the server kept the request of a client that left: {now}"
        time.sleep(0.05)
    # cut short, not decoded to the end (kept, it took budget - 1 steps after its prefill)
    assert now["num_decode_steps"] - steps_before < budget // 2, now["num_decode_steps"] - steps_before


def test_a_client_that_disconnects_stops_its_sequences(server):
    disconnect_mid_generation(server.url)
    status, obj = call(server.url, "POST", "/generate",  # and the server serves the next one
                       {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    assert status == 200 and len(obj["output_ids"]) == 4


# ----- a subprocess server: body limits, RSS, event loop, --api-key -----


@pytest.fixture(scope="module")
def proc_server(moe_dir, tmp_path_factory):
    # the key travels in the environment, not argv
    log = tmp_path_factory.mktemp("srv") / "server.log"
    with server_process(moe_dir, log, env={"SORL_ROLLOUT_API_KEY": KEY}) as running:
        yield running


AUTH = {"Authorization": f"Bearer {KEY}"}


def _send_oversized(url: str, path: str, total: int, chunked: bool) -> int:
    """Stream ``total`` bytes at the server (1 MiB at a time) and return the status it answers."""
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {total}\r\n\r\n"
    sock.sendall(head.encode())
    block = b"[" + b"1," * (512 * 1024 - 1)
    frame = f"{len(block):x}\r\n".encode() + block + b"\r\n" if chunked else block
    sent = 0
    try:
        while sent < total:
            sock.sendall(frame)
            sent += len(block)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed: what it said is still in our receive buffer
    try:
        answer = sock.recv(4096).decode(errors="replace")
    except ConnectionResetError:
        answer = ""
    sock.close()
    return int(answer.split()[1]) if answer.startswith("HTTP/1.1") else -1


def test_oversized_bodies_are_refused_before_buffering(proc_server):
    url, proc = proc_server
    rss = psutil.Process(proc.pid)
    call(url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}, AUTH)
    base = rss.memory_info().rss
    statuses = []
    for _ in range(3):  # declared too large: 413 before a byte of the body is kept
        statuses.append(_send_oversized(url, "/generate", 200 * 1024**2, chunked=False))
    for _ in range(3):  # streamed without a length: cut off at the 64 MiB default
        statuses.append(_send_oversized(url, "/generate", 200 * 1024**2, chunked=True))
    grown = (rss.memory_info().rss - base) / 1024**2
    print(f"\n[body limit] statuses {statuses}; server RSS grew {grown:.0f} MiB after six 200 MiB POSTs")
    assert statuses == [413] * 6
    assert grown < 256  # was ~1 GiB per refused POST
    status, obj = call(url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}, AUTH)
    assert status == 200
    status, obj = call(url, "POST", "/generate", b"x" * (65 * 1024**2), AUTH)
    assert status == 413 and "--max-body-mb" in err(obj)


def test_health_answers_while_a_50mb_body_is_validated(proc_server):
    url, _ = proc_server
    big = ("[" + ",".join(["17"] * 17_000_000) + "]").encode()  # ~50 MB of input_ids
    body = b'{"input_ids": ' + big + b', "sampling_params": {"max_new_tokens": 1}}'
    assert len(body) > 50 * 10**6
    box = {}

    def post():
        t0 = time.monotonic()
        box["r"] = call(url, "POST", "/generate", body, AUTH)
        box["s"] = time.monotonic() - t0

    t = threading.Thread(target=post)
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert call(url, "GET", "/health", timeout=30)[0] == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.02)
    t.join()
    status, obj = box["r"]
    print(f"\n[50 MB body] answered {status} in {box['s']:.2f} s; worst /health latency meanwhile {worst:.3f} s")
    assert status == 400 and "17000000 tokens, the context length is 4096" in err(obj)
    assert worst < 5.0  # the event loop was stalled 21 s before


def test_api_key_guards_everything_but_health(proc_server, moe_dir, monkeypatch):
    url, _ = proc_server
    assert call(url, "GET", "/health")[0] == 200  # open, as in SGLang (load balancers probe it)
    for method, path, body in [
        ("POST", "/generate", {"input_ids": PROMPT}),
        ("POST", "/update_weights_from_disk", {"model_path": str(moe_dir)}),
        ("POST", "/begin_weight_update", {}),
        ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}),
        ("POST", "/abort_request", {"rid": "x"}),
        ("GET", "/model_info", None),
        ("GET", "/server_info", None),
    ]:
        status, obj = call(url, method, path, body)
        assert status == 401 and "Unauthorized" in err(obj), path
        status, _ = call(url, method, path, body, {"Authorization": "Bearer wrong"})
        assert status == 401, path
    status, info = call(url, "GET", "/server_info", None, AUTH)
    assert status == 200 and info["api_key_required"] is True and KEY not in json.dumps(info)

    async def with_client(key):
        async with RolloutClient(RolloutClientConfig(urls=(url,), api_key=key)) as c:
            return await c.generate(PROMPT, SamplingParams(max_new_tokens=2))

    assert len(asyncio.run(with_client(KEY))) == 1
    with pytest.raises(RequestRejectedError, match="401") as ei:
        asyncio.run(with_client(None))
    assert ei.value.status == 401
    assert KEY not in repr(RolloutClientConfig(urls=(url,), api_key=KEY))
    monkeypatch.setenv("SORL_ROLLOUT_API_KEY", KEY)  # what the server read: the client reads it too
    assert len(asyncio.run(with_client(None))) == 1


def test_pickled_tensor_payload_is_refused_and_never_run(proc_server, tmp_path):
    url, _ = proc_server
    marker = tmp_path / "pwned"
    evil = base64.b64encode(pickle.dumps([("model.norm.weight", Exploit(marker))])).decode()
    status, obj = call(url, "POST", "/update_weights_from_tensor",
                       {"serialized_named_tensors": [evil], "load_format": "torch"}, AUTH)
    assert status == 400 and "cannot decode torch payload" in obj["message"]
    assert not marker.exists()


def test_a_client_that_disconnects_stops_its_sequences_in_the_cli_server(proc_server):
    """The same through ``python -m sorl_megatron.sglang_cpu.server`` (``web.run_app``)."""
    url, _ = proc_server
    disconnect_mid_generation(url, AUTH)
