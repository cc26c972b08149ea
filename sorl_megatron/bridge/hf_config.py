"""Read an HF config and fill the fields mbridge 0.15.1 expects under transformers 5."""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Union

from transformers import AutoConfig, PretrainedConfig


class CheckpointFileError(FileNotFoundError):
    """A checkpoint directory lacks a file it needs (the message names it)."""


def load_hf_config(source: Union[str, os.PathLike, PretrainedConfig]) -> PretrainedConfig:
    """AutoConfig from a local HF directory (or a config object), normalized for mbridge.

    Only local directories: nothing here downloads (paths that do not exist fail clearly).
    """
    if isinstance(source, PretrainedConfig):
        return normalize_hf_config(source)
    path = os.fspath(source)
    require_hf_dir(path)
    return normalize_hf_config(AutoConfig.from_pretrained(path, local_files_only=True))


def require_hf_dir(path: Union[str, os.PathLike], what: str = "HF model directory", config: bool = True) -> None:
    """``path`` is a local directory (holding ``config.json`` unless ``config=False``, e.g. a
    tokenizer directory), else a CheckpointFileError naming ``what`` and the path. Checked
    before transformers sees the path: it would take a missing directory for a Hub repo id."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointFileError(
            f"{what} {path!r} does not exist (a local directory is needed; nothing is downloaded)"
        )
    if not os.path.isdir(path):
        raise CheckpointFileError(f"{what} {path!r} is not a directory")
    if config and not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointFileError(
            f"{what} {path!r} is not an HF model checkpoint: {os.path.join(path, 'config.json')} not found "
            "(expected config.json, *.safetensors and tokenizer files)"
        )


def normalize_hf_config(hf_config: PretrainedConfig) -> PretrainedConfig:
    """Copy of `hf_config` with the attributes mbridge reads directly.

    - transformers 5 keeps rope_theta inside `rope_parameters`; mbridge reads `rope_theta`.
    - Mixtral configs carry `head_dim: null`; mbridge multiplies it.
    - GLM-4.5's `partial_rotary_factor` lives in `rope_parameters` too.
    """
    cfg = copy.deepcopy(hf_config)
    if getattr(cfg, "rope_theta", None) is None:
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        if theta is None:
            raise ValueError(f"{cfg.model_type} config has neither rope_theta nor rope_parameters['rope_theta']")
        cfg.rope_theta = theta
    rope = getattr(cfg, "rope_parameters", None)
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type == "yarn" and cfg.model_type == "deepseek_v3":
        pass  # megatron's MLA has YaRN: families.family_config_overrides passes its parameters
    elif rope_type not in (None, "default"):
        raise ValueError(f"rope_type={rope_type!r} (rope scaling) is not supported; only default RoPE"
                         + (" (and YaRN for deepseek_v3)" if rope_type == "yarn" else ""))
    # GLM-4.5's partial rotary: transformers 5 keeps it in rope_parameters, mbridge reads it
    # from the top level.
    if isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None:
        cfg.partial_rotary_factor = rope["partial_rotary_factor"]
    if getattr(cfg, "head_dim", None) is None:
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    return cfg


def tokenizer_and_generation_files(directory: str) -> list[str]:
    """Non-weight files of an HF directory worth copying next to exported weights."""
    keep_suffixes = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".py")
    skip = {"config.json", "model.safetensors.index.json"}
    out = []
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if os.path.isfile(full) and name.endswith(keep_suffixes) and name not in skip:
            out.append(name)
    return out


def describe(hf_config: Any) -> str:
    return (
        f"{hf_config.model_type} layers={hf_config.num_hidden_layers} hidden={hf_config.hidden_size} "
        f"heads={hf_config.num_attention_heads}/{getattr(hf_config, 'num_key_value_heads', None)} "
        f"vocab={hf_config.vocab_size}"
    )


def check_hf_dir_has_weights(hf_dir: str) -> None:
    files = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
    if not files:
        bins = [f for f in os.listdir(hf_dir) if f.endswith(".bin")]
        hint = f" (found {bins}: convert .bin checkpoints to safetensors first)" if bins else ""
        raise CheckpointFileError(f"no *.safetensors weight files in {hf_dir!r}{hint}")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = set(json.load(f).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not os.path.isfile(os.path.join(hf_dir, s)))
        if missing:
            raise CheckpointFileError(f"{index} lists shard(s) missing from {hf_dir!r}: {missing}")
