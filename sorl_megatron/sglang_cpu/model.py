"""The served model: checkpoint, tokenizer, the HF module built from it, and weight updates.

The scheduler thread is the only one that runs forwards or changes the weights (weight
updates reach it through ``RolloutEngine.call``). As in SGLang (whose updates wait for
in-flight requests), tensors sent between ``begin_update`` and ``end_update``, and the
``weight_version`` sent with them, take effect together at the end; the model is rebuilt
once, and the prefix cache (KV of other weights) is dropped with every rebuild.

Routed experts come from forward hooks on the model's own MoE routers (``RouterTap``), which
also apply the study's route-flip injector (``route_flip.py``) when it is on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, DynamicCache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..bridge.hf_config import require_hf_dir
from ..common.hf_build import HF_BUILD_LOCK
from .batch import KV, PrefixCache
from .options import EngineConfig
from .precision import apply_precision
from .route_flip import RouteFlipper
from .rowwise import expert_modules
from .weights import check_compatible, dequantize_fp8_pairs, read_checkpoint

transformers.utils.logging.disable_progress_bar()


class RouterTap:
    """Forward hooks on the model's own MoE routers, recording top-k expert ids per layer.

    As SGLang's capture buffer, the routing has one row per decoder layer; dense layers
    (DeepSeek-V3 / GLM-4.5's leading ones) are never routed and read -1. With a ``flipper``
    (the route-flip injector) the hooks return the perturbed routing, which the MoE block then
    computes with and which is what gets recorded."""

    def __init__(self, model: torch.nn.Module, num_layers: int, flipper: RouteFlipper | None = None):
        # Qwen/Mixtral name theirs *TopKRouter, DeepSeek-V3 / GLM-4.5 *TopkRouter.
        found = [(n, m) for n, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")]
        self.routers = [m for _, m in found]
        self.layers = [_layer_index(n) for n, _ in found]
        self.num_layers = num_layers
        self.active = False
        self._records: list[torch.Tensor | None] = [None] * len(self.routers)
        self.flipper = flipper if flipper is not None and flipper.fraction > 0 else None
        if self.flipper is not None:
            self.flipper.check(self.routers)
        for i, m in enumerate(self.routers):
            m.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def fn(mod, _inp, out):
            if self.flipper is not None:
                out = self.flipper.apply(mod, self.layers[i], out)
            if self.active:
                self._records[i] = out[2].to(torch.int32)  # (logits, scores, indices)
            return out

        return fn

    @property
    def top_k(self) -> int:
        return int(getattr(self.routers[0], "top_k", 0)) if self.routers else 0

    def take(self, batch: int, seq: int) -> np.ndarray:
        """``[batch, seq, num_layers, top_k]`` routing of the last forward (-1 on dense layers)."""
        out = torch.full((batch, seq, self.num_layers, self.top_k), -1, dtype=torch.int32)
        for layer, r in zip(self.layers, self._records):
            out[:, :, layer] = r.reshape(batch, seq, -1)  # type: ignore[union-attr]
        self._records = [None] * len(self.routers)
        return out.numpy()


def _layer_index(module_name: str) -> int:
    parts = module_name.split(".")
    if "layers" not in parts:
        raise ValueError(f"MoE router {module_name!r} is not inside a decoder layer (model.layers.N)")
    return int(parts[parts.index("layers") + 1])


def _eos_ids(config, tokenizer, gen_config) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(config, "eos_token_id", None), getattr(gen_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class ServedModel:
    """The checkpoint (``state``, float32, HF checkpoint names), the model built from it in the
    configured precision, its tokenizer and the version it reports. Weight updates and forwards:
    scheduler thread only."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model_path = cfg.model_path
        self.weight_version = cfg.weight_version
        require_hf_dir(cfg.model_path, "rollout model path")
        if cfg.tokenizer_path and not cfg.skip_tokenizer_init:
            require_hf_dir(cfg.tokenizer_path, "rollout tokenizer path", config=False)
        self.hf_config = AutoConfig.from_pretrained(cfg.model_path)
        self.tokenizer = (
            None if cfg.skip_tokenizer_init else AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.model_path)
        )
        try:
            gen_cfg = transformers.GenerationConfig.from_pretrained(cfg.model_path)
        except OSError:
            gen_cfg = None
        self.eos_ids = _eos_ids(self.hf_config, self.tokenizer, gen_cfg)
        self.pad_id = int(getattr(self.hf_config, "pad_token_id", None) or 0)
        self.context_length = cfg.context_length or int(getattr(self.hf_config, "max_position_embeddings", 4096))
        self.state = read_checkpoint(cfg.model_path)
        self.prefix_cache = PrefixCache(cfg.prefix_cache_max_tokens)
        self.gen = 0  # bumped whenever the served weights change (KV records the one it was computed with)
        self._in_update = False
        self._dirty = False
        self._pending_version: str | None = None  # applied with the weights at end_update
        self._build()

    def _build(self) -> None:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(self.hf_config)]
        with HF_BUILD_LOCK:
            model = cls.from_pretrained(None, config=self.hf_config, state_dict=self.state, dtype=torch.float32)
        model = apply_precision(model.eval(), self.cfg.precision, self.cfg.fp8_block_size)
        self.model = model
        flipper = RouteFlipper(self.cfg.inject_route_flip_fraction, self.cfg.inject_route_flip_seed)
        self.tap = RouterTap(model, int(self.hf_config.num_hidden_layers), flipper)
        self.experts = expert_modules(model)  # what a batch-invariant prefill runs row by row
        self._dirty = False
        self.gen += 1
        self.prefix_cache.clear()  # KV of other weights must not be reused

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head: valid token ids are ``[0, vocab_size)``."""
        return int(self.hf_config.vocab_size)

    @property
    def is_moe(self) -> bool:
        return bool(self.tap.routers)

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        return (self.tap.num_layers, self.tap.top_k) if self.is_moe else None

    @property
    def kv_heads(self) -> int:
        c = self.hf_config
        return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)

    @property
    def rowwise_prefill(self) -> bool:
        """Whether prompts may be prefilled together batch-invariantly (``forward.prefill_rowwise``):
        a dense model, or an MoE whose expert modules ``rowwise`` knows how to run row by row."""
        return not self.is_moe or bool(self.experts)

    def wants_routing(self, seqs) -> bool:
        return self.is_moe and any(s.req.return_routed_experts for s in seqs)

    # ----- forwards -----

    def _cache(self, kv: KV | None) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        if kv is not None:
            for layer, (k, v) in zip(cache.layers, kv):
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
        return cache

    def run(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, kv: KV | None, keep: int):
        """One forward: logits of the last ``keep`` positions and the KV grown by ``ids``."""
        cache = self._cache(kv)
        if self.tap.flipper is not None:  # the injector keys its flips on each token's id and position
            self.tap.flipper.bind(ids, pos)
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=keep,
            )
        finally:
            if self.tap.flipper is not None:
                self.tap.flipper.bind(None, None)
        return out.logits.float(), [(layer.keys, layer.values) for layer in cache.layers]

    # ----- weight updates (scheduler thread only, via RolloutEngine.call) -----

    def update_from_disk(self, model_path: str, weight_version: str | None) -> str:
        new = read_checkpoint(model_path)
        check_compatible(self.state, new, full=True)
        self.state = new
        self._build()
        self.model_path = model_path
        self._pending_version = None  # tensors sent before are replaced by the checkpoint
        if weight_version is not None:
            self.weight_version = weight_version
        return f"loaded {len(new)} tensors from {model_path}"

    def begin_update(self) -> str:
        self._in_update = True
        return "weight update begun"

    def update_from_tensors(self, named: dict[str, torch.Tensor], weight_version: str | None) -> str:
        named = dequantize_fp8_pairs(named, self.cfg.fp8_block_size)  # an FP8 export's pairs -> float32
        check_compatible(self.state, named, full=False)
        for k, v in named.items():
            self.state[k] = v.detach().to(torch.float32).clone()
        self._dirty = True
        if weight_version is not None:
            self._pending_version = weight_version
        if not self._in_update:  # older protocol without begin/end: apply at once
            self._apply_pending()
        return f"updated {len(named)} tensors"

    def end_update(self) -> str:
        self._in_update = False
        self._apply_pending()
        return "weight update ended"

    def set_weight_version(self, version: str) -> str:
        """``/update_weight_version``: within begin/end it labels the weights applied at the end."""
        if self._in_update:
            self._pending_version = version
            return f"weight_version {version} takes effect at /end_weight_update"
        self.weight_version = version
        return f"weight_version set to {version}"

    def _apply_pending(self) -> None:
        # The served model and the version it reports change together, between decode steps.
        if self._dirty:
            self._build()
        if self._pending_version is not None:
            self.weight_version, self._pending_version = self._pending_version, None

    @property
    def in_update(self) -> bool:
        """Between ``/begin_weight_update`` and ``/end_weight_update``."""
        return self._in_update

    def model_info(self) -> dict[str, Any]:
        """``/model_info``: the fields SGLang's answers with (no layer counts, no top-k: a client
        takes the routing shape from the model's config.json, as it must against SGLang)."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.cfg.tokenizer_path or self.cfg.model_path,
            "is_generation": True,
            "weight_version": self.weight_version,
            "model_type": getattr(self.hf_config, "model_type", None),
            "architectures": list(getattr(self.hf_config, "architectures", None) or []),
        }

    def info(self) -> dict[str, Any]:
        """What ``/server_info`` says about the model (the engine adds its own state)."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.cfg.tokenizer_path or self.cfg.model_path,
            "is_generation": True,
            "weight_version": self.weight_version,
            "precision": self.cfg.precision,
            "inject_route_flip_fraction": self.cfg.inject_route_flip_fraction,
            "architectures": list(getattr(self.hf_config, "architectures", None) or []),
            "num_hidden_layers": int(self.hf_config.num_hidden_layers),
            "num_moe_layers": len(self.tap.routers),
            "routed_experts_layers": self.tap.num_layers if self.is_moe else None,
            "num_experts_per_tok": self.tap.top_k if self.is_moe else None,
            "context_length": self.context_length,
            "eos_token_ids": sorted(self.eos_ids),
            "vocab_size": int(self.hf_config.vocab_size),
        }

