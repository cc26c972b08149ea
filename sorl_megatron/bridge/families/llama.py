"""Llama (``llama``): dense, no biases, no q/k norms. ``mlp_bias=True`` is refused (mbridge
0.15.1 builds and maps no MLP biases), so is ``attention_bias=True`` (it biases o_proj too)."""

from __future__ import annotations

from typing import Any

from .spec import FamilyConfigError, FamilySpec, get, register_family, tiny_base


def tiny_config():
    """Llama: no q/k/v or MLP biases, no q/k norms, untied, a non-default rope_theta."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **tiny_base(
            intermediate_size=96,
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
            rope_theta=500000.0,
        )
    )


def check(hf_config: Any) -> None:
    if bool(get(hf_config, "mlp_bias", False)):
        raise FamilyConfigError("llama with mlp_bias=True: mbridge 0.15.1 builds and maps no MLP biases")


SPEC = register_family(FamilySpec(
    model_type="llama",
    title="Llama",
    tiny_config=tiny_config,
    check=check,
    attention_bias_biases_o_proj=True,
))
