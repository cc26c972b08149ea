"""Deterministic mode decodes all running rows in one forward and prefills all admitted prompts
together (``sglang_cpu/rowwise.py``): every row must be bit for bit what a forward of that row
alone gives (the mode's former one-at-a-time decode and prefill), and a seeded request's tokens,
log-probs and routing the same alone and in any batch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sorl_megatron.common.protocol import GenRequest, SamplingParams
from sorl_megatron.sglang_cpu import forward
from sorl_megatron.sglang_cpu.batch import Seq, Unit
from sorl_megatron.sglang_cpu.model import ServedModel
from sorl_megatron.sglang_cpu.options import EngineConfig
from sorl_megatron.sglang_cpu.rowwise import RowwiseMode
from sorl_megatron.sglang_cpu.server import start_rollout_server
from tests.http_calls import call


def _prefilled(served: ServedModel, n: int, seed: int):
    ids = torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(seed))
    _, kv = served.run(ids, torch.ones((1, n), dtype=torch.long), torch.arange(n)[None], None, 1)
    return kv


@pytest.mark.parametrize("lengths,precision", [([9], "fp32"), ([40, 7, 33], "fp32"),
                                               ([5, 64, 17, 31, 2, 50, 12, 33, 8], "fp32"),
                                               ([5, 64, 17, 31, 2, 50, 12, 33, 8], "bf16")])
def test_rowwise_decode_equals_single_row_forwards(moe_dir, lengths, precision):
    served = ServedModel(EngineConfig(model_path=str(moe_dir), enable_return_routed_experts=True, deterministic=True,
                                      precision=precision))
    with torch.inference_mode():
        kvs = [_prefilled(served, n, seed) for seed, n in enumerate(lengths)]
        toks = torch.tensor([(37 * i) % 290 + 5 for i in range(len(lengths))])
        alone = []
        for r, n in enumerate(lengths):  # the former deterministic decode: one row, its own columns, no padding
            served.tap.active = True
            logits, kv = served.run(toks[r].view(1, 1), torch.ones((1, n + 1), dtype=torch.long),
                                    torch.tensor([[n]]), kvs[r], 1)
            served.tap.active = False
            alone.append((logits[0, -1], [(k[0, :, -1], v[0, :, -1]) for k, v in kv], served.tap.take(1, 1)[0, 0]))
        width = max(lengths)
        padded = [tuple(torch.cat([F.pad(kv[layer][j], (0, 0, width - n, 0)) for kv, n in zip(kvs, lengths)])
                        for j in (0, 1)) for layer in range(len(kvs[0]))]  # left padding, as in the running batch
        pos = torch.tensor(lengths)
        served.tap.active = True
        with RowwiseMode(pos + 1):
            logits, kv = served.run(toks[:, None], None, pos[:, None], padded, 1)
        served.tap.active = False
        routing = served.tap.take(len(lengths), 1)[:, 0]
    for r in range(len(lengths)):
        assert torch.equal(logits[r, -1], alone[r][0]), f"row {r}: logits differ from the row's forward alone"
        for layer, (k, v) in enumerate(kv):
            assert torch.equal(k[r, :, -1], alone[r][1][layer][0]) and torch.equal(v[r, :, -1], alone[r][1][layer][1])
        assert (routing[r] == alone[r][2]).all()


def _unit(tokens: list[int], n: int = 1, routed: bool = True) -> Unit:
    req = GenRequest(input_ids=tokens, params=SamplingParams(n=n), return_routed_experts=routed)
    return Unit(list(tokens), [Seq(req=req, sample=k, generator=None) for k in range(n)], input_lp=False)


def _cached(served: ServedModel, tokens: list[int]) -> None:
    """Put ``tokens``' KV (and routing) into the prefix cache, as a finished sequence leaves it."""
    b = forward.prefill_chunked(served, _unit(tokens, routed=served.is_moe))
    b.rows[0].storable = len(tokens)
    forward.store(served, b, 0)


