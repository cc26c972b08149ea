"""The CPU rollout server as its own process, as a user starts it (``python -m ...``), for the
tests that watch what only a process shows: peak memory, a hung event loop, flags, keys in env."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from tests.served import served


@contextlib.contextmanager
def server_process(model_dir: Path, log_path: Path, *flags: str,
                   env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``(url, process)`` of a healthy server on a free port, logging to ``log_path``; stopped
    after. ``env`` is added to this process's environment (the test tree stays importable)."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
    argv = lambda port: [sys.executable, "-m", "sorl_megatron.sglang_cpu.server", "--model-path",  # noqa: E731
                         str(model_dir), "--port", str(port), "--num-threads", "1", "--log-level", "warning", *flags]
    with served(argv, log_path, env=full_env) as running:
        yield running
