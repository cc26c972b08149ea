"""The one door from synchronous code into asyncio: :func:`run`.

``asyncio.run`` on the main thread installs a SIGINT handler bound to its task and, when it
restores the previous one, Python 3.11's ``signal`` module looks the handler up in an enum
whose failed lookup formats ``repr(handler)``, i.e. the task's repr *with its result*: twice
per call. For a rollout phase's result (hundreds of token and log-prob arrays) that repr took
about as long as the step's whole log-prob recompute. :func:`run` hands the result back past
the task, so the task's own result is ``None`` and nothing large is ever formatted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from . import interrupts

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``'s value (and exceptions, Ctrl-C included) without formatting it.
    During a run (``interrupts.catching``), Ctrl-C and SIGTERM cancel the loop's main task and
    come out as ``interrupts.SignalInterrupt``, also when some coroutine absorbed the
    cancellation or turned it into another error."""
    box: list[T] = []

    async def main() -> None:
        with interrupts.loop_task(asyncio.current_task()):
            box.append(await coro)

    try:
        asyncio.run(main())
    except BaseException as err:  # the cancellation, or what some coroutine turned it into (a timeout ...)
        if isinstance(err, KeyboardInterrupt) or interrupts.pending() is None:
            raise
        raise interrupts.SignalInterrupt(interrupts.pending()) from None
    interrupts.check()  # a signal whose cancellation some coroutine absorbed
    return box[0]
