"""The CPU server's settings: the engine's (``EngineConfig``) and the HTTP front's
(``ServerOptions``). The command line (``server.py``) sets them; flags in docs/concepts/rollout.md.
Importing this module loads neither torch nor transformers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..rollout.server_facts import SESSIONS_SINCE, parse_version

if TYPE_CHECKING:
    from .precision import Precision


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (``RolloutEngine``)."""

    model_path: str
    tokenizer_path: str | None = None
    precision: Precision = "fp32"
    fp8_block_size: int = 128
    max_running_requests: int = 32
    context_length: int | None = None
    enable_return_routed_experts: bool = False
    skip_tokenizer_init: bool = False
    random_seed: int = 0
    weight_version: str = "default"
    enable_prefix_cache: bool = True
    prefix_cache_max_tokens: int = 1 << 16
    deterministic: bool = False
    # study injector (route_flip.py): this fraction of (token, layer) top-k choices perturbed
    inject_route_flip_fraction: float = 0.0
    inject_route_flip_seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.inject_route_flip_fraction <= 1.0:
            raise ValueError(f"inject_route_flip_fraction must be in [0, 1], got {self.inject_route_flip_fraction}")


@dataclass(frozen=True)
class ServerOptions:
    """Limits and authentication of the HTTP front end (the engine's settings are EngineConfig).

    Attributes:
        max_body_mb: largest body of ``/generate`` and the control endpoints (MiB).
        max_weight_body_mb: largest body of ``/update_weights_from_tensor`` (MiB).
        weight_body_wait_s: bound on a ``/update_weights_from_tensor`` waiting for its turn: one
            such body is read, decoded and applied at a time (503 with Retry-After past it).
        max_prompts_per_request: most sequences one ``/generate`` may ask for (prompts x n).
        max_tokens_per_request: most tokens one ``/generate`` may ask for: the sum over its
            sequences of prompt tokens plus ``max_new_tokens`` (capped by the context length).
        api_key: when set, every endpoint but ``/health*`` needs ``Authorization: Bearer <key>``.
        weight_group_timeout_s: bound on each broadcast in a weight-update group (and on joining one).
        weight_group_join_timeout_s: bound on joining a weight-update group (the smaller of the
            two applies).
        max_weight_group_joins: most group joins in flight, in a pool of their own; one more is
            refused at once (503).
        control_timeout_s: bound on ``/flush_cache``, ``/pause_generation`` and
            ``/continue_generation`` waiting for the scheduler (they run at its next step).
        sglang_version: the SGLang release this server answers as (``/server_info``'s
            ``version``): from 0.5.21 updates from tensors or a group must run between
            ``/begin_weight_update`` and ``/end_weight_update``; before it those endpoints do not
            exist (404) and an update applies at once.
    """

    max_body_mb: int = 64
    max_weight_body_mb: int = 1024
    max_prompts_per_request: int = 1024
    max_tokens_per_request: int = 1 << 20
    api_key: str | None = field(default=None, repr=False)
    weight_group_timeout_s: float = 600.0
    weight_group_join_timeout_s: float = 60.0
    max_weight_group_joins: int = 4
    control_timeout_s: float = 60.0
    weight_body_wait_s: float = 60.0
    sglang_version: str = "0.5.21"

    def __post_init__(self) -> None:
        for name in ("max_body_mb", "max_weight_body_mb", "max_prompts_per_request", "max_tokens_per_request",
                     "max_weight_group_joins"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("weight_group_timeout_s", "weight_group_join_timeout_s", "control_timeout_s",
                     "weight_body_wait_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if parse_version(self.sglang_version) is None:
            raise ValueError(f"sglang_version must look like 0.5.21, got {self.sglang_version!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for no authentication)")

    @property
    def weight_update_sessions(self) -> bool:
        """Whether this persona has ``/begin_weight_update`` and ``/end_weight_update`` (0.5.21+)."""
        return parse_version(self.sglang_version) >= SESSIONS_SINCE

    def public(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("api_key", "sglang_version")}
        return {**d, "api_key_required": self.api_key is not None, "version": self.sglang_version}
