#!/usr/bin/env python
"""HuggingFace <-> Megatron checkpoint conversion and logit verification.

    python tools/convert.py --help
    python tools/convert.py hf-to-megatron --hf HF_DIR --out CKPT --layout tp=2
    torchrun --nproc_per_node=2 tools/convert.py hf-to-megatron --hf HF_DIR --out CKPT --layout tp=2
    python tools/convert.py megatron-to-hf --ckpt CKPT --out HF_OUT [--dtype bfloat16] [--fp8]
    python tools/convert.py verify --hf HF_DIR [--ckpt CKPT] --layout tp=2

See docs/how-to/convert.md. The implementation is sorl_megatron.bridge.convert_cli.
"""

import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from sorl_megatron.common.environment import require_environment
    except ModuleNotFoundError:  # this python has not got the project installed: not its environment
        print(f"tools/convert.py: sorl_megatron cannot be imported by {sys.executable}, which is not the project's "
              "virtual environment; run: source .venv/bin/activate (or make setup)", file=sys.stderr)
        return 2
    require_environment("tools/convert.py")  # before the heavy imports
    from sorl_megatron.bridge.convert_cli import main as convert

    return convert(argv)


if __name__ == "__main__":
    sys.exit(main())
