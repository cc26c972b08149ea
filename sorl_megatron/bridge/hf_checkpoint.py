"""What an HF safetensors directory holds, checked before a tensor is read (a checkpoint may
come from a stranger: docs/security.md).

``read_checkpoint(hf_dir)`` reads the index (if any) and every safetensors header (names,
dtypes, shapes: no tensor data) and refuses, naming the file and the tensor:

- a file reference that leaves the directory (``../x``, an absolute path, a symlink whose
  target is outside; the Hugging Face hub cache's ``snapshots/<rev>`` -> ``blobs/`` links are
  the one exception), a missing file, a malformed index;
- a header that is not safetensors, or a tensor whose bytes run past the end of the file
  (a truncated download);
- a tensor that is not floating point, one stored twice, one in a file but not in the index.

``check_config_against_weights`` compares config.json's sizes (hidden, vocabulary, layers,
heads, MLP and expert sizes) with those headers before a model is built from them: a config
that claims a larger model than its weights (hidden_size 2^20 over a 64-wide checkpoint) would
otherwise allocate it first (tools/convert.py grew to 16.7 GB before failing).

``check_against_model`` then compares the checkpoint with the tensors the bridge will ask
for (every tensor used, each fits its parameter's shape), and ``FiniteIO`` checks each
tensor's values as mbridge loads it. Both are collective: every rank raises the same error.
``weights.load_hf_weights`` runs the three; docs/how-to/convert.md#checkpoints-from-strangers.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np
import torch

from ..common.comm import all_gather_object
from .families import block_fp8_families, mtp_layers, reads_block_fp8
from .hf_config import (
    CheckpointContentError,
    CheckpointFileError,
    _one_line,
    inside_checkpoint,
    tokenizer_and_generation_files,
)

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024**2  # safetensors' own limit
# safetensors dtype -> bytes per element; only floating tensors are weights
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
LISTED = 5  # names quoted in one error


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the checkpoint: the file it is in and its header."""

    file: str
    dtype: str
    shape: tuple[int, ...]


def _header(path: str) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, from its header (the data is not read)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointContentError(f"{path}: {size} bytes, too short for a safetensors file (truncated?)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointContentError(
                f"{path}: not a safetensors file or truncated (its header claims {n} bytes of a {size}-byte file)"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError) as err:
            raise CheckpointContentError(f"{path}: the safetensors header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointContentError(f"{path}: the safetensors header is not a JSON object")
    data_bytes = size - 8 - n
    out, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            ok = all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end)) and isinstance(dtype, str)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CheckpointContentError(f"{path}: tensor {name!r} has a malformed header entry {str(info)[:200]}")
        if dtype not in FLOAT_DTYPES:
            raise CheckpointContentError(
                f"{path}: tensor {name!r} is {dtype}, not a floating-point weight ({', '.join(FLOAT_DTYPES)})"
            )
        if end > data_bytes:
            raise CheckpointContentError(
                f"{path}: tensor {name!r} ends at byte {end} of a {data_bytes}-byte data section: the file is truncated"
            )
        if end - begin != math.prod(shape) * FLOAT_DTYPES[dtype]:
            raise CheckpointContentError(
                f"{path}: tensor {name!r} holds {end - begin} bytes, not the {list(shape)} {dtype} its header declares"
            )
        out[name] = TensorEntry(path, dtype, shape)
        spans.append((begin, end, name))
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:  # safetensors requires the data to be tiled exactly
            raise CheckpointContentError(f"{path}: tensor {name!r} starts at byte {begin}, expected {pos} "
                                         "(byte ranges overlap or leave gaps: not a valid safetensors file)")
        pos = end
    if pos != data_bytes:
        raise CheckpointContentError(
            f"{path}: {data_bytes - pos} bytes after the last tensor (not a valid safetensors file)"
        )
    return out


def _read_index(hf_dir: str, index: str) -> dict[str, str]:
    try:
        with open(index, "rb") as f:
            body = json.load(f)
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointContentError(f"{index}: not valid JSON ({err})") from None
    weight_map = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointContentError(f"{index}: needs a non-empty 'weight_map' object (tensor name -> file name)")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointContentError(f"{index}: weight_map[{name!r}] is {file!r}, not a file name")
    return weight_map


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(map(repr, names[:LISTED])) + more


