"""Engine checks run inside one process group (1 process, or torchrun --nproc_per_node=2).

Every op builds engines at the case's layout, runs a fixed deterministic sequence and saves
its tensors (rank 0) to ``work/<tag>.pt``; pytest compares the files of different layouts.
Megatron's groups are re-initialized per case, so one launch covers several layouts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from batches import make_batch  # noqa: E402
from ckpt_attacks import evil_pickle, evil_torch_save, flip_bit, plant_in_byte_item, truncate, write  # noqa: E402
from transfer_ops import op_transfer  # noqa: E402

from sorl_megatron.algorithms import PolicyLossConfig, clip_bias_surrogate, compute_policy_loss  # noqa: E402
from sorl_megatron.bridge import ParallelLayout, iter_hf_weights  # noqa: E402
from sorl_megatron.bridge.model import ModelOptions  # noqa: E402
from sorl_megatron.engine.actor import ActorConfig, PolicyEngine  # noqa: E402
from sorl_megatron.engine.config import BatchingConfig, OptimConfig  # noqa: E402
from sorl_megatron.engine.critic import CriticConfig, ValueEngine  # noqa: E402
from sorl_megatron.engine.rl_batch import BatchError  # noqa: E402
from tests.bridge.case_runner import run_cases  # noqa: E402
from tests.bridge.worker import op_logits  # noqa: E402  (the one logits-vs-transformers check)


def rank() -> int:
    return torch.distributed.get_rank()


def params_of(engine) -> dict[str, torch.Tensor]:
    return {k: v.float().clone() for k, v in iter_hf_weights(engine.model)}


def save(work: str, tag: str, obj: dict) -> None:
    if rank() == 0:
        torch.save(obj, os.path.join(work, f"{tag}.pt"))


def actor_config(
    name="so_ppo", mode="logprob", apply_to="grad", mbs=2, replay="off", lr=1e-3, **loss_kw
) -> ActorConfig:
    loss = PolicyLossConfig.from_dict(
        {"name": name, "clip_bias": {"mode": mode, "apply_to": apply_to, "delta": 0.05}, **loss_kw}
    )
    return ActorConfig(loss=loss, optim=OptimConfig(lr=lr, warmup_steps=2, clip_grad=1.0, adam_eps=1e-6),
                       batching=BatchingConfig(micro_batch_size=mbs, mini_batch_size=8), routing_replay=replay)


def training_batch(engine, seed=0):
    b = make_batch(rows=8, seq=12, seed=seed)
    out = engine.compute_logprobs(b, entropy=True)
    g = torch.Generator().manual_seed(seed + 1)
    old = out.logprobs + 0.25 * torch.randn(out.logprobs.shape, generator=g) * b.loss_mask
    return b.replace(old_logprobs=old), out


def direct_clip_bias(engine, batch, cfg: PolicyLossConfig) -> dict:
    """||C|| of the concatenated mini-batch (logprob and scalar modes), from a plain forward."""
    out = engine.compute_logprobs(batch, entropy=True)
    res = {}
    for mode in ("logprob", "scalar"):
        c = dataclasses.replace(cfg, clip_bias=dataclasses.replace(cfg.clip_bias, mode=mode))
        _, m = compute_policy_loss(out.logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask, c,
                                   entropy=out.entropy, **loss_inputs(batch))
        res[mode] = float(m["clip_bias/norm"])
    return res


def loss_inputs(batch) -> dict:
    return {"rollout_logprobs": batch.rollout_logprobs, "ref_logprobs": batch.ref_logprobs, "turn_ids": batch.turn_ids}


def direct_param_grad_norm(engine, batch, cfg: PolicyLossConfig) -> float:
    """World size 1 only: ||dS/dtheta|| by autograd on one forward of the whole batch."""
    from sorl_megatron.bridge.forward import causal_attention_mask
    from sorl_megatron.engine.vocab_parallel import next_token_targets, shift_to_token_positions

    chunk = engine.model.unwrapped()[0]
    s = batch.seq_len
    logits = chunk(batch.input_ids, torch.arange(s).unsqueeze(0).expand_as(batch.input_ids), causal_attention_mask(s))
    lp = torch.log_softmax(logits.float(), -1).gather(-1, next_token_targets(batch.input_ids).unsqueeze(-1)).squeeze(-1)
    lp = shift_to_token_positions(lp) * batch.attention_mask
    logp = torch.log_softmax(logits.float(), -1)
    ent = shift_to_token_positions(-(logp.exp() * logp).sum(-1)) * batch.attention_mask
    surrogate = clip_bias_surrogate(lp, batch.old_logprobs, batch.advantages, batch.loss_mask, cfg, entropy=ent,
                                    **loss_inputs(batch))
    params = [p for p in chunk.parameters() if p.requires_grad]
    grads = torch.autograd.grad(surrogate, params, allow_unused=True)
    return float(sum((g.float() ** 2).sum() for g in grads if g is not None) ** 0.5)


def op_actor(case: dict, models: str, work: str) -> dict:
    """Log-probs, then three optimizer steps (logprob / param_grad / scalar+lr clip-bias modes);
    ``steps: 1`` stops after the first."""
    layout = ParallelLayout.from_string(case["layout"])
    cfg = actor_config(kl_coef=0.05, entropy_coef=0.01, is_correction={"mode": "tis"})
    cfg.optim.use_distributed_optimizer = bool(case.get("dist_opt", False))
    actor = PolicyEngine(os.path.join(models, case["model"]), layout, cfg)
    batch, out = training_batch(actor)
    res: dict = {"logprobs": out.logprobs, "entropy": out.entropy}
    batch = batch.replace(ref_logprobs=batch.old_logprobs - 0.05 * batch.loss_mask)
    res["direct_1"] = direct_clip_bias(actor, batch, cfg.loss)
    res["m1"] = actor.update(batch)
    res["params_1"] = params_of(actor)
    if case.get("steps", 3) == 1:  # log-probs and one update (the extra layouts)
        save(work, case["tag"], res)
        return {k: v for k, v in res.items() if k.startswith("m") or k.startswith("direct")}
    cfg.loss.clip_bias.mode = "param_grad"
    if torch.distributed.get_world_size() == 1 and not case.get("light"):
        res["direct_pg_2"] = direct_param_grad_norm(actor, batch, cfg.loss)
    res["m2"] = actor.update(batch)
    cfg.loss.clip_bias.mode = "scalar"
    cfg.loss.clip_bias.apply_to = "lr"
    res["direct_3"] = direct_clip_bias(actor, batch, cfg.loss)
    res["m3"] = actor.update(batch)
    res["params_3"] = params_of(actor)
    save(work, case["tag"], res)
    return {k: v for k, v in res.items() if k.startswith("m") or k.startswith("direct")}


def _named_bare_params(engine) -> dict[str, torch.Tensor]:
    """``chunk:name`` -> parameter, without the "module." prefixes DDP and Float16Module add."""
    def bare(name: str) -> str:
        while name.startswith("module."):
            name = name[len("module."):]
        return name

    return {f"{i}:{bare(n)}": p for i, c in enumerate(engine.model.chunks) for n, p in c.named_parameters()}


def main_params_of(engine) -> dict[str, torch.Tensor]:
    """The optimizer's float32 main parameters under the model's parameter names (replicated
    optimizer state only: megatron's Float16OptimizerWithFloat16Params keeps one fp32 copy per
    bf16 parameter; an fp32 model's parameters are their own main parameters)."""
    names = {id(p): n for n, p in _named_bare_params(engine).items()}
    out = {}
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        if hasattr(opt, "fp32_from_float16_groups"):
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for p, main in zip(model_group, main_group):
                    out[names[id(p)]] = main.detach().clone()
        else:
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    out[names[id(p)]] = p.detach().float().clone()
    return out


def op_bf16(case: dict, models: str, work: str) -> dict:
    """The same actor in float32 and in megatron's BF16 mixed precision (bf16 parameters and
    activations, fp32 main parameters, gradients and Adam state), from the same HF weights,
    on the same batch: log-probs, three optimizer steps (so_ppo with KL, entropy bonus, TIS,
    logprob clip-bias), and the log-probs after them. Rank 0 saves both runs' tensors."""
    layout = ParallelLayout.from_string(case["layout"])
    path = os.path.join(models, case["model"])
    steps = int(case.get("steps", 3))
    runs = {}
    batch = None
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if name == "fp32" and not case.get("with_fp32", True):
            continue
        replay = case.get("replay", "off")
        cfg = actor_config(kl_coef=0.05, entropy_coef=0.01, is_correction={"mode": "tis"}, replay=replay)
        cfg.optim.use_distributed_optimizer = bool(case.get("dist_opt", False))
        actor = PolicyEngine(path, layout, cfg, model_options=ModelOptions(dtype=dtype))
        if batch is None:  # one batch for both (its old log-probs, and R3 routes, from the first engine)
            batch = make_batch(rows=8, seq=12, seed=0)
            first = actor.compute_logprobs(batch, record_routing=replay == "r2")  # R2: fp32's routes
            noise = 0.25 * torch.randn(first.logprobs.shape, generator=torch.Generator().manual_seed(1))
            old = first.logprobs + noise * batch.loss_mask
            batch = batch.replace(old_logprobs=old, ref_logprobs=old - 0.05 * batch.loss_mask,
                                  routed_experts=first.routed_experts)
        replaying = replay != "off"
        out = actor.compute_logprobs(batch, entropy=True, replay=replaying)
        r: dict = {"lp0": out.logprobs, "ent0": out.entropy, "m": []}
        if torch.distributed.get_world_size() == 1:
            r["main0"] = main_params_of(actor)
        for _ in range(steps):
            r["m"].append(actor.update(batch))
        r["lp"] = actor.compute_logprobs(batch, replay=replaying).logprobs
        r["params"] = params_of(actor)
        if torch.distributed.get_world_size() == 1:
            r["main"] = main_params_of(actor)
            r["main_dtypes"] = sorted({str(p.dtype) for p in r["main"].values()})
            r["grad_dtypes"] = sorted({str(p.main_grad.dtype) for c in actor.model.chunks for p in c.parameters()})
            model = {k: p.detach() for k, p in _named_bare_params(actor).items()}
            r["model_is_rounded_main"] = all(torch.equal(model[k], v.to(model[k].dtype)) for k, v in r["main"].items())
        r["param_dtypes"] = sorted({str(p.dtype) for c in actor.model.chunks for p in c.parameters()})
        r["optimizers"] = [type(o).__name__ for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
        if name == "bf16" and case.get("resume"):  # the mixed-precision optimizer state resumes exactly
            from sorl_megatron.engine.checkpoint import load_engine_checkpoint, save_engine_checkpoint

            ckpt = os.path.join(work, case["tag"] + "_ckpt")
            save_engine_checkpoint(ckpt, actor)
            single = torch.distributed.get_world_size() == 1

            def state(engine):  # the bf16 weights, and at world size 1 the fp32 main weights too
                return {**params_of(engine), **(main_params_of(engine) if single else {})}

            actor.update(batch)
            uninterrupted = state(actor)
            del actor
            if cfg.optim.use_distributed_optimizer:  # the CPU patches for torch Adam's step are needed
                from sorl_megatron.bridge.cpu_compat import without_patch

                actor = PolicyEngine(path, layout, cfg, model_options=ModelOptions(dtype=dtype))
                # one fresh engine for both: the first fails in state_dict(), before it changes anything
                for patch, key in (("fresh_torch_adam_state_on_load", "unpatched_fresh_load"),
                                   ("torch_adam_step_on_load", "unpatched_load")):
                    try:
                        with without_patch(patch):
                            load_engine_checkpoint(ckpt, actor)
                        r[key] = None
                    except Exception as e:  # noqa: BLE001 - the test asserts on the message
                        r[key] = f"{type(e).__name__}: {e}"
                del actor
            actor = PolicyEngine(path, layout, cfg, model_options=ModelOptions(dtype=dtype))
            load_engine_checkpoint(ckpt, actor)
            actor.update(batch)
            r["resume_max_diff"] = _max_param_diff(uninterrupted, state(actor))
        runs[name] = r
        del actor
    if case.get("critic"):  # the value engine (scalar head in bf16, fp32 values out)
        vbatch = make_batch(rows=8, seq=12, seed=7)
        for name, dtype in (("critic_fp32", torch.float32), ("critic_bf16", torch.bfloat16)):
            critic_cfg = CriticConfig(optim=OptimConfig(lr=1e-3, adam_eps=1e-6), value_clip=0.2,
                                      batching=BatchingConfig(micro_batch_size=2, mini_batch_size=4))
            critic = ValueEngine(path, layout, critic_cfg, model_options=ModelOptions(dtype=dtype))
            v0 = critic.compute_values(vbatch)
            if name == "critic_fp32":
                vbatch = vbatch.replace(values=v0 + 0.1 * vbatch.loss_mask)
            m = critic.update(vbatch)
            optimizers = [type(o).__name__ for o in getattr(critic.optimizer, "chained_optimizers", [critic.optimizer])]
            runs[name] = {"v0": v0, "v1": critic.compute_values(vbatch), "m": m, "optimizers": optimizers}
            del critic
    save(work, case["tag"], runs)
    keep = ("param_dtypes", "main_dtypes", "grad_dtypes", "optimizers", "model_is_rounded_main", "resume_max_diff",
            "unpatched_load", "unpatched_fresh_load")
    return {k: {f: v for f, v in r.items() if f in keep} for k, r in runs.items() if not k.startswith("critic")}


def op_losses(case: dict, models: str, work: str) -> dict:
    """Every registered loss runs one step (4 micro-batches); metrics saved for comparison."""
    from sorl_megatron.algorithms import POLICY_LOSSES

    layout = ParallelLayout.from_string(case["layout"])
    actor = PolicyEngine(os.path.join(models, case["model"]), layout, actor_config(lr=1e-4))
    batch, _ = training_batch(actor, seed=3)
    res = {}
    for name in sorted(POLICY_LOSSES):
        actor.cfg.loss = PolicyLossConfig.from_dict(
            # delta 0.05 makes the factor ~20 here: on the LR that would throw the later losses'
            # ratios out of the clip range; on the gradient, clipping and Adam absorb it
            {"name": name, "clip_bias": {"delta": 0.05, "apply_to": "grad"}, "loss_agg": "seq-mean-token-mean"}
        )
        m = actor.update(batch)
        res[name] = {k: m[k] for k in ("loss", "grad_norm", "clip_bias/factor", "clip_frac")}
    res["params"] = params_of(actor)
    save(work, case["tag"], res)
    return {k: v for k, v in res.items() if k != "params"}


def op_placement(case: dict, models: str, work: str) -> dict:
    """Where the clip-bias factor applies: one optimizer step (Adam, clip_grad 1) from the same
    weights on the same batch per placement, against the unnormalized loss (grpo)."""
    layout = ParallelLayout.from_string(case["layout"])
    res = {}
    for variant, (name, apply_to) in {"base": ("grpo", "lr"), "lr": ("so_grpo", "lr"),
                                      "clipped_grad": ("so_grpo", "clipped_grad"), "grad": ("so_grpo", "grad")}.items():
        cfg = actor_config(name=name, apply_to=apply_to)
        cfg.loss.clip_bias.delta = 1e-4  # below this batch's ||C||: the factor is 1 / ||C||
        actor = PolicyEngine(os.path.join(models, case["model"]), layout, cfg)
        batch, _ = training_batch(actor, seed=7)
        before = params_of(actor)
        m = actor.update(batch)
        after = params_of(actor)
        update = sum(float(((after[k] - before[k]) ** 2).sum()) for k in before) ** 0.5
        keys = ("clip_bias/factor", "clip_bias/grad_scale", "clip_bias/lr_scale", "grad_norm", "clip_bias/logprob_norm")
        res[variant] = {"update_norm": update, **{k: m[k] for k in keys if k in m}}
        del actor
    return res


def op_replay(case: dict, models: str, work: str) -> dict:
    """R2: record, change the weights, replay; R3: given indices (with -1 = missing) are used."""
    layout = ParallelLayout.from_string(case["layout"])
    actor = PolicyEngine(os.path.join(models, case["model"]), layout, actor_config(name="grpo", replay="r2", lr=2e-2))
    batch, _ = training_batch(actor, seed=5)
    rec = actor.compute_logprobs(batch, record_routing=True)
    recorded = rec.routed_experts
    batch = batch.replace(routed_experts=recorded)
    m_first = actor.update(batch)
    m_more = [actor.update(batch) for _ in range(2)]
    live = actor.compute_logprobs(batch.replace(routed_experts=None), record_routing=True)
    used = actor.compute_logprobs(batch, record_routing=True, replay=True)
    att = batch.attention_mask.bool()[:, :, None, None].expand_as(recorded)
    # R3: random routes (distinct experts per token), prompt tokens missing (-1).
    g = torch.Generator().manual_seed(11)
    e = actor.config.num_moe_experts
    given = torch.argsort(torch.rand(recorded.shape[:3] + (e,), generator=g), dim=-1)[..., : recorded.shape[-1]].int()
    given[:, :3] = -1
    given = torch.where(att, given, torch.full_like(given, -1))
    moe = (recorded >= 0).flatten(0, 1).any(0).any(-1)  # layers with a router (not leading dense ones)
    given[:, :, ~moe] = -1
    r3 = actor.compute_logprobs(batch.replace(routed_experts=given), record_routing=True, replay=True)
    missing = (given < 0).all(-1, keepdim=True).expand_as(given) & att & moe[None, None, :, None]
    res = {
        "recorded": recorded,
        "r3_logprobs": r3.logprobs,
        "r3_used": r3.routed_experts,
        "m_first": m_first,
        "m_last": m_more[-1],
        "replay_used_equals_recorded": bool(torch.equal(used.routed_experts[att], recorded[att])),
        "live_differs_frac": float(
            (torch.sort(live.routed_experts, -1).values != torch.sort(recorded, -1).values)
            .any(-1)[att[..., 0]]
            .float()
            .mean()
        ),
        "used_replay_mismatch": used.metrics.get("routing/replay_mismatch_frac"),
        "r3_given_used_exactly": bool(torch.equal(r3.routed_experts[(given >= 0)], given[(given >= 0)])),
        "r3_missing_fall_back_to_live": bool(torch.equal(r3.routed_experts[missing], live.routed_experts[missing])),
        "r3_mismatch": r3.metrics.get("routing/replay_mismatch_frac"),
        "recorded_pad_is_minus_one": bool((recorded[~att] == -1).all()),
    }
    save(work, case["tag"], res)
    return {k: v for k, v in res.items() if not isinstance(v, torch.Tensor)}


def op_rollout_r3(case: dict, models: str, work: str) -> dict:
    """The embedded rollout server (HF transformers) serves the family; its routed experts, decoded
    as the trainer decodes SGLang's, are replayed exactly by the engine's R3 and equal the engine's
    own live routing at the same weights; the log-probs agree."""
    from sorl_megatron.common.protocol import GenRequest, SamplingParams
    from sorl_megatron.engine.rl_batch import RLBatch, routed_experts_from_sglang
    from sorl_megatron.sglang_cpu.engine import RolloutEngine
    from sorl_megatron.sglang_cpu.options import EngineConfig

    src = os.path.join(models, case["model"])
    server = RolloutEngine(EngineConfig(model_path=src, enable_return_routed_experts=True)).start()
    prompts = [[5, 9, 17, 3], [40, 2, 77], [100, 101, 102, 103, 104]]
    try:
        futures = [
            server.submit(GenRequest(input_ids=p, return_logprob=True, return_routed_experts=True,
                                     params=SamplingParams(max_new_tokens=7, sampling_seed=i, ignore_eos=True)))
            for i, p in enumerate(prompts)
        ]
        results = [f.result(timeout=300)[0] for f in futures]
        info = server.info()
    finally:
        server.stop()
    layers, topk = info["routed_experts_layers"], info["num_experts_per_tok"]
    seqs = [p + r["output_ids"] for p, r in zip(prompts, results)]
    s_len = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), s_len, dtype=torch.long)
    att, loss = torch.zeros_like(ids), torch.zeros_like(ids)
    rollout_lp = torch.zeros(len(seqs), s_len)
    routed = torch.full((len(seqs), s_len, layers, topk), -1, dtype=torch.int32)
    for i, (p, r, x) in enumerate(zip(prompts, results, seqs)):
        ids[i, : len(x)] = torch.tensor(x)
        att[i, : len(x)] = 1
        loss[i, len(p): len(x)] = 1
        rollout_lp[i, len(p): len(x)] = torch.tensor([t[0] for t in r["meta_info"]["output_token_logprobs"]])
        routed[i] = routed_experts_from_sglang(r["meta_info"]["routed_experts"], num_layers=layers, topk=topk,
                                               seq_len=s_len)
    batch = RLBatch(input_ids=ids, attention_mask=att, loss_mask=loss, routed_experts=routed,
                    advantages=torch.ones(len(seqs)), old_logprobs=rollout_lp, rollout_logprobs=rollout_lp)
    actor = PolicyEngine(src, ParallelLayout.from_string(case["layout"]), actor_config(name="grpo", replay="r3"))
    r3 = actor.compute_logprobs(batch, record_routing=True, replay=True)
    live = actor.compute_logprobs(batch, record_routing=True, replay=False)
    given = routed >= 0
    moe_layers = given.flatten(0, 1).any(0).any(-1)
    return {
        "num_moe_layers": info["num_moe_layers"],
        "routed_layers": moe_layers.tolist(),
        "dense_rows_unrouted": bool((routed[:, :, ~moe_layers] == -1).all()),
        "given_pairs": int(given.all(-1).sum()),
        "r3_used_exactly": bool(torch.equal(r3.routed_experts[given], routed[given])),
        "live_equals_rollout": bool(torch.equal(torch.sort(live.routed_experts, -1).values[given],
                                                torch.sort(routed, -1).values[given])),
        "replay_mismatch": r3.metrics.get("routing/replay_mismatch_frac"),
        "logprob_max_diff": float(((r3.logprobs - rollout_lp) * loss).abs().max()),
    }


