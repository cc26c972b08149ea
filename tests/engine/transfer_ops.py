"""The batch transfer's torchrun check (an op of worker.py): rank 0's batch sent as tensors,
routes only for each data-parallel rank's rows (``engine/batch_transfer.py``), against the
whole batch pickled to every rank (the path it replaced), on two engines with the same weights."""

from __future__ import annotations

import os

import torch

from sorl_megatron.algorithms import PolicyLossConfig
from sorl_megatron.bridge import ParallelLayout, iter_hf_weights
from sorl_megatron.common import comm
from sorl_megatron.engine.actor import ActorConfig, PolicyEngine
from sorl_megatron.engine.batch_transfer import share_batch
from sorl_megatron.engine.config import BatchingConfig, OptimConfig
from sorl_megatron.engine.rl_batch import RLBatch, RoutedRows


def _params(engine) -> dict[str, torch.Tensor]:
    return {k: v.float().clone() for k, v in iter_hf_weights(engine.model)}


def _grads(engine) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.clone() for c in engine.model.chunks for n, p in c.named_parameters()}


def packed(batch: RLBatch) -> RLBatch:
    """``batch`` with its dense routes as collate packs them: each row's real tokens, compact type."""
    r, att = batch.routed_experts, batch.filled().attention_mask.bool()
    values = r[att].to(torch.int8 if int(r.max()) < 128 else torch.int16)
    return batch.replace(routed_experts=RoutedRows(rows=torch.arange(batch.batch_size), lengths=att.sum(1),
                                                   values=values, batch_size=batch.batch_size,
                                                   seq_len=batch.seq_len, dtype=r.dtype))


def op_transfer(case: dict, models: str, work: str, full: RLBatch) -> dict:
    """Old and new path: the R3 old-logprob pass, then one update (two epochs of two shuffled
    mini-batches: four optimizer steps, what the transfer planned for) of ``full`` (a
    varied-length batch with rollout routes, the same on every rank; rank 0's is sent);
    log-probs, every update metric, the last mini-batch's gradients (this rank's shard) and the
    weights must be equal bit for bit, on every rank."""
    layout = ParallelLayout.from_string(case["layout"])
    batching = {"pack_sequences": True, "max_tokens_per_micro_batch": 40} if case.get("pack") else {}

    def actor():
        loss = PolicyLossConfig.from_dict({"name": "so_ppo", "kl_coef": 0.0, "loss_agg": "seq-mean-token-mean",
                                           "clip_bias": {"mode": "logprob", "apply_to": "lr", "delta": 0.05}})
        return PolicyEngine(os.path.join(models, case["model"]), layout, ActorConfig(
            loss=loss, optim=OptimConfig(lr=1e-2, clip_grad=1.0, adam_eps=1e-6), routing_replay="r3",
            batching=BatchingConfig(micro_batch_size=1, mini_batch_size=4, epochs=2, shuffle=True, seed=3, **batching)))

    rank0 = comm.rank() == 0
    engines = {"old": actor(), "new": actor()}
    received = {
        "old": comm.broadcast_object(full if rank0 else None),
        # rank 0 holds the routes packed, as rollout.trajectory.collate gives them
        "new": share_batch(packed(full) if rank0 else None, engines["new"].dp_rows, engines["new"].ranks["dp_rank"]),
    }
    out = {}
    for path, engine in engines.items():
        batch = received[path]
        lp = engine.compute_logprobs(batch, record_routing=True)
        g = torch.Generator().manual_seed(23)
        old = lp.logprobs + 0.3 * torch.randn(lp.logprobs.shape, generator=g) * batch.loss_mask
        train = batch.replace(old_logprobs=old, ref_logprobs=None)
        metrics = [engine.update(train)]
        out[path] = {"logprobs": lp.logprobs, "routes_used": lp.routed_experts, "metrics": metrics,
                     "grads": _grads(engine), "params": _params(engine)}
    a, b = out["old"], out["new"]
    routes = received["new"].routed_experts
    same = {
        "logprobs": torch.equal(a["logprobs"], b["logprobs"]),
        "routes_used": torch.equal(a["routes_used"], b["routes_used"]),
        "metrics": a["metrics"] == b["metrics"],
        "grads": all(torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"]),
        "params": all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]),
        "light_fields": all(torch.equal(v, getattr(received["new"], k))
                            for k, v in full.tensors().items() if k != "routed_experts"),
    }
    ranks = comm.all_gather_object({
        "same": same,
        "routes_type": type(routes).__name__,
        "routes_wire": str(routes.values.dtype) if isinstance(routes, RoutedRows) else None,
        "held_rows": routes.rows.tolist() if isinstance(routes, RoutedRows) else None,
        "dp_rank": engines["new"].ranks["dp_rank"],
        "routes_exact": bool(torch.equal(routes[torch.as_tensor(routes.rows)], full.routed_experts[routes.rows])),
    })
    return {"ranks": ranks, "update_ran": a["metrics"][-1]["steps"], "rows": full.batch_size,
            "clip_frac": a["metrics"][-1].get("clip_frac")}
