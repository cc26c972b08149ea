"""Refuse pickles that could run code, before anything unpickles them.

Torch DCP writes its ``.metadata`` with plain ``pickle`` and reads it back with
``pickle.load``; megatron's ``common.pt`` and DCP's byte items are ``torch.save`` archives.
Unpickling calls whatever the pickle names (``os.system`` is two opcodes away), so
``weights_only=True`` on our own loads is not enough. :func:`check_pickle` runs the opcodes
symbolically (``pickletools.genops``, no object is built) and allows only ``GLOBAL`` /
``STACK_GLOBAL`` references on an explicit allow-list: the classes these files really
contain (found by scanning checkpoints the tests save), all inert constructors or values.
It also refuses what no checkpoint needs and gadgets use: calls of anything but a named
global, BUILD / item assignment on a class, extension codes, out-of-band buffers.
"""

from __future__ import annotations

import _compat_pickle
import io
import os
import pickle
import pickletools
from typing import AbstractSet, Union

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
_MEMO_PUT = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
_CALLS = {"REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ"}  # the callable is the first operand
_MUTATES = {"BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS"}  # the target is the first
_PERSISTENT = {"PERSID", "BINPERSID"}
_NEVER = {"EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"}

# What the symbolic stack knows of a value: ("str", s) a literal string, ("global", (module,
# name)) a class or function, or _OTHER.
_OTHER = ("other",)
# name -> (operands below the mark or in all, whether it consumes down to the last MARK)
_OPERANDS = {
    op.name: (op.stack_before.index(pickletools.markobject), True) if pickletools.markobject in op.stack_before
    else (len(op.stack_before), False)
    for op in pickletools.opcodes
}
# ops that only push one plain value (ints, floats, bytes, None, bools, empty containers): the fast path
_SIMPLE_PUSH = {
    op.name for op in pickletools.opcodes
    if not op.stack_before and len(op.stack_after) == 1 and op.stack_after[0] is not pickletools.markobject
    and op.name not in {"GLOBAL", "PERSID"} | _NEVER | _MEMO_GET | _STRING_OPS
}


def _as_loaded(module: str, name: str, protocol: int) -> tuple[str, str]:
    """The (module, name) pickle's find_class really imports (Python 2 names are remapped)."""
    if protocol < 3:
        if (module, name) in _compat_pickle.NAME_MAPPING:
            return _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    return module, name


def pickle_globals(data: bytes, where: str, persistent_ids: bool = False) -> list[tuple[str, str]]:
    """Every global the pickle in ``data`` would import, in order, from a symbolic run of its
    opcodes (their stack effects as pickletools documents them). Raises UnsafeCheckpointError
    for what cannot be checked statically or is never legitimate: extension codes, a
    STACK_GLOBAL whose operands are not literal strings, a call of anything but a global,
    BUILD / item assignment on a global (that would set attributes of a class), persistent
    ids where the loader has no persistent_load, a malformed stack."""
    found: list[tuple[str, str]] = []
    stack: list[tuple] = []
    marks: list[int] = []  # stack heights at each MARK (pickle keeps marks on a separate metastack)
    memo: dict[int, tuple] = {}
    protocol = 0

    def malformed(what: str):
        return UnsafeCheckpointError(where, f"malformed pickle ({what})")

    def pop(n: int) -> list[tuple]:
        if n > len(stack) - (marks[-1] if marks else 0):
            raise malformed("stack underflow")
        out = stack[len(stack) - n:]
        del stack[len(stack) - n:]
        return out

    try:
        for op, arg, _pos in pickletools.genops(io.BytesIO(data)):
            name = op.name
            if name in _SIMPLE_PUSH:
                stack.append(_OTHER)
                continue
            if name in _NEVER:
                raise UnsafeCheckpointError(where, f"pickle opcode {name}")
            if name in _PERSISTENT and not persistent_ids:
                raise UnsafeCheckpointError(where, f"persistent id opcode {name} in a plain pickle")
            if name == "PROTO":
                protocol = int(arg)
                continue
            if name == "MARK":
                marks.append(len(stack))
                continue
            if name in _MEMO_PUT:
                if len(stack) == (marks[-1] if marks else 0):
                    raise malformed(f"{name} with nothing to memoize")
                memo[len(memo) if name == "MEMOIZE" else int(arg)] = stack[-1]
                continue
            if name in _MEMO_GET:
                stack.append(memo.get(int(arg), _OTHER))
                continue
            if name == "DUP":
                stack.extend(pop(1) * 2)
                continue
            n_below, uses_mark = _OPERANDS[name]
            if uses_mark:
                if not marks:
                    raise malformed(f"{name} without a mark")
                at = marks.pop()
                above = stack[at:]
                del stack[at:]
                operands = pop(n_below) + above
            else:
                operands = pop(n_below)
            result = _OTHER
            if name in _STRING_OPS:
                result = ("str", arg)
            elif name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                found.append(_as_loaded(module, attr, protocol))
                result = ("global", found[-1]) if name == "GLOBAL" else _OTHER
            elif name == "STACK_GLOBAL":
                if any(o[0] != "str" for o in operands):
                    raise UnsafeCheckpointError(where, "a STACK_GLOBAL whose module/name are not literal strings")
                found.append(_as_loaded(operands[0][1], operands[1][1], protocol))
                result = ("global", found[-1])
            elif name in _CALLS and operands[0][0] != "global":
                raise UnsafeCheckpointError(where, f"{name} calls something that is not a named global")
            elif name in _MUTATES:
                if operands[0][0] == "global":
                    module, attr = operands[0][1]
                    raise UnsafeCheckpointError(where, f"{name} on {module}.{attr} itself (would change the class)")
                result = operands[0]
            stack.extend([result] * len(op.stack_after))
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
