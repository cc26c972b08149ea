"""Megatron distributed checkpoints (megatron-core dist_checkpointing), layout-independent.

A checkpoint directory holds
  model/               the dist_checkpointing files (sharded tensors under global names)
  hf/                  config.json + tokenizer files, so it can be rebuilt or exported to HF
  sorl_megatron.json   what was saved: model_type, layout, value_head, dtype, step
  MANIFEST.json        size and sha256 of every file above, written last (manifest.py)
Sharded tensors carry their global offsets (layers, TP shards, experts), so a run saved at
one TP/PP/VPP/EP layout loads at any other layout that `validate_layout` accepts.

Loading verifies the manifest, then scans every pickle megatron / torch DCP would unpickle
(``.metadata``, ``common.pt``, the byte items inside the ``.distcp`` shards) against an
allow-list (safe_pickle.py) before ``dist_checkpointing.load`` touches the directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Optional

from ..common import comm
from .build import build_model
from .hf_config import CheckpointFileError
from .layout import ParallelLayout
from .manifest import verify_manifest, write_manifest
from .model import MegatronModel, ModelOptions
from .safe_pickle import (
    DCP_METADATA_GLOBALS,
    UnsafeCheckpointError,
    check_torch_save,
    check_torch_save_file,
    load_checked_pickle,
)
from .weights import copy_tokenizer_files

META_FILE = "sorl_megatron.json"
FORMAT_VERSION = 1


def _sharded_state_dict(model: MegatronModel) -> dict[str, Any]:
    chunks = model.unwrapped()
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def save_megatron_checkpoint(
    model: MegatronModel, ckpt_dir: str, extra: Optional[dict] = None, manifest: bool = True
) -> None:
    """Save the model chunks (all ranks call this). ``manifest=False`` when the caller writes
    one manifest for a larger directory (engine checkpoints)."""
    from megatron.core import dist_checkpointing

    model_dir = os.path.join(ckpt_dir, "model")
    if comm.rank() == 0:
        if os.path.isdir(model_dir) and os.listdir(model_dir):
            shutil.rmtree(model_dir)  # dist_checkpointing would mix old and new shards
        os.makedirs(model_dir, exist_ok=True)
    comm.barrier()
    dist_checkpointing.save(_sharded_state_dict(model), model_dir)
    if comm.rank() == 0:
        hf_dir = os.path.join(ckpt_dir, "hf")
        os.makedirs(hf_dir, exist_ok=True)
        _write_config(model, hf_dir)
        if model.source_dir:
            copy_tokenizer_files(model.source_dir, hf_dir)
        meta = {
            "format_version": FORMAT_VERSION,
            "model_type": model.hf_config.model_type,
            "saved_layout": {f.name: getattr(model.layout, f.name)
                             for f in dataclasses.fields(model.layout) if f.compare},  # not its timeouts
            "world_size": comm.world_size(),
            "value_head": model.options.value_head,
            "dtype": str(model.dtype).replace("torch.", ""),
            "extra": extra or {},
        }
        with open(os.path.join(ckpt_dir, META_FILE), "w") as f:
            json.dump(meta, f, indent=2)
    comm.barrier()
    if manifest:
        write_manifest(ckpt_dir)
        comm.barrier()


def _write_config(model: MegatronModel, hf_dir: str) -> None:
    src = model.source_dir and os.path.join(model.source_dir, "config.json")
    if src and os.path.isfile(src):
        shutil.copy2(src, os.path.join(hf_dir, "config.json"))
    else:
        model.hf_config.save_pretrained(hf_dir)


def read_checkpoint_meta(ckpt_dir: str) -> dict:
    """The sorl_megatron.json of a checkpoint, with clear errors for incomplete directories."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointFileError(f"Megatron checkpoint directory {ckpt_dir!r} does not exist")
    meta_path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(meta_path):
        raise CheckpointFileError(
            f"{meta_path} not found: {ckpt_dir!r} is not a checkpoint written by save_megatron_checkpoint"
        )
    for required in ("model/metadata.json", "hf/config.json"):
        if not os.path.isfile(os.path.join(ckpt_dir, required)):
            raise CheckpointFileError(f"checkpoint {ckpt_dir!r} is incomplete: {required} is missing")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointFileError(f"{meta_path}: format_version {meta.get('format_version')} != {FORMAT_VERSION}")
    return meta


