"""The typed schema of a training recipe, and the checks of its values.

Each section's dataclass checks its own keys in ``validate(prefix)``; ``TrainConfig.validate``
runs them when the config is built, then the rules that span sections (batch geometry against
the group size, a rollout mode against the loss's IS correction, ...). Non-finite numbers
(YAML's ``.nan`` / ``.inf``), values out of range, malformed URLs and impossible batch sizes
are a ``RecipeError`` naming the key. The ``rollout`` section is ``rollout_config.py``'s;
reading a recipe file (``defaults:``, overrides) is ``loader.py``; the checks that need the
world size and the model's HF config are ``launch_checks.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from ...algorithms.advantages import ADVANTAGE_ESTIMATORS
from ...algorithms.config import PolicyLossConfig
from ...bridge.layout import ParallelLayout
from ...bridge.te_fp8 import Fp8Error, Fp8Options
from ...engine.config import BatchingConfig, OptimConfig
from .bounds import check_maxima
from .checks import (
    RecipeError,
    _check_finite,
    _check_parallelism,
    _check_run_name,
    _check_url,
    _in_range,
    _positive_int,
    _positive_seconds,
)
from .rollout_config import RolloutConfig

MAX_SEED = 2**31 - 1  # schedule.seed's upper bound


@dataclass
class ModelConfig:
    """HF checkpoint of the policy (and the critic's initialization)."""

    path: str = ""  # the policy's HF model directory (config.json, weights, tokenizer); required
    critic_path: Optional[str] = None  # default: same as `path`
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    fp8: Fp8Options = field(default_factory=Fp8Options)  # TE FP8 (bridge/te_fp8.py); checked at launch
    # the reference and critic models (and the critic's gradients and Adam state) wait on the CPU
    # between their passes: GPU memory for the actor's update (docs/concepts/memory-plan.md)
    offload_idle: bool = False
    # the core attention of the TE-less layer spec (CPU, or a GPU without TE; TE runs its own):
    # torch's fused scaled_dot_product_attention, or megatron's unfused softmax math (the project's
    # first default; the study's recipes keep it so their cells stay comparable; CHANGELOG.md)
    local_attention: Literal["sdpa", "unfused"] = "sdpa"
    # the TE-less spec's expert linears: torch's grouped matmul where it has one for the device and
    # dtype (CUDA sm90 bf16), else a loop over experts; `loop` always loops (bridge/grouped_gemm.py)
    expert_gemm: Literal["auto", "loop"] = "auto"
    # an HF config.json the memory plan reads when model.path has none (recipes/gpu/model_configs/)
    config_for_planning: Optional[str] = None

    def validate(self, prefix: str = "model") -> None:
        if not self.path:
            raise RecipeError(f"{prefix}.path is empty: give the policy's HF model directory")
        try:
            self.fp8.validate(f"{prefix}.fp8")
        except Fp8Error as err:
            raise RecipeError(str(err)) from None


@dataclass
class AdvantageConfig:
    """A registered estimator (``algorithms.advantages.ADVANTAGE_ESTIMATORS``): gae (with a
    critic), grpo (group normalization) or pvpo (static V, PVPO eq. 10)."""

    estimator: str = "gae"  # the default loss (ppo) is defined on a critic's advantages
    gamma: float = 1.0  # GAE's discount gamma between successive policy tokens (gae only); in [0, 1]
    lam: float = 1.0  # GAE's lambda (gae only); in [0, 1]
    normalize_std: bool = True  # grpo only
    # the estimator's advantages whitened: mean 0, std 1 over the batch's policy tokens (any estimator)
    whiten: bool = False

    def validate(self, prefix: str = "advantage") -> None:
        _check_finite(self, prefix)
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise RecipeError(
                f"{prefix}.estimator: unknown estimator {self.estimator!r}; "
                f"registered: {sorted(ADVANTAGE_ESTIMATORS)}"
            )
        _in_range(f"{prefix}.gamma", self.gamma, 0, 1)
        _in_range(f"{prefix}.lam", self.lam, 0, 1)


@dataclass
class PVPOConfig:
    """PVPO group sampling: M reference rollouts per prompt before training."""

    num_ref_rollouts: int = 5  # M
    refresh_every: int = 0  # refresh static V every K steps (0 = never)
    refresh_at: list[int] = field(default_factory=list)  # and/or at these steps (PVPO table 2: [500])
    drop_solved: bool = True  # drop prompts with reference accuracy 1
    inject_ground_truth: bool = False  # replace one rollout of accuracy-0 prompts by a GT trajectory

    def refresh_due(self, step: int) -> bool:
        """Whether static V is refreshed before RL step ``step`` (0-based; never before step 1)."""
        return step > 0 and (step in self.refresh_at or (self.refresh_every > 0 and step % self.refresh_every == 0))

    def validate(self, prefix: str = "pvpo") -> None:
        _positive_int(f"{prefix}.num_ref_rollouts", self.num_ref_rollouts)
        _positive_int(f"{prefix}.refresh_every", self.refresh_every, minimum=0)
        if any(k < 1 for k in self.refresh_at):
            raise RecipeError(f"{prefix}.refresh_at steps must be >= 1, got {self.refresh_at}")


@dataclass
class AlgorithmConfig:
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    # MoE routing replay (needs an MoE model): r2: the update replays the experts the old-logprob pass
    # recorded; r3: every actor pass (old log-probs included) replays the experts the rollout servers returned
    routing_replay: Literal["off", "r2", "r3"] = "off"
    value_clip: Optional[float] = 0.2  # clipped value loss range; null = unclipped
    pvpo: PVPOConfig = field(default_factory=PVPOConfig)

    def validate(self, prefix: str = "algorithm") -> None:
        """The loss validates itself when built (``PolicyLossConfig``); here the estimator it
        needs, and the PVPO keys when the estimator is pvpo."""
        _check_finite(self, prefix)
        self.advantage.validate(f"{prefix}.advantage")
        self._check_loss_fits_estimator(prefix)
        if self.advantage.estimator == "pvpo":
            self.pvpo.validate(f"{prefix}.pvpo")
        if self.value_clip is not None and self.value_clip <= 0:
            raise RecipeError(f"{prefix}.value_clip must be > 0 or null, got {self.value_clip}")

    def _check_loss_fits_estimator(self, prefix: str) -> None:
        """The estimator gives the advantages the loss is defined on (a critic's for the PPO
        family, outcome-based ones for the group-relative losses)."""
        loss, estimator = self.loss.name, self.advantage.estimator
        critic = self.loss.spec.critic
        spec = ADVANTAGE_ESTIMATORS[estimator]
        if critic != spec.critic:
            wants = "a critic's advantages (gae)" if critic else "outcome-based advantages"
            fitting = sorted(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.critic == critic)
            raise RecipeError(
                f"{prefix}.loss.name={loss} is defined on {wants} but {prefix}.advantage.estimator={estimator} "
                f"{'needs' if spec.critic else 'has'} {'a critic' if spec.critic else 'no critic'}: "
                f"use {prefix}.advantage.estimator in {fitting}"
            )


@dataclass
class RetrievalConfig:
    """No URL = start the embedded BM25 server over `corpus`."""

    url: Optional[str] = None  # a running retrieval server (http(s) URL); null: the embedded one
    # the JSONL passages ({"id", "contents"} rows, Search-R1's format) the embedded server indexes; required without url
    corpus: str = ""
    topk: int = 3  # passages per search
    timeout_s: float = 30.0  # per /retrieve call (not retried after a timeout: a hung server fails after this)
    health_timeout_s: float = 10.0  # per GET /health, asked before each rollout phase
    retries: int = 2  # extra attempts after a refused connection or a 5xx answer

    def validate(self, prefix: str = "retrieval") -> None:
        _check_finite(self, prefix)
        if not self.url and not self.corpus:
            raise RecipeError(f"{prefix}.corpus is empty and {prefix}.url is not set: give one of them")
        _positive_seconds(f"{prefix}.timeout_s", self.timeout_s)
        _positive_seconds(f"{prefix}.health_timeout_s", self.health_timeout_s)
        _positive_int(f"{prefix}.retries", self.retries, minimum=0)
        _positive_int(f"{prefix}.topk", self.topk)
        if self.url:
            _check_url(f"{prefix}.url", self.url)


@dataclass
class DataConfig:
    train: str = ""  # the training parquet file (verl / Search-R1 rows); required
    val: Optional[str] = ""  # empty or null (``data.val=``): no validation
    max_prompt_tokens: int = 256  # longer prompts are an error naming the row; < rollout.max_total_tokens
    shuffle: bool = True  # a new order of data.train each epoch (seeded: schedule.seed, epoch); false: file order
    # rows each validation plays (0: all): a fixed seeded sample of the validation split, the same
    # at every evaluation, so a 51,713-row split does not stall the run at each val_every
    val_max_rows: int = 0

    def validate(self, prefix: str = "data") -> None:
        if not self.train:
            raise RecipeError(f"{prefix}.train is empty: give the training parquet file")
        _positive_int(f"{prefix}.max_prompt_tokens", self.max_prompt_tokens)
        _positive_int(f"{prefix}.val_max_rows", self.val_max_rows, minimum=0)


@dataclass
class OptimizerConfig(OptimConfig):
    """The engine's optimizer config (one owner of every optimizer field) plus the critic's.

    ``warmup_steps`` counts optimizer steps (batch x group / mini_batch x ppo_epochs per RL
    step), not RL steps; ``decay_steps`` (null) is derived from the run's length.
    """

    critic_lr: float = 1e-5  # the critic's peak learning rate (gae; the actor's schedule); > 0
    critic_warmup_steps: Optional[int] = None  # None: warmup_steps

    def validate(self, prefix: str = "optimizer") -> None:
        super().validate(prefix)
        if not (isinstance(self.critic_lr, (int, float)) and math.isfinite(self.critic_lr) and self.critic_lr > 0):
            raise RecipeError(f"{prefix}.critic_lr must be finite and > 0, got {self.critic_lr}")
        if self.critic_warmup_steps is not None and self.critic_warmup_steps < 0:
            raise RecipeError(f"{prefix}.critic_warmup_steps must be >= 0, got {self.critic_warmup_steps}")

    def actor(self, optimizer_steps: int) -> OptimConfig:
        """The actor's engine config for a run of ``optimizer_steps`` optimizer steps (a
        decaying schedule ends there unless ``decay_steps`` is set)."""
        decay = self.decay_steps
        if decay is None and self.lr_schedule != "constant":
            decay = optimizer_steps
        return self._engine_config(decay_steps=decay)

    def critic(self, optimizer_steps: int) -> OptimConfig:
        """The critic's: ``critic_lr``, ``critic_warmup_steps`` (default: the actor's warm-up)."""
        warmup = self.warmup_steps if self.critic_warmup_steps is None else self.critic_warmup_steps
        return dataclasses.replace(
            self.actor(optimizer_steps), lr=self.critic_lr, min_lr=min(self.min_lr, self.critic_lr), warmup_steps=warmup
        )

    def _engine_config(self, **changes: Any) -> OptimConfig:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(OptimConfig)}
        return OptimConfig(**{**fields, **changes})


