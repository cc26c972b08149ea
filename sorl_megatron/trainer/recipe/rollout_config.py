"""The recipe's ``rollout`` section: multi-turn generation, the servers it runs on, the weight
sync to them and the rollout modes (``config.py`` holds the other sections and ``TrainConfig``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import shlex
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

from ...common.typed_config import config_key
from .checks import RecipeError, _check_finite, _check_url, _in_range, _positive_int, _positive_seconds
from .rollout_modes import ROLLOUT_MODES, AsyncMode, LaggedMode, ModeSettings, RolloutModeName, StalenessConfig


@dataclass
class RolloutInjectConfig:
    """Study injectors (off by default; docs/study.md): the embedded servers perturb this fraction
    of the (token, MoE layer) top-k routing choices they compute with and return (a hash of
    ``seed``, the layer and each token's position and id; ``sglang_cpu/route_flip.py``)."""

    route_flip_fraction: float = 0.0  # the fraction perturbed, in [0, 1] (0: off); embedded servers and MoE models only
    seed: int = 0  # the hash's seed; in [0, 2^31)

    def validate(self, prefix: str = "rollout.inject") -> None:
        _check_finite(self, prefix)
        _in_range(f"{prefix}.route_flip_fraction", self.route_flip_fraction, 0.0, 1.0)
        if not 0 <= self.seed < 2**31:
            raise RecipeError(f"{prefix}.seed must be in [0, 2^31), got {self.seed}")


@dataclass
class WeightSyncConfig:
    """``rollout.weight_sync``: how the trainer's weights reach the rollout servers after each
    step (``weight_sync/``; docs/concepts/rollout.md, "Distributed weight sync")."""

    # distributed: SGLang's /update_weights_from_distributed (a gloo/NCCL group with the servers;
    # each pipeline stage and expert owner sends its own tensors); tensor: HTTP bodies from rank 0
    # (embedded servers only); disk: an HF checkpoint the servers reload (docs/concepts/rollout.md)
    transport: Literal["distributed", "tensor", "disk"] = "distributed"
    bucket_mb: int = 512  # tensors per /update_weights_from_distributed (a larger one goes alone)
    # seconds per weight-sync call (one bucket, begin/end, a reload from disk) and other control call
    timeout_s: float = 600.0
    # bound on forming the weight-update group and on each broadcast in it
    init_timeout_s: float = 120.0
    # the address the servers reach the sending ranks at (null: the route towards the first server)
    master_address: Optional[str] = None

    def validate(self, prefix: str = "rollout.weight_sync") -> None:
        _check_finite(self, prefix)
        _positive_int(f"{prefix}.bucket_mb", self.bucket_mb)
        address = self.master_address
        if address is not None and (not address or any(c.isspace() for c in address)):
            raise RecipeError(f"{prefix}.master_address must be a host name or IP address, got {address!r}")
        for key in ("timeout_s", "init_timeout_s"):
            _positive_seconds(f"{prefix}.{key}", getattr(self, key))


@dataclass
class FleetConfig:
    """``rollout.fleet`` (docs/concepts/rollout.md, "A fleet of servers"): the servers the rollouts run on
    besides ``rollout.urls``, the router in front of them, and what a failed server costs."""

    # embedded servers to start (no rollout.urls) ...
    num_servers: int = 1
    # ... the real sglang-router in front of them (or of rollout.urls), started by the trainer
    # unless router_url names one already running in front of rollout.urls ...
    router: Literal["none", "sglang_router"] = "none"
    router_url: Optional[str] = None  # a running router (with rollout.urls); null: router=sglang_router starts one
    # not power_of_two: sglang-router polls each worker's /get_load for it, which SGLang 0.5.21 does not serve
    router_policy: Literal["cache_aware", "round_robin", "random"] = "cache_aware"
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
    restart_servers: bool = True  # a failed embedded server is started again (false: killed, not restarted)
    restart_command: Optional[str] = None  # for a failed external server (above; rollout.urls only); null: none

    def validate(self, prefix: str = "rollout.fleet", urls: Sequence[str] = (), urls_key: str = "rollout.urls") -> None:
        """The fleet keys (servers, router, restarts) fit together and with ``urls`` (the
        external servers, the recipe's ``urls_key``)."""
        _check_finite(self, prefix)
        _positive_seconds(f"{prefix}.start_timeout_s", self.start_timeout_s)
        _positive_int(f"{prefix}.num_servers", self.num_servers)
        _positive_int(f"{prefix}.failover_retries", self.failover_retries, minimum=0)
        _positive_int(f"{prefix}.router_balance_abs_threshold", self.router_balance_abs_threshold, minimum=0)
        if urls and self.num_servers != 1:
            raise RecipeError(f"{prefix}.num_servers={self.num_servers} starts embedded servers, but {urls_key} "
                              "lists external ones: give one or the other")
        if self.router_url is not None:
            _check_url(f"{prefix}.router_url", self.router_url)
            if self.router != "sglang_router":
                raise RecipeError(f"{prefix}.router_url is set but {prefix}.router={self.router}: "
                                  f"set {prefix}.router=sglang_router")
            if not urls:
                raise RecipeError(f"{prefix}.router_url needs {urls_key}: the workers behind it, which get the "
                                  "weight updates, flush_cache and health checks (generation goes through the router)")
        elif self.router == "sglang_router" and importlib.util.find_spec("sglang_router") is None:
            raise RecipeError(f"{prefix}.router=sglang_router needs the sglang-router package to start the router: "
                              f"pip install sglang-router (or give {prefix}.router_url of a running one)")
        if self.restart_command is not None:
            if not urls:
                raise RecipeError(f"{prefix}.restart_command is for external servers ({urls_key}); the trainer "
                                  f"restarts its embedded servers itself ({prefix}.restart_servers)")
            try:
                words = shlex.split(self.restart_command)
            except ValueError as err:
                raise RecipeError(
                    f"{prefix}.restart_command: {self.restart_command!r} is not a command line ({err})"
                ) from None
            if not words:
                raise RecipeError(f"{prefix}.restart_command is empty: give a command or leave it null")


@dataclass
class RolloutConfig:
    """Multi-turn generation. No URLs = start the embedded CPU server."""

    urls: list[str] = field(default_factory=list)  # external SGLang servers (http(s)); empty: embedded ones
    # embedded server: the precision it generates in; external servers (urls): fp8 makes each
    # weight sync export block-FP8 weights (serve the FP8 export of `tools/convert.py megatron-to-hf
    # --fp8`; SGLang's --quantization fp8 on a BF16 checkpoint is refused)
    precision: Literal["fp32", "bf16", "fp8"] = "fp32"
    group_size: int = 4  # n rollouts per prompt
    temperature: float = 1.0  # sampling temperature; the trainer's logits are divided by it too; > 0
    top_p: float = 1.0  # nucleus sampling; in (0, 1], 1 = off (validation: 1)
    top_k: int = -1  # -1 = off, else >= 1 (validation: 1, greedy)
    max_turns: int = 3  # policy turns per episode; the last turn's search is not executed
    max_turn_tokens: int = 64  # tokens sampled per policy turn at most; < max_total_tokens
    # an episode's token budget: prompt, policy turns and observations; an episode that reaches it ends
    # (finish_reason max_length)
    max_total_tokens: int = 512
    max_obs_tokens: int = 128  # tokens of one search's observation (passages cut, tags kept); < max_total_tokens
    concurrency: int = 16  # most /generate calls in flight over all servers (and episodes per rollout call)
    # embedded servers decode each row alone (--enable-deterministic-inference): a seeded episode
    # gets the same tokens whatever else is in flight, so a run repeats on its machine at any
    # load; costs the batching speed-up (docs/concepts/rollout.md). External servers: SGLang's own flag.
    deterministic: bool = False
    # Every wait on the servers is bounded (see docs/concepts/rollout.md, failure model): seconds per
    # /generate call here (a timed-out call is not retried) ...
    timeout_s: float = 120.0
    # ... per weight-sync call and other control call in weight_sync.timeout_s ...
    # ... per GET /health, asked before each phase (rollout, weight sync, validation, PVPO pass)
    health_timeout_s: float = 10.0
    retries: int = 2  # extra attempts after a refused connection or a 5xx answer (never after a timeout)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    # Rollout modes (docs/concepts/rollout.md, "Rollout modes"; rollout_modes.py): sync generates each
    # step's batch with the step's own weights; one_step_off generates step k+1's batch while step
    # k trains, on the weights step k started from (a lag of exactly one version); async keeps
    # episodes in flight across weight updates (partial rollouts) and trains on finished groups
    # whose oldest token is at most staleness.max versions behind the trainer; lagged (a study
    # axis) trains step k on the batch generated on weights k - lagged.lag (min(k, lag) while the
    # pipeline fills). A mode with keys has its section under its name.
    mode: RolloutModeName = "sync"
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    lagged: LaggedMode = field(default_factory=LaggedMode)
    async_: AsyncMode = field(default_factory=AsyncMode, metadata={"key": "async"})
    # DAPO dynamic sampling: a group whose rewards are all equal (no GRPO signal) is dropped and
    # replaced by a fresh prompt's group until the batch is full; at most this many groups are
    # drawn per step (0: 4 x schedule.batch_size), then dropped groups fill the rest
    dynamic_sampling: bool = False
    # the most groups drawn per step (0: 4 x schedule.batch_size); 0 or >= schedule.batch_size
    dynamic_sampling_max_groups: int = 0
    # episodes cut by rollout.max_total_tokens (finish_reason max_length): keep, filter (loss mask
    # zeroed) or penalty (DAPO's soft overlong punishment: the reward falls linearly by up to
    # overlong_penalty over the last overlong_buffer tokens of the budget, and by all of it when cut)
    overlong: Literal["keep", "filter", "penalty"] = "keep"
    overlong_buffer: int = 64  # penalty: the budget's last tokens, where the reward falls; < max_total_tokens
    overlong_penalty: float = 1.0  # penalty: the reward an episode the budget cut loses (less in the buffer); >= 0
    inject: RolloutInjectConfig = field(default_factory=RolloutInjectConfig)

    def validate(self, prefix: str = "rollout") -> None:
        _check_finite(self, prefix)
        for key in ("group_size", "max_turns", "max_turn_tokens", "max_total_tokens", "max_obs_tokens", "concurrency"):
            _positive_int(f"{prefix}.{key}", getattr(self, key))
        self.weight_sync.validate(f"{prefix}.weight_sync")
        for key in ("timeout_s", "health_timeout_s"):
            _positive_seconds(f"{prefix}.{key}", getattr(self, key))
        _positive_int(f"{prefix}.retries", self.retries, minimum=0)
        if not 0 < self.top_p <= 1:
            raise RecipeError(f"{prefix}.top_p must be in (0, 1], got {self.top_p}")
        if self.temperature <= 0:
            raise RecipeError(f"{prefix}.temperature must be > 0, got {self.temperature}")
        if self.top_k == 0 or self.top_k < -1:
            raise RecipeError(f"{prefix}.top_k must be -1 (off) or >= 1, got {self.top_k}")
        for key in ("max_obs_tokens", "max_turn_tokens"):
            if getattr(self, key) >= self.max_total_tokens:
                raise RecipeError(
                    f"{prefix}.{key}={getattr(self, key)} must be < {prefix}.max_total_tokens={self.max_total_tokens}"
                )
        for i, url in enumerate(self.urls):
            _check_url(f"{prefix}.urls[{i}]", url)
        self.fleet.validate(f"{prefix}.fleet", self.urls, f"{prefix}.urls")
        if self.deterministic and self.urls:
            raise RecipeError(f"{prefix}.deterministic is for embedded servers; launch external SGLang servers with "
                              "--enable-deterministic-inference instead")
        self._check_modes(prefix)
        self.inject.validate(f"{prefix}.inject")
        if self.inject.route_flip_fraction > 0 and self.urls:
            raise RecipeError(f"{prefix}.inject.route_flip_fraction is an injector of the embedded servers; "
                              f"{prefix}.urls names external ones")

    def _check_modes(self, prefix: str) -> None:
        """The rollout mode (each mode's section checks its own keys, the selected mode what it
        asks of the staleness bound), dynamic sampling and overlong options (those against other
        sections: ``TrainConfig.validate``)."""
        self.staleness.validate(f"{prefix}.staleness")
        _positive_int(f"{prefix}.dynamic_sampling_max_groups", self.dynamic_sampling_max_groups, minimum=0)
        _positive_int(f"{prefix}.overlong_buffer", self.overlong_buffer)
        if self.overlong_buffer >= self.max_total_tokens:
            raise RecipeError(f"{prefix}.overlong_buffer={self.overlong_buffer} must be < {prefix}.max_total_tokens="
                              f"{self.max_total_tokens}")
        if self.overlong_penalty < 0:
            raise RecipeError(f"{prefix}.overlong_penalty must be >= 0, got {self.overlong_penalty}")
        for name, section in self.mode_sections().items():
            section.validate(f"{prefix}.{name}")
        self.mode_settings.check_selected(prefix, self.staleness)

    def mode_sections(self) -> dict[str, ModeSettings]:
        """The sections of the modes that have keys, by mode name (``rollout.<mode>``)."""
        return {config_key(f): getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), ModeSettings)}

    @property
    def mode_settings(self) -> ModeSettings:
        """The settings of ``rollout.mode``: its section, or the defaults of a mode without keys."""
        return self.mode_sections().get(self.mode) or ROLLOUT_MODES[self.mode]()