def op_critic(case: dict, models: str, work: str) -> dict:
    layout = ParallelLayout.from_string(case["layout"])
    cfg = CriticConfig(
        optim=OptimConfig(lr=1e-3, adam_eps=1e-6),
        batching=BatchingConfig(micro_batch_size=2, mini_batch_size=4),
        value_clip=0.2,
    )
    critic = ValueEngine(os.path.join(models, case["model"]), layout, cfg)
    batch = make_batch(rows=8, seq=12, seed=7)
    v0 = critic.compute_values(batch)
    batch = batch.replace(values=v0 + 0.1 * batch.loss_mask)
    m = critic.update(batch)
    v1 = critic.compute_values(batch)
    res = {"v0": v0, "v1": v1, "m": m, "params": params_of(critic)}
    save(work, case["tag"], res)
    return {"m": m}


def op_sft(case: dict, models: str, work: str) -> dict:
    """SFT cold start: three cross-entropy steps on a fixed batch."""
    layout = ParallelLayout.from_string(case["layout"])
    cfg = ActorConfig(loss=PolicyLossConfig(name="ppo", loss_agg="token-mean"),
                      optim=OptimConfig(lr=1e-3, clip_grad=1.0, adam_eps=1e-6),
                      batching=BatchingConfig(micro_batch_size=2, mini_batch_size=8))
    actor = PolicyEngine(os.path.join(models, case["model"]), layout, cfg)
    batch = make_batch(rows=8, seq=12, seed=3)
    lp0 = actor.compute_logprobs(batch).logprobs
    steps = [actor.sft_update(batch) for _ in range(3)]
    lp1 = actor.compute_logprobs(batch).logprobs
    save(work, case["tag"], {"lp0": lp0, "lp1": lp1, "m": steps, "mask": batch.loss_mask, "params": params_of(actor)})
    return {"nll": [m["sft/nll"] for m in steps]}