def read_checkpoint(hf_dir: str) -> dict[str, TensorEntry]:
    """Every tensor of the HF directory's safetensors, by name (module docstring: what is refused).

    With ``model.safetensors.index.json`` the checkpoint is what its ``weight_map`` lists (each
    file must hold exactly the tensors listed for it); without, every ``*.safetensors`` file.
    """
    hf_dir = os.fspath(hf_dir)
    names = sorted(os.listdir(hf_dir))
    if not any(n.endswith(".safetensors") and not n.startswith(".") for n in names):
        bins = [n for n in names if n.endswith(".bin")]
        hint = f" (found {bins}: convert .bin checkpoints to safetensors first)" if bins else ""
        raise CheckpointFileError(f"no *.safetensors weight files in {hf_dir!r}{hint}")
    tokenizer_and_generation_files(hf_dir)  # refuses a link out of the directory (it would be copied)
    index = os.path.join(hf_dir, INDEX_FILE)
    tensors: dict[str, TensorEntry] = {}
    if os.path.isfile(inside_checkpoint(hf_dir, INDEX_FILE)):
        weight_map = _read_index(hf_dir, index)
        files = sorted(set(weight_map.values()))
        paths = {f: inside_checkpoint(hf_dir, f, index) for f in files}
        missing = [f for f in files if not os.path.isfile(paths[f])]
        if missing:
            raise CheckpointFileError(f"{index} lists shard(s) missing from {hf_dir!r}: {missing}")
        for file in files:
            found = _header(paths[file])
            listed = {n for n, f in weight_map.items() if f == file}
            if listed - set(found):
                raise CheckpointContentError(
                    f"{paths[file]}: tensor(s) {_listed(listed - set(found))} listed in {index} are not in the file"
                )
            if set(found) - listed:
                raise CheckpointContentError(
                    f"{paths[file]}: tensor(s) {_listed(set(found) - listed)} are not listed in {index} for this "
                    "file (each tensor of a checkpoint is used exactly once)"
                )
            tensors.update(found)
        return tensors
    for name in names:
        if name.endswith(".safetensors") and not name.startswith("."):  # as mbridge's glob
            for tensor, entry in _header(inside_checkpoint(hf_dir, name)).items():
                if tensor in tensors:
                    raise CheckpointContentError(
                        f"{hf_dir}: tensor {tensor!r} is stored twice, in {tensors[tensor].file} and {entry.file}"
                    )
                tensors[tensor] = entry
    return tensors


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight")


