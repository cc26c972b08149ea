"""The engines' typed configs: the optimizer and how a batch is cut.

Plain dataclasses with no torch or megatron import, so the recipe schema
(``trainer/recipe/config.py``) builds on them without loading the engines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, get_args

LRSchedule = Literal["constant", "linear", "cosine"]


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass
class OptimConfig:
    """Adam + LR schedule + gradient clipping (megatron's optimizer and OptimizerParamScheduler).

    The schedule advances *before* each optimizer step, so with ``warmup_steps = W`` step k
    (1-based) uses ``lr * k / W`` for k <= W (never a zero-LR first step), then ``lr``
    (``constant``) or a ``linear`` / ``cosine`` decay to ``min_lr`` at ``decay_steps`` (which a
    decaying schedule needs by the time an engine is built; the trainer derives it from the
    run's length). The recipe's ``optimizer`` section is this class plus the critic's LR.
    ``clip_grad`` is the global max gradient norm (0 = off), reduced over TP/PP/DP with
    TP-duplicated parameters counted once (megatron's ``get_grad_norm_fp32``).
    """

    lr: float = 1e-6  # the peak learning rate (after warm-up); > 0
    min_lr: float = 0.0  # where a linear / cosine decay ends; in [0, lr]
    warmup_steps: int = 0  # optimizer steps of linear warm-up to lr (0: none)
    # the optimizer step a decay reaches min_lr at (> warmup_steps); null: the run's length (the trainer's)
    decay_steps: Optional[int] = None
    lr_schedule: LRSchedule = "constant"  # after warm-up: lr throughout, or a linear / cosine decay to min_lr
    weight_decay: float = 0.0  # Adam's weight decay, the same at every step; >= 0
    adam_beta1: float = 0.9  # Adam's beta1; in [0, 1)
    adam_beta2: float = 0.999  # Adam's beta2; in [0, 1)
    adam_eps: float = 1e-8  # Adam's epsilon; > 0
    clip_grad: float = 1.0  # the global max gradient norm (0 = off)
    # megatron's DistributedOptimizer: the optimizer state (fp32 main parameters, Adam moments) sharded over DP
    use_distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "optim") -> None:
        for key in ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"):
            value = getattr(self, key)
            finite = isinstance(value, (int, float)) and math.isfinite(value)
            check(finite, f"{prefix}.{key} must be finite, got {value}")
        check(self.lr > 0, f"{prefix}.lr must be > 0, got {self.lr}")
        check(0 <= self.min_lr <= self.lr, f"{prefix}.min_lr must be in [0, lr], got {self.min_lr}")
        check(
            isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, f"{prefix}.warmup_steps must be an int >= 0"
        )
        if self.decay_steps is not None:
            check(self.decay_steps > self.warmup_steps, f"{prefix}.decay_steps must be > warmup_steps")
        check(
            self.lr_schedule in get_args(LRSchedule),
            f"{prefix}.lr_schedule {self.lr_schedule!r} not in {get_args(LRSchedule)}",
        )
        check(self.weight_decay >= 0, f"{prefix}.weight_decay must be >= 0, got {self.weight_decay}")
        check(
            0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
            f"{prefix}.adam_beta1/adam_beta2 must be in [0, 1), got {self.adam_beta1}/{self.adam_beta2}",
        )
        check(self.adam_eps > 0, f"{prefix}.adam_eps must be > 0")
        check(self.clip_grad >= 0, f"{prefix}.clip_grad must be >= 0 (0 = off), got {self.clip_grad}")


@dataclass
class BatchingConfig:
    """How one RL batch is cut: ``epochs`` x mini-batches (one optimizer step each) x micro-batches.

    mini_batch_size: rows per optimizer step over all DP ranks (None = the whole batch).
    micro_batch_size: rows per forward/backward on one DP rank.
    forward_micro_batch_size: rows per micro-batch in forward-only passes (None = micro_batch_size).
    shuffle: permute rows each epoch (same permutation on every rank: seed, step, epoch).
    pack_sequences: pack trajectories back to back into rows of at most ``max_tokens_per_micro_batch``
        tokens (default: micro-batch size x the batch's padded length), one packed row per
        micro-batch, attention within each trajectory (``engine/packing.py``).
    max_tokens_per_micro_batch: token budget of a micro-batch (dynamic micro-batch size): with
        packing the capacity of a packed row, without it ``budget // S`` padded rows; the
        micro-batches of a mini-batch are balanced over the DP ranks. None = ``micro_batch_size`` rows.
    """

    epochs: int = 1
    mini_batch_size: Optional[int] = None
    micro_batch_size: int = 1
    forward_micro_batch_size: Optional[int] = None
    shuffle: bool = False
    seed: int = 0
    pack_sequences: bool = False
    max_tokens_per_micro_batch: Optional[int] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "batching") -> None:
        check(isinstance(self.epochs, int) and self.epochs >= 1, f"{prefix}.epochs must be an int >= 1")
        check(
            isinstance(self.micro_batch_size, int) and self.micro_batch_size >= 1,
            f"{prefix}.micro_batch_size must be an int >= 1",
        )
        if self.mini_batch_size is not None:
            check(
                isinstance(self.mini_batch_size, int) and self.mini_batch_size >= 1,
                f"{prefix}.mini_batch_size must be an int >= 1",
            )
        if self.forward_micro_batch_size is not None:
            check(self.forward_micro_batch_size >= 1, f"{prefix}.forward_micro_batch_size must be >= 1")
        check(isinstance(self.pack_sequences, bool), f"{prefix}.pack_sequences must be true or false")
        budget = self.max_tokens_per_micro_batch
        if budget is not None:
            check(
                isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1,
                f"{prefix}.max_tokens_per_micro_batch must be an int >= 1 or null, got {budget!r}",
            )
