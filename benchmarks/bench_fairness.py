"""Fairness of the embedded rollout server: a small call behind a large one.

    python benchmarks/bench_fairness.py [--n 256] [--tokens 400] [--compare-src /path/to/old/checkout]

A server (``python -m sorl_megatron.sglang_cpu.server``, the demo's tiny random Qwen3-MoE
shape, tokens only, default ``--max-running-requests 32``) gets one call of ``n`` samples x
``--tokens`` new tokens (split by the server into parts of 32); once its first part decodes,
a 4-token call is sent. Printed: the small call's latency alone and behind the large call,
their ratio, the decode steps it waited (``/server_info``'s ``num_decode_steps``, which the
machine's load does not change), the large call's own time, and the load average.
``--compare-src`` runs the server of another checkout the same way (e.g. before the fix).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load  # noqa: E402

from sorl_megatron.common.background import free_port, wait_healthy  # noqa: E402
from sorl_megatron.data.tiny_model import TinyModelConfig, save_tiny_model  # noqa: E402

PROMPT = list(range(5, 69))  # 64 tokens


def body(n: int, tokens: int, seed: int) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {"n": n, "max_new_tokens": tokens, "ignore_eos": True,
                                                     "sampling_seed": seed}}


async def post(s: aiohttp.ClientSession, url: str, payload: dict) -> float:
    t0 = time.perf_counter()
    async with s.post(f"{url}/generate", json=payload) as r:
        assert r.status == 200, await r.text()
        await r.read()
    return time.perf_counter() - t0


async def steps(s: aiohttp.ClientSession, url: str) -> int:
    async with s.get(f"{url}/server_info") as r:
        return (await r.json())["num_decode_steps"]


async def scenario(url: str, n: int, tokens: int) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=7200)) as s:
        alone = statistics.median([await post(s, url, body(1, 4, seed=k)) for k in range(3)])
        start = await steps(s, url)
        big = asyncio.ensure_future(post(s, url, body(n, tokens, seed=1)))
        while await steps(s, url) < start + 2:  # the first part decodes; the others are queued
            await asyncio.sleep(0.01)
        before = await steps(s, url)
        behind = await post(s, url, body(1, 4, seed=7))
        waited = await steps(s, url) - before
        big_s = await big
    return {"alone": alone, "behind": behind, "waited": waited, "big": big_s}


def run(src: Path, model: Path, n: int, tokens: int, threads: int) -> dict:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen([sys.executable, "-m", "sorl_megatron.sglang_cpu.server", "--model-path", str(model),
                             "--port", str(port), "--skip-tokenizer-init", "--num-threads", str(threads),
                             "--max-tokens-per-request", str(1 << 24), "--log-level", "warning"], env=env, cwd=src)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 180, proc)
        return asyncio.run(scenario(url, n, tokens))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=256, help="samples of the large call (default 256)")
    p.add_argument("--tokens", type=int, default=400, help="new tokens per sample of the large call (default 400)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads of the server (default 1)")
    p.add_argument("--compare-src", default=None, help="another checkout whose server runs the same scenario")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(TinyModelConfig(arch="qwen3_moe"), Path(tmp) / "m")
        srcs = {"this checkout": Path(__file__).resolve().parents[1]}
        if args.compare_src:
            srcs["--compare-src"] = Path(args.compare_src).resolve()
        print(f"large call: n={args.n} x {args.tokens} tokens (parts of 32); small call: 4 tokens; {load()}")
        for name, src in srcs.items():
            r = run(src, model, args.n, args.tokens, args.num_threads)
            print(f"{name:>14}: small call alone {r['alone']:.2f} s, behind the large call {r['behind']:.2f} s "
                  f"(x{r['behind'] / r['alone']:.1f}, {r['waited']} decode steps); large call {r['big']:.1f} s; "
                  f"{load()}")


if __name__ == "__main__":
    main()