def check_dist_checkpoint(dist_dir: str) -> None:
    """Refuse a megatron dist_checkpointing directory whose pickles reference anything off the
    allow-lists, before megatron or torch DCP unpickles them (UnsafeCheckpointError names the
    file and the global). Also refuses shard paths that leave the directory."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    md_path = os.path.join(dist_dir, ".metadata")
    if not os.path.isfile(md_path):
        raise CheckpointFileError(f"{md_path} not found: {dist_dir!r} is not a complete dist checkpoint")
    metadata = load_checked_pickle(md_path, DCP_METADATA_GLOBALS)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(md_path, "no storage_data (not torch DCP metadata)")
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or os.path.basename(rel) != rel or rel in ("", ".", ".."):
            raise UnsafeCheckpointError(md_path, f"shard path {rel!r} is not a file of this directory")
    for name in sorted(os.listdir(dist_dir)):
        if name.endswith(".pt"):  # common.pt; ShardedObjects of other megatron strategies
            check_torch_save_file(os.path.join(dist_dir, name))
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        # DCP hands byte items to torch.load(weights_only=False) (DefaultLoadPlanner.load_bytes)
        info = storage.get(MetadataIndex(key))
        if info is None or info.transform_descriptors:
            raise UnsafeCheckpointError(md_path, f"byte item {key!r} has no plain storage entry")
        shard = os.path.join(dist_dir, info.relative_path)
        with open(shard, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise CheckpointFileError(f"{shard}: byte item {key!r} is truncated")
        check_torch_save(data, f"{shard} (byte item {key!r})")


def load_dist_checkpoint(sharded_state_dict: dict, dist_dir: str) -> dict:
    """``dist_checkpointing.load`` after :func:`check_dist_checkpoint` (every rank scans the
    files it is about to read)."""
    from megatron.core import dist_checkpointing

    check_dist_checkpoint(dist_dir)
    return dist_checkpointing.load(sharded_state_dict, dist_dir)


def load_megatron_checkpoint_into(model: MegatronModel, ckpt_dir: str, verify: bool = True) -> dict:
    """Load a checkpoint into already built chunks (any layout). Returns the checkpoint meta.

    All ranks call it. ``verify=False`` only when the caller verified a manifest that covers
    ``ckpt_dir`` (engine checkpoints)."""
    if verify:
        verify_manifest(ckpt_dir)
    meta = read_checkpoint_meta(ckpt_dir)
    if bool(meta["value_head"]) != model.options.value_head:
        kind = lambda v: "value (critic)" if v else "LM"  # noqa: E731
        raise CheckpointFileError(
            f"checkpoint {ckpt_dir!r} holds a {kind(meta['value_head'])} model but a "
            f"{kind(model.options.value_head)} model was built"
        )
    if meta["model_type"] != model.hf_config.model_type:
        raise CheckpointFileError(
            f"checkpoint {ckpt_dir!r} is {meta['model_type']!r}, the model is {model.hf_config.model_type!r}"
        )
    sharded = _sharded_state_dict(model)
    loaded = load_dist_checkpoint(sharded, os.path.join(ckpt_dir, "model"))
    chunks = model.unwrapped()
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for chunk, key in zip(chunks, keys):
        chunk.load_state_dict(loaded[key], strict=True)
    return meta


def load_megatron_checkpoint(
    ckpt_dir: str,
    layout: Optional[ParallelLayout] = None,
    options: Optional[ModelOptions] = None,
) -> MegatronModel:
    """Build the model from the checkpoint's config at `layout` and load its weights."""
    verify_manifest(ckpt_dir)  # before its config is read
    meta = read_checkpoint_meta(ckpt_dir)
    if options is None:
        options = ModelOptions(value_head=bool(meta["value_head"]))
    hf_dir = os.path.join(ckpt_dir, "hf")
    model = build_model(hf_dir, layout, options, load_weights=False)
    load_megatron_checkpoint_into(model, ckpt_dir)  # verified above: the cache makes this a stat
    return model
