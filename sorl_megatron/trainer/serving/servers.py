"""Embedded rollout and retrieval servers for a training run.

With no ``rollout.urls`` the trainer starts ``python -m sorl_megatron.sglang_cpu.server`` on a
free 127.0.0.1 port; with no ``retrieval.url`` it starts the BM25 retrieval server over
``retrieval.corpus``. Both are child processes stopped on exit: normal return, exceptions,
Ctrl-C (``KeyboardInterrupt``) and SIGTERM all go through :meth:`EmbeddedServers.stop`, and an
``atexit`` hook catches anything else; on Linux the children also get SIGTERM when the trainer
itself is killed (SIGKILL included). Server output goes to ``<run_dir>/servers/*.log``.
A fleet of rollout servers (``rollout.fleet.num_servers``) and the ``sglang-router`` in front of
them are started the same way; :meth:`EmbeddedServers.restart` replaces one that died or hung
(trainer/serving/fleet.py decides when).
"""

from __future__ import annotations

import atexit
import math
import os
import secrets
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ...common.background import free_port, lost_its_port, wait_healthy
from ...common.interrupts import SignalInterrupt, raise_interrupt  # noqa: F401 (SignalInterrupt: re-exported)
from ...common.procutil import die_with_parent_preexec
from ...common.protocol import RETRIEVAL_API_KEY_ENV, ROLLOUT_API_KEY_ENV

# A server is handed a port that was free a moment before it binds it; another process (a client's
# outgoing connection, a server started beside it) can take it in between. A launch that exits
# saying so is launched again on a new port, this many times.
PORT_RETRIES = 3


@dataclass
class ServerSpec:
    """How to start one embedded server."""

    name: str
    module: str
    args: list[str]
    health_timeout_s: float = 300.0
    api_key_env: Optional[str] = None  # the server's --api-key variable (see start)
    # servers sharing a key group share one key (the rollout servers and their router); default: the name
    key_group: Optional[str] = None


@dataclass
class EmbeddedServers:
    """Starts the servers a run needs and guarantees they stop."""

    run_dir: Path
    host: str = "127.0.0.1"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    api_keys: dict[str, str] = field(default_factory=dict)  # server name -> its --api-key
    _logs: list = field(default_factory=list)

    specs: dict[str, ServerSpec] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # server name -> times restarted
    _log_starts: dict[str, int] = field(default_factory=dict)  # server name -> its log's size at launch

    def start(self, spec: ServerSpec) -> str:
        """Launch ``spec`` on a free port, wait for ``/health``, return its URL.

        Loopback is reachable by every local user, so each server gets an API key: the one in
        its key variable, else a fresh random one for this run (one per ``key_group``), passed
        in the child's environment (never in argv, which ``ps`` shows) and kept in ``api_keys``
        for the trainer's clients.
        """
        self.launch(spec)
        return self.wait_ready(spec.name)  # the URL it answers on (a relaunch moves it)

    def launch(self, spec: ServerSpec) -> str:
        """Start ``spec``'s process on a free port without waiting for it; returns its URL."""
        env = dict(os.environ)
        if spec.api_key_env:
            group = spec.key_group or spec.name
            key = self.api_keys.get(group) or env.get(spec.api_key_env) or secrets.token_urlsafe(32)
            env[spec.api_key_env] = self.api_keys[group] = key
        port = free_port(self.host)
        log_dir = self.run_dir / "servers"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = open(log_dir / f"{spec.name}.log", "ab")
        self._logs.append(log)
        self._log_starts[spec.name] = log.tell()  # where this launch's output begins (append mode: the end)
        # a spec may need a second port of its own (the router's metrics exporter)
        args = [str(free_port(self.host)) if a == "{prometheus_port}" else a for a in spec.args]
        cmd = [sys.executable, "-m", spec.module, *args, "--host", self.host, "--port", str(port)]
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent_preexec(),
        )
        if not self.procs:
            atexit.register(self.stop)
        self.procs[spec.name], self.specs[spec.name] = proc, spec
        self.urls[spec.name] = f"http://{self.host}:{port}"
        return self.urls[spec.name]

    def log_path(self, name: str) -> Path:
        return self.run_dir / "servers" / f"{name}.log"

    def wait_ready(self, name: str, timeout_s: Optional[float] = None, stop_all: bool = True) -> str:
        """Wait (``timeout_s``, default the spec's ``health_timeout_s``) for a launched server's
        ``/health``; on failure raise naming its log, after stopping every server (``stop_all``)
        or only this one (a restart that failed: the fleet goes on without it)."""
        spec, relaunches = self.specs[name], 0
        while True:
            proc = self.procs[name]
            try:
                wait_healthy(self.urls[name], timeout_s=timeout_s or spec.health_timeout_s, proc=proc)
                return self.urls[name]
            except Exception as err:
                if (relaunches < PORT_RETRIES and proc.poll() is not None
                        and lost_its_port(self.log_path(name), self._log_starts[name])):
                    relaunches += 1
                    self.launch(spec)
                    continue
                if stop_all:
                    self.stop()
                else:
                    self.kill(name)
                raise RuntimeError(f"embedded {name} server failed to start ({err}); "
                                   f"see {self.log_path(name)}") from None

    def kill(self, name: str) -> None:
        """SIGKILL one server's process group (a stopped, SIGSTOP'ed process dies too) and reap it."""
        proc = self.procs[name]
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)

    def restart(self, name: str) -> str:
        """Kill server ``name`` (dead, hung or alive) and launch it again on a new free port,
        without waiting; returns its new URL (:meth:`wait_ready` / the fleet waits)."""
        self.kill(name)
        self.restarts[name] = self.restarts.get(name, 0) + 1
        return self.launch(self.specs[name])

    def stop(self) -> None:
        """Terminate every server (SIGTERM, then SIGKILL after 10 s); idempotent."""
        for name, proc in list(self.procs.items()):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            del self.procs[name]
        self.specs.clear()
        self.urls.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> "EmbeddedServers":
        self._previous_sigterm = signal.getsignal(signal.SIGTERM)
        if _in_main_thread():
            # SIGTERM (e.g. a scheduler killing the job) becomes an exception, so __exit__ runs.
            signal.signal(signal.SIGTERM, raise_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if _in_main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)


