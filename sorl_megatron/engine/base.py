"""Shared machinery of the Megatron RL engines (policy and value).

What lives here: model + Megatron DDP construction, the micro-batched pass through
``get_forward_backward_func`` (any TP/PP/VPP/EP, ``forward_only`` for inference passes), and the
cross-rank reductions of outputs and metrics. How a pass is cut into this data-parallel rank's
micro-batches is the engine's :class:`~.micro_batching.MicroBatcher` (``engine.batcher``); the
Megatron optimizer, its LR schedule and the step are its :class:`~.optimizer.OptimizerStep`
(``engine.stepper``).

Gradient bookkeeping. Per micro-batch the loss functions compute their share of the
*mini-batch* loss (aggregation denominators are mini-batch totals), so the sum over the
micro-batches of all DP ranks is the mini-batch loss. Megatron divides each micro-batch loss
by ``num_microbatches`` and DDP averages gradients over DP, so the tensor handed to megatron
is ``loss * num_microbatches * dp_size``: the accumulated gradient is then exactly the
gradient of the mini-batch loss (``calculate_per_token_loss`` stays off).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Any, Callable, Optional

import torch

from ..algorithms import aggregation_denominator
from ..bridge.build import build_model
from ..bridge.forward import causal_attention_mask
from ..bridge.hf_config import load_hf_config
from ..bridge.layout import ParallelLayout, num_experts_of
from ..bridge.model import MegatronModel, ModelOptions
from ..bridge.te_fp8 import forward_only_fp8
from ..common import comm
from .config import BatchingConfig, OptimConfig, check
from .micro_batching import MicroBatcher, rank_info
from .offload import Offloadable, device
from .optimizer import OptimizerStep
from .rl_batch import BatchError, RLBatch
from .routing_replay import RoutingReplay
from .vocab_parallel import shift_to_token_positions

# torch 2.13 deprecates these two collectives (for all_gather_single / reduce_scatter_single);
# megatron-core 0.16.1 calls them (sequence-parallel mappings in tensor_parallel/, the DDP and
# distributed-optimizer buffers in distributed/param_and_grad_buffer.py); this package does not.
# The FutureWarning is attributed to torch's c10d_logger wrapper, so no `module=` can aim at
# megatron: the filter matches these two messages exactly and is installed where our engines
# hand their passes to megatron (every torchrun rank printed both otherwise).
# tests/engine/test_megatron_warnings.py checks the messages still match.
MEGATRON_DEPRECATED_COLLECTIVES = (
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated\. "
    r"Please use `torch\.distributed\.(all_gather_single|reduce_scatter_single)` instead"
)


def quiet_megatron_collective_deprecations() -> None:
    """Ignore exactly the FutureWarnings of :data:`MEGATRON_DEPRECATED_COLLECTIVES` (idempotent:
    ``filterwarnings`` replaces an equal filter)."""
    warnings.filterwarnings("ignore", message=MEGATRON_DEPRECATED_COLLECTIVES, category=FutureWarning)


def recompute_overrides(mode: str) -> dict[str, Any]:
    """TransformerConfig fields of ``parallelism.recompute``: none; selective (megatron's default
    modules, core attention); full (every layer's input kept, the layer re-run in backward)."""
    if mode == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if mode == "selective":
        return dict(recompute_granularity="selective")
    check(mode == "none", f"parallelism.recompute must be none, selective or full, got {mode!r}")
    return {}


# --------------------------------------------------------------------------------------
# Metric reduction: every micro-batch metric is a (kind, value, weight) partial.

SUM_METRICS = {
    "loss", "pg_loss", "kl_ref", "entropy", "sapo/penalty", "clip_bias/scalar", "clip_bias/sq_sum",
    "policy_tokens", "value_loss", "tokens", "turn_ratio/spread_sum", "turn_ratio/multi_turn_rows",
    "clip/turns_clipped", "clip/turns",
}


def _kind(name: str) -> str:
    if name in SUM_METRICS:
        return "sum"
    if name.endswith(("/min", "_min")):
        return "min"
    if name.endswith(("/max", "_max")):
        return "max"
    return "mean"


def accumulate_metrics(acc: dict[str, list], metrics: dict[str, torch.Tensor], weight) -> None:
    """Fold one micro-batch's metrics into `acc` (name -> [value, weight], float64 tensors on the
    metrics' device): nothing is read back to the host here; :func:`reduce_metrics` reads every
    partial in one copy. ``weight``: a number or a scalar tensor (a mean's weight)."""
    w = _scalar64(weight, _device_of(metrics, weight))
    for name, value in metrics.items():
        v = _scalar64(value.detach().float().sum() if isinstance(value, torch.Tensor) else value, w.device)
        kind = _kind(name)
        if name not in acc:
            acc[name] = [v * w, w] if kind == "mean" else [v, torch.ones_like(w)]
            continue
        a = acc[name]
        if kind == "sum":
            a[0] = a[0] + v
        elif kind == "min":
            a[0] = torch.minimum(a[0], v)
        elif kind == "max":
            a[0] = torch.maximum(a[0], v)
        else:
            a[0] = a[0] + v * w
            a[1] = a[1] + w


def _device_of(metrics: dict[str, Any], weight) -> torch.device:
    for x in (weight, *metrics.values()):
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _scalar64(x, dev: torch.device) -> torch.Tensor:
    """``x`` as a float64 scalar tensor on ``dev`` (the float32 -> float64 step of ``float(t)``)."""
    if isinstance(x, torch.Tensor):
        return x.to(device=dev, dtype=torch.float64)
    return torch.tensor(float(x), dtype=torch.float64, device=dev)


def metrics_to_host(acc: dict[str, list]) -> dict[str, list[float]]:
    """The partials of :func:`accumulate_metrics` as numbers: one device-to-host copy."""
    if not acc:
        return {}
    flat = torch.stack([t for pair in acc.values() for t in pair]).cpu().tolist()
    return {name: flat[2 * i: 2 * i + 2] for i, name in enumerate(acc)}


def reduce_metrics(acc: dict[str, list], contributes: bool) -> dict[str, float]:
    """Combine the partials of all ranks (only `contributes` ranks count: last stage, TP rank 0)."""
    parts = comm.all_gather_object(metrics_to_host(acc) if contributes else {})
    merged: dict[str, list[float]] = {}
    for part in parts:
        for name, (v, w) in (part or {}).items():
            kind = _kind(name)
            if name not in merged:
                merged[name] = [v, w]
            elif kind == "sum":
                merged[name][0] += v
            elif kind == "min":
                merged[name][0] = min(merged[name][0], v)
            elif kind == "max":
                merged[name][0] = max(merged[name][0], v)
            else:
                merged[name][0] += v
                merged[name][1] += w
    out = {}
    for name, (v, w) in merged.items():
        out[name] = v / w if _kind(name) == "mean" and w > 0 else (v if _kind(name) != "mean" else 0.0)
    return out


def mean_over_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for s in steps for k in s})
    return {k: sum(s[k] for s in steps if k in s) / max(1, sum(1 for s in steps if k in s)) for k in keys}


