"""The pickle scan refuses every way a pickle can name a callable off the allow-list (all
protocols, memoized names, Python 2 names, extension codes), without running anything."""

from __future__ import annotations

import importlib
import io
import os
import pickle
import pickletools

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from sorl_megatron.bridge.safe_pickle import (
    DCP_METADATA_GLOBALS,
    TORCH_SAVE_GLOBALS,
    UnsafeCheckpointError,
    check_pickle,
    check_torch_save,
    load_checked_pickle,
    pickle_globals,
)

from ..engine.ckpt_attacks import Evil, evil_torch_save


def _op(name: str) -> bytes:
    return bytes([next(o.code for o in pickletools.opcodes if o.name == name).encode("latin-1")[0]])


def _short_str(s: str) -> bytes:
    return _op("SHORT_BINUNICODE") + bytes([len(s)]) + s.encode()


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_os_system_is_refused_at_every_protocol(protocol, tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps(Evil(str(marker)), protocol=protocol)
    with pytest.raises(UnsafeCheckpointError, match=r"x\.pkl: refused to load: .*posix\.system"):
        check_pickle(data, DCP_METADATA_GLOBALS, "x.pkl")
    (tmp_path / "x.pkl").write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        load_checked_pickle(tmp_path / "x.pkl", DCP_METADATA_GLOBALS)
    assert not marker.exists()


def test_memoized_names_are_followed():
    # "posix" is memoized, popped and fetched back before STACK_GLOBAL
    data = (_op("PROTO") + b"\x04" + _short_str("posix") + _op("MEMOIZE") + _op("POP") + _op("BINGET") + b"\x00"
            + _short_str("system") + _op("STACK_GLOBAL") + _op("STOP"))
    assert pickle_globals(data, "m") == [("posix", "system")]
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        check_pickle(data, DCP_METADATA_GLOBALS, "m")


def test_names_that_are_not_literal_strings_are_refused():
    data = _op("PROTO") + b"\x04" + _short_str("posix") + _op("NONE") + _op("STACK_GLOBAL") + _op("STOP")
    with pytest.raises(UnsafeCheckpointError, match="not literal strings"):
        check_pickle(data, DCP_METADATA_GLOBALS, "n")


def test_python2_names_are_checked_as_python_3_loads_them():
    data = b"\x80\x02c__builtin__\neval\nq\x00."
    assert pickle_globals(data, "p") == [("builtins", "eval")]
    with pytest.raises(UnsafeCheckpointError, match="builtins.eval"):
        check_pickle(data, DCP_METADATA_GLOBALS, "p")


@pytest.mark.parametrize(
    "data,needle",
    [
        (b"\x80\x02\x82\x01.", "EXT1"),  # the copyreg extension registry
        (b"\x80\x02K\x01Q.", "persistent id"),  # BINPERSID in a plain pickle
        (pickle.dumps({"a": 1})[:-3], "not a readable pickle"),  # truncated
        (b"", "not a readable pickle"),
    ],
)
def test_unverifiable_pickles_are_refused(data, needle):
    with pytest.raises(UnsafeCheckpointError, match=needle):
        check_pickle(data, DCP_METADATA_GLOBALS, "u")


def test_dcp_metadata_round_trips_through_the_restricted_loader(tmp_path):
    props = TensorProperties(dtype=torch.bfloat16)
    md = Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(props, torch.Size([4, 2]), [
            ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 2]))])},
        storage_data={MetadataIndex("w", torch.Size([0, 0])): "x"},
    )
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    got = load_checked_pickle(tmp_path / ".metadata", DCP_METADATA_GLOBALS)
    assert got.state_dict_metadata["w"].size == torch.Size([4, 2])
    assert got.state_dict_metadata["w"].properties.dtype == torch.bfloat16


def test_torch_save_archives(tmp_path):
    buf = io.BytesIO()
    torch.save({"step": torch.tensor(3.0), "groups": [{"lr": 1e-3}]}, buf)
    check_torch_save(buf.getvalue(), "common.pt")  # what megatron writes: accepted
    marker = tmp_path / "ran"
    with pytest.raises(UnsafeCheckpointError, match=r"evil\.pt \(data\.pkl\): .*posix\.system"):
        check_torch_save(evil_torch_save(str(marker)), "evil.pt")
    legacy = io.BytesIO()
    torch.save({"a": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeCheckpointError, match="not a torch.save zip archive"):
        check_torch_save(legacy.getvalue(), "old.pt")
    assert not marker.exists() and not os.path.exists("ran")
    assert ("torch", "BFloat16Storage") in TORCH_SAVE_GLOBALS


@pytest.mark.parametrize("allowed", [DCP_METADATA_GLOBALS, TORCH_SAVE_GLOBALS], ids=["dcp_metadata", "torch_save"])
def test_every_allowed_global_exists(allowed):
    """A renamed torch class would make the allow-list refuse real checkpoints: fail here first."""
    for module, name in allowed:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


def test_build_on_a_class_and_calls_of_non_globals_are_refused():
    # torch.Size (allowed) fetched as a global, then BUILD with state (None, {"__eq__": 1}):
    # pickle would setattr on the class itself
    size = _short_str("torch") + _short_str("Size") + _op("STACK_GLOBAL")
    state = _op("NONE") + _op("EMPTY_DICT") + _short_str("__eq__") + _op("BININT1") + b"\x01" + _op("SETITEM")
    data = _op("PROTO") + b"\x04" + size + state + _op("TUPLE2") + _op("BUILD") + _op("STOP")
    with pytest.raises(UnsafeCheckpointError, match=r"BUILD on torch\.Size itself"):
        check_pickle(data, DCP_METADATA_GLOBALS, "b")
    # calling the result of a call (not a named global)
    called = (_op("PROTO") + b"\x04" + size + _op("EMPTY_TUPLE") + _op("REDUCE") + _op("EMPTY_TUPLE")
              + _op("REDUCE") + _op("STOP"))
    with pytest.raises(UnsafeCheckpointError, match="not a named global"):
        check_pickle(called, DCP_METADATA_GLOBALS, "c")
    with pytest.raises(UnsafeCheckpointError, match="stack underflow"):
        check_pickle(_op("PROTO") + b"\x04" + _op("TUPLE2") + _op("STOP"), DCP_METADATA_GLOBALS, "d")


def test_stack_global_under_a_protocol_2_header_is_remapped_like_pickle_does():
    data = (_op("PROTO") + b"\x02" + _short_str("__builtin__") + _short_str("eval") + _op("STACK_GLOBAL")
            + _op("STOP"))
    assert pickle_globals(data, "q") == [("builtins", "eval")]
