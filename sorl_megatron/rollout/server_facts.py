"""What the trainer must know about a rollout server before it talks to it, read from SGLang's
``/server_info`` (its server arguments plus ``version``; the embedded CPU server answers the
same fields): which weight-update protocol the server speaks, whether it can honour the
agent's requests, and how it quantizes the weights a sync sends it.

- Weight-update sessions: from SGLang 0.5.21 a distributed or tensor update is refused outside
  ``/begin_weight_update`` ... ``/end_weight_update``; before 0.5.21 those endpoints do not
  exist (404). The client opens a session exactly where the server has them.
- ``skip_tokenizer_init``: such a server refuses every request carrying stop strings (the
  agent's turns all do), so the trainer refuses it when it starts (:meth:`ServerFacts.check_rollouts`)
  rather than see every episode fail.
- FP8 (:func:`served_weight_format`): SGLang loads block-FP8 pairs (``weight`` +
  ``weight_scale_inv``) only into a server started from an FP8-serialized checkpoint (its
  ``config.json`` has ``quantization_config`` with ``quant_method: fp8`` and
  ``weight_block_size``); a BF16 checkpoint served with ``--quantization fp8`` is quantized
  online per tensor, into a layout a sync cannot write. ``/server_info`` reports the flag, not
  the checkpoint, so the checkpoint's ``config.json`` is read from ``model_path``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

SESSIONS_SINCE = (0, 5, 21)  # /begin_weight_update and /end_weight_update exist, and are required
OLDEST_SUPPORTED = (0, 5, 18)  # the oldest SGLang this client was checked against

WeightFormat = Literal["bf16", "block_fp8"]


class ServerMismatchError(RuntimeError):
    """A rollout server that cannot work with this run as it was started (version, flags,
    checkpoint): a setup error, never retried, naming the server and what it needs."""


def parse_version(text: Any) -> tuple[int, int, int] | None:
    """``"0.5.21"``, ``"0.5.21.post1"``, ``"0.5.21rc0"`` -> ``(0, 5, 21)``; None when unreadable."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)\.(\d+)", str(text)) if text is not None else None
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


@dataclass(frozen=True)
class ServerFacts:
    """One server's answer to ``/server_info``, checked (:meth:`from_server_info`)."""

    url: str
    version: str
    tp_size: int = 1
    skip_tokenizer_init: bool = False
    quantization: str | None = None
    model_path: str | None = None
    # this project's embedded server reads safetensors bodies on /update_weights_from_tensor;
    # SGLang reads there pickled tensors (CUDA IPC handles) from a process on its own GPUs
    safetensors_updates: bool = False

    @property
    def weight_update_sessions(self) -> bool:
        """Whether updates must run between ``/begin_weight_update`` and ``/end_weight_update``."""
        v = parse_version(self.version)
        return v is not None and v >= SESSIONS_SINCE

    @classmethod
    def from_server_info(cls, url: str, info: Any) -> "ServerFacts":
        """The facts of ``url``; :class:`ServerMismatchError` for a server this client cannot use."""
        if not isinstance(info, dict):
            raise ServerMismatchError(f"{url}/server_info answered {type(info).__name__}, not a JSON object")
        found = parse_version(info.get("version"))
        if found is None or found < OLDEST_SUPPORTED:
            raise ServerMismatchError(
                f"rollout server {url} reports SGLang version {info.get('version')!r}; this trainer needs "
                f"SGLang >= {_dotted(OLDEST_SUPPORTED)} (weight-update sessions from {_dotted(SESSIONS_SINCE)})")
        return cls(url=url, version=str(info["version"]), tp_size=int(info.get("tp_size") or 1),
                   skip_tokenizer_init=bool(info.get("skip_tokenizer_init")),
                   quantization=info.get("quantization") or None, model_path=info.get("model_path") or None,
                   safetensors_updates=info.get("weight_update_body") == "safetensors")

    def check_rollouts(self) -> None:
        """:class:`ServerMismatchError` where the agent's requests cannot be served."""
        if self.skip_tokenizer_init:
            raise ServerMismatchError(
                f"rollout server {self.url} was started with --skip-tokenizer-init: SGLang then refuses every "
                "request with stop strings, and every agent turn sends them (the tool-call tags). Start it "
                "without that flag (the client sends and reads token ids either way)")


