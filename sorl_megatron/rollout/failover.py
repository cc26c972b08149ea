"""Which rollout servers a :class:`~.client.RolloutClient` sends to, and what it does when one
fails a call.

:class:`GenerationServers`: every ``/generate`` call goes to one server, picked among those
serving now (round robin, or least-loaded by calls in flight), or to the ``sglang-router`` in
front of them. A server that refuses connections is skipped for a cool-down while the others
carry on; with ``failover_retries`` a call that timed out or failed with 5xx is sent again after
the ``on_failure`` hook (the trainer's fleet) has had its say.

:class:`ControlSet`: a control call (weight updates, cache flush) goes to every server of the set
and all must succeed; a server that failed it and that the hook then drops leaves the set, and
the call stands on the others.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..common.http import (
    BadResponseError,
    RequestRejectedError,
    ServerError,
    ServerTimeoutError,
    ServerUnavailableError,
)

# What the fleet is told when a /generate call failed on ``url`` (None: through the router,
# server unknown); it answers the URLs of the servers still serving (empty: none is left).
FailureHook = Callable[[str | None, ServerError], Awaitable[Sequence[str]]]


class GenerationServers:
    """Where ``/generate`` calls go: ``urls`` (``serving()``, when given, says which serve now, from
    any thread; else ``urls`` less those ``on_failure`` dropped), or every call to ``router_url``.
    Holds the calls in flight per server, the cool-downs, and the rotation that breaks ties.
    ``on_retry()`` is told of each call sent again."""

    def __init__(self, urls: Sequence[str], routing: str, down_cooldown_s: float, router_url: str | None,
                 failover_retries: int, serving: Callable[[], Sequence[str]] | None,
                 on_failure: FailureHook | None, on_retry: Callable[[], None]):
        self.urls = tuple(urls)
        self.routing = routing
        self.down_cooldown_s = down_cooldown_s
        self.router_url = router_url
        self.failover_retries = failover_retries
        self.serving = serving
        self.on_failure = on_failure
        self.on_retry = on_retry
        self._inflight = {u: 0 for u in self.urls}
        self._usable: set[str] | None = None  # the servers the fleet still lists (None: all)
        self._down_until = {u: 0.0 for u in self.urls}
        self._rr = itertools.count()

    @property
    def inflight(self) -> dict[str, int]:
        return dict(self._inflight)

    def pick(self, exclude: set[str]) -> str | None:
        now = time.monotonic()
        if self.serving is not None:
            known = [u.rstrip("/") for u in self.serving()]
        else:
            known = [u for u in self.urls if self._usable is None or u in self._usable]
        urls = [u for u in known if u not in exclude]
        up = [u for u in urls if self._down_until.get(u, 0.0) <= now]
        if not up:
            up = urls  # all cooling down: try anyway
        if not up:
            return None
        start = next(self._rr) % len(known)  # rotate over the known list: ties move on
        ordered = sorted(up, key=lambda u: (known.index(u) - start) % len(known))
        if self.routing == "round_robin":
            return ordered[0]
        return min(ordered, key=lambda u: self._inflight.get(u, 0))

    async def post(self, send: Callable[[str], Awaitable[Any]]) -> tuple[Any, str]:
        """``send(url)``'s answer and the server that gave it, failing over as the module doc says."""
        tried: set[str] = set()
        errors: list[str] = []
        failovers = 0
        while True:
            url = self.router_url or self.pick(tried)
            if url is None:
                raise ServerUnavailableError("no rollout server reachable: " + "; ".join(errors))
            self._inflight[url] = self._inflight.get(url, 0) + 1
            try:
                return await send(url), url
            except (ServerUnavailableError, ServerTimeoutError, BadResponseError) as exc:
                errors.append(str(exc))
                failed = exc
            finally:
                self._inflight[url] -= 1
            unavailable = isinstance(failed, ServerUnavailableError)
            if not unavailable and failovers >= self.failover_retries:
                raise failed  # timeouts and 5xx: not sent again without failover_retries
            if self.router_url is None:
                if unavailable or self.on_failure is None:
                    tried.add(url)  # without a fleet to ask, a hung server is not asked again
                if unavailable:
                    self._down_until[url] = time.monotonic() + self.down_cooldown_s
            elif unavailable and failovers >= self.failover_retries:
                raise failed  # the router itself is unreachable
            if self.on_failure is not None:
                left = await self.on_failure(None if self.router_url else url, failed)
                if not left:
                    raise ServerUnavailableError("no rollout server reachable: " + "; ".join(errors))
                self._usable = set(left)
            failovers += 1
            self.on_retry()


class ControlSet:
    """The servers control calls go to (``urls``, less those the fleet dropped during one)."""

    def __init__(self, urls: Sequence[str], on_failure: FailureHook | None):
        self.urls = list(urls)
        self.on_failure = on_failure

    async def call(self, send: Callable[[str], Awaitable[Any]], path: str) -> dict[str, Any]:
        """``{url: send(url)}`` over the set; all must succeed (``path`` names the call in errors).

        With an ``on_failure`` hook (the trainer's fleet), servers that failed the call
        (unreachable, timed out, 5xx) and that the hook then drops (they fail ``/health``) leave
        the set and the call stands on the others: a server that dies during a weight sync does
        not end the run while one is left. A refusal (4xx) always raises.
        """
        urls = list(self.urls)
        results = await asyncio.gather(*(send(u) for u in urls), return_exceptions=True)
        failed = {u: r for u, r in zip(urls, results) if isinstance(r, BaseException)}
        if failed and self.on_failure is not None and urls and not any(
            isinstance(r, RequestRejectedError) or not isinstance(r, ServerError) for r in failed.values()
        ):
            left: Sequence[str] = urls
            for u, err in failed.items():
                left = await self.on_failure(u, err)
            gone = [u for u in failed if u not in left]
            if len(gone) == len(failed) and len(gone) < len(urls):
                self.urls = [u for u in self.urls if u not in gone]
                urls, results = zip(*[(u, r) for u, r in zip(urls, results) if u not in gone])
                failed = {}
        failures = list(failed.values())
        errors = [f"{u}: {r}" for u, r in failed.items()]
        if errors:
            rejected = [r for r in failures if isinstance(r, RequestRejectedError)]
            if rejected:
                raise RequestRejectedError(
                    f"{path} rejected by {len(rejected)}/{len(urls)} rollout server(s): " + "; ".join(errors),
                    rejected[0].status,
                )
            # keep the kind (timeout, unreachable) when every server failed the same way
            kind = type(failures[0])
            if not (issubclass(kind, ServerError) and all(type(r) is kind for r in failures)):
                kind = ServerError
            raise kind(f"{path} failed on {len(errors)}/{len(urls)} rollout server(s): " + "; ".join(errors))
        for u, r in zip(urls, results):
            if isinstance(r, dict) and r.get("success") is False:
                raise RequestRejectedError(f"{u}{path}: {r.get('message')}", 400)
        return dict(zip(urls, results))
