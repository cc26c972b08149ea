"""A server under test as its own process (``python -m ...``, as a user starts it) on a free port.

The port is free when :func:`free_port` returns it, not always when the child binds it: another
test worker's process, or a client's outgoing connection, can take it in between. A child that
exits saying so is started again on a new port, like the trainer's own embedded servers
(``EmbeddedServers.wait_ready``)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Callable, Iterator, Optional

from sorl_megatron.common.background import free_port, lost_its_port, wait_healthy


@contextlib.contextmanager
def served(argv: Callable[[int], list[str]], log_path: Path, env: Optional[dict] = None, timeout_s: float = 120.0,
           tries: int = 3) -> Iterator[tuple[str, subprocess.Popen]]:
    """``(url, process)`` of ``argv(port)`` healthy on a free 127.0.0.1 port, its output in
    ``log_path``; terminated after."""
    with open(log_path, "ab") as log:
        for attempt in range(tries):
            start, port = log.tell(), free_port()
            proc = subprocess.Popen(argv(port), stdout=log, stderr=subprocess.STDOUT, env=env)
            url = f"http://127.0.0.1:{port}"
            try:
                wait_healthy(url, timeout_s=timeout_s, proc=proc)
                break
            except Exception:
                proc.kill()
                proc.wait(timeout=20)
                log.flush()
                if attempt + 1 < tries and lost_its_port(log_path, start):
                    continue
                raise
        try:
            yield url, proc
        finally:
            proc.terminate()
            proc.wait(timeout=20)
