"""Build Megatron GPT model chunks (and the mbridge bridge) from an HF directory or config."""

from __future__ import annotations

import contextlib
import os
import types
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

import torch
from transformers import PretrainedConfig

from .cpu_compat import apply_cpu_compat
from .hf_config import load_hf_config
from .layout import LayoutError, ParallelLayout, num_experts_of, validate_layout


@dataclass
class ModelOptions:
    """How to build the model (the layout is passed separately).

    dtype: parameter dtype; None = float32 on CPU, bfloat16 on GPU.
    value_head: replace the LM head with a scalar head (PPO critic); embeddings untied.
    use_te: force the TE (True) or local (False) layer spec; None = TE iff it imports.
    config_overrides: extra TransformerConfig fields (e.g. moe_enable_routing_replay=True).
    wrap_with_ddp / ddp_config: passed to mbridge's get_model (training wants DDP).
    seed: RNG seed for parallel init when build_model initializes the groups itself.
    """

    dtype: Optional[torch.dtype] = None
    value_head: bool = False
    use_te: Optional[bool] = None
    config_overrides: dict[str, Any] = field(default_factory=dict)
    wrap_with_ddp: bool = False
    ddp_config: Optional[dict[str, Any]] = None
    seed: int = 1234

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


def _attach_value_head(model, pre_process, post_process, config, hf_config):
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


def _config_overrides(hf_config: PretrainedConfig, layout: ParallelLayout, options: ModelOptions) -> dict:
    on_cpu = not torch.cuda.is_available()
    use_te = _use_te(options)
    over: dict[str, Any] = {
        "sequence_parallel": layout.use_sequence_parallel,
        # Fused kernels live in TE/apex or CUDA extensions; plain ops are exact on any device.
        "persist_layer_norm": False,
        "masked_softmax_fusion": False,
        "gradient_accumulation_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "moe_grouped_gemm": use_te,  # local spec: its own grouped linears, no grouped_gemm pkg
        "use_cpu_initialization": on_cpu,
    }
    mt = hf_config.model_type
    if mt == "mixtral":
        # HF Mixtral renormalizes the top-k probabilities; mbridge's pre-softmax does not.
        over["moe_router_pre_softmax"] = False
    elif mt == "qwen3_moe":
        # HF Qwen3-MoE renormalizes top-k only when norm_topk_prob is set.
        over["moe_router_pre_softmax"] = not bool(getattr(hf_config, "norm_topk_prob", False))
    if num_experts_of(hf_config):
        over["moe_token_dispatcher_type"] = "alltoall"
    over.update(options.config_overrides)
    return over


def _use_te(options: ModelOptions) -> bool:
    from .local_spec import transformer_engine_available

    return transformer_engine_available() if options.use_te is None else bool(options.use_te)


def _check_hf_dir_has_weights(hf_dir: str) -> None:
    from .hf_config import CheckpointFileError

    files = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
    if not files:
        bins = [f for f in os.listdir(hf_dir) if f.endswith(".bin")]
        hint = f" (found {bins}: convert .bin checkpoints to safetensors first)" if bins else ""
        raise CheckpointFileError(f"no *.safetensors weight files in {hf_dir!r}{hint}")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        import json

        with open(index) as f:
            shards = set(json.load(f).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not os.path.isfile(os.path.join(hf_dir, s)))
        if missing:
            raise CheckpointFileError(f"{index} lists shard(s) missing from {hf_dir!r}: {missing}")


def build_model(
    hf: Union[str, os.PathLike, PretrainedConfig],
    layout: Optional[ParallelLayout] = None,
    options: Optional[ModelOptions] = None,
    load_weights: bool = True,
) -> MegatronModel:
    """Megatron model chunks for `hf` (an HF directory or config) at `layout`.

    The layout is validated against the config before any process-group work. If megatron's
    groups are not initialized (or were initialized at another layout), this initializes them
    (gloo on CPU, nccl on GPU). With `load_weights` and a directory, HF safetensors are loaded.
    """
    options = options or ModelOptions()
    source_dir = None if isinstance(hf, PretrainedConfig) else os.fspath(hf)
    hf_config = load_hf_config(hf)
    if layout is None:
        layout = ParallelLayout()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else None
    if world is None and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
    validate_layout(layout, hf_config, world)
    if num_experts_of(hf_config) and layout.tp > 1 and not layout.use_sequence_parallel:
        raise LayoutError(f"MoE with TP={layout.tp} needs sequence parallelism (megatron requires it)")
    if load_weights and source_dir is not None:
        _check_hf_dir_has_weights(source_dir)

    apply_cpu_compat()
    from .parallel import current_layout, init_parallel
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized() or _without_sp(current_layout()) != _without_sp(layout):
        init_parallel(layout, seed=options.seed)

    bridge = _make_bridge(hf_config, layout, options)
    callbacks = [_attach_value_head] if options.value_head else []
    dtype = options.resolved_dtype()
    chunks = bridge.get_model(
        weight_path=None,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        wrap_with_ddp=options.wrap_with_ddp,
        ddp_config=options.ddp_config,
        use_cpu_initialization=not torch.cuda.is_available(),
        post_model_creation_callbacks=callbacks,
    )
    model = MegatronModel(chunks, bridge, hf_config, layout, options, source_dir)
    if load_weights and source_dir is not None:
        from .weights import load_hf_weights

        load_hf_weights(model, source_dir)
    return model


def _without_sp(layout: ParallelLayout) -> tuple:
    return (layout.tp, layout.pp, layout.vpp, layout.ep, layout.expert_tp, layout.cp)


def _make_bridge(hf_config: PretrainedConfig, layout: ParallelLayout, options: ModelOptions):
    from mbridge import AutoBridge

    from .local_spec import decoder_block_spec

    bridge_config = hf_config
    if options.value_head and getattr(hf_config, "tie_word_embeddings", False):
        # A critic's head is not the embedding: build untied so nothing syncs the two.
        import copy

        bridge_config = copy.deepcopy(hf_config)
        bridge_config.tie_word_embeddings = False
    bridge = AutoBridge.from_config(bridge_config, dtype=options.resolved_dtype())
    # mbridge's Qwen2 bridge writes the tied-embedding mapping into a class-level dict, so one
    # tied model would make every later untied model in the process export embed_tokens as
    # lm_head. Give each bridge its own mapping.
    mapping = dict(type(bridge)._DIRECT_MAPPING)
    tied = bool(getattr(bridge_config, "tie_word_embeddings", False))
    mapping["output_layer.weight"] = "model.embed_tokens.weight" if tied else "lm_head.weight"
    bridge._DIRECT_MAPPING = mapping
    bridge.set_extra_args(**_config_overrides(hf_config, layout, options))
    use_te = _use_te(options)

    def layer_spec(self, vp_stage: Optional[int] = None):
        self.has_vp_stage = True
        return decoder_block_spec(self.config, vp_stage=vp_stage, use_te=use_te)

    bridge._get_transformer_layer_spec = types.MethodType(layer_spec, bridge)
    return bridge
