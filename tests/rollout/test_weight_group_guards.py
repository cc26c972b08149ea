"""The embedded server's guards on distributed weight updates (issue 31, items 2 and 7).

- A broadcast that disagrees with its announcement (a gloo sender, here a thread of the test
  that is the group's rank 0, broadcasting a tensor larger or smaller than announced, or NaN):
  the server stays up, answers 400 naming the tensor, drops the group and keeps its weights
  (the same /generate gives the same tokens); a correct sync afterwards still works.
- Joins that hang (a master port nobody listens on) run in a pool of their own, at most
  ``--max-weight-group-joins`` at once, each bounded by ``--weight-group-join-timeout-s``: a
  /generate and a valid join meanwhile answer promptly, one join past the cap gets 503 at once.
"""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest
import torch

from sorl_megatron.common.background import free_port
from sorl_megatron.common.protocol import SamplingParams
from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig
from sorl_megatron.sglang_cpu.options import EngineConfig, ServerOptions
from sorl_megatron.sglang_cpu.server import start_rollout_server
from sorl_megatron.weight_sync.distributed import DistributedSender, begin_update, end_update
from sorl_megatron.weight_sync.group import BucketSpec

PROMPT = [5, 6, 7, 8, 9, 10, 11]


async def post(url: str, path: str, body: dict, timeout_s: float = 120) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        async with s.post(url + path, json=body) as r:
            return r.status, await r.json()


async def generate(url: str) -> tuple[list[int], str]:
    async with RolloutClient(url) as c:
        out = (await c.generate(PROMPT, SamplingParams(max_new_tokens=6, sampling_seed=3, ignore_eos=True)))[0]
    return out.output_ids, out.weight_version


@pytest.fixture
def server(moe_dir):
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir)),
                               options=ServerOptions(weight_group_timeout_s=30, weight_group_join_timeout_s=20))
    yield srv
    srv.stop()


def test_a_broadcast_that_disagrees_with_its_announcement_is_refused(server):
    url, served = server.url, server.engine.served
    name = "lm_head.weight"
    shape = tuple(served.state[name].shape)
    before = {k: v.clone() for k, v in served.state.items()}
    tokens_before = asyncio.run(generate(url))
    n = shape[0] * shape[1]
    hostile = {
        "larger": torch.ones(n + n // 2),  # gloo aborted the process for this one
        "smaller": torch.ones(n - shape[1]),  # this one was applied with torch.empty's garbage in its tail
        "nan": torch.full(shape, float("nan")),
    }

    async def send_hostile(sent: torch.Tensor, group_name: str) -> tuple[int, dict]:
        async with RolloutClient(RolloutClientConfig(urls=(url,))) as c:
            sender = DistributedSender(c, group_name, init_timeout_s=20)
            await sender.connect()
            await begin_update(c)
            spec = BucketSpec.of([(name, torch.zeros(shape))], group_name, flush_cache=False)  # what it announces
            cast = threading.Thread(target=lambda: sender.group.broadcast([sent]), daemon=True)
            answer = asyncio.ensure_future(post(url, "/update_weights_from_distributed", spec.to_json(), 60))
            await asyncio.sleep(0.2)  # the server is receiving (as the sender's own send does it)
            cast.start()
            status, body = await answer
            await asyncio.to_thread(cast.join, 30)
            sender.group.destroy()
            await end_update(c, "hostile", ok=False)  # closes the session, version unchanged
            return status, body

    for kind, sent in hostile.items():
        status, body = asyncio.run(send_hostile(sent, f"g_{kind}"))
        assert status == 400 and body["success"] is False and name in body["message"], (kind, body)
        needle = {"larger": "larger than announced", "smaller": "unset or non-finite",
                  "nan": "unset or non-finite"}[kind]
        assert needle in body["message"], (kind, body)
        assert len(server.engine.groups) == 0, kind  # the group is dropped
        assert server.engine.alive
        assert all(torch.equal(served.state[k], v) for k, v in before.items()), kind
    assert served.weight_version == "default"
    assert asyncio.run(generate(url)) == tokens_before  # the old weights still serve

    async def honest() -> None:  # the same server still takes a correct sync
        async with RolloutClient(RolloutClientConfig(urls=(url,))) as c:
            sender = DistributedSender(c, "g_honest", init_timeout_s=20)
            await begin_update(c)
            await sender.send([(name, before[name] + 0.5)], 1 << 20)
            await end_update(c, "honest", ok=True)
            await sender.close()

    asyncio.run(honest())
    assert torch.equal(served.state[name], before[name] + 0.5) and served.weight_version == "honest"


def test_joins_that_hang_block_neither_generate_nor_a_valid_join(moe_dir):
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir)), options=ServerOptions(
        weight_group_timeout_s=600, weight_group_join_timeout_s=15, max_weight_group_joins=8))
    dead = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "backend": "gloo"}  # nobody listens there: each join waits out its timeout

    async def go():
        t0 = time.monotonic()
        # more hung joins than the threads of the loop's default pool (6 on 2 cores), where joins
        # waited before, behind one another
        hung = [asyncio.ensure_future(post(srv.url, "/init_weights_update_group", {**dead, "group_name": f"d{i}"}))
                for i in range(7)]
        while srv.engine.groups._joins < 7:  # all seven are waiting in the join pool
            assert time.monotonic() - t0 < 30, "the joins never started"
            await asyncio.sleep(0.05)
        took = {}
        t = time.monotonic()
        assert (await generate(srv.url))[1] == "default"
        took["generate"] = time.monotonic() - t
        t = time.monotonic()
        async with RolloutClient(RolloutClientConfig(urls=(srv.url,))) as c:  # a valid join, then leave
            sender = DistributedSender(c, "g_valid", init_timeout_s=20)
            await sender.connect()
            await sender.close()
        took["valid join"] = time.monotonic() - t
        assert took["generate"] < 10 and took["valid join"] < 10, took  # though seven joins hang
        # the cap: an eighth hung join fills it, a ninth is refused at once
        hung.append(asyncio.ensure_future(post(srv.url, "/init_weights_update_group", {**dead, "group_name": "d7"})))
        while srv.engine.groups._joins < 8:
            await asyncio.sleep(0.05)
        t = time.monotonic()
        status, body = await post(srv.url, "/init_weights_update_group", {**dead, "group_name": "d8"})
        took["refused"] = time.monotonic() - t
        assert status == 503 and "--max-weight-group-joins 8" in body["message"], body
        answers = await asyncio.gather(*hung)
        return took, answers, time.monotonic() - t0

    try:
        took, answers, total = asyncio.run(go())
    finally:
        srv.stop()
    assert took["refused"] < 3, took
    for status, body in answers:  # the hung joins end at their own bound, 15 s, not the 600 s one
        assert status == 400 and "could not be formed within 15 s" in body["message"], body
    assert total < 90, total
    assert len(srv.engine.groups) == 0


