"""The spec of one HF model family and the registry of the supported ones.

A family is an HF ``model_type``. Its `FamilySpec` holds everything this package knows about it
beyond mbridge 0.15.1's bridge: the config fixes megatron needs to compute what transformers
computes, the configurations it refuses, what the memory plan counts, which rope scaling and
which FP8 checkpoints load, the fix to mbridge's bridge class, and the tiny random model the
tests build. Each family is one module of this package (``qwen3_moe.py``, ...) that calls
`register_family`; ``families/__init__.py`` imports them and holds the functions the rest of the
package calls (they consult the spec, nobody else compares ``model_type`` strings).

Pure Python: no torch / megatron / transformers import at module level (the layout checks run
before anything is built). Hooks import what they need when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

# A family's HF config class built for the tests (`FamilySpec.tiny_config`). Typed loosely:
# transformers is imported only when a tiny config is made.
Config = Any


class FamilyConfigError(ValueError):
    """A config value of a supported family that this package cannot reproduce exactly."""


def get(cfg: Any, name: str, default: Any = None) -> Any:
    """``cfg.name``, or ``default`` when it is absent or None (HF configs leave keys None)."""
    value = getattr(cfg, name, None)
    return default if value is None else value


@dataclass(frozen=True)
class FamilySpec:
    """What one HF ``model_type`` needs beyond mbridge's defaults. Defaults are the plain case
    (a dense decoder mbridge builds right, as Llama): a family sets only what differs.

    model_type: the HF ``config.json`` ``model_type`` (the registry key).
    title: the family's name in messages and docs ("DeepSeek-V3").
    tiny_config: makes the tiny random HF config the tests build (tests/bridge/tiny_models.py
        saves it; ``tools/convert.py verify`` checks it for every registered family). Keyword
        overrides are the family's own (e.g. Qwen2's ``tied``).
    mbridge_name: the key of mbridge's bridge registry (``mbridge.core.auto_bridge._MODEL_REGISTRY``).
    bridge_class: takes mbridge's bridge class and returns the one to build with (a subclass
        fixing what 0.15.1 gets wrong on megatron-core 0.16.1); None = mbridge's as is.
    check: raises `FamilyConfigError` for this family's configurations megatron would compute
        differently (naming the key); runs after the generic checks (sliding window,
        ``attention_bias_biases_o_proj``).
    config_overrides: ``(hf_config, on_gpu_te) -> dict`` of megatron TransformerConfig fields set
        after mbridge's (router pre-softmax / score scaling, shared-expert gate, YaRN, ...);
        ``on_gpu_te`` is whether the model runs TransformerEngine's spec on a GPU.
    local_spec_problem: ``(hf_config, tp) -> str | None``: what the CPU (local) layer spec cannot
        split at ``tp > 1`` (build_model raises it as a LayoutError on ``tp``).
    sliding_window: how transformers' attention reads ``sliding_window``: "by_layer_type" (on
        the layers ``layer_types`` marks sliding), "every_layer" (whenever it is set), None (never).
        A window that drops a position is refused (mbridge builds full causal attention).
    attention_bias_biases_o_proj: transformers' ``attention_bias=True`` biases o_proj too, which
        megatron cannot (it biases o_proj only with the MLP): such configs are refused.
    qkv_bias: the q/k/v projections carry biases whatever ``attention_bias`` says (memory plan).
    qk_norm: q and k have RMS norms (memory plan).
    dense_prefix_key: the config key counting the leading dense (non-MoE) layers of a MoE model.
    shared_expert_size: ``hf_config -> int``: the FFN size of the shared experts of one MoE
        layer; None = no shared experts. A family with them gets
        ``moe_shared_expert_overlap=False`` off the GPU (the overlap runs on a CUDA side stream).
    rope_scaling: the ``rope_parameters['rope_type']`` values besides default RoPE that load
        (their parameters reach megatron through ``config_overrides``); others are refused.
    reads_block_fp8: the bridge reads a block-FP8 checkpoint (``quantization_config.quant_method
        == 'fp8'``) and dequantizes it with its ``weight_scale_inv`` tensors; in any other family
        those scales are unused tensors and the load is refused.
    tiny_router_std: the tiny test model's router weights are drawn with this std (clear top-k
        margins, no near ties between transformers and megatron); None = as initialized.
    demo_config: ``(common, head_dim=, intermediate_size=, num_experts=, top_k=) -> config``: the
        CPU demo's and training tests' tiny model (sorl_megatron/data/tiny_model.py, its
        ``arch``) from the sizes every family shares (``common``: vocabulary, hidden size,
        layers, heads, ...) and these; None = the demo does not build this family.
    """

    model_type: str
    title: str
    tiny_config: Callable[..., Config]
    mbridge_name: str = ""
    bridge_class: Optional[Callable[[type], type]] = None
    check: Optional[Callable[[Any], None]] = None
    config_overrides: Optional[Callable[[Any, bool], dict[str, Any]]] = None
    local_spec_problem: Optional[Callable[[Any, int], Optional[str]]] = None
    sliding_window: Optional[Literal["by_layer_type", "every_layer"]] = None
    attention_bias_biases_o_proj: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    dense_prefix_key: Optional[str] = None
    shared_expert_size: Optional[Callable[[Any], int]] = None
    rope_scaling: tuple[str, ...] = ()
    reads_block_fp8: bool = False
    tiny_router_std: Optional[float] = None
    demo_config: Optional[Callable[..., Config]] = None

    def __post_init__(self) -> None:
        if not self.mbridge_name:
            object.__setattr__(self, "mbridge_name", self.model_type)
        if self.sliding_window not in (None, "by_layer_type", "every_layer"):
            raise ValueError(f"{self.model_type}: sliding_window={self.sliding_window!r}")


# model_type -> spec, in registration order (the order the supported families are listed in).
FAMILIES: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec) -> FamilySpec:
    """Add ``spec`` to the registry (a model_type registers once) and return it."""
    if spec.model_type in FAMILIES:
        raise ValueError(f"model family {spec.model_type!r} is already registered "
                         f"(by {FAMILIES[spec.model_type].tiny_config.__module__})")
    FAMILIES[spec.model_type] = spec
    return spec


def family_of(hf_config: Any) -> Optional[FamilySpec]:
    """The spec of ``hf_config``'s ``model_type`` (an HF config or any object with the
    attribute, e.g. a ``config.json`` read as a namespace), or None when it is not registered."""
    return FAMILIES.get(getattr(hf_config, "model_type", None))


def tiny_base(**kw: Any) -> dict[str, Any]:
    """The sizes every tiny test model shares (vocabulary 128, hidden 64, 2 layers, 4 heads, 2 KV
    heads), updated with ``kw``: the keyword arguments of a family's HF config class."""
    base = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        attention_dropout=0.0,
    )
    base.update(kw)
    return base
