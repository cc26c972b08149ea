"""Buckets keep together what SGLang joins within one request (``common.buckets``): DeepSeek's
``q_a_proj`` and ``kv_a_proj_with_mqa`` (and their FP8 scales), which its loader caches until
both have come in the same ``load_weights`` call. Small inputs here, every transport's bucketing,
and SGLang's own loader (from the wheel) over the buckets of a small DeepSeek-V3 checkpoint; the
GPU recipes at full size are test_receiver_rules.py's."""

from __future__ import annotations

import asyncio
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from sorl_megatron.common.buckets import buckets, fused_group
from sorl_megatron.common.fp8 import quantize_hf_tensor
from sorl_megatron.rollout.client import RolloutClient
from sorl_megatron.weight_sync.distributed import DistributedSender
from sorl_megatron.weight_sync.tensor import send_tensors
from sorl_megatron.weight_sync.wire import deserialize_named_tensors
from tests.weight_sync.test_transports import Recorder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYER = "model.layers.{}.self_attn."
# one MLA layer's attention as the export yields it: q_b_proj (and q_a's norm) between the pair
ORDER = ["o_proj.weight", "q_a_proj.weight", "q_b_proj.weight", "q_a_layernorm.weight", "kv_a_proj_with_mqa.weight",
         "kv_b_proj.weight", "kv_a_layernorm.weight"]


def layers(n: int, fp8: bool = False, rows: int = 128) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i in range(n):
        for part in ORDER:
            t = torch.randn(rows) if "layernorm" in part else torch.randn(rows, 128)
            out += list(quantize_hf_tensor(LAYER.format(i) + part, t)) if fp8 else [(LAYER.format(i) + part, t)]
    return out


def where(bucketed: list[list[str]]) -> dict[str, int]:
    return {n: i for i, b in enumerate(bucketed) for n in b}


def together(bucketed: list[list[str]], n: int) -> list[str]:
    """The fused pairs (and their scales) of ``n`` layers that are split over two buckets."""
    at = where(bucketed)
    split = []
    for i in range(n):
        for suffix in ("weight", "weight_scale_inv"):
            a, b = (LAYER.format(i) + f"{p}.{suffix}" for p in ("q_a_proj", "kv_a_proj_with_mqa"))
            if a in at and at[a] != at[b]:
                split.append(a)
    return split


def test_the_group_rule_names_deepseeks_pair_only():
    a, b = fused_group(LAYER.format(7) + "q_a_proj.weight"), fused_group(LAYER.format(7) + "kv_a_proj_with_mqa.weight")
    assert a == b and a[1] == 2
    assert fused_group(LAYER.format(8) + "q_a_proj.weight") != a
    assert fused_group(LAYER.format(7) + "q_a_proj.weight_scale_inv") is None  # it follows its weight
    assert fused_group(LAYER.format(7) + "q_b_proj.weight") is None
    assert fused_group("model.layers.7.self_attn.q_proj.weight") is None  # Moonlight's: no q LoRA, no fusion


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("bucket_kb", [48, 100, 130, 300])
def test_a_fused_pair_and_its_scales_share_a_bucket_at_every_bucket_size(fp8, bucket_kb):
    named = layers(6, fp8)
    out = [([n for n, _ in b], last) for b, last in buckets(named, bucket_kb * 1024)]
    bucketed = [b for b, _ in out]
    assert sorted(n for b in bucketed for n in b) == sorted(n for n, _ in named)  # each tensor once
    assert together(bucketed, 6) == []
    if fp8:
        at = where(bucketed)
        assert all(at[n] == at[n + "_scale_inv"] for n in at if n + "_scale_inv" in at)
    assert [last for _, last in out] == [False] * (len(out) - 1) + [True]
    # the bound holds, but for a unit larger than a bucket (a tensor, or the pair, with scales)
    pair = 2 * 128 * 128 * (1 if fp8 else 4) + (2 * 4 if fp8 else 0)
    for b, _ in out:
        size = sum(t.numel() * t.element_size() for n, t in named if n in b)
        assert size <= max(bucket_kb * 1024, pair) + (4 if fp8 else 0), (b, size)


def test_the_old_rule_splits_the_pair():
    """Without the group rule (pairs of weight and scale only, as before issue 45) the same
    layers at 100 KiB buckets put some q_a_proj and kv_a_proj_with_mqa in different buckets."""
    bucketed, bucket, size = [], [], 0
    for n, t in layers(6):
        if bucket and size + t.numel() * 4 > 100 * 1024:
            bucketed.append(bucket)
            bucket, size = [], 0
        bucket.append(n)
        size += t.numel() * 4
    bucketed.append(bucket)
    assert together(bucketed, 6)


