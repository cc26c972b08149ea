"""Run the Triton kernels on CPU through the Triton interpreter.

``triton.language`` and the kernel modules were imported interpreted before any test module
was collected (tests/conftest.py); each test here runs with ``TRITON_INTERPRET=1`` and first
checks that Triton's own helpers are the interpreted ones.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(tl.zeros, InterpretedFunction), "triton.language was imported without the interpreter"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
