"""Hostile or broken copies of a tiny HF checkpoint (tests/bridge/test_hostile_checkpoints.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _edit_tensors(d: Path, edit: Callable[[dict], None]) -> None:
    state = load_file(str(d / WEIGHTS))
    edit(state)
    save_file(state, str(d / WEIGHTS), metadata={"format": "pt"})


def _edit_config(d: Path, **change) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))


def _sharded(d: Path, weight_map_of: Callable[[dict], dict]) -> None:
    """Move the weights into shard.safetensors listed by an index that ``weight_map_of`` rewrites."""
    names = list(load_file(str(d / WEIGHTS)))
    os.replace(d / WEIGHTS, d / "shard.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map_of({n: "shard.safetensors" for n in names})}))


def _outside_index(d: Path) -> None:
    other = d.parent / "other"
    other.mkdir(exist_ok=True)
    shutil.copy(d / WEIGHTS, other / "x.safetensors")
    _sharded(d, lambda m: {**m, Q_PROJ: "../other/x.safetensors"})


def _absolute_index(d: Path) -> None:
    other = d.parent / "abs.safetensors"
    shutil.copy(d / WEIGHTS, other)
    _sharded(d, lambda m: {**m, Q_PROJ: str(other)})


def _symlinked_out(d: Path) -> None:
    other = d.parent / "elsewhere.safetensors"
    os.replace(d / WEIGHTS, other)
    (d / WEIGHTS).symlink_to(other)


def _index_text(text: str) -> Callable[[Path], None]:
    def write(d: Path) -> None:
        _sharded(d, lambda m: m)
        (d / "model.safetensors.index.json").write_text(text)

    return write


def _truncated(d: Path) -> None:
    data = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(data[: len(data) - 1000])


def _wrong_shape(state: dict) -> None:
    state[Q_PROJ] = torch.randn(state[Q_PROJ].shape[0] + 8, state[Q_PROJ].shape[1])


def _extra_layer(state: dict) -> None:
    state["model.layers.7.mlp.down_proj.weight"] = torch.randn(4, 4)


def _nan(state: dict) -> None:
    state[Q_PROJ][3, 5] = float("nan")


def _int32(state: dict) -> None:
    state[Q_PROJ] = state[Q_PROJ].to(torch.int32)


# name -> (how to break a copy, what the one-line error must say)
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "index_parent_path": (_outside_index, "'../other/x.safetensors' resolves to"),
    "index_absolute_path": (_absolute_index, "is an absolute path; files must be inside"),
    "symlink_out": (_symlinked_out, "'model.safetensors' resolves to"),
    "index_not_json": (_index_text("{"), "model.safetensors.index.json: not valid JSON"),
    "index_no_weight_map": (_index_text('{"weight_map": []}'), "needs a non-empty 'weight_map' object"),
    "index_lists_absent_tensor": (lambda d: _sharded(d, lambda m: {**m, "model.extra.weight": "shard.safetensors"}),
                                  "tensor(s) 'model.extra.weight' listed in"),
    "truncated": (_truncated, "the file is truncated"),
    "int32": (lambda d: _edit_tensors(d, _int32), f"tensor '{Q_PROJ}' is I32, not a floating-point weight"),
    "layers_0": (lambda d: _edit_config(d, num_hidden_layers=0), "num_hidden_layers must be an integer in [1,"),
    "layers_neg": (lambda d: _edit_config(d, num_hidden_layers=-2), "num_hidden_layers must be an integer in [1,"),
    "hidden_65": (lambda d: _edit_config(d, hidden_size=65), "hidden_size 65 is not divisible by num_attention_heads"),
    "vocab_1e11": (lambda d: _edit_config(d, vocab_size=1e11), "vocab_size must be an integer in [1, 2147483647]"),
    # found against the model (mbridge's names and shapes) or while loading
    "extra_layer": (lambda d: _edit_tensors(d, _extra_layer),
                    "1 tensor(s) the model does not use: 'model.layers.7.mlp.down_proj.weight'"),
    # config.json's sizes against the safetensors headers, before any model is built
    "wrong_shape": (lambda d: _edit_tensors(d, _wrong_shape), f"say {Q_PROJ} is [64, 64], but the safetensors header"),
    "nan": (lambda d: _edit_tensors(d, _nan), f"tensor '{Q_PROJ}' holds NaN or infinite values"),
}
NEEDS_MODEL = ("extra_layer", "wrong_shape", "nan")


def make_case(src: Path, root: Path, case: str) -> Path:
    """A copy of ``src`` under ``root/case/model`` broken as ``case`` says."""
    d = root / case / "model"
    shutil.copytree(src, d)
    CASES[case][0](d)
    return d
