"""A per-GPU memory estimate of a recipe before launch (``train --print-memory``), and the refusal
of a run whose estimate exceeds ``parallelism.gpu_memory_gib``.

Arithmetic on the model's HF ``config.json`` (``model.path``, else ``model.config_for_planning``
or ``--model-config``) and the recipe's layout, dtype, optimizer, micro-batch tokens, recompute
and offload keys. Nothing is built: the numbers are an upper-bound style estimate of the
allocator's peak (docs/concepts/memory-plan.md says what each item counts and what it leaves out).

The peak is the larger of two phases: the actor's update (actor states, its logits and
activations, plus the reference and critic unless ``model.offload_idle`` moves them to the CPU
while idle) and the critic's update (critic states and activations beside the resident actor).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from ...algorithms.advantages import ADVANTAGE_ESTIMATORS
from ...bridge.families import first_k_dense, has_qk_norm, has_qkv_bias, shared_expert_size
from .config import RecipeError, TrainConfig

GIB = 1024**3
# CUDA context and allocator fragmentation, measured in a world of one (results/gpu-checks.md)
RUNTIME_RESERVE_GIB = 3.0
# each NCCL communicator of a group of size > 1 this rank joins: its channels' send/receive
# buffers (NCCL_BUFFSIZE 4 MiB per channel and peer, up to 32 channels on NVLink, three
# protocols) and its proxy state. An estimate, not measured: one GPU cannot hold two NCCL ranks.
NCCL_COMMUNICATOR_GIB = 0.5
# an 80 GB H100 as torch.cuda.get_device_properties reports it: the budget of a plan made where
# there is no GPU and the recipe names none (parallelism.gpu_memory_gib)
H100_80GB_REPORTED_GIB = 79.2


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a model, split by how megatron shards them."""

    dense: int  # attention, norms, dense FFNs, shared experts, routers: split over TP x PP
    experts: int  # routed experts: split over EP x ETP x PP
    vocab: int  # embedding + output layer (value head: the embedding alone): split over TP


