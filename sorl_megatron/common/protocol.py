"""The subset of SGLang's native HTTP API used for RL rollouts (see docs/concepts/rollout.md).

Typed views of ``/generate`` requests and responses, shared by the client (which builds
requests and parses answers) and the embedded server (which validates requests). Validation
errors are ``ProtocolError`` with the offending field in the message; servers answer them
with HTTP 400.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import math
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

TOP_K_OFF = 1 << 30  # SGLang's "no top-k" value
MAX_TOKENS_FIELD = 2**31 - 1  # max/min_new_tokens fit an int32, as in SGLang's batch tensors
SEED_RANGE = (-(2**63), 2**63)  # torch.Generator.manual_seed(seed + sample index) accepts these
MAX_N = 1024
MAX_STOPS = 256  # stop strings / stop token ids per request: each is checked at every sampled token
GREEDY_EPS = 1e-6  # temperatures below this sample greedily (SGLang's _SAMPLING_EPS)
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp8")


class ProtocolError(ValueError):
    """A request or response that does not follow the contract."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ProtocolError(msg)


def check_text(s: str, where: str) -> None:
    """Lone surrogates (JSON ``"\\ud800"``) are not text: no tokenizer can encode them."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProtocolError(
            f"{where} is not valid Unicode text: lone surrogate {s[exc.start]!r} at character {exc.start}"
        ) from None


def short(x: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: error messages never echo a huge value back."""
    if isinstance(x, int) and abs(x) >= 10**60:  # repr of a huge int is slow and says nothing
        return f"{'-' if x < 0 else ''}<{x.bit_length()}-bit integer>"
    r = repr(x)
    return r if len(r) <= limit else r[: limit - 3] + "..."


# Environment variables holding the servers' API keys: the servers read them when --api-key is
# not given and the clients when no key is configured, so a key set once covers both sides
# (and never shows in a process list, as a command-line argument would).
ROLLOUT_API_KEY_ENV = "SORL_ROLLOUT_API_KEY"
RETRIEVAL_API_KEY_ENV = "SORL_RETRIEVAL_API_KEY"


def bearer_headers(api_key: str | None, env: str | None = None) -> dict[str, str]:
    """Headers for a server started with ``--api-key`` (SGLang's scheme); none without a key.

    ``api_key=None`` falls back to the environment variable ``env`` when it is set.
    """
    if api_key is None and env is not None:
        api_key = os.environ.get(env) or None
    if api_key is None:
        return {}
    _check(bool(api_key) and api_key.isprintable(), "api_key must be a non-empty printable string")
    return {"Authorization": f"Bearer {api_key}"}


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
                _check(_is_int(raw[key]), f"{where}.{key} must be an integer, got {short(raw[key])}")
                setattr(p, key, raw[key])
        for key in ("temperature", "top_p", "min_p"):
            if key in raw and raw[key] is not None:
                _check(_is_num(raw[key]), f"{where}.{key} must be a number, got {short(raw[key])}")
                try:
                    setattr(p, key, float(raw[key]))
                except OverflowError:
                    raise ProtocolError(f"{where}.{key} is out of range, got {short(raw[key])}") from None
        for key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if key in raw and raw[key] is not None:
                _check(isinstance(raw[key], bool), f"{where}.{key} must be a boolean, got {short(raw[key])}")
                setattr(p, key, raw[key])
        stop = raw.get("stop")
        if stop is not None:
            stop = [stop] if isinstance(stop, str) else stop
            _check(
                isinstance(stop, list) and all(isinstance(s, str) and s for s in stop),
                f"{where}.stop must be a non-empty string or list of them",
            )
            _check(len(stop) <= MAX_STOPS, f"{where}.stop has {len(stop)} strings, at most {MAX_STOPS} are allowed")
            for i, s in enumerate(stop):
                check_text(s, f"{where}.stop[{i}]")
            p.stop = list(stop)
        ids = raw.get("stop_token_ids")
        if ids is not None:
            _check(isinstance(ids, list), f"{where}.stop_token_ids must be a list of token ids")
            _check(len(ids) <= MAX_STOPS, f"{where}.stop_token_ids has {len(ids)} ids, at most {MAX_STOPS} are allowed")
            _check(all(_is_int(i) and i >= 0 for i in ids), f"{where}.stop_token_ids must be a list of token ids")
            p.stop_token_ids = list(ids)
        seed = raw.get("sampling_seed", raw.get("seed"))
        if seed is not None:
            _check(_is_int(seed), f"{where}.sampling_seed must be an integer, got {short(seed)}")
            p.sampling_seed = seed
        _check(
            0 <= p.max_new_tokens <= MAX_TOKENS_FIELD,
            f"{where}.max_new_tokens must be in [0, {MAX_TOKENS_FIELD}], got {short(p.max_new_tokens)}",
        )
        _check(
            0 <= p.min_new_tokens <= p.max_new_tokens,
            f"{where}.min_new_tokens must be in [0, max_new_tokens={p.max_new_tokens}], got {short(p.min_new_tokens)}",
        )
        _check(
            math.isfinite(p.temperature) and p.temperature >= 0,
            f"{where}.temperature must be a finite number >= 0, got {p.temperature}",
        )
        _check(0 < p.top_p <= 1, f"{where}.top_p must be in (0, 1], got {p.top_p}")
        _check(
            p.top_k == -1 or 1 <= p.top_k <= TOP_K_OFF,
            f"{where}.top_k must be -1 (off) or in [1, 2**30], got {short(p.top_k)}",
        )
        _check(0 <= p.min_p <= 1, f"{where}.min_p must be in [0, 1], got {p.min_p}")
        _check(1 <= p.n <= MAX_N, f"{where}.n must be in [1, {MAX_N}], got {short(p.n)}")
        if p.sampling_seed is not None:
            lo, hi = SEED_RANGE
            _check(
                lo <= p.sampling_seed < hi,
                f"{where}.sampling_seed must be in [-2**63, 2**63), got {short(p.sampling_seed)}",
            )
        if p.top_k == -1:
            p.top_k = TOP_K_OFF
        if p.temperature < GREEDY_EPS:
            p.temperature = 0.0
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
    sample_offset: int = 0  # a client's n samples may be split over requests: this one's first index
    total_n: int | None = None  # the client's n (None: params.n)
    split: int | None = None  # shared by the parts a server split one prompt's n into (None: not split)
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


def compact_route_dtype(routes: np.ndarray) -> np.dtype:
    """The smallest integer type that holds ``routes`` (expert ids, -1 for none): int8 below 128
    experts (Qwen3-30B-A3B's 128 need int16), int16 below 32,768. A step's routes are the largest
    thing rank 0 holds under R3 (``L x K`` per token), so they are kept in it from the start."""
    top = int(routes.max()) if routes.size else 0
    return np.dtype(np.int8 if top < 128 else np.int16 if top < 32768 else np.int32)


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
        "/generate answer without output_ids (SGLang's answers carry them: is this an SGLang server?)",
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