def resume_engines(src: str, layout: str):
    cfg = actor_config(mbs=2)
    cfg.loss.clip_bias.form = "relative"  # its running mean of ||C|| is engine state to resume
    cfg.batching.shuffle = True
    cfg.batching.mini_batch_size = 4  # two optimizer steps per update
    actor = PolicyEngine(src, ParallelLayout.from_string(layout), cfg)
    critic = ValueEngine(src, ParallelLayout.from_string(layout),
                         CriticConfig(optim=OptimConfig(lr=1e-3, warmup_steps=3, adam_eps=1e-6),
                                      batching=BatchingConfig(micro_batch_size=2)))
    return actor, critic


def resume_batch():
    batch = make_batch(rows=8, seq=12, seed=9)
    # near the tiny model's log-probs, spread so that some tokens clip (the relative form's ||C|| > 0)
    spread = 0.5 * torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(9))
    return batch.replace(old_logprobs=(-4.8 + spread) * batch.attention_mask)


def op_resume(case: dict, models: str, work: str) -> dict:
    """Uninterrupted k+1 steps vs save after k, rebuild at `resume_layout`, load, one step.
    Then the damaged-checkpoint paths with every rank verifying its share of the files."""
    from sorl_megatron.engine.checkpoint import load_engine_checkpoint, newest_checkpoint, save_engine_checkpoint

    src = os.path.join(models, case["model"])
    ckpt = os.path.join(work, case["tag"] + "_ckpt")
    engines = functools.partial(resume_engines, src)
    batch = resume_batch()
    actor, critic = engines(case["layout"])
    actor.update(batch)
    critic.update(batch)
    save_engine_checkpoint(ckpt, actor, critic, extra={"trainer_step": 1})
    running_saved = actor.clip_bias_running
    ref_m = actor.update(batch)
    critic.update(batch)
    ref_actor, ref_critic = params_of(actor), params_of(critic)
    del actor, critic
    actor, critic = engines(case["resume_layout"])
    extra = load_engine_checkpoint(ckpt, actor, critic)
    running_loaded = actor.clip_bias_running
    m = actor.update(batch)
    critic.update(batch)
    got_actor, got_critic = params_of(actor), params_of(critic)
    diff = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in a)  # noqa: E731
    # step_2 damaged in one shard: every rank must agree to fall back to step_1, and a direct
    # load of step_2 must fail on every rank with the same error (no rank left waiting)
    root = os.path.join(work, case["tag"] + "_runs")
    bad = os.path.join(root, "step_2", "critic", "optim", "__0_1.distcp")
    if rank() == 0:
        for k in (1, 2):
            shutil.copytree(ckpt, os.path.join(root, f"step_{k}"))
        flip_bit(bad)
    torch.distributed.barrier()
    newest = str(newest_checkpoint(root))
    try:
        load_engine_checkpoint(os.path.join(root, "step_2"), actor, critic)
        damaged_error = None
    except Exception as e:
        damaged_error = f"{type(e).__name__}: {e}"
    return {
        "extra": extra,
        "step": actor.step,
        "actor_max_diff": diff(ref_actor, got_actor),
        "critic_max_diff": diff(ref_critic, got_critic),
        "loss_diff": abs(ref_m["loss"] - m["loss"]),
        "lr": [ref_m["lr"], m["lr"]],
        "no_tmp_left": not os.path.exists(ckpt + ".tmp"),
        "clip_bias_running": [running_saved, running_loaded],
        "newest": all_ranks(newest),
        "damaged_file": bad,
        "damaged_error": all_ranks(damaged_error),
    }


