"""Hostile or broken HF checkpoints (conversion and the trainer share the loader): files outside
the directory, extra / non-float / non-finite / misshapen tensors, truncated files, malformed
indexes and insane configs fail with one line naming the file and the key or tensor, before
anything is allocated where the headers and config suffice; the CLI exits 2."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from sorl_megatron.bridge import CheckpointContentError, build_model
from sorl_megatron.bridge.hf_checkpoint import read_checkpoint, unused_allowed

from .harness import PYTHON, REPO, run_command, torchrun_args
from .hostile import CASES, NEEDS_MODEL, Q_PROJ, WEIGHTS, make_case
from .tiny_models import deepseek_v3_config, qwen2_config, save_tiny_model

CLI = str(REPO / "tools" / "convert.py")
HEADER_CASES = [c for c in CASES if c not in NEEDS_MODEL]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return save_tiny_model("qwen2_tied", str(root / "qwen2_tied"), seed=3)


@pytest.mark.parametrize("case", HEADER_CASES)
def test_refused_from_headers_and_config_before_any_allocation(tiny, tmp_path, case):
    src = tiny
    d = make_case(Path(src), tmp_path, case)
    with pytest.raises(CheckpointContentError) as info:
        build_model(str(d))  # fails before megatron builds anything or a process group exists
    msg = str(info.value)
    assert CASES[case][1] in msg and "\n" not in msg, msg
    assert str(d) in msg  # names the file (or the directory a reference escapes)
    assert not torch.distributed.is_initialized()


def test_links_inside_the_directory_and_the_hub_cache_are_fine(tiny, tmp_path):
    src = tiny
    snapshot = tmp_path / "models--x" / "snapshots" / "abc123"
    blobs = tmp_path / "models--x" / "blobs"
    shutil.copytree(src, snapshot)
    blobs.mkdir()
    for name in (WEIGHTS, "tokenizer.json"):  # the hub cache's layout: snapshot files link to blobs
        os.replace(snapshot / name, blobs / name)
        (snapshot / name).symlink_to(os.path.join("..", "..", "blobs", name))
    os.replace(snapshot / "config.json", snapshot / "real_config.json")
    (snapshot / "config.json").symlink_to("real_config.json")
    assert Q_PROJ in read_checkpoint(str(snapshot))
    # but a tokenizer file linking elsewhere would be copied into every export: refused
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(tmp_path / "secret.json")
    with pytest.raises(CheckpointContentError, match="'tokenizer.json' resolves to .*secret.json, outside"):
        read_checkpoint(str(snapshot))


def test_what_a_model_may_leave_unused():
    ds = deepseek_v3_config()  # one MTP layer, stored as layer num_hidden_layers
    mtp = f"model.layers.{ds.num_hidden_layers}.eh_proj.weight"
    assert unused_allowed(ds, mtp, set(), value_head=False)
    assert not unused_allowed(ds, f"model.layers.{ds.num_hidden_layers + 1}.eh_proj.weight", set(), False)
    assert not unused_allowed(qwen2_config(), "model.layers.2.mlp.down_proj.weight", set(), False)
    assert unused_allowed(qwen2_config(tied=True), "lm_head.weight", set(), False)
    assert not unused_allowed(qwen2_config(tied=False), "lm_head.weight", set(), False)
    assert unused_allowed(qwen2_config(tied=False), "lm_head.weight", set(), value_head=True)
    assert unused_allowed(qwen2_config(), "model.layers.0.self_attn.rotary_emb.inv_freq", set(), False)
    # FP8 scales only where the loader dequantizes (mbridge's DeepSeek-V3 reader)
    assert not unused_allowed(qwen2_config(), f"{Q_PROJ}_scale_inv", {Q_PROJ}, False)


def _one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(lines) == 1, f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["index_parent_path", "vocab_1e11", "truncated", *NEEDS_MODEL])
def test_cli_exits_2_with_one_line(tiny, tmp_path, case):
    """Extra tensors and NaN converted silently before; a wrong shape raised a bare traceback."""
    src = tiny
    d = make_case(Path(src), tmp_path, case)
    out = tmp_path / "out"
    proc = run_command([PYTHON, CLI, "megatron-to-hf", "--hf", str(d), "--out", str(out)], timeout=300)
    line = _one_error_line(proc)
    assert CASES[case][1] in line, line
    assert not out.exists()  # refused before anything was written


@pytest.mark.slow
def test_extra_tensors_are_found_across_pipeline_stages(tiny, tmp_path):
    """At PP=2 each rank asks for half the tensors: the ranks pool what they use, so a tied
    model's clean checkpoint passes and a layer the config lacks is still found."""
    src = tiny
    clean = run_command([*torchrun_args(2), CLI, "verify", "--hf", src, "--layout", "pp=2", "--seq-len", "8"])
    assert clean.returncode == 0, clean.stderr[-3000:]
    d = make_case(Path(src), tmp_path, "extra_layer")
    proc = run_command([*torchrun_args(2), CLI, "verify", "--hf", str(d), "--layout", "pp=2", "--seq-len", "8"])
    assert proc.returncode != 0 and CASES["extra_layer"][1] in proc.stderr, proc.stderr[-3000:]
