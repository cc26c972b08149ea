"""Run the Triton kernels on CPU through the Triton interpreter.

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted
(``TRITON_INTERPRET``), so the kernel modules are (re)imported here with the variable set.
The variable is then restored and only set again around each test of this folder, so other
test folders (which may import Triton code of their own) never see it.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

KERNEL_MODULES = ("sorl_kernels.segment", "sorl_kernels.logprobs", "sorl_kernels.surrogate")


def _import_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in KERNEL_MODULES:
            if name in sys.modules:  # imported earlier without the interpreter: decorate again
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


_import_interpreted()


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
