"""Build Megatron GPT model chunks (and the mbridge bridge) from an HF directory or config."""

from __future__ import annotations

import copy
import os
import types
from typing import Any, Optional, Union

import torch
from transformers import PretrainedConfig

from .cpu_compat import apply_cpu_compat
from .families import bridge_class, family_config_overrides, local_spec_layout_problem
from .hf_checkpoint import read_checkpoint
from .hf_config import load_hf_config
from .layout import LayoutError, ParallelLayout, megatron_pipeline_split, num_experts_of, validate_layout
from .model import MegatronModel, ModelOptions, attach_value_head
from .parallel import current_layout, init_parallel
from .weights import load_hf_weights


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
    if num_experts_of(hf_config):
        over["moe_token_dispatcher_type"] = "alltoall"
    over.update(megatron_pipeline_split(layout))  # layer offsets follow it: mbridge maps by layer_number
    over.update(family_config_overrides(hf_config, on_gpu_te=use_te and not on_cpu))
    over.update(options.config_overrides)
    return over


def _use_te(options: ModelOptions) -> bool:
    # local_spec imports megatron.core (seconds): only when a model is actually built.
    from .local_spec import transformer_engine_available

    use_te = transformer_engine_available() if options.use_te is None else bool(options.use_te)
    if options.fp8 is not None and options.fp8.enabled and not use_te:
        # FP8 is TE's: the local layer spec has no FP8 GEMMs, and running it in bf16 would hide that
        raise ValueError("model.fp8.enabled=true needs the TransformerEngine layer spec "
                         f"(transformer_engine importable, use_te not false; use_te={options.use_te})")
    return use_te


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
        read_checkpoint(source_dir)  # index, file references, headers: refused before anything is built

    apply_cpu_compat()  # before megatron's first import (it quiets the CPU-only import warnings)
    problem = None if _use_te(options) else local_spec_layout_problem(hf_config, layout.tp)
    if problem:
        raise LayoutError(problem, ("tp",))
    from megatron.core import parallel_state as mpu


    if not mpu.model_parallel_is_initialized() or _without_sp(current_layout()) != _without_sp(layout):
        init_parallel(layout, seed=options.seed)

    bridge = _make_bridge(hf_config, layout, options)
    callbacks = [attach_value_head] if options.value_head else []
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
        load_hf_weights(model, source_dir)
    return model


def _without_sp(layout: ParallelLayout) -> tuple:
    return (layout.tp, layout.pp, layout.vpp, layout.ep, layout.expert_tp, layout.cp)


def _bridge_class(hf_config: PretrainedConfig):
    """mbridge's registered bridge class for the config's family, as its spec fixes it where
    0.15.1 does not run on megatron-core 0.16.1 (families/)."""
    from mbridge.core.auto_bridge import _MODEL_REGISTRY

    return bridge_class(hf_config, _MODEL_REGISTRY)


def _make_bridge(hf_config: PretrainedConfig, layout: ParallelLayout, options: ModelOptions):
    from .local_spec import decoder_block_spec

    bridge_config = hf_config
    if options.value_head and getattr(hf_config, "tie_word_embeddings", False):
        # A critic's head is not the embedding: build untied so nothing syncs the two.
        bridge_config = copy.deepcopy(hf_config)
        bridge_config.tie_word_embeddings = False
    bridge = _bridge_class(bridge_config)(bridge_config, dtype=options.resolved_dtype())
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
        return decoder_block_spec(self.config, vp_stage=vp_stage, use_te=use_te,
                                  local_attention=options.local_attention, expert_gemm=options.expert_gemm)

    bridge._get_transformer_layer_spec = types.MethodType(layer_spec, bridge)
    return bridge