class SilentMaster:
    """A group master that accepts every connection and never answers (issue 49, item 5)."""

    def __init__(self):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)  # held open, never read nor answered

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def test_a_master_that_accepts_and_never_answers_holds_a_join_no_longer_than_its_bound(moe_dir):
    """Before, torch's TCPStore client waited for the master's first answer without a bound: two
    such joins held both slots for a minute (--weight-group-join-timeout-s 8) and every valid
    join got 503 meanwhile. Now each is answered 400 at its bound, the slots are free again and
    a valid join goes through."""
    master = SilentMaster()
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir)), options=ServerOptions(
        weight_group_timeout_s=600, weight_group_join_timeout_s=3, max_weight_group_joins=2))
    silent = {"master_address": "127.0.0.1", "master_port": master.port, "rank_offset": 1, "world_size": 2,
              "backend": "gloo"}

    async def go():
        t0 = time.monotonic()
        hung = [asyncio.ensure_future(post(srv.url, "/init_weights_update_group", {**silent, "group_name": f"s{i}"},
                                           timeout_s=60)) for i in range(2)]
        while srv.engine.groups._joins < 2:
            assert time.monotonic() - t0 < 30, "the joins never started"
            await asyncio.sleep(0.05)
        busy = await post(srv.url, "/init_weights_update_group", {**silent, "group_name": "s2"})  # the cap
        answers = await asyncio.gather(*hung)
        answered = time.monotonic() - t0
        t = time.monotonic()
        async with RolloutClient(RolloutClientConfig(urls=(srv.url,))) as c:  # the slots are free: a valid join
            sender = DistributedSender(c, "g_valid", init_timeout_s=20)
            await sender.connect()
            await sender.close()
        return busy, answers, answered, time.monotonic() - t

    try:
        busy, answers, answered, valid = asyncio.run(go())
    finally:
        srv.stop()
        master.close()
    assert busy[0] == 503, busy
    for status, body in answers:
        assert status == 400 and "could not be formed within 3 s" in body["message"], body
    assert answered < 3 + 2 + 10, answered  # the bound, the unblocking grace, a loaded machine's slack
    assert valid < 10, valid
    assert srv.engine.groups._joins == 0 and len(srv.engine.groups) == 0
