"""The route-flip injector (issue 30): the requested fraction of (token, layer) top-k choices
flipped, deterministically and whatever the batching; the returned routes are the ones the
server computed with (replaying them reproduces its log-probs, live routing does not)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from sorl_megatron.common.protocol import SamplingParams
from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig
from sorl_megatron.sglang_cpu.options import EngineConfig
from sorl_megatron.sglang_cpu.route_flip import flip_hash, flip_routes
from sorl_megatron.sglang_cpu.server import parse_args, start_rollout_server

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [3]]
FRACTION = 0.3


def _routes(n: int, k: int, experts: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.3, 1.0])
def test_flip_routes_flips_the_fraction_as_sets(fraction):
    n, k, experts = 20000, 2, 8
    idx = _routes(n, k, experts)
    pos = torch.arange(n)
    h = flip_hash(3, 1, pos, (pos * 7) % 400)
    out = flip_routes(idx, h, fraction, experts)
    differs = (out.sort(1).values != idx.sort(1).values).any(1)
    tol = 4 * math.sqrt(fraction * (1 - fraction) / n) + 1e-9  # 4 sigma of a binomial proportion
    assert abs(differs.float().mean().item() - fraction) <= tol
    assert (out >= 0).all() and (out < experts).all()
    assert (out.sort(1).values.diff(dim=1) != 0).all()  # k distinct experts per row
    assert ((out != idx).sum(1) <= 1).all()  # at most one slot replaced
    assert torch.equal(out, flip_routes(idx, flip_hash(3, 1, pos, (pos * 7) % 400), fraction, experts))
    if 0 < fraction < 1:  # another seed or layer flips other pairs
        other = flip_routes(idx, flip_hash(4, 1, pos, (pos * 7) % 400), fraction, experts)
        assert not torch.equal(out, other)


def test_flip_hash_is_a_function_of_its_inputs_only():
    pos = torch.tensor([0, 5, 5, 9])
    tok = torch.tensor([1, 2, 2, 3])
    h = flip_hash(0, 0, pos, tok)
    assert h[1] == h[2] and (h >= 0).all() and (h < 2**31).all()
    assert torch.equal(h[1:3], flip_hash(0, 0, pos[1:3], tok[1:3]))  # alone = batched


def test_cli_flags_validated():
    args = parse_args(["--model-path", "x", "--inject-route-flip-fraction", "0.25", "--inject-route-flip-seed", "9"])
    assert args.inject_route_flip_fraction == 0.25 and args.inject_route_flip_seed == 9
    for bad in (["--inject-route-flip-fraction", "1.5"], ["--inject-route-flip-fraction", "nan"],
                ["--inject-route-flip-seed", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(["--model-path", "x", *bad])


def test_dense_model_refused(dense_dir):
    with pytest.raises(ValueError, match="needs a MoE model"):
        start_rollout_server(EngineConfig(model_path=str(dense_dir), inject_route_flip_fraction=0.1))


@pytest.fixture(scope="module")
def flip_server(moe_dir):
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir), enable_return_routed_experts=True,
                                            deterministic=True, inject_route_flip_fraction=FRACTION,
                                            inject_route_flip_seed=11))
    yield srv
    srv.stop()


async def _generate(url, prompts, seeds):
    async with RolloutClient(RolloutClientConfig(urls=(url,), routing_shape=(2, 2))) as c:
        outs = await asyncio.gather(*(
            c.generate(p, SamplingParams(max_new_tokens=16, sampling_seed=s, ignore_eos=True),
                       return_routed_experts=True) for p, s in zip(prompts, seeds)))
    return [o[0] for o in outs]


def _replayed_forward(model, ids: list[int], routes: np.ndarray | None):
    """Teacher-forced log-probs of ``ids[1:]``, each MoE router replaying ``routes[pos, layer]``
    (the gate weights recomputed from the router's own probabilities, as R3 does), or live."""
    handles = []
    if routes is not None:
        full = torch.cat([torch.from_numpy(routes).long(), torch.zeros(1, *routes.shape[1:], dtype=torch.long)])
        for name, m in model.named_modules():
            if type(m).__name__.endswith("TopKRouter"):
                layer = int(name.split(".")[name.split(".").index("layers") + 1])

                def hook(mod, _inp, out, layer=layer):
                    logits, _, idx = out
                    # the last position's routing is never returned: it keeps its live choice
                    new = torch.cat([full[: idx.shape[0] - 1, layer], idx[-1:]])
                    w = torch.softmax(logits.float(), -1).gather(1, new)
                    return logits, (w / w.sum(-1, keepdim=True)).to(out[1].dtype), new

                handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    lp = torch.log_softmax(out.logits[0].float(), -1)[:-1]
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_server_flips_deterministically_and_returns_the_routes_used(flip_server, moe_model, teacher_forced):
    seeds = [21, 22, 23, 24]
    batched = asyncio.run(_generate(flip_server.url, PROMPTS, seeds))
    alone = [asyncio.run(_generate(flip_server.url, [p], [s]))[0] for p, s in zip(PROMPTS, seeds)]
    flipped = total = 0
    worst_replay = worst_live = 0.0
    for prompt, b, a in zip(PROMPTS, batched, alone):
        assert b.output_ids == a.output_ids and np.array_equal(b.routed_experts, a.routed_experts)
        assert np.allclose(b.output_logprobs, a.output_logprobs, atol=1e-6)
        ids = prompt + b.output_ids
        _, live_routes = teacher_forced(moe_model, ids)
        got = np.sort(b.routed_experts, -1)
        flipped += int((got != np.sort(live_routes.numpy(), -1)).any(-1).sum())
        total += got.shape[0] * got.shape[1]
        n = len(prompt) - 1
        replay = _replayed_forward(moe_model, ids, b.routed_experts)[n:]
        live = _replayed_forward(moe_model, ids, None)[n:]
        server = torch.tensor(b.output_logprobs)
        worst_replay = max(worst_replay, (replay - server).abs().max().item())
        worst_live = max(worst_live, (live - server).abs().max().item())
    rate = flipped / total
    assert abs(rate - FRACTION) <= 4 * math.sqrt(FRACTION * (1 - FRACTION) / total), rate
    assert worst_replay <= 1e-5, worst_replay  # the returned routes are the ones computed with
    assert worst_live > 1e-3, worst_live  # the trainer's own routing gives other log-probs
