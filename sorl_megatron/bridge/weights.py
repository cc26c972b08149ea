"""HF weights in and out of Megatron chunks: load safetensors, stream (hf_name, tensor)
buckets, and write a complete HF directory from any layout. What each rank sends in a
distributed weight sync is ``weight_sync.export``."""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterator, Optional

import torch
from safetensors.torch import save_file

from ..common import comm
from ..common.buckets import buckets
from ..common.fp8 import FP8_BLOCK, fp8_quantization_config, quantize_hf_tensor
from .hf_checkpoint import FiniteIO, check_against_model, read_checkpoint
from .hf_config import tokenizer_and_generation_files
from .model import MegatronModel, detached_value_heads

DEFAULT_BUCKET_BYTES = 512 * 1024**2
DEFAULT_SHARD_BYTES = 4 * 1024**3


def load_hf_weights(model: MegatronModel, hf_dir: str) -> None:
    """Load the HF safetensors in `hf_dir` into the chunks (any layout; all ranks call it).

    A checkpoint may come from a stranger (hf_checkpoint.py): its files stay inside `hf_dir`,
    every tensor is floating point, used by the model (or one transformers ignores too) and
    fits its parameter, and holds finite values; otherwise every rank raises the same
    CheckpointContentError naming the file and the tensor, before or while loading."""
    tensors = read_checkpoint(hf_dir)
    bridge = model.bridge
    make_io = bridge._get_safetensor_io
    with detached_value_heads(model), torch.no_grad():
        check_against_model(model, hf_dir, tensors)
        bridge._get_safetensor_io = lambda path: FiniteIO(make_io(path), tensors)
        try:
            bridge.load_weights(model.chunks, hf_dir)
        finally:
            del bridge._get_safetensor_io  # back to the class's reader
    model.source_dir = model.source_dir or hf_dir


def iter_hf_weights(model: MegatronModel, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (unsharded) tensors under HF names, one at a time, on every rank.

    Every rank must consume the whole iterator (gathers run inside). Tensors are fresh copies
    (never live parameters), each name appears once (tied embeddings at PP>1 are exported
    twice by mbridge), and a value model exports its backbone only.
    """
    seen: set[str] = set()
    with detached_value_heads(model), torch.no_grad():
        for name, tensor in model.bridge.export_weights(model.chunks):
            if name in seen:
                continue
            seen.add(name)
            out = tensor.detach()
            out = out.to(dtype) if dtype is not None and out.is_floating_point() else out.clone()
            yield name, out.contiguous()


def iter_hf_weight_buckets(
    model: MegatronModel,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: Optional[torch.dtype] = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group `iter_hf_weights` into lists of at most `bucket_bytes` (a larger tensor is
    sent alone; ``common.buckets``, the loop every weight sync uses)."""
    for bucket, _ in buckets(iter_hf_weights(model, dtype), bucket_bytes):
        yield bucket


class _ShardWriter:
    """Writes tensors to model-XXXXX-of-YYYYY.safetensors shards (or model.safetensors)."""

    def __init__(self, out_dir: str, max_shard_bytes: int):
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.cpu()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        idx = len(self.shards)
        save_file(self.pending, os.path.join(self.out_dir, f".shard-{idx:05d}.safetensors"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, final in enumerate(names):
            os.replace(os.path.join(self.out_dir, f".shard-{i:05d}.safetensors"), os.path.join(self.out_dir, final))
        index_path = os.path.join(self.out_dir, "model.safetensors.index.json")
        if n > 1:
            weight_map = {k: names[i] for i, keys in enumerate(self.shards) for k in keys}
            with open(index_path, "w") as f:
                json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        elif os.path.exists(index_path):
            os.remove(index_path)


def save_hf_checkpoint(
    model: MegatronModel,
    out_dir: str,
    dtype: Optional[torch.dtype] = None,
    fp8: bool = False,
    source_dir: Optional[str] = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Write an HF directory (safetensors shards + config.json + tokenizer files) from any layout.

    All ranks call this; rank 0 writes. dtype: exported dtype (None = the dtype named in the
    source config.json, e.g. bfloat16 for a bf16 checkpoint trained in fp32 on CPU; else the model's).
    fp8: block-quantize linear weights (see fp8.py); non-linear tensors use `dtype`.
    source_dir: where tokenizer/generation files are copied from (default: the load source).
    """
    dtype = dtype or source_dtype(model) or model.dtype
    writer = _ShardWriter(out_dir, max_shard_bytes) if comm.rank() == 0 else None
    if writer is not None:
        os.makedirs(out_dir, exist_ok=True)
    for name, tensor in iter_hf_weights(model, dtype):
        if writer is None:
            continue
        if fp8:
            for out_name, out_tensor in quantize_hf_tensor(name, tensor, FP8_BLOCK):
                writer.add(out_name, out_tensor)
        else:
            writer.add(name, tensor)
    if writer is not None:
        writer.close()
        write_hf_config(model, out_dir, dtype, fp8_quantization_config() if fp8 else None)
        source = source_dir or model.source_dir
        if source:
            copy_tokenizer_files(source, out_dir)
    comm.barrier()


_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def source_dtype(model: MegatronModel) -> Optional[torch.dtype]:
    """The dtype the source HF config.json declares (`dtype` or legacy `torch_dtype`), if any."""
    path = model.source_dir and os.path.join(model.source_dir, "config.json")
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        cfg = json.load(f)
    return _EXPORT_DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype")))


def write_hf_config(
    model: MegatronModel, out_dir: str, dtype: torch.dtype, quantization_config: Optional[dict]
) -> None:
    """config.json: the source config (as the user had it, not mbridge's normalized copy)
    with the exported dtype and, for FP8, the quantization_config."""
    source = model.source_dir and os.path.join(model.source_dir, "config.json")
    if source and os.path.isfile(source):
        with open(source) as f:
            cfg = json.load(f)
    else:
        cfg = model.hf_config.to_dict()
    cfg["dtype"] = str(dtype).replace("torch.", "")
    cfg.pop("torch_dtype", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    else:
        cfg.pop("quantization_config", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def copy_tokenizer_files(source_dir: str, out_dir: str) -> list[str]:
    copied = []
    if os.path.abspath(source_dir) == os.path.abspath(out_dir):
        return copied
    for name in tokenizer_and_generation_files(source_dir):
        shutil.copy2(os.path.join(source_dir, name), os.path.join(out_dir, name))
        copied.append(name)
    return copied