def check_config_against_weights(hf_dir: str, tensors: Optional[dict[str, TensorEntry]] = None) -> None:
    """config.json's sizes against the safetensors headers (no tensor data read), before a model
    is built from them; CheckpointContentError naming config.json, the size and the tensor that
    disagrees. Tensors a family names otherwise are not compared (the bridge's own check after
    the build still is)."""
    from .hf_config import load_hf_config

    c = load_hf_config(hf_dir)  # its sizes bounded (check_config_sizes)
    tensors = read_checkpoint(hf_dir) if tensors is None else tensors
    where = os.path.join(os.fspath(hf_dir), "config.json")
    hidden, vocab, layers = int(c.hidden_size), int(c.vocab_size), int(c.num_hidden_layers)
    heads = int(c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)

    def shape(name: str) -> Optional[tuple[int, ...]]:
        entry = tensors.get(name)
        return tuple(entry.shape) if entry is not None else None

    expected: list[tuple[str, Optional[tuple[int, ...]], tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", shape("model.embed_tokens.weight"), (vocab, hidden), "vocab_size, hidden_size"),
        ("model.layers.0.input_layernorm.weight", shape("model.layers.0.input_layernorm.weight"), (hidden,),
         "hidden_size"),
    ]
    if getattr(c, "kv_lora_rank", None) is None:  # not multi-latent attention: heads x head_dim projections
        for proj, n, key in (("q_proj", heads, "num_attention_heads"), ("k_proj", kv, "num_key_value_heads"),
                             ("v_proj", kv, "num_key_value_heads")):
            name = f"model.layers.0.self_attn.{proj}.weight"
            expected.append((name, shape(name), (n * head_dim, hidden), f"{key} x head_dim, hidden_size"))
    dense = sorted((int(m.group(1)), n) for n in tensors if (m := re.fullmatch(
        r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", n)))
    if dense and getattr(c, "intermediate_size", None):
        name = dense[0][1]
        expected.append((name, shape(name), (int(c.intermediate_size), hidden), "intermediate_size, hidden_size"))
    experts: dict[int, set[int]] = {}
    for n in tensors:
        if (m := _EXPERT.fullmatch(n)):
            experts.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    if experts:
        layer = min(experts)
        moe = getattr(c, "moe_intermediate_size", None) or getattr(c, "intermediate_size", None)
        name = f"model.layers.{layer}.mlp.experts.0.gate_proj.weight"
        if moe and name in tensors:
            expected.append((name, shape(name), (int(moe), hidden), "moe_intermediate_size, hidden_size"))
    for name, got, want, keys in expected:
        if got is not None and got != want:
            raise CheckpointContentError(
                f"{where}: {keys} say {name} is {list(want)}, but the safetensors header ({tensors[name].file}) "
                f"has {list(got)}: config.json and the weights disagree (nothing was built from them)")
    held = {int(m.group(1)) for n in tensors if (m := _LAYER.match(n))}
    if held and layers > max(held) + 1:
        raise CheckpointContentError(
            f"{where}: num_hidden_layers is {layers}, but the safetensors hold layers 0..{max(held)} only: config.json "
            "and the weights disagree (nothing was built from them)")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        count = getattr(c, key, None)
        if count and experts:
            layer = min(experts)
            if max(experts[layer]) + 1 != int(count):
                raise CheckpointContentError(
                    f"{where}: {key} is {count}, but the safetensors hold {max(experts[layer]) + 1} experts in layer "
                    f"{layer}: config.json and the weights disagree (nothing was built from them)")
            break


def unused_allowed(hf_config: Any, name: str, requested: set[str], value_head: bool) -> bool:
    """Checkpoint tensors the model may leave unused, as transformers does: the multi-token-
    prediction layers (DeepSeek-V3, GLM-4.5), an LM head the model does not have (tied
    embeddings, a critic's value head), rotary tables some exports keep, and the scales of
    block-FP8 weights the loader dequantizes."""
    layers, mtp = int(hf_config.num_hidden_layers), mtp_layers(hf_config)
    if any(name.startswith(f"model.layers.{i}.") for i in range(layers, layers + mtp)):
        return True
    if name == "lm_head.weight" and (value_head or getattr(hf_config, "tie_word_embeddings", False)):
        return True
    if name.endswith(".rotary_emb.inv_freq"):
        return True
    # only a family whose bridge dequantizes block-FP8 (FamilySpec.reads_block_fp8) uses the
    # scales; any other would take FP8 values without them
    return name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in requested and reads_block_fp8(hf_config)


def _fits(bridge: Any, local: str, global_name: str, hf_names: list[str], param: Any,
          tensors: dict[str, TensorEntry]) -> Optional[str]:
    """Why the checkpoint's tensors for one parameter do not fit it, or None. The bridge's own
    conversion and tensor-parallel split run on meta tensors (shapes only, nothing allocated)."""
    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    metas = [torch.empty(tensors[n].shape, dtype=dtypes[tensors[n].dtype], device="meta") for n in hf_names]
    expert = ".mlp.experts.linear_fc" in local
    size = bridge.mpu.etp_size if expert else bridge.mpu.tp_size
    try:
        merged = bridge._weight_to_mcore_format(local, metas)
        if hf_names[0] in ("lm_head.weight", "model.embed_tokens.weight") and param.shape[0] == 1 \
                and merged.shape[0] != 1:
            return None  # a critic's value head: mbridge skips it (the head is not the LM head)
        pieces = list(bridge._weight_split_across_tp(local, merged, param, size))
        if len(pieces) == size and all(tuple(p.shape) == tuple(param.shape) for p in pieces):
            return None
    except (AssertionError, RuntimeError, ValueError, IndexError):
        pass
    got = ", ".join(f"{n!r} {list(tensors[n].shape)}" for n in hf_names)
    files = ", ".join(sorted({tensors[n].file for n in hf_names}))
    return (f"tensor(s) {got} in {files} do not fit the model's {global_name} ({list(param.shape)} per rank "
            f"at {'expert ' if expert else ''}TP={size}): the shapes disagree with config.json")


def check_against_model(model: Any, hf_dir: str, tensors: dict[str, TensorEntry]) -> None:
    """Every checkpoint tensor is one the model loads (or may leave unused, ``unused_allowed``),
    every tensor it asks for is there (else CheckpointFileError) and fits its parameter.
    Collective: all ranks call it (with value heads detached) and raise the same error."""
    bridge, requested, problem = model.bridge, set(), None
    for chunk in model.unwrapped():
        state = chunk.state_dict()
        for local, global_name in bridge._weight_name_mapping_mcore_local_to_global(chunk).items():
            if "_extra_state" in local:
                continue
            hf_names = bridge._weight_name_mapping_mcore_to_hf(global_name)
            requested.update(hf_names)
            if problem:
                continue
            absent = [n for n in hf_names if n not in tensors]
            if absent:  # a missing piece of the checkpoint, as a missing file
                problem = ("missing", f"{hf_dir}: the model needs tensor(s) {_listed(absent)}, "
                           "which the checkpoint does not have")
            elif (misfit := _fits(bridge, local, global_name, hf_names, state[local], tensors)) is not None:
                problem = ("content", misfit)
    # which checkpoint tensors some rank uses: one bit per tensor, OR-ed over the ranks
    order = sorted(tensors)
    used = np.packbits(np.array([n in requested for n in order], dtype=bool)).tobytes()
    parts = all_gather_object((used, problem))
    problems = [p for _, p in parts if p]
    if problems:
        kind, message = problems[0]
        raise (CheckpointFileError if kind == "missing" else CheckpointContentError)(message)
    used_any = np.bitwise_or.reduce([np.frombuffer(u, dtype=np.uint8) for u, _ in parts])
    used_bits = np.unpackbits(used_any)[: len(order)].astype(bool)
    requested_all = {n for n, u in zip(order, used_bits) if u}
    extra = [n for n, u in zip(order, used_bits)
             if not u and not unused_allowed(model.hf_config, n, requested_all, model.options.value_head)]
    if extra:
        files = sorted({tensors[n].file for n in extra})
        why = (f"block-FP8 scales: only {', '.join(block_fp8_families())} loads block-FP8 weights "
               "(mbridge dequantizes them)"
               if any(n.endswith("_scale_inv") for n in extra) else
               "layers or modules config.json does not describe: the checkpoint and its config disagree")
        raise CheckpointContentError(
            f"{hf_dir}: {len(extra)} tensor(s) the model does not use: {_listed(extra)} (in {', '.join(files[:3])}); "
            f"{why}"
        )


_FINITE_CHUNK = 1 << 24  # elements checked at once (bounds the temporary mask)


def nonfinite(tensor: Any) -> bool:
    """Whether ``tensor`` holds a NaN or an infinity (chunked: no full-size mask)."""
    flat = tensor.reshape(-1)
    if flat.element_size() == 1:  # float8: isfinite is not implemented; float16 holds every value
        flat = flat.to(torch.float16)
    return any(not bool(torch.isfinite(flat[i:i + _FINITE_CHUNK]).all()) for i in range(0, flat.numel(), _FINITE_CHUNK))


class FiniteIO:
    """mbridge's safetensors reader with every tensor checked finite as it is loaded.

    mbridge calls ``load_some_hf_weight`` once per model chunk on every rank (ranks that load
    nothing pass no names), so the ranks agree on the outcome there: all raise or none.
    """

    def __init__(self, inner: Any, tensors: dict[str, TensorEntry]):
        self._inner, self._tensors = inner, tensors

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _problem(self, loaded: dict) -> Optional[str]:
        bad = next((n for n, t in loaded.items() if nonfinite(t)), None)
        return None if bad is None else f"{self._tensors[bad].file}: tensor {bad!r} holds NaN or infinite values"

    def _load(self, names: list[str]) -> tuple[dict, Optional[str]]:
        try:
            loaded = self._inner.load_some_hf_weight(names)
        except Exception as err:  # e.g. safetensors' own checks: reported on every rank below
            files = sorted({self._tensors[n].file for n in names if n in self._tensors})
            return {}, f"{', '.join(files[:3])}: reading the tensors failed ({_one_line(err)})"
        bad = next((n for n, t in loaded.items() if nonfinite(t)), None)
        if bad is None:
            return loaded, None
        return loaded, f"{self._tensors[bad].file}: tensor {bad!r} holds NaN or infinite values"

    def load_some_hf_weight(self, hf_weight_names: list[str]) -> dict:
        loaded, problem = self._load(hf_weight_names)
        problems = [p for p in all_gather_object(problem) if p]
        if problems:
            raise CheckpointContentError(problems[0])
        return loaded

    def load_one_hf_weight(self, hf_weight_name: str) -> Any:  # one rank at a time: not collective
        loaded, problem = self._load([hf_weight_name])
        if problem:
            raise CheckpointContentError(problem)
        return loaded[hf_weight_name]
