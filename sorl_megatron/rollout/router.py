"""``sglang-router`` in front of the rollout servers: its launcher and its worker registry.

``python -m sorl_megatron.rollout.router [sglang-router flags]`` starts the real router
(the ``sglang-router`` package, a Rust binary) with the flags of
``python -m sglang_router.launch_router``; the one difference is the API key, which is read
from ``$SORL_ROLLOUT_API_KEY`` when ``--api-key`` is not given, so it never shows in ``ps``.
With a key the router asks for ``Authorization: Bearer KEY`` on every endpoint but
``/health`` and forwards the caller's header to the workers, so one key covers the router
and the rollout servers behind it.

:class:`RouterAdmin` adds and removes workers at run time through the router's HTTP API
(``GET /workers``, ``POST /workers {"url": ...}``, ``DELETE /workers/{id}``; both changes
are queued by the router and answered 202, so :meth:`RouterAdmin.wait_for` polls the list
until it shows the change, bounded).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Sequence

import aiohttp

from ..common.http import RetryPolicy, ServerError, request
from ..common.protocol import ROLLOUT_API_KEY_ENV, bearer_headers


class RouterAdmin:
    """The worker list of one ``sglang-router``; every call bounded by ``policy``."""

    def __init__(self, url: str, api_key: str | None = None, policy: RetryPolicy = RetryPolicy(timeout_s=10.0)):
        self.url = url.rstrip("/")
        self.policy = policy
        self._headers = bearer_headers(api_key, ROLLOUT_API_KEY_ENV)

    async def _call(self, method: str, path: str, body=None):
        async with aiohttp.ClientSession(headers=self._headers) as session:
            return await request(session, method, f"{self.url}{path}", body, self.policy)

    async def workers(self) -> dict[str, dict]:
        """``{worker url: the router's record}`` (``id``, ``is_healthy``, ``load``, ...)."""
        data = await self._call("GET", "/workers")
        return {w["url"].rstrip("/"): w for w in data.get("workers", [])}

    async def add(self, url: str) -> None:
        await self._call("POST", "/workers", {"url": url})

    async def remove(self, url: str) -> bool:
        """Take ``url`` out of the routing; False if the router does not list it."""
        record = (await self.workers()).get(url.rstrip("/"))
        if record is None:
            return False
        await self._call("DELETE", f"/workers/{record['id']}")
        return True

    async def not_serving(self, urls: Sequence[str], listed: dict[str, dict] | None = None) -> list[str]:
        """The URLs of ``urls`` the router does not list as healthy (``listed``: a list just read)."""
        listed = await self.workers() if listed is None else listed
        return [u for u in urls if not listed.get(u.rstrip("/"), {}).get("is_healthy")]

    async def wait_for(self, present: Sequence[str] = (), absent: Sequence[str] = (), timeout_s: float = 60.0) -> None:
        """Poll until every URL of ``present`` is listed healthy and none of ``absent`` is
        listed; ``ServerError`` naming what is missing after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            listed = await self.workers()
            missing = await self.not_serving(present, listed)
            left = [u for u in absent if u.rstrip("/") in listed]
            if not missing and not left:
                return
            if time.monotonic() >= deadline:
                raise ServerError(
                    f"router {self.url}: after {timeout_s:g} s still "
                    + "; ".join(([f"not serving {missing}"] if missing else []) + ([f"listing {left}"] if left else []))
                )
            await asyncio.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        from sglang_router.launch_router import launch_router, parse_router_args
    except ImportError as err:
        sys.exit(f"the sglang-router package is not installed ({err}): pip install sglang-router")
    args = parse_router_args(list(sys.argv[1:] if argv is None else argv))
    if not args.api_key:
        args.api_key = os.environ.get(ROLLOUT_API_KEY_ENV) or None
    launch_router(args)


if __name__ == "__main__":
    main()