def test_a_held_member_waits_for_its_group_only_and_buckets_stay_lazy():
    taken: list[str] = []

    def export():
        for n, t in layers(2):
            taken.append(n)
            yield n, t

    it = buckets(export(), bucket_bytes=128 * 128 * 4)  # one weight per bucket
    first, _ = next(it)
    assert [n for n, _ in first] == [LAYER.format(0) + "o_proj.weight"]
    assert taken[-1] == LAYER.format(0) + "q_b_proj.weight"  # q_a_proj held, q_b_proj did not fit
    second, _ = next(it)
    assert [n for n, _ in second] == [LAYER.format(0) + "q_b_proj.weight"]
    assert taken[-1] == LAYER.format(0) + "q_a_layernorm.weight"
    third, _ = next(it)
    assert [n for n, _ in third] == [LAYER.format(0) + "q_a_layernorm.weight"]
    assert taken[-1] == LAYER.format(0) + "kv_a_proj_with_mqa.weight"  # the pair is whole: no more taken
    fourth, _ = next(it)
    assert [n for n, _ in fourth] == [LAYER.format(0) + p for p in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight")]


def test_a_group_missing_a_member_is_sent_at_the_end():
    named = [(LAYER.format(0) + "q_a_proj.weight", torch.ones(4)), ("model.norm.weight", torch.ones(4))]
    assert [[n for n, _ in b] for b, _ in buckets(named, 16)] == [["model.norm.weight"],
                                                                 [LAYER.format(0) + "q_a_proj.weight"]]


def test_the_distributed_sender_posts_each_pair_in_one_request():
    posted: list[list[str]] = []
    s = object.__new__(DistributedSender)  # a formed group, without the servers
    s.group_name, s.bytes_sent, s.group = "g0", 0, object()
    s.client = SimpleNamespace(cfg=SimpleNamespace(urls=("http://server",)))
    s.group_urls, s.generations, s.group_generations = s.client.cfg.urls, (), ()

    async def send_bucket(spec, tensors):
        posted.append(list(spec.names))

    s._send_bucket = send_bucket
    asyncio.run(s.send(iter(layers(6, fp8=True)), 40 * 1024, settle=lambda: None))
    assert len(posted) > 6 and together(posted, 6) == []


def test_the_tensor_transport_posts_each_pair_in_one_body():
    server = Recorder()
    try:
        async def go():
            async with RolloutClient(server.url) as client:
                await send_tensors(client, iter(layers(6, fp8=True)), "v1", bucket_bytes=40 * 1024)

        asyncio.run(go())
        bodies = [b for p, b in server.calls if p == "/update_weights_from_tensor"]
        named = [list(deserialize_named_tensors(b["serialized_named_tensors"][0], b["load_format"])) for b in bodies]
        assert len(named) > 6 and together(named, 6) == []
    finally:
        server.server.stop()


@pytest.mark.slow
def test_sglang_loads_every_bucket_of_a_small_deepseek_v3():
    """SGLang 0.5.21's DeepSeek loader (from the wheel), one call per bucket, over a small
    DeepSeek-V3 checkpoint in transformers' order cut into small buckets: every name is loaded and
    every parameter it holds is filled, also in FP8."""
    from tests.weight_sync import sglang_loaders as sgl

    sys.path.insert(0, os.path.join(ROOT, "tests", "bridge"))
    from tiny_models import deepseek_v3_config

    cfg = deepseek_v3_config()
    reference = sgl.checkpoint_names(cfg)
    for fp8 in (False, True):
        params = sgl.receiver_params(cfg, [n for n, _ in reference])
        if fp8:
            params |= sgl.fp8_params(params, sgl.quantized_modules(cfg.model_type))
        server = sgl.Receiver(cfg, params, quantized=fp8)
        units = {ld.unit for ld in server.load((n, sgl.meta(s, "bfloat16")) for n, s in reference)}
        named = [(n, torch.zeros(s, dtype=torch.bfloat16)) for n, s in reference]
        if fp8:
            named = [p for n, t in named for p in quantize_hf_tensor(n, t.float())]
            units |= {(p + "_scale_inv", sh, e) for p, sh, e in units if p + "_scale_inv" in params}
        got, loaded, requests = set(), set(), 0
        for bucket, _ in buckets(named, 4 * 1024):
            loads = server.load((n, sgl.meta(t.shape, t.dtype)) for n, t in bucket)
            got |= {ld.unit for ld in loads}
            loaded |= {n for ld in loads for n in ld.sources}
            requests += 1
        assert requests > 20
        skipped, stale = {n for n, _ in named} - loaded, units - got
        assert not skipped, f"SGLang does not load {sorted(skipped)[:4]} (fp8={fp8})"
        assert not stale, f"never filled: {sorted(stale, key=str)[:4]} (fp8={fp8})"
