"""Bytes each rank receives of a step's RL batch: the whole batch pickled to every rank (the old
path, ``comm.broadcast_object``) vs ``engine/batch_transfer.share_batch`` (fields as compact
tensors, R3 routes only for the rows the rank's data-parallel passes read, real tokens only).

Measured: gloo process groups of 2 and 4 CPU ranks (every rank its own data-parallel rank) at
the CPU demo's geometry (recipes/tiny_search_r3_bf16.yaml: 8 prompts x 8 = 64 trajectories of
at most 640 tokens, micro-batch 8, mini-batch 32, one epoch; the tiny MoE: 2 layers, top-2 of 4
experts), with ``comm``'s collectives wrapped to count what each rank receives (tensor bytes;
pickled bytes for object collectives). Old and new run interleaved, repeated; times are
reported as ratios with the machine load.

Computed: the Qwen3-30B-A3B R3 recipe (recipes/gpu/minirl_qwen3_30b_a3b_r3.yaml: 256 prompts x
16 = 4,096 trajectories of at most 8,192 tokens, packed micro-batches of 4 x 8,192 tokens,
mini-batch 1,024, one epoch, TP 2 x PP 2 x DP 8; 48 layers, top-8 of 128 experts), from the
same row plans (``MicroBatcher.dp_rows``) at full length and at lengths uniform in [1k, 8k].

    .venv/bin/python benchmarks/bench_batch_transfer.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import interleaved, load, report  # noqa: E402

from sorl_megatron.common import comm  # noqa: E402
from sorl_megatron.engine.batch_transfer import share_batch  # noqa: E402
from sorl_megatron.engine.config import BatchingConfig  # noqa: E402
from sorl_megatron.engine.micro_batching import MicroBatcher  # noqa: E402
from sorl_megatron.engine.rl_batch import RLBatch  # noqa: E402

GB = 1e9


class PlanOnly:
    """The engine's row planning (``dp_rows`` at optimizer step 0) without a model: its
    :class:`MicroBatcher` over the batching, the DP size and the layout facts the plans read."""

    def __init__(self, batching: BatchingConfig, dp: int, dp_rank: int = 0, seq_multiple: int = 1):
        layout = SimpleNamespace(tp=seq_multiple, pp=1, use_sequence_parallel=seq_multiple > 1)
        ranks = {"dp": dp, "dp_rank": dp_rank, "tp": 1, "tp_rank": 0, "pp": 1, "last_stage": 1}
        self.batcher = MicroBatcher(batching, layout, interleaved=False, ranks=lambda: ranks)
        self.batcher.config_prefix = "schedule"

    def dp_rows(self, batch: RLBatch) -> list[torch.Tensor]:
        return self.batcher.dp_rows(batch, step=0)


def rollout_batch(rows: int, seq: int, layers: int, topk: int, experts: int, lengths: torch.Tensor,
                  vocab: int = 512, seed: int = 0) -> tuple[RLBatch, torch.Tensor]:
    """What ``RLTrainer._to_batch`` builds (collate's dtypes: int64 ids / masks / turn ids, float32
    rollout log-probs, int32 routes with -1 on padding) and the injected flags."""
    g = torch.Generator().manual_seed(seed)
    att = (torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)).long()
    loss = att * (torch.arange(seq) >= 16)
    routes = torch.randint(0, experts, (rows, seq, layers, topk), generator=g, dtype=torch.int32)
    routes = torch.where(att[:, :, None, None].bool(), routes, torch.full_like(routes, -1))
    batch = RLBatch(input_ids=torch.randint(0, vocab, (rows, seq), generator=g) * att, attention_mask=att,
                    loss_mask=loss, rollout_logprobs=-torch.rand(rows, seq, generator=g) * loss,
                    turn_ids=loss.cumsum(1).clamp(max=3) * loss, group_ids=torch.arange(rows) // 8,
                    routed_experts=routes)
    return batch, torch.zeros(rows, dtype=torch.bool)


def _count(received: dict[str, int]):
    """Wrap ``comm``'s collectives to add what this rank receives to ``received['bytes']``."""
    me = comm.rank()
    orig = {k: getattr(comm, k) for k in ("broadcast", "broadcast_object", "recv", "all_gather_object")}

    def broadcast(tensor, src, group=None):
        out = orig["broadcast"](tensor, src, group)
        received["bytes"] += tensor.nbytes if me != src else 0
        return out

    def broadcast_object(obj, src=0, group=None):
        out = orig["broadcast_object"](obj, src, group)
        received["bytes"] += len(pickle.dumps(out)) if me != src else 0
        return out

    def recv(tensor, src, group=None):
        out = orig["recv"](tensor, src, group)
        received["bytes"] += tensor.nbytes
        return out

    def all_gather_object(obj, group=None):
        out = orig["all_gather_object"](obj, group)
        received["bytes"] += sum(len(pickle.dumps(o)) for i, o in enumerate(out) if i != me)
        return out

    for k, fn in (("broadcast", broadcast), ("broadcast_object", broadcast_object), ("recv", recv),
                  ("all_gather_object", all_gather_object)):
        setattr(comm, k, fn)


