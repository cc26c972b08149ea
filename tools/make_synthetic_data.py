"""Write the synthetic search-agent data set the CPU demo trains on (no downloads).

    python tools/make_synthetic_data.py --out runs/tiny [--num-people 200] [--make-model]

A thin wrapper of ``python -m sorl_megatron.data.synthetic`` (same flags): a knowledge base,
its JSONL corpus, single- and two-hop questions as Search-R1 / verl parquet
(train/validation/test), gold plans for SFT and PVPO's ground-truth injection, and with
``--make-model`` an offline BPE tokenizer and a tiny random Qwen3-MoE HF model.
"""

from __future__ import annotations

import sys

from sorl_megatron.data.synthetic import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
