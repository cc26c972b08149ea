"""The wire format of ``/update_weights_from_tensor``: safe (de)serialization of named tensors.

Payloads are safetensors bytes, or ``torch.save`` bytes read with ``torch.load(weights_only=True)``
(torch's restricted unpickler): never plain pickle. The tensor transport (``weight_sync.tensor``)
encodes, the CPU server (``sorl_megatron.sglang_cpu``) decodes; reading and checking checkpoints
is the server's (``sorl_megatron/sglang_cpu/weights.py``). Like ``weight_sync.group`` it imports no
model code, so the server can use it.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save

from ..bridge.safe_pickle import check_torch_save

LOAD_FORMATS = ("safetensors", "torch")


class WeightError(ValueError):
    """A checkpoint or weight payload that cannot be applied (names the key or file)."""


def serialize_named_tensors(named: Iterable[tuple[str, torch.Tensor]], load_format: str = "safetensors") -> str:
    """``[(name, tensor)]`` -> one base64 string in ``load_format``."""
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in named}
    if load_format == "safetensors":
        return base64.b64encode(save(tensors)).decode("ascii")
    if load_format == "torch":
        buf = io.BytesIO()
        torch.save(list(tensors.items()), buf)
        return base64.b64encode(buf.getvalue()).decode("ascii")
    raise WeightError(f"load_format {load_format!r} is not one of {list(LOAD_FORMATS)}")


def deserialize_named_tensors(payload: str, load_format: str | None) -> dict[str, torch.Tensor]:
    """Inverse of :func:`serialize_named_tensors`; rejects anything but the safe formats."""
    fmt = load_format or "safetensors"
    if fmt not in LOAD_FORMATS:
        raise WeightError(
            f"load_format {fmt!r} is not accepted by this server (safe formats: {list(LOAD_FORMATS)}); "
            "SGLang's pickled IPC payloads only work for a colocated CUDA server"
        )
    try:
        raw = base64.b64decode(payload, validate=True)
    except (ValueError, TypeError) as exc:
        raise WeightError(f"serialized_named_tensors is not valid base64: {exc}") from None
    try:
        if fmt == "safetensors":
            return dict(st_load(raw))
        # an explicit allow-list (tensors and their storages) checked before torch's own unpickler
        check_torch_save(raw, "serialized_named_tensors")
        obj = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as exc:  # any decoding failure is the client's payload
        raise WeightError(f"cannot decode {fmt} payload: {type(exc).__name__}: {exc}") from None
    return _named_tensors(obj)


def _named_tensors(obj: object) -> dict[str, torch.Tensor]:
    """A decoded ``torch`` payload as ``{name: tensor}``: what ``serialize_named_tensors`` writes
    (a list of ``(name, tensor)`` pairs, SGLang's ``named_tensors``) or a ``{name: tensor}`` dict;
    anything else (a number, a string, a bare tensor, a pair whose name is not a string) is the
    client's error, named with what was expected."""
    expected = "a list of (name, tensor) pairs or a {name: tensor} dict"
    if isinstance(obj, dict):
        pairs = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        pairs = list(obj)
    else:
        raise WeightError(f"torch payload holds a {type(obj).__name__}; expected {expected}")
    out: dict[str, torch.Tensor] = {}
    for i, item in enumerate(pairs):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise WeightError(f"torch payload entry {i} is not a (name, tensor) pair; expected {expected}")
        if item[0] in out:
            raise WeightError(f"torch payload names tensor {item[0]!r} twice")
        out[item[0]] = item[1]
    return out