@pytest.mark.parametrize("arch,precision", [("moe", "fp32"), ("moe", "bf16"), ("dense", "fp32")])
def test_rowwise_prefill_equals_each_prompt_prefilled_alone(moe_dir, dense_dir, arch, precision):
    """``prefill_rowwise`` of prompts of 1 to 100 tokens (chunk ends at 32, 64, 96; one chunk of a
    single token; two samples of one prompt; three prompts that extend cached ones by a chunk-aligned
    prefix hit) against ``prefill_chunked`` of each alone: logits, the KV of every layer and routing
    bit for bit, and the batch the scheduler decodes from laid out as the decode expects."""
    served = ServedModel(EngineConfig(model_path=str(moe_dir if arch == "moe" else dense_dir), deterministic=True,
                                      enable_return_routed_experts=True, precision=precision))
    base = [(11 * i) % 290 + 5 for i in range(110)]
    prompts = [(base[:3], 1), (base[:31], 1), (base[:32], 1), (base[:33], 2), (base[:65], 1), (base[:100], 1),
               (base[:1], 1), ([(7 * i) % 290 + 5 for i in range(70)], 1), (base[:64] + [9] * 7, 1),
               (base[:96] + [4, 5, 6], 1), (base[:40] + [8] * 30, 1)]
    with torch.inference_mode():
        _cached(served, base[:100])  # hits of 32, 64 and 96 for the prompts that share a prefix with it

        def units():
            us = [_unit(p, n, routed=served.is_moe) for p, n in prompts]
            for u in us:
                forward.lookup(served, u)
            return us

        alone = [forward.prefill_chunked(served, u) for u in units()]
        us = units()
        assert {0, 32, 64, 96} <= {u.hit for u in us}  # prefix-cache hits (and none) in one batched prefill
        both = forward.prefill_rowwise(served, us)
    rows = [s for u in us for s in u.seqs]
    assert len(both) == len(rows) == sum(len(b) for b in alone)
    k = 0
    for b in alone:
        for r in range(len(b)):
            s, n = rows[k], int(b.pos[r])
            assert int(both.pos[k]) == n and int(both.mask[k].sum()) == n and both.mask[k, -n:].all()
            assert torch.equal(both.last[k], b.last[r]), f"row {k}: logits differ from the prompt prefilled alone"
            for (k1, v1), (k2, v2) in zip(both.kv, b.kv):  # the row's own columns: the last n, as decode reads them
                assert torch.equal(k1[k, :, -n:], k2[r, :, -n:]) and torch.equal(v1[k, :, -n:], v2[r, :, -n:])
            if arch == "moe":
                assert np.array_equal(np.concatenate(s.routing), np.concatenate(b.rows[r].routing))
            assert s.storable == b.rows[r].storable and s.cached_tokens == b.rows[r].cached_tokens
            k += 1


def _generate(url: str, prompt: list[int], max_new: int, seed: int | None, n: int = 1) -> list[dict]:
    sp = {"max_new_tokens": max_new, "ignore_eos": True, "no_stop_trim": True, "n": n, "temperature": 0.9}
    if seed is not None:
        sp["sampling_seed"] = seed
    status, obj = call(url, "POST", "/generate", {"input_ids": prompt, "sampling_params": sp, "return_logprob": True,
                                                  "return_routed_experts": True})
    assert status == 200, obj
    return obj if isinstance(obj, list) else [obj]


def _key(outs: list[dict]):
    """What must not depend on the batch: tokens, log-probs (exact floats) and routing, per sample."""
    return [(o["output_ids"], [t[0] for t in o["meta_info"]["output_token_logprobs"]],
             o["meta_info"].get("routed_experts")) for o in outs]


def test_seeded_requests_are_bit_identical_alone_and_in_any_batch(moe_dir):
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir), deterministic=True,
                                            enable_return_routed_experts=True))
    base = [(11 * i) % 290 + 5 for i in range(70)]
    # (prompt, new tokens, seed, n): different lengths, two samples, and two prompts that extend
    # another's (a later turn: a prefix-cache hit once the shorter one has finished)
    reqs = [(base[:3], 12, 1, 1), (base[:45], 20, 2, 2), (base[:70], 9, 3, 1), (base[:33], 16, 4, 1),
            (base[:45] + [7, 8, 9, 10] * 8, 14, 5, 1)]
    fillers = [([(13 * i + j) % 290 + 5 for i in range(4 + 9 * j)], 6 + 3 * j, None, 1) for j in range(8)]
    try:
        alone = []
        for r in reqs:  # one at a time, from an empty cache
            assert call(srv.url, "POST", "/flush_cache")[0] == 200
            alone.append(_key(_generate(srv.url, *r)))
        compositions = [list(range(5)), [4, 0], [2, 3, 1], list(range(5))]
        for c, comp in enumerate(compositions):
            jobs = [reqs[i] for i in comp] + (fillers if c % 2 == 0 else fillers[:3])
            with ThreadPoolExecutor(len(jobs)) as pool:
                outs = list(pool.map(lambda job: _generate(srv.url, *job), jobs))
            for i, out in zip(comp, outs):
                assert _key(out) == alone[i], f"composition {comp}: request {i} differs from its run alone"
        assert srv.engine.max_batch >= 8 and srv.engine.max_prefill >= 3  # the requests really ran batched
        info = call(srv.url, "GET", "/server_info")[1]["prefix_cache"]
        assert info["hits"] >= 3 and info["hit_tokens"] >= 3 * 32  # and from the prefix cache
    finally:
        srv.stop()