@dataclass
class ScheduleConfig:
    """Batch geometry. ``batch_size`` prompts x ``group_size`` trajectories are split into
    mini-batches of ``mini_batch_size`` trajectories (one optimizer step each), each over
    ``ppo_epochs`` epochs: batch/mini-batch > 1 or epochs > 1 is off-policy (SORL A.5).

    ``pack_sequences`` packs trajectories back to back into rows of at most
    ``max_tokens_per_micro_batch`` tokens (default ``micro_batch_size`` x the batch's padded
    length), one packed row per micro-batch; ``max_tokens_per_micro_batch`` alone sets the
    micro-batch size in padded rows from the batch's length. Either way the work of a
    mini-batch is balanced over the DP ranks and its gradient is unchanged (docs/concepts/engine.md).

    ``old_logprobs_from_update``: the first mini-batch's own update forward gives its rows' old
    log-probs and the old pass forwards only the others (docs/concepts/engine.md; ``RLTrainer`` says
    where it does not apply)."""

    total_steps: int = 10  # RL steps of the run
    batch_size: int = 8  # prompts per RL step
    mini_batch_size: int = 16  # trajectories per optimizer step (all DP ranks); divides batch_size x rollout.group_size
    micro_batch_size: int = 4  # padded rows per forward/backward on one DP rank (above); fixed: divides mini_batch_size
    pack_sequences: bool = False  # one packed row of trajectories per micro-batch (above)
    max_tokens_per_micro_batch: Optional[int] = None  # a micro-batch's tokens (above); >= rollout.max_total_tokens
    ppo_epochs: int = 1  # passes of the actor's update over each batch
    critic_epochs: int = 1  # passes of the critic's update over each batch (gae)
    val_every: int = 5  # validate every K RL steps, before step 1 and after the last (0: only those two)
    seed: int = 1234  # seeds the prompt order, batch shuffles, SFT batches, the servers' sampling; in [0, 2^31 - 1]
    # (above) ignored with R2, with routes from the rollout (R3, route flips) and with FP8 forward-only passes
    old_logprobs_from_update: bool = True

    @property
    def fixed_micro_batches(self) -> bool:
        """Whether a micro-batch is ``micro_batch_size`` padded rows (no packing, no token budget)."""
        return self.max_tokens_per_micro_batch is None and not self.pack_sequences

    def validate(self, prefix: str = "schedule") -> None:
        for key in ("total_steps", "batch_size", "mini_batch_size", "micro_batch_size", "ppo_epochs", "critic_epochs"):
            _positive_int(f"{prefix}.{key}", getattr(self, key))
        _positive_int(f"{prefix}.val_every", self.val_every, minimum=0)
        # every RNG it seeds (data order, batch shuffles, SFT batches, the servers' sampling_seed, derived
        # per group and step) takes a 32-bit seed; a larger one crashed the embedded server
        if not 0 <= self.seed <= MAX_SEED:
            raise RecipeError(f"{prefix}.seed must be in [0, {MAX_SEED}], got {self.seed}")
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise RecipeError(f"{prefix}.max_tokens_per_micro_batch must be an integer or null, got {budget!r}")


