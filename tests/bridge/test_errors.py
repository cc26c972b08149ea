"""Bad layouts and broken checkpoint directories fail before any process group exists,
with messages that name the layout, the number or the file."""

from __future__ import annotations

import json

import pytest
import torch

from sorl_megatron.bridge import (
    CheckpointFileError,
    LayoutError,
    ParallelLayout,
    UnsupportedModelError,
    build_model,
    read_checkpoint_meta,
    validate_layout,
)
from sorl_megatron.bridge.hf_config import load_hf_config

from .tiny_models import mixtral_config, qwen2_config, qwen3_moe_config


@pytest.fixture(autouse=True)
def no_process_group_after():
    yield
    # None of these errors may come after process-group work.
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "config,layout,world,needle",
    [
        (qwen2_config(), ParallelLayout(tp=3), None, "TP=3 does not divide num_attention_heads=4"),
        (qwen2_config(), ParallelLayout(tp=4), None, "TP=4 does not divide num_key_value_heads=2"),
        (qwen3_moe_config(), ParallelLayout(ep=3), None, "EP=3 does not divide num_experts=4"),
        (mixtral_config(), ParallelLayout(ep=8), None, "EP=8 does not divide num_experts=4"),
        (qwen2_config(), ParallelLayout(pp=3), None, "do not divide num_hidden_layers=2"),
        (
            qwen2_config(),
            ParallelLayout(pp=2, vpp=2),
            None,
            "PP=2 x VPP=2 = 4 stages do not divide num_hidden_layers=2",
        ),
        (qwen2_config(), ParallelLayout(vpp=2), None, "VPP=2 needs PP > 1"),
        (qwen2_config(), ParallelLayout(ep=2), None, "given for dense model"),
        (qwen2_config(), ParallelLayout(tp=2), 3, "world size 3 is not a multiple of TP x PP x CP = 2"),
        (qwen3_moe_config(), ParallelLayout(tp=1, ep=4), 2, "ETP x EP x PP = 4"),
        (qwen2_config(), ParallelLayout(cp=2), None, "context parallelism"),
        (qwen2_config(), ParallelLayout(tp=0), None, "tp=0 must be >= 1"),
    ],
)
def test_impossible_layouts_are_refused(config, layout, world, needle):
    with pytest.raises(LayoutError, match=None) as info:
        validate_layout(layout, config, world)
    assert needle in str(info.value), str(info.value)


def test_valid_layouts_pass():
    validate_layout(ParallelLayout(tp=2), qwen2_config(), 2)
    validate_layout(ParallelLayout(tp=2, ep=2, etp=1), mixtral_config(), 2)
    validate_layout(ParallelLayout(pp=2, vpp=2), qwen2_config(layers=4), 2)
    validate_layout(ParallelLayout(ep=4), qwen3_moe_config(), 4)


def test_unsupported_architecture():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'"):
        validate_layout(ParallelLayout(), GPT2Config(n_layer=2, n_head=2, n_embd=16))


def test_layout_strings():
    assert ParallelLayout.from_string("tp=2,pp=2,vpp=2,ep=4,etp=1,sp=0") == ParallelLayout(
        tp=2, pp=2, vpp=2, ep=4, etp=1, sequence_parallel=False
    )
    assert ParallelLayout.from_string("") == ParallelLayout()
    assert (
        ParallelLayout(tp=2).use_sequence_parallel
        and not ParallelLayout(tp=1, sequence_parallel=True).use_sequence_parallel
    )
    for bad, needle in [("tp", "not key=value"), ("tp=x", "not an integer"), ("dp=2", "unknown layout key 'dp'")]:
        with pytest.raises(LayoutError, match=needle):
            ParallelLayout.from_string(bad)


def test_moe_with_tp_needs_sequence_parallel(tmp_path):
    path = tmp_path / "moe"
    qwen3_moe_config().save_pretrained(path)
    with pytest.raises(LayoutError, match="needs sequence parallelism"):
        build_model(str(path), ParallelLayout(tp=2, sequence_parallel=False), load_weights=False)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointFileError, match="does not exist"):
        build_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointFileError, match=r"empty/config.json not found"):
        build_model(str(tmp_path / "empty"))


def test_missing_weight_files(tmp_path):
    path = tmp_path / "noweights"
    qwen2_config().save_pretrained(path)
    with pytest.raises(CheckpointFileError, match=r"no \*\.safetensors weight files in .*noweights"):
        build_model(str(path))
    (path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointFileError, match="convert .bin checkpoints to safetensors"):
        build_model(str(path))


def test_index_listing_a_missing_shard(tmp_path):
    path = tmp_path / "sharded"
    qwen2_config().save_pretrained(path)
    (path / "model-00001-of-00002.safetensors").write_bytes(b"")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFileError, match=r"missing from .*\['model-00002-of-00002.safetensors'\]"):
        build_model(str(path))


def test_megatron_checkpoint_dir_errors(tmp_path):
    with pytest.raises(CheckpointFileError, match="does not exist"):
        read_checkpoint_meta(str(tmp_path / "none"))
    ck = tmp_path / "ck"
    ck.mkdir()
    with pytest.raises(CheckpointFileError, match="sorl_megatron.json not found"):
        read_checkpoint_meta(str(ck))
    (ck / "sorl_megatron.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(CheckpointFileError, match="model/metadata.json is missing"):
        read_checkpoint_meta(str(ck))


def test_rope_scaling_is_refused():
    cfg = qwen2_config()
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        load_hf_config(cfg)


def test_public_api_names_resolve():
    import sorl_megatron.bridge as api

    assert sorted(api.__all__) == sorted(api._EXPORTS)
    for name in api.__all__:
        assert getattr(api, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        api.nope  # noqa: B018


def test_expert_tp_without_tp_is_refused_before_anything_is_built():
    """mbridge 0.15.1 merges expert-TP shards on export only when TP > 1 (it asserts one tensor
    when TP is 1), so tp=1, etp=2 would pass every check and fail at the first weight sync."""
    with pytest.raises(LayoutError, match=r"ETP=2 with TP=1: mbridge 0.15.1 exports expert-TP shards only when TP > 1"):
        validate_layout(ParallelLayout(tp=1, ep=1, etp=2), mixtral_config(), 2)
    validate_layout(ParallelLayout(tp=2, ep=1, etp=2), mixtral_config(), 2)  # merged across TP: fine
