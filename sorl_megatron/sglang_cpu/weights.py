"""Checkpoint loading and the checks of weight updates on the CPU server.

The server keeps the weights in HuggingFace *checkpoint* names (``...experts.3.up_proj.weight``),
the names a trainer sends; transformers' own loader maps them onto the in-memory modules
(which may fuse experts). The wire format of tensor payloads (and ``WeightError``) is
``sorl_megatron/weight_sync/wire.py``, shared with the client; this module re-exports the
two names the server uses so that its other modules import them from one place.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from ..weight_sync.wire import WeightError, deserialize_named_tensors

__all__ = [
    "WeightError",
    "check_bucket",
    "check_compatible",
    "dequantize_fp8_pairs",
    "deserialize_named_tensors",
    "read_checkpoint",
]


def read_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in ``model_dir``, as float32."""
    d = Path(model_dir)
    if not d.is_dir():
        raise WeightError(f"model path {d} is not a directory")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors file in {d} (only safetensors checkpoints are served)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(f)
        except Exception as exc:  # a pickle or truncated file named *.safetensors is the caller's input
            raise WeightError(f"{f} is not a readable safetensors file: {type(exc).__name__}: {exc}") from None
        for k, v in tensors.items():
            if k in state:
                raise WeightError(f"tensor {k} appears twice ({f.name} and an earlier shard)")
            state[k] = v.float() if v.is_floating_point() else v
    return state


def check_compatible(current: dict[str, torch.Tensor], update: dict[str, torch.Tensor], full: bool) -> None:
    """Every updated name must exist with the same shape; a full update must cover all names."""
    unknown = sorted(set(update) - set(current))
    if unknown:
        raise WeightError(
            f"unknown weight name(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''}; "
            f"expected HF checkpoint names like {next(iter(current))!r}"
        )
    for k, v in update.items():
        if tuple(v.shape) != tuple(current[k].shape):
            raise WeightError(f"weight {k}: shape {tuple(v.shape)} does not match the served {tuple(current[k].shape)}")
        if not v.is_floating_point():
            raise WeightError(f"weight {k}: dtype {v.dtype} is not floating point")
        if not torch.isfinite(v).all():
            raise WeightError(f"weight {k} contains NaN or Inf")
    if full:
        missing = sorted(set(current) - set(update))
        if missing:
            raise WeightError(f"checkpoint lacks weight(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def _scale_shape(shape: tuple[int, ...], block: int) -> tuple[int, int]:
    return (-(-shape[0] // block), -(-shape[1] // block))


def check_bucket(
    current: dict[str, torch.Tensor],
    names: tuple[str, ...],
    dtypes: tuple[torch.dtype, ...],
    shapes: tuple[tuple[int, ...], ...],
    block: int = 128,
) -> None:
    """Check an announced bucket (names, dtypes, shapes) before any byte of it is received.

    Every name must be served with that shape, floating point; an FP8 weight (``float8_e4m3fn``)
    must come with its ``<name>_scale_inv`` (float32, one entry per ``block x block`` tile) in the
    same bucket, as the FP8 export writes them.
    """
    announced = dict(zip(names, zip(dtypes, shapes)))
    for name, (dtype, shape) in announced.items():
        if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in announced:
            base_dtype, base_shape = announced[name.removesuffix("_scale_inv")]
            if base_dtype != torch.float8_e4m3fn or len(base_shape) != 2:
                raise WeightError(f"{name}: a scale for a weight that is not a 2-D float8_e4m3fn tensor")
            if dtype != torch.float32 or shape != _scale_shape(base_shape, block):
                raise WeightError(
                    f"{name}: expected float32 {_scale_shape(base_shape, block)} ({block}x{block} blocks), "
                    f"got {str(dtype).removeprefix('torch.')} {shape}"
                )
            continue
        if name not in current:
            raise WeightError(
                f"unknown weight name {name!r}; expected HF checkpoint names like {next(iter(current))!r}"
            )
        if shape != tuple(current[name].shape):
            raise WeightError(f"weight {name}: shape {shape} does not match the served {tuple(current[name].shape)}")
        if not dtype.is_floating_point:
            raise WeightError(f"weight {name}: dtype {dtype} is not floating point")
        if dtype == torch.float8_e4m3fn and f"{name}_scale_inv" not in announced:
            raise WeightError(f"FP8 weight {name} comes without {name}_scale_inv in the same bucket")


def dequantize_fp8_pairs(named: dict[str, torch.Tensor], block: int = 128) -> dict[str, torch.Tensor]:
    """Fold FP8 ``(<name>, <name>_scale_inv)`` pairs (the FP8 export's layout) into float32 weights;
    other tensors pass through. A weight without its scale, or a scale without its weight, is an error."""
    from ..common.fp8 import FP8_DTYPE, dequantize_block_fp8

    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in named:
            continue
        if t.dtype == FP8_DTYPE:
            scale = named.get(f"{name}_scale_inv")
            if scale is None:
                raise WeightError(f"FP8 weight {name} comes without {name}_scale_inv in the same bucket")
            try:
                out[name] = dequantize_block_fp8(t, scale, torch.float32, (block, block))
            except ValueError as exc:
                raise WeightError(f"{name}: {exc}") from None
        else:
            out[name] = t
    return out
