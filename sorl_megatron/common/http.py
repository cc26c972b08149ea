"""JSON-over-HTTP calls with bounded timeouts, retries with backoff and clear errors.

Shared by the rollout client and the retrieval client. Every failure becomes one of the
exceptions below, naming the URL, so a dead or slow server never hangs a rollout silently.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp


class ServerError(RuntimeError):
    """Base class of the errors raised for a server call."""


class ServerUnavailableError(ServerError):
    """The server could not be reached (refused, reset, DNS) after all retries."""


class ServerTimeoutError(ServerError):
    """The server did not answer within the timeout."""


class RequestRejectedError(ServerError):
    """The server answered 4xx: the request is wrong and retrying cannot help."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class BadResponseError(ServerError):
    """The server answered 2xx/5xx with a body that is not the expected JSON."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to call a server.

    Attributes:
        timeout_s: total time for one attempt (connect + answer).
        connect_timeout_s: time to open the connection; short, so a dead host fails fast.
        retries: extra attempts after the first for connection errors and 5xx answers.
        backoff_s: first wait between attempts, doubled each time (with 0-25% jitter).
        max_backoff_s: cap of the wait.
        retry_on_timeout: retry attempts that timed out (off for generation: a retry would
            double the load of an overloaded server).
    """

    timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    retry_on_timeout: bool = False

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"retry.{name} must be > 0, got {getattr(self, name)}")
        if self.retries < 0 or self.backoff_s < 0:
            raise ValueError("retry.retries and retry.backoff_s must be >= 0")

    def wait(self, attempt: int) -> float:
        base = min(self.backoff_s * (2**attempt), self.max_backoff_s)
        return base * (1 + 0.25 * random.random())


def _error_message(body: str) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body[:500]
    if isinstance(data, dict):
        for key in ("error", "message", "detail"):
            if key in data:
                err = data[key]
                return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    return body[:500]


async def request(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    payload: Any = None,
    policy: RetryPolicy = RetryPolicy(),
    expect_json: bool = True,
    on_retry: Optional[Callable[[], None]] = None,
) -> Any:
    """One HTTP call with the retry policy; returns parsed JSON (or text when not expected).
    ``on_retry`` is called before each re-send (a caller that counts the calls sent again)."""
    timeout = aiohttp.ClientTimeout(total=policy.timeout_s, sock_connect=policy.connect_timeout_s)
    last: Exception | None = None
    for attempt in range(policy.retries + 1):
        if attempt:
            await asyncio.sleep(policy.wait(attempt - 1))
            if on_retry is not None:
                on_retry()
        try:
            async with session.request(method, url, json=payload, timeout=timeout) as resp:
                body = await resp.text()
                if 400 <= resp.status < 500:
                    raise RequestRejectedError(
                        f"{method} {url} -> HTTP {resp.status}: {_error_message(body)}", resp.status
                    )
                if resp.status >= 500:
                    last = BadResponseError(f"{method} {url} -> HTTP {resp.status}: {_error_message(body)}")
                    continue
                if not expect_json:
                    return body
                try:
                    return json.loads(body)
                except ValueError as exc:
                    raise BadResponseError(f"{method} {url} answered invalid JSON ({exc}): {body[:200]!r}") from None
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            last = ServerTimeoutError(f"{method} {url} did not answer within {policy.timeout_s:g} s")
            if not policy.retry_on_timeout:
                raise last from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            last = ServerUnavailableError(f"{method} {url} is unreachable: {type(exc).__name__}: {exc}")
    assert last is not None
    if isinstance(last, ServerUnavailableError):
        raise ServerUnavailableError(f"{last} (after {policy.retries + 1} attempts)")
    raise last


async def check_health(
    session: aiohttp.ClientSession, kind: str, urls: Sequence[str], policy: RetryPolicy, when: str = ""
) -> None:
    """``GET /health`` of every server at once, each bounded by ``policy``.

    Any HTTP answer below 500 counts as alive (Search-R1's own retrieval server has no
    ``/health`` and answers 404); a timeout, a refused connection or a 5xx (SGLang answers 503
    when unhealthy) raises an error naming each failing server and what failed, e.g.
    ``retrieval server http://127.0.0.1:8000 did not answer /health within 5 s before the
    rollout phase of step 3`` (``kind`` = "retrieval", ``when`` = "before the rollout ...").
    """
    suffix = f" {when}" if when else ""

    async def one(url: str) -> ServerError | None:
        try:
            await request(session, "GET", f"{url}/health", None, policy, expect_json=False)
        except RequestRejectedError:
            return None  # it answered: alive
        except ServerTimeoutError:
            return ServerTimeoutError(
                f"{kind} server {url} did not answer /health within {policy.timeout_s:g} s{suffix}"
            )
        except ServerUnavailableError as err:
            return ServerUnavailableError(f"{kind} server {url} is unreachable{suffix} ({err})")
        except ServerError as err:
            return ServerError(f"{kind} server {url} is unhealthy{suffix} ({err})")
        return None

    failed = [e for e in await asyncio.gather(*(one(u) for u in urls)) if e is not None]
    if len(failed) == 1:
        raise failed[0]
    if failed:
        same = all(type(e) is type(failed[0]) for e in failed)
        raise (type(failed[0]) if same else ServerError)("; ".join(str(e) for e in failed))
