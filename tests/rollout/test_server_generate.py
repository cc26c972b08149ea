"""Embedded server vs a teacher-forced transformers forward, over real HTTP."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from sorl_megatron.common.hf_build import HF_BUILD_LOCK
from sorl_megatron.common.http import RequestRejectedError
from sorl_megatron.common.protocol import SamplingParams, decode_routed_experts
from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig
from sorl_megatron.sglang_cpu.options import EngineConfig
from sorl_megatron.sglang_cpu.server import start_rollout_server

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [3]]


def run(coro):
    return asyncio.run(coro)


async def _generate_all(url, prompts, sp, routed=False):
    async with RolloutClient(RolloutClientConfig(urls=(url,), routing_shape=(2, 2))) as c:  # the tiny MoE's
        outs = await asyncio.gather(*(c.generate(p, sp, return_routed_experts=routed) for p in prompts))
    return [o[0] for o in outs]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_logprobs_equal_teacher_forcing(moe_server, moe_model, temperature, teacher_forced):
    sp = SamplingParams(max_new_tokens=24, temperature=temperature, sampling_seed=7, ignore_eos=True)
    outs = run(_generate_all(moe_server.url, PROMPTS, sp))
    worst = 0.0
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.output_ids) == 24 and out.finish_type == "length"
        assert out.prompt_tokens == len(prompt) and out.completion_tokens == 24
        ref, _ = teacher_forced(moe_model, prompt + out.output_ids, temperature)
        diff = (ref[len(prompt) - 1 :] - torch.tensor(out.output_logprobs)).abs().max().item()
        worst = max(worst, diff)
    print(f"\n[fp32 T={temperature}] max |server - teacher-forced| logprob = {worst:.2e}")
    assert worst <= 1e-5
    assert moe_server.engine.num_waves >= 1


def test_routed_experts_equal_forward_routing(moe_server, moe_model, teacher_forced):
    sp = SamplingParams(max_new_tokens=10, sampling_seed=3, ignore_eos=True)
    outs = run(_generate_all(moe_server.url, PROMPTS, sp, routed=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = prompt + out.output_ids
        assert out.routed_experts.shape == (len(ids) - 1, 2, 2) and out.routed_experts.dtype == np.int32
        _, routing = teacher_forced(moe_model, ids)
        assert np.array_equal(out.routed_experts, routing.numpy())


def test_routed_experts_start_len_and_raw_wire_format(moe_server, moe_model, teacher_forced):
    prompt = PROMPTS[2]

    async def go():
        async with aiohttp.ClientSession() as s:
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0, "no_stop_trim": True},
                "return_logprob": True,
                "return_routed_experts": True,
                "routed_experts_start_len": 4,
                "logprob_start_len": 2,
            }
            async with s.post(f"{moe_server.url}/generate", json=body) as r:
                return r.status, await r.json()

    status, obj = run(go())
    assert status == 200
    meta = obj["meta_info"]
    re = decode_routed_experts(meta["routed_experts"], 2, 2)
    ids = prompt + obj["output_ids"]
    assert re.shape == (len(prompt) + 5 - 1 - 4, 2, 2)
    lp_ref, routing = teacher_forced(moe_model, ids)
    assert np.array_equal(re, routing[4:].numpy())
    # input logprobs from position 2 on: [logprob, id, text] triples; none is null past position 0
    inp = meta["input_token_logprobs"]
    assert [t[1] for t in inp] == prompt[2:]
    assert np.allclose([t[0] for t in inp], lp_ref[1 : len(prompt) - 1].numpy(), atol=1e-5)
    # greedy: every output token is the argmax of the teacher-forced distribution
    out_lp = [t[0] for t in meta["output_token_logprobs"]]
    assert np.allclose(out_lp, lp_ref[len(prompt) - 1 :].numpy(), atol=1e-5)
    assert meta["weight_version"] == "default" and isinstance(obj["text"], str)


def test_batch_n_seed_and_stops(moe_server, tokenizer):
    async def post(body):
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{moe_server.url}/generate", json=body) as r:
                return r.status, await r.json()

    sp = {"max_new_tokens": 6, "sampling_seed": 11, "n": 3, "ignore_eos": True}
    status, outs = run(post({"input_ids": [PROMPTS[0], PROMPTS[1]], "sampling_params": sp}))
    assert status == 200 and isinstance(outs, list) and len(outs) == 6
    # same seed -> sample j of a prompt is reproducible; different samples differ
    status, again = run(post({"input_ids": PROMPTS[0], "sampling_params": sp}))
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs[:3]]
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) > 1
    # stop token id: find the 3rd greedy token, then stop on it
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    _, g = run(post({"input_ids": PROMPTS[2], "sampling_params": greedy}))
    tok = g["output_ids"][2]
    first = g["output_ids"].index(tok)
    _, s1 = run(
        post(
            {
                "input_ids": PROMPTS[2],
                "sampling_params": {**greedy, "stop_token_ids": [tok], "no_stop_trim": True},
                "return_logprob": True,
            }
        )
    )
    assert s1["output_ids"] == g["output_ids"][: first + 1]
    assert s1["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    assert len(s1["meta_info"]["output_token_logprobs"]) == first + 1
    _, s2 = run(post({"input_ids": PROMPTS[2], "sampling_params": {**greedy, "stop_token_ids": [tok]}}))
    assert s2["output_ids"] == g["output_ids"][:first]  # trimmed without no_stop_trim
    # stop string: the decoded text of the 2nd..3rd greedy tokens
    text = tokenizer.decode(g["output_ids"][1:3])
    _, s3 = run(post({"input_ids": PROMPTS[2], "sampling_params": {**greedy, "stop": [text], "no_stop_trim": True}}))
    assert s3["meta_info"]["finish_reason"] == {"type": "stop", "matched": text}
    assert text in s3["text"] and s3["output_ids"] == g["output_ids"][: len(s3["output_ids"])]
    # top_k=1 sampling is greedy
    _, s4 = run(
        post({"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 8, "top_k": 1, "ignore_eos": True}})
    )
    assert s4["output_ids"] == g["output_ids"]


@pytest.mark.parametrize(
    "body,msg",
    [
        ({}, "input_ids or text"),
        ({"input_ids": []}, "non-empty"),
        ({"input_ids": [1, 10**9]}, "token id"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "1 entries for 2 prompts"),
        (
            {"input_ids": [1, 2], "routed_experts_start_len": 5, "return_routed_experts": True},
            "routed_experts_start_len",
        ),
        ({"input_ids": [1], "stream": True}, "stream"),
    ],
)
def test_bad_generate_requests_get_400(moe_server, body, msg):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{moe_server.url}/generate", json=body) as r:
                return r.status, await r.json()

    status, obj = run(go())
    assert status == 400 and msg in obj["error"]["message"]


def test_malformed_json_body_is_400_and_server_survives(moe_server):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(
                f"{moe_server.url}/generate", data=b"{oops", headers={"Content-Type": "application/json"}
            ) as r:
                assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
            async with s.get(f"{moe_server.url}/health") as r:
                assert r.status == 200
            async with s.get(f"{moe_server.url}/model_info") as r:
                info = await r.json()
            async with s.get(f"{moe_server.url}/server_info") as r:
                server = await r.json()
        # /model_info has SGLang's fields only: no layer count or top-k for a client to lean on
        assert set(info) == {"model_path", "tokenizer_path", "is_generation", "weight_version", "model_type",
                             "architectures"}
        assert server["num_moe_layers"] == 2 and server["num_experts_per_tok"] == 2 and server["version"] == "0.5.21"

    run(go())


def test_the_routing_shape_comes_from_the_models_config(moe_dir, moe_server):
    """R3's (layers, top_k) is read from config.json (as SGLang captures: every decoder layer, the
    leading dense ones unrouted), never asked of the server; a client without it refuses at once."""
    from types import SimpleNamespace

    from sorl_megatron.bridge.families import FamilyConfigError, routing_shape
    from sorl_megatron.bridge.hf_config import load_hf_config
    from sorl_megatron.common.protocol import ProtocolError

    assert routing_shape(load_hf_config(str(moe_dir))) == (2, 2)
    deepseek = SimpleNamespace(model_type="deepseek_v3", num_hidden_layers=61, num_experts_per_tok=8,
                               first_k_dense_replace=3)
    assert routing_shape(deepseek) == (61, 8)
    with pytest.raises(FamilyConfigError, match="num_experts_per_tok"):
        routing_shape(SimpleNamespace(model_type="qwen2", num_hidden_layers=2))

    async def ask(shape):
        async with RolloutClient(RolloutClientConfig(urls=(moe_server.url,), routing_shape=shape)) as c:
            return await c.generate([5, 6, 7], SamplingParams(max_new_tokens=3), return_routed_experts=True)

    with pytest.raises(ProtocolError, match="routing_shape"):
        run(ask(None))
    out = run(ask(routing_shape(load_hf_config(str(moe_dir)))))[0]
    assert out.routed_experts.shape[1:] == (2, 2)


def test_precision_mismatch_is_real_and_reported(moe_dir, moe_model, teacher_forced):
    """bf16 and emulated-fp8 servers sample from a different distribution than fp32 training."""
    sp = SamplingParams(max_new_tokens=32, sampling_seed=5, ignore_eos=True)
    report = {}
    for precision in ("bf16", "fp8"):
        srv = start_rollout_server(
            EngineConfig(model_path=str(moe_dir), precision=precision, enable_return_routed_experts=True)
        )
        try:
            outs = run(_generate_all(srv.url, PROMPTS, sp, routed=True))
        finally:
            srv.stop()
        diffs, flips, total = [], 0, 0
        for prompt, out in zip(PROMPTS, outs):
            ref, routing = teacher_forced(moe_model, prompt + out.output_ids)
            diffs.append((ref[len(prompt) - 1 :] - torch.tensor(out.output_logprobs)).abs())
            flips += int((np.sort(out.routed_experts, -1) != np.sort(routing.numpy(), -1)).any(-1).sum())
            total += routing.shape[0] * routing.shape[1]
        d = torch.cat(diffs)
        report[precision] = (d.max().item(), d.mean().item(), flips / total)
    for p, (mx, mean, flip) in report.items():
        print(
            f"\n[{p} vs fp32 trainer] logprob |diff| max={mx:.3e} mean={mean:.3e}; "
            f"routing flips {flip:.1%} of token-layers"
        )
    assert report["bf16"][0] > 1e-4 and report["fp8"][0] > 1e-4
    assert report["fp8"][1] > report["bf16"][1]  # coarser weights, larger mismatch


def test_dense_model_logprobs_and_no_routing(dense_dir, teacher_forced):
    srv = start_rollout_server(EngineConfig(model_path=str(dense_dir), enable_return_routed_experts=True))
    with HF_BUILD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    try:
        outs = run(
            _generate_all(srv.url, PROMPTS[:2], SamplingParams(max_new_tokens=12, sampling_seed=1, ignore_eos=True))
        )
        for prompt, out in zip(PROMPTS, outs):
            ref, _ = teacher_forced(model, prompt + out.output_ids)
            assert (ref[len(prompt) - 1 :] - torch.tensor(out.output_logprobs)).abs().max() <= 1e-5

        async def routed():
            async with RolloutClient(RolloutClientConfig(urls=(srv.url,), routing_shape=(2, 2))) as c:
                await c.generate([1, 2], SamplingParams(max_new_tokens=2), return_routed_experts=True)

        with pytest.raises(RequestRejectedError, match="no MoE routers"):
            run(routed())
    finally:
        srv.stop()