# --------------------------------------------------------------------------------------


def gather_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], shape: tuple, dtype) -> torch.Tensor:
    """Per-row outputs of every DP rank assembled on every rank (``parts``: this rank's
    ``(rows, values)``, empty on a rank that does not contribute: not last stage or TP rank 0)."""
    full = torch.zeros(shape, dtype=dtype, device=device())
    for rows, values in parts:
        full[rows.to(full.device)] = values.to(dtype)
    comm.all_reduce(full)
    return full.cpu()


class EngineBase(Offloadable):
    """Model and the micro-batched pass (cut by ``self.batcher``), stepped by ``self.stepper``
    (None when frozen); subclasses add the losses."""

    value_head = False

    def __init__(
        self,
        hf: Any,
        layout: Optional[ParallelLayout],
        optim: Optional[OptimConfig],
        batching: BatchingConfig,
        *,
        trainable: bool = True,
        temperature: float = 1.0,
        moe_aux_loss_coeff: float = 0.0,
        recompute: bool = False,
        model_options: Optional[ModelOptions] = None,
    ):
        check(temperature > 0, f"temperature must be > 0, got {temperature}")
        quiet_megatron_collective_deprecations()
        self.batching = batching
        self.optim = optim if optim is not None else OptimConfig()
        self.trainable = trainable
        self.temperature = float(temperature)
        self.step = 0  # optimizer steps taken
        options = model_options or ModelOptions()
        overrides = dict(options.config_overrides)
        hf_config = load_hf_config(hf)
        self.is_moe = num_experts_of(hf_config) > 0
        if self.is_moe:
            overrides.setdefault("moe_enable_routing_replay", True)
            # RL default: no load-balancing loss (its gradient is not part of the RL objective).
            overrides.setdefault("moe_aux_loss_coeff", moe_aux_loss_coeff)
            if moe_aux_loss_coeff == 0.0:
                overrides.setdefault("moe_router_load_balancing_type", "none")
        if options.fp8 is not None:
            overrides.update(options.fp8.build_overrides())  # FP8 training only; forward-only: _run
        overrides.update(recompute_overrides("full" if recompute else (layout.recompute if layout else "none")))
        # the reference (frozen) and the critic wait on the CPU between passes; the actor, which
        # every phase uses and whose weights are synced, stays
        self.offload_idle = options.offload_idle and (not trainable or self.value_head)
        ddp_config = None
        if trainable:
            ddp_config = dict(
                use_distributed_optimizer=self.optim.use_distributed_optimizer,
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                overlap_param_gather=False,
            )
        options = dataclasses.replace(options, value_head=self.value_head, config_overrides=overrides,
                                      wrap_with_ddp=trainable, ddp_config=ddp_config)
        self.model: MegatronModel = build_model(hf, layout, options)
        self.layout = self.model.layout
        self.config = self.model.config
        self._chunk_index = {id(c): i for i, c in enumerate(self.model.chunks)}
        self.batcher = MicroBatcher(batching, self.layout, interleaved=len(self.model.chunks) > 1)
        self._init_extra_params()
        self.stepper = OptimizerStep(self.optim, self.model) if trainable else None
        self.replay = RoutingReplay(self.model.unwrapped(), self.layout.use_sequence_parallel) if self.is_moe else None
        self._init_placement(device())

    # -- construction -------------------------------------------------------------------

    def _init_extra_params(self) -> None:
        """Initialize parameters the HF checkpoint does not have (before the optimizer copies them)."""

    @property
    def optimizer(self) -> Any:
        """Megatron's optimizer (None when frozen): what checkpoints save and offloading moves."""
        return self.stepper.optimizer if self.stepper is not None else None

    @property
    def scheduler(self) -> Any:
        """The LR schedule (None when frozen), checkpointed with the optimizer."""
        return self.stepper.scheduler if self.stepper is not None else None

    # -- batch geometry -----------------------------------------------------------------

    @property
    def ranks(self) -> dict[str, int]:
        return rank_info()

    @property
    def contributes(self) -> bool:
        """This rank's loss outputs count once: last pipeline stage, TP rank 0."""
        r = self.ranks
        return bool(r["last_stage"]) and r["tp_rank"] == 0

    @property
    def config_prefix(self) -> str:
        """What errors call this engine's batching settings (the trainer sets ``schedule``)."""
        return self.batcher.config_prefix

    @config_prefix.setter
    def config_prefix(self, prefix: str) -> None:
        self.batcher.config_prefix = prefix

    def batching_metrics(self) -> dict[str, float]:
        """How the last call (an update or a forward pass) was cut (:meth:`.MicroBatcher.metrics`)."""
        return self.batcher.metrics()

    def dp_rows(self, batch: RLBatch, *, forward: bool = True, update: bool = True) -> list[torch.Tensor]:
        """Per data-parallel rank, the rows its passes over ``batch`` read at this engine's
        optimizer step (:meth:`.MicroBatcher.dp_rows`): what the batch transfer sends it."""
        return self.batcher.dp_rows(batch, self.step, forward=forward, update=update)

    def _mask(self, s: int) -> torch.Tensor:
        return causal_attention_mask(s, device())

    def _model_tokens(self, mb: dict) -> torch.Tensor:
        """The token ids the model saw for ``mb`` (``[1, T]`` packed, else the rows ``[b, S]``)."""
        return mb["model"]["input_ids"] if "packed" in mb else mb["input_ids"]

    def _at_token_positions(self, mb: dict, per_prediction: torch.Tensor) -> torch.Tensor:
        """Per-prediction outputs in the model's layout -> the rows' ``[n, S]`` token positions
        (the batch contract: position t holds what the output at t-1 said; 0 at t = 0 and off the
        attention mask). Differentiable."""
        p = mb.get("packed")
        if p is None:
            att = mb["attention_mask"].bool()
            return torch.where(att, shift_to_token_positions(per_prediction), torch.zeros_like(per_prediction))
        return p.unpack_predictions(per_prediction, mb["input_ids"].shape[1])

    # -- the pass -----------------------------------------------------------------------

    def _run(
        self,
        micro: list[dict],
        loss_fn: Callable[[dict, torch.Tensor], tuple[torch.Tensor, dict]],
        forward_only: bool,
        replay_mode: Optional[str] = None,
        record_into: Optional[torch.Tensor] = None,
    ) -> list[dict]:
        """Run `micro` through megatron's schedule; returns the last stage's per-micro-batch dicts."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not micro:
            raise BatchError("no micro-batches on this rank (empty batch?)")
        packed = "packed" in micro[0]
        b, s = micro[0]["model"]["input_ids"].shape if packed else micro[0]["input_ids"].shape
        mask = None if packed else self._mask(s)
        chunks = self.model.chunks
        replay = self.replay if (self.replay is not None and replay_mode is not None) else None

        def step(data_iterator, model):
            mb = next(data_iterator)
            ci = self._chunk_index[id(model)]
            inputs = mb["model"] if packed else mb
            if replay is not None and replay_mode == "replay":
                replay.set_targets(ci, inputs.get("routed_experts"))
            if packed:
                out = model(inputs["input_ids"], inputs["position_ids"], None,
                            packed_seq_params=inputs["packed_seq_params"])
            else:
                out = model(mb["input_ids"], mb["position_ids"], mask)
            if replay is not None and record_into is not None:
                if packed:
                    p = mb["packed"]
                    token_rows, token_pos = p.token_row.unsqueeze(0), p.token_pos.unsqueeze(0)
                else:
                    token_rows = mb["rows"].unsqueeze(1).expand(b, s)
                    token_pos = torch.arange(s).unsqueeze(0).expand(b, s)
                replay.collect_records(ci, record_into, token_rows.cpu(), token_pos.cpu())
            return out, functools.partial(loss_fn, mb)

        iterators = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
        if replay is not None:
            replay.begin(replay_mode, keep_used=record_into is not None)
        was_training = [c.training for c in chunks]
        for c in chunks:
            c.train(not forward_only)
        fp8 = forward_only_fp8(self.config, self.model.options.fp8) if forward_only else contextlib.nullcontext()
        try:
            with fp8:
                store = get_forward_backward_func()(
                    forward_step_func=step,
                    data_iterator=iterators,
                    model=chunks if len(chunks) > 1 else chunks[0],
                    num_microbatches=len(micro),
                    seq_length=s,
                    micro_batch_size=b,
                    forward_only=forward_only,
                )
        finally:
            self._replay_stats = replay.end() if replay is not None else torch.zeros(2, dtype=torch.float64)
            for c, mode in zip(chunks, was_training):
                c.train(mode)
        return store

    def _replay_metrics(self) -> dict[str, float]:
        """Fraction of replayed (token, layer) pairs whose live routing differs (all ranks)."""
        stats = self._replay_stats.clone()
        comm.all_reduce(stats)  # disjoint tokens/layers per rank (DP rows, SP slices, PP layers)
        if stats[0] <= 0:
            return {}
        return {"routing/replayed_pairs": float(stats[0]), "routing/replay_mismatch_frac": float(stats[1] / stats[0])}

    def _gather_rows(self, parts: list[tuple[torch.Tensor, torch.Tensor]], shape: tuple, dtype) -> torch.Tensor:
        return gather_rows(parts if self.contributes else [], shape, dtype)

    def _logits_scaled(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float() / self.temperature if self.temperature != 1.0 else logits.float()

    # -- optimizer step -------------------------------------------------------------------

    def _optimizer_step(self, factor: float = 1.0, apply_to: str = "lr") -> dict[str, float]:
        """One step of the optimizer (:meth:`.OptimizerStep.step`), counted in ``self.step``."""
        metrics = self.stepper.step(factor, apply_to)
        self.step += 1
        return metrics

    def extra_state(self) -> dict[str, Any]:
        """JSON-serializable engine state beyond weights, optimizer and schedule (checkpointed)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`extra_state` returned."""

    def _optimize(self, batch: RLBatch, train_mini_batch) -> dict[str, float]:
        """``epochs`` x mini-batches of ``train_mini_batch(batch, rows, micro_batch_size)``."""
        self.batcher.begin_pass()
        batch = batch.padded_seq(self.batcher.seq_multiple())
        mbs = self.batching.micro_batch_size
        mini_batches = self.batcher.update_rows(batch.batch_size, self.step)
        per_step = [train_mini_batch(batch, rows, mbs) for rows in mini_batches]
        out = mean_over_steps(per_step)
        out["steps"] = float(len(per_step))
        out["lr"] = per_step[-1]["lr"]
        out.update(self.batcher.metrics())
        return out

    def _fit_mini_batch(
        self, batch: RLBatch, rows: torch.Tensor, mbs: int, loss_agg: str, micro_loss
    ) -> dict[str, float]:
        """One optimizer step of a plain objective (SFT, value loss) on the mini-batch ``rows``.

        ``micro_loss(mb, model_output, denominator) -> (loss, metrics, weight)`` gives a
        micro-batch's share of the mini-batch loss (``denominator`` = mini-batch aggregation
        count); the policy update has its own step because of the clip-bias normalization.
        """
        denominator = aggregation_denominator(batch.loss_mask[rows], loss_agg).to(device())
        _, micro = self.batcher.micro_batches(batch, rows, mbs, "batching.mini_batch_size")
        scale = float(len(micro) * self.ranks["dp"])  # undo megatron's 1/num_microbatches and DDP's 1/dp
        acc: dict[str, list] = {}  # device partials, read once (reduce_metrics)

        def loss_fn(mb, out):
            loss, metrics, weight = micro_loss(mb, out, denominator)
            accumulate_metrics(acc, metrics, weight=weight)
            return loss * scale, {}

        self.stepper.zero_grads()
        self._run(micro, loss_fn, forward_only=False)
        metrics = reduce_metrics(acc, self.contributes)
        metrics.update(self._optimizer_step())
        return metrics
