"""SGLang's distributed weight update against two embedded servers, in one process.

The test is the trainer's sending rank (``weight_sync.distributed.DistributedSender``); both
servers join its gloo group through ``/init_weights_update_group`` and receive every bucket by
broadcast. The multi-rank trainer side (TP2, EP2, PP2 senders) is tests/engine/test_weight_sync.py.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from safetensors.torch import load_file

from sorl_megatron.common.fp8 import dequantize_block_fp8, quantize_block_fp8, quantize_hf_tensor
from sorl_megatron.common.hf_build import HF_BUILD_LOCK
from sorl_megatron.common.http import RequestRejectedError
from sorl_megatron.common.protocol import SamplingParams
from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig
from sorl_megatron.sglang_cpu.options import EngineConfig, ServerOptions
from sorl_megatron.sglang_cpu.server import start_rollout_server
from sorl_megatron.weight_sync.distributed import (
    DistributedSender,
    begin_update,
    end_update,
    group_backend,
    server_device,
)
from sorl_megatron.weight_sync.group import WeightGroupError
from tests.http_calls import call

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def servers(moe_dir):
    opts = ServerOptions(weight_group_timeout_s=20)
    srvs = [start_rollout_server(EngineConfig(model_path=str(moe_dir)), options=opts) for _ in range(2)]
    yield srvs
    for s in srvs:
        s.stop()


def client_of(servers) -> RolloutClient:
    return RolloutClient(RolloutClientConfig(urls=tuple(s.url for s in servers)))


def perturbed(moe_dir, scale: float, seed: int) -> dict[str, torch.Tensor]:
    state = load_file(str(moe_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}


async def sync(servers, named, version: str, bucket_bytes: int, group: str = "g_test", close: bool = True):
    async with client_of(servers) as c:
        sender = DistributedSender(c, group, init_timeout_s=20)
        await begin_update(c)
        ok = False
        try:
            sent = await sender.send(named, bucket_bytes)
            ok = True
        finally:
            await end_update(c, version, ok)
            if close:
                await sender.close()
        return sent


async def logprobs(url: str):
    async with RolloutClient(url) as c:
        out = (await c.generate(PROMPT, SamplingParams(max_new_tokens=12, sampling_seed=3, ignore_eos=True)))[0]
    return out


def test_distributed_sync_both_servers_follow(servers, moe_dir, teacher_forced):
    state = perturbed(moe_dir, 0.05, seed=11)
    sent = run(sync(servers, list(state.items()), "step-7", bucket_bytes=64 * 1024))
    assert sent == sum(t.numel() * 4 for t in state.values())
    base = servers[0].engine.served.model  # the served class, rebuilt from the sent state (as the tests of tensors do)
    with HF_BUILD_LOCK:
        model = type(base).from_pretrained(None, config=base.config, state_dict=state, dtype=torch.float32).eval()
    for s in servers:
        assert all(torch.equal(s.engine.served.state[k], v) for k, v in state.items())
        out = run(logprobs(s.url))
        assert out.weight_version == "step-7"
        ref, _ = teacher_forced(model, PROMPT + out.output_ids)
        assert (ref[len(PROMPT) - 1:] - torch.tensor(out.output_logprobs)).abs().max().item() <= 1e-5
        assert len(s.engine.groups) == 0  # destroyed at the end


def settings(**kw) -> SimpleNamespace:
    """The rollout settings a transport reads (duck-typed like the recipe's rollout section)."""
    sync = SimpleNamespace(transport="distributed", timeout_s=30.0, init_timeout_s=20.0, bucket_mb=1,
                           master_address=None)
    base = dict(weight_sync=sync, precision="fp32", urls=[], retries=0, health_timeout_s=5.0,
                async_=SimpleNamespace(flush_idle_timeout_s=5.0))
    return SimpleNamespace(**{**base, **kw})


def test_each_sync_goes_to_the_servers_it_is_given(servers, moe_dir, monkeypatch):
    """The transport takes the servers from every call, not the first: a second sync to more
    servers (as after a restart on a new URL) leaves the old group and forms one with them all.
    The model is a state dict here; the export (every rank's own part) is tests/engine's."""
    from sorl_megatron.weight_sync import distributed
    from sorl_megatron.weight_sync.base import SyncTargets

    monkeypatch.setattr(distributed, "weight_sync_roles", lambda: (True, True))
    monkeypatch.setattr(distributed, "iter_owned_hf_weights", lambda model: iter(list(model.items())))
    wsync = distributed.DistributedWeightSync(settings())
    try:
        first = perturbed(moe_dir, 0.05, seed=21)
        stats = wsync.sync(first, SyncTargets((servers[0].url,)), "one-server")
        assert stats.bytes_sent == sum(t.numel() * 4 for t in first.values())
        assert servers[0].engine.served.weight_version == "one-server" != servers[1].engine.served.weight_version
        assert list(servers[0].engine.groups._groups) == ["sorl_wsync_r0"] and servers[1].engine.groups._groups == {}
        second = perturbed(moe_dir, 0.05, seed=22)
        wsync.sync(second, SyncTargets(tuple(s.url for s in servers)), "two-servers")
        for s in servers:
            assert s.engine.served.weight_version == "two-servers"
            assert all(torch.equal(s.engine.served.state[k], v) for k, v in second.items())
            assert list(s.engine.groups._groups) == ["sorl_wsync_r0"]
    finally:
        wsync.close()
    assert all(s.engine.groups._groups == {} for s in servers)  # close left the group on both


def test_a_server_back_on_the_same_url_gets_a_new_group(servers, moe_dir, monkeypatch):
    """An external server that failed and was brought back on the same URL by its operator is
    a new process without the group: the fleet's count of its failures (``generations``) makes
    the sender form the group again; with the same count it sends into a group the server no
    longer has, and the sync fails."""
    from sorl_megatron.weight_sync import distributed
    from sorl_megatron.weight_sync.base import SyncTargets

    monkeypatch.setattr(distributed, "weight_sync_roles", lambda: (True, True))
    monkeypatch.setattr(distributed, "iter_owned_hf_weights", lambda model: iter(list(model.items())))
    wsync = distributed.DistributedWeightSync(settings())
    url = servers[0].url
    try:
        wsync.sync(perturbed(moe_dir, 0.05, seed=31), SyncTargets((url,), generations=(0,)), "first")
        servers[0].engine.groups.destroy("sorl_wsync_r0")  # what a restart on the same port leaves
        with pytest.raises((RequestRejectedError, WeightGroupError)):  # no group there / its peer left
            wsync.sync(perturbed(moe_dir, 0.05, seed=32), SyncTargets((url,), generations=(0,)), "same-count")
        wsync.sync(perturbed(moe_dir, 0.05, seed=31), SyncTargets((url,), generations=(0,)), "formed-after-failure")
        servers[0].engine.groups.destroy("sorl_wsync_r0")
        second = perturbed(moe_dir, 0.05, seed=33)
        wsync.sync(second, SyncTargets((url,), generations=(1,)), "after-restart")
        assert servers[0].engine.served.weight_version == "after-restart"
        assert all(torch.equal(servers[0].engine.served.state[k], v) for k, v in second.items())
    finally:
        wsync.close()
    assert servers[0].engine.groups._groups == {}


def test_fp8_buckets_are_the_quantizers_output(servers, moe_dir):
    state = perturbed(moe_dir, 0.05, seed=12)
    named = [pair for n, t in state.items() for pair in quantize_hf_tensor(n, t)]
    assert any(t.dtype == torch.float8_e4m3fn for _, t in named)
    run(sync(servers, named, "fp8-1", bucket_bytes=32 * 1024))
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    expected = dequantize_block_fp8(*quantize_block_fp8(state[name]))
    for s in servers:
        assert torch.equal(s.engine.served.state[name], expected)
        assert torch.equal(s.engine.served.state["model.norm.weight"], state["model.norm.weight"])
        assert s.engine.served.weight_version == "fp8-1"


async def post(url, path, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body) as r:
            return r.status, await r.json()


@pytest.mark.parametrize("trainer_cuda, devices, backend", [
    (True, ["cuda", "cuda"], "nccl"),
    (True, ["cuda", "cpu"], "gloo"),  # one CPU server: NCCL cannot reach it
    (True, ["cpu"], "gloo"),  # the embedded server on a GPU host
    (False, ["cuda"], "gloo"),  # a CPU trainer
    (False, ["cpu"], "gloo"),
])
def test_the_group_backend_is_nccl_only_when_both_ends_hold_cuda(trainer_cuda, devices, backend):
    assert group_backend(trainer_cuda, devices) == backend


def test_server_device_from_server_info():
    assert server_device({"device": "cpu"}) == "cpu"
    assert server_device({"tp_size": 8}) == "cuda"  # real SGLang that does not say: a GPU server
    assert server_device({"device": None}) == "cuda"


def test_the_server_reports_its_device_and_the_sender_follows(servers):
    url = servers[0].url
    status, info = call(url, "GET", "/server_info")
    assert status == 200 and info["device"] == "cpu"

    async def formed_backend():
        async with client_of(servers[:1]) as c:
            sender = DistributedSender(c, "g_device", init_timeout_s=20)
            await sender.connect()
            try:
                return sender.group.spec.backend
            finally:
                await sender.close()

    assert run(formed_backend()) == "gloo"  # on a GPU host too: the server receives on the CPU
    # asked for NCCL (SGLang's default backend), the CPU server refuses before joining anything
    status, res = run(post(url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": "g_nccl"}))
    assert status == 400 and "backend 'gloo'" in res["message"], res


def test_bad_requests_are_4xx_and_leave_weights(servers, moe_dir):
    url = servers[0].url
    before = {k: v.clone() for k, v in servers[0].engine.served.state.items()}
    version = servers[0].engine.served.weight_version
    bucket = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "nope"}
    status, res = run(post(url, "/update_weights_from_distributed", bucket))  # SGLang 0.5.21: only in a session
    assert status == 400 and "must run between begin_weight_update() and end_weight_update()" in res["message"]
    assert run(post(url, "/begin_weight_update", {"selector": "all"}))[0] == 200
    status, res = run(post(url, "/update_weights_from_distributed", bucket))
    assert status == 400 and "'nope' is not initialized" in res["message"]
    status, res = run(post(url, "/destroy_weights_update_group", {"group_name": "nope"}))
    assert status == 400 and "not initialized" in res["message"]
    for body, needle in [
        ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2}, "rank_offset"),
        ({"master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 1, "world_size": 2}, "master_port"),
        ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "mpi"},
         "backend"),
        ({"master_port": 1, "rank_offset": 1, "world_size": 2}, "master_address"),
    ]:
        status, res = run(post(url, "/init_weights_update_group", body))
        assert status == 400 and needle in res["message"], res

    # a live group: mismatched shape, unknown name, bad dtype, ragged lists -> 400 before any byte moves
    async def bad_buckets():
        async with client_of(servers[:1]) as c:
            sender = DistributedSender(c, "g_bad", init_timeout_s=20)
            await sender.connect()
            answers = []
            for names, dtypes, shapes in [
                (["model.norm.weight"], ["float32"], [[65]]),
                (["model.layers.7.nope.weight"], ["float32"], [[3]]),
                (["model.norm.weight"], ["int64"], [[64]]),
                (["model.norm.weight"], ["float32", "float32"], [[64]]),
                (["model.layers.0.self_attn.q_proj.weight"], ["float8_e4m3fn"], [[64, 64]]),
            ]:
                answers.append(await post(url, "/update_weights_from_distributed",
                                          {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": "g_bad"}))
            # the sender's own path: a wrong shape is refused and reported by name, nothing is applied
            with pytest.raises(RequestRejectedError, match=r"model.norm.weight: shape \(3,\)"):
                await sender.send([("model.norm.weight", torch.ones(3))], 1 << 20)
            assert sender.group is None  # dropped: the next sync forms a new group
            status, res = await post(url, "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
                "group_name": "g_bad"})
            return answers, status, res

    answers, status, res = run(bad_buckets())
    needles = ["shape (65,)", "unknown weight name 'model.layers.7.nope.weight'", "dtypes[0]", "one entry per tensor",
               "without model.layers.0.self_attn.q_proj.weight_scale_inv"]
    for (st, body), needle in zip(answers, needles):
        assert st == 400 and body["success"] is False and needle in body["message"], body
    assert status == 400 and "already initialized" in res["message"]  # the server still holds it until destroy
    run(post(url, "/destroy_weights_update_group", {"group_name": "g_bad"}))
    assert run(post(url, "/end_weight_update", {}))[0] == 200
    assert all(torch.equal(servers[0].engine.served.state[k], v) for k, v in before.items())
    assert servers[0].engine.served.weight_version == version
    assert run(logprobs(url)).weight_version == version


def test_group_init_is_bounded_by_its_timeout(moe_dir):
    opts = ServerOptions(weight_group_timeout_s=1.5)
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir)), options=opts)
    try:
        # a trainer that never comes: the server answers within its timeout, and keeps serving
        body = {"master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1, "world_size": 2,
                "group_name": "g_gone", "backend": "gloo"}
        status, res = run(asyncio.wait_for(post(srv.url, "/init_weights_update_group", body), 30))
        assert status == 400 and "could not be formed within 1.5 s" in res["message"]
        assert len(srv.engine.groups) == 0
        assert run(logprobs(srv.url)).weight_version == "default"
    finally:
        srv.stop()
    assert WeightGroupError  # the error type the sender raises for the same failure


