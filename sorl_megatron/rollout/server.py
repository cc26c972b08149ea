"""Embedded SGLang-compatible rollout server (HF transformers on CPU).

    python -m sorl_megatron.rollout.server --model-path DIR --port 30000

Answers the subset of SGLang's native HTTP API that RL rollouts use (docs/rollout.md):
``/generate`` (single and batch, ``n``, log-probs, routed experts), weight updates from disk,
from tensors and through a torch.distributed group (``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group``; gloo on CPU),
between ``/begin_weight_update`` and ``/end_weight_update``,
``/flush_cache`` (drops the prefix cache), ``/pause_generation`` and ``/continue_generation``,
``/health``, ``/model_info``. A malformed request gets HTTP 400 with
``{"error": {"message": ...}}``; an internal failure gets 500; neither stops the server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from ..common.background import BackgroundServer
from ..common.protocol import (
    PRECISIONS,
    ROLLOUT_API_KEY_ENV,
    GenRequest,
    ProtocolError,
    SamplingParams,
    _is_int,
    check_text,
    short,
)
from ..common.serving import BodyError, MiB, OffLoop, api_key_middleware, parse_json, read_body

if TYPE_CHECKING:  # torch/transformers load lazily so that --help answers at once
    from .engine import Engine, EngineConfig

log = logging.getLogger("sorl_megatron.rollout.server")

# A client that disconnects (it timed out, or gave up on this server) cancels its handler, so
# its sequences leave the batch instead of decoding to max_new_tokens for nobody (aiohttp
# leaves handlers running by default). A control call or weight update already queued on the
# scheduler still runs (its answer goes nowhere); a distributed bucket whose broadcast started
# is received and applied.
CANCEL_ON_DISCONNECT = True


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ProtocolError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


@dataclass(frozen=True)
class ServerOptions:
    """Limits and authentication of the HTTP front end (the engine's settings are EngineConfig).

    Attributes:
        max_body_mb: largest body of ``/generate`` and the control endpoints (MiB).
        max_weight_body_mb: largest body of ``/update_weights_from_tensor`` (MiB).
        max_prompts_per_request: most sequences one ``/generate`` may ask for (prompts x n).
        max_tokens_per_request: most tokens one ``/generate`` may ask for: the sum over its
            sequences of prompt tokens plus ``max_new_tokens`` (capped by the context length).
        api_key: when set, every endpoint but ``/health*`` needs ``Authorization: Bearer <key>``.
        weight_group_timeout_s: bound on joining a weight-update group and on each broadcast in it.
        control_timeout_s: bound on ``/flush_cache``, ``/pause_generation`` and
            ``/continue_generation`` waiting for the scheduler (they run at its next step).
    """

    max_body_mb: int = 64
    max_weight_body_mb: int = 1024
    max_prompts_per_request: int = 1024
    max_tokens_per_request: int = 1 << 20
    api_key: str | None = field(default=None, repr=False)
    weight_group_timeout_s: float = 600.0
    control_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_body_mb", "max_weight_body_mb", "max_prompts_per_request", "max_tokens_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.weight_group_timeout_s < float("inf"):
            raise ValueError(f"weight_group_timeout_s must be > 0 seconds, got {self.weight_group_timeout_s}")
        if not 0 < self.control_timeout_s < float("inf"):
            raise ValueError(f"control_timeout_s must be > 0 seconds, got {self.control_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for no authentication)")

    def public(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "api_key"}
        return {**d, "api_key_required": self.api_key is not None}


def token_ids(value: Any, where: str, vocab: int) -> list[int]:
    """A non-empty list of ints in ``[0, vocab)``, checked in C (bodies hold millions of ids)."""
    if not isinstance(value, list) or not value:
        raise ProtocolError(f"{where} must be a non-empty list of token ids")
    if not set(map(type, value)) <= {int}:  # bool is not a token id
        k = next(i for i, t in enumerate(value) if type(t) is not int)
        raise ProtocolError(f"{where}[{k}] is {short(value[k])}, not an integer token id")
    try:
        arr = np.array(value, dtype=np.int64)
        ok = bool(arr.min() >= 0 and arr.max() < vocab)
    except OverflowError:
        ok = False
    if not ok:
        k = next(i for i, t in enumerate(value) if not 0 <= t < vocab)
        raise ProtocolError(f"{where}[{k}] = {short(value[k])} is not a token id in [0, {vocab})")
    return value


def parse_generate(body: Any, engine: Engine, opts: ServerOptions | None = None) -> tuple[list[GenRequest], bool]:
    """Validate a ``/generate`` body into per-prompt requests; returns (requests, is_batch).

    Everything is checked before anything is queued, cheapest first (counts, lengths,
    totals, then every token id), so one bad element rejects the whole body with 400
    naming it (SGLang also rejects a batch whose element fails validation).
    """
    opts = opts or ServerOptions()
    if not isinstance(body, dict):
        raise ProtocolError("body must be a JSON object")
    if body.get("stream"):
        raise ProtocolError("stream=true is not supported by the embedded server")
    ids, text = body.get("input_ids"), body.get("text")
    if ids is None and text is None:
        raise ProtocolError("one of input_ids or text is required")
    if ids is not None and text is not None:
        raise ProtocolError("give either input_ids or text, not both")
    vocab, ctx = engine.vocab_size, engine.context_length
    if ids is None:
        is_batch = isinstance(text, list)
        raw = text if is_batch else [text]
        name = "text"
    else:
        if not isinstance(ids, list) or not ids:
            raise ProtocolError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        is_batch = isinstance(ids[0], list)
        raw = ids if is_batch else [ids]
        name = "input_ids"
    if not raw:
        raise ProtocolError(f"{name} must not be an empty list")
    cap = opts.max_prompts_per_request
    if len(raw) > cap:
        raise ProtocolError(f"{len(raw)} prompts in one request; the limit is {cap} (--max-prompts-per-request)")
    n = len(raw)

    def where(field_name: str, i: int) -> str:
        return f"{field_name}[{i}]" if is_batch else field_name

    sps = _per_prompt(body.get("sampling_params"), n, "sampling_params")
    params = [SamplingParams.from_json(sps[i], where("sampling_params", i)) for i in range(n)]
    sequences = sum(p.n for p in params)
    if sequences > cap:
        raise ProtocolError(
            f"{sequences} sequences (prompts x n) in one request; the limit is {cap} (--max-prompts-per-request)"
        )
    if ids is None:
        if engine.tokenizer is None:
            raise ProtocolError("text input needs a tokenizer (server started with --skip-tokenizer-init)")
        for i, t in enumerate(raw):
            if not isinstance(t, str):
                raise ProtocolError(f"{where('text', i)} must be a string, got {type(t).__name__}")
            check_text(t, where("text", i))
        prompts = engine.tokenizer(list(raw), add_special_tokens=False)["input_ids"]
    else:
        prompts = raw
    total = 0
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        if not isinstance(prompt, list) or not prompt:
            raise ProtocolError(f"{where(name, i)} must be a non-empty list of token ids")
        if len(prompt) >= ctx:
            raise ProtocolError(f"{where(name, i)} has {len(prompt)} tokens, the context length is {ctx}")
        total += sp.n * (len(prompt) + min(sp.max_new_tokens, ctx - len(prompt)))
    if total > opts.max_tokens_per_request:
        raise ProtocolError(
            f"the request asks for {total} tokens (prompt + max_new_tokens, times n, over its prompts); "
            f"the limit is {opts.max_tokens_per_request} (--max-tokens-per-request)"
        )
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        token_ids(prompt, where("input_ids", i), vocab)
        if sp.stop_token_ids:
            token_ids(sp.stop_token_ids, where("sampling_params", i) + ".stop_token_ids", vocab)
        if sp.stop and engine.tokenizer is None:
            raise ProtocolError(
                "stop strings need a tokenizer (server started with --skip-tokenizer-init); use stop_token_ids"
            )
    ret_lp = _per_prompt(body.get("return_logprob", False), n, "return_logprob")
    starts = _per_prompt(body.get("logprob_start_len", -1), n, "logprob_start_len")
    tops = _per_prompt(body.get("top_logprobs_num", 0), n, "top_logprobs_num")
    rids = _per_prompt(body.get("rid"), n, "rid")
    routed = body.get("return_routed_experts", False)
    r_start = body.get("routed_experts_start_len", 0)
    if not isinstance(routed, bool):
        raise ProtocolError("return_routed_experts must be a boolean")
    if routed and not engine.cfg.enable_return_routed_experts:
        raise ProtocolError("return_routed_experts needs the server flag --enable-return-routed-experts")
    if routed and not engine.is_moe:
        raise ProtocolError("return_routed_experts: the served model has no MoE routers")
    max_top = min(64, vocab)
    reqs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if not isinstance(ret_lp[i], bool):
            raise ProtocolError(f"{where('return_logprob', i)} must be a boolean")
        if not _is_int(starts[i]) or not -1 <= starts[i] < len(p):
            raise ProtocolError(
                f"{where('logprob_start_len', i)} must be -1 or in [0, {len(p)}), got {short(starts[i])}"
            )
        if not _is_int(tops[i]) or not 0 <= tops[i] <= max_top:
            raise ProtocolError(
                f"{where('top_logprobs_num', i)} must be an integer in [0, {max_top}], got {short(tops[i])}"
            )
        if not _is_int(r_start) or not 0 <= r_start <= len(p):
            raise ProtocolError(f"routed_experts_start_len must be in [0, {len(p)}], got {short(r_start)}")
        if rids[i] is not None and not isinstance(rids[i], str):
            raise ProtocolError(f"{where('rid', i)} must be a string")
        if rids[i] is not None:
            check_text(rids[i], where("rid", i))
        kw = {"rid": rids[i]} if rids[i] else {}
        # n larger than a wave is split into wave-sized requests (seeds follow the sample index).
        step = max(1, engine.cfg.max_running_requests)
        for lo in range(0, sp.n, step):
            part = sp if sp.n <= step else replace(sp, n=min(step, sp.n - lo))
            reqs.append(
                GenRequest(
                    input_ids=list(p),
                    params=part,
                    return_logprob=ret_lp[i],
                    logprob_start_len=starts[i],
                    top_logprobs_num=tops[i],
                    return_routed_experts=routed,
                    routed_experts_start_len=r_start,
                    sample_offset=lo,
                    total_n=sp.n,
                    **kw,
                )
            )
    return reqs, is_batch


class SchedulerError(RuntimeError):
    """A control call the scheduler thread did not run: dead (503) or not within its bound (504)."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


def _error(msg: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": msg}}, status=status)


def _result(ok: bool, msg: str, status: int | None = None) -> web.Response:
    return web.json_response({"success": ok, "message": msg}, status=status or (200 if ok else 400))


def build_app(engine: Engine, opts: ServerOptions | None = None) -> web.Application:
    from ..weight_sync.group import BucketSpec, GroupSpec, WeightGroupError, parse_group_name
    from ..weight_sync.wire import WeightError, deserialize_named_tensors  # torch: after --help, like the engine
    from .engine import PAUSE_MODES

    opts = opts or ServerOptions()
    body_limit = opts.max_body_mb * MiB
    weight_limit = opts.max_weight_body_mb * MiB
    off_loop = OffLoop("rollout-validate")

    async def on_scheduler(fut, what: str, bound_s: float | None = None) -> Any:
        """The result of a call queued on the scheduler thread; ``SchedulerError`` when that
        thread is dead (now or while waiting) or ``bound_s`` passes (None: the caller's own
        timeout bounds it, as for weight updates that wait for running requests)."""
        wrapped = asyncio.wrap_future(fut)
        deadline = None if bound_s is None else asyncio.get_running_loop().time() + bound_s
        while True:
            if not engine.alive and not fut.done():
                wrapped.cancel()
                raise SchedulerError(f"{what}: the scheduler thread is not running (see the server log)")
            left = 0.5 if deadline is None else min(0.5, deadline - asyncio.get_running_loop().time())
            if left <= 0:
                if fut.cancel():  # not started: it never runs, the 504 is the whole truth
                    raise SchedulerError(f"{what}: the scheduler did not run it within {bound_s:g} s "
                                         "(--control-timeout-s)", 504)
                deadline = None  # already running (a quick control call): answer what it did
                continue
            done, _ = await asyncio.wait({wrapped}, timeout=left)
            if done:
                return wrapped.result()

    async def run_control(fn) -> Any:
        return await on_scheduler(engine.call(fn), "weight update")

    async def run_urgent(fn, what: str) -> Any:
        return await on_scheduler(engine.call(fn, urgent=True), what, opts.control_timeout_s)

    async def read_json(request: web.Request, limit: int, flag: str) -> Any:
        raw = await read_body(request, limit, flag)
        return await off_loop.run(lambda: parse_json(raw))

    async def generate(request: web.Request) -> web.Response:
        raw = bytearray()
        try:
            raw = await read_body(request, body_limit, "--max-body-mb")
            reqs, is_batch = await off_loop.run(lambda: parse_generate(parse_json(raw), engine, opts))
        except BodyError as exc:
            return _error(str(exc), exc.status)
        except ProtocolError as exc:
            return _error(str(exc))
        except Exception as exc:  # a bug, or a tokenizer refusing the text: this request only
            log.exception("validating a /generate request failed")
            return _error(f"could not validate the request: {type(exc).__name__}: {exc}", 500)
        finally:
            raw = bytearray()  # drop the body now, not when the (long) generation ends
        futures = [asyncio.wrap_future(engine.submit(r)) for r in reqs]
        try:
            results = await asyncio.gather(*futures)
        except asyncio.CancelledError:  # client went away: its queued/running sequences stop
            for f in futures:
                f.cancel()
            raise
        except Exception as exc:
            for f in futures:
                f.cancel()
            return _error(f"generation failed: {type(exc).__name__}: {exc}", 500)
        flat = [obj for per_prompt in results for obj in per_prompt]
        if not is_batch and len(flat) == 1:
            return web.json_response(flat[0])
        return web.json_response(flat)

    def weight_handler(fn_of_body, limit: int = body_limit, flag: str = "--max-body-mb"):
        async def handler(request: web.Request) -> web.Response:
            raw = bytearray()
            try:
                raw = await read_body(request, limit, flag)

                def prepare():  # off the event loop: JSON and tensor payloads can be large
                    body = parse_json(raw) if raw.strip() else {}
                    if not isinstance(body, dict):
                        raise ProtocolError("body must be a JSON object")
                    return fn_of_body(body)

                fn = await off_loop.run(prepare)
                raw = bytearray()  # drop the body before the (slow) update runs
                msg = await run_control(fn)
            except BodyError as exc:
                return _result(False, str(exc), exc.status)
            except (ProtocolError, WeightError) as exc:
                return _result(False, str(exc))
            except SchedulerError as exc:
                return _result(False, str(exc), exc.status)
            except Exception as exc:
                log.exception("weight update failed")
                return _result(False, f"{type(exc).__name__}: {exc}", 500)
            return _result(True, msg)

        return handler

    def _version(body: dict, key: str = "weight_version") -> str | None:
        v = body.get(key)
        if v is not None:
            if not isinstance(v, str):
                raise ProtocolError(f"{key} must be a string")
            check_text(v, key)
        return v

    def from_disk(body: dict):
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ProtocolError("model_path (string) is required")
        check_text(path, "model_path")
        if "\x00" in path:
            raise ProtocolError("model_path contains a NUL character")
        version = _version(body)
        return lambda: engine.update_from_disk(path, version)

    def from_tensor(body: dict):
        payloads = body.get("serialized_named_tensors")
        if isinstance(payloads, str):
            payloads = [payloads]
        if not isinstance(payloads, list) or not payloads or not all(isinstance(x, str) for x in payloads):
            raise ProtocolError("serialized_named_tensors must be a list of base64 strings (one per TP rank)")
        fmt = body.get("load_format")
        if fmt is not None and not isinstance(fmt, str):
            raise ProtocolError("load_format must be a string")
        # The embedded server has one rank: every entry must carry the same tensors; use rank 0's.
        named = deserialize_named_tensors(payloads[0], fmt)
        version = _version(body)
        return lambda: engine.update_from_tensors(named, version)

    def group_handler(parse, work, apply=None):
        """A distributed-update endpoint: ``parse(body)`` checks the request (400 on a bad one),
        ``work(parsed)`` runs in a thread of its own (it waits on the other group members), then
        ``apply(parsed, result)``, if given, on the scheduler thread between waves. Once ``work``
        has started, both run to the end even if the client leaves: the collective finishes
        anyway, and a bucket received but not applied would tear the weights."""

        async def work_then_apply(parsed) -> Any:
            result = await asyncio.to_thread(work, parsed)
            return result if apply is None else await run_control(lambda: apply(parsed, result))

        def log_if_abandoned(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                log.warning("a distributed weight-update call whose client left failed: %s", task.exception())

        async def handler(request: web.Request) -> web.Response:
            try:
                body = await read_json(request, body_limit, "--max-body-mb")
                if not isinstance(body, dict):
                    raise ProtocolError("body must be a JSON object")
                parsed = parse(body)
                task = asyncio.ensure_future(work_then_apply(parsed))
                try:
                    msg = await asyncio.shield(task)
                except asyncio.CancelledError:  # the client left: the task goes on, unawaited
                    task.add_done_callback(log_if_abandoned)
                    raise
            except BodyError as exc:
                return _result(False, str(exc), exc.status)
            except (ProtocolError, WeightError, WeightGroupError) as exc:
                return _result(False, str(exc))
            except SchedulerError as exc:
                return _result(False, str(exc), exc.status)
            except Exception as exc:
                log.exception("distributed weight update failed")
                return _result(False, f"{type(exc).__name__}: {exc}", 500)
            return _result(True, msg)

        return handler

    def set_version(body: dict):
        v = _version(body, "new_version")
        if v is None:
            raise ProtocolError("new_version (string) is required")
        return lambda: engine.set_weight_version(v)

    async def flush_cache(_: web.Request) -> web.Response:
        # Drops the prefix cache at the next decode step; running requests keep their own KV.
        try:
            msg = await run_urgent(engine.flush_cache, "/flush_cache")
        except SchedulerError as exc:
            return web.Response(status=exc.status, text=str(exc))
        return web.Response(text=f"Cache flushed.\n({msg})\n")

    async def pause_generation(request: web.Request) -> web.Response:
        try:
            raw = await read_body(request, MiB, "(fixed 1 MiB for /pause_generation)")
            body = parse_json(raw) if raw.strip() else {}  # SGLang's default body: {"mode": "abort"}
            if not isinstance(body, dict):
                raise ProtocolError("body must be a JSON object")
            mode = body.get("mode", "abort")
            if mode not in PAUSE_MODES:
                raise ProtocolError(f"mode must be one of {list(PAUSE_MODES)}, got {short(mode)}")
        except BodyError as exc:
            return _result(False, str(exc), exc.status)
        except ProtocolError as exc:
            return _result(False, str(exc))
        try:
            msg = await run_urgent(lambda: engine.pause(mode), "/pause_generation")
        except SchedulerError as exc:
            return _result(False, str(exc), exc.status)
        return _result(True, msg)

    async def continue_generation(_: web.Request) -> web.Response:
        try:
            msg = await run_urgent(engine.resume, "/continue_generation")
        except SchedulerError as exc:
            return _result(False, str(exc), exc.status)
        return _result(True, msg)

    async def health(_: web.Request) -> web.Response:
        ok = engine.alive
        return web.Response(status=200 if ok else 503, text="" if ok else "scheduler thread is not running")

    async def health_generate(_: web.Request) -> web.Response:
        req = GenRequest(input_ids=[engine.pad_id], params=SamplingParams(max_new_tokens=1))
        try:
            await asyncio.wait_for(asyncio.wrap_future(engine.submit(req)), timeout=60)
        except Exception as exc:
            return web.Response(status=503, text=f"generation failed: {exc}")
        return web.Response(text="")

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response(engine.info())

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response(
            {
                **engine.cfg.__dict__,
                **engine.info(),
                **opts.public(),
                "tp_size": 1,  # ranks this server holds in a weight-update group
                "num_waves": engine.num_waves,  # prefill forwards (admissions into the running batch)
                "num_decode_steps": engine.num_steps,
                "max_running_batch": engine.max_batch,
                "num_tracked_aborts": engine.num_tracked_aborts,
                "num_live_requests": engine.num_live_requests,  # queued or running
            }
        )

    async def abort(request: web.Request) -> web.Response:
        try:
            body = await read_json(request, MiB, "(fixed 1 MiB for /abort_request)")
        except BodyError as exc:
            return _error(str(exc), exc.status)
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            return _error("rid (string) is required")
        engine.abort(rid)  # unknown ids are ignored, as in SGLang: nothing accumulates
        return web.Response(text="")

    async def memory_noop(_: web.Request) -> web.Response:
        return _result(True, "CPU server keeps weights and cache resident; nothing to release")

    middlewares = [api_key_middleware(opts.api_key)] if opts.api_key else []
    # Bodies are read by read_body with per-endpoint limits; aiohttp's own limit is a backstop.
    app = web.Application(client_max_size=max(body_limit, weight_limit), middlewares=middlewares)
    app.on_cleanup.append(off_loop.close)
    r = app.router
    r.add_post("/generate", generate)
    r.add_post("/update_weights_from_disk", weight_handler(from_disk))
    r.add_post("/begin_weight_update", weight_handler(lambda b: engine.begin_update))
    r.add_post(
        "/update_weights_from_tensor", weight_handler(from_tensor, weight_limit, "--max-weight-body-mb")
    )
    r.add_post("/end_weight_update", weight_handler(lambda b: engine.end_update))
    r.add_post(
        "/init_weights_update_group",
        group_handler(GroupSpec.from_json, lambda spec: engine.init_weights_group(spec, opts.weight_group_timeout_s)),
    )
    r.add_post("/update_weights_from_distributed", group_handler(
        # the weights are untouched until the whole bucket is here
        BucketSpec.from_json, engine.receive_bucket, lambda spec, named: engine.update_from_tensors(
            named, spec.weight_version)))
    r.add_post("/destroy_weights_update_group", group_handler(parse_group_name, engine.destroy_weights_group))
    r.add_post("/update_weight_version", weight_handler(set_version))
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    r.add_post("/abort_request", abort)
    r.add_post("/release_memory_occupation", memory_noop)
    r.add_post("/resume_memory_occupation", memory_noop)
    return app


@dataclass
class RolloutServer:
    """An engine plus its HTTP server running in background threads (tests, the demo)."""

    engine: Engine
    http: BackgroundServer

    @property
    def url(self) -> str:
        return self.http.url

    def stop(self) -> None:
        self.http.stop()
        self.engine.stop()


def start_rollout_server(
    cfg: EngineConfig, host: str = "127.0.0.1", port: int = 0, options: ServerOptions | None = None
) -> RolloutServer:
    """Start an embedded server in this process (port 0 picks a free port)."""
    from .engine import Engine

    engine = Engine(cfg).start()
    http = BackgroundServer(build_app(engine, options), host, port, handler_cancellation=CANCEL_ON_DISCONNECT)
    return RolloutServer(engine, http.start())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sorl_megatron.rollout.server",
        description="SGLang-compatible rollout server on CPU (HF transformers). Speaks the /generate, "
        "weight-update and control endpoints of SGLang's native API used by RL trainers.",
    )
    p.add_argument("--model-path", required=True, help="HF model directory (config.json + *.safetensors [+ tokenizer])")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: --model-path)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=30000, help="TCP port (default 30000, as SGLang)")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="rollout numerics: fp32, bf16, or fp8 (e4m3 128x128 block-quantized weights, bf16 compute); "
        "default fp32, or what --dtype/--quantization imply",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="SGLang-style alias: bfloat16 = --precision bf16",
    )
    p.add_argument("--quantization", choices=["fp8"], default=None, help="SGLang-style alias: fp8 = --precision fp8")
    p.add_argument("--fp8-block-size", type=int, default=128, help="block edge of the FP8 weight scales (default 128)")
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="allow return_routed_experts in /generate (MoE models; R3 routing replay)",
    )
    p.add_argument(
        "--skip-tokenizer-init", action="store_true", help="tokens in, tokens out: no tokenizer, no text field"
    )
    p.add_argument(
        "--max-running-requests", type=int, default=32, help="most sequences decoded together in one batch (default 32)"
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="max prompt+completion tokens (default: max_position_embeddings)",
    )
    p.add_argument(
        "--random-seed", type=int, default=0, help="seed of the sampler for requests without sampling_seed (default 0)"
    )
    p.add_argument(
        "--weight-version", default="default", help="initial weight_version reported in meta_info (default 'default')"
    )
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op CPU threads (default: torch's choice)")
    p.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="keep no prefix cache: every request prefills its whole prompt (cached_tokens is always 0)",
    )
    p.add_argument(
        "--prefix-cache-max-tokens",
        type=int,
        default=1 << 16,
        help="most tokens of KV the prefix cache keeps, least recently used dropped first (default 65536)",
    )
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="a request with sampling_seed gets the same tokens whatever else runs (rows decoded one by one: "
        "no batching speed-up; see docs/rollout.md)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health* (as SGLang's --api-key); "
        f"default: the environment variable {ROLLOUT_API_KEY_ENV}, which unlike argv is not visible to other "
        "local users",
    )
    p.add_argument(
        "--max-body-mb", type=int, default=64, help="largest body of /generate and control requests in MiB (default 64)"
    )
    p.add_argument(
        "--max-weight-body-mb",
        type=int,
        default=1024,
        help="largest body of /update_weights_from_tensor in MiB (default 1024)",
    )
    p.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=1024,
        help="most sequences one /generate may ask for, prompts x n (default 1024)",
    )
    p.add_argument(
        "--max-tokens-per-request",
        type=int,
        default=1 << 20,
        help="most tokens one /generate may ask for: prompt + max_new_tokens per sequence, summed (default 1048576)",
    )
    p.add_argument(
        "--weight-group-timeout-s",
        type=float,
        default=600.0,
        help="bound in seconds on joining a weight-update group and on each broadcast in it (default 600)",
    )
    p.add_argument(
        "--control-timeout-s",
        type=float,
        default=60.0,
        help="bound in seconds on /flush_cache, /pause_generation and /continue_generation waiting for the "
        "scheduler (they run at its next step; default 60); past it, or with the scheduler dead, they answer 5xx",
    )
    p.add_argument("--log-level", default="info", help="python logging level (default info)")
    args = p.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get(ROLLOUT_API_KEY_ENV) or None
    if args.precision is None:
        args.precision = "fp8" if args.quantization == "fp8" else ("bf16" if args.dtype == "bfloat16" else "fp32")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from ..bridge.hf_config import CheckpointFileError, require_hf_dir

    try:  # before transformers, which would take a mistyped directory for a Hub repo id
        require_hf_dir(args.model_path, "--model-path")
        if args.tokenizer_path and not args.skip_tokenizer_init:
            require_hf_dir(args.tokenizer_path, "--tokenizer-path", config=False)
    except CheckpointFileError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    from .engine import Engine, EngineConfig

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    cfg = EngineConfig(
        model_path=args.model_path,
        tokenizer_path=args.tokenizer_path,
        precision=args.precision,
        fp8_block_size=args.fp8_block_size,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        enable_return_routed_experts=args.enable_return_routed_experts,
        skip_tokenizer_init=args.skip_tokenizer_init,
        random_seed=args.random_seed,
        weight_version=args.weight_version,
        enable_prefix_cache=not args.disable_radix_cache,
        prefix_cache_max_tokens=args.prefix_cache_max_tokens,
        deterministic=args.enable_deterministic_inference,
    )
    opts = ServerOptions(
        max_body_mb=args.max_body_mb,
        max_weight_body_mb=args.max_weight_body_mb,
        max_prompts_per_request=args.max_prompts_per_request,
        max_tokens_per_request=args.max_tokens_per_request,
        api_key=args.api_key,
        weight_group_timeout_s=args.weight_group_timeout_s,
        control_timeout_s=args.control_timeout_s,
    )
    engine = Engine(cfg).start()
    log.info(
        "serving %s (%s, moe=%s) on http://%s:%d (%s)", args.model_path, args.precision, engine.is_moe, args.host,
        args.port, "API key required" if opts.api_key else "no API key: anyone who can connect may update weights",
    )
    try:
        web.run_app(build_app(engine, opts), host=args.host, port=args.port, print=lambda s: log.info("%s", s),
                    handler_cancellation=CANCEL_ON_DISCONNECT)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
