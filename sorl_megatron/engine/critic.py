"""The value (critic) engine for PPO / SO-PPO: forward-only values for GAE and value updates.

Alignment follows the batch contract: ``values[:, t] = V(input_ids[:, :t])``, the value of
the state from which token t was sampled (the head's output at position t-1); 0 at t = 0 and
on padding. Loss per policy token (``loss_mask``), aggregated like the policy loss::

    v_clip = v_old + clamp(v - v_old, -value_clip, value_clip)
    l_t    = 0.5 * max((v - R)^2, (v_clip - R)^2)        (value_clip=None: 0.5 * (v - R)^2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..algorithms.aggregation import LOSS_AGG_MODES, aggregate, masked_mean, token_weights
from ..bridge.layout import ParallelLayout
from ..bridge.model import ModelOptions, ScalarValueHead
from .base import EngineBase
from .config import BatchingConfig, OptimConfig
from .offload import resident
from .rl_batch import RLBatch, validate_batch


@dataclass
class CriticConfig:
    """Critic configuration: its own optimizer / LR and batching; clipped value loss option."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    value_clip: Optional[float] = 0.2
    loss_agg: str = "token-mean"
    moe_aux_loss_coeff: float = 0.0
    head_seed: int = 0

    def __post_init__(self) -> None:
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"critic.value_clip must be > 0 or None, got {self.value_clip}")
        if self.loss_agg not in LOSS_AGG_MODES:
            raise ValueError(f"critic.loss_agg {self.loss_agg!r} not in {list(LOSS_AGG_MODES)}")
        self.optim.validate("critic.optim")
        self.batching.validate("critic.batching")


def value_loss(
    values: torch.Tensor, old_values: Optional[torch.Tensor], returns: torch.Tensor, loss_mask: torch.Tensor,
    value_clip: Optional[float], loss_agg: str, denominator=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(Clipped) value loss with mini-batch aggregation weights; returns (loss, metrics)."""
    mask = loss_mask.bool()
    err = (values - returns) ** 2
    clipfrac = torch.zeros(())
    if value_clip is not None:
        if old_values is None:
            raise ValueError("critic.value_clip needs batch.values (the old values)")
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        err_clipped = (clipped - returns) ** 2
        clipfrac = masked_mean((err_clipped > err).float(), mask)
        err = torch.maximum(err, err_clipped)
    w = token_weights(mask, loss_agg, denominator)
    loss = 0.5 * aggregate(err, w)
    metrics = {
        "value_loss": loss.detach(),
        "value_clip_frac": clipfrac.detach(),
        "values/mean": masked_mean(values.detach(), mask),
        "value_error/mean": masked_mean((values - returns).detach().abs(), mask),
        "tokens": mask.float().sum(),
    }
    return loss, metrics


class ValueEngine(EngineBase):
    """Critic on Megatron: a value head (``ModelOptions(value_head=True)``) on the backbone."""

    value_head = True

    def __init__(self, hf: Any, layout: Optional[ParallelLayout] = None, config: Optional[CriticConfig] = None, *,
                 model_options: Optional[ModelOptions] = None):
        self.cfg = config or CriticConfig()
        super().__init__(hf, layout, self.cfg.optim, self.cfg.batching, trainable=True,
                         moe_aux_loss_coeff=self.cfg.moe_aux_loss_coeff, model_options=model_options)

    def _init_extra_params(self) -> None:
        """The value head is not in the HF checkpoint: N(0, 1/hidden) from a fixed seed, the same
        on every rank and at every layout (the head is replicated, never sharded)."""
        g = torch.Generator().manual_seed(self.cfg.head_seed)
        for chunk in self.model.unwrapped():
            head = getattr(chunk, "output_layer", None)
            if isinstance(head, ScalarValueHead):
                w = torch.randn(head.weight.shape, generator=g) / head.weight.shape[1] ** 0.5
                with torch.no_grad():
                    head.weight.copy_(w.to(head.weight))

    def _validate(self, batch: RLBatch, need=()) -> RLBatch:
        return validate_batch(batch.replace(routed_experts=None), need=need, vocab_size=self.model.hf_config.vocab_size)

    def _values(self, mb: dict, head_out: torch.Tensor) -> torch.Tensor:
        return self._at_token_positions(mb, head_out.float().squeeze(-1))

    @resident
    @torch.no_grad()
    def compute_values(self, batch: RLBatch) -> torch.Tensor:
        """[B, S] values (CPU) for GAE, aligned to token positions."""
        batch = self._validate(batch)
        b0, s0 = batch.batch_size, batch.seq_len
        batch, micro = self.batcher.forward_micro_batches(batch)

        def loss_fn(mb, out):
            v = self._values(mb, out)
            return torch.zeros((), device=v.device), {"rows": mb["rows"], "values": v}

        store = self._run(micro, loss_fn, forward_only=True)
        full = self._gather_rows(
            [(d["rows"], d["values"]) for d in store], (batch.batch_size, batch.seq_len), torch.float32
        )
        return full[:b0, :s0]

    @resident
    def update(self, batch: RLBatch) -> dict[str, float]:
        """Fit values to ``batch.returns`` on ``batch.loss_mask`` (epochs x mini x micro)."""
        need = ("returns",) + (("values",) if self.cfg.value_clip is not None else ())
        return self._optimize(self._validate(batch, need), self._value_mini_batch)

    def _value_mini_batch(self, batch: RLBatch, rows: torch.Tensor, mbs: int) -> dict[str, float]:
        def micro_loss(mb, out, denominator):
            loss, metrics = value_loss(self._values(mb, out), mb.get("values"), mb["returns"], mb["loss_mask"],
                                       self.cfg.value_clip, self.cfg.loss_agg, denominator)
            return loss, metrics, metrics["tokens"]

        return self._fit_mini_batch(batch, rows, mbs, self.cfg.loss_agg, micro_loss)
