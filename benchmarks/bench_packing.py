"""Actor update throughput: right-padded vs packed micro-batches, timed in alternation.

Two trajectory-length distributions, each one batch through two PolicyEngines built from the
same weights (one with ``micro_batch_size`` padded rows, one with ``pack_sequences``), whose
``update`` calls are timed in alternation (``common.interleaved``) over ``--repeats``:

- ``demo``: the CPU demo's model and trajectories. ``data.synthetic`` writes the demo's data and
  tiny Qwen3-MoE (hidden 128, tied embeddings) into ``--work``; its SFT cold-start
  demonstrations (gold plans, 30% direct answers) are played through the real agent loop and
  BM25 retriever with the demo's limits (3 turns of <= 32 tokens, observations <= 128, top-1,
  640 tokens). 64 of them (batch 8 x group 8), mini-batch 32, micro-batch 8 and the demo's loss
  (so_grpo, ``param_grad`` clip-bias, delta 1): tiny_search_base.yaml.
- ``longtail``: ``--longtail-rows`` (16) trajectories of 100-4000 tokens (log-normal, median
  ~450), random tokens, alternating 64-token policy turns and observations after a 100-token
  prompt; two mini-batches; padded micro-batches of 1 row against packed rows of <= 4096
  tokens (about the same memory).

Prints per distribution the padding fraction of both paths, tokens/s (real tokens / update
seconds) of each, and the packed/padded tokens/s ratio (median of the per-round ratios, and of
the fastest updates), with the load average before and after (the ratios are what to compare
across machines, not the seconds).

    nice -n 10 .venv/bin/python benchmarks/bench_packing.py [--repeats 5] [--only demo|longtail]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import statistics
from pathlib import Path

import torch
from common import interleaved, load

from sorl_megatron.algorithms import PolicyLossConfig
from sorl_megatron.bridge import ParallelLayout, init_distributed
from sorl_megatron.engine.actor import ActorConfig, PolicyEngine
from sorl_megatron.engine.config import BatchingConfig, OptimConfig
from sorl_megatron.engine.rl_batch import RLBatch


def demo_trajectories(work: Path, n: int, seed: int = 0) -> tuple[str, RLBatch]:
    """The demo's model directory and ``n`` of its SFT demonstrations as an RL batch."""
    from transformers import AutoTokenizer

    from sorl_megatron.data.gold import cold_start_plans, gold_trajectory
    from sorl_megatron.data.qa import encode_prompt, read_parquet
    from sorl_megatron.data.synthetic import write_dataset
    from sorl_megatron.retrieval.bm25 import BM25Index
    from sorl_megatron.rollout.agent import AgentConfig, SearchAgent
    from sorl_megatron.rollout.trajectory import collate

    if not (work / "model" / "config.json").is_file():
        write_dataset(work, make_model=True, hidden_size=128, tie_embeddings=True)
    tokenizer = AutoTokenizer.from_pretrained(str(work / "model"))
    rows = read_parquet(work / "train.parquet")
    plans = cold_start_plans(rows, direct_answer_fraction=0.3, seed=1234)
    index = BM25Index.from_jsonl(work / "corpus.jsonl")

    class Retriever:  # the BM25 server's index, in process
        async def retrieve(self, queries, topk=None):
            return index.search(queries, topk or 1)

    cfg = AgentConfig(max_turns=3, max_turn_tokens=32, max_total_tokens=640, max_obs_tokens=128, topk=1)
    picked = random.Random(seed).sample(sorted(plans), n)

    async def play():
        return [await gold_trajectory(lambda pol: SearchAgent(pol, Retriever(), tokenizer, cfg), tokenizer,
                                      encode_prompt(tokenizer, rows[i]), plans[i]) for i in picked]

    t = collate(asyncio.run(play()), pad_token_id=tokenizer.pad_token_id or 0)
    return str(work / "model"), RLBatch(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                                         loss_mask=t["loss_mask"], turn_ids=t["turn_ids"])


