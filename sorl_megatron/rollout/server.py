"""Moved: the CPU SGLang-compatible server is now ``sorl_megatron.sglang_cpu``.

``python -m sorl_megatron.rollout.server ...`` still works for this release: it says where the
server moved and runs ``python -m sorl_megatron.sglang_cpu.server ...`` with the same
arguments. It runs that module by name (as the trainer starts it), never imports it: ``rollout``
sits below ``sglang_cpu`` in the layers (tests/test_layout.py). This shim goes in the next release.
"""

from __future__ import annotations

import runpy
import sys

NEW_MODULE = "sorl_megatron.sglang_cpu.server"


def main() -> None:
    print(f"note: python -m sorl_megatron.rollout.server is deprecated and will be removed; "
          f"it runs python -m {NEW_MODULE} now", file=sys.stderr)
    runpy.run_module(NEW_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