def _demo_geometry():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(120, 641, (64,), generator=g)  # multi-turn search episodes, <= 640 tokens
    batch, injected = rollout_batch(64, int(lengths.max()), layers=2, topk=2, experts=4, lengths=lengths)
    return batch, injected, BatchingConfig(micro_batch_size=8, mini_batch_size=32, epochs=1, shuffle=True, seed=0)


def _rank_main(rank: int, world: int, init: str, repeats: int, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    batch, injected, batching = _demo_geometry()
    plans = PlanOnly(batching, dp=world, dp_rank=rank)
    received = {"bytes": 0}
    _count(received)
    got: dict[str, list[int]] = {"old": [], "new": []}

    def measured(name, fn):
        def run():
            received["bytes"] = 0
            fn()
            got[name].append(received["bytes"])
        return run

    mine = batch if rank == 0 else None
    fns = {"old": measured("old", lambda: comm.broadcast_object((mine, injected))),
           "new": measured("new", lambda: (comm.broadcast_object(injected),
                                           share_batch(mine, plans.dp_rows, rank)))}
    times = interleaved(fns, repeats=repeats)
    per_rank = comm.all_gather_object({k: max(v) for k, v in got.items()})
    if rank == 0:
        torch.save({"times": times, "per_rank": per_rank}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def measure(world: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        mp.spawn(_rank_main, args=(world, f"file://{tmp}/store", repeats, out), nprocs=world)
        res = torch.load(out, weights_only=False)
    print(f"\n== demo geometry, {world} gloo ranks (DP {world}) ==")
    for r, b in enumerate(res["per_rank"]):
        print(f"rank {r}: old {b['old'] / 1e6:8.3f} MB   new {b['new'] / 1e6:8.3f} MB   "
              f"ratio {b['new'] / b['old'] if b['old'] else float('nan'):.3f}")
    report(res["times"], "old")


def computed_qwen3_30b() -> None:
    """The recipe's bytes per rank, old vs new, from the row plans of rank 0's DP group."""
    rows, seq, layers, topk, dp = 256 * 16, 8192, 48, 8, 8
    batching = BatchingConfig(micro_batch_size=4, mini_batch_size=1024, epochs=1, shuffle=True, seed=0,
                               pack_sequences=True)
    print(f"\n== Qwen3-30B-A3B R3 recipe (computed): {rows} x {seq} tokens, {layers} layers x top-{topk}, "
          f"DP {dp} (TP 2 x PP 2) ==")
    g = torch.Generator().manual_seed(0)
    for label, lengths in (("full length", torch.full((rows,), seq)),
                           ("lengths uniform in [1024, 8192]", torch.randint(1024, seq + 1, (rows,), generator=g))):
        att = (torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1))
        light = RLBatch(input_ids=torch.zeros(rows, 1, dtype=torch.long).expand(rows, seq), attention_mask=att.long())
        plan = PlanOnly(batching, dp=dp, seq_multiple=2).dp_rows(light)
        tokens = rows * seq
        # old: int64 ids / masks / turn ids, float32 rollout log-probs, int32 routes, all rows, all positions
        old = tokens * (8 * 4 + 4) + tokens * layers * topk * 4
        # new: int32 ids, int8 masks and turn ids, float32 log-probs, whole; int8 routes of the rank's rows' real tokens
        light_bytes = tokens * (4 + 1 + 1 + 4 + 1)
        worst = max(int(lengths[p].sum()) for p in plan)
        route_bytes = worst * layers * topk * 1
        share = max(len(p) for p in plan) / rows
        print(f"{label}: old {old / GB:7.2f} GB per rank; new {(light_bytes + route_bytes) / GB:6.2f} GB "
              f"(fields {light_bytes / GB:.2f} GB + routes {route_bytes / GB:.2f} GB of {share:.1%} of the rows); "
              f"ratio {(light_bytes + route_bytes) / old:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    print(load())
    for world in args.worlds:
        measure(world, args.repeats)
    computed_qwen3_30b()


if __name__ == "__main__":
    main()
