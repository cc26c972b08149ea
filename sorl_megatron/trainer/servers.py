"""Embedded rollout and retrieval servers for a training run.

With no ``rollout.urls`` the trainer starts ``python -m sorl_megatron.rollout.server`` on a
free 127.0.0.1 port; with no ``retrieval.url`` it starts the BM25 retrieval server over
``retrieval.corpus``. Both are child processes stopped on exit: normal return, exceptions,
Ctrl-C (``KeyboardInterrupt``) and SIGTERM all go through :meth:`EmbeddedServers.stop`, and an
``atexit`` hook catches anything else; on Linux the children also get SIGTERM when the trainer
itself is killed (SIGKILL included). Server output goes to ``<run_dir>/servers/*.log``.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..common.background import free_port, wait_healthy
from ..common.procutil import die_with_parent_preexec
from ..common.protocol import RETRIEVAL_API_KEY_ENV, ROLLOUT_API_KEY_ENV


@dataclass
class ServerSpec:
    """How to start one embedded server."""

    name: str
    module: str
    args: list[str]
    health_timeout_s: float = 300.0
    api_key_env: Optional[str] = None  # the server's --api-key variable (see start)


@dataclass
class EmbeddedServers:
    """Starts the servers a run needs and guarantees they stop."""

    run_dir: Path
    host: str = "127.0.0.1"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    api_keys: dict[str, str] = field(default_factory=dict)  # server name -> its --api-key
    _logs: list = field(default_factory=list)

    def start(self, spec: ServerSpec) -> str:
        """Launch ``spec`` on a free port, wait for ``/health``, return its URL.

        Loopback is reachable by every local user, so each server gets an API key: the one in
        its key variable, else a fresh random one for this run, passed in the child's
        environment (never in argv, which ``ps`` shows) and kept in ``api_keys`` for the
        trainer's clients.
        """
        env = dict(os.environ)
        if spec.api_key_env:
            env[spec.api_key_env] = self.api_keys[spec.name] = env.get(spec.api_key_env) or secrets.token_urlsafe(32)
        port = free_port(self.host)
        log_dir = self.run_dir / "servers"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = open(log_dir / f"{spec.name}.log", "ab")
        self._logs.append(log)
        cmd = [sys.executable, "-m", spec.module, *spec.args, "--host", self.host, "--port", str(port)]
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent_preexec(),
        )
        self.procs[spec.name] = proc
        if len(self.procs) == 1:
            atexit.register(self.stop)
        url = f"http://{self.host}:{port}"
        try:
            wait_healthy(url, timeout_s=spec.health_timeout_s, proc=proc)
        except Exception as err:
            self.stop()
            raise RuntimeError(f"embedded {spec.name} server failed to start ({err}); see {log.name}") from None
        return url

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
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> "EmbeddedServers":
        self._previous_sigterm = signal.getsignal(signal.SIGTERM)
        if _in_main_thread():
            # SIGTERM (e.g. a scheduler killing the job) becomes an exception, so __exit__ runs.
            signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if _in_main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)


def rollout_server_spec(model_path: str, precision: str, routed_experts: bool, seed: int,
                        tokenizer_path: Optional[str] = None, max_running_requests: Optional[int] = None) -> ServerSpec:
    args = ["--model-path", model_path, "--precision", precision, "--random-seed", str(seed)]
    if tokenizer_path:
        args += ["--tokenizer-path", tokenizer_path]
    if routed_experts:
        args.append("--enable-return-routed-experts")
    if max_running_requests:
        args += ["--max-running-requests", str(max_running_requests)]
    return ServerSpec("rollout", "sorl_megatron.rollout.server", args, api_key_env=ROLLOUT_API_KEY_ENV)


def retrieval_server_spec(corpus: str, topk: int) -> ServerSpec:
    if not corpus or not Path(corpus).is_file():
        raise FileNotFoundError(f"retrieval.corpus: {corpus!r} is not a file (and no retrieval.url was given)")
    return ServerSpec(
        "retrieval", "sorl_megatron.retrieval.server", ["--corpus", corpus, "--topk", str(topk)],
        health_timeout_s=120.0, api_key_env=RETRIEVAL_API_KEY_ENV,
    )


class SignalInterrupt(KeyboardInterrupt):
    """A signal (SIGTERM) turned into KeyboardInterrupt so that every cleanup runs; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def report_interrupt(err: KeyboardInterrupt) -> int:
    """For an entry point that caught Ctrl-C (or SIGTERM, as :class:`SignalInterrupt`) after
    the trainer's cleanup stopped its servers: one line on rank 0 instead of a traceback per
    rank; returns the exit code a shell expects (128 + the signal number)."""
    signum = int(getattr(err, "signum", signal.SIGINT))
    if int(os.environ.get("RANK", "0")) == 0:
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"interrupted ({what}): stopped the run and its servers; run the same command again to resume "
              "from its last checkpoint", file=sys.stderr, flush=True)
    return 128 + signum


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise SignalInterrupt(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