@dataclass
class SFTConfig:
    """Cold-start supervised stage on gold trajectories, before RL."""

    enabled: bool = False  # RL then starts from this stage's policy, <logging.dir>/<logging.run_name>/sft_model
    steps: int = 100  # SFT optimizer steps
    lr: float = 1e-3  # the SFT stage's LR: constant, no warm-up (optimizer.clip_grad applies); > 0
    batch_size: int = 16  # gold trajectories per optimizer step
    # the SFT engine's micro-batches, None = the schedule's (schedule.micro_batch_size /
    # pack_sequences); the CPU demo packs its whole SFT batch into one row, its fastest SFT step
    micro_batch_size: Optional[int] = None
    pack_sequences: Optional[bool] = None  # None: schedule.pack_sequences
    # a resumable checkpoint every K steps into <checkpoint.dir>/sft/step_K (0 = none: an interrupted
    # SFT starts over); checkpoint.keep_last applies, and they are removed once sft_model is written
    save_every: int = 200
    # this fraction of the demonstrations answers at once with a guess instead of searching
    # (data.gold.cold_start_plans): RL must learn that searching pays (the CPU demo)
    direct_answer_fraction: float = 0.0

    def validate(self, prefix: str = "sft") -> None:
        _check_finite(self, prefix)
        if self.lr <= 0:
            raise RecipeError(f"{prefix}.lr must be > 0, got {self.lr}")
        if not self.enabled:
            return
        _positive_int(f"{prefix}.steps", self.steps)
        _positive_int(f"{prefix}.batch_size", self.batch_size)
        if self.micro_batch_size is not None:
            _positive_int(f"{prefix}.micro_batch_size", self.micro_batch_size)
        _positive_int(f"{prefix}.save_every", self.save_every, minimum=0)
        if not 0 <= self.direct_answer_fraction < 1:
            raise RecipeError(f"{prefix}.direct_answer_fraction must be in [0, 1), got {self.direct_answer_fraction}")

    def batching(self, schedule: ScheduleConfig) -> BatchingConfig:
        """The SFT engine's batching: ``batch_size`` rows per optimizer step, micro-batched by
        this section's keys where set, else by the schedule's."""
        pack = schedule.pack_sequences if self.pack_sequences is None else self.pack_sequences
        return BatchingConfig(mini_batch_size=self.batch_size,
                              micro_batch_size=self.micro_batch_size or schedule.micro_batch_size,
                              pack_sequences=pack, max_tokens_per_micro_batch=schedule.max_tokens_per_micro_batch)


