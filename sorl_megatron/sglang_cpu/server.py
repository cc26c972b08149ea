"""The CPU stand-in for SGLang: command line, and embedding in another process.

    python -m sorl_megatron.sglang_cpu.server --model-path DIR --port 30000

Answers the subset of SGLang's native HTTP API that RL rollouts use (``app.py``,
docs/concepts/rollout.md) with HF transformers on CPU (``engine.py``). A malformed request gets HTTP 400
with ``{"error": {"message": ...}}``; an internal failure gets 500; neither stops the server.
``start_rollout_server`` runs one inside this process (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from ..common.background import BackgroundServer
from ..common.cli_range import DAY, MAX_PORT, MAX_SEED, count, number, seconds
from ..common.protocol import PRECISIONS, ROLLOUT_API_KEY_ENV
from ..common.serving import check_api_key
from .options import EngineConfig, ServerOptions

if TYPE_CHECKING:  # torch/transformers load lazily so that --help answers at once
    from .engine import RolloutEngine

log = logging.getLogger("sorl_megatron.sglang_cpu.server")  # not __main__ under python -m

# A client that disconnects (it timed out, or gave up on this server) cancels its handler, so
# its sequences leave the batch instead of decoding to max_new_tokens for nobody (aiohttp
# leaves handlers running by default). A control call or weight update already queued on the
# scheduler still runs (its answer goes nowhere); a distributed bucket whose broadcast started
# is received and applied.
CANCEL_ON_DISCONNECT = True


@dataclass
class RolloutServer:
    """An engine plus its HTTP server running in background threads (tests, the demo)."""

    engine: RolloutEngine
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
    from .app import build_app
    from .engine import RolloutEngine

    engine = RolloutEngine(cfg).start()
    http = BackgroundServer(build_app(engine, options), host, port, handler_cancellation=CANCEL_ON_DISCONNECT)
    return RolloutServer(engine, http.start())


def _check_ranges(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What a flag's type cannot check alone (each numeric flag's range is its cli_range type)."""
    from ..rollout.server_facts import parse_version

    if parse_version(args.sglang_version) is None:
        p.error(f"--sglang-version must be a release like 0.5.21, got {args.sglang_version!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sorl_megatron.sglang_cpu.server",
        description="SGLang-compatible rollout server on CPU (HF transformers). Speaks the /generate, "
        "weight-update and control endpoints of SGLang's native API used by RL trainers.",
    )
    p.add_argument("--model-path", required=True, help="HF model directory (config.json + *.safetensors [+ tokenizer])")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: --model-path)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=count(0, MAX_PORT), default=30000, help="TCP port (default 30000, as SGLang)")
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
    p.add_argument("--fp8-block-size", type=count(1, 4096), default=128,
                   help="block edge of the FP8 weight scales (default 128)")
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="allow return_routed_experts in /generate (MoE models; R3 routing replay)",
    )
    p.add_argument(
        "--skip-tokenizer-init", action="store_true",
        help="SGLang's flag, mirrored: no tokenizer, no text field, requests with stop strings refused "
        "(the trainer refuses such a server: its agent sends stop strings)"
    )
    p.add_argument(
        "--max-running-requests", type=count(1, 1 << 16), default=32,
        help="most sequences decoded together in one batch (default 32)"
    )
    p.add_argument(
        "--context-length",
        type=count(1, 1 << 24),
        default=None,
        help="max prompt+completion tokens (default: max_position_embeddings)",
    )
    p.add_argument(
        "--random-seed", type=count(0, MAX_SEED), default=0,
        help="seed of the sampler for requests without sampling_seed (default 0)"
    )
    p.add_argument(
        "--weight-version", default="default", help="initial weight_version reported in meta_info (default 'default')"
    )
    p.add_argument("--num-threads", type=count(1, 4096), default=None,
                   help="torch intra-op CPU threads (default: torch's choice)")
    p.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="keep no prefix cache: every request prefills its whole prompt (cached_tokens is always 0)",
    )
    p.add_argument(
        "--prefix-cache-max-tokens",
        type=count(1, 1 << 32),
        default=1 << 16,
        help="most tokens of KV the prefix cache keeps, least recently used dropped first (default 65536)",
    )
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="a request with sampling_seed gets the same tokens whatever else runs (rows decoded one by one: "
        "no batching speed-up; see docs/concepts/rollout.md)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health* (as SGLang's --api-key); "
        f"default: the environment variable {ROLLOUT_API_KEY_ENV}, which unlike argv is not visible to other "
        "local users",
    )
    p.add_argument(
        "--max-body-mb", type=count(1, 1 << 20), default=64,
        help="largest body of /generate and control requests in MiB (default 64)"
    )
    p.add_argument(
        "--max-weight-body-mb",
        type=count(1, 1 << 20),
        default=1024,
        help="largest body of /update_weights_from_tensor in MiB (default 1024)",
    )
    p.add_argument(
        "--max-prompts-per-request",
        type=count(1, 1 << 20),
        default=1024,
        help="most sequences one /generate may ask for, prompts x n (default 1024)",
    )
    p.add_argument(
        "--max-tokens-per-request",
        type=count(1, 1 << 34),
        default=1 << 20,
        help="most tokens one /generate may ask for: prompt + max_new_tokens per sequence, summed (default 1048576)",
    )
    p.add_argument(
        "--weight-group-timeout-s",
        type=seconds(DAY),
        default=600.0,
        help="bound in seconds on each broadcast in a weight-update group (default 600)",
    )
    p.add_argument(
        "--weight-group-join-timeout-s",
        type=seconds(DAY),
        default=60.0,
        help="bound in seconds on joining a weight-update group (default 60; at most --weight-group-timeout-s)",
    )
    p.add_argument(
        "--max-weight-group-joins",
        type=count(1, 256),
        default=4,
        help="most /init_weights_update_group calls in flight, in a pool of their own; one more is refused with "
        "503 at once (default 4)",
    )
    p.add_argument(
        "--control-timeout-s",
        type=seconds(DAY),
        default=60.0,
        help="bound in seconds on /flush_cache, /pause_generation and /continue_generation waiting for the "
        "scheduler (they run at its next step; default 60); past it, or with the scheduler dead, they answer 5xx",
    )
    p.add_argument(
        "--weight-body-wait-s",
        type=seconds(DAY),
        default=60.0,
        help="bound in seconds on a /update_weights_from_tensor waiting for its turn: one such body is read, "
        "decoded and applied at a time (default 60); past it the call answers 503 with Retry-After",
    )
    p.add_argument(
        "--sglang-version",
        default="0.5.21",
        help="the SGLang release this server answers as (/server_info's version; default 0.5.21): before 0.5.21 "
        "it has no /begin_weight_update and /end_weight_update and applies each update at once; from 0.5.21 it "
        "refuses tensor and distributed updates outside them",
    )
    p.add_argument(
        "--inject-route-flip-fraction", type=number(0.0, 1.0), default=0.0,
        help="STUDY INJECTOR, not an SGLang flag: replace one top-k expert of this fraction of the (token, MoE "
        "layer) routing choices by another expert and compute with it (returned routes are the ones used); "
        "default 0 (off)",
    )
    p.add_argument("--inject-route-flip-seed", type=count(0, 2**31 - 1), default=0,
                   help="seed of the route-flip injector's hash (default 0)")
    p.add_argument("--log-level", default="info", help="python logging level (default info)")
    args = p.parse_args(argv)
    _check_ranges(p, args)
    try:
        check_api_key(args.api_key)  # --api-key "" would mean no authentication: refused
    except ValueError as err:
        p.error(str(err))
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

    from .app import build_app
    from .engine import RolloutEngine

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
        inject_route_flip_fraction=args.inject_route_flip_fraction,
        inject_route_flip_seed=args.inject_route_flip_seed,
    )
    opts = ServerOptions(
        max_body_mb=args.max_body_mb,
        max_weight_body_mb=args.max_weight_body_mb,
        max_prompts_per_request=args.max_prompts_per_request,
        max_tokens_per_request=args.max_tokens_per_request,
        api_key=args.api_key,
        weight_group_timeout_s=args.weight_group_timeout_s,
        weight_group_join_timeout_s=args.weight_group_join_timeout_s,
        max_weight_group_joins=args.max_weight_group_joins,
        control_timeout_s=args.control_timeout_s,
        weight_body_wait_s=args.weight_body_wait_s,
        sglang_version=args.sglang_version,
    )
    engine = RolloutEngine(cfg).start()
    auth = "API key required" if opts.api_key else "no API key: anyone who can connect may update weights"
    log.info("serving %s (%s, moe=%s) on http://%s:%d (%s)", args.model_path, args.precision, engine.served.is_moe,
             args.host, args.port, auth)
    try:
        web.run_app(build_app(engine, opts), host=args.host, port=args.port, print=lambda s: log.info("%s", s),
                    handler_cancellation=CANCEL_ON_DISCONNECT)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
