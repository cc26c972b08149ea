"""The rollout fleet of a run (rank 0): the rollout servers, the ``sglang-router`` in front of
them, and what happens when one dies or hangs.

- Embedded (no ``rollout.urls``): ``rollout.fleet.num_servers`` servers, plus the router when
  ``rollout.fleet.router=sglang_router``, started like the other embedded servers (bounded by
  ``rollout.fleet.start_timeout_s``, logs in ``<run_dir>/servers/``).
- External (``rollout.urls``): those servers, behind ``rollout.fleet.router_url`` or behind a router
  the trainer starts itself (``rollout.fleet.router=sglang_router`` without a URL), or none.

Generation goes through the router when there is one; weight updates, ``flush_cache`` and
health checks go to every worker (the trainer's ``rollout_urls``).

A server is *failed* when it does not answer ``/health`` within ``rollout.health_timeout_s``:
asked before every phase, and at once when a ``/generate`` call on it (or through the
router) timed out after ``rollout.timeout_s``, was refused or answered 5xx. A failed server is
taken out of the router and of the worker list, and the calls it held are sent again to the
others (``rollout.fleet.failover_retries`` times per call, counted in ``rollout/retries``). An
embedded one is killed (SIGKILL: a hung process too) and started again on a new port at once;
an external one gets the operator's ``rollout.fleet.restart_command`` (run with
``$SORL_FAILED_SERVER_URL``), or nothing. Before the next weight sync the trainer waits for
the restarted embedded servers (bounded by ``rollout.fleet.start_timeout_s``) and asks the failed
external ones for ``/health`` once; those that answer get the sync with the others, so they
hold the current weights, and only then go back into the router and the worker list. The
step fails only when no server is left and none is coming back. A fleet with no server serving
but some restarted (one server, the default, that died) raises :class:`FleetRejoining` from
:meth:`RolloutFleet.check`: the trainer then runs a weight sync of the weights it holds before
the phase goes on (``rl_loop.RLTrainer._served``), so a restarted server never serves its
start-up weights. Metrics per step: ``rollout/retries``,
``rollout/server_failures``, ``rollout/server_restarts``, ``rollout/servers_rejoined``,
``rollout/servers_up``.

Threads: in ``rollout.mode`` one_step_off and async a background thread (its own event loop) and the main thread
report failures to the same fleet. One ``threading.Lock`` serializes every decision (checks,
failures, joins), and a report is handled once per *worker generation*: a URL that no longer
names a serving worker (already taken out, or restarted on a new port) is not checked again, so
two threads reporting the same dead server cause one restart. Readers (``urls()``) take no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import aiohttp

from ...common import aio
from ...common.http import RetryPolicy, ServerError, ServerUnavailableError, check_health
from ...common.protocol import ROLLOUT_API_KEY_ENV, bearer_headers
from ...rollout.router import RouterAdmin
from .servers import EmbeddedServers, ServerSpec, router_spec

log = logging.getLogger("sorl_megatron.trainer.serving.fleet")

FAILED_SERVER_ENV = "SORL_FAILED_SERVER_URL"


class FleetRejoining(ServerUnavailableError):
    """No rollout server serves now, but some were restarted (or answer again): they serve once
    a weight sync has given them the trainer's current weights."""


@dataclass
class Worker:
    """One rollout server. ``state``: up (serving), down (failed: restarting, or waiting for
    its operator), joining (healthy again: gets the next weight sync, then serves), lost (an
    embedded restart that failed)."""

    url: str
    name: Optional[str] = None  # the embedded server's name; None: external
    state: str = "up"
    failures: int = 0  # failures handled so far: tells a later state apart from the one a caller saw


