"""Set-up for the whole test session, loaded before any test module is collected.

Triton decides when a function is decorated whether ``@triton.jit`` compiles it or interprets
it (``TRITON_INTERPRET``), and that holds for its own library too: ``tl.zeros`` and the other
``triton.language`` helpers are decorated once, when ``triton.language`` is first imported. The
kernel tests (tests/kernels) run interpreted on CPU, so ``triton.language`` and the kernel
modules are imported here, first, with the variable set; it is restored at once, so nothing
else runs interpreted (the kernels' fixture sets it around each of their tests). When this ran
only at the collection of tests/kernels, a module collected before it imported Triton
(transformers' ``LlamaConfig`` does) and every interpreted kernel calling ``tl.zeros`` failed.
On a machine with a GPU, a test that compiles a Triton kernel of its own in this session would
find those helpers interpreted: run it in its own process (none does now).
"""

from __future__ import annotations

import importlib
import os
import sys

KERNEL_MODULES = ("triton.language", "sorl_kernels.segment", "sorl_kernels.logprobs", "sorl_kernels.surrogate")


def _import_interpreted() -> None:
    if "triton.language" in sys.modules:  # a plugin imported it: its helpers cannot be re-decorated
        raise RuntimeError("triton.language was imported before tests/conftest.py: the kernel tests need it "
                           "imported with TRITON_INTERPRET=1 first")
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in KERNEL_MODULES:
            importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


_import_interpreted()

