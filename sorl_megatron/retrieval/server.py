"""Search-R1-compatible retrieval server: ``POST /retrieve`` over a BM25 index.

    python -m sorl_megatron.retrieval.server --corpus corpus.jsonl --port 8000

Request ``{"queries": [str], "topk": int, "return_scores": bool}``; answer
``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}`` (documents alone
without ``return_scores``). Bad requests answer HTTP 400 ``{"error": ...}`` with the reason;
bodies above ``--max-body-mb`` get 413 before they are buffered; with ``--api-key`` every
method on every path but ``GET /health`` needs ``Authorization: Bearer <key>``. Every flag is
range-checked at start (a server that would refuse or break every request does not start),
and so is the corpus (one whose passages hold only stop words indexes to nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..common.background import BackgroundServer
from ..common.cli_range import MAX_PORT, count, number
from ..common.protocol import RETRIEVAL_API_KEY_ENV, check_text, short
from ..common.serving import BodyError, MiB, OffLoop, api_key_middlewares, check_api_key, parse_json, read_body
from .bm25 import BM25Index, check_bm25_params

log = logging.getLogger("sorl_megatron.retrieval.server")


@dataclass(frozen=True)
class RetrievalServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    default_topk: int = 3
    max_topk: int = 100
    max_queries: int = 1024
    max_query_chars: int = 4096
    max_body_mb: int = 32  # 1024 queries x 4096 characters fit even if all are \u-escaped (24 MiB)
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """Refuse settings under which the server would refuse or break every request."""
        if not (isinstance(self.port, int) and 0 <= self.port <= 65535):
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        for flag, value in (("--max-topk", self.max_topk), ("--max-queries", self.max_queries),
                            ("--max-query-chars", self.max_query_chars), ("--max-body-mb", self.max_body_mb)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {value}")
        if isinstance(self.default_topk, bool) or not isinstance(self.default_topk, int) \
                or not 1 <= self.default_topk <= self.max_topk:
            raise ValueError(f"--topk must be an integer in [1, --max-topk {self.max_topk}], got {self.default_topk}")
        check_api_key(self.api_key)


class BadRequest(ValueError):
    pass


def _validate(body: Any, cfg: RetrievalServerConfig) -> tuple[list[str], int, bool]:
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object with a 'queries' list")
    queries = body.get("queries")
    if isinstance(queries, str):
        queries = [queries]
    if not isinstance(queries, list) or not queries:
        raise BadRequest("'queries' must be a non-empty list of strings")
    if len(queries) > cfg.max_queries:
        raise BadRequest(f"too many queries: {len(queries)} > --max-queries {cfg.max_queries}")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise BadRequest(f"queries[{i}] is {type(q).__name__}, expected a string")
        if not q.strip():
            raise BadRequest(f"queries[{i}] is empty")
        if len(q) > cfg.max_query_chars:
            raise BadRequest(f"queries[{i}] has {len(q)} characters > --max-query-chars {cfg.max_query_chars}")
        try:
            check_text(q, f"queries[{i}]")
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    topk = body.get("topk", cfg.default_topk)
    if topk is None:
        topk = cfg.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= cfg.max_topk:
        raise BadRequest(f"'topk' must be an integer in [1, {cfg.max_topk}], got {short(topk)}")
    return_scores = body.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise BadRequest(f"'return_scores' must be a boolean, got {short(return_scores)}")
    return queries, topk, return_scores


def build_app(index: BM25Index, cfg: RetrievalServerConfig) -> web.Application:
    lock = asyncio.Lock()
    off_loop = OffLoop("retrieval-validate")
    limit = cfg.max_body_mb * MiB

    async def retrieve(request: web.Request) -> web.Response:
        try:
            raw = await read_body(request, limit, "--max-body-mb")
            queries, topk, return_scores = await off_loop.run(lambda: _validate(parse_json(raw), cfg))
        except BodyError as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)
        except BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)
        async with lock:  # bm25s is not documented as thread-safe
            try:
                hits = await asyncio.get_running_loop().run_in_executor(None, index.search, queries, topk)
            except ValueError as exc:  # scores that are not finite: never sent as NaN
                log.error("retrieval failed: %s", exc)
                return web.json_response({"error": str(exc)}, status=500)
        result = [
            [
                {"document": {"id": p.id, "contents": p.contents}, "score": p.score}
                if return_scores
                else {"id": p.id, "contents": p.contents}
                for p in row
            ]
            for row in hits
        ]
        return web.json_response({"result": result})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "num_passages": len(index)})

    middlewares = api_key_middlewares(cfg.api_key, open_paths=("/health",))
    # Bodies are read by read_body (refused before buffering); aiohttp's limit is a backstop.
    app = web.Application(client_max_size=limit, middlewares=middlewares)
    app.on_cleanup.append(off_loop.close)
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    return app


def start_retrieval_server(index: BM25Index, cfg: RetrievalServerConfig | None = None) -> BackgroundServer:
    """Serve ``index`` in a background thread (port 0 picks a free port)."""
    cfg = cfg or RetrievalServerConfig(port=0)
    return BackgroundServer(build_app(index, cfg), cfg.host, cfg.port).start()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sorl_megatron.retrieval.server",
        description="Search-R1-compatible BM25 retrieval server (POST /retrieve, GET /health).",
    )
    p.add_argument(
        "--corpus",
        required=True,
        help='JSONL corpus, one {"id", "contents"} per line; contents = title line, then text',
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=count(0, MAX_PORT), default=8000, help="TCP port (default 8000)")
    p.add_argument("--topk", type=count(1, 1 << 20), default=3,
                   help="passages per query when a request gives no topk (default 3)")
    p.add_argument("--max-topk", type=count(1, 1 << 20), default=100,
                   help="largest topk a request may ask for (default 100)")
    p.add_argument("--max-queries", type=count(1, 1 << 20), default=1024,
                   help="most queries in one request (default 1024)")
    p.add_argument("--max-query-chars", type=count(1, 1 << 24), default=4096,
                   help="longest query in characters (default 4096)")
    p.add_argument(
        "--max-body-mb", type=count(1, 1 << 14), default=32,
        help="largest request body in MiB, refused with 413 (default 32)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every method and path but GET /health (non-empty); default: "
        f"the environment variable {RETRIEVAL_API_KEY_ENV}, which unlike argv is not visible to other local users",
    )
    p.add_argument("--bm25-k1", type=number(0.0, 100.0), default=1.5, help="BM25 k1, finite and >= 0 (default 1.5)")
    p.add_argument("--bm25-b", type=number(0.0, 1.0), default=0.75, help="BM25 b, in [0, 1] (default 0.75)")
    p.add_argument("--log-level", default="info", help="python logging level (default info)")
    args = p.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get(RETRIEVAL_API_KEY_ENV) or None
    try:  # every flag in range before the corpus is read: one line, exit 2
        server_config(args)
        check_bm25_params(args.bm25_k1, args.bm25_b)
    except ValueError as exc:
        p.error(str(exc))
    return args


def server_config(args: argparse.Namespace) -> RetrievalServerConfig:
    return RetrievalServerConfig(
        host=args.host,
        port=args.port,
        default_topk=args.topk,
        max_topk=args.max_topk,
        max_queries=args.max_queries,
        max_query_chars=args.max_query_chars,
        max_body_mb=args.max_body_mb,
        api_key=args.api_key,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    t0 = time.perf_counter()
    try:
        index = BM25Index.from_jsonl(args.corpus, k1=args.bm25_k1, b=args.bm25_b)
    except (OSError, ValueError) as exc:  # missing file, bad row, nothing to index: named, one line
        print(f"error: --corpus {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    log.info("indexed %d passages from %s in %.1f s", len(index), args.corpus, time.perf_counter() - t0)
    cfg = server_config(args)
    web.run_app(build_app(index, cfg), host=cfg.host, port=cfg.port, print=lambda s: log.info("%s", s))


if __name__ == "__main__":
    main()
