"""Embedded SGLang-compatible rollout server (HF transformers on CPU).

    python -m sorl_megatron.rollout.server --model-path DIR --port 30000

Answers the subset of SGLang's native HTTP API that RL rollouts use (docs/rollout.md):
``/generate`` (single and batch, ``n``, log-probs, routed experts), weight updates from disk
and from tensors (between ``/begin_weight_update`` and ``/end_weight_update``),
``/flush_cache``, ``/health``, ``/model_info``. A malformed request gets HTTP 400 with
``{"error": {"message": ...}}``; an internal failure gets 500; neither stops the server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..common.background import BackgroundServer
from ..common.protocol import PRECISIONS, GenRequest, ProtocolError, SamplingParams, _is_int

if TYPE_CHECKING:  # torch/transformers load lazily so that --help answers at once
    from .engine import Engine, EngineConfig

log = logging.getLogger("sorl_megatron.rollout.server")


def _error(msg: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": msg}}, status=status)


def _result(ok: bool, msg: str, status: int | None = None) -> web.Response:
    return web.json_response({"success": ok, "message": msg}, status=status or (200 if ok else 400))


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ProtocolError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def parse_generate(body: Any, engine: Engine) -> tuple[list[GenRequest], bool]:
    """Validate a ``/generate`` body into per-prompt requests; returns (requests, is_batch)."""
    if not isinstance(body, dict):
        raise ProtocolError("body must be a JSON object")
    if body.get("stream"):
        raise ProtocolError("stream=true is not supported by the embedded server")
    ids, text = body.get("input_ids"), body.get("text")
    if ids is None and text is None:
        raise ProtocolError("one of input_ids or text is required")
    if ids is None:
        if engine.tokenizer is None:
            raise ProtocolError("text input needs a tokenizer (server started with --skip-tokenizer-init)")
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not all(isinstance(t, str) for t in texts):
            raise ProtocolError("text must be a string or a list of strings")
        prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    else:
        if not isinstance(ids, list) or not ids:
            raise ProtocolError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        is_batch = isinstance(ids[0], list)
        prompts = ids if is_batch else [ids]
    vocab = int(engine.hf_config.vocab_size)
    for i, p in enumerate(prompts):
        where = f"input_ids[{i}]" if is_batch else "input_ids"
        if not isinstance(p, list) or not p:
            raise ProtocolError(f"{where} must be a non-empty list of token ids")
        if not all(_is_int(t) and 0 <= t < vocab for t in p):
            raise ProtocolError(f"{where} holds a value that is not a token id in [0, {vocab})")
        if len(p) >= engine.context_length:
            raise ProtocolError(f"{where} has {len(p)} tokens, the context length is {engine.context_length}")
    n = len(prompts)
    sps = _per_prompt(body.get("sampling_params"), n, "sampling_params")
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
    reqs = []
    for i, p in enumerate(prompts):
        sp = SamplingParams.from_json(sps[i], "sampling_params" + (f"[{i}]" if is_batch else ""))
        if sp.stop and engine.tokenizer is None:
            raise ProtocolError(
                "stop strings need a tokenizer (server started with --skip-tokenizer-init); use stop_token_ids"
            )
        if not isinstance(ret_lp[i], bool):
            raise ProtocolError("return_logprob must be a boolean")
        if not _is_int(starts[i]) or not -1 <= starts[i] < len(p):
            raise ProtocolError(f"logprob_start_len must be -1 or in [0, {len(p)}), got {starts[i]!r}")
        if not _is_int(tops[i]) or not 0 <= tops[i] <= 64:
            raise ProtocolError(f"top_logprobs_num must be an integer in [0, 64], got {tops[i]!r}")
        if not _is_int(r_start) or not 0 <= r_start <= len(p):
            raise ProtocolError(f"routed_experts_start_len must be in [0, {len(p)}], got {r_start!r}")
        if rids[i] is not None and not isinstance(rids[i], str):
            raise ProtocolError("rid must be a string")
        kw = {"rid": rids[i]} if rids[i] else {}
        reqs.append(
            GenRequest(
                input_ids=list(p),
                params=sp,
                return_logprob=ret_lp[i],
                logprob_start_len=starts[i],
                top_logprobs_num=tops[i],
                return_routed_experts=routed,
                routed_experts_start_len=r_start,
                **kw,
            )
        )
    return reqs, is_batch


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:
        raise ProtocolError(f"body is not valid JSON: {exc}") from None


def build_app(engine: Engine) -> web.Application:
    from .weights import WeightError, deserialize_named_tensors

    async def run_control(fn) -> Any:
        return await asyncio.wrap_future(engine.call(fn))

    async def generate(request: web.Request) -> web.Response:
        try:
            reqs, is_batch = parse_generate(await _json(request), engine)
        except ProtocolError as exc:
            return _error(str(exc))
        futures = [asyncio.wrap_future(engine.submit(r)) for r in reqs]
        try:
            results = await asyncio.gather(*futures)
        except asyncio.CancelledError:  # client went away: stop its sequences
            for r in reqs:
                engine.abort(r.rid)
            raise
        except Exception as exc:
            log.exception("generation failed")
            return _error(f"generation failed: {type(exc).__name__}: {exc}", 500)
        flat = [obj for per_prompt in results for obj in per_prompt]
        if not is_batch and len(flat) == 1:
            return web.json_response(flat[0])
        return web.json_response(flat)

    def weight_handler(fn_of_body):
        async def handler(request: web.Request) -> web.Response:
            try:
                body = await _json(request) if request.can_read_body else {}
                if not isinstance(body, dict):
                    raise ProtocolError("body must be a JSON object")
                fn = fn_of_body(body)
                msg = await run_control(fn)
            except (ProtocolError, WeightError) as exc:
                return _result(False, str(exc))
            except Exception as exc:
                log.exception("weight update failed")
                return _result(False, f"{type(exc).__name__}: {exc}", 500)
            return _result(True, msg)

        return handler

    def _version(body: dict) -> str | None:
        v = body.get("weight_version")
        if v is not None and not isinstance(v, str):
            raise ProtocolError("weight_version must be a string")
        return v

    def from_disk(body: dict):
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ProtocolError("model_path (string) is required")
        version = _version(body)
        return lambda: engine.update_from_disk(path, version)

    def from_tensor(body: dict):
        payloads = body.get("serialized_named_tensors")
        if isinstance(payloads, str):
            payloads = [payloads]
        if not isinstance(payloads, list) or not payloads or not all(isinstance(x, str) for x in payloads):
            raise ProtocolError("serialized_named_tensors must be a list of base64 strings (one per TP rank)")
        # The embedded server has one rank: every entry must carry the same tensors; use rank 0's.
        named = deserialize_named_tensors(payloads[0], body.get("load_format"))
        version = _version(body)
        return lambda: engine.update_from_tensors(named, version)

    def set_version(body: dict):
        v = body.get("new_version")
        if not isinstance(v, str):
            raise ProtocolError("new_version (string) is required")

        def fn():
            engine.weight_version = v
            return f"weight_version set to {v}"

        return fn

    async def flush_cache(_: web.Request) -> web.Response:
        # No prefix cache is kept between requests, so there is nothing to drop.
        return web.Response(text="Cache flushed.\n")

    async def health(_: web.Request) -> web.Response:
        ok = engine._thread.is_alive()
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
        return web.json_response({**engine.cfg.__dict__, **engine.info(), "num_waves": engine.num_waves})

    async def abort(request: web.Request) -> web.Response:
        try:
            body = await _json(request)
        except ProtocolError as exc:
            return _error(str(exc))
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            return _error("rid (string) is required")
        engine.abort(rid)
        return web.Response(text="")

    async def memory_noop(_: web.Request) -> web.Response:
        return _result(True, "CPU server keeps weights and cache resident; nothing to release")

    app = web.Application(client_max_size=1024**3)
    r = app.router
    r.add_post("/generate", generate)
    r.add_post("/update_weights_from_disk", weight_handler(from_disk))
    r.add_post("/begin_weight_update", weight_handler(lambda b: engine.begin_update))
    r.add_post("/update_weights_from_tensor", weight_handler(from_tensor))
    r.add_post("/end_weight_update", weight_handler(lambda b: engine.end_update))
    r.add_post("/update_weight_version", weight_handler(set_version))
    r.add_route("*", "/flush_cache", flush_cache)
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


def start_rollout_server(cfg: EngineConfig, host: str = "127.0.0.1", port: int = 0) -> RolloutServer:
    """Start an embedded server in this process (port 0 picks a free port)."""
    from .engine import Engine

    engine = Engine(cfg).start()
    return RolloutServer(engine, BackgroundServer(build_app(engine), host, port).start())


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
        help="accepted for SGLang compatibility; no prefix cache is kept anyway",
    )
    p.add_argument("--log-level", default="info", help="python logging level (default info)")
    args = p.parse_args(argv)
    if args.precision is None:
        args.precision = "fp8" if args.quantization == "fp8" else ("bf16" if args.dtype == "bfloat16" else "fp32")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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
    )
    engine = Engine(cfg).start()
    log.info(
        "serving %s (%s, moe=%s) on http://%s:%d", args.model_path, args.precision, engine.is_moe, args.host, args.port
    )
    try:
        web.run_app(build_app(engine), host=args.host, port=args.port, print=lambda s: log.info("%s", s))
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