def all_ranks(value) -> list:
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def op_ckpt_safety(case: dict, models: str, work: str) -> dict:
    """Damaged and planted engine checkpoints: each load fails naming the file, nothing runs."""
    from sorl_megatron.bridge.manifest import write_manifest
    from sorl_megatron.engine.checkpoint import load_engine_checkpoint, save_engine_checkpoint

    actor, critic = resume_engines(os.path.join(models, case["model"]), case["layout"])
    actor.update(resume_batch())
    critic.update(resume_batch())
    base = os.path.join(work, "safety_base")
    save_engine_checkpoint(base, actor, critic, extra={"step": 1})
    marker = os.path.join(work, "safety_MARKER")
    out: dict = {"base": base, "marker": marker}

    def attempt(name, damage, refresh_manifest=False):
        d = os.path.join(work, f"safety_{name}")
        shutil.copytree(base, d)
        damage(d)
        if refresh_manifest:  # an attacker who rewrites the manifest too
            write_manifest(d)
        try:
            load_engine_checkpoint(d, actor, critic)
            out[name] = None
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"

    j = os.path.join
    attempt("flip", lambda d: flip_bit(j(d, "actor", "optim", "__0_0.distcp")))
    attempt("truncate", lambda d: truncate(j(d, "actor", "model", "__0_1.distcp"), 1000))
    attempt("missing", lambda d: os.remove(j(d, "critic", "engine.json")))
    attempt("extra", lambda d: write(j(d, "actor", "model", "__9_9.distcp"), b"x"))
    attempt("rng_pickle", lambda d: write(j(d, "rng", "rank0.safetensors"), evil_pickle(marker)), True)
    attempt("metadata_pickle", lambda d: write(j(d, "actor", "model", ".metadata"), evil_pickle(marker)), True)
    attempt("common_pt", lambda d: write(j(d, "critic", "optim", "common.pt"), evil_torch_save(marker)), True)
    attempt("byte_item", lambda d: plant_in_byte_item(j(d, "actor", "model"), marker), True)

    def old_format(d):  # what format 1 looked like: pickles, no manifest
        os.remove(j(d, "MANIFEST.json"))
        write(j(d, "rng", "rank0.pt"), evil_pickle(marker))
        write(j(d, "actor", "engine.pt"), evil_pickle(marker))

    attempt("old_format", old_format)
    out["marker_created"] = os.path.exists(marker)
    out["extra_after"] = load_engine_checkpoint(base, actor, critic)  # the intact one still loads
    return out


