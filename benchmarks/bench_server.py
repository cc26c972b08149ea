"""The embedded rollout server under concurrent load: continuous batching, prefix cache, determinism.

    python benchmarks/bench_server.py [--repeats 5] [--num-threads 1] [--compare-src /path/to/old/checkout]

Servers run as subprocesses (``python -m sorl_megatron.sglang_cpu.server``, tokens only, the
demo's tiny random Qwen3-MoE shape), each with ``--num-threads`` torch threads; the load comes
from one aiohttp client in this process. Every request is seeded and ignores EOS, so each
configuration generates the same number of tokens. Within a round every configuration runs
once, in alternating order (benchmarks/common.py), and the ratios are taken round by round.

  concurrency:  tokens/s with 1, 16 and 64 clients in a closed loop (each sends its next
                request when the previous answer is back), 16-112 new tokens per request;
                ``--compare-src`` also runs the server of another checkout (e.g. the fixed-wave
                engine before continuous batching) the same way.
  multi-turn:   episodes/s of 16 concurrent 4-turn episodes (a 128-256 token prompt; each turn
                re-sends the whole context: previous prompt + 24-token answer + a 64-token
                observation, as a search agent's retrieved documents), default server
                (prefix cache) vs ``--disable-radix-cache``.
  deterministic: 16 clients, default server vs ``--enable-deterministic-inference``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, load  # noqa: E402

from sorl_megatron.common.background import free_port, wait_healthy  # noqa: E402
from sorl_megatron.data.tiny_model import TinyModelConfig, save_tiny_model  # noqa: E402

VOCAB = 400
NEW_TOKENS = (16, 112)  # new tokens per request: uniform in this range (mean 64)


def start_server(model: Path, threads: int, extra: list[str], src: str | None = None):
    port = free_port()
    root = Path(src) if src else Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    # a checkout from before the server moved to sglang_cpu/ has it under its old name
    module = "sorl_megatron.sglang_cpu.server" if (root / "sorl_megatron/sglang_cpu").is_dir() else (
        "sorl_megatron.rollout.server")
    cmd = [sys.executable, "-m", module, "--model-path", str(model), "--port", str(port),
           "--skip-tokenizer-init", "--num-threads", str(threads), "--max-running-requests", "64",
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, env=env, cwd=src or None)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 180, proc)
    return proc, url


async def _post(session: aiohttp.ClientSession, url: str, prompt: list[int], new: int, seed: int) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": new, "ignore_eos": True, "sampling_seed": seed,
                                                     "no_stop_trim": True}}
    async with session.post(f"{url}/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(32, 97))] for _ in range(n)]


def work(clients: int, per_client: int) -> tuple[list[list[int]], list[int]]:
    ps = prompts(clients * per_client, seed=clients)
    rng = random.Random(clients)
    return ps, [rng.randint(*NEW_TOKENS) for _ in ps]


def closed_loop(url: str, clients: int, per_client: int) -> int:
    """``clients`` concurrent clients, ``per_client`` requests each; returns tokens generated."""
    ps, news = work(clients, per_client)

    async def client(session, c):
        for k in range(per_client):
            i = c * per_client + k
            await _post(session, url, ps[i], news[i], seed=i)

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            await asyncio.gather(*(client(s, c) for c in range(clients)))

    asyncio.run(go())
    return sum(news)


def episodes(url: str, n: int = 16, turns: int = 4, new: int = 24, obs_len: int = 64,
             stats: dict | None = None) -> None:
    rng = random.Random(7)
    obs = [[[rng.randrange(3, VOCAB) for _ in range(obs_len)] for _ in range(turns)] for _ in range(n)]
    starts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(128, 257))] for _ in range(n)]

    async def episode(session, e):
        ctx = list(starts[e])
        for t in range(turns):
            out = await _post(session, url, ctx, new, seed=1000 * e + t)
            if stats is not None:
                stats["cached"] = stats.get("cached", 0) + out["meta_info"]["cached_tokens"]
                stats["prompt"] = stats.get("prompt", 0) + len(ctx)
            ctx = ctx + out["output_ids"] + obs[e][t]

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            await asyncio.gather(*(episode(s, e) for e in range(n)))

    asyncio.run(go())


def summary(name: str, times: list[float], work: float, unit: str, base: list[float] | None, base_work: float) -> str:
    rate = [work / t for t in times]
    line = f"{name:34s} {statistics.median(rate):9.1f} {unit} (best {max(rate):9.1f})"
    if base is not None:
        ratios = [(work / t) / (base_work / b) for t, b in zip(times, base)]
        line += f"   x{statistics.median(ratios):5.2f} (median of per-round ratios; min {min(ratios):.2f})"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads per server (default 1)")
    ap.add_argument("--compare-src", default=None, help="another checkout whose server runs the same load")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: concurrency,multiturn,deterministic")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"start: {load()}; torch threads per server: {args.num_threads}")
    root = Path(tempfile.mkdtemp(prefix="bench_server_"))
    procs = []
    try:
        model = save_tiny_model(TinyModelConfig(vocab_size=VOCAB), root / "model")

        def server(extra, src=None):
            proc, url = start_server(model, args.num_threads, extra, src)
            procs.append(proc)
            return url

        default = server([])
        if "concurrency" not in skip:
            loads = {"1 client": (1, 8), "16 clients": (16, 4), "64 clients": (64, 1)}
            servers = {"new": default}
            if args.compare_src:
                servers["compare"] = server([], args.compare_src)
            fns = {f"{s} {name}": (lambda u=u, c=c, k=k: closed_loop(u, c, k))
                   for s, u in servers.items() for name, (c, k) in loads.items()}
            times = interleaved(fns, repeats=args.repeats)
            tokens = {name: sum(work(c, k)[1]) for name, (c, k) in loads.items()}
            print(f"\n== concurrency: tokens/s, {NEW_TOKENS[0]}-{NEW_TOKENS[1]} new tokens per request ({load()})")
            for s in servers:
                base = times[f"{s} 1 client"]
                for name in loads:
                    key = f"{s} {name}"
                    print(summary(key, times[key], tokens[name], "tok/s", base, tokens["1 client"]))
            if args.compare_src:
                for name in loads:
                    print(summary(f"new/compare {name}", times[f"new {name}"], tokens[name], "tok/s",
                                  times[f"compare {name}"], tokens[name]))
        if "multiturn" not in skip:
            nocache = server(["--disable-radix-cache"])
            stats: dict = {}
            fns = {"prefix cache": lambda: episodes(default, stats=stats), "no prefix cache": lambda: episodes(nocache)}
            times = interleaved(fns, repeats=args.repeats)
            print(f"\n== multi-turn: 16 concurrent episodes x 4 turns (prompt 128-256 tokens, then 24 new + 64 "
                  f"observation tokens per turn) ({load()})")
            print(summary("no prefix cache", times["no prefix cache"], 16, "episodes/s", None, 0))
            print(summary("prefix cache", times["prefix cache"], 16, "episodes/s", times["no prefix cache"], 16))
            print(f"prompt tokens served from the cache: {stats['cached'] / stats['prompt']:.1%}")
        if "deterministic" not in skip:
            det = server(["--enable-deterministic-inference"])
            fns = {"default": lambda: closed_loop(default, 16, 2), "deterministic": lambda: closed_loop(det, 16, 2)}
            times = interleaved(fns, repeats=args.repeats)
            n = sum(work(16, 2)[1])
            print(f"\n== deterministic mode: 16 clients x 2 requests ({load()})")
            print(summary("default", times["default"], n, "tok/s", None, 0))
            print(summary("deterministic", times["deterministic"], n, "tok/s", times["default"], n))
        print(f"\nend: {load()}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
        time.sleep(0)


if __name__ == "__main__":
    main()
