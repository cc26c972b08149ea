"""Server-side request hygiene shared by the embedded servers (rollout and retrieval).

- Bodies are read with a byte limit that refuses *before* buffering: a declared
  ``Content-Length`` above the limit gets 413 without a byte read, and a streamed (chunked)
  body is cut off as soon as it passes the limit. aiohttp's own ``request.read()`` raises its
  stream buffer to the whole ``client_max_size`` and buffers up to it before refusing.
- JSON is parsed strictly (no ``NaN``/``Infinity``), and every parse failure, including
  nesting too deep for the parser, is a 400 that says what is wrong.
- ``--api-key``: SGLang's scheme (``Authorization: Bearer <key>``, compared in constant time).
  Every method on every path needs it except ``GET``/``HEAD`` of the health probes, which load
  balancers call without credentials. An empty key is refused (it would authenticate nothing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import hmac
import json
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

MiB = 1024**2
T = TypeVar("T")


class BodyError(ValueError):
    """A request body that is refused before it reaches a handler's logic (400 or 413)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


async def read_body(request: web.Request, limit: int, flag: str) -> bytearray:
    """The raw body, never buffering more than ``limit`` bytes (``flag`` names the setting)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyError(
            f"request body of {declared} bytes exceeds the limit of {limit} bytes (raise it with {flag})", 413
        )
    buf = bytearray()
    async for chunk in request.content.iter_any():
        if len(buf) + len(chunk) > limit:
            raise BodyError(f"request body exceeds the limit of {limit} bytes (raise it with {flag})", 413)
        buf += chunk
    return buf


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes | bytearray) -> Any:
    """Strict JSON; any failure is a ``BodyError`` (400) naming the problem."""
    if not raw:
        raise BodyError("request body is empty; expected a JSON object")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise BodyError("request body is not valid JSON: nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise BodyError(f"request body is not UTF-8 text: {exc}") from None
    except ValueError as exc:
        raise BodyError(f"request body is not valid JSON: {exc}") from None


class OffLoop:
    """One worker thread for parsing and validating bodies away from the event loop.

    A single worker also bounds how many large bodies are expanded into Python objects at
    once; ``/health`` keeps answering while it works.
    """

    def __init__(self, name: str):
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def close(self, _app: web.Application | None = None) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# Paths a load balancer probes without credentials (SGLang's); GET and HEAD only.
HEALTH_PATHS = ("/health", "/health_generate")


def check_api_key(api_key: str | None) -> str | None:
    """``api_key`` if it can authenticate: None (no authentication) or a non-empty printable
    string; anything else is a ValueError. An empty ``--api-key ""`` must not pass for "no key"."""
    if api_key is not None and not (isinstance(api_key, str) and api_key and api_key.isprintable()):
        raise ValueError("--api-key must be a non-empty printable string (leave it unset for no authentication)")
    return api_key


def api_key_middlewares(api_key: str | None, open_paths: tuple[str, ...] = HEALTH_PATHS) -> list:
    """The middlewares for a server's ``--api-key``: none without a key (None), the key check otherwise."""
    return [] if check_api_key(api_key) is None else [api_key_middleware(api_key, open_paths)]


def api_key_middleware(api_key: str, open_paths: tuple[str, ...] = HEALTH_PATHS):
    """401 unless ``Authorization: Bearer <api_key>`` (SGLang's ``--api-key`` semantics), for
    every method and path but ``GET``/``HEAD`` of ``open_paths`` (exact paths: ``/health/x``,
    ``/healthz`` and ``OPTIONS /health`` need the key, as do paths no route serves)."""
    if check_api_key(api_key) is None:
        raise ValueError("--api-key must be a non-empty printable string")
    expected = f"Bearer {api_key}".encode()
    open_set = frozenset(open_paths)

    @web.middleware
    async def authenticate(request: web.Request, handler):
        if request.method in ("GET", "HEAD") and request.path in open_set:
            return await handler(request)
        got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(got, expected):
            # SGLang's answer shape; the reason helps a user who forgot the key.
            return web.json_response(
                {"error": "Unauthorized: send the server's key as 'Authorization: Bearer <key>'"}, status=401
            )
        return await handler(request)

    return authenticate
