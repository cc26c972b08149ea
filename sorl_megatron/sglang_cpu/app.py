"""The HTTP app of the CPU server: the subset of SGLang's native API that RL rollouts use.

Endpoints (docs/concepts/rollout.md): ``/generate`` (single and batch, ``n``, log-probs, routed
experts), weight updates from disk, from tensors and through a torch.distributed group
(``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``; gloo on CPU) between ``/begin_weight_update`` and
``/end_weight_update`` (as the SGLang release ``--sglang-version`` names: from 0.5.21 an update
from tensors or a group is refused outside them; before it they do not exist),
``/update_weight_version``, ``/flush_cache``, ``/pause_generation``,
``/continue_generation``, ``/abort_request``, ``/health``, ``/health_generate``,
``/model_info``, ``/server_info``.

Handlers are grouped: generation, weight updates (``weight_endpoints.py``), control, state.
Errors: handlers raise, and ``error_response`` (``endpoints.py``, with the answers' shapes) alone
turns an exception into the answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..common.protocol import GenRequest, ProtocolError, SamplingParams, short
from ..common.serving import BodyError, MiB, OffLoop, api_key_middlewares, parse_json, read_body
from .endpoints import ERROR, RESULT, TEXT, ServiceError, endpoint, on_scheduler, read_json, respond
from .engine import RolloutEngine
from .options import ServerOptions
from .parse import parse_generate
from .scheduler import PAUSE_MODES
from .weight_endpoints import WeightEndpoints

log = logging.getLogger(__name__)


class Handlers:
    """The endpoints over one engine; bodies are parsed and checked off the event loop."""

    def __init__(self, engine: RolloutEngine, opts: ServerOptions):
        self.engine = engine
        self.opts = opts
        self.body_limit = opts.max_body_mb * MiB
        self.off_loop = OffLoop("rollout-validate")
        self.weights = WeightEndpoints(engine, opts, self.off_loop)

    async def _urgent(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn`` at the scheduler's next step, bounded by ``--control-timeout-s``."""
        return await on_scheduler(self.engine, self.engine.call(fn, urgent=True), what, self.opts.control_timeout_s)

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
        body = await read_json(self.off_loop, request, MiB, "(fixed 1 MiB for /abort_request)")
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            raise ProtocolError("rid (string) is required")
        self.engine.abort(rid)  # unknown ids are ignored, as in SGLang: nothing accumulates
        return web.Response(text="")

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
                "weight_update_body": "safetensors",  # what /update_weights_from_tensor reads (not SGLang's)
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
    app = web.Application(client_max_size=max(h.body_limit, h.weights.weight_limit), middlewares=middlewares)
    app.on_cleanup.append(h.off_loop.close)
    r = app.router
    r.add_post("/generate", h.generate)
    r.add_post("/update_weights_from_disk", h.weights.update_weights_from_disk)
    if opts.weight_update_sessions:  # SGLang 0.5.21+; older releases answer 404
        r.add_post("/begin_weight_update", h.weights.begin_weight_update)
        r.add_post("/end_weight_update", h.weights.end_weight_update)
    r.add_post("/update_weights_from_tensor", h.weights.update_weights_from_tensor)
    r.add_post("/init_weights_update_group", h.weights.init_weights_update_group)
    r.add_post("/update_weights_from_distributed", h.weights.update_weights_from_distributed)
    r.add_post("/destroy_weights_update_group", h.weights.destroy_weights_update_group)
    r.add_post("/update_weight_version", h.weights.update_weight_version)
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