def op_bad_input(case: dict, models: str, work: str) -> dict:
    layout = ParallelLayout.from_string(case["layout"])
    actor = PolicyEngine(os.path.join(models, case["model"]), layout, actor_config(replay="r2"))
    batch = make_batch(rows=8, seq=12)
    errors = {}

    def expect(name, fn):
        t = time.time()
        try:
            fn()
            errors[name] = None
        except (BatchError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
        errors[name + "_s"] = time.time() - t

    expect("advantages_shape", lambda: actor.update(batch.replace(advantages=torch.zeros(8, 11))))
    expect("old_logprobs_shape", lambda: actor.update(batch.replace(old_logprobs=torch.zeros(7, 12))))
    expect(
        "routing_shape", lambda: actor.update(batch.replace(routed_experts=torch.zeros(8, 12, 2, 3, dtype=torch.int32)))
    )
    expect(
        "routing_values",
        lambda: actor.update(batch.replace(routed_experts=torch.full((8, 12, 2, 2), 9, dtype=torch.int32))),
    )
    expect(
        "empty",
        lambda: actor.compute_logprobs(
            make_batch(rows=8, seq=12).replace(
                input_ids=torch.zeros(0, 12, dtype=torch.long),
                attention_mask=None,
                loss_mask=None,
                old_logprobs=None,
                advantages=None,
                rollout_logprobs=None,
                ref_logprobs=None,
                returns=None,
                values=None,
                group_ids=None,
            )
        ),
    )
    expect(
        "left_padded",
        lambda: actor.compute_logprobs(batch.replace(attention_mask=torch.flip(batch.attention_mask, [1]))),
    )
    expect("mini_batch", lambda: actor.update(batch.select(slice(0, 6))))
    # still usable afterwards (no rank left inside a collective)
    errors["after_ok"] = bool(torch.isfinite(actor.compute_logprobs(batch).logprobs).all())
    return errors


def op_compat(case: dict, models: str, work: str) -> dict:
    """The optimizer_on_cpu patch is needed: without it each megatron optimizer entry point fails."""
    import megatron.core.optimizer as mopt
    from megatron.core.optimizer import clip_grads

    from sorl_megatron.bridge.cpu_compat import without_patch

    layout = ParallelLayout.from_string(case["layout"])
    actor = PolicyEngine(os.path.join(models, case["model"]), layout, actor_config())
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the test asserts on the type and message
            out[name] = f"{type(e).__name__}: {e}"

    params = [p for c in actor.model.chunks for p in c.parameters()]
    for p in params:
        p.grad = torch.ones_like(p)

    def oc(dist):
        return mopt.OptimizerConfig(
            optimizer="adam", lr=1e-3, params_dtype=torch.float32, use_distributed_optimizer=dist
        )

    with without_patch("optimizer_on_cpu"):
        attempt("fp32_optimizer_unpatched", lambda: mopt.get_megatron_optimizer(oc(False), actor.model.chunks))
        attempt("clip_unpatched", lambda: clip_grads.clip_grad_by_total_norm_fp32(params, 1.0, 10.0))
    attempt("fp32_optimizer_patched", lambda: mopt.get_megatron_optimizer(oc(False), actor.model.chunks))
    attempt("clip_patched", lambda: clip_grads.clip_grad_by_total_norm_fp32(params, 1.0, 10.0))
    return out


def op_compat_uneven(case: dict, models: str, work: str) -> dict:
    """The uneven_gather_on_gloo patch is needed and exact: megatron's first-dimension all-gather
    with per-rank split sizes (what the alltoall dispatcher does at ETP > 1 and EP > 1), over
    the whole world, without and with it; the even gather is left to megatron."""
    from megatron.core.tensor_parallel import mappings

    from sorl_megatron.bridge.cpu_compat import apply_cpu_compat, without_patch

    apply_cpu_compat()
    world, me = torch.distributed.get_world_size(), rank()
    group = torch.distributed.new_group(list(range(world)))
    sizes = [3 + 2 * i for i in range(world)]
    full = torch.arange(sum(sizes) * 4, dtype=torch.float32).reshape(-1, 4)
    mine = full[sum(sizes[:me]):sum(sizes[:me + 1])]
    out: dict = {}

    def attempt(name, fn, expected):
        try:
            out[name] = bool(torch.equal(fn(), expected))
        except Exception as e:  # noqa: BLE001 - the test asserts on the message
            out[name] = f"{type(e).__name__}: {e}"

    gather = lambda: mappings._gather_along_first_dim(mine, group, output_split_sizes=sizes)  # noqa: E731
    with without_patch("uneven_gather_on_gloo"):
        attempt("unpatched", gather, full)
    attempt("patched", gather, full)
    even = full[: 4 * world].reshape(world, 4, 4)[me]
    attempt("even", lambda: mappings._gather_along_first_dim(even, group), full[: 4 * world])
    return {"results": all_ranks(out)}


def op_recompute(case: dict, models: str, work: str) -> dict:
    """R2 under full activation recompute: the re-forward in backward replays the same routes."""
    import sorl_megatron.engine.routing_replay as rr

    counter = {"in_backward": 0}
    real = torch._C._current_graph_task_id

    def spy():
        v = real()
        counter["in_backward"] += v != -1
        return v

    out = {}
    for recompute in (False, True):
        cfg = actor_config(name="grpo", replay="r2", lr=2e-2)
        cfg.recompute = recompute
        actor = PolicyEngine(os.path.join(models, case["model"]), ParallelLayout.from_string(case["layout"]), cfg)
        batch, _ = training_batch(actor, seed=5)
        batch = batch.replace(routed_experts=actor.compute_logprobs(batch, record_routing=True).routed_experts)
        rr.torch._C._current_graph_task_id = spy
        try:
            losses = [actor.update(batch)["loss"] for _ in range(2)]
        finally:
            rr.torch._C._current_graph_task_id = real
        out[recompute] = (params_of(actor), losses, counter["in_backward"])
        counter["in_backward"] = 0
    return {
        "param_diff": _max_param_diff(out[False][0], out[True][0]),
        "losses": [out[False][1], out[True][1]],
        "replays_in_backward": [out[False][2], out[True][2]],
    }


def direct_loss(engine, batch, cfg: PolicyLossConfig):
    """World size 1 only: one forward of the whole batch at the current weights; the policy loss
    with its metrics, the log-probs and entropy, and the chunk's trainable parameters."""
    from sorl_megatron.bridge.forward import causal_attention_mask
    from sorl_megatron.engine.vocab_parallel import next_token_targets, shift_to_token_positions

    chunk = engine.model.unwrapped()[0]
    s = batch.seq_len
    logits = chunk(batch.input_ids, torch.arange(s).unsqueeze(0).expand_as(batch.input_ids), causal_attention_mask(s))
    logp = torch.log_softmax(logits.float(), -1)
    lp = logp.gather(-1, next_token_targets(batch.input_ids).unsqueeze(-1)).squeeze(-1)
    lp = shift_to_token_positions(lp) * batch.attention_mask
    ent = shift_to_token_positions(-(logp.exp() * logp).sum(-1)) * batch.attention_mask
    loss, m = compute_policy_loss(lp, batch.old_logprobs, batch.advantages, batch.loss_mask, cfg, entropy=ent,
                                  normalize=False, **loss_inputs(batch))
    return loss, m, lp.detach(), ent.detach(), [p for p in chunk.parameters() if p.requires_grad]


def op_diagnostics(case: dict, models: str, work: str) -> dict:
    """World size 1: one update's per-step diagnostics against a direct forward of the whole
    mini-batch; the clip-bias diagnostics flag on a loss without normalization."""
    from sorl_megatron.algorithms import segment_turns
    from sorl_megatron.algorithms.diagnostics import abs_log_ratio_histogram, advantage_stats, turn_ratio_spread

    layout = ParallelLayout.from_string(case["layout"])
    path = os.path.join(models, case["model"])

    def engine(diagnostics: bool) -> PolicyEngine:
        # one mini-batch of 8 rows: one optimizer step; loss diagnostics on: grpo's turn-ratio spread
        cfg = actor_config(name="grpo", lr=1e-3, diagnostics=True)
        cfg.loss.clip_bias.diagnostics = diagnostics
        cfg.optim.clip_grad = 1e-3  # clipping certainly acts: grad_norm must be the norm before it
        return PolicyEngine(path, layout, cfg)

    plain = engine(False)
    batch, _ = training_batch(plain, seed=5)
    cfg = plain.cfg.loss
    loss, direct, lp, ent, params = direct_loss(plain, batch, cfg)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    res: dict = {"direct_grad_norm": float(sum((g.float() ** 2).sum() for g in grads if g is not None) ** 0.5)}
    res["direct_pg_norm"] = direct_param_grad_norm(plain, batch, cfg)
    mask = batch.loss_mask.bool()
    hist = abs_log_ratio_histogram(lp, batch.old_logprobs, mask)
    values = (lp.double() - batch.old_logprobs.double())[mask].abs()
    spread, rows = turn_ratio_spread(torch.where(mask, lp - batch.old_logprobs, torch.zeros(())), segment_turns(mask),
                                     cfg.log_ratio_clamp)
    res["direct"] = {
        **advantage_stats(batch.advantages, mask),
        **{k: float(direct[k]) for k in ("clip_frac_high", "clip_frac_low", "approx_kl_k1", "approx_kl_k3")},
        **hist.metrics("abs_log_ratio"),
        "exact_p50": float(torch.quantile(values, 0.5)),
        "entropy/mean": float(ent[mask].mean()), "turn_ratio/spread": float(spread / rows), "rows": float(rows),
        "policy_tokens": float(mask.sum()),
    }
    res["m_plain"] = plain.update(batch)
    res["hist_num"] = plain.histograms["abs_log_ratio"].num
    with_diag = engine(True)
    res["m_diag"] = with_diag.update(batch)
    res["param_diff"] = _max_param_diff(params_of(plain), params_of(with_diag))
    # on policy (old log-probs = the current ones) nothing is clipped: C = 0 and no second pass runs
    passes = []
    run = with_diag._run
    with_diag._run = lambda micro, *a, **k: passes.append(len(micro)) or run(micro, *a, **k)
    on_policy = batch.replace(old_logprobs=with_diag.compute_logprobs(batch).logprobs)
    passes.clear()
    res["m_on_policy"] = with_diag.update(on_policy)
    res["on_policy_passes"] = len(passes)
    return res


def packing_batch(experts: int = 4, layers: int = 2, topk: int = 2):
    """8 trajectories of very different lengths (4..24 tokens) with explicit turn ids and
    rollout routes (prompt positions missing: the live router decides)."""
    b = make_batch(rows=8, seq=24, seed=13)
    lengths = torch.tensor([24, 5, 17, 9, 4, 21, 12, 7])
    pos = torch.arange(24).unsqueeze(0)
    att = (pos < lengths.unsqueeze(1)).long()
    loss = b.loss_mask * att
    loss[:, 3] = 1  # every row has a policy token
    turn_ids = torch.cumsum(((loss[:, 1:] == 1) & (loss[:, :-1] == 0)).long(), 1)
    turn_ids = torch.cat([torch.zeros(8, 1, dtype=torch.long), turn_ids], 1) * loss
    g = torch.Generator().manual_seed(17)
    routes = torch.argsort(torch.rand(8, 24, layers, experts, generator=g), dim=-1)[..., :topk].int()
    routes[:, :3] = -1
    routes = torch.where(att[:, :, None, None].bool(), routes, torch.full_like(routes, -1))
    return b.replace(
        attention_mask=att, loss_mask=loss, turn_ids=turn_ids, routed_experts=routes,
        advantages=b.advantages * loss, old_logprobs=b.old_logprobs * att, ref_logprobs=b.ref_logprobs * att,
        rollout_logprobs=b.rollout_logprobs * att, returns=b.returns * loss, values=b.values * loss,
    )


def _local_max_grad_diff(a, b) -> float:
    pa = {n: p for c in a.model.chunks for n, p in c.named_parameters()}
    pb = {n: p for c in b.model.chunks for n, p in c.named_parameters()}
    diff = torch.tensor(max(float((pa[n].main_grad - pb[n].main_grad).abs().max()) for n in pa))
    torch.distributed.all_reduce(diff, op=torch.distributed.ReduceOp.MAX)  # every rank's shard
    return float(diff)


def op_packing(case: dict, models: str, work: str) -> dict:
    """Padded vs token-budget vs packed micro-batches on the same weights and batch: log-probs,
    entropy, routes, the update's losses and gradients (so_ppo turn ratios with explicit turn ids,
    R3 replay, KL, entropy bonus, TIS, param_grad clip-bias), then the critic's values and update."""
    layout = ParallelLayout.from_string(case["layout"])
    path = os.path.join(models, case["model"])

    def actor(**batching):
        loss = PolicyLossConfig.from_dict({
            "name": "so_ppo", "kl_coef": 0.05, "entropy_coef": 0.01, "is_correction": {"mode": "tis"},
            "clip_bias": {"mode": "param_grad", "apply_to": "lr", "delta": 0.05}, "loss_agg": "seq-mean-token-mean",
        })
        return PolicyEngine(path, layout, ActorConfig(
            loss=loss, optim=OptimConfig(lr=1e-3, clip_grad=0.0, adam_eps=1e-6), routing_replay="r3",
            batching=BatchingConfig(micro_batch_size=2, mini_batch_size=8, **batching)))

    # budget 72: 3 padded rows of 24 per micro-batch (at dp = 1 one of them a dummy row)
    variants = {"padded": {}, "budget": {"max_tokens_per_micro_batch": 72},
                "packed": {"pack_sequences": True, "max_tokens_per_micro_batch": 40}}
    engines = {k: actor(**v) for k, v in variants.items()}
    batch = packing_batch()
    res: dict = {"lengths": batch.attention_mask.sum(1).tolist()}
    out = {}
    for k, e in engines.items():
        r3 = e.compute_logprobs(batch, entropy=True, record_routing=True)  # replays the given routes
        live = e.compute_logprobs(batch, record_routing=True, replay=False)  # R2's record
        out[k] = (r3, live)
    g = torch.Generator().manual_seed(19)
    ref_lp = out["padded"][0].logprobs
    train = batch.replace(old_logprobs=ref_lp + 0.3 * torch.randn(ref_lp.shape, generator=g) * batch.loss_mask,
                          ref_logprobs=ref_lp - 0.05 * batch.loss_mask)
    metrics = {k: e.update(train) for k, e in engines.items()}
    keys = ("loss", "pg_loss", "kl_ref", "entropy", "clip_bias/norm", "clip_bias/logprob_norm", "clip_frac",
            "grad_norm", "turn_ratio/spread", "routing/replay_mismatch_frac", "policy_tokens")
    for k in ("budget", "packed"):
        a, b = out["padded"], out[k]
        res[k] = {
            "logprobs": float((a[0].logprobs - b[0].logprobs).abs().max()),
            "entropy": float((a[0].entropy - b[0].entropy).abs().max()),
            "r3_routes_equal": bool(torch.equal(a[0].routed_experts, b[0].routed_experts)),
            "live_routes_equal": bool(torch.equal(a[1].routed_experts, b[1].routed_experts)),
            "metrics": {m: abs(metrics["padded"][m] - metrics[k][m]) for m in keys},
            "grads": _local_max_grad_diff(engines["padded"], engines[k]),
            "params": _max_param_diff(params_of(engines["padded"]), params_of(engines[k])),
        }
    res["batching"] = {k: {m: v for m, v in metrics[k].items() if m.startswith("batching/")} for k in engines}
    res["old_batching"] = {k: {m: v for m, v in out[k][0].metrics.items() if m.startswith("batching/")} for k in out}
    res["update"] = {k: {m: metrics[k][m] for m in keys} for k in engines}
    del engines, out

    def critic(**batching):
        return ValueEngine(path, layout, CriticConfig(
            optim=OptimConfig(lr=1e-3, clip_grad=0.0, adam_eps=1e-6), value_clip=0.2,
            batching=BatchingConfig(micro_batch_size=2, mini_batch_size=8, **batching)))

    critics = {"padded": critic(), "packed": critic(pack_sequences=True, max_tokens_per_micro_batch=40)}
    values = {k: c.compute_values(batch) for k, c in critics.items()}
    cm = {k: c.update(batch.replace(values=values["padded"] + 0.3 * batch.loss_mask)) for k, c in critics.items()}
    res["critic"] = {
        "values": float((values["padded"] - values["packed"]).abs().max()),
        "value_loss": abs(cm["padded"]["value_loss"] - cm["packed"]["value_loss"]),
        "grads": _local_max_grad_diff(critics["padded"], critics["packed"]),
        "padding_frac": [cm[k]["batching/padding_frac"] for k in critics],
        "value_clip_frac": cm["padded"]["value_clip_frac"],
    }
    return res


def op_wsync(case: dict, models: str, work: str) -> dict:
    """Distributed weight sync at this layout to two embedded servers (on rank 0): after it,
    every server's prompt log-probs equal the trainer's (fp32), or (fp8) every served weight
    is the quantizer's output of the trainer's weight; bytes sent per rank."""
    import asyncio

    from sorl_megatron.common.fp8 import dequantize_hf_state_dict, quantize_hf_tensor
    from sorl_megatron.rollout.client import RolloutClient
    from sorl_megatron.sglang_cpu.options import EngineConfig, ServerOptions
    from sorl_megatron.sglang_cpu.server import start_rollout_server
    from sorl_megatron.trainer.recipe.rollout_config import RolloutConfig, WeightSyncConfig
    from sorl_megatron.weight_sync.base import SyncTargets
    from sorl_megatron.weight_sync.distributed import DistributedWeightSync
    from sorl_megatron.weight_sync.export import weight_sync_roles

    precision = case.get("precision", "fp32")
    path = os.path.join(models, case["model"])
    actor = PolicyEngine(path, ParallelLayout.from_string(case["layout"]), actor_config())
    g = torch.Generator().manual_seed(100)  # one seed on every rank: replicated tensors stay equal
    with torch.no_grad():  # move every shard away from the checkpoint the servers hold
        for chunk in actor.model.chunks:
            for p in chunk.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.dtype))
    servers = []
    if rank() == 0:
        opts = ServerOptions(weight_group_timeout_s=60)
        servers = [start_rollout_server(EngineConfig(model_path=path, precision=precision, skip_tokenizer_init=True),
                                        options=opts) for _ in range(2)]
    sync = DistributedWeightSync(RolloutConfig(precision=precision,
                                               weight_sync=WeightSyncConfig(bucket_mb=1, init_timeout_s=60)))
    try:
        sent = sync.sync(actor.model, SyncTargets(tuple(s.url for s in servers)), "step_1").bytes_sent
        sent_by_rank = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(sent_by_rank, (sent, weight_sync_roles()))
        full = params_of(actor)  # the trainer's whole model, for the checks only
        res: dict = {"sent_by_rank": sent_by_rank, "total_bytes": sum(v.numel() * 4 for v in full.values())}
        batch = make_batch(rows=4, seq=12, seed=3)
        lp = actor.compute_logprobs(batch).logprobs
        if rank() == 0:
            res["versions"] = [s.engine.served.weight_version for s in servers]
            if precision == "fp8":
                expected = dequantize_hf_state_dict(dict(
                    pair for n, t in full.items() for pair in quantize_hf_tensor(n, t)))
                res["max_weight_diff"] = max(
                    (s.engine.served.state[k] - v).abs().max().item() for s in servers for k, v in expected.items())
                res["quantized"] = sum(t.dtype == torch.float8_e4m3fn for n, t in (
                    pair for n, t in full.items() for pair in quantize_hf_tensor(n, t)))
            else:
                res["max_weight_diff"] = max(
                    (s.engine.served.state[k] - v).abs().max().item() for s in servers for k, v in full.items())

                async def server_lp(url):
                    out = []
                    async with RolloutClient(url) as c:
                        for i in range(batch.batch_size):
                            n = int(batch.attention_mask[i].sum())
                            body = {"input_ids": batch.input_ids[i, :n].tolist(), "return_logprob": True,
                                    "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1}}
                            obj = await c._post_generate(body)
                            obj = obj[0] if isinstance(obj, tuple) else obj
                            got = [x[0] for x in obj["meta_info"]["input_token_logprobs"][1:]]
                            out.append((torch.tensor(got) - lp[i, 1:n]).abs().max().item())
                    return max(out)

                res["max_logprob_diff"] = max(asyncio.run(server_lp(s.url)) for s in servers)
    finally:
        sync.close()
        for s in servers:
            s.stop()
    return res


def _max_param_diff(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def op_old_from_forward(case: dict, models: str, work: str) -> dict:
    """An update whose first mini-batch takes its old log-probs from its own forward
    (``old_from_forward``, after an old pass over the other rows only) against the plain update
    after a full old pass: SO-GRPO with ||C|| in parameter space (its second backward reads pi_old
    too), 2 epochs of 2 shuffled mini-batches (the second epoch reads the kept values), optionally
    replaying R3 routes; then flags the update must refuse."""
    layout = ParallelLayout.from_string(case["layout"])
    replay = case.get("replay", "off")

    def engine(replay: str) -> PolicyEngine:
        cfg = actor_config(name="so_grpo", mode="param_grad", replay=replay)
        cfg.batching = BatchingConfig(micro_batch_size=2, mini_batch_size=4, epochs=2, shuffle=True, seed=3)
        return PolicyEngine(os.path.join(models, case["model"]), layout, cfg)

    batch = make_batch(rows=8, seq=12, seed=7)
    if replay == "r3":  # the "rollout's" routes: another engine's live ones
        batch = batch.replace(routed_experts=engine("off").compute_logprobs(batch, record_routing=True).routed_experts)
    plain, reusing = engine(replay), engine(replay)
    start = params_of(plain)
    full = plain.compute_logprobs(batch).logprobs
    m_plain = plain.update(batch.replace(old_logprobs=full))
    flags = reusing.first_mini_batch_rows(batch.batch_size)
    first, rest = flags.nonzero().flatten(), (~flags).nonzero().flatten()
    part = reusing.compute_logprobs(batch, rows=rest).logprobs
    m_reusing = reusing.update(batch.replace(old_logprobs=part), old_from_forward=flags)
    kept = reusing.forward_old_logprobs
    res = {
        "first": first.tolist(), "rest": rest.tolist(), "steps": m_plain["steps"],
        "param_diff": _max_param_diff(params_of(plain), params_of(reusing)),
        "param_step": _max_param_diff(start, params_of(plain)),
        "m_plain": m_plain, "m_reusing": m_reusing,
        "factor": m_plain["clip_bias/factor"], "param_norm": m_plain["clip_bias/norm"],
        "kept_diff": float((kept[first] - full[first]).abs().max()),
        "kept_elsewhere": float(kept[rest].abs().max()),
        "rest_diff": float((part[rest] - full[rest]).abs().max()),
        "skipped_rows": float(part[first].abs().max()),
    }
    errors = {}
    for name, bad in {"outside": torch.ones(batch.batch_size, dtype=torch.bool),
                      "shape": torch.zeros(batch.batch_size - 1, dtype=torch.bool),
                      "dtype": torch.zeros(batch.batch_size)}.items():
        before = params_of(reusing)
        try:
            reusing.update(batch.replace(old_logprobs=full), old_from_forward=bad)
            errors[name] = "accepted"
        except BatchError as e:
            errors[name] = str(e)
        errors[name + "_param_diff"] = _max_param_diff(before, params_of(reusing))
    res["errors"] = errors
    return res


OPS = {
    "placement": op_placement,
    "sft": op_sft,
    "recompute": op_recompute,
    "compat": op_compat,
    "compat_uneven": op_compat_uneven,
    "actor": op_actor,
    "losses": op_losses,
    "bf16": op_bf16,
    "replay": op_replay,
    "critic": op_critic,
    "rollout_r3": op_rollout_r3,
    "resume": op_resume,
    "ckpt_safety": op_ckpt_safety,
    "bad_input": op_bad_input,
    "diagnostics": op_diagnostics,
    "old_from_forward": op_old_from_forward,
    "packing": op_packing,
    "wsync": op_wsync,
    "transfer": lambda case, models, work: op_transfer(case, models, work, packing_batch()),
    "logits": op_logits,  # the bridge's check, run in this suite's four-process launch
}


def main() -> None:
    run_cases(OPS, default_timeout_s=120)


if __name__ == "__main__":
    main()
