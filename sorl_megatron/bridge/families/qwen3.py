"""Qwen3 (``qwen3``): dense, q/k RMS norms, no q/k/v biases, an explicit ``head_dim``."""

from __future__ import annotations

from .spec import FamilySpec, register_family, tiny_base


def tiny_config():
    """Dense Qwen3: q/k RMS norms, no q/k/v biases, and head_dim=32 given explicitly (not
    hidden_size / num_attention_heads = 16, as Qwen3-0.6B / 1.7B / 4B: heads x head_dim != hidden)."""
    from transformers import Qwen3Config

    return Qwen3Config(**tiny_base(intermediate_size=96, head_dim=32, tie_word_embeddings=False, rope_theta=10000.0))


def demo_config(common: dict, *, head_dim: int, intermediate_size: int, num_experts: int, top_k: int):
    from transformers import Qwen3Config

    return Qwen3Config(**common, head_dim=head_dim, intermediate_size=intermediate_size)


SPEC = register_family(FamilySpec(
    model_type="qwen3",
    title="Qwen3",
    tiny_config=tiny_config,
    sliding_window="by_layer_type",
    attention_bias_biases_o_proj=True,
    qk_norm=True,
    demo_config=demo_config,
))