def test_the_mode_intercepts_only_its_own_thread_and_leaves_torch_as_it_was():
    """The mode swaps F.linear / SDPA / grouped_mm for wrappers while it is active: its own
    thread's calls run row by row, another thread's run as they are, and once the last mode has
    exited the attributes are torch's own again."""
    originals = (F.linear, F.scaled_dot_product_attention)
    w, x = torch.randn(8, 5), torch.randn(3, 1, 5)
    seen_elsewhere = []
    with RowwiseMode([4, 6, 9]) as mode:
        assert F.linear is not originals[0]
        out = F.linear(x, w)  # three one-row linears
        with ThreadPoolExecutor(1) as pool:
            seen_elsewhere.append(pool.submit(lambda: (F.linear(x, w), mode._linears)).result())
    assert mode._linears == 1 and seen_elsewhere[0][1] == 1  # the other thread's call was not the mode's
    assert torch.equal(out, torch.cat([torch._C._nn.linear(x[r : r + 1], w) for r in range(3)]))
    assert (F.linear, F.scaled_dot_product_attention) == originals


def test_a_forward_without_a_linear_the_mode_saw_is_an_error():
    """A model that calls its linears by another name would run batched, silently not
    batch-invariant: the mode refuses the forward instead."""
    with pytest.raises(RuntimeError, match="saw no F.linear"):
        with RowwiseMode([4, 6]):
            torch._C._nn.linear(torch.randn(2, 1, 5), torch.randn(8, 5))  # not through F.linear
    assert F.linear is torch._C._nn.linear
    with pytest.raises(RuntimeError, match="already active"), RowwiseMode([3]), RowwiseMode([3]):
        pass
    assert F.linear is torch._C._nn.linear


@pytest.mark.parametrize("bias", [False, True])
def test_a_decode_linear_is_one_batched_product_only_where_it_equals_the_rows_alone(monkeypatch, bias):
    """A decode step's linears run as one (b)addbmm over the rows where this machine's kernels
    give each row what the linear alone gives it, checked on the first call of each shape; a
    shape whose batched product differs (here: made to differ) keeps one linear a row, and the
    rows are still each exactly as alone."""
    from sorl_megatron.sglang_cpu import rowwise

    monkeypatch.setattr(rowwise, "_DECODE_BMM", {})
    w, x = torch.randn(24, 7), torch.randn(5, 1, 7)
    b = torch.randn(24) if bias else None
    alone = torch.cat([torch._C._nn.linear(x[r : r + 1], w, b) for r in range(5)])
    with RowwiseMode([3] * 5):
        first, again = F.linear(x, w, b), F.linear(x, w, b)
    assert torch.equal(first, alone) and torch.equal(again, alone)
    assert list(rowwise._DECODE_BMM.values()) in ([True], [False])  # decided once, on the first call

    monkeypatch.setattr(rowwise, "_DECODE_BMM", {})
    name = "baddbmm" if bias else "bmm"
    real = getattr(torch, name)
    monkeypatch.setattr(torch, name, lambda *a, **k: real(*a, **k) + 1e-3)
    with RowwiseMode([3] * 5):
        first, again = F.linear(x, w, b), F.linear(x, w, b)
    assert torch.equal(first, alone) and torch.equal(again, alone)
    assert list(rowwise._DECODE_BMM.values()) == [False]


def test_a_groups_one_row_products_are_one_bmm_only_where_it_equals_them(monkeypatch):
    """Decode's expert products: a group's rows as one bmm where the first call of that kind shows
    each row equal to its own one-row mm, else (here: made to differ) one mm a row."""
    from sorl_megatron.sglang_cpu import rowwise

    x, m = torch.randn(6, 7), torch.randn(7, 9)
    alone = torch.cat([torch.mm(x[r : r + 1], m) for r in range(6)])
    monkeypatch.setattr(rowwise, "_DECODE_BMM", {})
    assert torch.equal(rowwise._one_row_products(x, m), alone)
    assert torch.equal(rowwise._one_row_products(x, m), alone)
    monkeypatch.setattr(rowwise, "_DECODE_BMM", {})
    real = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a: real(*a) + 1e-3)
    assert torch.equal(rowwise._one_row_products(x, m), alone)
    assert torch.equal(rowwise._one_row_products(x, m), alone)
    assert list(rowwise._DECODE_BMM.values()) == [False]
