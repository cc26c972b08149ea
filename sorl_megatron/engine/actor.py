"""The policy (actor) engine: log-probs / entropy passes and the PPO-family update.

    actor = PolicyEngine(hf_dir, layout, ActorConfig(loss=PolicyLossConfig(name="so_ppo")))
    out = actor.compute_logprobs(batch, record_routing=True)       # old-policy pass (R2 records)
    batch = batch.replace(old_logprobs=out.logprobs, routed_experts=out.routed_experts)
    metrics = actor.update(batch)                                   # epochs x mini x micro

Clipping-triggered normalization (SORL eq. 12) is applied per *mini-batch*: the clip-bias
statistics of every micro-batch on every pipeline stage and DP rank are summed, ``||C||`` is
taken once, and ``1 / max(||C||, delta)`` scales the accumulated gradient before clipping and
the optimizer step: that step's LR (``clip_bias.apply_to = 'lr'``, the default), the clipped
gradient (``clipped_grad``) or the gradient before clipping (``grad``, eq. 12 literally).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, get_args

import torch

from ..algorithms import (
    LossDenominators,
    PolicyLossConfig,
    clip_bias_surrogate,
    compute_policy_loss,
    loss_denominators,
    sft_loss,
)
from ..algorithms.clip_bias import mini_batch_normalization
from ..algorithms.diagnostics import (
    ABS_LOG_RATIO_EDGES,
    Histogram,
    abs_log_ratio_histogram,
    advantage_stats,
    turn_advantage_sign_mixing,
)
from ..bridge.layout import ParallelLayout
from ..bridge.model import ModelOptions
from ..common import comm
from .base import EngineBase, accumulate_metrics, device, reduce_metrics
from .config import BatchingConfig, OptimConfig
from .offload import resident
from .old_from_forward import OldFromForward
from .optimizer import factor_scales
from .rl_batch import RLBatch, validate_batch
from .vocab_parallel import next_token_targets, vocab_parallel_logprobs_entropy

RoutingReplayMode = Literal["off", "r2", "r3"]


@dataclass
class ActorConfig:
    """Policy engine configuration.

    routing_replay: ``off``; ``r2`` (``compute_logprobs(record_routing=True)`` records, the update
        replays ``batch.routed_experts``); ``r3`` (``batch.routed_experts`` from the rollout engine
        is replayed in every pass, the old-logprob pass included).
    temperature: logits are divided by it (use the rollout sampling temperature).
    moe_aux_loss_coeff: MoE load-balancing loss weight (0 = off, the RL default).
    recompute: full activation recompute (routing replay stays consistent in the re-forward).
    """

    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    routing_replay: RoutingReplayMode = "off"
    temperature: float = 1.0
    moe_aux_loss_coeff: float = 0.0
    recompute: bool = False

    def __post_init__(self) -> None:
        if self.routing_replay not in get_args(RoutingReplayMode):
            raise ValueError(f"actor.routing_replay {self.routing_replay!r} not in {list(get_args(RoutingReplayMode))}")
        if not self.temperature > 0:
            raise ValueError(f"actor.temperature must be > 0, got {self.temperature}")
        self.loss.validate("actor.loss")
        self.optim.validate("actor.optim")
        self.batching.validate("actor.batching")


@dataclass
class LogprobOutput:
    """Per-token outputs of a forward-only pass, aligned to token positions ([B, S], CPU)."""

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    routed_experts: Optional[torch.Tensor] = None  # [B, S, L, K] int32 (R2 record), -1 = none
    metrics: dict[str, float] = field(default_factory=dict)


class PolicyEngine(EngineBase):
    """Actor (trainable) or reference (``trainable=False``) policy on Megatron."""

    def __init__(
        self,
        hf: Any,
        layout: Optional[ParallelLayout] = None,
        config: Optional[ActorConfig] = None,
        *,
        trainable: bool = True,
        model_options: Optional[ModelOptions] = None,
    ):
        self.cfg = config or ActorConfig()
        super().__init__(
            hf, layout, self.cfg.optim, self.cfg.batching, trainable=trainable, temperature=self.cfg.temperature,
            moe_aux_loss_coeff=self.cfg.moe_aux_loss_coeff, recompute=self.cfg.recompute, model_options=model_options,
        )
        if self.cfg.routing_replay != "off" and not self.is_moe:
            raise ValueError(f"actor.routing_replay={self.cfg.routing_replay!r} needs a MoE model")
        # running mean of ||C|| of the relative clip-bias form (engine state: checkpointed)
        self.clip_bias_running: Optional[float] = None
        # distributions of the last update, for TensorBoard histograms (every rank holds the same)
        self.histograms: dict[str, Histogram] = {}
        self._abs_log_ratio: Optional[Histogram] = None  # merged over the update's forwards
        # during an update: where its old log-probs come from (the batch, or its own forward)
        self._forward_old = OldFromForward()
        # the old log-probs the last update took from its own forward ([B, S], 0 on other rows)
        self.forward_old_logprobs: Optional[torch.Tensor] = None

    def extra_state(self) -> dict[str, Any]:
        return {"clip_bias_running": self.clip_bias_running}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        running = state.get("clip_bias_running")
        self.clip_bias_running = None if running is None else float(running)

    # -- validation -----------------------------------------------------------------------

    def _validate(self, batch: RLBatch, need: tuple[str, ...] = (), require_routes: bool = True) -> RLBatch:
        c = self.config
        kw: dict[str, Any] = {"vocab_size": self.model.hf_config.vocab_size}
        if self.is_moe:
            kw.update(num_layers=c.num_layers, topk=c.moe_router_topk, num_experts=c.num_moe_experts)
        if (
            require_routes
            and self.cfg.routing_replay == "r3"
            and "routed_experts" not in need
            and batch.routed_experts is None
        ):
            need = need + ("routed_experts",)
        return validate_batch(batch, need=need, **kw)

    def _replay_mode(self, batch: RLBatch, training: bool) -> Optional[str]:
        if self.cfg.routing_replay == "off" or batch.routed_experts is None:
            return None
        if self.cfg.routing_replay == "r2" and not training:
            return None  # R2: the old-logprob pass records instead
        return "replay"

    # -- forward-only pass -------------------------------------------------------------

    def _token_outputs(
        self, mb: dict, logits: torch.Tensor, entropy: bool
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Log-probs (and entropy) aligned to token positions, 0 off the attention mask."""
        logits = self._logits_scaled(logits)  # [b, s, V/tp] (packed: [1, T, V/tp])
        lp, ent = vocab_parallel_logprobs_entropy(logits, next_token_targets(self._model_tokens(mb)))
        lp = self._at_token_positions(mb, lp)
        if not entropy:
            return lp, None
        return lp, self._at_token_positions(mb, ent)

    @resident
    @torch.no_grad()
    def compute_logprobs(
        self, batch: RLBatch, *, entropy: bool = False, record_routing: bool = False, replay: Optional[bool] = None,
        rows: Optional[torch.Tensor] = None,
    ) -> LogprobOutput:
        """Log-probs of ``batch.input_ids`` under the current weights (the old / ref pass); with
        ``rows`` (global ids) of those rows only, the others' outputs 0.

        ``replay``: replay ``batch.routed_experts`` (None = by config: only under ``r3``).
        ``record_routing`` (MoE) returns the routing every router used as ``routed_experts``:
        the live top-k (R2's record) or, when replaying, the replayed-with-fallback routes.
        """
        batch = self._validate(batch, ("routed_experts",) if replay else ())
        b0, s0 = batch.batch_size, batch.seq_len
        batch, micro = self.batcher.forward_micro_batches(batch, rows)
        mode = self._replay_mode(batch, training=False) if replay is None else ("replay" if replay else None)
        record = None
        if record_routing:
            if not self.is_moe:
                raise ValueError("record_routing needs a MoE model")
            c = self.config
            record = torch.zeros(batch.batch_size, batch.seq_len, c.num_layers, c.moe_router_topk, dtype=torch.int32)
            mode = mode or "record"

        def loss_fn(mb, logits):
            lp, ent = self._token_outputs(mb, logits, entropy)
            out = {"rows": mb["rows"], "logprobs": lp}
            if ent is not None:
                out["entropy"] = ent
            return torch.zeros((), device=lp.device), out

        store = self._run(micro, loss_fn, forward_only=True, replay_mode=mode, record_into=record)
        shape = (batch.batch_size, batch.seq_len)
        lp = self._gather_rows([(d["rows"], d["logprobs"]) for d in store], shape, torch.float32)[:b0, :s0]
        ent = None
        if entropy:
            ent = self._gather_rows([(d["rows"], d["entropy"]) for d in store], shape, torch.float32)[:b0, :s0]
        routed = None
        if record is not None:
            comm.all_reduce(record)  # each (row, position, layer) written by one rank
            routed = (record - 1)[:b0, :s0]
            routed = torch.where(batch.attention_mask[:b0, :s0, None, None].bool(), routed, torch.full_like(routed, -1))
        return LogprobOutput(lp, ent, routed, {**self._replay_metrics(), **self.batching_metrics()})

    # -- update -------------------------------------------------------------------------

    def _diagnostics(self, reduced: dict[str, float], log_ratios: list[Histogram]) -> dict[str, float]:
        """The mini-batch's turn-ratio spread from its summed parts, and its |log r| histogram
        (from the contributing ranks: last stage, TP rank 0) merged into the update's."""
        out = {}
        if "turn_ratio/multi_turn_rows" in reduced:  # turn-level losses, or loss.diagnostics
            rows = reduced.pop("turn_ratio/multi_turn_rows")
            out["turn_ratio/spread"] = reduced.pop("turn_ratio/spread_sum", 0.0) / max(rows, 1.0)
        if "clip/turns" in reduced:  # the fraction of turns clipped by their turn ratio
            out["clip_frac/turn"] = reduced.pop("clip/turns_clipped", 0.0) / max(reduced.pop("clip/turns"), 1.0)
        h = Histogram.empty(ABS_LOG_RATIO_EDGES, device())
        for part in log_ratios if self.contributes else []:
            h = h.merge(part)
        sums = torch.cat([h.counts, h.total.view(1), h.total_squares.view(1)])
        extremes = torch.stack([-h.minimum, h.maximum])
        comm.all_reduce(sums)
        comm.all_reduce(extremes, "max")
        k = len(h.counts)
        merged = Histogram(h.edges, sums[:k], sums[k], sums[k + 1], -extremes[0], extremes[1])
        self._abs_log_ratio = (self._abs_log_ratio or Histogram.empty(h.edges)).merge(merged.to("cpu"))
        return out

    def _need(self) -> tuple[str, ...]:
        need = ["old_logprobs", "advantages"]
        loss = self.cfg.loss
        if loss.kl_coef > 0:
            need.append("ref_logprobs")
        if loss.is_correction.mode != "off":
            need.append("rollout_logprobs")
        return tuple(need)

    def _loss_kwargs(self, mb: dict, denominator: LossDenominators, entropy: Optional[torch.Tensor]) -> dict:
        return dict(
            rollout_logprobs=mb.get("rollout_logprobs"),
            ref_logprobs=mb.get("ref_logprobs"),
            entropy=entropy,
            turn_ids=mb.get("turn_ids"),
            denominator=denominator,
        )

    @resident
    def update(self, batch: RLBatch, old_from_forward: Optional[torch.Tensor] = None) -> dict[str, float]:
        """One RL update on `batch`: ``epochs`` x mini-batches (one optimizer step each).

        ``old_from_forward`` ([B] bool): rows whose old log-probs are their own forward in this
        update, detached (``batch.old_logprobs`` is not read there), for rows of the first
        mini-batch only (:meth:`first_mini_batch_rows`). That mini-batch trains on the weights
        a separate old pass would read, so its forward *is* that pass (the ratio is exactly 1),
        and the pass is saved; the same to rounding (a row's result may depend on the rows that
        share its micro-batch: docs/concepts/engine.md, tests/engine). ``self.forward_old_logprobs`` then holds
        them ([B, S], 0 on the other rows).

        Returns metrics averaged over the optimizer steps (token-weighted over micro-batches
        and DP ranks within a step), plus ``steps`` and the last step's ``lr``; and of the whole
        update: ``advantage/{mean,var}`` over the batch's policy tokens,
        ``advantage/turn_sign_mixed_frac`` over its turns and
        ``abs_log_ratio/{p50,p90,p99,max}`` over every token of every forward (``self.histograms``
        keeps that distribution).
        """
        if not self.trainable:
            raise RuntimeError("this PolicyEngine was built with trainable=False")
        batch = self._validate(batch, self._need())
        seq_len = batch.seq_len
        self._abs_log_ratio = Histogram.empty(ABS_LOG_RATIO_EDGES)
        self.forward_old_logprobs = None
        self._forward_old = OldFromForward.of(old_from_forward, batch.batch_size, self.first_mini_batch_rows)
        try:
            out = self._optimize(batch, self._train_mini_batch)
        finally:
            self.forward_old_logprobs, self._forward_old = self._forward_old.logprobs, OldFromForward()
        if self.forward_old_logprobs is not None:  # without the sequence padding of the passes
            self.forward_old_logprobs = self.forward_old_logprobs[:, :seq_len]
        out.update(advantage_stats(batch.advantages, batch.loss_mask))
        out.update(turn_advantage_sign_mixing(batch.advantages, batch.loss_mask, batch.turn_ids))
        out.update(self._abs_log_ratio.metrics("abs_log_ratio"))
        self.histograms = {"abs_log_ratio": self._abs_log_ratio}
        return out

    @property
    def update_forward_is_forward_pass(self) -> bool:
        """Whether an update's forward computes what a forward-only pass at the same weights
        would: not where forward-only passes run under FP8 and the update does not."""
        fp8 = self.model.options.fp8
        return not (fp8 is not None and fp8.enabled and fp8.forward_only)

    def first_mini_batch_rows(self, n: int) -> torch.Tensor:
        """Which of ``n`` rows (``[n]`` bool) the first mini-batch of an update started at this
        optimizer step trains on: the weights a forward pass would read now, so its update
        forward is that pass (:meth:`update`'s ``old_from_forward``)."""
        first = torch.zeros(n, dtype=torch.bool)
        first[self.batcher.update_rows(n, self.step)[0]] = True
        return first

    @resident
    def sft_update(self, batch: RLBatch) -> dict[str, float]:
        """Supervised cold start on gold trajectories: cross-entropy on ``loss_mask`` tokens,
        aggregated like ``loss.loss_agg``, one optimizer step per mini-batch (same batching)."""
        if not self.trainable:
            raise RuntimeError("this PolicyEngine was built with trainable=False")
        return self._optimize(self._validate(batch, require_routes=False), self._sft_mini_batch)

    def _sft_mini_batch(self, batch: RLBatch, rows: torch.Tensor, mbs: int) -> dict[str, float]:
        agg = self.cfg.loss.loss_agg

        def micro_loss(mb, logits, denominator):
            lp, _ = self._token_outputs(mb, logits, False)
            loss, metrics = sft_loss(lp, mb["loss_mask"], agg, denominator)
            return loss, metrics, metrics["policy_tokens"]

        return self._fit_mini_batch(batch, rows, mbs, agg, micro_loss)

    def _param_grad_clip_bias_norm(
        self, micro: list[dict], clipping: torch.Tensor, denominator: LossDenominators, need_entropy: bool,
        replay_mode: Optional[str],
    ) -> float:
        """``||dS/dtheta||`` of the mini-batch whose loss gradient the buffers hold: a second
        backward of the clip-bias surrogate ``S`` over the micro-batches that clipped anything on
        some rank (``S``'s gradient is exactly 0 on the others, so a mini-batch that clipped
        nothing, like the on-policy first one, costs no pass), reduced like the gradient. The
        loss gradient is set aside meanwhile and put back unchanged."""
        comm.all_reduce(clipping, "max")  # last stages decide for all
        chosen = [mb for mb, c in zip(micro, clipping.tolist()) if c > 0]
        if not chosen:
            return 0.0
        loss_cfg = self.cfg.loss
        scale = float(len(chosen) * self.ranks["dp"])  # undo megatron's 1/num_microbatches and DDP's 1/dp

        def surrogate_fn(mb, logits):
            lp, ent = self._token_outputs(mb, logits, need_entropy)
            old = self._forward_old.old_logprobs(mb, lp)
            s = clip_bias_surrogate(lp, old, mb["advantages"], mb["loss_mask"], loss_cfg,
                                    **self._loss_kwargs(mb, denominator, ent))
            return s * scale, {"clip_bias/surrogate": s.detach()}

        buffers = [b for c in self.model.chunks for b in c.buffers + c.expert_parallel_buffers]
        saved = [b.grad_data.clone() for b in buffers]  # the loss gradient, DP-reduced
        self.stepper.zero_grads()
        replay_stats = self._replay_stats  # routing/* report the loss pass over every micro-batch, not this subset
        self._run(chosen, surrogate_fn, forward_only=False, replay_mode=replay_mode)
        self._replay_stats = replay_stats
        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        self.stepper.zero_grads()
        for b, g in zip(buffers, saved):
            b.grad_data.copy_(g)
        return norm

    def _train_mini_batch(self, batch: RLBatch, rows: torch.Tensor, mbs: int) -> dict[str, float]:
        loss_cfg = self.cfg.loss
        spec = loss_cfg.spec
        denominator = loss_denominators(batch.loss_mask[rows], batch.advantages[rows], loss_cfg).to(device())
        _, micro = self.batcher.micro_batches(batch, rows, mbs, "batching.mini_batch_size")
        scale = float(len(micro) * self.ranks["dp"])  # undo megatron's 1/num_microbatches and DDP's 1/dp
        need_entropy = loss_cfg.entropy_coef > 0
        replay_mode = self._replay_mode(batch, training=True)
        mode = loss_cfg.clip_bias.mode
        step_metrics: dict[str, float] = {}

        self.stepper.zero_grads()
        # ||C|| in parameter space: the param_grad mode's factor, or a diagnostic for any loss
        measure_c = (spec.clip_normalized and mode == "param_grad") or loss_cfg.clip_bias.diagnostics
        acc: dict[str, list] = {}  # device partials, read once (reduce_metrics)
        log_ratios: list[Histogram] = []
        clipping = torch.zeros(len(micro), dtype=torch.float32, device=device())  # per micro-batch: C != 0

        def loss_fn(mb, logits):
            lp, ent = self._token_outputs(mb, logits, True)  # entropy comes with the log-probs: always logged
            old = self._forward_old.old_logprobs(mb, lp)
            self._forward_old.collect(mb, old)
            loss, metrics = compute_policy_loss(
                lp, old, mb["advantages"], mb["loss_mask"], loss_cfg, normalize=False,
                **self._loss_kwargs(mb, denominator, ent),
            )
            if measure_c:  # sum_t c_t^2 = 0 exactly when dS/dlog pi = 0, i.e. C = 0 on this micro-batch
                clipping[len(log_ratios)] = (metrics["clip_bias/sq_sum"] > 0).float()  # stays on the device
            accumulate_metrics(acc, metrics, weight=metrics["policy_tokens"])
            log_ratios.append(abs_log_ratio_histogram(lp, old, mb["loss_mask"]))
            return loss * scale, {}

        self._run(micro, loss_fn, forward_only=False, replay_mode=replay_mode)
        c_norm = 0.0
        if measure_c:
            c_norm = self._param_grad_clip_bias_norm(micro, clipping, denominator, need_entropy, replay_mode)
        reduced = reduce_metrics(acc, self.contributes)
        step_metrics.update(reduced)
        if "clip_bias/sq_sum" in reduced:  # losses that normalize by ||C||, or with diagnostics
            step_metrics["clip_bias/logprob_norm"] = max(reduced["clip_bias/sq_sum"], 0.0) ** 0.5
        step_metrics.update(self._diagnostics(step_metrics, log_ratios))
        if loss_cfg.clip_bias.diagnostics:
            step_metrics["clip_bias/param_norm"] = c_norm  # logged only: the update is unchanged
        factor = 1.0
        if spec.clip_normalized:
            norm = mini_batch_normalization(
                reduced.get("clip_bias/scalar", 0.0), reduced.get("clip_bias/sq_sum", 0.0), loss_cfg.clip_bias,
                param_grad_norm=c_norm if mode == "param_grad" else None, running=self.clip_bias_running,
            )
            factor, self.clip_bias_running = norm.factor, norm.running
            step_metrics["clip_bias/norm"] = norm.norm
            if norm.running is not None:
                step_metrics["clip_bias/running_norm"] = norm.running
        step_metrics["clip_bias/factor"] = factor
        step_metrics.update(self._replay_metrics())
        self._forward_old.keep(self._gather_rows, (batch.batch_size, batch.seq_len))
        apply_to = loss_cfg.clip_bias.apply_to
        step_metrics.update(self._optimizer_step(factor, apply_to))
        step_metrics.update(factor_scales(factor, apply_to, step_metrics["grad_norm"], self.optim.clip_grad))
        return step_metrics