def rollout_server_spec(model_path: str, precision: str, routed_experts: bool, seed: int,
                        tokenizer_path: Optional[str] = None, max_running_requests: Optional[int] = None,
                        name: str = "rollout", health_timeout_s: float = 300.0,
                        deterministic: bool = False, route_flip: tuple[float, int] = (0.0, 0)) -> ServerSpec:
    args = ["--model-path", model_path, "--precision", precision, "--random-seed", str(seed)]
    if deterministic:
        args.append("--enable-deterministic-inference")
    if route_flip[0] > 0:  # the study's routing-mismatch injector (rollout.inject)
        args += ["--inject-route-flip-fraction", repr(route_flip[0]), "--inject-route-flip-seed", str(route_flip[1])]
    if tokenizer_path:
        args += ["--tokenizer-path", tokenizer_path]
    if routed_experts:
        args.append("--enable-return-routed-experts")
    if max_running_requests:
        args += ["--max-running-requests", str(max_running_requests)]
    return ServerSpec(name, "sorl_megatron.sglang_cpu.server", args, health_timeout_s=health_timeout_s,
                      api_key_env=ROLLOUT_API_KEY_ENV, key_group="rollout")


def router_spec(worker_urls: list[str], policy: str, request_timeout_s: float, health_timeout_s: float = 120.0,
                balance_abs_threshold: int = 4, name: str = "router") -> ServerSpec:
    """The real ``sglang-router`` (through ``sorl_megatron.rollout.router``, which hands it the
    rollout key from the environment, not argv) in front of ``worker_urls``.

    Its own retries are off: a request that fails on a dead or hung worker comes back to the
    trainer's client, which counts it, has the fleet take the worker out and sends it again.
    Its Prometheus exporter listens on loopback, on the port after the router's.
    """
    args = ["--policy", policy, "--request-timeout-secs", str(max(1, math.ceil(request_timeout_s))),
            "--disable-retries", "--prometheus-host", "127.0.0.1", "--prometheus-port", "{prometheus_port}",
            "--balance-abs-threshold", str(balance_abs_threshold), "--log-level", "warn"]
    if worker_urls:
        args += ["--worker-urls", *worker_urls]
    return ServerSpec(name, "sorl_megatron.rollout.router", args, health_timeout_s=health_timeout_s,
                      api_key_env=ROLLOUT_API_KEY_ENV, key_group="rollout")


def retrieval_server_spec(corpus: str, topk: int) -> ServerSpec:
    if not corpus or not Path(corpus).is_file():
        raise FileNotFoundError(f"retrieval.corpus: {corpus!r} is not a file (and no retrieval.url was given)")
    return ServerSpec(
        # the recipe's topk is the embedded server's cap too (its default cap is 100)
        "retrieval", "sorl_megatron.retrieval.server",
        ["--corpus", corpus, "--topk", str(topk), "--max-topk", str(max(topk, 100))],
        health_timeout_s=120.0, api_key_env=RETRIEVAL_API_KEY_ENV,
    )


def report_interrupt(err: KeyboardInterrupt) -> int:
    """For an entry point that caught Ctrl-C (or SIGTERM, as :class:`SignalInterrupt`) after
    the trainer's cleanup stopped its servers: one line on rank 0 instead of a traceback per
    rank; returns the exit code a shell expects (128 + the signal number). The trainer's own
    interrupt (``rerun.RunInterrupted``) names the phase it stopped in and what the same command
    does next; any other came before the trainer started or after it finished."""
    signum = int(getattr(err, "signum", signal.SIGINT))
    if int(os.environ.get("RANK", "0")) == 0:
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        phase, plan = getattr(err, "phase", None), getattr(err, "plan", None)
        if phase is None or plan is None:
            line = (f"interrupted ({what}) before the run started or after it ended: nothing was lost; run the same "
                    "command again")
        else:
            line = (f"interrupted ({what}) during {phase}: stopped the run and its servers; run the same command "
                    f"again: {plan}")
        print(line, file=sys.stderr, flush=True)
    return 128 + signum


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
