"""The TE-less layer spec's core attention: torch SDPA vs megatron's unfused math, in alternation.

Two levels, each timed in alternation (``common.interleaved``) with the load printed:

- ``module``: one attention module (forward + backward of a weighted sum), fp32, grouped KV
  heads (8 query heads, 2 KV heads, head dim 16, as the demo's model): the RL update's padded
  micro-batch (8 rows x 640 tokens with the engine's causal mask) and the SFT step's packed row
  (16 demonstrations of the demo's lengths, THD segments). Also prints the largest difference of
  the two outputs (float rounding).
- ``sft``: one SFT step of the demo (``PolicyEngine.sft_update`` on 16 of its demonstrations,
  packed into one row, Adam) with each kernel, the demo's model and settings
  (``bench_packing.demo_trajectories`` writes them into ``--work`` when missing).

Ratios are SDPA's time over unfused's (< 1: SDPA faster).

    nice -n 10 .venv/bin/python benchmarks/bench_attention.py [--repeats 7] [--only module|sft]
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
from common import interleaved, load, report


def module_shapes(repeats: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from sorl_megatron.bridge import ParallelLayout, init_parallel
    from sorl_megatron.bridge.cpu_modes import CudaDeviceToCpu
    from sorl_megatron.bridge.forward import causal_attention_mask
    from sorl_megatron.bridge.local_spec import LOCAL_ATTENTION

    if not parallel_state.model_parallel_is_initialized():
        init_parallel(ParallelLayout())
    cfg = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=8, num_query_groups=2,
                            use_cpu_initialization=True, attention_dropout=0.0)
    mods = {k: cls(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
            for k, cls in LOCAL_ATTENTION.items()}
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(60, 260, (16,), generator=g)  # the demo's demonstrations: ~150 tokens
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    t = int(cu[-1])
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=int(lengths.max()), max_seqlen_kv=int(lengths.max()))
    cases = {
        "rl_padded_8x640": ([(640, 8, h, 16) for h in (8, 2, 2)], causal_attention_mask(640, "cpu"), None),
        f"sft_packed_{t}": ([(t, h, 16) for h in (8, 2, 2)], None, packed),
    }
    for name, (shapes, mask, pack) in cases.items():
        qkv = [torch.randn(*s, generator=g) for s in shapes]
        outs = {}

        def run(kind):
            leaves = [x.clone().requires_grad_(True) for x in qkv]
            with CudaDeviceToCpu():
                y = mods[kind](*leaves, mask, packed_seq_params=pack)
            y.sum().backward()
            outs[kind] = y.detach()

        print(f"\n== {name}: forward + backward ({load()})", flush=True)
        times = interleaved({k: functools.partial(run, k) for k in ("unfused", "sdpa")}, repeats=repeats)
        report(times, baseline="unfused")
        print(f"max |sdpa - unfused| = {(outs['sdpa'] - outs['unfused']).abs().max().item():.2e}")


def sft_steps(work: Path, repeats: int) -> None:
    from bench_packing import demo_trajectories

    from sorl_megatron.algorithms import PolicyLossConfig
    from sorl_megatron.bridge import ModelOptions, ParallelLayout
    from sorl_megatron.engine.actor import ActorConfig, PolicyEngine
    from sorl_megatron.engine.config import BatchingConfig, OptimConfig

    model, batch = demo_trajectories(work, 16)
    loss = PolicyLossConfig.from_dict({"name": "so_grpo", "eps_low": 0.2, "loss_agg": "seq-mean-token-mean"})
    engines = {
        kind: PolicyEngine(model, ParallelLayout(), ActorConfig(
            # lr 1e-12: the weights stay put, so every round repeats the same work
            loss=loss, optim=OptimConfig(lr=1e-12, clip_grad=1.0),
            batching=BatchingConfig(mini_batch_size=16, micro_batch_size=16, pack_sequences=True)),
            model_options=ModelOptions(local_attention=kind))
        for kind in ("unfused", "sdpa")
    }
    print(f"\n== the demo's SFT step: 16 demonstrations, {int(batch.attention_mask.sum())} tokens in one packed row "
          f"({load()})", flush=True)
    times = interleaved({k: functools.partial(e.sft_update, batch) for k, e in engines.items()},
                        repeats=repeats, warmup=2)
    report(times, baseline="unfused")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", choices=["module", "sft"])
    parser.add_argument("--work", default="/tmp/bench_attention", help="where the demo's data and model are written")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.only in (None, "module"):
        module_shapes(args.repeats)
    if args.only in (None, "sft"):
        sft_steps(Path(args.work), args.repeats)


if __name__ == "__main__":
    main()
