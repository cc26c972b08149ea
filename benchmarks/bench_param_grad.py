"""One actor update with the ``param_grad`` clip-bias norm against the same update without it.

World size 1 on CPU, the CPU demo's model (Qwen3-MoE, hidden 64, 2 layers, 4 experts, vocab
2048) and batching (64 trajectories, mini-batches of 32, micro-batches of 8, one epoch),
trajectories of the demo's shape (a prompt, up to 3 assistant turns of <= 32 tokens between
tool observations, 120-640 tokens). Two engines from the same weights, ``so_grpo`` with
``clip_bias.mode`` ``logprob`` and ``param_grad``; their updates are timed in alternation (the
old-logprob pass before each is not timed).

Two regimes: ``demo``: old log-probs are the current policy's (as the trainer computes them),
so the first mini-batch clips nothing and only the second, after one step, needs ||C|| (the
engine skips the second backward where S's gradient is exactly 0); ``off_policy``: old log-probs
perturbed, every mini-batch clips and takes the second backward. Target (issue 17): <= 1.3x.

    .venv/bin/python benchmarks/bench_param_grad.py [--repeats 5] [--regime demo off_policy]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from common import interleaved, load, report

from sorl_megatron.algorithms import ClipBiasConfig, PolicyLossConfig
from sorl_megatron.bridge.parallel import init_distributed
from sorl_megatron.data.tiny_model import TinyModelConfig, save_tiny_model
from sorl_megatron.engine.actor import ActorConfig, PolicyEngine
from sorl_megatron.engine.config import BatchingConfig, OptimConfig
from sorl_megatron.engine.rl_batch import RLBatch


def demo_batch(rows: int = 64, vocab: int = 2048, seed: int = 0) -> RLBatch:
    """Right-padded trajectories of the demo's shape; group-relative advantages per row."""
    g = torch.Generator().manual_seed(seed)
    prompt, obs, turn, seq = 105, 60, 32, 640
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    loss = torch.zeros(rows, seq, dtype=torch.long)
    length = torch.zeros(rows, dtype=torch.long)
    turns = torch.randint(1, 4, (rows,), generator=g)
    for r in range(rows):  # building the test data, not a hot path
        pos = prompt
        for k in range(int(turns[r])):
            n = int(torch.randint(8, turn + 1, (1,), generator=g))
            loss[r, pos:pos + n] = 1
            pos += n + (obs if k + 1 < int(turns[r]) else 0)
        length[r] = pos
    att = (torch.arange(seq).unsqueeze(0) < length.unsqueeze(1)).long()
    adv = torch.randn(rows, generator=g).unsqueeze(1).expand(rows, seq).clone() * loss
    return RLBatch(input_ids=ids, attention_mask=att, loss_mask=loss, old_logprobs=torch.zeros(rows, seq),
                   advantages=adv, group_ids=torch.arange(rows) // 8)


def engine(model: str, mode: str, lr: float) -> PolicyEngine:
    loss = PolicyLossConfig(name="so_grpo", loss_agg="seq-mean-token-mean", clip_bias=ClipBiasConfig(mode=mode))
    cfg = ActorConfig(loss=loss, optim=OptimConfig(lr=lr, clip_grad=1.0),
                      batching=BatchingConfig(micro_batch_size=8, mini_batch_size=32))
    return PolicyEngine(model, None, cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    # the demo's lr is 3e-4 on a trained (sharp) policy; a random tiny model needs a larger step
    # for the second mini-batch to clip as the demo's does (clip_frac of a few percent)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--regime", nargs="+", choices=["demo", "off_policy"], default=["demo", "off_policy"])
    args = ap.parse_args()
    init_distributed()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(save_tiny_model(TinyModelConfig(vocab_size=2048, hidden_size=64, num_heads=4, head_dim=16,
                                                    intermediate_size=128), os.path.join(tmp, "model")))
        engines = {mode: engine(model, mode, args.lr) for mode in ("logprob", "param_grad")}
        batch = demo_batch()
        print(f"rows=64 seq=640 policy tokens={int(batch.loss_mask.sum())} torch threads={torch.get_num_threads()}; "
              f"{load()}")
        for regime in args.regime:
            noise = torch.Generator().manual_seed(1)
            ready: dict[str, RLBatch] = {}
            seen: dict[str, list[float]] = {"clip_frac": [], "norm": []}

            def prepare(name):
                def fn():  # the trainer's old-logprob pass at the current weights: not timed
                    old = engines[name].compute_logprobs(batch).logprobs
                    if regime == "off_policy":
                        old = old + 0.3 * torch.randn(old.shape, generator=noise) * batch.loss_mask
                    ready[name] = batch.replace(old_logprobs=old)
                return fn

            def update(name):
                def fn():
                    m = engines[name].update(ready.pop(name))
                    if name == "param_grad":
                        seen["clip_frac"].append(m["clip_frac"])
                        seen["norm"].append(m["clip_bias/norm"])
                return fn

            times = interleaved({n: update(n) for n in engines}, args.repeats,
                                prepare={n: prepare(n) for n in engines})
            n = len(seen["norm"])
            print(f"\nregime {regime}: param_grad updates' mean clip_frac {sum(seen['clip_frac']) / n:.4f}, "
                  f"mean param-space ||C|| {sum(seen['norm']) / n:.4g} (means over the 2 mini-batches)")
            report(times, "logprob", targets={"param_grad": 1.3})
    torch.distributed.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
