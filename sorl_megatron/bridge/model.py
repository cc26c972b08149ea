"""What a built Megatron model is: its chunks, options and the critic's value head (``build.py`` builds it)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from transformers import PretrainedConfig

from .grouped_gemm import EXPERT_GEMMS
from .layout import ParallelLayout
from .te_fp8 import Fp8Options

# the TE-less spec's core attentions (local_spec.LOCAL_ATTENTION's keys; the recipe's model.local_attention)
LOCAL_ATTENTIONS = ("sdpa", "unfused")


@dataclass
class ModelOptions:
    """How to build the model (the layout is passed separately).

    dtype: parameter dtype; None = float32 on CPU, bfloat16 on GPU.
    value_head: replace the LM head with a scalar head (PPO critic); embeddings untied.
    use_te: force the TE (True) or local (False) layer spec; None = TE iff it imports.
    config_overrides: extra TransformerConfig fields (e.g. moe_enable_routing_replay=True).
    wrap_with_ddp / ddp_config: passed to mbridge's get_model (training wants DDP).
    seed: RNG seed for parallel init when build_model initializes the groups itself.
    fp8: TransformerEngine FP8 (``te_fp8.py``); None or disabled = the model's dtype only.
    local_attention / expert_gemm: the TE-less spec's core attention and expert linears
    (``local_spec.LOCAL_ATTENTION``, ``grouped_gemm``); TE's spec runs its own.
    offload_idle: the engines of a frozen model (the reference) and of a critic keep it, its
    gradients and optimizer state on the CPU between their passes (``EngineBase.on_device``).
    """

    dtype: Optional[torch.dtype] = None
    value_head: bool = False
    use_te: Optional[bool] = None
    config_overrides: dict[str, Any] = field(default_factory=dict)
    wrap_with_ddp: bool = False
    ddp_config: Optional[dict[str, Any]] = None
    seed: int = 1234
    fp8: Optional[Fp8Options] = None
    offload_idle: bool = False
    local_attention: str = "sdpa"
    expert_gemm: str = "auto"

    def __post_init__(self) -> None:
        if self.local_attention not in LOCAL_ATTENTIONS:
            raise ValueError(f"local_attention must be one of {LOCAL_ATTENTIONS}, got {self.local_attention!r}")
        if self.expert_gemm not in EXPERT_GEMMS:
            raise ValueError(f"expert_gemm must be one of {EXPERT_GEMMS}, got {self.expert_gemm!r}")

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32


@dataclass
class MegatronModel:
    """Model chunks (one per virtual pipeline stage on this rank) and what built them."""

    chunks: list[torch.nn.Module]
    bridge: Any  # mbridge.core.Bridge
    hf_config: PretrainedConfig
    layout: ParallelLayout
    options: ModelOptions
    source_dir: Optional[str] = None  # HF directory the weights came from, if any

    @property
    def config(self):  # megatron TransformerConfig
        return self.bridge.config

    @property
    def dtype(self) -> torch.dtype:
        return self.options.resolved_dtype()

    def unwrapped(self) -> list[torch.nn.Module]:
        from mbridge.core.util import unwrap_model

        return unwrap_model(self.chunks)

    def train(self, mode: bool = True) -> "MegatronModel":
        for c in self.chunks:
            c.train(mode)
        return self

    def eval(self) -> "MegatronModel":
        return self.train(False)


class ScalarValueHead(torch.nn.Linear):
    """Critic head: hidden -> 1 value per token, in float32, gathered out of the SP region."""

    def __init__(self, hidden_size: int, config: Any):
        super().__init__(hidden_size, 1, bias=False, dtype=config.params_dtype)
        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel:
            self.weight.sequence_parallel = True  # grads differ per sequence shard

    def forward(self, input_, weight=None, runtime_gather_output=None):
        from megatron.core import tensor_parallel

        values = super().forward(input_).float()
        if self.sequence_parallel:
            values = tensor_parallel.gather_from_sequence_parallel_region(
                values, tensor_parallel_output_grad=False
            )
        return values, None


def attach_value_head(model, pre_process, post_process, config, hf_config):
    if post_process:
        model.output_layer = ScalarValueHead(config.hidden_size, config)


@contextlib.contextmanager
def detached_value_heads(model: MegatronModel) -> Iterator[None]:
    """Hide value heads from state_dict while HF weights are loaded/exported (the HF files
    have an LM head, not a critic head)."""
    if not model.options.value_head:
        yield
        return
    saved = []
    for chunk in model.unwrapped():
        if isinstance(getattr(chunk, "output_layer", None), ScalarValueHead):
            saved.append((chunk, chunk.output_layer))
            chunk.output_layer = None
    try:
        yield
    finally:
        for chunk, head in saved:
            chunk.output_layer = head
