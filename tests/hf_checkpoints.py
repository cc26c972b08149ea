"""HF checkpoints the rollout tests derive from a tiny model."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from sorl_megatron.common.hf_build import HF_BUILD_LOCK


def perturbed_checkpoint(src, dst, scale: float, seed: int):
    """``src``'s weights plus ``scale`` x N(0, 1) noise (seeded), saved to ``dst``; the model returned."""
    with HF_BUILD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(dst)
    return model.eval()
