"""The rollout fleet of a run (rank 0): the rollout servers, the ``sglang-router`` in front of
them, and what happens when one dies or hangs.

- Embedded (no ``rollout.urls``): ``rollout.num_servers`` servers, plus the router when
  ``rollout.router=sglang_router``, started like the other embedded servers (bounded by
  ``rollout.start_timeout_s``, logs in ``<run_dir>/servers/``).
- External (``rollout.urls``): those servers, behind ``rollout.router_url`` or behind a router
  the trainer starts itself (``rollout.router=sglang_router`` without a URL), or none.

Generation goes through the router when there is one; weight updates, ``flush_cache`` and
health checks go to every worker (the trainer's ``rollout_urls``).

A server is *failed* when it does not answer ``/health`` within ``rollout.health_timeout_s``:
asked before every phase, and at once when a ``/generate`` call on it (or through the
router) timed out after ``rollout.timeout_s``, was refused or answered 5xx. A failed server is
taken out of the router and of the worker list, and the calls it held are sent again to the
others (``rollout.failover_retries`` times per call, counted in ``rollout/retries``). An
embedded one is killed (SIGKILL: a hung process too) and started again on a new port at once;
an external one gets the operator's ``rollout.restart_command`` (run with
``$SORL_FAILED_SERVER_URL``), or nothing. Before the next weight sync the trainer waits for
the restarted embedded servers (bounded by ``rollout.start_timeout_s``) and asks the failed
external ones for ``/health`` once; those that answer get the sync with the others, so they
hold the current weights, and only then go back into the router and the worker list. The
step fails only when no server is left. Metrics per step: ``rollout/retries``,
``rollout/server_failures``, ``rollout/server_restarts``, ``rollout/servers_rejoined``,
``rollout/servers_up``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import aiohttp

from ..common.http import RetryPolicy, ServerError, ServerUnavailableError, check_health
from ..common.protocol import ROLLOUT_API_KEY_ENV, bearer_headers
from ..rollout.router import RouterAdmin
from .servers import EmbeddedServers, ServerSpec, router_spec

log = logging.getLogger("sorl_megatron.trainer.fleet")

FAILED_SERVER_ENV = "SORL_FAILED_SERVER_URL"


@dataclass
class Worker:
    """One rollout server. ``state``: up (serving), down (failed: restarting, or waiting for
    its operator), joining (healthy again: gets the next weight sync, then serves), lost (an
    embedded restart that failed)."""

    url: str
    name: Optional[str] = None  # the embedded server's name; None: external
    state: str = "up"


@dataclass
class RolloutFleet:
    timeout_s: float  # rollout.start_timeout_s: a (re)start and a router registration
    health: RetryPolicy  # rollout.health_timeout_s / retries
    run_dir: Path
    workers: list[Worker]
    servers: Optional[EmbeddedServers] = None
    router_url: Optional[str] = None
    restart_command: Optional[str] = None
    restart_embedded: bool = True
    api_key: Optional[str] = field(default=None, repr=False)
    counts: dict[str, float] = field(default_factory=dict)
    _hooks: list[subprocess.Popen] = field(default_factory=list)
    _lock: Optional[asyncio.Lock] = None
    _lock_loop: object = None
    _last_check: float = 0.0

    # -- views ------------------------------------------------------------------------

    def urls(self, joining: bool = False) -> list[str]:
        """The workers that serve (``joining``: and those about to get the weight sync)."""
        states = ("up", "joining") if joining else ("up",)
        return [w.url for w in self.workers if w.state in states]

    def _count(self, key: str, n: float = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def metrics(self) -> dict[str, float]:
        """This step's counters (then reset) and the servers up now."""
        out = {f"rollout/{k}": float(self.counts.get(k, 0))
               for k in ("retries", "server_failures", "server_restarts", "servers_rejoined")}
        out["rollout/servers_up"] = float(len(self.urls()))
        self.counts.clear()
        return out

    def _router(self) -> Optional[RouterAdmin]:
        if self.router_url is None:
            return None
        return RouterAdmin(self.router_url, self.api_key, RetryPolicy(timeout_s=self.health.timeout_s, retries=1))

    # -- detection --------------------------------------------------------------------

    async def _health(self, urls: list[str], when: str) -> dict[str, Optional[ServerError]]:
        async with aiohttp.ClientSession(headers=bearer_headers(self.api_key, ROLLOUT_API_KEY_ENV)) as session:

            async def one(url: str) -> Optional[ServerError]:
                try:
                    await check_health(session, "rollout", [url], self.health, when)
                except ServerError as err:
                    return err
                return None

            return dict(zip(urls, await asyncio.gather(*(one(u) for u in urls))))

    async def check(self, when: str = "") -> None:
        """``/health`` of every serving worker, and of the failed external ones (back: they
        join at the next weight sync); the failed ones are handled (see the module doc).
        Raises when no worker is left serving: the health errors, as one health check of
        them all would, or a ``ServerUnavailableError`` saying where the workers are."""
        asked = [w for w in self.workers if w.state == "up" or (w.state == "down" and w.name is None)]
        errors = await self._health([w.url for w in asked], when)
        for w in asked:
            if errors[w.url] is None and w.state == "down":
                w.state = "joining"
            elif errors[w.url] is not None and w.state == "up":
                await self._fail(w, errors[w.url])
        if self.urls():
            return
        failed = [e for e in errors.values() if e is not None]
        if len(failed) == 1:
            raise failed[0]
        if failed:
            same = all(type(e) is type(failed[0]) for e in failed)
            raise (type(failed[0]) if same else ServerError)("; ".join(str(e) for e in failed))
        raise ServerUnavailableError(f"no rollout server left {when}: " + ", ".join(
            f"{w.url} {w.state}" for w in self.workers) + " (a restarted server serves after the next weight sync)")

    async def on_failure(self, url: Optional[str], err: ServerError) -> list[str]:
        """The client's hook after a call failed on ``url`` (None: a ``/generate`` through the
        router, server unknown): health-check it (all of them for the router), handle the
        failed ones; returns the URLs still serving or getting the weight sync (a joining
        server that fails its sync fails like the others). Concurrent failures share one check."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:  # one lock per event loop (one per phase)
            self._lock, self._lock_loop = asyncio.Lock(), loop
        asked = time.monotonic()
        async with self._lock:
            if self._last_check > asked:
                return self.urls(joining=True)  # a check that started after this failure already ran
            suspects = [u for u in self.urls(joining=True) if url is None or u == url]
            log.warning("rollout: a call failed (%s); checking %s", err, suspects or "no server")
            errors = await self._health(suspects, "after a failed call")
            for w in [w for w in self.workers if w.state in ("up", "joining") and errors.get(w.url) is not None]:
                await self._fail(w, errors[w.url])
            self._last_check = time.monotonic()
            return self.urls(joining=True)

    async def _fail(self, w: Worker, err: ServerError) -> None:
        log.warning("rollout server %s failed (%s): taken out of the fleet", w.url, err)
        w.state = "down"
        self._count("server_failures")
        router = self._router()
        if router is not None:
            try:
                if await router.remove(w.url):
                    await router.wait_for(absent=[w.url], timeout_s=self.health.timeout_s)
            except ServerError as exc:  # the router's own health checks skip it anyway
                log.warning("could not take %s out of the router %s: %s", w.url, self.router_url, exc)
        if w.name is not None and self.servers is not None and self.restart_embedded:
            w.url = self.servers.restart(w.name)
            self._count("server_restarts")
            log.warning("restarting embedded rollout server %s on %s (log %s)", w.name, w.url,
                        self.servers.log_path(w.name))
        elif w.name is not None and self.servers is not None:
            self.servers.kill(w.name)  # not restarted (rollout.restart_servers=false): a hung one is ended
        elif w.name is None and self.restart_command:
            self._run_restart_hook(w.url)
            self._count("server_restarts")

    def _run_restart_hook(self, url: str) -> None:
        """``rollout.restart_command`` for a failed external server, not waited for: the
        server comes back when it answers ``/health`` before a weight sync."""
        log_path = self.run_dir / "servers" / "restart_hook.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {self.restart_command} ({url})\n".encode())
            out.flush()
            self._hooks.append(subprocess.Popen(
                shlex.split(self.restart_command), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, FAILED_SERVER_ENV: url}, start_new_session=True))
        log.warning("ran rollout.restart_command for %s (output in %s)", url, log_path)

    # -- coming back ------------------------------------------------------------------

    def prepare_sync(self) -> list[str]:
        """Before a weight sync: the failed workers that are healthy again become *joining*
        (embedded restarts waited for, bounded; external ones asked once); returns the URLs
        the sync goes to (serving and joining)."""
        self._hooks = [p for p in self._hooks if p.poll() is None]
        down = [w for w in self.workers if w.state == "down"]
        for w in down:
            if w.name is not None and not (self.restart_embedded and self.servers is not None
                                           and w.name in self.servers.procs):
                w.state = "lost"  # embedded, not restarted (rollout.restart_servers=false)
            elif w.name is not None:
                try:
                    self.servers.wait_ready(w.name, timeout_s=self.timeout_s, stop_all=False)
                    w.state = "joining"
                except RuntimeError as err:
                    w.state = "lost"
                    log.error("rollout server %s did not come back: %s", w.name, err)
        external = [w for w in down if w.name is None]
        if external:
            errors = asyncio.run(self._health([w.url for w in external], "before the weight sync"))
            for w in external:
                if errors[w.url] is None:
                    w.state = "joining"
        return self.urls(joining=True)

    def finish_sync(self) -> None:
        """After a weight sync that reached them: the joining workers serve again (router
        registration waited for, bounded)."""
        joining = [w for w in self.workers if w.state == "joining"]
        if not joining:
            return
        router = self._router()
        if router is not None:

            async def register():
                for w in joining:
                    await router.add(w.url)
                await router.wait_for(present=[w.url for w in joining], timeout_s=self.timeout_s)

            asyncio.run(register())
        for w in joining:
            w.state = "up"
            self._count("servers_rejoined")
            log.warning("rollout server %s is back (current weights%s)", w.url, ", in the router" if router else "")

    def close(self) -> None:
        for p in self._hooks:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        self._hooks.clear()


def start_fleet(rollout, run_dir: Path, servers: Optional[EmbeddedServers],
                spec_for: Callable[[str], ServerSpec]) -> RolloutFleet:
    """The fleet of ``rollout`` (the recipe's ``RolloutConfig``): the embedded servers and
    router it needs started (``spec_for(name)`` describes one rollout server)."""
    r = rollout
    workers: list[Worker] = []
    if r.urls:
        workers = [Worker(u.rstrip("/")) for u in r.urls]
    else:
        assert servers is not None
        names = ["rollout"] if r.num_servers == 1 else [f"rollout-{i}" for i in range(r.num_servers)]
        for name in names:  # launched together, then waited for: start-ups overlap
            workers.append(Worker(servers.launch(spec_for(name)), name=name))
        for w in workers:
            servers.wait_ready(w.name, timeout_s=r.start_timeout_s)
    router_url = r.router_url.rstrip("/") if r.router_url else None
    api_key = servers.api_keys.get("rollout") if servers is not None else None
    if r.router == "sglang_router" and router_url is None:
        assert servers is not None
        router_url = servers.start(router_spec([w.url for w in workers], r.router_policy, r.timeout_s,
                                               health_timeout_s=r.start_timeout_s,
                                               balance_abs_threshold=r.router_balance_abs_threshold))
        api_key = servers.api_keys.get("rollout")
    fleet = RolloutFleet(
        timeout_s=r.start_timeout_s, health=RetryPolicy(timeout_s=r.health_timeout_s, retries=r.retries),
        run_dir=run_dir, workers=workers, servers=servers, router_url=router_url,
        restart_command=r.restart_command, restart_embedded=r.restart_servers, api_key=api_key)
    if router_url is not None and not r.router_url:
        router = fleet._router()
        try:
            asyncio.run(router.wait_for(present=[w.url for w in workers], timeout_s=r.start_timeout_s))
        except ServerError as err:
            raise RuntimeError(f"{err}; see {servers.log_path('router')}") from None
    return fleet
