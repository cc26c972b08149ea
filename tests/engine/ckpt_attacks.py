"""Damage and planted pickles for engine checkpoints (used by the worker and by pytest)."""

from __future__ import annotations

import io
import os
import pickle

import torch


class Evil:
    """Unpickling it runs ``touch MARKER``: a checkpoint refusing it must leave no marker."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def evil_pickle(marker: str) -> bytes:
    return pickle.dumps(Evil(marker), protocol=4)


def evil_torch_save(marker: str) -> bytes:
    buf = io.BytesIO()
    torch.save({"param_groups": [Evil(marker)]}, buf)
    return buf.getvalue()


def flip_bit(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


def truncate(path: str, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def plant_in_byte_item(dist_dir: str, marker: str) -> str:
    """Point the first byte item of a DCP directory at a new shard holding a torch.save payload
    that runs code: the .metadata itself stays within the allow-list, but DCP would hand the
    item to ``torch.load(weights_only=False)``. Returns the new shard's name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    md_path = os.path.join(dist_dir, ".metadata")
    with open(md_path, "rb") as f:
        metadata = pickle.load(f)  # our own test checkpoint
    key = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    payload = evil_torch_save(marker)
    write(os.path.join(dist_dir, "__evil.distcp"), payload)
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__evil.distcp", 0, len(payload))
    with open(md_path, "wb") as f:
        pickle.dump(metadata, f)
    return "__evil.distcp"