def read_model_config(path: str) -> SimpleNamespace:
    """An HF ``config.json`` (a file, or a directory holding one) as attributes."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise RecipeError(f"cannot read the model config {file} for the memory plan ({err})") from None
    if not isinstance(data, dict) or "hidden_size" not in data:
        raise RecipeError(f"{file} is not an HF config.json (no hidden_size)")
    from ...bridge.hf_config import CheckpointContentError, check_config_sizes

    try:
        check_config_sizes(data, str(file))  # a zero or absurd size would divide by zero or overflow the plan
    except CheckpointContentError as err:
        raise RecipeError(f"the memory plan cannot use it: {err}") from None
    return SimpleNamespace(**data)


def _get(c: Any, name: str, default: Any = 0) -> Any:
    value = getattr(c, name, None)
    return default if value is None else value


def routed_experts(c: Any) -> int:
    return int(_get(c, "num_experts", 0) or _get(c, "num_local_experts", 0) or _get(c, "n_routed_experts", 0))


def _attention_params(c: Any) -> tuple[int, int]:
    """(parameters, width of the q, k, v activations per token) of one attention block."""
    h, heads = int(c.hidden_size), int(c.num_attention_heads)
    if _get(c, "kv_lora_rank", 0):  # MLA (DeepSeek-V3)
        nope, rope, v = int(c.qk_nope_head_dim), int(c.qk_rope_head_dim), int(c.v_head_dim)
        q_lora, kv_lora = int(_get(c, "q_lora_rank", 0)), int(c.kv_lora_rank)
        q = h * q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        kv = h * (kv_lora + rope) + kv_lora * heads * (nope + v)
        return q + kv + heads * v * h, heads * (2 * (nope + rope) + v)
    kv_heads = int(_get(c, "num_key_value_heads", heads))
    hd = int(_get(c, "head_dim", h // heads))
    width = (heads + 2 * kv_heads) * hd
    bias = width if has_qkv_bias(c) else 0
    qk_norm = 2 * hd if has_qk_norm(c) else 0
    return h * width + heads * hd * h + bias + qk_norm, width


def count_params(c: Any, value_head: bool = False) -> ParamCount:
    """Parameters by kind (the MTP module, never built here, is not counted)."""
    h, layers, vocab = int(c.hidden_size), int(c.num_hidden_layers), int(c.vocab_size)
    attn, _ = _attention_params(c)
    experts = routed_experts(c)
    dense_layers = first_k_dense(c) if experts else layers
    moe_layers = layers - dense_layers
    ffn = int(_get(c, "intermediate_size", 0))
    moe_ffn = int(_get(c, "moe_intermediate_size", ffn))
    per_moe = 3 * h * shared_expert_size(c) + h * experts  # shared experts + router
    dense = layers * (attn + 2 * h) + dense_layers * 3 * h * ffn + moe_layers * per_moe + h
    tied = bool(_get(c, "tie_word_embeddings", False)) and not value_head
    head = h if value_head else (0 if tied else vocab * h)
    return ParamCount(dense=dense, experts=moe_layers * experts * 3 * h * moe_ffn, vocab=vocab * h + head)


def activation_bytes_per_token(c: Any, cfg: TrainConfig, layers: int) -> float:
    """Saved activations of ``layers`` decoder layers per token (bf16) for one micro-batch in flight.

    none: per layer the norms' inputs and outputs (4 h, split over TP by sequence parallelism),
    q/k/v and the attention output, the FFN's gate, up and activation outputs (split over TP;
    MoE: top-k experts' and the shared experts', plus the dispatched copies of the token).
    selective: megatron's default (core attention), which with fused attention stores no s^2
    softmax to begin with: counted as none. full: each layer's input, plus one layer recomputed.
    """
    p = cfg.parallelism
    h, heads = int(c.hidden_size), int(c.num_attention_heads)
    sp = p.tp if p.use_sequence_parallel else 1
    _, qkv = _attention_params(c)
    attn_out = heads * int(_get(c, "v_head_dim", _get(c, "head_dim", h // heads)))
    experts = routed_experts(c)
    if experts:
        topk = int(_get(c, "num_experts_per_tok", 1))
        moe_ffn = int(_get(c, "moe_intermediate_size", 0))
        # each GPU's experts get its sequence shard's tokens x top-k on average (all-to-all);
        # ETP splits an expert's FFN but gathers the tokens: the same per GPU
        ffn = topk * (3 * moe_ffn + 2 * h) / sp + 3 * shared_expert_size(c) / p.tp
    else:
        ffn = 3 * int(c.intermediate_size) / p.tp
    per_layer = 2 * (4 * h / sp + (qkv + attn_out) / p.tp + ffn)
    if p.recompute == "full":
        return 2 * h / sp * layers + per_layer
    return per_layer * layers


@dataclass
class MemoryItem:
    name: str
    gib: float
    note: str = ""


@dataclass
class MemoryPlan:
    """The items of the peak phase, with its name and the GPU's budget."""

    items: list[MemoryItem]
    phase: str
    budget_gib: float
    layout: str
    other_phase: str = ""
    hints: list[str] = field(default_factory=list)

    @property
    def total_gib(self) -> float:
        return sum(i.gib for i in self.items)

    budget_source: str = "parallelism.gpu_memory_gib"

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.budget_gib

    @property
    def margin_gib(self) -> float:
        return self.budget_gib - self.total_gib

    def biggest(self, n: int = 3) -> list[MemoryItem]:
        return sorted(self.items, key=lambda i: -i.gib)[:n]

    def report(self) -> str:
        width = max(len(i.name) for i in self.items)
        lines = [f"memory plan per GPU ({self.layout}); peak phase: {self.phase}"]
        lines += [f"  {i.name:<{width}} {i.gib:8.2f} GiB  {i.note}".rstrip() for i in self.items]
        verdict = f"fits, {self.margin_gib:.2f} GiB to spare" if self.fits else "DOES NOT FIT"
        lines.append(f"  {'total':<{width}} {self.total_gib:8.2f} GiB  {verdict} in {self.budget_gib:.1f} GiB "
                     f"({self.budget_source})")
        if self.other_phase:
            lines.append(f"  ({self.other_phase})")
        lines.append("  biggest: " + ", ".join(f"{i.name} {i.gib:.1f} GiB" for i in self.biggest()))
        return "\n".join(lines)


