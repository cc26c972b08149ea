"""The CPU server's weight-update endpoints: from disk, from tensors, and through a
torch.distributed group, inside ``/begin_weight_update`` ... ``/end_weight_update`` where the
SGLang release the server answers as has them, and ``/update_weight_version``.

Every update runs on the scheduler thread between waves (``engine.call``): an update waits for
the running requests (at once while generation is paused). One ``/update_weights_from_tensor``
body is held in memory at a time. A distributed bucket is received in a thread of its own (it
waits on the other group members), then applied on the scheduler thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..common.protocol import ProtocolError, check_text
from ..common.serving import MiB, OffLoop, parse_json, read_body
from ..weight_sync.group import BucketSpec, GroupSpec, parse_group_name
from .endpoints import RESULT, ServiceError, endpoint, error_response, on_scheduler, read_json, respond
from .engine import RolloutEngine
from .options import ServerOptions
from .weights import WeightError, deserialize_named_tensors

log = logging.getLogger("sorl_megatron.sglang_cpu.app")


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


class WeightEndpoints:
    """The weight-update endpoints over one engine (``Handlers.weights``); bodies are parsed and
    decoded off the event loop (``off_loop``, the handlers' own)."""

    def __init__(self, engine: RolloutEngine, opts: ServerOptions, off_loop: OffLoop):
        self.engine = engine
        self.opts = opts
        self.body_limit = opts.max_body_mb * MiB
        self.weight_limit = opts.max_weight_body_mb * MiB
        self.off_loop = off_loop
        engine.groups.max_joins = opts.max_weight_group_joins
        # One /update_weights_from_tensor body in memory at a time: taken before its first byte
        # is read, held until its update is applied (its decoded tensors live until then).
        self._weight_body_turn = asyncio.Semaphore(1)

    async def _control(self, fn: Callable[[], Any]) -> Any:
        return await on_scheduler(self.engine, self.engine.call(fn), "weight update")

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
        body = await read_json(self.off_loop, request, self.body_limit, "--max-body-mb")
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
