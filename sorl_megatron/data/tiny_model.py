"""Tiny random HuggingFace causal LMs built from a config (tests and the CPU demo).

Nothing is downloaded: the architecture comes from a transformers config class, weights are
random with a fixed seed, and the result is saved as safetensors next to the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from ..bridge.families import FAMILIES
from ..common.hf_build import HF_BUILD_LOCK

# A registered model family whose spec makes a demo model (FamilySpec.demo_config): qwen2,
# qwen3, qwen3_moe, mixtral.
Arch = str


@dataclass(frozen=True)
class TinyModelConfig:
    arch: Arch = "qwen3_moe"
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    num_experts: int = 4
    top_k: int = 2
    max_position_embeddings: int = 4096
    # Routers get a larger init than the rest so that top-k choices are not near ties
    # (a near tie would flip under any reordering of float sums).
    router_init_std: float = 0.5
    # Tied input/output embeddings let a tiny model copy a rare token (a name in the question
    # or a passage) into its output: the output row of a token is its well-trained input row.
    tie_embeddings: bool = False
    seed: int = 0


def hf_config(
    cfg: TinyModelConfig, eos_token_id: int | None = None, pad_token_id: int | None = None
) -> PretrainedConfig:
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    spec = FAMILIES.get(cfg.arch)
    if spec is None or spec.demo_config is None:
        archs = ", ".join(mt for mt, s in FAMILIES.items() if s.demo_config is not None)
        raise ValueError(f"tiny_model.arch: {cfg.arch!r} is not one of {archs}")
    return spec.demo_config(common, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
                            num_experts=cfg.num_experts, top_k=cfg.top_k)


def build_tiny_model(cfg: TinyModelConfig, eos_token_id: int | None = None, pad_token_id: int | None = None):
    """A float32 random model in eval mode."""
    torch.manual_seed(cfg.seed)
    with HF_BUILD_LOCK:
        model = AutoModelForCausalLM.from_config(hf_config(cfg, eos_token_id, pad_token_id), dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.weight.normal_(0.0, cfg.router_init_std)
    return model.eval()


VOCAB_MULTIPLE = 64  # padded vocabulary, as Megatron pads: any TP size up to 64 that is a power of 2 divides it


def save_tiny_model(cfg: TinyModelConfig, out_dir: str | Path, tokenizer=None) -> Path:
    """Build and save a tiny model (and tokenizer, whose size, rounded up to a multiple of
    ``VOCAB_MULTIPLE``, sets the vocabulary: the unused rows are never sampled ids' targets but
    let tensor parallelism split the embedding and output layer evenly)."""
    out = Path(out_dir)
    if tokenizer is not None:
        vocab = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        cfg = TinyModelConfig(**{**cfg.__dict__, "vocab_size": vocab})
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    pad = tokenizer.pad_token_id if tokenizer is not None else None
    model = build_tiny_model(cfg, eos, pad)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
