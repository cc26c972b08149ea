"""Client behaviour against dead, slow and misbehaving servers: clear errors, bounded time."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from sorl_megatron.common.background import BackgroundServer, free_port
from sorl_megatron.common.http import (
    BadResponseError,
    RequestRejectedError,
    RetryPolicy,
    ServerError,
    ServerTimeoutError,
    ServerUnavailableError,
)
from sorl_megatron.common.protocol import ProtocolError, SamplingParams
from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig
from sorl_megatron.weight_sync.tensor import send_tensors

FAST = RetryPolicy(timeout_s=2.0, connect_timeout_s=1.0, retries=2, backoff_s=0.05)
SP = SamplingParams(max_new_tokens=2)


def ok_body(prompt_len: int) -> dict:
    return {
        "output_ids": [1, 2],
        "meta_info": {
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": prompt_len,
            "completion_tokens": 2,
            "weight_version": "w",
            "output_token_logprobs": [[-0.1, 1, None], [-0.2, 2, None]],
        },
    }


class Fake:
    """A scripted /generate server that counts calls and concurrency."""

    def __init__(self, mode: str = "ok", delay: float = 0.0):
        self.mode, self.delay = mode, delay
        self.calls = 0
        self.active = 0
        self.max_active = 0
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        self.server = BackgroundServer(app, "127.0.0.1", 0).start()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            body = await request.json()
            await asyncio.sleep(self.delay)
            if self.mode == "garbage":
                return web.Response(text="<html>oops", content_type="text/html")
            if self.mode == "500":
                return web.json_response({"error": {"message": "CUDA out of memory"}}, status=500)
            if self.mode == "400":
                return web.json_response({"error": {"message": "bad sampling_params"}}, status=400)
            if self.mode == "short":
                obj = ok_body(len(body["input_ids"]))
                obj["meta_info"]["output_token_logprobs"] = obj["meta_info"]["output_token_logprobs"][:1]
                return web.json_response(obj)
            return web.json_response(ok_body(len(body["input_ids"])))
        finally:
            self.active -= 1

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


def client(urls, **kw) -> RolloutClient:
    return RolloutClient(RolloutClientConfig(urls=tuple(urls), generate_retry=kw.pop("policy", FAST), **kw))


def run(coro, limit: float = 20.0):
    async def bounded():
        return await asyncio.wait_for(coro, limit)

    return asyncio.run(bounded())


def test_server_down_fails_fast_with_url():
    url = f"http://127.0.0.1:{free_port()}"

    async def go():
        async with client([url]) as c:
            await c.generate([1, 2], SP)

    t0 = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=rf"no rollout server reachable.*{url}.*after 3 attempts"):
        run(go())
    assert time.monotonic() - t0 < 5


def test_slow_server_times_out():
    fake = Fake(delay=5.0)
    try:

        async def go():
            async with client([fake.url], policy=RetryPolicy(timeout_s=0.5, retries=2)) as c:
                await c.generate([1], SP)

        t0 = time.monotonic()
        with pytest.raises(ServerTimeoutError, match="did not answer within 0.5 s"):
            run(go())
        assert time.monotonic() - t0 < 3 and fake.calls == 1  # no retry on timeout by default
    finally:
        fake.stop()


@pytest.mark.parametrize(
    "mode,exc,msg,calls",
    [
        ("garbage", BadResponseError, "invalid JSON", 1),
        ("500", BadResponseError, "HTTP 500: CUDA out of memory", 3),
        ("400", RequestRejectedError, "HTTP 400: bad sampling_params", 1),
        ("short", ProtocolError, "1 output_token_logprobs for 2 output_ids", 1),
    ],
)
def test_misbehaving_server(mode, exc, msg, calls):
    fake = Fake(mode)
    try:

        async def go():
            async with client([fake.url]) as c:
                await c.generate([1], SP)

        with pytest.raises(exc, match=msg):
            run(go())
        assert fake.calls == calls
    finally:
        fake.stop()


def test_failover_to_live_server_and_least_loaded_balance():
    dead = f"http://127.0.0.1:{free_port()}"
    a, b = Fake(delay=0.2), Fake(delay=0.2)
    try:

        async def go():
            async with client([dead, a.url, b.url], max_concurrency=4) as c:
                outs = await asyncio.gather(*(c.generate([1, 2, 3], SP) for _ in range(12)))
                return outs, c.inflight

        outs, inflight = run(go())
        assert all(o[0].output_ids == [1, 2] and o[0].prompt_tokens == 3 for o in outs)
        assert a.calls + b.calls == 12 and abs(a.calls - b.calls) <= 2
        assert a.max_active + b.max_active <= 4  # global concurrency bound
        assert set(inflight.values()) == {0}
    finally:
        a.stop()
        b.stop()


def test_round_robin_spreads_evenly():
    a, b = Fake(), Fake()
    try:

        async def go():
            async with client([a.url, b.url], routing="round_robin", max_concurrency=1) as c:
                for _ in range(6):
                    await c.generate([1], SP)

        run(go())
        assert (a.calls, b.calls) == (3, 3)
    finally:
        a.stop()
        b.stop()


def test_config_validation():
    with pytest.raises(ValueError, match="at least one"):
        RolloutClientConfig(urls=())
    with pytest.raises(ValueError, match="routing"):
        RolloutClientConfig(urls=("http://x",), routing="random")
    with pytest.raises(ValueError, match="timeout_s"):
        RetryPolicy(timeout_s=0)


# ----- every wait bounded by the caller's policies (the trainer passes the recipe's) -----


class Control:
    """Scripted weight/health endpoints: ``hang`` lists the paths that never answer."""

    def __init__(self, hang=(), health_status: int = 200):
        self.hang, self.health_status = set(hang), health_status
        self.calls: list[str] = []
        app = web.Application()
        for path in ("/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"):
            app.router.add_post(path, self.control)
        app.router.add_get("/health", self.health)
        app.router.add_get("/server_info", self.server_info)
        self.server = BackgroundServer(app, "127.0.0.1", 0).start()

    async def server_info(self, _: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.21", "tp_size": 1})

    async def control(self, request: web.Request) -> web.Response:
        self.calls.append(request.path)
        await request.read()
        if request.path in self.hang:
            await asyncio.sleep(3600)
        return web.json_response({"success": True, "message": ""})

    async def health(self, request: web.Request) -> web.Response:
        self.calls.append(request.path)
        if "/health" in self.hang:
            await asyncio.sleep(3600)
        return web.Response(status=self.health_status, text="")

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


def test_weight_sync_bounded_by_control_policy_and_closed_with_health_policy():
    import torch

    fake = Control(hang=("/update_weights_from_tensor", "/end_weight_update"))
    cfg = RolloutClientConfig(
        urls=(fake.url,),
        control_retry=RetryPolicy(timeout_s=1.0, retries=2),
        health_retry=RetryPolicy(timeout_s=0.5, retries=2),
    )
    try:

        async def go():
            async with RolloutClient(cfg) as c:
                await send_tensors(c, [("w", torch.zeros(2))], "v1")

        t0 = time.monotonic()
        with pytest.raises(
            ServerTimeoutError,
            match=rf"/update_weights_from_tensor failed on 1/1 rollout server\(s\): {fake.url}: .*within 1 s",
        ):
            run(go())
        # 1 s for the bucket (a timeout is not retried) + 0.5 s for the closing /end_weight_update
        assert time.monotonic() - t0 < 3 * 1.0 + 3
        assert fake.calls == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
    finally:
        fake.stop()


@pytest.mark.parametrize(
    "hang,status,exc,msg",
    [
        (("/health",), 200, ServerTimeoutError, "did not answer /health within 0.5 s before phase X"),
        ((), 503, ServerError, r"is unhealthy before phase X \(.*HTTP 503"),
        ((), 404, None, None),  # answered: alive (Search-R1's retrieval server has no /health)
    ],
)
def test_check_health_names_server_and_phase(hang, status, exc, msg):
    fake = Control(hang=hang, health_status=status)
    cfg = RolloutClientConfig(urls=(fake.url,), health_retry=RetryPolicy(timeout_s=0.5, retries=1, backoff_s=0.05))
    try:

        async def go():
            async with RolloutClient(cfg) as c:
                await c.check_health("before phase X")
                return await c.health()

        t0 = time.monotonic()
        if exc is None:
            assert run(go()) == {fake.url: True}
        else:
            with pytest.raises(exc, match=f"rollout server {fake.url} {msg}"):
                run(go())
        assert time.monotonic() - t0 < 3 * 0.5 + 3
    finally:
        fake.stop()


def test_check_health_of_a_dead_server_fails_fast_naming_it():
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = RolloutClientConfig(urls=(dead,), health_retry=RetryPolicy(timeout_s=5.0, retries=2, backoff_s=0.05))

    async def go():
        async with RolloutClient(cfg) as c:
            assert await c.health() == {dead: False}
            await c.check_health("before phase X")

    t0 = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=rf"rollout server {dead} is unreachable before phase X \("):
        run(go())
    assert time.monotonic() - t0 < 5
