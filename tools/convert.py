#!/usr/bin/env python
"""HuggingFace <-> Megatron checkpoint conversion and logit verification.

    python tools/convert.py --help
    python tools/convert.py hf-to-megatron --hf HF_DIR --out CKPT --layout tp=2
    torchrun --nproc_per_node=2 tools/convert.py hf-to-megatron --hf HF_DIR --out CKPT --layout tp=2
    python tools/convert.py megatron-to-hf --ckpt CKPT --out HF_OUT [--dtype bfloat16] [--fp8]
    python tools/convert.py verify --hf HF_DIR [--ckpt CKPT] --layout tp=2

See docs/conversion.md. The implementation is sorl_megatron.bridge.convert_cli.
"""

import sys

from sorl_megatron.bridge.convert_cli import main

if __name__ == "__main__":
    sys.exit(main())
