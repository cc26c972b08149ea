"""Write the synthetic search-agent data set the CPU demo trains on (no downloads).

    python tools/make_synthetic_data.py --out runs/tiny [--num-people 200] [--make-model]

A thin wrapper of ``python -m sorl_megatron.data.synthetic`` (same flags): a knowledge base,
its JSONL corpus, single- and two-hop questions as Search-R1 / verl parquet
(train/validation/test), gold plans for SFT and PVPO's ground-truth injection, and with
``--make-model`` an offline BPE tokenizer and a tiny random Qwen3-MoE HF model.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from sorl_megatron.common.environment import require_environment
    except ModuleNotFoundError:  # this python has not got the project installed: not its environment
        print(f"tools/make_synthetic_data.py: sorl_megatron cannot be imported by {sys.executable}, "
              "which is not the project's virtual environment; run: source .venv/bin/activate (or make setup)",
              file=sys.stderr)
        return 2
    require_environment("tools/make_synthetic_data.py")  # before the heavy imports
    from sorl_megatron.data.synthetic import main as make_data

    return make_data(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