@dataclass
class RolloutFleet:
    timeout_s: float  # rollout.fleet.start_timeout_s: a (re)start and a router registration
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
    # the decisions (check, fail, join): one thread at a time; held across health checks
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _counts_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # never held across I/O
    _last_check: float = 0.0  # when the last health check under the lock started

    # -- views ------------------------------------------------------------------------

    def urls(self, joining: bool = False) -> list[str]:
        """The workers that serve (``joining``: and those about to get the weight sync). Any
        thread, no lock: a worker's URL is read before its state, and a failure sets the state
        (down) before the URL (the restart's port), so a new URL is never listed before it serves."""
        states = ("up", "joining") if joining else ("up",)
        out = []
        for w in list(self.workers):
            url = w.url
            if w.state in states:
                out.append(url)
        return out

    def rejoining(self) -> bool:
        """Whether no worker serves and some are coming back: an embedded one being restarted
        (down, ``rollout.fleet.restart_servers``) or one healthy again (joining). A weight sync makes
        them serve (:meth:`prepare_sync`, :meth:`finish_sync`). Any thread, no lock."""
        workers = list(self.workers)
        if any(w.state == "up" for w in workers):
            return False
        restarting = self.servers is not None and self.restart_embedded
        return any(w.state == "joining" or (w.state == "down" and w.name is not None and restarting)
                   for w in workers)

    def generations(self, urls: list[str]) -> tuple[int, ...]:
        """Each URL's count of failures handled: it changes when a server failed and came back,
        even on the same URL (an external server's operator), so its weight-update group is
        formed again."""
        failures = {w.url: w.failures for w in list(self.workers)}
        return tuple(failures.get(u, 0) for u in urls)

    def count(self, key: str, n: float = 1) -> None:
        """Add to this step's counter ``rollout/<key>`` (any thread)."""
        with self._counts_lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def metrics(self) -> dict[str, float]:
        """This step's counters (then reset) and the servers up now."""
        with self._counts_lock:
            out = {f"rollout/{k}": float(self.counts.get(k, 0))
                   for k in ("retries", "server_failures", "server_restarts", "servers_rejoined")}
            self.counts.clear()
        out["rollout/servers_up"] = float(len(self.urls()))
        return out

    @contextlib.asynccontextmanager
    async def _deciding(self) -> AsyncIterator[None]:
        """The decision lock from a coroutine, without blocking its event loop (the other
        thread may hold it across a health check). Bounded: the holder's work is health checks,
        router calls and process launches, each bounded; ``rollout.fleet.start_timeout_s`` is the cap."""
        deadline = time.monotonic() + self.timeout_s
        while not self._lock.acquire(blocking=False):
            if time.monotonic() > deadline:
                raise ServerError(f"the rollout fleet's failure handling stayed busy in another thread for "
                                  f"{self.timeout_s:g} s (rollout.fleet.start_timeout_s)")
            await asyncio.sleep(0.01)
        try:
            yield
        finally:
            self._lock.release()

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
        async with self._deciding():
            started = time.monotonic()
            asked = [(w, w.url) for w in self.workers if w.state == "up" or (w.state == "down" and w.name is None)]
            errors = await self._health([u for _, u in asked], when)
            for w, url in asked:
                if w.url != url:
                    continue
                if errors[url] is None and w.state == "down":
                    w.state = "joining"
                elif errors[url] is not None and w.state == "up":
                    await self._fail(w, errors[url])
            self._last_check = started
        if self.urls():
            return
        if self.rejoining():
            raise FleetRejoining(f"no rollout server serves {when}: " + ", ".join(
                f"{w.url} {w.state}" for w in self.workers) + " (restarted: it serves once a weight sync has "
                "given it the current weights)")
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
        server that fails its sync fails like the others). Concurrent failures, from any thread,
        share one check; a URL no longer serving (taken out, restarted elsewhere) is not checked again."""
        asked = time.monotonic()
        async with self._deciding():
            suspects = [u for u in self.urls(joining=True) if url is None or u == url]
            if self._last_check > asked or not suspects:
                return self.urls(joining=True)  # handled: a check started after this failure, or it is out
            log.warning("rollout: a call failed (%s); checking %s", err, suspects)
            started = time.monotonic()
            errors = await self._health(suspects, "after a failed call")
            for w in [w for w in self.workers if w.state in ("up", "joining") and errors.get(w.url) is not None]:
                await self._fail(w, errors[w.url])
            self._last_check = started
            return self.urls(joining=True)

    async def _fail(self, w: Worker, err: ServerError) -> None:
        """Under the decision lock: take ``w`` out (state first, then a restart's new URL)."""
        log.warning("rollout server %s failed (%s): taken out of the fleet", w.url, err)
        w.state = "down"
        w.failures += 1
        self.count("server_failures")
        await self._take_out_of_router([w.url])
        if w.name is not None and self.servers is not None and self.restart_embedded:
            w.url = self.servers.restart(w.name)
            self.count("server_restarts")
            log.warning("restarting embedded rollout server %s on %s (log %s)", w.name, w.url,
                        self.servers.log_path(w.name))
        elif w.name is not None and self.servers is not None:
            self.servers.kill(w.name)  # not restarted (rollout.fleet.restart_servers=false): a hung one is ended
        elif w.name is None and self.restart_command:
            self._run_restart_hook(w.url)
            self.count("server_restarts")

    async def _take_out_of_router(self, urls: list[str]) -> None:
        router = self._router()
        if router is None:
            return
        for url in urls:
            try:
                if await router.remove(url):
                    await router.wait_for(absent=[url], timeout_s=self.health.timeout_s)
            except ServerError as exc:  # the router's own health checks skip it anyway
                log.warning("could not take %s out of the router %s: %s", url, self.router_url, exc)

    def _run_restart_hook(self, url: str) -> None:
        """``rollout.fleet.restart_command`` for a failed external server, not waited for: the
        server comes back when it answers ``/health`` before a weight sync."""
        log_path = self.run_dir / "servers" / "restart_hook.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {self.restart_command} ({url})\n".encode())
            out.flush()
            self._hooks.append(subprocess.Popen(
                shlex.split(self.restart_command), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, FAILED_SERVER_ENV: url}, start_new_session=True))
        log.warning("ran rollout.fleet.restart_command for %s (output in %s)", url, log_path)

    # -- coming back ------------------------------------------------------------------

    def prepare_sync(self) -> list[str]:
        """Before a weight sync: the failed workers that are healthy again become *joining*
        (embedded restarts waited for, bounded; external ones asked once); returns the URLs
        the sync goes to (serving and joining)."""
        self._hooks = [p for p in self._hooks if p.poll() is None]
        down = [(w, w.url, w.failures) for w in self.workers if w.state == "down"]
        ready: dict[str, Optional[str]] = {}  # a down worker's URL -> the URL it is healthy on, or None
        restarted = self.servers.procs if self.restart_embedded and self.servers is not None else {}
        for w, url, _ in down:  # waited for without the lock: the producer's failures go on meanwhile
            if w.name is not None and w.name in restarted:
                try:  # a relaunch after a lost port moves it
                    ready[url] = self.servers.wait_ready(w.name, timeout_s=self.timeout_s, stop_all=False)
                except RuntimeError as err:
                    ready[url] = None
                    log.error("rollout server %s did not come back: %s", w.name, err)
        external = [url for w, url, _ in down if w.name is None]
        if external:
            errors = aio.run(self._health(external, "before the weight sync"))
            ready.update({u: u if errors[u] is None else None for u in external})
        with self._lock:
            for w, url, failures in down:
                if w.state != "down" or w.url != url or w.failures != failures:
                    continue  # changed meanwhile
                if w.name is not None and url not in ready:
                    w.state = "lost"  # embedded, not restarted (rollout.fleet.restart_servers=false)
                elif ready.get(url):
                    w.state, w.url = "joining", ready[url]
                elif w.name is not None:
                    w.state = "lost"  # an embedded restart that did not come up
        return self.urls(joining=True)

    def finish_sync(self) -> None:
        """After a weight sync that reached them: the joining workers serve again (router
        registration waited for, bounded)."""
        joining = [(w, w.url, w.failures) for w in self.workers if w.state == "joining"]
        if not joining:
            return

        def still_joining() -> list[tuple[Worker, str, int]]:  # not failed since (the producer's calls)
            return [j for j in joining if (j[0].state, j[0].url, j[0].failures) == ("joining", j[1], j[2])]

        router = self._router()
        if router is not None:

            async def register():
                for _, url, _ in still_joining():
                    await router.add(url)
                deadline = time.monotonic() + self.timeout_s
                while True:
                    pending = still_joining()
                    missing = set(await router.not_serving([url for _, url, _ in pending]))
                    waiting = [j for j in pending if j[1] in missing]
                    if not waiting:
                        return
                    if time.monotonic() >= deadline:  # it answered /health before the sync, not now
                        async with self._deciding():
                            for w, url, _ in [j for j in waiting if j in still_joining()]:
                                await self._fail(w, ServerError(
                                    f"{url} is not serving in the router {self.router_url} {self.timeout_s:g} s "
                                    "after it was added (rollout.fleet.start_timeout_s)"))
                        return
                    await asyncio.sleep(0.1)

            aio.run(register())
        with self._lock:
            back = still_joining()
            for w, _, _ in back:
                w.state = "up"
                self.count("servers_rejoined")
                log.warning("rollout server %s is back (current weights%s)", w.url, ", in the router" if router else "")
            failed = [url for w, url, _ in joining if w.state != "up" or w.url != url]
        if failed:  # a failure handled before its registration found nothing to take out of the router
            aio.run(self._take_out_of_router(failed))

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
    r, f = rollout, rollout.fleet
    workers: list[Worker] = []
    if r.urls:
        workers = [Worker(u.rstrip("/")) for u in r.urls]
    else:
        assert servers is not None
        names = ["rollout"] if f.num_servers == 1 else [f"rollout-{i}" for i in range(f.num_servers)]
        for name in names:  # launched together, then waited for: start-ups overlap
            workers.append(Worker(servers.launch(spec_for(name)), name=name))
        for w in workers:
            w.url = servers.wait_ready(w.name, timeout_s=f.start_timeout_s)
    router_url = f.router_url.rstrip("/") if f.router_url else None
    api_key = servers.api_keys.get("rollout") if servers is not None else None
    if f.router == "sglang_router" and router_url is None:
        assert servers is not None
        router_url = servers.start(router_spec([w.url for w in workers], f.router_policy, r.timeout_s,
                                               health_timeout_s=f.start_timeout_s,
                                               balance_abs_threshold=f.router_balance_abs_threshold))
        api_key = servers.api_keys.get("rollout")
    fleet = RolloutFleet(
        timeout_s=f.start_timeout_s, health=RetryPolicy(timeout_s=r.health_timeout_s, retries=r.retries),
        run_dir=run_dir, workers=workers, servers=servers, router_url=router_url,
        restart_command=f.restart_command, restart_embedded=f.restart_servers, api_key=api_key)
    if router_url is not None and not f.router_url:
        router = fleet._router()
        try:
            aio.run(router.wait_for(present=[w.url for w in workers], timeout_s=f.start_timeout_s))
        except ServerError as err:
            raise RuntimeError(f"{err}; see {servers.log_path('router')}") from None
    return fleet
