"""The CPU server answering as a chosen SGLang release (``--sglang-version``), and the client
speaking to each exactly: weight-update sessions from 0.5.21 only, SGLang's ``/flush_cache``
(refused while requests run; ``?timeout=`` waits for idle), ``--skip-tokenizer-init`` refused."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from sorl_megatron.common.http import RequestRejectedError
from sorl_megatron.rollout.client import RolloutClient
from sorl_megatron.rollout.server_facts import ServerMismatchError
from sorl_megatron.sglang_cpu.options import EngineConfig, ServerOptions
from sorl_megatron.sglang_cpu.server import start_rollout_server
from sorl_megatron.weight_sync.tensor import send_tensors
from sorl_megatron.weight_sync.wire import serialize_named_tensors
from tests.http_calls import call

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def with_client(url: str, fn):
    async def go():
        async with RolloutClient(url) as c:
            return await fn(c)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def personas(moe_dir):
    servers = {v: start_rollout_server(EngineConfig(model_path=str(moe_dir)), options=ServerOptions(sglang_version=v))
               for v in ("0.5.18", "0.5.21")}
    yield servers
    for s in servers.values():
        s.stop()


def one_tensor(server, scale: float) -> tuple[str, torch.Tensor]:
    name = "model.norm.weight"
    return name, server.engine.served.state[name] * scale


def test_each_persona_speaks_its_releases_weight_update_protocol(personas):
    old, new = personas["0.5.18"], personas["0.5.21"]
    assert call(old.url, "GET", "/server_info")[1]["version"] == "0.5.18"
    assert call(old.url, "POST", "/begin_weight_update", {"selector": "all"})[0] == 404
    # 0.5.21 refuses an update outside a session, as SGLang's scheduler does
    payload = serialize_named_tensors([one_tensor(new, 1.0)], "safetensors")
    status, obj = call(new.url, "POST", "/update_weights_from_tensor",
                       {"serialized_named_tensors": [payload], "load_format": "safetensors"})
    assert status == 400 and "between begin_weight_update() and end_weight_update()" in obj["message"]
    assert call(new.url, "POST", "/end_weight_update", {})[0] == 400  # none open

    # the client reads each version and syncs each its own way: both end on the new weights
    for server, version in ((old, "v-old"), (new, "v-new")):
        name, t = one_tensor(server, 2.0)
        with_client(server.url, lambda c: send_tensors(c, [(name, t)], version))
        assert call(server.url, "GET", "/model_info")[1]["weight_version"] == version
        assert torch.equal(server.engine.served.state[name], t)


def test_a_session_left_open_by_a_dead_sync_is_closed_and_opened_again(personas):
    new = personas["0.5.21"]
    assert call(new.url, "POST", "/begin_weight_update", {"selector": "all"})[0] == 200  # a sync that died
    status, obj = call(new.url, "POST", "/begin_weight_update", {"selector": "all"})
    assert status == 400 and "already open" in obj["message"]
    name, t = one_tensor(new, 0.5)
    with_client(new.url, lambda c: send_tensors(c, [(name, t)], "after-crash"))
    assert call(new.url, "GET", "/model_info")[1]["weight_version"] == "after-crash"
    assert not new.engine.served.in_update


def test_flush_cache_is_refused_while_requests_run_and_waits_for_idle_when_asked(personas):
    """The async rollout.async.pause_mode in_place case: paused in place, the running request keeps its place
    in the batch, so a flush is refused; one that waits for idle flushes once it has ended."""
    server = personas["0.5.21"]
    url = server.url
    box: dict = {}

    def in_thread(key, *args, **kw):
        t = threading.Thread(target=lambda: box.update({key: call(*args, **kw)}))
        t.start()
        return t

    gen = in_thread("gen", url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 800, "ignore_eos": True}}, timeout=600)  # still running when paused
    deadline = time.monotonic() + 60
    while server.engine.num_live_requests == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert call(url, "POST", "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        assert server.engine.num_live_requests == 1  # paused in place, in the batch
        status, text = call(url, "POST", "/flush_cache")
        assert status == 400 and "requests are running" in str(text)
        status, text = call(url, "POST", "/flush_cache?timeout=0.2")
        assert status == 400 and "Timed out waiting for idle state" in str(text)
        flush = in_thread("flush", url, "POST", "/flush_cache?timeout=500", timeout=600)
        time.sleep(0.5)
        assert "flush" not in box  # held: the request is still there
    finally:
        assert call(url, "POST", "/continue_generation", {})[0] == 200
    flush.join(600)
    gen.join(600)
    assert box["gen"][0] == 200
    assert box["flush"][0] == 200 and "Cache flushed" in str(box["flush"][1])
    assert call(url, "POST", "/flush_cache?timeout=-1")[0] == 400


def test_a_server_started_with_skip_tokenizer_init_is_refused_at_once(moe_dir):
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir), skip_tokenizer_init=True))
    try:
        with pytest.raises(ServerMismatchError, match="--skip-tokenizer-init") as err:
            with_client(srv.url, lambda c: c.check_for_rollouts())
        assert with_client(srv.url, lambda c: c.weight_update_sessions())  # a weight sync still may
        assert srv.url in str(err.value)
    finally:
        srv.stop()


def test_a_stray_update_name_is_an_error_not_a_skip(personas):
    old = personas["0.5.18"]
    with pytest.raises(RequestRejectedError, match="unknown weight name"):
        with_client(old.url, lambda c: send_tensors(c, [("model.layers.0.mlp.nonexistent.weight", torch.ones(2))],
                                                    "never"))


def test_the_tensor_transport_is_refused_against_sglang_at_start(personas):
    """SGLang's /update_weights_from_tensor reads pickled tensors (CUDA IPC handles) from a process
    on its own GPUs; the tensor transport posts safetensors bodies, which only the embedded server
    reads. A server answering /server_info as SGLang 0.5.21 does (its arguments and version, no
    field of this project's) is refused when the run starts, naming the transport to use."""
    from aiohttp import web

    from sorl_megatron.common.background import BackgroundServer

    async def server_info(request):
        return web.json_response({"version": "0.5.21", "model_path": "/models/policy", "tp_size": 8,
                                  "skip_tokenizer_init": False, "quantization": None})

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    sglang = BackgroundServer(app, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{sglang.port}"
        with pytest.raises(ServerMismatchError, match=r"transport is tensor.*transport=distributed"):
            with_client(url, lambda c: c.check_for_rollouts(tensor_sync=True))
        with_client(url, lambda c: c.check_for_rollouts(tensor_sync=False))  # other transports: as before
    finally:
        sglang.stop()
    with_client(personas["0.5.21"].url, lambda c: c.check_for_rollouts(tensor_sync=True))  # the embedded server
