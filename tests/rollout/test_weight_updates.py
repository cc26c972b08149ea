"""Weight updates over HTTP: from disk and from tensors; log-probs follow the new weights."""

from __future__ import annotations

import asyncio
import base64
import pickle

import aiohttp
import pytest
import torch
from safetensors.torch import load_file

from sorl_megatron.common.hf_build import HF_BUILD_LOCK
from sorl_megatron.common.http import RequestRejectedError
from sorl_megatron.common.protocol import SamplingParams
from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig
from sorl_megatron.sglang_cpu.options import EngineConfig
from sorl_megatron.sglang_cpu.server import start_rollout_server
from sorl_megatron.weight_sync.tensor import send_tensors
from tests.hf_checkpoints import perturbed_checkpoint

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def server(moe_dir):
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir), enable_return_routed_experts=True))
    yield srv
    srv.stop()


async def sample(url, routed=True):
    async with RolloutClient(RolloutClientConfig(urls=(url,), routing_shape=(2, 2))) as c:  # the tiny MoE's
        return (
            await c.generate(
                PROMPT,
                SamplingParams(max_new_tokens=16, sampling_seed=2, ignore_eos=True),
                return_routed_experts=routed,
            )
        )[0]


def max_diff(model, out, teacher_forced):
    ref, routing = teacher_forced(model, PROMPT + out.output_ids)
    return (ref[len(PROMPT) - 1 :] - torch.tensor(out.output_logprobs)).abs().max().item(), routing


def test_update_from_disk(server, moe_dir, moe_model, tmp_path, teacher_forced):
    before = run(sample(server.url))
    assert before.weight_version == "default"
    new_model = perturbed_checkpoint(moe_dir, tmp_path / "v1", 0.05, seed=1)

    async def update():
        async with RolloutClient(server.url) as c:
            return await c.update_weights_from_disk(str(tmp_path / "v1"), weight_version="step-1")

    assert run(update()) == "step-1"
    after = run(sample(server.url))
    assert after.weight_version == "step-1"
    diff_new, routing = max_diff(new_model, after, teacher_forced)
    diff_old, _ = max_diff(moe_model, after, teacher_forced)
    assert diff_new <= 1e-5 < diff_old
    assert (after.routed_experts == routing.numpy()).all()


def test_update_from_tensor_partial_in_buckets(server, tmp_path, teacher_forced):
    # Start from a known checkpoint, then send some tensors (incl. per-expert HF names).
    base = perturbed_checkpoint(server.engine.served.model_path, tmp_path / "base", 0.0, seed=0)
    state = load_file(str(tmp_path / "base" / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    names = [
        "model.layers.0.mlp.experts.1.up_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "lm_head.weight",
    ]
    update = {n: state[n] + 0.1 * torch.randn(state[n].shape, generator=g) for n in names}
    state.update(update)
    with HF_BUILD_LOCK:
        expected = type(base).from_pretrained(None, config=base.config, state_dict=state, dtype=torch.float32).eval()

    async def go():
        async with RolloutClient(server.url) as c:
            # tiny buckets: one tensor per /update_weights_from_tensor call
            return await send_tensors(c, update.items(), "step-2", bucket_bytes=1)

    assert run(go()) == sum(t.numel() * 4 for t in update.values())
    out = run(sample(server.url))
    assert out.weight_version == "step-2"
    diff_new, routing = max_diff(expected, out, teacher_forced)
    diff_old, _ = max_diff(base, out, teacher_forced)
    assert diff_new <= 1e-5 < diff_old
    assert (out.routed_experts == routing.numpy()).all()


def test_torch_weights_only_format(server):
    state = server.engine.served.state
    name = "model.norm.weight"

    async def go():
        async with RolloutClient(server.url) as c:
            return await send_tensors(c, [(name, state[name] * 1.5)], "step-3", load_format="torch")

    old = state[name].clone()
    run(go())
    assert server.engine.served.weight_version == "step-3"
    assert torch.allclose(server.engine.served.state[name], old * 1.5)
    assert torch.allclose(server.engine.served.model.model.norm.weight, old * 1.5)


async def post(url, path, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body) as r:
            return r.status, await r.json()


def test_bad_updates_rejected_and_server_keeps_serving(server, tmp_path):
    version = server.engine.served.weight_version
    evil = base64.b64encode(pickle.dumps([("model.norm.weight", torch.ones(64))])).decode()
    status, res = run(
        post(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": [evil], "load_format": "pickle"})
    )
    assert status == 400 and res["success"] is False and "not accepted" in res["message"]
    # plain pickle bytes declared as torch format: the weights-only unpickler decodes only tensors
    status, res = run(
        post(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": ["@@@"], "load_format": "torch"})
    )
    assert status == 400 and "base64" in res["message"]

    async def wrong(named, fmt="safetensors"):
        async with RolloutClient(server.url) as c:
            await send_tensors(c, named, "never", load_format=fmt)

    with pytest.raises(RequestRejectedError, match="model.layers.9.nope"):
        run(wrong([("model.layers.9.nope", torch.ones(3))]))
    with pytest.raises(RequestRejectedError, match=r"lm_head.weight: shape \(2, 2\)"):
        run(wrong([("lm_head.weight", torch.ones(2, 2))]))
    with pytest.raises(RequestRejectedError, match="NaN"):
        run(wrong([("model.norm.weight", torch.full((64,), float("nan")))]))
    status, res = run(post(server.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")}))
    assert status == 400 and "not a directory" in res["message"]
    status, res = run(post(server.url, "/update_weights_from_disk", {}))
    assert status == 400 and "model_path" in res["message"]
    assert server.engine.served.weight_version == version
    assert run(sample(server.url, routed=False)).weight_version == version


def test_update_weight_version_and_flush(server):
    status, res = run(post(server.url, "/update_weight_version", {"new_version": "v42"}))
    assert status == 200 and res["success"]

    async def go():
        async with RolloutClient(server.url) as c:
            await c.flush_cache()
            return await c.health(), await c.model_info()

    health, info = run(go())
    assert health == {server.url: True} and info["weight_version"] == "v42"


def test_rebuilds_beside_a_callers_load_keep_lm_heads_tied(tmp_path, tokenizer):
    """transformers swaps process-wide functions (``tie_weights`` among them) while it builds a
    model. An embedded server rebuilding after weight updates while its caller loads a model
    interleaved those swaps and left every later model of the process with a random untied LM
    head (a flaky full-suite failure): both sides hold ``HF_BUILD_LOCK``."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    from sorl_megatron.data.tiny_model import TinyModelConfig, save_tiny_model
    from sorl_megatron.sglang_cpu.engine import RolloutEngine

    tie_weights = PreTrainedModel.tie_weights
    tied = save_tiny_model(TinyModelConfig(arch="qwen3_moe", seed=3, tie_embeddings=True), tmp_path / "tied", tokenizer)
    engine = RolloutEngine(EngineConfig(model_path=str(tied))).start()
    try:
        rebuilds = [engine.call(lambda: engine.served.update_from_disk(str(tied), None)) for _ in range(16)]
        for _ in range(16):
            with HF_BUILD_LOCK:
                model = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)
            assert model.lm_head.weight is model.model.embed_tokens.weight
        for done in rebuilds:
            done.result(timeout=120)
        assert engine.served.model.lm_head.weight is engine.served.model.model.embed_tokens.weight
    finally:
        engine.stop()
    assert PreTrainedModel.tie_weights is tie_weights
