"""common/interrupts.py: Ctrl-C and SIGTERM inside a run are never lost (issue 49, item 3).

The end-to-end matrix (each signal at each phase of a real run, then the resume) is
tests/trainer/test_signals.py; here the mechanism, in this process: a signal that lands in an
event loop whose coroutine absorbs the cancellation, or turns it into another error, still
comes out of ``aio.run`` as ``SignalInterrupt``; one swallowed outside a loop is raised again
by ``check``; a second one while the first is being handled is not raised."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from sorl_megatron.common import aio, interrupts
from sorl_megatron.common.http import ServerError


async def _absorbing(convert: bool) -> str:
    os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next bytecode: it cancels this task
    try:
        await asyncio.sleep(5)
    except asyncio.CancelledError:
        asyncio.current_task().uncancel()  # absorbed, as a careless library may
        if convert:
            raise ServerError("the call failed") from None
    return "went on"


@pytest.mark.parametrize("convert", [False, True])
def test_a_signal_absorbed_in_an_event_loop_still_stops(convert):
    with interrupts.catching():
        with pytest.raises(interrupts.SignalInterrupt) as err:
            aio.run(_absorbing(convert))
        assert err.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_signal_swallowed_outside_a_loop_is_raised_again_at_the_next_check():
    with interrupts.catching():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt:
            pass  # swallowed
        assert interrupts.pending() == signal.SIGTERM
        with pytest.raises(interrupts.SignalInterrupt) as err:
            interrupts.check()  # the next phase boundary
        assert err.value.signum == signal.SIGTERM
    assert interrupts.pending() is None


def test_a_second_signal_during_the_cleanup_is_recorded_not_raised():
    cleaned = []
    with interrupts.catching():
        with pytest.raises(interrupts.SignalInterrupt):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except KeyboardInterrupt:
                os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while stopping
                time.sleep(0.1)
                interrupts.check()  # the cleanup's own checks do not raise either
                cleaned.append(True)
                raise
    assert cleaned == [True]


def test_outside_a_run_nothing_changes():
    assert interrupts.pending() is None
    interrupts.check()
    assert aio.run(asyncio.sleep(0, result="x")) == "x"
