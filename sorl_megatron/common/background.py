"""An aiohttp application served from a daemon thread: embedded servers for tests and demos."""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
import time
import urllib.request

from aiohttp import web


class BackgroundServer:
    """Runs an aiohttp app on its own event loop in a daemon thread (tests, demos)."""

    def __init__(self, app: web.Application, host: str, port: int, handler_cancellation: bool = False):
        self.host, self.port = host, port
        self._handler_cancellation = handler_cancellation
        self._app = app
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"http-{port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(self._app, access_log=None, shutdown_timeout=1.0,
                               handler_cancellation=self._handler_cancellation)
        try:
            self._loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.host, self.port)
            self._loop.run_until_complete(site.start())
            if self.port == 0:
                self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        except BaseException as exc:  # surfaced to start()
            self._error = exc
            self._ready.set()
            return
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def start(self, timeout_s: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"server on {self.host}:{self.port} did not start within {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"server on {self.host}:{self.port} failed to start: {self._error}") from self._error
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for launching servers as subprocesses)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def lost_its_port(log_path, offset: int = 0) -> bool:
    """Whether a server process whose output went to ``log_path`` (from byte ``offset``: its own
    launch) exited because its port was taken between :func:`free_port` and its bind: another
    process, a client's outgoing connection or a server started beside it, got there first."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        return b"address already in use" in f.read().lower()


def wait_healthy(url: str, timeout_s: float = 120.0, proc=None, poll_timeout_s: float = 2.0) -> None:
    """Poll ``url/health`` until it answers 200; fail early if ``proc`` (a Popen) exits.

    The whole wait is bounded by ``timeout_s``: each poll gets at most ``poll_timeout_s`` and
    never more than the time left, so a server that accepts connections but never answers
    (stopped, deadlocked) cannot stretch it.
    """
    if not (timeout_s > 0 and poll_timeout_s > 0):
        raise ValueError(f"wait_healthy: timeout_s={timeout_s} and poll_timeout_s={poll_timeout_s} must be > 0")
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server process for {url} exited with code {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=min(poll_timeout_s, left)) as r:
                if r.status == 200:
                    return
        except (OSError, http.client.HTTPException):  # refused, timed out, reset, garbled: not up yet
            pass
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:g} s")
