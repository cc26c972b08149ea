"""Read an HF config and fill the fields mbridge 0.15.1 expects under transformers 5; the
checkpoint directory's errors, its config's size checks and which of its files may be read
(``inside_checkpoint``: nothing outside the directory)."""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Optional, Union

from transformers import AutoConfig, PretrainedConfig

from ..common.environment import missing_path
from .families import is_supported, rope_scaling_allowed, rope_scaling_note


class CheckpointFileError(FileNotFoundError):
    """A checkpoint directory lacks a file it needs (the message names it)."""


class CheckpointContentError(ValueError):
    """A checkpoint file whose content cannot be used: a config value, an index entry, a tensor
    (the message names the file and the key or tensor)."""


# Sizes every config gives (>= 1), and those some families give (>= 1 when set). The upper bound
# keeps a typo (vocab_size 1e11) from allocating terabytes; real models are far below it.
_REQUIRED_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
_OPTIONAL_SIZES = (
    "num_key_value_heads", "intermediate_size", "head_dim", "max_position_embeddings", "moe_intermediate_size",
    "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
)
_MAX_SIZE = 2**31 - 1


def check_config_sizes(values: dict[str, Any], where: str) -> None:
    """The config's sizes, before anything is allocated from them: CheckpointContentError
    naming ``where`` (the config.json) and the key. ``values`` are as the file has them."""
    for key in _REQUIRED_SIZES + _OPTIONAL_SIZES:
        value = values.get(key)
        if value is None and key in _OPTIONAL_SIZES:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_SIZE:
            raise CheckpointContentError(f"{where}: {key} must be an integer in [1, {_MAX_SIZE}], got {value!r}")
    heads, kv = values["num_attention_heads"], values.get("num_key_value_heads")
    if kv is not None and heads % kv:
        raise CheckpointContentError(f"{where}: num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    # Without head_dim, the head size is hidden_size / heads (multi-latent attention has its own dims)
    if values.get("head_dim") is None and values.get("kv_lora_rank") is None and values["hidden_size"] % heads:
        raise CheckpointContentError(
            f"{where}: hidden_size {values['hidden_size']} is not divisible by num_attention_heads {heads} "
            "(and head_dim is not given)"
        )


def _one_line(err: BaseException) -> str:
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())


def _roots(real_dir: str) -> list[str]:
    """Where the files of ``real_dir`` may resolve to: inside it, and for a Hugging Face hub
    cache snapshot (``models--x/snapshots/<rev>``) the cache's own ``models--x/blobs``."""
    parent = os.path.dirname(real_dir)
    roots = [real_dir]
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def inside_checkpoint(hf_dir: str, name: Any, referrer: Optional[str] = None) -> str:
    """``hf_dir/name`` when that file stays inside ``hf_dir`` once symlinks are resolved, else a
    CheckpointContentError naming ``referrer`` (the index that lists ``name``; default the directory)."""
    where = referrer or hf_dir
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointContentError(f"{where}: {name!r} is not a file name")
    if os.path.isabs(name):
        raise CheckpointContentError(f"{where}: {name!r} is an absolute path; files must be inside {hf_dir}")
    path = os.path.join(hf_dir, name)
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, root]) == root for root in _roots(os.path.realpath(hf_dir))):
        raise CheckpointContentError(
            f"{where}: {name!r} resolves to {real}, outside the checkpoint directory {hf_dir}"
        )
    return path


def load_hf_config(source: Union[str, os.PathLike, PretrainedConfig]) -> PretrainedConfig:
    """AutoConfig from a local HF directory (or a config object), normalized for mbridge.

    Only local directories: nothing here downloads (paths that do not exist fail clearly). The
    sizes are checked first (``check_config_sizes``); what transformers refuses in the file is a
    one-line CheckpointContentError naming it.
    """
    if isinstance(source, PretrainedConfig):
        if is_supported(source.model_type):
            check_config_sizes(
                {k: getattr(source, k, None) for k in (*_REQUIRED_SIZES, *_OPTIONAL_SIZES, "kv_lora_rank")},
                f"{source.model_type} config",
            )
        return normalize_hf_config(source)
    path = os.fspath(source)
    require_hf_dir(path)
    config_json = os.path.join(path, "config.json")
    inside_checkpoint(path, "config.json", config_json)
    try:
        with open(config_json, "rb") as f:
            raw = json.load(f)
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointContentError(f"{config_json}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise CheckpointContentError(f"{config_json}: expected a JSON object, got {type(raw).__name__}")
    if is_supported(raw.get("model_type")):  # others are refused by name (validate_layout)
        check_config_sizes(raw, config_json)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, TypeError, KeyError, ArithmeticError) as err:  # transformers' own checks
        raise CheckpointContentError(f"{config_json}: transformers cannot use it: {_one_line(err)}") from None
    try:
        return normalize_hf_config(config)
    except ValueError as err:
        raise CheckpointContentError(f"{config_json}: {err}") from None


def require_hf_dir(path: Union[str, os.PathLike], what: str = "HF model directory", config: bool = True) -> None:
    """``path`` is a local directory (holding ``config.json`` unless ``config=False``, e.g. a
    tokenizer directory), else a CheckpointFileError naming ``what`` and the path. Checked
    before transformers sees the path: it would take a missing directory for a Hub repo id."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointFileError(
            f"{what} {missing_path(path)}: a local directory is needed; nothing is downloaded"
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
    # a scaling the family passes to megatron (DeepSeek-V3's YaRN: its config_overrides) loads
    if not rope_scaling_allowed(cfg, rope_type):
        raise ValueError(f"rope_type={rope_type!r} (rope scaling) is not supported; only default RoPE"
                         + rope_scaling_note(rope_type))
    # GLM-4.5's partial rotary: transformers 5 keeps it in rope_parameters, mbridge reads it
    # from the top level.
    if isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None:
        cfg.partial_rotary_factor = rope["partial_rotary_factor"]
    if getattr(cfg, "head_dim", None) is None:
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    return cfg


def tokenizer_and_generation_files(directory: str) -> list[str]:
    """Non-weight files of an HF directory worth copying next to exported weights; a
    CheckpointContentError if one is a link out of the directory (its target would be copied)."""
    keep_suffixes = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".py")
    skip = {"config.json", "model.safetensors.index.json"}
    out = []
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if name.endswith(keep_suffixes) and name not in skip:
            inside_checkpoint(directory, name, full)
            if os.path.isfile(full):
                out.append(name)
    return out


def describe(hf_config: Any) -> str:
    return (
        f"{hf_config.model_type} layers={hf_config.num_hidden_layers} hidden={hf_config.hidden_size} "
        f"heads={hf_config.num_attention_heads}/{getattr(hf_config, 'num_key_value_heads', None)} "
        f"vocab={hf_config.vocab_size}"
    )
