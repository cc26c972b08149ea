"""The HTTP app of the CPU server: the subset of SGLang's native API that RL rollouts use.

Endpoints (docs/rollout.md): ``/generate`` (single and batch, ``n``, log-probs, routed
experts), weight updates from disk, from tensors and through a torch.distributed group
(``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``; gloo on CPU) between ``/begin_weight_update`` and
``/end_weight_update`` (as the SGLang release ``--sglang-version`` names: from 0.5.21 an update
from tensors or a group is refused outside them; before it they do not exist),
``/update_weight_version``, ``/flush_cache``, ``/pause_generation``,
``/continue_generation``, ``/abort_request``, ``/health``, ``/health_generate``,
``/model_info``, ``/server_info``.

Errors: handlers raise, and ``error_response`` alone turns an exception into the answer:
the request's fault (``ProtocolError``, ``WeightError``, ``WeightGroupError``) is 400, a
refused body (``BodyError``) and a ``ServiceError`` carry their status (413; 503 with the
scheduler thread dead or, with ``Retry-After``, while another tensor-update body holds its
turn past ``--weight-body-wait-s``; 504 past ``--control-timeout-s``, 500 when generation
failed), and
anything else is 500 naming the exception, logged with its traceback. No error stops the
server. The answer has the endpoint's shape, as SGLang's: ``{"error": {"message": ...}}`` from
``/generate`` and ``/abort_request``, ``{"success": false, "message": ...}`` from the weight and
control endpoints, plain text from ``/flush_cache`` and ``/health*``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..common.protocol import GenRequest, ProtocolError, SamplingParams, check_text, short
from ..common.serving import BodyError, MiB, OffLoop, api_key_middlewares, parse_json, read_body
from ..weight_sync.group import BucketSpec, GroupSpec, WeightGroupError, parse_group_name
from .engine import RolloutEngine
from .options import ServerOptions
from .parse import parse_generate
from .scheduler import PAUSE_MODES
from .weight_groups import JoinsBusy
from .weights import WeightError, deserialize_named_tensors

log = logging.getLogger(__name__)

# The shapes of an answer (see the module doc).
ERROR, RESULT, TEXT = "error", "result", "text"
CLIENT_FAULTS = (ProtocolError, WeightError, WeightGroupError)  # 400


class ServiceError(RuntimeError):
    """What the server could not do, with the HTTP status that says why (see the module doc)."""

    def __init__(self, message: str, status: int = 503, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s  # sent as Retry-After: when trying again may succeed


def respond(shape: str, message: str, status: int = 200) -> web.Response:
    if shape == ERROR:
        return web.json_response({"error": {"message": message}}, status=status)
    if shape == RESULT:
        return web.json_response({"success": status == 200, "message": message}, status=status)
    return web.Response(status=status, text=message)


def error_response(exc: Exception, shape: str, what: str) -> web.Response:
    """The one mapping from an exception to an HTTP answer; ``what`` names the work in the log."""
    if isinstance(exc, (BodyError, ServiceError, JoinsBusy)):
        resp = respond(shape, str(exc), exc.status)
        if getattr(exc, "retry_after_s", None) is not None:
            resp.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        return resp
    if isinstance(exc, CLIENT_FAULTS):
        return respond(shape, str(exc), 400)
    log.error("%s failed", what, exc_info=exc)
    return respond(shape, f"{type(exc).__name__}: {exc}", 500)


def endpoint(shape: str, what: str):
    """A handler whose exceptions are answered by ``error_response`` in ``shape``. A cancelled
    handler (the client left) is not an error: ``CancelledError`` passes through."""

    def wrap(method):
        @functools.wraps(method)
        async def handler(self: Handlers, request: web.Request) -> web.StreamResponse:
            try:
                return await method(self, request)
            except web.HTTPException:
                raise
            except Exception as exc:
                return error_response(exc, shape, what)

        return handler

    return wrap


def _version(body: dict, key: str = "weight_version") -> str | None:
    v = body.get(key)
    if v is not None:
        if not isinstance(v, str):
            raise ProtocolError(f"{key} must be a string")
        check_text(v, key)
    return v


def _log_if_abandoned(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("a distributed weight-update call whose client left failed: %s", task.exception())


class Handlers:
    """The endpoints over one engine; bodies are parsed and checked off the event loop."""

    def __init__(self, engine: RolloutEngine, opts: ServerOptions):
        self.engine = engine
        self.opts = opts
        self.body_limit = opts.max_body_mb * MiB
        self.weight_limit = opts.max_weight_body_mb * MiB
        self.off_loop = OffLoop("rollout-validate")
        engine.groups.max_joins = opts.max_weight_group_joins
        # One /update_weights_from_tensor body in memory at a time: taken before its first byte
        # is read, held until its update is applied (its decoded tensors live until then).
        self._weight_body_turn = asyncio.Semaphore(1)

    # ----- the scheduler thread -----

    async def _on_scheduler(self, fut, what: str, bound_s: float | None = None) -> Any:
        """The result of a call queued on the scheduler thread; ``ServiceError`` when that
        thread is dead (now or while waiting) or ``bound_s`` passes (None: the caller's own
        timeout bounds it, as for weight updates that wait for running requests)."""
        engine = self.engine
        wrapped = asyncio.wrap_future(fut)
        deadline = None if bound_s is None else asyncio.get_running_loop().time() + bound_s
        while True:
            if not engine.alive and not fut.done():
                wrapped.cancel()
                raise ServiceError(f"{what}: the scheduler thread is not running (see the server log)")
            left = 0.5 if deadline is None else min(0.5, deadline - asyncio.get_running_loop().time())
            if left <= 0:
                if fut.cancel():  # not started: it never runs, the 504 is the whole truth
                    raise ServiceError(f"{what}: the scheduler did not run it within {bound_s:g} s "
                                       "(--control-timeout-s)", 504)
                deadline = None  # already running (a quick control call): answer what it did
                continue
            done, _ = await asyncio.wait({wrapped}, timeout=left)
            if done:
                return wrapped.result()

    async def _control(self, fn: Callable[[], Any]) -> Any:
        return await self._on_scheduler(self.engine.call(fn), "weight update")

    async def _urgent(self, fn: Callable[[], Any], what: str) -> Any:
        return await self._on_scheduler(self.engine.call(fn, urgent=True), what, self.opts.control_timeout_s)

    @contextlib.asynccontextmanager
    async def _one_weight_body(self):
        """The turn of one large weight body; 503 with Retry-After past ``--weight-body-wait-s``.
        Waiting bodies are not read: TCP flow control holds them in the clients."""
        wait_s = self.opts.weight_body_wait_s
        try:
            await asyncio.wait_for(self._weight_body_turn.acquire(), wait_s)
        except asyncio.TimeoutError:
            raise ServiceError(f"another /update_weights_from_tensor body is being received or applied; waited "
                               f"{wait_s:g} s for its turn (--weight-body-wait-s): retry later", 503,
                               retry_after_s=wait_s) from None
        try:
            yield
        finally:
            self._weight_body_turn.release()

    async def _read_json(self, request: web.Request, limit: int, flag: str) -> Any:
        raw = await read_body(request, limit, flag)
        return await self.off_loop.run(lambda: parse_json(raw))

    # ----- generation -----

    @endpoint(ERROR, "/generate")
    async def generate(self, request: web.Request) -> web.Response:
        raw = bytearray()
        try:
            raw = await read_body(request, self.body_limit, "--max-body-mb")
            reqs, is_batch = await self.off_loop.run(lambda: parse_generate(parse_json(raw), self.engine, self.opts))
        except (BodyError, ProtocolError):
            raise
        except Exception as exc:  # a bug, or a tokenizer refusing the text: this request only
            log.exception("validating a /generate request failed")
            raise ServiceError(f"could not validate the request: {type(exc).__name__}: {exc}", 500) from None
        finally:
            raw = bytearray()  # drop the body now, not when the (long) generation ends
        futures = [asyncio.wrap_future(self.engine.submit(r)) for r in reqs]
        try:
            results = await asyncio.gather(*futures)
        except BaseException as exc:  # the client went away (cancelled) or a request failed: stop the others
            for f in futures:
                f.cancel()
            if isinstance(exc, Exception):
                raise ServiceError(f"generation failed: {type(exc).__name__}: {exc}", 500) from None
            raise
        flat = [obj for per_prompt in results for obj in per_prompt]
        if not is_batch and len(flat) == 1:
            return web.json_response(flat[0])
        return web.json_response(flat)

    @endpoint(TEXT, "/health_generate")
    async def health_generate(self, _: web.Request) -> web.Response:
        req = GenRequest(input_ids=[self.engine.served.pad_id], params=SamplingParams(max_new_tokens=1))
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.engine.submit(req)), timeout=60)
        except Exception as exc:
            raise ServiceError(f"generation failed: {exc}", 503) from None
        return web.Response(text="")

    @endpoint(ERROR, "/abort_request")
    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._read_json(request, MiB, "(fixed 1 MiB for /abort_request)")
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            raise ProtocolError("rid (string) is required")
        self.engine.abort(rid)  # unknown ids are ignored, as in SGLang: nothing accumulates
        return web.Response(text="")

    # ----- weight updates through the scheduler thread -----

    async def _weight_update(self, request: web.Request, prepare: Callable[[dict], Callable[[], str]],
                             limit: int | None = None, flag: str = "--max-body-mb") -> web.Response:
        """``prepare(body)`` checks the body and returns the update, run on the scheduler thread
        between waves."""
        raw = await read_body(request, limit or self.body_limit, flag)

        def checked():  # off the event loop: JSON and tensor payloads can be large
            body = parse_json(raw) if raw.strip() else {}
            raw.clear()  # the raw bytes are not needed while the (large) payload is decoded
            if not isinstance(body, dict):
                raise ProtocolError("body must be a JSON object")
            return prepare(body)

        fn = await self.off_loop.run(checked)
        raw = bytearray()  # drop the body before the (slow) update runs
        return respond(RESULT, await self._control(fn))

    def _from_disk(self, body: dict) -> Callable[[], str]:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ProtocolError("model_path (string) is required")
        check_text(path, "model_path")
        if "\x00" in path:
            raise ProtocolError("model_path contains a NUL character")
        version = _version(body)
        return lambda: self.engine.served.update_from_disk(path, version)

    def _from_tensor(self, body: dict) -> Callable[[], str]:
        payloads = body.get("serialized_named_tensors")
        if isinstance(payloads, str):
            payloads = [payloads]
        if not isinstance(payloads, list) or not payloads or not all(isinstance(x, str) for x in payloads):
            raise ProtocolError("serialized_named_tensors must be a list of base64 strings (one per TP rank)")
        fmt = body.get("load_format")
        if fmt is not None and not isinstance(fmt, str):
            raise ProtocolError("load_format must be a string")
        # The embedded server has one rank: every entry must carry the same tensors; use rank 0's.
        box = [deserialize_named_tensors(payloads[0], fmt)]
        version = _version(body)

        def update() -> str:  # on the scheduler thread
            try:
                self._in_session("update_weights_from_tensor")
                return self.engine.served.update_from_tensors(box.pop(), version)
            except WeightError as exc:
                message = str(exc)
            finally:
                box.clear()  # the payload is gone once the update has run, whatever holds this function
            # A fresh error raised outside the handler: no frame in its traceback holds the tensors.
            raise WeightError(message)

        return update

    def _set_version(self, body: dict) -> Callable[[], str]:
        v = _version(body, "new_version")
        if v is None:
            raise ProtocolError("new_version (string) is required")
        return lambda: self.engine.served.set_weight_version(v)

    @endpoint(RESULT, "weight update")
    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        return await self._weight_update(request, self._from_disk)

    @endpoint(RESULT, "weight update")
    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        async with self._one_weight_body():
            try:
                return await self._weight_update(request, self._from_tensor, self.weight_limit,
                                                 "--max-weight-body-mb")
            except web.HTTPException:
                raise
            except Exception as exc:
                answer = error_response(exc, RESULT, "weight update")
            # A payload that failed to decode is held by its exception's traceback, in a reference
            # cycle (the exception and the future that carried it): free it before the next
            # body's turn, or each refused body would stay until the collector ran.
            gc.collect()
            return answer

    def _in_session(self, what: str) -> None:
        """As SGLang 0.5.21+: an update from tensors or a group only inside a session."""
        if self.opts.weight_update_sessions and not self.engine.served.in_update:
            raise WeightError(f"{what} must run between begin_weight_update() and end_weight_update()")

    def _begin(self) -> str:
        if self.engine.served.in_update:
            raise WeightError("a weight-update session is already open; call end_weight_update() first")
        return self.engine.served.begin_update()

    def _end(self) -> str:
        if not self.engine.served.in_update:
            raise WeightError("no weight-update session is open; call begin_weight_update() first")
        return self.engine.served.end_update()

    @endpoint(RESULT, "weight update")
    async def begin_weight_update(self, request: web.Request) -> web.Response:
        return await self._weight_update(request, lambda body: self._begin)

    @endpoint(RESULT, "weight update")
    async def end_weight_update(self, request: web.Request) -> web.Response:
        return await self._weight_update(request, lambda body: self._end)

    @endpoint(RESULT, "weight update")
    async def update_weight_version(self, request: web.Request) -> web.Response:
        return await self._weight_update(request, self._set_version)

    # ----- distributed weight updates -----

    async def _group_call(self, request: web.Request, parse: Callable[[dict], Any], work: Callable[[Any], Any],
                          apply: Callable[[Any, Any], str] | None = None,
                          start: Callable[[Any], Any] | None = None) -> web.Response:
        """``parse(body)`` checks the request (400 on a bad one), ``work(parsed)`` runs in a thread
        of its own (it waits on the other group members; ``start(parsed)``, if given, submits it
        and returns its future), then ``apply(parsed, result)``, if given, on the scheduler
        thread between waves. Once ``work`` has started, both run to the end even if the client
        leaves: the collective finishes anyway, and a bucket received but not applied would tear
        the weights."""
        body = await self._read_json(request, self.body_limit, "--max-body-mb")
        if not isinstance(body, dict):
            raise ProtocolError("body must be a JSON object")
        parsed = parse(body)

        async def work_then_apply() -> Any:
            result = await (asyncio.wrap_future(start(parsed)) if start else asyncio.to_thread(work, parsed))
            return result if apply is None else await self._control(lambda: apply(parsed, result))

        task = asyncio.ensure_future(work_then_apply())
        try:
            msg = await asyncio.shield(task)
        except asyncio.CancelledError:  # the client left: the task goes on, unawaited
            task.add_done_callback(_log_if_abandoned)
            raise
        return respond(RESULT, msg)

    @endpoint(RESULT, "distributed weight update")
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        # in the joins' own pool, capped (503 beyond), bounded by the join timeout
        groups, opts = self.engine.groups, self.opts
        join_s = min(opts.weight_group_join_timeout_s, opts.weight_group_timeout_s)
        return await self._group_call(request, GroupSpec.from_json, None, start=lambda spec: groups.start_join(
            spec, opts.weight_group_timeout_s, join_s))

    @endpoint(RESULT, "distributed weight update")
    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        served = self.engine.served  # the weights are untouched until the whole bucket is here

        def parse(body: dict) -> BucketSpec:
            spec = BucketSpec.from_json(body)
            self._in_session("update_weights_from_distributed")
            return spec

        return await self._group_call(request, parse, self.engine.groups.receive_bucket,
                                      lambda spec, named: served.update_from_tensors(named, spec.weight_version))

    @endpoint(RESULT, "distributed weight update")
    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        return await self._group_call(request, parse_group_name, self.engine.groups.destroy)

    # ----- control -----

    @endpoint(TEXT, "/flush_cache")
    async def flush_cache(self, request: web.Request) -> web.Response:
        # As SGLang: refused (400) while requests run, or wait unpaused; ?timeout=S holds the call
        # until the scheduler is idle, at most S seconds.
        try:
            wait_s = float(request.query.get("timeout", 0))
        except ValueError:
            raise ProtocolError("timeout must be a number of seconds") from None
        if not 0 <= wait_s < float("inf"):
            raise ProtocolError(f"timeout must be >= 0 seconds, got {wait_s}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            msg = await self._urgent(self.engine.scheduler.flush_cache, "/flush_cache")
            if msg is not None:
                return web.Response(text=f"Cache flushed.\n({msg})\n")
            if loop.time() >= deadline:
                why = "Timed out waiting for idle state." if wait_s else "requests are running or waiting"
                return web.Response(status=400, text=f"Cache not flushed: {why}\n")
            await asyncio.sleep(min(0.05, max(deadline - loop.time(), 0.0)))

    @endpoint(RESULT, "/pause_generation")
    async def pause_generation(self, request: web.Request) -> web.Response:
        raw = await read_body(request, MiB, "(fixed 1 MiB for /pause_generation)")
        body = parse_json(raw) if raw.strip() else {}  # SGLang's default body: {"mode": "abort"}
        if not isinstance(body, dict):
            raise ProtocolError("body must be a JSON object")
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise ProtocolError(f"mode must be one of {list(PAUSE_MODES)}, got {short(mode)}")
        return respond(RESULT, await self._urgent(lambda: self.engine.scheduler.pause(mode), "/pause_generation"))

    @endpoint(RESULT, "/continue_generation")
    async def continue_generation(self, _: web.Request) -> web.Response:
        return respond(RESULT, await self._urgent(self.engine.scheduler.resume, "/continue_generation"))

    @endpoint(RESULT, "memory occupation")
    async def memory_noop(self, _: web.Request) -> web.Response:
        return respond(RESULT, "CPU server keeps weights and cache resident; nothing to release")

    # ----- state -----

    @endpoint(TEXT, "/health")
    async def health(self, _: web.Request) -> web.Response:
        if not self.engine.alive:
            raise ServiceError("scheduler thread is not running", 503)
        return web.Response(text="")

    @endpoint(TEXT, "/model_info")
    async def model_info(self, _: web.Request) -> web.Response:
        return web.json_response(self.engine.served.model_info())

    @endpoint(TEXT, "/server_info")
    async def server_info(self, _: web.Request) -> web.Response:
        engine = self.engine
        return web.json_response(
            {
                **engine.cfg.__dict__,
                **engine.info(),
                **self.opts.public(),  # version: the SGLang release this server answers as
                "quantization": "fp8" if engine.cfg.precision == "fp8" else None,  # as SGLang's --quantization
                "tp_size": 1,  # ranks this server holds in a weight-update group
                "device": engine.groups.device,  # where it receives weights: the trainer picks gloo or NCCL by it
                "num_waves": engine.num_waves,  # prefill forwards (admissions into the running batch)
                "num_decode_steps": engine.num_steps,
                "max_running_batch": engine.max_batch,
                "num_tracked_aborts": engine.num_tracked_aborts,
                "num_live_requests": engine.num_live_requests,  # queued or running
            }
        )


def build_app(engine: RolloutEngine, opts: ServerOptions | None = None) -> web.Application:
    opts = opts or ServerOptions()
    h = Handlers(engine, opts)
    middlewares = api_key_middlewares(opts.api_key)
    # Bodies are read by read_body with per-endpoint limits; aiohttp's own limit is a backstop.
    app = web.Application(client_max_size=max(h.body_limit, h.weight_limit), middlewares=middlewares)
    app.on_cleanup.append(h.off_loop.close)
    r = app.router
    r.add_post("/generate", h.generate)
    r.add_post("/update_weights_from_disk", h.update_weights_from_disk)
    if opts.weight_update_sessions:  # SGLang 0.5.21+; older releases answer 404
        r.add_post("/begin_weight_update", h.begin_weight_update)
        r.add_post("/end_weight_update", h.end_weight_update)
    r.add_post("/update_weights_from_tensor", h.update_weights_from_tensor)
    r.add_post("/init_weights_update_group", h.init_weights_update_group)
    r.add_post("/update_weights_from_distributed", h.update_weights_from_distributed)
    r.add_post("/destroy_weights_update_group", h.destroy_weights_update_group)
    r.add_post("/update_weight_version", h.update_weight_version)
    r.add_route("*", "/flush_cache", h.flush_cache)
    r.add_post("/pause_generation", h.pause_generation)
    r.add_post("/continue_generation", h.continue_generation)
    r.add_get("/health", h.health)
    r.add_get("/health_generate", h.health_generate)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, h.model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, h.server_info)
    r.add_post("/abort_request", h.abort_request)
    r.add_post("/release_memory_occupation", h.memory_noop)
    r.add_post("/resume_memory_occupation", h.memory_noop)
    return app
