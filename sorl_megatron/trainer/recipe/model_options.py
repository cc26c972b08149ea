"""The engine's model options, from the recipe's ``model`` section."""

from __future__ import annotations

import torch

from ...bridge.model import ModelOptions
from .config import TrainConfig


def model_options(cfg: TrainConfig) -> ModelOptions:
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    return ModelOptions(dtype=dtype, fp8=cfg.model.fp8, offload_idle=cfg.model.offload_idle,
                        local_attention=cfg.model.local_attention, expert_gemm=cfg.model.expert_gemm)
