"""The subset of SGLang's native HTTP API used for RL rollouts (see docs/rollout.md).

Typed views of ``/generate`` requests and responses, shared by the client (which builds
requests and parses answers) and the embedded server (which validates requests). Validation
errors are ``ProtocolError`` with the offending field in the message; servers answer them
with HTTP 400.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

TOP_K_OFF = 1 << 30  # SGLang's "no top-k" value
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp8")


class ProtocolError(ValueError):
    """A request or response that does not follow the contract."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ProtocolError(msg)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """SGLang ``sampling_params`` (only the fields RL rollouts use; None = server default)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_OFF
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    min_new_tokens: int = 0
    sampling_seed: int | None = None
    n: int = 1

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if d["sampling_seed"] is None:
            del d["sampling_seed"]
        return d

    @classmethod
    def from_json(cls, raw: Any, where: str = "sampling_params") -> "SamplingParams":
        """Validate a request's ``sampling_params``; unknown keys are ignored like SGLang."""
        if raw is None:
            return cls()
        _check(isinstance(raw, dict), f"{where} must be an object")
        p = cls()
        for key in ("max_new_tokens", "top_k", "min_new_tokens", "n"):
            if key in raw and raw[key] is not None:
                _check(_is_int(raw[key]), f"{where}.{key} must be an integer, got {raw[key]!r}")
                setattr(p, key, raw[key])
        for key in ("temperature", "top_p", "min_p"):
            if key in raw and raw[key] is not None:
                _check(_is_num(raw[key]), f"{where}.{key} must be a number, got {raw[key]!r}")
                setattr(p, key, float(raw[key]))
        for key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if key in raw and raw[key] is not None:
                _check(isinstance(raw[key], bool), f"{where}.{key} must be a boolean, got {raw[key]!r}")
                setattr(p, key, raw[key])
        stop = raw.get("stop")
        if stop is not None:
            stop = [stop] if isinstance(stop, str) else stop
            _check(
                isinstance(stop, list) and all(isinstance(s, str) and s for s in stop),
                f"{where}.stop must be a non-empty string or list of them",
            )
            p.stop = list(stop)
        ids = raw.get("stop_token_ids")
        if ids is not None:
            _check(
                isinstance(ids, list) and all(_is_int(i) and i >= 0 for i in ids),
                f"{where}.stop_token_ids must be a list of token ids",
            )
            p.stop_token_ids = list(ids)
        seed = raw.get("sampling_seed", raw.get("seed"))
        if seed is not None:
            _check(_is_int(seed), f"{where}.sampling_seed must be an integer, got {seed!r}")
            p.sampling_seed = seed
        _check(p.max_new_tokens >= 0, f"{where}.max_new_tokens must be >= 0")
        _check(p.temperature >= 0, f"{where}.temperature must be >= 0")
        _check(0 < p.top_p <= 1, f"{where}.top_p must be in (0, 1]")
        _check(p.top_k == -1 or p.top_k >= 1, f"{where}.top_k must be >= 1 (or -1 for off)")
        _check(0 <= p.min_p <= 1, f"{where}.min_p must be in [0, 1]")
        _check(1 <= p.n <= 1024, f"{where}.n must be in [1, 1024]")
        _check(p.min_new_tokens >= 0, f"{where}.min_new_tokens must be >= 0")
        if p.top_k == -1:
            p.top_k = TOP_K_OFF
        return p


@dataclass
class GenRequest:
    """One prompt of a ``/generate`` call (``params.n`` samples of it)."""

    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    future: cf.Future = field(default_factory=cf.Future)
    arrival: float = field(default_factory=time.perf_counter)


@dataclass
class GenerateOutput:
    """One completion as the client sees it (a parsed ``/generate`` answer object)."""

    output_ids: list[int]
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    weight_version: str | None = None
    text: str | None = None
    output_logprobs: list[float] | None = None
    routed_experts: np.ndarray | None = None  # int32 [tokens, layers, top_k]
    cached_tokens: int = 0
    server: str | None = None
    meta_info: dict[str, Any] = field(default_factory=dict)

    @property
    def finish_type(self) -> str:
        return str(self.finish_reason.get("type", ""))

    @property
    def matched(self) -> int | str | None:
        return self.finish_reason.get("matched")


def encode_routed_experts(experts: np.ndarray) -> str:
    """int32 array -> base64 of its little-endian bytes (the contract's wire format)."""
    return base64.b64encode(np.ascontiguousarray(experts, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(b64: str, num_layers: int, top_k: int, num_tokens: int | None = None) -> np.ndarray:
    """base64 -> int32 ``[tokens, num_layers, top_k]``; checks the size against the shape."""
    raw = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    per_token = num_layers * top_k
    _check(
        per_token > 0 and raw.size % per_token == 0,
        f"routed_experts has {raw.size} ints, not a multiple of layers*top_k={per_token}",
    )
    arr = raw.reshape(-1, num_layers, top_k).astype(np.int32)
    if num_tokens is not None:
        _check(arr.shape[0] == num_tokens, f"routed_experts covers {arr.shape[0]} tokens, expected {num_tokens}")
    return arr


def parse_generate_output(
    obj: Any, routing_shape: tuple[int, int] | None = None, routed_start: int = 0, server: str | None = None
) -> GenerateOutput:
    """Parse one answer object of ``/generate`` (raises ProtocolError on a malformed one)."""
    _check(isinstance(obj, dict) and "meta_info" in obj, f"/generate answer without meta_info: {str(obj)[:200]}")
    meta = obj["meta_info"]
    ids = obj.get("output_ids")
    _check(
        isinstance(ids, list),
        "/generate answer without output_ids (is the server running with --skip-tokenizer-init or a recent SGLang?)",
    )
    fr = meta.get("finish_reason") or {}
    if fr.get("type") == "abort":
        raise ProtocolError(f"request aborted by server: {fr.get('message', fr)}")
    out = GenerateOutput(
        output_ids=[int(i) for i in ids],
        finish_reason=fr,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=int(meta.get("completion_tokens", len(ids))),
        weight_version=meta.get("weight_version"),
        text=obj.get("text"),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        server=server,
        meta_info=meta,
    )
    if "output_token_logprobs" in meta:
        lp = meta["output_token_logprobs"]
        _check(len(lp) == len(ids), f"{len(lp)} output_token_logprobs for {len(ids)} output_ids")
        _check(all(int(t[1]) == i for t, i in zip(lp, ids)), "output_token_logprobs token ids differ from output_ids")
        out.output_logprobs = [float(t[0]) for t in lp]
    if meta.get("routed_experts") is not None:
        _check(routing_shape is not None, "routed_experts returned but the client does not know (num_layers, top_k)")
        assert routing_shape is not None
        n = out.prompt_tokens + len(ids) - 1 - routed_start
        out.routed_experts = decode_routed_experts(meta["routed_experts"], *routing_shape, num_tokens=n)
    return out