def _world_dp(cfg: TrainConfig, world_size: Optional[int]) -> tuple[int, int]:
    """(data-parallel size, expert data-parallel size); without a world size the recipe's
    ``parallelism.planned_world_size``, else the smallest world the layout needs."""
    p = cfg.parallelism
    mp, expert_mp = p.tp * p.pp * p.cp, p.expert_tp * p.ep * p.pp
    if world_size is None:
        world_size = p.planned_world_size or mp * expert_mp // _gcd(mp, expert_mp)
    return max(1, world_size // mp), max(1, world_size // expert_mp)


def memory_budget(cfg: TrainConfig) -> tuple[float, str]:
    """(GiB, where it comes from): ``parallelism.gpu_memory_gib``, else this GPU's reported
    memory, else (no GPU here) an 80 GB H100's."""
    if cfg.parallelism.gpu_memory_gib is not None:
        return cfg.parallelism.gpu_memory_gib, "parallelism.gpu_memory_gib"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory / GIB, f"the memory {props.name} reports"
    return H100_80GB_REPORTED_GIB, "an 80 GB H100's reported memory: no GPU here, no parallelism.gpu_memory_gib"


def nccl_groups(cfg: TrainConfig, dp: tuple[int, int], routed: bool) -> list[str]:
    """The NCCL groups of size > 1 a rank of the layout joins (megatron's, and the weight-update
    group of a stage's sender): each holds a communicator's buffers on the GPU."""
    p = cfg.parallelism
    sizes = [("TP", p.tp), ("PP", p.pp), ("DP", dp[0]), ("TP x PP", p.tp * p.pp if p.tp > 1 and p.pp > 1 else 1),
             ("embedding", 2 if p.pp > 1 else 1)]
    if routed:
        sizes += [("EP", p.ep), ("expert-TP", p.expert_tp), ("expert-DP", dp[1]),
                  ("EP x expert-TP", p.ep * p.expert_tp if p.ep > 1 and p.expert_tp > 1 else 1)]
    groups = [name for name, size in sizes if size > 1]
    from ...weight_sync.factory import transport_class

    return groups + (["weight update"] if transport_class(cfg.rollout).update_group else [])


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def micro_batch_tokens(cfg: TrainConfig) -> int:
    """The most tokens one micro-batch holds, RL's or (when it has its own) SFT's: the token
    budget, else micro_batch_size x the longest trajectory (a packed row's capacity, or the
    padded rows)."""
    s = cfg.schedule
    rows = max(s.micro_batch_size, cfg.sft.micro_batch_size or 0) if cfg.sft.enabled else s.micro_batch_size
    return s.max_tokens_per_micro_batch or rows * cfg.rollout.max_total_tokens


def _stage_layers(cfg: TrainConfig, c: Any) -> int:
    return max(cfg.parallelism.stage_layers(int(c.num_hidden_layers)))


def megatron_adam_is_fused() -> bool:
    """Whether megatron-core's optimizer is TransformerEngine's or apex's FusedAdam (it binds the
    first that imports, else torch's AdamW, whose multi-tensor step allocates one fp32 tensor the
    size of the parameters it updates: measured on an H100, docs/how-to/gpu-check.md)."""
    try:
        with warnings.catch_warnings():  # its "falling back to torch optimizers" is what this asks
            warnings.simplefilter("ignore")
            from megatron.core import optimizer
    except Exception:  # no megatron here (--print-memory on a bare machine): assume torch's
        return False
    return not optimizer.Adam.__module__.startswith("torch.")


def _states(cfg: TrainConfig, c: Any, who: str, dp: tuple[int, int], bf16: bool, trainable: bool,
            value_head: bool = False) -> list[MemoryItem]:
    """Weights (and for a trainable model gradients and Adam state) per GPU."""
    p = cfg.parallelism
    n = count_params(c, value_head)
    layers = int(c.num_hidden_layers)
    stage = _stage_layers(cfg, c) / layers  # the heaviest pipeline stage's share of the layers
    dense = n.dense * stage / p.tp + n.vocab / p.tp
    experts = n.experts * stage / (p.ep * p.expert_tp)
    params = dense + experts
    split = f"{params / 1e9:.2f}B params/GPU" + (f" ({experts / 1e9:.2f}B of them experts over EP {p.ep})"
                                                  if n.experts else "")
    items = [MemoryItem(f"{who} weights", params * (2 if bf16 else 4) / GIB, f"{'bf16' if bf16 else 'fp32'}, {split}")]
    if not trainable:
        return items
    items.append(MemoryItem(f"{who} gradients", params * 4 / GIB, "fp32 grad buffer (grad_reduce_in_fp32)"))
    # Adam: exp_avg + exp_avg_sq, plus an fp32 main copy of bf16 weights; sharded over (expert-)DP
    per = 12 if bf16 else 8
    if cfg.optimizer.use_distributed_optimizer:
        state = dense * per / dp[0] + experts * per / dp[1]
        note = f"Adam {'fp32 main + ' if bf16 else ''}2 moments, distributed over DP {dp[0]}"
    else:
        state, note = params * per, f"Adam {'fp32 main + ' if bf16 else ''}2 moments (not distributed)"
    items.append(MemoryItem(f"{who} optimizer", state / GIB, note))
    return items


def _optimizer_step(states: list[MemoryItem], bf16: bool, freed: float) -> list[MemoryItem]:
    """torch's multi-tensor AdamW allocates sqrt(exp_avg_sq) as a new fp32 tensor per parameter it
    updates (the optimizer item's parameters: 12 bytes each with a bf16 model, 8 with fp32). The
    step runs after the pass's activations and logits (``freed`` GiB) are released, so only the
    excess counts."""
    opt = states[-1]  # _states' last item of a trainable model
    step = opt.gib / (12 if bf16 else 8) * 4
    return [MemoryItem(opt.name + " step", max(0.0, step - freed),
                       f"torch's AdamW step (no fused Adam): {step:.2f} GiB, less the {freed:.2f} GiB the pass "
                       "frees before it")]


def _bf16(cfg: TrainConfig, on_gpu: bool) -> bool:
    return cfg.model.dtype == "bfloat16" or (cfg.model.dtype == "auto" and on_gpu)


def plan_memory(cfg: TrainConfig, c: Any, critic_config: Any = None, world_size: Optional[int] = None,
                on_gpu: bool = True) -> MemoryPlan:
    """The per-GPU estimate of ``cfg`` for the model config ``c`` (``critic_config``: the
    critic's when ``model.critic_path`` differs). ``on_gpu``: dtype auto means bf16."""
    p, bf16 = cfg.parallelism, _bf16(cfg, on_gpu)
    dp = _world_dp(cfg, world_size)
    critic_c = critic_config or c
    has_ref = cfg.algorithm.loss.kl_coef > 0
    has_critic = ADVANTAGE_ESTIMATORS[cfg.algorithm.advantage.estimator].critic
    offload = cfg.model.offload_idle
    tokens = micro_batch_tokens(cfg)
    in_flight = min(p.pp * p.vpp, max(1, cfg.schedule.mini_batch_size)) if p.pp > 1 else 1
    groups = nccl_groups(cfg, dp, routed_experts(c) > 0) if on_gpu else []
    reserve = [MemoryItem("runtime reserve", RUNTIME_RESERVE_GIB if on_gpu else 0.0,
                          "CUDA context, allocator fragmentation"),
               MemoryItem("NCCL communicators", len(groups) * NCCL_COMMUNICATOR_GIB,
                          f"{len(groups)} x ~{NCCL_COMMUNICATOR_GIB:g} GiB (estimate)" + (": " + ", ".join(groups)
                                                                                        if groups else ""))]

    torch_adam = on_gpu and not megatron_adam_is_fused()
    actor = _states(cfg, c, "actor", dp, bf16, trainable=True)
    ref = _states(cfg, c, "reference", dp, bf16, trainable=False) if has_ref else []
    critic = _states(cfg, critic_c, "critic", dp, bf16, trainable=True, value_head=True) if has_critic else []
    vocab_shard = int(c.vocab_size) / p.tp
    logit_elems = tokens * vocab_shard
    temp_copy = 4 if cfg.rollout.temperature != 1.0 else 0
    logits = [
        MemoryItem("logits", logit_elems * (2 if bf16 else 4) / GIB, f"[{tokens} tokens, {vocab_shard:.0f} vocab/TP]"),
        MemoryItem("logits fp32 copy", logit_elems * (4 + temp_copy if bf16 else temp_copy) / GIB,
                   "the fp32 copy for log-softmax" + (" and the temperature's" if temp_copy else "")),
        MemoryItem("log-softmax temporaries", logit_elems * (4 + (2 if bf16 else 0)) / GIB,
                   "backward: fp32 gradient of the logits and its cast"),
    ]
    act_bytes = activation_bytes_per_token(c, cfg, _stage_layers(cfg, c)) * (1 if bf16 else 2)
    note = f"{tokens} tokens x {in_flight} in flight, recompute={p.recompute}"
    actor_act = MemoryItem("actor activations", act_bytes * tokens * in_flight / GIB, note)
    critic_act = MemoryItem("critic activations",
                            activation_bytes_per_token(critic_c, cfg, _stage_layers(cfg, critic_c)) * (1 if bf16 else 2)
                            * tokens * in_flight / GIB, note)

    def parked(items: list[MemoryItem]) -> list[MemoryItem]:
        if not offload:
            return items
        return [MemoryItem(i.name, 0.0, "on the CPU while idle (model.offload_idle)") for i in items]

    def step(states: list[MemoryItem], freed: float) -> list[MemoryItem]:
        return _optimizer_step(states, bf16, freed) if torch_adam else []

    actor_phase = (actor + step(actor, sum(i.gib for i in logits) + actor_act.gib) + parked(ref) + parked(critic)
                   + logits + [actor_act] + reserve)
    critic_phase = (actor + parked(ref) + critic + step(critic, critic_act.gib) + [critic_act] + reserve
                    if has_critic else [])
    total = (sum(i.gib for i in actor_phase), sum(i.gib for i in critic_phase))
    world = world_size or p.planned_world_size
    layout = (f"{world} GPUs: " if world else "") + f"{p.describe()}, DP {dp[0]}" + (
        f", expert-DP {dp[1]}" if routed_experts(c) else "")
    budget, source = memory_budget(cfg)
    if critic_phase and total[1] > total[0]:
        return MemoryPlan(critic_phase, "critic update", budget, layout, f"actor update: {total[0]:.1f} GiB",
                          budget_source=source)
    other = f"critic update: {total[1]:.1f} GiB" if critic_phase else ""
    return MemoryPlan(actor_phase, "actor update", budget, layout, other, budget_source=source)


# what shrinks each kind of item (by the item name's last word), named in the refusal
_HINTS = {
    "weights": "parallelism.tp / pp (/ ep for experts)",
    "gradients": "parallelism.tp / pp (/ ep for experts)",
    "optimizer": "optimizer.use_distributed_optimizer=true, more data-parallel ranks",
    "step": "optimizer.use_distributed_optimizer=true, more data-parallel ranks; TransformerEngine or apex "
            "(megatron then uses their fused Adam)",
    "logits": "schedule.max_tokens_per_micro_batch, parallelism.tp",
    "copy": "schedule.max_tokens_per_micro_batch, parallelism.tp",
    "temporaries": "schedule.max_tokens_per_micro_batch, parallelism.tp",
    "activations": "parallelism.recompute=full, schedule.max_tokens_per_micro_batch",
}


def hint_for(item: MemoryItem) -> str:
    """The keys that shrink ``item``; the reference's and critic's states can also wait on the CPU."""
    hint = _HINTS.get(item.name.split()[-1], "parallelism.gpu_memory_gib (if the GPU has more)")
    if item.name.split()[0] in ("reference", "critic") and not item.name.endswith("activations"):
        hint = "model.offload_idle=true; " + hint
    return hint


def _existing(path: str) -> str:
    """``path`` as given, else under the repository root (recipes name repo-relative files)."""
    root = Path(__file__).resolve().parents[3] / path  # sorl_megatron/trainer/recipe/ -> the repository
    return path if os.path.exists(path) or not root.exists() else str(root)


def model_config_for(cfg: TrainConfig, override: Optional[str] = None) -> tuple[Any, Any, str]:
    """(policy config, critic config or None, where the policy's came from): ``override``, else
    ``<model.path>/config.json`` when present, else ``model.config_for_planning``."""
    if override:
        key, path = "--model-config", _existing(override)
    elif cfg.model.path and os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        key, path = "model.path", cfg.model.path
    elif cfg.model.config_for_planning:
        key, path = "model.config_for_planning", _existing(cfg.model.config_for_planning)
    else:
        raise RecipeError(f"the memory plan needs the model's config.json: {cfg.model.path}/config.json does not "
                          "exist; give model.config_for_planning (recipes/gpu/model_configs/) or --model-config")
    critic_path = cfg.model.critic_path
    critic = None
    if critic_path and os.path.isfile(os.path.join(critic_path, "config.json")):
        critic = read_model_config(critic_path)
    return read_model_config(path), critic, f"{key}={path}"


def check_memory_for_launch(cfg: TrainConfig, world_size: int, on_gpu: bool) -> Optional[MemoryPlan]:
    """Refuse (RecipeError naming the biggest items and the keys to change) a GPU run whose
    estimate exceeds ``parallelism.gpu_memory_gib``. CPU runs are not checked (returns None)."""
    if not on_gpu:
        return None
    c, critic, source = model_config_for(cfg)
    plan = plan_memory(cfg, c, critic, world_size, on_gpu=True)
    if plan.fits:
        return plan
    keys = "; ".join(f"{i.name} {i.gib:.1f} GiB: {hint_for(i)}" for i in plan.biggest())
    raise RecipeError(
        f"the memory estimate {plan.total_gib:.1f} GiB per GPU ({plan.phase}; {source}) exceeds "
        f"{plan.budget_gib:.1f} GiB ({plan.budget_source}). Biggest items: {keys}. "
        "See `python -m sorl_megatron.train --config RECIPE --print-memory` and docs/concepts/memory-plan.md"
    )
