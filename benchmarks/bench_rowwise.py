"""The deterministic server's batch-invariant forwards (``sglang_cpu/rowwise.py``): this tree's
``RowwiseMode`` against another checkout's, in alternation, on the same served model and KV.

Two forwards, each timed in alternation (``common.interleaved``) with the load printed:

- ``decode``: one decode step of ``--rows`` rows whose pasts are 120, 133, ... tokens long (left
  padded to the longest, as the running batch holds them);
- ``prefill``: one round of the deterministic prefill (``forward.prefill_rowwise``) for ``--rows``
  prompts of 10, 11, ... tokens (a round feeds at most 32), no past.

Both modes must give the same logits and KV bit for bit (checked before timing; a difference
stops the script). Ratios are the old mode's time over this tree's (> 1: this tree faster).

    python benchmarks/bench_rowwise.py --old-src /tmp/old_checkout [--model recipes/study/round2_policy]
        [--rows 16] [--repeats 21]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from common import interleaved, load, report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def old_rowwise(src: Path):
    """The other checkout's ``rowwise`` module, loaded under its own name beside this tree's."""
    path = src / "sorl_megatron" / "sglang_cpu" / "rowwise.py"
    if not path.is_file():
        raise SystemExit(f"--old-src {src}: no {path.relative_to(src)} there (RowwiseMode exists from 2026-11-26 on)")
    spec = importlib.util.spec_from_file_location("old_rowwise", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-src", required=True, help="root of the checkout whose RowwiseMode to compare with")
    ap.add_argument("--model", default=str(ROOT / "recipes" / "study" / "round2_policy"))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()

    from sorl_megatron.sglang_cpu import rowwise
    from sorl_megatron.sglang_cpu.model import ServedModel
    from sorl_megatron.sglang_cpu.options import EngineConfig

    torch.set_num_threads(1)  # as the study gives each server
    old = old_rowwise(Path(args.old_src))
    served = ServedModel(EngineConfig(model_path=args.model, deterministic=True, precision="fp32"))
    n = args.rows
    print(f"start: {load()}; model {args.model}; {n} rows; old RowwiseMode from {args.old_src}")
    with torch.inference_mode():
        lengths = [120 + 13 * i for i in range(n)]
        pasts = []
        for seed, length in enumerate(lengths):
            ids = torch.randint(3, 300, (1, length), generator=torch.Generator().manual_seed(seed))
            pasts.append(served.run(ids, torch.ones((1, length), dtype=torch.long), torch.arange(length)[None],
                                    None, 1)[1])
        width = max(lengths)
        padded = [tuple(torch.cat([F.pad(kv[layer][j], (0, 0, width - m, 0)) for kv, m in zip(pasts, lengths)])
                        for j in (0, 1)) for layer in range(len(pasts[0]))]
        pos, toks = torch.tensor(lengths), torch.arange(n) + 5
        prompt_lengths = [min(10 + i, 32) for i in range(n)]
        longest = max(prompt_lengths)
        prompts = torch.zeros((n, longest), dtype=torch.long)
        for r, m in enumerate(prompt_lengths):  # left padded
            prompts[r, longest - m:] = torch.randint(3, 300, (m,), generator=torch.Generator().manual_seed(100 + r))
        col = torch.arange(longest)[None] - (longest - torch.tensor(prompt_lengths))[:, None]  # < 0: padding
        prompt_pos, prompt_mask = col.clamp(min=0), (col >= 0).long()

        def decode(module):
            with module.RowwiseMode(pos + 1):
                return served.run(toks[:, None], None, pos[:, None], padded, 1)

        def prefill(module):
            with module.RowwiseMode(prompt_lengths, prompt_lengths, served.experts, served.kv_heads):
                return served.run(prompts, prompt_mask, prompt_pos, None, 1)

        for name, fn in (("decode", decode), ("prefill", prefill)):
            if not same(fn(old), fn(rowwise)):
                raise SystemExit(f"{name}: the two modes' logits or KV differ")
            print(f"\n{name}: bit-identical; seconds per forward")
            times = interleaved({"old": lambda f=fn: f(old), "this tree": lambda f=fn: f(rowwise)},
                                repeats=args.repeats, warmup=2)
            ratios = report(times, "this tree")
            print(f"old / this tree: {ratios['old']:.2f}x")
    print(f"\nend: {load()}")


if __name__ == "__main__":
    main()
