"""Qwen2 / Qwen2.5 (``qwen2``): dense, q/k/v biases on every layer, tied or untied embeddings.

mbridge's Qwen2 bridge builds it as transformers computes it; the only caveat (its class-level
tied-embedding mapping) is handled for every family in build.py.
"""

from __future__ import annotations

from .spec import FamilySpec, register_family, tiny_base


def tiny_config(tied: bool = False, layers: int = 2, **kw):
    """Two (or ``layers``) layers, q/k/v biases, tied embeddings when ``tied``."""
    from transformers import Qwen2Config

    kw = {"intermediate_size": 96, **kw}
    return Qwen2Config(**tiny_base(tie_word_embeddings=tied, rope_theta=10000.0, num_hidden_layers=layers, **kw))


def demo_config(common: dict, *, head_dim: int, intermediate_size: int, num_experts: int, top_k: int):
    from transformers import Qwen2Config

    return Qwen2Config(**common, intermediate_size=intermediate_size)


SPEC = register_family(FamilySpec(
    model_type="qwen2",
    title="Qwen2",
    tiny_config=tiny_config,
    sliding_window="by_layer_type",
    qkv_bias=True,
    demo_config=demo_config,
))