def check_tensor_sync(facts: dict[str, ServerFacts]) -> None:
    """:class:`ServerMismatchError` where a server cannot take the tensor transport's bodies."""
    other = [f.url for f in facts.values() if not f.safetensors_updates]
    if other:
        raise ServerMismatchError(
            f"rollout.weight_sync.transport is tensor, which posts safetensors bodies that only this project's "
            f"embedded server reads; {', '.join(other)} (SGLang) takes pickled tensors from a process on its own "
            "GPUs there, and its scheduler would fail on them. Use rollout.weight_sync.transport=distributed "
            "(or disk)")


def same_protocol(facts: dict[str, ServerFacts]) -> bool:
    """Whether the servers use weight-update sessions; servers that disagree are refused (one
    sync drives them all the same way)."""
    kinds = {f.weight_update_sessions for f in facts.values()}
    if len(kinds) > 1:
        listing = ", ".join(f"{f.url} ({f.version})" for f in facts.values())
        raise ServerMismatchError(
            f"the rollout servers run SGLang versions on both sides of {_dotted(SESSIONS_SINCE)} "
            f"(weight-update sessions): {listing}; run one version")
    return kinds == {True}


def checkpoint_quantization(model_path: str | None) -> dict | None | Literal[False]:
    """The ``quantization_config`` of ``model_path``'s ``config.json`` (None: none, a BF16
    checkpoint; False: the file cannot be read from here)."""
    if not model_path:
        return False
    path = Path(model_path) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return q if isinstance(q, dict) else None


def served_weight_format(facts: ServerFacts, precision: str, trainer_path: str = "<the trainer's HF checkpoint>",
                         checkpoint_config: dict | None | Literal[False] | None = None) -> WeightFormat:
    """How the server takes weights: ``block_fp8`` (``weight`` + ``weight_scale_inv`` pairs,
    128x128 blocks) or ``bf16``; :class:`ServerMismatchError` where it agrees with neither the
    recipe's ``rollout.precision`` nor anything a sync can send. ``checkpoint_config``: the
    served checkpoint's ``quantization_config`` (default: read from ``facts.model_path``)."""
    from ..common.fp8 import FP8_BLOCK  # torch: only where a sync needs it

    q = checkpoint_quantization(facts.model_path) if checkpoint_config is None else checkpoint_config
    fix = (f"make an FP8-serialized checkpoint with `python tools/convert.py megatron-to-hf --hf {trainer_path} "
           "--out <dir> --fp8` "
           "and start the server from it")
    if q is False:
        if precision != "fp8" and facts.quantization is None:
            return "bf16"
        raise ServerMismatchError(
            f"rollout server {facts.url} (quantization={facts.quantization!r}) serves {facts.model_path!r}, whose "
            "config.json cannot be read from the trainer, so how it stores FP8 weights is unknown; put the "
            "checkpoint where the trainer can read it (the same path)")
    method = str((q or {}).get("quant_method") or "").lower()
    if method == "fp8":
        block = list((q or {}).get("weight_block_size") or [])
        if block != list(FP8_BLOCK):
            raise ServerMismatchError(
                f"rollout server {facts.url} serves an FP8 checkpoint with weight_block_size {block or None}; the "
                f"trainer sends {FP8_BLOCK[0]}x{FP8_BLOCK[1]} blocks: {fix}")
        if precision != "fp8":
            raise ServerMismatchError(
                f"rollout server {facts.url} serves a block-FP8 checkpoint but rollout.precision is {precision!r}: "
                "set rollout.precision: fp8 (the sync then sends block-FP8 pairs)")
        return "block_fp8"
    if method:
        raise ServerMismatchError(
            f"rollout server {facts.url} serves a {method!r}-quantized checkpoint; a sync sends BF16 or block FP8 "
            f"only: {fix}, or serve the BF16 checkpoint")
    if facts.quantization:
        raise ServerMismatchError(
            f"rollout server {facts.url} quantizes a BF16 checkpoint online (--quantization "
            f"{facts.quantization}): its weights are per-tensor/channel scaled and transposed, and a sync "
            f"cannot write them; {fix} (no --quantization flag needed)")
    if precision == "fp8":
        raise ServerMismatchError(
            f"rollout.precision is fp8 but rollout server {facts.url} serves the BF16 checkpoint "
            f"{facts.model_path!r}: {fix}")
    return "bf16"
