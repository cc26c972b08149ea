"""TransformerEngine FP8 compute for the Megatron passes (``model.fp8`` in a recipe).

Off by default. When on, the TE layers of the model run their GEMMs in FP8:
  forward_only: true   only the forward-only passes (old / reference log-probs) run under
                       megatron's FP8 context (``fp8_utils.get_fp8_context``: TE's fp8_autocast
                       with the recipe built from TransformerConfig's fp8 fields); training
                       forward/backward stays in the model's dtype.
  forward_only: false  the model is built with TransformerConfig ``fp8`` / ``fp8_recipe`` set,
                       so megatron runs training and forward-only passes in FP8.
The log-probs FP8 gives differ from the training pass's: that mismatch is what the IS
correction metrics already report (docs/concepts/algorithms.md). This module imports neither torch
nor megatron at import time, so the recipe schema can use ``Fp8Options``.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Optional

FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and later have FP8 tensor cores


class Fp8Error(ValueError):
    """FP8 asked for where it cannot run; the message names the recipe key."""


@dataclass
class Fp8Options:
    """``model.fp8`` of a recipe (and ``ModelOptions.fp8``)."""

    # the TE layers' GEMMs in FP8 (TransformerEngine on a GPU of compute capability >= 8.9; checked at launch)
    enabled: bool = False
    format: Literal["e4m3", "hybrid"] = "e4m3"  # hybrid: e4m3 forward, e5m2 gradients
    recipe: Literal["delayed", "blockwise"] = "delayed"  # blockwise: 128x128 / 1x128 scales (Hopper)
    # FP8 in the forward-only passes only (old / reference log-probs, values); false: in training too
    forward_only: bool = True

    def validate(self, prefix: str = "model.fp8") -> None:
        for key in ("enabled", "forward_only"):
            if not isinstance(getattr(self, key), bool):
                raise Fp8Error(f"{prefix}.{key} must be true or false, got {getattr(self, key)!r}")
        if self.format not in ("e4m3", "hybrid"):
            raise Fp8Error(f"{prefix}.format must be e4m3 or hybrid, got {self.format!r}")
        if self.recipe not in ("delayed", "blockwise"):
            raise Fp8Error(f"{prefix}.recipe must be delayed or blockwise, got {self.recipe!r}")

    def config_fields(self) -> dict[str, Any]:
        """megatron TransformerConfig's FP8 fields for these options."""
        return {"fp8": self.format, "fp8_recipe": self.recipe}

    def build_overrides(self) -> dict[str, Any]:
        """TransformerConfig overrides at build time: FP8 training only (forward_only=false)."""
        return self.config_fields() if self.enabled and not self.forward_only else {}


def fp8_unavailable_reason() -> Optional[str]:
    """Why TE FP8 cannot run in this process (None when it can): no importable
    transformer_engine, no CUDA device, or a GPU below compute capability 8.9."""
    from .te_probe import te_import_error

    reason = te_import_error()
    if reason is not None:
        return reason
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        return f"{name} has compute capability {cap[0]}.{cap[1]}; FP8 needs >= 8.9 (Ada, Hopper or later)"
    return None


def require_fp8(options: Fp8Options, prefix: str = "model.fp8") -> None:
    """Raise ``Fp8Error`` naming ``<prefix>.enabled`` when FP8 is on but cannot run here."""
    if not options.enabled:
        return
    reason = fp8_unavailable_reason()
    if reason is not None:
        raise Fp8Error(f"{prefix}.enabled=true needs TransformerEngine FP8 on the GPU: {reason}; "
                       f"set {prefix}.enabled=false")


@contextlib.contextmanager
def forward_only_fp8(config: Any, options: Optional[Fp8Options]) -> Iterator[None]:
    """The FP8 context of a forward-only pass: megatron's own (TE fp8_autocast with the recipe
    and amax-reduction group megatron derives from ``fp8`` / ``fp8_recipe``) on a copy of the
    model's TransformerConfig, so the training passes keep the config they were built with.
    A no-op unless ``options.enabled`` and ``options.forward_only``."""
    if options is None or not options.enabled or not options.forward_only:
        yield
        return
    from megatron.core.fp8_utils import get_fp8_context

    fp8_config = copy.copy(config)  # a shallow copy: no __post_init__ re-validation
    for key, value in options.config_fields().items():
        setattr(fp8_config, key, value)
    with get_fp8_context(fp8_config):
        yield
