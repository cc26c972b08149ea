"""Bounded numbers on the command line: the ``type`` of every numeric flag of every entry point.

``type=Range(int, 1, 64)`` makes argparse refuse a value that is not a number, NaN, infinite or
out of range with its own error, one line naming the flag (``prog: error: argument --jobs: must
be in [1, 64], got 0``, exit 2), before any work. tests/test_cli_flags.py finds every parser of
the package and the tools and fails for a numeric flag whose type is not a ``Range``.
"""

from __future__ import annotations

import argparse
import math
from typing import Union

Number = Union[int, float]

HOUR = 3600
DAY = 24 * HOUR
WEEK = 7 * DAY
MAX_SEED = 2**63 - 1  # numpy / torch seeds
MAX_PORT = 65535


class Range:
    """An argparse type: a ``kind`` (int or float) in [low, high] ((low, high] when ``open_low``),
    in ``unit`` (named in the error)."""

    def __init__(self, kind: type, low: Number, high: Number, open_low: bool = False, unit: str = ""):
        self.kind, self.low, self.high, self.open_low, self.unit = kind, low, high, open_low, unit
        self.__name__ = kind.__name__  # what argparse's messages and --help call the type

    def __repr__(self) -> str:
        span = f"{'(' if self.open_low else '['}{_shown(self.low)}, {_shown(self.high)}]"
        return f"{span} {self.unit}" if self.unit else span

    def contains(self, value: Number) -> bool:
        above = value > self.low if self.open_low else value >= self.low
        return math.isfinite(value) and above and value <= self.high

    def __call__(self, text: str) -> Number:
        noun = "an integer" if self.kind is int else "a number"
        try:
            value = self.kind(text)
        except (TypeError, ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"must be {noun} in {self!r}, got {text!r}") from None
        if not self.contains(value):
            raise argparse.ArgumentTypeError(f"must be in {self!r}, got {text}")
        return value


def _shown(x: Number) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def count(low: int, high: int) -> Range:
    """An integer flag in [low, high] (a count, a size, a seed, a port)."""
    return Range(int, low, high)


def seconds(high: float) -> Range:
    """A wait in seconds: finite, > 0 and at most ``high``."""
    return Range(float, 0, high, open_low=True, unit="seconds")


def number(low: float, high: float) -> Range:
    """A float flag in [low, high]."""
    return Range(float, low, high)
