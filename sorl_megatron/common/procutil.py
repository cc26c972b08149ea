"""Helper processes that must not outlive their parent: the trainer's embedded servers
(:func:`die_with_parent_preexec`) and megatron's checkpoint-writer manager (:func:`die_with_parent`)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable, Optional


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; no-op
    elsewhere). For helper processes (servers, multiprocessing managers) that would otherwise
    outlive a trainer killed with SIGKILL, which runs no cleanup."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def die_with_parent_preexec() -> Optional[Callable[[], None]]:
    """A Popen ``preexec_fn`` giving the child SIGTERM when the trainer dies (Linux).

    ``EmbeddedServers.stop`` and its ``atexit`` hook cover every exit the trainer sees; a SIGKILL (OOM killer,
    ``kill -9``, a scheduler's hard kill) runs neither, and the servers live in their own
    sessions, so without this they would outlive the run. ``prctl`` is resolved here, in the
    parent, so the child only makes the call between fork and exec.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the trainer died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