@dataclass
class RewardConfig:
    """Rule rewards by each row's ``data_source`` (rewards/registry.py)."""

    metric: Optional[Literal["em", "f1"]] = None  # None: each data_source's own metric (EM for the QA sets)
    format_weight: float = 0.0  # (1 - w) x metric + w x well-formed response

    def validate(self, prefix: str = "reward") -> None:
        _check_finite(self, prefix)
        if not 0 <= self.format_weight <= 1:
            raise RecipeError(f"{prefix}.format_weight must be in [0, 1], got {self.format_weight}")


RESUME_MODES = ("auto", "none")


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # None or empty: <logging.dir>/<logging.run_name>/checkpoints
    save_every: int = 0  # 0 = only at the end
    resume: str = "auto"  # auto | none | a checkpoint directory
    keep_last: int = 2  # newest complete checkpoints kept at each save, RL's and SFT's (0 = all)

    def validate(self, prefix: str = "checkpoint") -> None:
        _positive_int(f"{prefix}.save_every", self.save_every, minimum=0)
        _positive_int(f"{prefix}.keep_last", self.keep_last, minimum=0)
        self._check_resume(prefix)

    def _check_resume(self, prefix: str) -> None:
        """``auto``, ``none`` or something that looks like a path: a bare word that is neither (a
        typo of auto) must not silently become a relative directory that is then not found."""
        resume = self.resume
        if not resume.strip():
            raise RecipeError(f"{prefix}.resume is empty: give auto, none or a checkpoint directory")
        if resume in RESUME_MODES or os.sep in resume or "/" in resume or Path(resume).exists():
            return
        close = difflib.get_close_matches(resume.lower(), RESUME_MODES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else " (write ./NAME for a directory here)"
        raise RecipeError(f"{prefix}.resume: {resume!r} is not auto, none or a checkpoint directory{hint}")


@dataclass
class WandbConfig:
    """Weights & Biases logging (the optional ``wandb`` package: ``pip install -e '.[wandb]'``),
    beside the JSONL and TensorBoard logs. One W&B run per training run, its SFT curve
    included; a resumed run continues its W&B run."""

    mode: Literal["online", "offline", "disabled"] = "disabled"  # wandb.init's mode; disabled: no W&B run
    project: str = "sorl-megatron"  # the W&B project; not empty (unless disabled)
    entity: Optional[str] = None  # None: the account's default entity
    name: Optional[str] = None  # None: logging.run_name
    init_timeout_s: float = 90.0  # the longest wait for wandb.init (online: the W&B server)

    def validate(self, prefix: str = "wandb") -> None:
        _check_finite(self, prefix)
        if self.mode == "disabled":
            return
        if not self.project.strip():
            raise RecipeError(f"{prefix}.project is empty")
        _positive_seconds(f"{prefix}.init_timeout_s", self.init_timeout_s)
        if importlib.util.find_spec("wandb") is None:
            raise RecipeError(f"{prefix}.mode={self.mode} needs the wandb package: pip install -e '.[wandb]' "
                              "(or pip install wandb)")


@dataclass
class LoggingConfig:
    dir: str = "runs"  # the parent of run directories: a run's is <logging.dir>/<logging.run_name>
    run_name: str = "run"  # the run directory's name: one path component, at most 200 bytes
    tensorboard: bool = True  # also log the metrics and histograms to the run directory's tensorboard/
    # tqdm: a progress bar (plain where stderr is not a terminal); plain: a line per step; none: no progress
    progress: Literal["tqdm", "plain", "none"] = "tqdm"
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self, prefix: str = "logging") -> None:
        _check_run_name(self.run_name, prefix)
        self.wandb.validate(f"{prefix}.wandb")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelLayout = field(default_factory=ParallelLayout)  # the engines' layout itself
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        if not self.checkpoint.dir:
            # one checkpoint directory per run: resume=auto never picks up another run's steps
            self.checkpoint.dir = str(Path(self.logging.dir) / self.logging.run_name / "checkpoints")
        self.validate()

    def validate(self) -> None:
        """Each section's own checks, then the rules between sections. (The optimizer section
        and algorithm.loss check themselves when built, as the engine's and the loss's configs.)"""
        self.model.validate()
        _check_parallelism(self.parallelism)
        self.algorithm.validate()
        self.rollout.validate()
        self.retrieval.validate()
        self.data.validate()
        self.schedule.validate()
        self.sft.validate()
        self.reward.validate()
        self.checkpoint.validate()
        self.logging.validate()
        check_maxima(self)  # every wait and retry count at most its maximum (bounds.py)
        if self.data.max_prompt_tokens >= self.rollout.max_total_tokens:
            raise RecipeError(
                f"data.max_prompt_tokens={self.data.max_prompt_tokens} must be < rollout.max_total_tokens="
                f"{self.rollout.max_total_tokens} (a prompt that long leaves no room for the policy's turns)"
            )
        self._check_modes()
        self._check_batches()

    def _check_batches(self) -> None:
        """The batch of trajectories splits into mini-batches, a mini-batch and the SFT batch
        into micro-batches that hold the longest trajectory, and grpo has a group to compare.
        The micro-batch rule (the schedule's own) comes after the mini-batch one, so that a
        mini-batch size that does not divide the batch is named for that."""
        s = self.schedule
        trajectories = s.batch_size * self.rollout.group_size
        if trajectories % s.mini_batch_size:
            raise RecipeError(
                f"schedule.mini_batch_size={s.mini_batch_size} must divide "
                f"schedule.batch_size x rollout.group_size = {trajectories}"
            )
        budget = s.max_tokens_per_micro_batch
        if budget is not None and budget < self.rollout.max_total_tokens:
            raise RecipeError(
                f"schedule.max_tokens_per_micro_batch={budget} must be >= rollout.max_total_tokens="
                f"{self.rollout.max_total_tokens}: a trajectory is never split across micro-batches"
            )
        if s.fixed_micro_batches and s.mini_batch_size % s.micro_batch_size:
            raise RecipeError(f"schedule.micro_batch_size={s.micro_batch_size} must divide "
                              f"schedule.mini_batch_size={s.mini_batch_size}")
        sft = self.sft.batching(s) if self.sft.enabled else None  # a disabled section may hold anything
        padded_rows = sft and not (sft.pack_sequences or sft.max_tokens_per_micro_batch)
        if padded_rows and self.sft.batch_size % sft.micro_batch_size:
            key = "sft.micro_batch_size" if self.sft.micro_batch_size else "schedule.micro_batch_size"
            raise RecipeError(f"{key}={sft.micro_batch_size} must divide sft.batch_size={self.sft.batch_size}")
        if self.algorithm.advantage.estimator == "grpo" and self.rollout.group_size < 2:
            raise RecipeError("algorithm.advantage.estimator=grpo needs rollout.group_size >= 2")

    @property
    def rollout_routes(self) -> bool:
        """Whether the rollout returns its routed experts: R3 replays them; with the route-flip
        injector on, the trainer compares them with its own (``mismatch/route_flip_rate``)."""
        return self.algorithm.routing_replay == "r3" or self.rollout.inject.route_flip_fraction > 0

    def _check_modes(self) -> None:
        """What the rollout mode and dynamic sampling ask of the loss and the batch."""
        r = self.rollout
        r.mode_settings.check_run_length("rollout", self.schedule.total_steps)
        keeps_stale = r.mode_settings.stale and r.staleness.stale_groups == "keep"
        if keeps_stale and self.algorithm.loss.is_correction.mode == "off":
            raise RecipeError("rollout.staleness.stale_groups=keep trains on groups beyond rollout.staleness.max with "
                              "the IS correction of their behaviour log-probs: set algorithm.loss.is_correction.mode "
                              "(tis or mis), or drop them (rollout.staleness.stale_groups=drop)")
        if r.dynamic_sampling_max_groups and r.dynamic_sampling_max_groups < self.schedule.batch_size:
            raise RecipeError(f"rollout.dynamic_sampling_max_groups={r.dynamic_sampling_max_groups} must be 0 or "
                              f">= schedule.batch_size={self.schedule.batch_size}")


