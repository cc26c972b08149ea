"""Weight sync to two embedded rollout servers: disk vs HTTP tensors vs distributed (gloo).

    python benchmarks/bench_weight_sync.py [--sizes tiny,medium] [--repeats 5]

The source is an HF state dict in this process (the Megatron export costs the same for all
three and is left out); the two servers run in this process too (their own threads and event
loops), as in the tests. Each round runs the three paths in alternation (benchmarks/common.py)
and ends with the servers holding the new weights under a new version:
  disk:        safetensors written to a directory, ``/update_weights_from_disk`` on both servers;
  tensor:      ``/update_weights_from_tensor`` (safetensors + base64 bodies, 512 MiB buckets);
  distributed: ``/update_weights_from_distributed`` + gloo broadcasts (512 MiB buckets), group
               formed once before the rounds (as a run does at its first sync).
Bytes per rank: what the one sending rank puts on the wire per server (the whole model here).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, load, report  # noqa: E402

from sorl_megatron.data.tiny_model import TinyModelConfig, build_tiny_model  # noqa: E402
from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig  # noqa: E402
from sorl_megatron.sglang_cpu.options import EngineConfig, ServerOptions  # noqa: E402
from sorl_megatron.sglang_cpu.server import start_rollout_server  # noqa: E402
from sorl_megatron.weight_sync.distributed import DistributedSender, begin_update, end_update  # noqa: E402
from sorl_megatron.weight_sync.tensor import send_tensors  # noqa: E402

SIZES = {
    "tiny": TinyModelConfig(),
    # a random Qwen3-MoE of ~400 MB in fp32: 4 layers x 8 experts, hidden 1024, vocab 16k
    "medium": TinyModelConfig(vocab_size=16384, hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=8,
                              head_dim=64, intermediate_size=512, num_experts=8, top_k=2),
}
BUCKET = 512 * 1024**2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="tiny,medium")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"start: {load()}")
    for size in args.sizes.split(","):
        root = Path(tempfile.mkdtemp(prefix=f"bench_wsync_{size}_"))
        try:
            run_size(size, root, args.repeats)
        finally:
            shutil.rmtree(root, ignore_errors=True)


def run_size(size: str, root: Path, repeats: int) -> None:
    model = build_tiny_model(SIZES[size], None, None)
    model.save_pretrained(root / "base")
    state = load_file(str(root / "base" / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    servers = [start_rollout_server(EngineConfig(model_path=str(root / "base"), skip_tokenizer_init=True),
                                    options=ServerOptions(max_weight_body_mb=4096, weight_group_timeout_s=600))
               for _ in range(2)]
    urls = tuple(s.url for s in servers)
    shutil.copy(root / "base" / "config.json", root / "config.json")
    counter = iter(range(1 << 30))
    sender_box: list[DistributedSender] = []

    def client() -> RolloutClient:
        return RolloutClient(RolloutClientConfig(urls=urls))

    def disk() -> None:
        d = root / "sync"
        d.mkdir(exist_ok=True)
        save_file(state, str(d / "model.safetensors"))
        shutil.copy(root / "base" / "config.json", d / "config.json")

        async def go():
            async with client() as c:
                await c.update_weights_from_disk(str(d), weight_version=f"v{next(counter)}")
        asyncio.run(go())

    def tensor() -> None:
        async def go():
            async with client() as c:
                await send_tensors(c, state.items(), f"v{next(counter)}", bucket_bytes=BUCKET)
        asyncio.run(go())

    def distributed() -> None:
        async def go():
            async with client() as c:
                if not sender_box:
                    sender_box.append(DistributedSender(c, "bench", init_timeout_s=600))
                sender = sender_box[0]
                sender.bind(c)
                await begin_update(c)
                await sender.send(state.items(), BUCKET)
                await end_update(c, f"v{next(counter)}")
        asyncio.run(go())

    try:
        times = interleaved({"disk": disk, "tensor": tensor, "distributed": distributed}, repeats=repeats)
        assert all(torch.equal(s.engine.served.state[k], v) for s in servers for k, v in list(state.items())[:3])
        print(f"\n{size}: {nbytes / 1e6:.1f} MB of weights (fp32), 2 servers; bytes per sending rank "
              f"{nbytes / 1e6:.1f} MB per server ({2 * nbytes / 1e6:.1f} MB on the wire)")
        report(times, baseline="distributed")
    finally:
        if sender_box:
            async def close():
                async with client() as c:
                    sender_box[0].bind(c)
                    await sender_box[0].close()
            asyncio.run(close())
        for s in servers:
            s.stop()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
