"""common/aio.py: ``run`` returns the coroutine's value and raises its errors, and never formats
the value (``asyncio.run`` on the main thread of Python 3.11 formats its task's result twice)."""

from __future__ import annotations

import asyncio
import pathlib
import signal
import sys

import pytest

from sorl_megatron.common import aio

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "sorl_megatron"


class Loud:
    """A value that counts how often it is formatted."""

    reprs = 0

    def __repr__(self) -> str:
        Loud.reprs += 1
        return "Loud()"


async def value(x):
    await asyncio.sleep(0)
    return x


def test_run_returns_the_value_without_formatting_it():
    Loud.reprs = 0
    out = aio.run(value(Loud()))
    assert isinstance(out, Loud) and Loud.reprs == 0
    assert aio.run(value(None)) is None  # a None result is a result too


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the formatting this avoids is Python 3.11's")
def test_asyncio_run_itself_formats_the_value():
    """What the helper is for: plain ``asyncio.run`` formats the result (if this starts failing
    on a fixed Python, the helper is no longer needed)."""
    # asyncio.run installs its own SIGINT handler (the path that formats) only over Python's
    # default one: an earlier test in the same process may have left another installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        Loud.reprs = 0
        asyncio.run(value(Loud()))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert Loud.reprs > 0


def test_run_raises_the_coroutines_error():
    async def fail():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        aio.run(fail())


def test_the_package_enters_asyncio_only_through_the_helper():
    found = [f"{p.relative_to(PACKAGE)}:{n}" for p in PACKAGE.rglob("*.py") if p != PACKAGE / "common" / "aio.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) if "asyncio.run(" in line]
    assert found == []