CONFIG_GROUPS: dict[str, str] = {
    "model": "HF checkpoint of the policy / critic, dtype, fp8 (TransformerEngine FP8 on GPU), offload_idle, "
             "config_for_planning",
    "parallelism": "tp, pp, vpp, ep, etp, cp, sequence_parallel, first_stage_layers / last_stage_layers (uneven PP), "
                   "collective_timeout_s, rank0_phase_timeout_s, gpu_memory_gib, recompute, planned_world_size",
    "algorithm": (
        "loss (name, clip, aggregation, KL, entropy, clip_bias, sapo, is_correction), advantage, "
        "routing_replay, value_clip, pvpo"
    ),
    "rollout": "SGLang URLs, precision, group size, sampling, turns and lengths; weight_sync (transport, buckets, "
    "timeouts), fleet (embedded servers, sglang-router, failover and restarts), mode with staleness / lagged / async",
    "retrieval": "retrieval URL (or embedded BM25 corpus), top-k",
    "data": "train / val files (Search-R1 / verl parquet), prompt length, val_max_rows",
    "optimizer": "lr, critic_lr, Adam, grad clipping, warm-up and LR schedule, distributed optimizer",
    "schedule": "steps, batch / mini-batch / micro-batch sizes, sequence packing and token budget, ppo_epochs, "
    "validation period, seed",
    "sft": "cold-start supervised stage (steps, lr, batch size, save_every: resumable SFT checkpoints)",
    "reward": "metric override (em / f1; default: each data_source's own), format weight",
    "checkpoint": "directory (default <logging.dir>/<run_name>/checkpoints), period, resume=auto|none|DIR",
    "logging": "run directory and name, TensorBoard, progress bar, wandb (mode online/offline/disabled, project, ...)",
}
