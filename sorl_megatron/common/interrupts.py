"""Ctrl-C and SIGTERM during a run: acted on at once, and never lost.

Python turns SIGINT into ``KeyboardInterrupt`` at the main thread's next bytecode, and
``asyncio.run`` turns it into a cancellation of its main task instead; code that catches the
exception, or absorbs the cancellation (or turns it into another error that a retry or
failover absorbs), loses it, and the run goes on to its last step. While a run is inside
:func:`catching`:

- SIGINT and SIGTERM are both handled here, and recorded. Outside an event loop the handler
  raises :class:`SignalInterrupt` (a ``KeyboardInterrupt``) at once; inside one that
  :func:`sorl_megatron.common.aio.run` runs on the main thread, it cancels the loop's main
  task (as asyncio's own handler does: every coroutine's cleanup runs), and ``aio.run`` turns
  that cancellation into :class:`SignalInterrupt`;
- :func:`check` raises it again while one is recorded: ``aio.run`` calls it when its loop
  returns as if nothing happened (the cancellation was absorbed) and the trainer at every
  phase boundary, so a signal that some code swallowed still stops the run, at the latest at
  the next phase;
- a signal that comes while an interrupt is being handled up the stack (the cleanup on the way
  out: stopping servers, saying what a rerun does) is recorded, not raised, so a second Ctrl-C
  does not cut that cleanup short.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalInterrupt(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM) turned into KeyboardInterrupt so that every cleanup runs;
    ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


_pending: Optional[int] = None  # the first signal recorded by the outermost catching()
_depth = 0
_loop_task: Optional[asyncio.Task] = None  # the main task of the event loop the main thread runs (aio.run)


def _stopping() -> bool:
    """Whether an interrupt is being handled up the stack (an ``except`` or ``__exit__`` of it)."""
    return isinstance(sys.exc_info()[1], KeyboardInterrupt)


def raise_interrupt(signum: int, frame=None) -> None:
    """The handler of SIGINT and SIGTERM (see the module doc)."""
    global _pending
    if _pending is None and _depth > 0:
        _pending = signum
    if _stopping():
        return
    task = _loop_task
    if task is not None and not task.done() and _pending is not None:  # recorded: aio.run turns it back
        task.cancel()  # aio.run raises SignalInterrupt once the loop has unwound
        with contextlib.suppress(RuntimeError):  # wake the loop if it waits in select()
            task.get_loop().call_soon_threadsafe(lambda: None)
        return
    raise SignalInterrupt(_pending or signum)


def pending() -> Optional[int]:
    """The signal recorded since the outermost :func:`catching` began, if any."""
    return _pending


def check() -> None:
    """Raise :class:`SignalInterrupt` if a signal came (and the run is not already stopping)."""
    if _pending is not None and not _stopping():
        raise SignalInterrupt(_pending)


@contextlib.contextmanager
def loop_task(task: asyncio.Task) -> Iterator[None]:
    """While inside, a signal cancels ``task`` (the main task of ``aio.run``'s loop, on the main
    thread) instead of raising in the middle of the loop; elsewhere it changes nothing."""
    global _loop_task
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous, _loop_task = _loop_task, task
    try:
        yield
    finally:
        _loop_task = previous


@contextlib.contextmanager
def catching() -> Iterator[None]:
    """SIGINT and SIGTERM are handled here and recorded inside (main thread; elsewhere, or
    nested, it changes nothing); the previous handlers are back after."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    previous = {}
    if _depth == 1:
        _pending = None
        previous = {s: signal.getsignal(s) for s in SIGNALS}
        for s in SIGNALS:
            signal.signal(s, raise_interrupt)
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
            _pending = None
