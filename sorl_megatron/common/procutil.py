"""Process helpers shared by the trainer's servers and megatron's CPU shims."""

from __future__ import annotations

import signal
import sys


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; no-op
    elsewhere). For helper processes (servers, multiprocessing managers) that would otherwise
    outlive a trainer killed with SIGKILL, which runs no cleanup."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
