"""One process, CPU: the memory plan's checks that need a built engine (tests/engine/test_memory_plan.py).

- recompute: ``parallelism.recompute`` selective and full train a tiny model to the loss and gradients of none;
- offload: with ``offload_idle`` the reference and critic report the CPU between calls and the compute
  device during them (a mock CUDA device: on CPU the real move is a no-op), with unchanged results;
- measured: the peak of torch's CPU allocator over building an engine and one update
  (``torch.profiler`` with ``profile_memory=True``) against the plan's states + logits items.

Usage: python memory_worker.py MODELS_DIR OUT_JSON
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from batches import make_batch  # noqa: E402

from sorl_megatron.algorithms import PolicyLossConfig  # noqa: E402
from sorl_megatron.bridge import ParallelLayout  # noqa: E402
from sorl_megatron.bridge.model import ModelOptions  # noqa: E402
from sorl_megatron.engine import offload  # noqa: E402
from sorl_megatron.engine.actor import ActorConfig, PolicyEngine  # noqa: E402
from sorl_megatron.engine.config import BatchingConfig, OptimConfig  # noqa: E402
from sorl_megatron.engine.critic import CriticConfig, ValueEngine  # noqa: E402

VOCAB = 1024  # the memory model's (the logits item is then visible beside the states)


def actor_config(mbs: int = 4, rows: int = 8) -> ActorConfig:
    return ActorConfig(loss=PolicyLossConfig.from_dict({"name": "grpo"}), optim=OptimConfig(lr=1e-3),
                       batching=BatchingConfig(micro_batch_size=mbs, mini_batch_size=rows))


def training_batch(engine, rows=8, seq=12, vocab=128, seed=0):
    b = make_batch(rows=rows, seq=seq, vocab=vocab, seed=seed)
    out = engine.compute_logprobs(b)
    g = torch.Generator().manual_seed(seed + 1)
    old = out.logprobs + 0.1 * torch.randn(out.logprobs.shape, generator=g) * b.loss_mask
    return b.replace(old_logprobs=old, advantages=torch.randn(out.logprobs.shape, generator=g) * b.loss_mask)


def grads_of(engine) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in engine.model.chunks[0].module.named_parameters()}


def op_recompute(models: str) -> dict:
    out = {}
    for mode in ("none", "selective", "full"):
        layout = dataclasses.replace(ParallelLayout(), recompute=mode)
        actor = PolicyEngine(os.path.join(models, "qwen2"), layout, actor_config())
        batch = training_batch(actor)
        loss = actor.update(batch)["loss"]
        out[mode] = (loss, grads_of(actor), actor.config.recompute_granularity)
    diff = max((out["none"][1][k] - out[mode][1][k]).abs().max().item() for k in out["none"][1]
               for mode in ("selective", "full"))
    return {"losses": [out[m][0] for m in out], "grad_diff": diff, "granularity": [out[m][2] for m in out]}


def op_offload(models: str) -> dict:
    path = os.path.join(models, "qwen2")
    moves: list[str] = []
    real = offload.place_state
    offload.place_state = lambda chunks, optimizer, target: moves.append(str(target))  # record, move nothing
    try:
        opts = ModelOptions(offload_idle=True)
        actor = PolicyEngine(path, None, actor_config(), model_options=opts)
        ref = PolicyEngine(path, None, actor_config(), trainable=False, model_options=opts)
        critic = ValueEngine(path, None, CriticConfig(optim=OptimConfig(lr=1e-3), batching=actor_config().batching),
                             model_options=opts)
        plain_ref = PolicyEngine(path, None, actor_config(), trainable=False)
        batch = training_batch(actor)
        result = {"offloads": [actor.offload_idle, ref.offload_idle, critic.offload_idle, plain_ref.offload_idle]}
        mock = torch.device("cuda", 0)  # where the engines compute (mock: nothing moves on CPU)
        for engine in (ref, critic, plain_ref):
            engine._compute = mock
        seen = {}
        inner = PolicyEngine._run

        def spy(self, *args, **kwargs):
            seen[id(self)] = str(self.resides)
            return inner(self, *args, **kwargs)

        PolicyEngine._run = spy
        moves.clear()
        lp = ref.compute_logprobs(batch).logprobs
        result["ref_moves"], result["ref_during"], result["ref_after"] = list(moves), seen[id(ref)], str(ref.resides)
        moves.clear()
        lp_plain = plain_ref.compute_logprobs(batch).logprobs
        result["plain_moves"], result["plain_after"] = list(moves), str(plain_ref.resides)
        PolicyEngine._run = inner
        moves.clear()
        values = critic.compute_values(batch)
        critic.update(batch.replace(returns=values + 0.5 * batch.loss_mask, values=values))
        result["critic_moves"], result["critic_after"] = list(moves), str(critic.resides)
        result["logprob_diff"] = (lp - lp_plain).abs().max().item()
    finally:
        offload.place_state = real
    return result


def op_measured(models: str) -> dict:
    """Peak CPU allocation over build + one update (the profiler's memory events, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    rows, seq, mbs = 8, 64, 8
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        actor = PolicyEngine(os.path.join(models, "qwen2_mem"), None, actor_config(mbs=mbs, rows=rows))
        batch = training_batch(actor, rows=rows, seq=seq, vocab=VOCAB)
        actor.update(batch)
    # each op's own allocations (its children's are theirs) and the frees ("[memory]" events), in time order
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage != 0), key=lambda e: e.time_range.start)
    level = peak = 0
    for e in events:
        level += e.self_cpu_memory_usage
        peak = max(peak, level)
    params = sum(p.numel() for p in actor.model.chunks[0].module.parameters())
    return {"peak_bytes": peak, "params": params, "tokens": mbs * seq, "events": len(events)}


def main() -> None:
    models, out_path = sys.argv[1], sys.argv[2]
    result = {name: fn(models) for name, fn in
              (("recompute", op_recompute), ("offload", op_offload), ("measured", op_measured))
              if name in sys.argv[3:] or len(sys.argv) == 3}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
