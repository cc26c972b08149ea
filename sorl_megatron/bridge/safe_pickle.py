"""Refuse pickles that could run code, before anything unpickles them.

Torch DCP writes its ``.metadata`` with plain ``pickle`` and reads it back with
``pickle.load``; megatron's ``common.pt`` and DCP's byte items are ``torch.save`` archives.
Unpickling calls whatever the pickle names (``os.system`` is two opcodes away), so
``weights_only=True`` on our own loads is not enough. :func:`check_pickle` walks the opcodes
(``pickletools.genops``, no object is built) and allows only ``GLOBAL`` / ``STACK_GLOBAL``
references on an explicit allow-list: the classes these files really contain (found by
scanning checkpoints the tests save), all inert constructors or values.
"""

from __future__ import annotations

import _compat_pickle
import io
import os
import pickle
import pickletools
from typing import AbstractSet, Optional, Union

import torch

from .hf_config import CheckpointFileError


class UnsafeCheckpointError(CheckpointFileError):
    """A checkpoint file holds a pickle that references something off the allow-list."""

    def __init__(self, path: str, what: str):
        super().__init__(f"{path}: refused to load: {what} (only checkpoints this code wrote are loadable)")
        self.path = path
        self.what = what


_DTYPES = frozenset(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))
_STORAGES = frozenset(n for n in dir(torch) if n.endswith("Storage") and n[0].isupper())

# torch DCP Metadata as megatron-core 0.16 / torch 2.13 write it (with megatron's all_local_plans);
# all dataclasses, enums or values. tests/bridge scan checkpoints the tests save against it.
DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )}
    | {("torch.distributed.checkpoint.planner", n)
       for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
       ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
       ("torch.serialization", "_get_layout"),  # name -> torch.layout, a dict lookup
       ("torch", "Size"),
       ("collections", "OrderedDict")}
    | {("torch", n) for n in _DTYPES}
)

# torch.save archives megatron writes (common.pt: optimizer param groups; DCP byte items).
TORCH_SAVE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2")}
    | {("torch", n) for n in _DTYPES | _STORAGES}
)

_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"}  # bytes strings: not names
_MEMO_GET = {"GET", "BINGET", "LONG_BINGET"}
_MEMO_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}
_PERSISTENT = {"PERSID", "BINPERSID"}
_NEVER = {"EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"}


def _as_loaded(module: str, name: str, protocol: int) -> tuple[str, str]:
    """The (module, name) pickle's find_class really imports (Python 2 names are remapped)."""
    if protocol < 3:
        if (module, name) in _compat_pickle.NAME_MAPPING:
            return _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    return module, name


def pickle_globals(data: bytes, where: str, persistent_ids: bool = False) -> list[tuple[str, str]]:
    """Every global the pickle in ``data`` would import, in order. Raises UnsafeCheckpointError
    for what cannot be checked statically (extension codes, a STACK_GLOBAL whose operands are
    not literal strings, persistent ids where the loader has no persistent_load)."""
    found: list[tuple[str, str]] = []
    # Literal strings on top of the stack: ops that only push a string (or fetch one from
    # the memo) append; memo writes leave the stack alone; any other op resets it (its
    # effect on the stack is not modelled), so the top entries here are exact.
    pushed: list[Optional[str]] = []
    memo: dict[int, Optional[str]] = {}
    protocol = 0
    try:
        for op, arg, _pos in pickletools.genops(io.BytesIO(data)):
            name = op.name
            if name == "PROTO":
                protocol = int(arg)
            elif name in _STRING_OPS:
                pushed.append(arg if isinstance(arg, str) else None)
            elif name in _MEMO_GET:
                pushed.append(memo.get(int(arg)))
            elif name in _MEMO_PUT or name == "MEMOIZE":
                memo[len(memo) if name == "MEMOIZE" else int(arg)] = pushed[-1] if pushed else None
            elif name == "FRAME":
                pass
            else:
                if name in ("GLOBAL", "INST"):
                    module, _, attr = str(arg).partition(" ")
                    found.append(_as_loaded(module, attr, protocol))
                elif name == "STACK_GLOBAL":
                    if len(pushed) < 2 or pushed[-1] is None or pushed[-2] is None:
                        raise UnsafeCheckpointError(where, "a STACK_GLOBAL whose module/name are not literal strings")
                    found.append((pushed[-2], pushed[-1]))
                elif name in _PERSISTENT and not persistent_ids:
                    raise UnsafeCheckpointError(where, f"persistent id opcode {name} in a plain pickle")
                elif name in _NEVER:
                    raise UnsafeCheckpointError(where, f"pickle opcode {name}")
                pushed = []
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated or not a pickle: genops raises ValueError and friends
        raise UnsafeCheckpointError(where, f"not a readable pickle ({type(e).__name__}: {e})") from None
    return found


def check_pickle(
    data: bytes, allowed: AbstractSet[tuple[str, str]], where: str, persistent_ids: bool = False
) -> None:
    """Raise UnsafeCheckpointError naming ``where`` and the first global not in ``allowed``."""
    for module, name in pickle_globals(data, where, persistent_ids):
        if (module, name) not in allowed:
            raise UnsafeCheckpointError(where, f"the pickle references {module}.{name}, which is not on the allow-list")


def check_pickle_file(path: Union[str, os.PathLike], allowed: AbstractSet[tuple[str, str]]) -> None:
    with open(path, "rb") as f:
        check_pickle(f.read(), allowed, os.fspath(path))


def check_torch_save(data: bytes, where: str, allowed: AbstractSet[tuple[str, str]] = TORCH_SAVE_GLOBALS) -> None:
    """Check a ``torch.save`` archive's ``data.pkl``, read with the zip reader torch.load uses
    (so no zip-parser difference can show this check one pickle and torch.load another).
    The legacy non-zip format is refused: it is a chain of pickles torch.load reads its own way."""
    if not data.startswith(b"PK\x03\x04"):
        raise UnsafeCheckpointError(where, "not a torch.save zip archive (legacy or foreign format)")
    try:
        record = torch._C.PyTorchFileReader(io.BytesIO(data)).get_record("data.pkl")
    except RuntimeError as e:
        raise UnsafeCheckpointError(where, f"unreadable torch.save archive ({e})") from None
    check_pickle(bytes(record), allowed, f"{where} (data.pkl)", persistent_ids=True)


def check_torch_save_file(path: Union[str, os.PathLike], allowed: AbstractSet[tuple[str, str]] = TORCH_SAVE_GLOBALS):
    with open(path, "rb") as f:
        check_torch_save(f.read(), os.fspath(path), allowed)


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file, allowed: AbstractSet[tuple[str, str]], where: str):
        super().__init__(file)
        self._allowed, self._where = allowed, where

    def find_class(self, module: str, name: str):
        if (module, name) not in self._allowed:
            raise UnsafeCheckpointError(self._where, f"the pickle references {module}.{name}")
        return super().find_class(module, name)


def load_checked_pickle(path: Union[str, os.PathLike], allowed: AbstractSet[tuple[str, str]]):
    """Scan, then unpickle with find_class restricted to the same allow-list."""
    with open(path, "rb") as f:
        data = f.read()
    where = os.fspath(path)
    check_pickle(data, allowed, where)
    return _AllowListUnpickler(io.BytesIO(data), allowed, where).load()