def test_a_bucket_whose_client_left_mid_broadcast_is_still_applied(moe_dir):
    """The server cancels a handler whose client disconnects. A bucket's broadcast, once its
    server thread waits in it, finishes anyway, so its tensors must also be applied: a bucket
    received and dropped would leave the weights torn at /end_weight_update. The client here
    gives up (1 s) before the trainer side broadcasts; the broadcast then completes."""
    from sorl_megatron.weight_sync.group import BucketSpec

    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir)), options=ServerOptions(weight_group_timeout_s=60))
    name = "model.norm.weight"
    new = srv.engine.served.state[name] + 1.0

    async def go():
        async with client_of([srv]) as c:
            sender = DistributedSender(c, "g_left", init_timeout_s=30)
            await sender.connect()
            await begin_update(c)
            spec = BucketSpec.of([(name, new)], "g_left", flush_cache=False)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as s:
                with pytest.raises(asyncio.TimeoutError):
                    await s.post(f"{srv.url}/update_weights_from_distributed", json=spec.to_json())
            await asyncio.sleep(1.0)  # the server has seen the client go (its handler is cancelled)
            await asyncio.to_thread(sender.group.broadcast, [new])
            deadline = time.monotonic() + 60
            while not torch.equal(srv.engine.served.state[name], new) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await end_update(c, "after-left", True)
            await sender.close()

    try:
        run(go())
        assert torch.equal(srv.engine.served.state[name], new), "the received bucket was dropped"
        assert srv.engine.served.weight_version == "after-left"
    finally:
        srv.stop()
