"""What the CPU server's endpoints share: the shapes of their answers and the one mapping from
an exception to an answer, request bodies read off the event loop, and calls awaited on the
scheduler thread.

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
import concurrent.futures as cf
import functools
import logging
import math
from typing import Any

from aiohttp import web

from ..common.protocol import ProtocolError
from ..common.serving import BodyError, OffLoop, parse_json, read_body
from ..weight_sync.group import WeightGroupError
from .engine import RolloutEngine
from .weight_groups import JoinsBusy
from .weights import WeightError

log = logging.getLogger("sorl_megatron.sglang_cpu.app")

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
        async def handler(self: Any, request: web.Request) -> web.StreamResponse:
            try:
                return await method(self, request)
            except web.HTTPException:
                raise
            except Exception as exc:
                return error_response(exc, shape, what)

        return handler

    return wrap


async def read_json(off_loop: OffLoop, request: web.Request, limit: int, flag: str) -> Any:
    """A JSON body of at most ``limit`` bytes (``flag`` names the limit), parsed off the event loop."""
    raw = await read_body(request, limit, flag)
    return await off_loop.run(lambda: parse_json(raw))


async def on_scheduler(engine: RolloutEngine, fut: cf.Future, what: str, bound_s: float | None = None) -> Any:
    """The result of a call queued on the scheduler thread; ``ServiceError`` when that
    thread is dead (now or while waiting) or ``bound_s`` passes (None: the caller's own
    timeout bounds it, as for weight updates that wait for running requests)."""
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