def longtail_batch(n: int, vocab: int, seed: int = 0) -> RLBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(n, generator=g) * 0.9 + 6.1).exp().round().long().clamp(100, 4000)
    s = int(lengths.max())
    pos = torch.arange(s).unsqueeze(0)
    att = (pos < lengths.unsqueeze(1)).long()
    loss = ((pos >= 100) & (((pos - 100) // 64) % 2 == 0)).long() * att
    return RLBatch(input_ids=torch.randint(0, vocab, (n, s), generator=g), attention_mask=att, loss_mask=loss)


def with_rl_fields(engine: PolicyEngine, batch: RLBatch, group: int, seed: int = 0) -> RLBatch:
    """Old log-probs from the engine (perturbed so that some tokens clip), group-normalized
    random rewards as advantages."""
    g = torch.Generator().manual_seed(seed)
    old = engine.compute_logprobs(batch).logprobs
    old = old + 0.2 * torch.randn(old.shape, generator=g) * batch.loss_mask
    rewards = (torch.rand(batch.batch_size, generator=g) < 0.5).float().view(-1, group)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
    return batch.replace(old_logprobs=old, advantages=adv.unsqueeze(1) * batch.loss_mask)


def engines(model: str, mini: int, micro: int, budget) -> dict[str, PolicyEngine]:
    loss = PolicyLossConfig.from_dict({"name": "so_grpo", "eps_low": 0.2, "loss_agg": "seq-mean-token-mean",
                                       "clip_bias": {"mode": "param_grad", "delta": 1.0}})
    out = {}
    for name, pack in (("padded", False), ("packed", True)):
        batching = BatchingConfig(mini_batch_size=mini, micro_batch_size=micro, pack_sequences=pack,
                                  max_tokens_per_micro_batch=budget if pack else None)
        out[name] = PolicyEngine(model, ParallelLayout(), ActorConfig(
            # lr 1e-12: the weights stay put, so every round repeats the same work (the same tokens
            # clip, the same micro-batches take the param_grad pass); with the demo's 3e-4 the two
            # engines drift apart and their rounds stop being comparable
            loss=loss, optim=OptimConfig(lr=1e-12, clip_grad=1.0), batching=batching))
    return out


def measure(name: str, model: str, batch: RLBatch, group: int, mini: int, micro: int, budget, repeats: int) -> None:
    e = engines(model, mini, micro, budget)
    batch = with_rl_fields(e["padded"], batch, group)
    lengths = batch.attention_mask.sum(1).float()
    print(f"\n== {name}: {batch.batch_size} trajectories, length min/median/mean/max "
          f"{int(lengths.min())}/{int(lengths.median())}/{lengths.mean():.0f}/{int(lengths.max())}, "
          f"padded length {batch.seq_len}; mini-batch {mini}, padded micro-batch {micro} rows, "
          f"packed budget {budget or f'{micro} x {batch.seq_len}'} tokens", flush=True)
    stats: dict[str, dict] = {}

    def update(k):
        stats[k] = e[k].update(batch)

    before = load()
    times = interleaved({k: functools.partial(update, k) for k in e}, repeats=repeats, warmup=1)
    tokens = stats["padded"]["batching/tokens"]
    for k in e:
        rates = [tokens / t for t in times[k]]
        print(f"{k:7s} padding {stats[k]['batching/padding_frac']:.3f}  micro-batches/update "
              f"{stats[k]['batching/micro_batches']:.0f}  tokens/s median {statistics.median(rates):8.0f} "
              f"(all: {', '.join(f'{x:.0f}' for x in rates)})")
    ratios = [p / q for p, q in zip(times["padded"], times["packed"])]  # packed tokens/s over padded
    print(f"packed / padded tokens/s: median {statistics.median(ratios):.2f}x, of the fastest updates "
          f"{min(times['padded']) / min(times['packed']):.2f}x, over {repeats} interleaved rounds; "
          f"before: {before}; after: {load()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", default="/tmp/sorl_bench_packing", help="where the demo's data and model are made")
    ap.add_argument("--only", choices=("demo", "longtail"))
    ap.add_argument("--longtail-rows", type=int, default=16, help="trajectories of the long-tailed batch (default 16)")
    ap.add_argument("--demo-budget", type=int, default=None,
                    help="packed row budget for the demo (default: micro-batch size x padded length)")
    args = ap.parse_args()
    init_distributed(timeout_s=600)
    print(f"torch threads {torch.get_num_threads()}; {load()}")
    model, demo = demo_trajectories(Path(args.work), 64)
    if args.only != "longtail":
        measure("demo", model, demo, group=8, mini=32, micro=8, budget=args.demo_budget, repeats=args.repeats)
    if args.only != "demo":
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size
        n = args.longtail_rows
        measure("longtail", model, longtail_batch(n, vocab), group=8, mini=n // 2, micro=1, budget=4096,
                repeats=args.repeats)


if __name__ == "__main__":
    main()
