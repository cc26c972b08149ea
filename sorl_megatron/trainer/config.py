"""The typed schema of a training recipe, and the recipe loader.

A recipe is NeMo-style OmegaConf YAML: an optional ``defaults:`` recipe or list of recipes
(paths relative to the file, ``.yaml`` optional) merged in order, then the file itself, then
dotted command-line overrides (``algorithm.loss.name=so_grpo``, or Hydra's ``+key=value`` /
``++key=value`` as NeMo-RL writes them). The merged tree is checked
against the dataclasses below before any process starts: unknown keys (with a
did-you-mean), wrong types, non-finite numbers (YAML's ``.nan`` / ``.inf``), values out of
range, malformed URLs and impossible layouts or batch sizes are errors naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Sequence
from urllib.parse import urlsplit

from ..algorithms.advantages import ADVANTAGE_ESTIMATORS
from ..algorithms.config import PolicyLossConfig
from ..algorithms.loss_registry import POLICY_LOSSES
from ..bridge.layout import ParallelLayout, num_experts_of
from ..common.typed_config import ConfigError, build_dataclass, to_dict
from ..engine.config import OptimConfig


@dataclass
class ModelConfig:
    """HF checkpoint of the policy (and the critic's initialization)."""

    path: str = ""
    critic_path: Optional[str] = None  # default: same as `path`
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: float32 on CPU, bfloat16 on GPU


@dataclass
class AdvantageConfig:
    """A registered estimator (``algorithms.advantages.ADVANTAGE_ESTIMATORS``): gae (with a
    critic), grpo (group normalization) or pvpo (static V, PVPO eq. 10)."""

    estimator: str = "gae"  # the default loss (ppo) is defined on a critic's advantages
    gamma: float = 1.0
    lam: float = 1.0
    normalize_std: bool = True  # grpo only
    whiten: bool = False


@dataclass
class PVPOConfig:
    """PVPO group sampling: M reference rollouts per prompt before training."""

    num_ref_rollouts: int = 5  # M
    refresh_every: int = 0  # refresh static V every K steps (0 = never)
    refresh_at: list[int] = field(default_factory=list)  # and/or at these steps (PVPO table 2: [500])

    def refresh_due(self, step: int) -> bool:
        """Whether static V is refreshed before RL step ``step`` (0-based; never before step 1)."""
        return step > 0 and (step in self.refresh_at or (self.refresh_every > 0 and step % self.refresh_every == 0))
    drop_solved: bool = True  # drop prompts with reference accuracy 1
    inject_ground_truth: bool = False  # replace one rollout of accuracy-0 prompts by a GT trajectory


@dataclass
class AlgorithmConfig:
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    routing_replay: Literal["off", "r2", "r3"] = "off"
    value_clip: Optional[float] = 0.2  # clipped value loss range; null = unclipped
    pvpo: PVPOConfig = field(default_factory=PVPOConfig)


@dataclass
class RolloutConfig:
    """Multi-turn generation. No URLs = start the embedded CPU server."""

    urls: list[str] = field(default_factory=list)
    # embedded server: the precision it generates in; external servers (urls): fp8 makes each
    # weight sync export FP8-quantized weights (launch SGLang with --quantization fp8)
    precision: Literal["fp32", "bf16", "fp8"] = "fp32"
    group_size: int = 4  # n rollouts per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_turns: int = 3
    max_turn_tokens: int = 64
    max_total_tokens: int = 512
    max_obs_tokens: int = 128
    concurrency: int = 16
    # embedded servers decode each row alone (--enable-deterministic-inference): a seeded episode
    # gets the same tokens whatever else is in flight, so a run repeats on its machine at any
    # load; costs the batching speed-up (docs/rollout.md). External servers: SGLang's own flag.
    deterministic: bool = False
    # Every wait on the servers is bounded here (see docs/rollout.md, failure model): seconds
    # per /generate call (a timed-out call is not retried) ...
    timeout_s: float = 120.0
    # ... per weight-sync call (one bucket, begin/end, a reload from disk) and other control call ...
    weight_sync_timeout_s: float = 600.0
    # ... per GET /health, asked before each phase (rollout, weight sync, validation, PVPO pass)
    health_timeout_s: float = 10.0
    retries: int = 2  # extra attempts after a refused connection or a 5xx answer (never after a timeout)
    # distributed: SGLang's /update_weights_from_distributed (a gloo/NCCL group with the servers;
    # each pipeline stage and expert owner sends its own tensors); tensor: HTTP bodies from rank 0
    # (embedded servers only); disk: an HF checkpoint the servers reload (docs/rollout.md)
    weight_sync: Literal["distributed", "tensor", "disk"] = "distributed"
    weight_sync_bucket_mb: int = 512  # tensors per /update_weights_from_distributed (a larger one goes alone)
    # bound on forming the weight-update group and on each broadcast in it
    weight_sync_init_timeout_s: float = 120.0
    # the address the servers reach the sending ranks at (null: the route towards the first server)
    weight_sync_master_address: Optional[str] = None
    # The fleet (docs/rollout.md, "A fleet of servers"): embedded servers to start (no urls) ...
    num_servers: int = 1
    # ... the real sglang-router in front of them (or of `urls`), started by the trainer unless
    # router_url names one already running in front of `urls` ...
    router: Literal["none", "sglang_router"] = "none"
    router_url: Optional[str] = None
    router_policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = "cache_aware"
    # cache_aware balances (shortest queue) when in-flight calls differ by more than this between
    # servers (and by 1.5x); sglang-router's own default, 64, is for GPU servers: at rollout
    # concurrencies below it every call would go to one server
    router_balance_abs_threshold: int = 4
    # ... the longest wait for an embedded server or router to start (and restart) ...
    start_timeout_s: float = 300.0
    # ... and what a server that dies or hangs mid-step costs: each /generate call it failed is sent
    # again to the others at most this many times; embedded servers are restarted; external ones
    # get this operator command (run with $SORL_FAILED_SERVER_URL; not waited for)
    failover_retries: int = 2
    restart_servers: bool = True
    restart_command: Optional[str] = None
    # Rollout modes (docs/rollout.md, "Rollout modes"): sync generates each step's batch with
    # the step's own weights; one_step_off generates step k+1's batch while step k trains, on
    # the weights step k started from (a lag of exactly one version); async keeps episodes in
    # flight across weight updates (partial rollouts) and trains on finished groups whose oldest
    # token is at most max_staleness versions behind the trainer ...
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    max_staleness: int = 1
    # ... and what happens to a group beyond it: dropped (and replaced), or kept: trained with the
    # IS correction of algorithm.loss.is_correction on its true behaviour log-probs
    stale_groups: Literal["drop", "keep"] = "drop"
    # async: SGLang's /pause_generation mode around each weight update (off: never pause; a server
    # without the endpoint answers 404 and the update lands between its requests)
    pause_mode: Literal["retract", "in_place", "off"] = "retract"
    # DAPO dynamic sampling: a group whose rewards are all equal (no GRPO signal) is dropped and
    # replaced by a fresh prompt's group until the batch is full; at most this many groups are
    # drawn per step (0: 4 x schedule.batch_size), then dropped groups fill the rest
    dynamic_sampling: bool = False
    dynamic_sampling_max_groups: int = 0
    # episodes cut by rollout.max_total_tokens (finish_reason max_length): keep, filter (loss mask
    # zeroed) or penalty (DAPO's soft overlong punishment: the reward falls linearly by up to
    # overlong_penalty over the last overlong_buffer tokens of the budget, and by all of it when cut)
    overlong: Literal["keep", "filter", "penalty"] = "keep"
    overlong_buffer: int = 64
    overlong_penalty: float = 1.0


@dataclass
class RetrievalConfig:
    """No URL = start the embedded BM25 server over `corpus`."""

    url: Optional[str] = None
    corpus: str = ""
    topk: int = 3
    timeout_s: float = 30.0  # per /retrieve call (not retried after a timeout: a hung server fails after this)
    health_timeout_s: float = 10.0  # per GET /health, asked before each rollout phase
    retries: int = 2  # extra attempts after a refused connection or a 5xx answer


@dataclass
class DataConfig:
    train: str = ""
    val: Optional[str] = ""  # empty or null (``data.val=``): no validation
    max_prompt_tokens: int = 256  # longer prompts are an error naming the row; < rollout.max_total_tokens
    shuffle: bool = True


@dataclass
class OptimizerConfig(OptimConfig):
    """The engine's optimizer config (one owner of every optimizer field) plus the critic's.

    ``warmup_steps`` counts optimizer steps (batch x group / mini_batch x ppo_epochs per RL
    step), not RL steps; ``decay_steps`` (null) is derived from the run's length.
    """

    critic_lr: float = 1e-5
    critic_warmup_steps: Optional[int] = None  # None: warmup_steps

    def validate(self, prefix: str = "optimizer") -> None:
        super().validate(prefix)
        if not (isinstance(self.critic_lr, (int, float)) and math.isfinite(self.critic_lr) and self.critic_lr > 0):
            raise ValueError(f"{prefix}.critic_lr must be finite and > 0, got {self.critic_lr}")
        if self.critic_warmup_steps is not None and self.critic_warmup_steps < 0:
            raise ValueError(f"{prefix}.critic_warmup_steps must be >= 0, got {self.critic_warmup_steps}")

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
    mini-batch is balanced over the DP ranks and its gradient is unchanged (docs/engine.md)."""

    total_steps: int = 10
    batch_size: int = 8
    mini_batch_size: int = 16
    micro_batch_size: int = 4
    pack_sequences: bool = False
    max_tokens_per_micro_batch: Optional[int] = None
    ppo_epochs: int = 1
    critic_epochs: int = 1
    val_every: int = 5
    seed: int = 1234


@dataclass
class SFTConfig:
    """Cold-start supervised stage on gold trajectories, before RL."""

    enabled: bool = False
    steps: int = 100
    lr: float = 1e-3
    batch_size: int = 16  # gold trajectories per optimizer step
    # this fraction of the demonstrations answers at once with a guess instead of searching
    # (data.gold.cold_start_plans): RL must learn that searching pays (the CPU demo)
    direct_answer_fraction: float = 0.0


@dataclass
class RewardConfig:
    """Rule rewards by each row's ``data_source`` (rewards/registry.py)."""

    metric: Optional[Literal["em", "f1"]] = None  # None: each data_source's own metric (EM for the QA sets)
    format_weight: float = 0.0  # (1 - w) x metric + w x well-formed response


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # None or empty: <logging.dir>/<logging.run_name>/checkpoints
    save_every: int = 0  # 0 = only at the end
    resume: str = "auto"  # auto | none | a checkpoint directory
    keep_last: int = 2


@dataclass
class WandbConfig:
    """Weights & Biases logging (the optional ``wandb`` package: ``pip install -e '.[wandb]'``),
    beside the JSONL and TensorBoard logs. One W&B run per training run, its SFT curve
    included; a resumed run continues its W&B run."""

    mode: Literal["online", "offline", "disabled"] = "disabled"
    project: str = "sorl-megatron"
    entity: Optional[str] = None  # None: the account's default entity
    name: Optional[str] = None  # None: logging.run_name
    init_timeout_s: float = 90.0  # the longest wait for wandb.init (online: the W&B server)


@dataclass
class LoggingConfig:
    dir: str = "runs"
    run_name: str = "run"
    tensorboard: bool = True
    progress: Literal["tqdm", "plain", "none"] = "tqdm"
    wandb: WandbConfig = field(default_factory=WandbConfig)


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
        _check_values(self)


CONFIG_GROUPS: dict[str, str] = {
    "model": "HF checkpoint of the policy / critic and dtype",
    "parallelism": "tp, pp, vpp, ep, etp, cp, sequence_parallel, first_stage_layers / last_stage_layers (uneven PP)",
    "algorithm": (
        "loss (name, clip, aggregation, KL, entropy, clip_bias, sapo, is_correction), advantage, "
        "routing_replay, value_clip, pvpo"
    ),
    "rollout": "SGLang URLs (or embedded servers), sglang-router, failover and restarts, precision, group size, "
    "sampling, turns and lengths",
    "retrieval": "retrieval URL (or embedded BM25 corpus), top-k",
    "data": "train / val files (Search-R1 / verl parquet), prompt length",
    "optimizer": "lr, critic_lr, Adam, grad clipping, warm-up and LR schedule, distributed optimizer",
    "schedule": "steps, batch / mini-batch / micro-batch sizes, sequence packing and token budget, ppo_epochs, "
    "validation period, seed",
    "sft": "cold-start supervised stage",
    "reward": "metric override (em / f1; default: each data_source's own), format weight",
    "checkpoint": "directory (default <logging.dir>/<run_name>/checkpoints), period, resume=auto|none|DIR",
    "logging": "run directory and name, TensorBoard, progress bar, wandb (mode online/offline/disabled, project, ...)",
}


def _positive_int(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


def _check_loss_and_estimator(loss: str, estimator: str) -> None:
    """The estimator exists and gives the advantages the loss is defined on (a critic's for
    the PPO family, outcome-based ones for the group-relative losses)."""
    spec = ADVANTAGE_ESTIMATORS.get(estimator)
    if spec is None:
        raise ConfigError(
            f"algorithm.advantage.estimator: unknown estimator {estimator!r}; "
            f"registered: {sorted(ADVANTAGE_ESTIMATORS)}"
        )
    if POLICY_LOSSES[loss].critic != spec.critic:
        wants = "a critic's advantages (gae)" if POLICY_LOSSES[loss].critic else "outcome-based advantages"
        fitting = sorted(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.critic == POLICY_LOSSES[loss].critic)
        raise ConfigError(
            f"algorithm.loss.name={loss} is defined on {wants} but algorithm.advantage.estimator={estimator} "
            f"{'needs' if spec.critic else 'has'} {'a critic' if spec.critic else 'no critic'}: "
            f"use algorithm.advantage.estimator in {fitting}"
        )


def _check_finite(obj: Any, prefix: str = "") -> None:
    """Every number in the recipe is finite: YAML reads ``.nan`` / ``.inf`` as floats, and a
    NaN passes every ``<`` / ``>`` range check after this one."""
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_finite(value, key)
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(f"{key if i is None else f'{key}[{i}]'} must be a finite number, got {item}")


def _in_range(key: str, value: float, low: float, high: float, high_open: bool = False) -> None:
    if not (low <= value < high if high_open else low <= value <= high):
        raise ConfigError(f"{key} must be in [{low:g}, {high:g}{')' if high_open else ']'}, got {value}")


def _check_url(key: str, url: str) -> None:
    """An http(s) URL with a host (the rollout / retrieval servers speak HTTP)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port out of range or not a number
    except ValueError as err:
        raise ConfigError(f"{key}: {url!r} is not a valid URL ({err})") from None
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host or any(c.isspace() for c in url):
        raise ConfigError(f"{key}: {url!r} is not an http(s) URL with a host, e.g. http://127.0.0.1:30000")


def _check_fleet(r: RolloutConfig) -> None:
    """The fleet keys (servers, router, restarts) fit together."""
    _positive_int("rollout.num_servers", r.num_servers)
    _positive_int("rollout.failover_retries", r.failover_retries, minimum=0)
    _positive_int("rollout.router_balance_abs_threshold", r.router_balance_abs_threshold, minimum=0)
    if r.urls and r.num_servers != 1:
        raise ConfigError(f"rollout.num_servers={r.num_servers} starts embedded servers, but rollout.urls lists "
                          "external ones: give one or the other")
    if r.router_url is not None:
        _check_url("rollout.router_url", r.router_url)
        if r.router != "sglang_router":
            raise ConfigError(
                f"rollout.router_url is set but rollout.router={r.router}: set rollout.router=sglang_router")
        if not r.urls:
            raise ConfigError("rollout.router_url needs rollout.urls: the workers behind it, which get the weight "
                              "updates, flush_cache and health checks (generation goes through the router)")
    elif r.router == "sglang_router":
        import importlib.util

        if importlib.util.find_spec("sglang_router") is None:
            raise ConfigError("rollout.router=sglang_router needs the sglang-router package to start the router: "
                              "pip install sglang-router (or give rollout.router_url of a running one)")
    if r.deterministic and r.urls:
        raise ConfigError("rollout.deterministic is for embedded servers; launch external SGLang servers with "
                          "--enable-deterministic-inference instead")
    if r.restart_command is not None:
        if not r.urls:
            raise ConfigError("rollout.restart_command is for external servers (rollout.urls); the trainer restarts "
                              "its embedded servers itself (rollout.restart_servers)")
        try:
            words = shlex.split(r.restart_command)
        except ValueError as err:
            raise ConfigError(f"rollout.restart_command: {r.restart_command!r} is not a command line ({err})") from None
        if not words:
            raise ConfigError("rollout.restart_command is empty: give a command or leave it null")


RESUME_MODES = ("auto", "none")


def _check_modes(cfg: TrainConfig) -> None:
    """The rollout mode, staleness, dynamic sampling and overlong options."""
    r = cfg.rollout
    _positive_int("rollout.max_staleness", r.max_staleness, minimum=0)
    _positive_int("rollout.dynamic_sampling_max_groups", r.dynamic_sampling_max_groups, minimum=0)
    _positive_int("rollout.overlong_buffer", r.overlong_buffer)
    if r.overlong_buffer >= r.max_total_tokens:
        raise ConfigError(f"rollout.overlong_buffer={r.overlong_buffer} must be < rollout.max_total_tokens="
                          f"{r.max_total_tokens}")
    if r.overlong_penalty < 0:
        raise ConfigError(f"rollout.overlong_penalty must be >= 0, got {r.overlong_penalty}")
    if r.mode == "one_step_off" and r.max_staleness < 1:
        raise ConfigError("rollout.mode=one_step_off trains on batches one weight version old: "
                          "rollout.max_staleness must be >= 1")
    if r.mode == "async" and r.max_staleness < 1:
        raise ConfigError("rollout.mode=async with rollout.max_staleness=0 would drop every group that was in "
                          "flight at a weight update: use rollout.mode=sync, or max_staleness >= 1")
    if r.mode != "sync" and r.stale_groups == "keep" and cfg.algorithm.loss.is_correction.mode == "off":
        raise ConfigError("rollout.stale_groups=keep trains on groups beyond rollout.max_staleness with the IS "
                          "correction of their behaviour log-probs: set algorithm.loss.is_correction.mode "
                          "(tis or mis), or drop them (rollout.stale_groups=drop)")
    if r.dynamic_sampling_max_groups and r.dynamic_sampling_max_groups < cfg.schedule.batch_size:
        raise ConfigError(f"rollout.dynamic_sampling_max_groups={r.dynamic_sampling_max_groups} must be 0 or "
                          f">= schedule.batch_size={cfg.schedule.batch_size}")


def _check_resume(resume: str) -> None:
    """``auto``, ``none`` or something that looks like a path: a bare word that is neither (a
    typo of auto) must not silently become a relative directory that is then not found."""
    if not resume.strip():
        raise ConfigError("checkpoint.resume is empty: give auto, none or a checkpoint directory")
    if resume in RESUME_MODES or os.sep in resume or "/" in resume or Path(resume).exists():
        return
    close = difflib.get_close_matches(resume.lower(), RESUME_MODES, n=1)
    hint = f" (did you mean {close[0]}?)" if close else " (write ./NAME for a directory here)"
    raise ConfigError(f"checkpoint.resume: {resume!r} is not auto, none or a checkpoint directory{hint}")


def _check_wandb(w: WandbConfig) -> None:
    if w.mode == "disabled":
        return
    if not w.project.strip():
        raise ConfigError("logging.wandb.project is empty")
    if not w.init_timeout_s > 0:
        raise ConfigError(f"logging.wandb.init_timeout_s must be > 0 seconds, got {w.init_timeout_s}")
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"logging.wandb.mode={w.mode} needs the wandb package: pip install -e '.[wandb]' (or pip install wandb)"
        )


def _check_values(cfg: TrainConfig) -> None:
    _check_finite(cfg)
    if not cfg.model.path:
        raise ConfigError("model.path is empty: give the policy's HF model directory")
    if not cfg.data.train:
        raise ConfigError("data.train is empty: give the training parquet file")
    if not cfg.retrieval.url and not cfg.retrieval.corpus:
        raise ConfigError("retrieval.corpus is empty and retrieval.url is not set: give one of them")
    p = cfg.parallelism
    for key in ("tp", "pp", "vpp", "ep"):
        _positive_int(f"parallelism.{key}", getattr(p, key))
    if p.etp is not None:
        _positive_int("parallelism.etp", p.etp)
    if p.vpp > 1 and p.pp == 1:  # the rule of bridge/layout.py validate_layout
        raise ConfigError(f"parallelism.vpp={p.vpp} needs parallelism.pp > 1 (interleaving splits pipeline stages)")
    for key in ("first_stage_layers", "last_stage_layers"):
        if getattr(p, key) is not None:
            _positive_int(f"parallelism.{key}", getattr(p, key))
            if p.pp == 1:
                raise ConfigError(f"parallelism.{key}={getattr(p, key)} needs parallelism.pp > 1 "
                                  "(it sizes the first / last pipeline stage)")
    s = cfg.schedule
    for key in ("total_steps", "batch_size", "mini_batch_size", "micro_batch_size", "ppo_epochs", "critic_epochs"):
        _positive_int(f"schedule.{key}", getattr(s, key))
    _positive_int("schedule.val_every", s.val_every, minimum=0)
    r = cfg.rollout
    for key in ("group_size", "max_turns", "max_turn_tokens", "max_total_tokens", "max_obs_tokens", "concurrency"):
        _positive_int(f"rollout.{key}", getattr(r, key))
    _positive_int("rollout.weight_sync_bucket_mb", r.weight_sync_bucket_mb)
    if r.weight_sync_master_address is not None and (
        not r.weight_sync_master_address or any(c.isspace() for c in r.weight_sync_master_address)
    ):
        raise ConfigError(
            "rollout.weight_sync_master_address must be a host name or IP address, "
            f"got {r.weight_sync_master_address!r}"
        )
    for key in ("rollout.timeout_s", "rollout.weight_sync_timeout_s", "rollout.health_timeout_s",
                "rollout.weight_sync_init_timeout_s", "rollout.start_timeout_s",
                "retrieval.timeout_s", "retrieval.health_timeout_s"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not value > 0:  # finite already (_check_finite)
            raise ConfigError(f"{key} must be > 0 seconds, got {value}")
    _positive_int("rollout.retries", r.retries, minimum=0)
    _positive_int("retrieval.retries", cfg.retrieval.retries, minimum=0)
    _positive_int("retrieval.topk", cfg.retrieval.topk)
    _positive_int("data.max_prompt_tokens", cfg.data.max_prompt_tokens)
    _positive_int("checkpoint.save_every", cfg.checkpoint.save_every, minimum=0)
    _positive_int("checkpoint.keep_last", cfg.checkpoint.keep_last, minimum=0)
    if not 0 <= cfg.reward.format_weight <= 1:
        raise ConfigError(f"reward.format_weight must be in [0, 1], got {cfg.reward.format_weight}")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {cfg.rollout.top_p}")
    if cfg.rollout.temperature <= 0:
        raise ConfigError(f"rollout.temperature must be > 0, got {cfg.rollout.temperature}")
    if r.top_k == 0 or r.top_k < -1:
        raise ConfigError(f"rollout.top_k must be -1 (off) or >= 1, got {r.top_k}")
    for key in ("max_obs_tokens", "max_turn_tokens"):
        if getattr(r, key) >= r.max_total_tokens:
            raise ConfigError(
                f"rollout.{key}={getattr(r, key)} must be < rollout.max_total_tokens={r.max_total_tokens}"
            )
    if cfg.data.max_prompt_tokens >= r.max_total_tokens:
        raise ConfigError(
            f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} must be < rollout.max_total_tokens="
            f"{r.max_total_tokens} (a prompt that long leaves no room for the policy's turns)"
        )
    for i, url in enumerate(r.urls):
        _check_url(f"rollout.urls[{i}]", url)
    _check_fleet(r)
    _check_modes(cfg)
    if cfg.retrieval.url:
        _check_url("retrieval.url", cfg.retrieval.url)
    _check_resume(cfg.checkpoint.resume)
    _check_wandb(cfg.logging.wandb)
    if cfg.sft.lr <= 0:
        raise ConfigError(f"sft.lr must be > 0, got {cfg.sft.lr}")
    trajectories = s.batch_size * cfg.rollout.group_size
    if trajectories % s.mini_batch_size:
        raise ConfigError(
            f"schedule.mini_batch_size={s.mini_batch_size} must divide "
            f"schedule.batch_size x rollout.group_size = {trajectories}"
        )
    fixed_micro = _check_token_budget(cfg)
    if fixed_micro and s.mini_batch_size % s.micro_batch_size:
        raise ConfigError(
            f"schedule.micro_batch_size={s.micro_batch_size} must divide schedule.mini_batch_size={s.mini_batch_size}"
        )
    if cfg.sft.enabled:
        _positive_int("sft.steps", cfg.sft.steps)
        _positive_int("sft.batch_size", cfg.sft.batch_size)
        if fixed_micro and cfg.sft.batch_size % s.micro_batch_size:
            raise ConfigError(
                f"schedule.micro_batch_size={s.micro_batch_size} must divide sft.batch_size={cfg.sft.batch_size}"
            )
        if not 0 <= cfg.sft.direct_answer_fraction < 1:
            raise ConfigError(f"sft.direct_answer_fraction must be in [0, 1), got {cfg.sft.direct_answer_fraction}")
    a = cfg.algorithm
    _check_loss_and_estimator(a.loss.name, a.advantage.estimator)
    _in_range("algorithm.advantage.gamma", a.advantage.gamma, 0, 1)
    _in_range("algorithm.advantage.lam", a.advantage.lam, 0, 1)
    if a.advantage.estimator == "grpo" and cfg.rollout.group_size < 2:
        raise ConfigError("algorithm.advantage.estimator=grpo needs rollout.group_size >= 2")
    if a.advantage.estimator == "pvpo":
        _positive_int("algorithm.pvpo.num_ref_rollouts", a.pvpo.num_ref_rollouts)
        _positive_int("algorithm.pvpo.refresh_every", a.pvpo.refresh_every, minimum=0)
        if any(k < 1 for k in a.pvpo.refresh_at):
            raise ConfigError(f"algorithm.pvpo.refresh_at steps must be >= 1, got {a.pvpo.refresh_at}")
    if a.value_clip is not None and a.value_clip <= 0:
        raise ConfigError(f"algorithm.value_clip must be > 0 or null, got {a.value_clip}")


def _check_token_budget(cfg: TrainConfig) -> bool:
    """``schedule.max_tokens_per_micro_batch`` holds the longest trajectory a rollout can make
    (one is never split); returns whether micro-batches are ``micro_batch_size`` padded rows."""
    s = cfg.schedule
    budget = s.max_tokens_per_micro_batch
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise ConfigError(f"schedule.max_tokens_per_micro_batch must be an integer or null, got {budget!r}")
        if budget < cfg.rollout.max_total_tokens:
            raise ConfigError(
                f"schedule.max_tokens_per_micro_batch={budget} must be >= rollout.max_total_tokens="
                f"{cfg.rollout.max_total_tokens}: a trajectory is never split across micro-batches"
            )
    return budget is None and not s.pack_sequences


def validate_layout_for_launch(cfg: TrainConfig, world_size: int) -> None:
    """Checks that need the world size and the model's HF config (heads, experts, layers).

    Reads ``<model.path>/config.json`` (and ``model.critic_path``'s when set): a missing one is
    an error. The layout rules are bridge/layout.py's ``validate_layout`` (the ones the
    engines apply when they build), run here before any process or server starts.
    """
    p = cfg.parallelism
    mp = p.tp * p.pp
    if world_size % mp:
        raise ConfigError(
            f"parallelism: tp x pp = {p.tp} x {p.pp} = {mp} does not divide the world size {world_size}"
        )
    models = [("model.path", cfg.model.path)]
    if cfg.model.critic_path and cfg.algorithm.advantage.estimator == "gae":
        models.append(("model.critic_path", cfg.model.critic_path))
    for key, path in models:
        hf_config = _load_hf_config(key, path)
        _check_model_layout(cfg, hf_config, key)
        _check_layout_rules(cfg, hf_config, key, world_size)
    dp = world_size // mp
    s = cfg.schedule
    if s.pack_sequences:
        return  # packed micro-batches are dealt to the DP ranks whatever the row count
    if s.max_tokens_per_micro_batch is not None:
        if s.mini_batch_size % dp:
            raise ConfigError(f"schedule.mini_batch_size={s.mini_batch_size} must be a multiple of the "
                              f"data-parallel size {dp} (token-budget micro-batches of padded rows)")
        return
    if s.mini_batch_size % (s.micro_batch_size * dp):
        raise ConfigError(
            f"schedule.mini_batch_size={s.mini_batch_size} must be a multiple of "
            "schedule.micro_batch_size x data-parallel size "
            f"= {s.micro_batch_size} x {dp}"
        )


def _load_hf_config(key: str, path: str):
    from ..bridge.hf_config import load_hf_config

    try:
        return load_hf_config(path)
    except FileNotFoundError as err:
        raise ConfigError(f"{key}: {err}") from None
    except (OSError, ValueError) as err:  # unreadable JSON, unknown model_type, rope scaling
        raise ConfigError(f"{key}: cannot use the HF config of {path} ({err})") from None


def _check_model_layout(cfg: TrainConfig, hf_config, key: str) -> None:
    """The common mistakes, with messages in config keys (validate_layout covers the rest)."""
    p = cfg.parallelism
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    layers = int(hf_config.num_hidden_layers)
    experts = num_experts_of(hf_config)
    if heads % p.tp or kv % p.tp:
        raise ConfigError(
            f"parallelism.tp={p.tp} does not divide the model's {heads} attention / {kv} KV heads ({key})"
        )
    vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
    if vocab % p.tp:
        # megatron shards the (unpadded) embedding and output layer over TP
        raise ConfigError(
            f"parallelism.tp={p.tp} does not divide the model's vocab_size {vocab} (pad the vocabulary; {key})"
        )
    if not p.uneven and layers % (p.pp * p.vpp):
        raise ConfigError(f"parallelism.pp x vpp = {p.pp * p.vpp} does not divide the model's {layers} layers "
                          f"({key}; uneven stages: parallelism.first_stage_layers / last_stage_layers)")
    if p.ep > 1 and experts == 0:
        raise ConfigError(f"parallelism.ep={p.ep} needs an MoE model; {key} is dense")
    if p.ep > 1 and experts % p.ep:
        raise ConfigError(f"parallelism.ep={p.ep} does not divide the model's {experts} experts ({key})")
    if key == "model.path" and cfg.algorithm.routing_replay != "off" and experts == 0:
        raise ConfigError(
            f"algorithm.routing_replay={cfg.algorithm.routing_replay} needs an MoE model; {cfg.model.path} is dense"
        )


def _check_layout_rules(cfg: TrainConfig, hf_config, key: str, world_size: int) -> None:
    """bridge/layout.py's rules (expert layout vs the world size, expert FFN vs ETP, ...)."""
    from ..bridge.layout import LayoutError, UnsupportedModelError, validate_layout

    layout = p = cfg.parallelism
    stages = f", first_stage_layers={p.first_stage_layers}, last_stage_layers={p.last_stage_layers}" * p.uneven
    where = (f"parallelism (tp={p.tp}, pp={p.pp}, vpp={p.vpp}, ep={p.ep}, etp={p.etp}{stages}) "
             f"at world size {world_size} for {key}={getattr(cfg.model, key.split('.')[1])}")
    try:
        validate_layout(layout, hf_config, world_size)
    except UnsupportedModelError as err:
        raise ConfigError(f"{key}: {err}") from None
    except LayoutError as err:
        named = ", ".join(f"parallelism.{k}={getattr(p, k)}" for k in err.keys)  # the keys to change
        raise ConfigError(f"{named + ': ' if named else ''}{where}: {err}") from None
    if num_experts_of(hf_config) and layout.tp > 1 and not layout.use_sequence_parallel:
        # bridge/build.py refuses this when it builds the model
        raise ConfigError(
            f"parallelism.sequence_parallel=false with tp={p.tp}: MoE models need sequence parallelism under TP"
        )


def load_recipe(path: str | os.PathLike, overrides: Sequence[str] = ()) -> TrainConfig:
    """Load a YAML recipe with its ``defaults`` chain, apply dotted overrides, validate."""
    from omegaconf import OmegaConf

    tree = _load_with_defaults(Path(path), seen=())
    if overrides:
        tree = OmegaConf.merge(tree, overrides_tree(overrides))
    try:
        plain = OmegaConf.to_container(tree, resolve=True)
    except Exception as err:  # unresolvable interpolation
        raise ConfigError(f"{path}: {err}") from None
    plain.pop("defaults", None)
    return build_dataclass(TrainConfig, plain)


def overrides_tree(overrides: Sequence[str]):
    """Command-line overrides as an OmegaConf tree to merge over a recipe.

    The grammar NeMo-RL's loader takes (Hydra's): ``key=value``, ``+key=value`` (add a key)
    and ``++key=value`` (add or override). Every key this project has is in the typed schema,
    so the three set the key alike and the schema decides whether it exists: an unknown one
    is an error naming it, whichever form added it. Values are YAML (``[a,b]``, ``null``).
    """
    from omegaconf import OmegaConf

    dotlist = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if key.startswith("~"):
            raise ConfigError(f"override {item!r}: deleting a key (~key) is not supported; set it instead (key=value)")
        name = key[2:] if key.startswith("++") else key[1:] if key.startswith("+") else key
        if not sep or not name.strip() or name != name.strip() or name.startswith("+"):
            raise ConfigError(
                f"override {item!r} is not key=value, +key=value or ++key=value (e.g. algorithm.loss.name=so_grpo)"
            )
        dotlist.append(f"{name}={value}")
    try:
        return OmegaConf.from_dotlist(dotlist)
    except Exception as err:  # omegaconf's grammar errors
        raise ConfigError(f"bad override in {list(overrides)}: {err}") from None


def _load_with_defaults(path: Path, seen: tuple[Path, ...]):
    from omegaconf import ListConfig, OmegaConf

    if path.suffix not in (".yaml", ".yml") and path.name:
        candidate = path.with_name(path.name + ".yaml")  # names may hold dots: sorl_qwen2.5_7b_base
        path = candidate if candidate.is_file() else path
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"recipe defaults form a cycle: {' -> '.join(str(p) for p in seen + (path,))}")
    if not path.is_file():
        where = f" (listed in the defaults of {seen[-1]})" if seen else ""
        raise ConfigError(f"recipe {path} not found{where}")
    try:
        node = OmegaConf.load(path)
    except Exception as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(OmegaConf.to_container(node) if node is not None else {}, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping")
    defaults = node.pop("defaults", None) if "defaults" in node else None
    if isinstance(defaults, str):  # NeMo-RL's loader takes one parent as a string
        defaults = [defaults]
    elif defaults is None:
        defaults = []
    elif not isinstance(defaults, ListConfig):
        raise ConfigError(f"{path}: defaults must be a recipe path or a list of them, got {defaults!r}")
    merged = OmegaConf.create({})
    for item in defaults:
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(f"{path}: defaults entries must be recipe paths (non-empty strings), got {item!r}")
        merged = OmegaConf.merge(merged, _load_with_defaults(path.parent / item, seen + (path,)))
    return OmegaConf.merge(merged, node)


def dump_config(cfg: TrainConfig) -> str:
    """The resolved config as YAML (written next to each run for reproducibility)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))
