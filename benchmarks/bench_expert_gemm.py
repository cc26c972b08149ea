"""The TE-less expert linear: ``torch._grouped_mm`` (one kernel) vs one ``F.linear`` per expert.

Forward + backward of one expert linear (``sorl_megatron.bridge.grouped_gemm``) on tokens
routed at random over the experts (some experts get none), timed in alternation
(``common.interleaved``) with the load printed; ratios are the grouped kernel's time over the
loop's (< 1: grouped faster). Shapes: ``tiny`` (the tests' MoE models), ``small`` (hidden 256,
16 experts) and ``wide`` (Qwen3-30B-A3B's fc1: hidden 2048 -> 2 x 768, 128 experts, few tokens).
Also checks that both paths agree. This is what ``grouped_gemm``'s automatic choice rests on
for the CPU.

    nice -n 10 .venv/bin/python benchmarks/bench_expert_gemm.py [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse

import torch
from common import interleaved, report

from sorl_megatron.bridge.grouped_gemm import grouped_linear, loop_linear

SHAPES = {  # rows (tokens x top-k), experts, in, out
    "tiny": (256, 8, 64, 64),
    "small": (2048, 16, 256, 256),
    "wide": (2048, 128, 2048, 1536),
}


def routed_counts(rows: int, experts: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, experts, (rows,), generator=g)
    idx[idx == experts - 1] = 0  # one expert without tokens, as happens in routing
    return torch.bincount(idx, minlength=experts)


def case(name: str, dtype: torch.dtype, repeats: int) -> None:
    rows, experts, d_in, d_out = SHAPES[name]
    counts = routed_counts(rows, experts)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, d_in, generator=g).to(dtype).requires_grad_()
    ws = [(torch.randn(d_out, d_in, generator=g) / d_in**0.5).to(dtype).requires_grad_() for _ in range(experts)]
    grad = torch.randn(rows, d_out, generator=g).to(dtype)
    results = {}

    def step(fn):
        def run():
            for t in (x, *ws):
                t.grad = None
            y = fn(x, ws, counts)
            y.backward(grad)
            results[fn.__name__] = (y.detach(), x.grad)
        return run

    times = interleaved({"grouped": step(grouped_linear), "loop": step(loop_linear)}, repeats=repeats)
    diff = max((a.float() - b.float()).abs().max().item()
               for a, b in zip(results["grouped_linear"], results["loop_linear"]))
    print(f"\n{name} {dtype}: rows {rows}, experts {experts}, {d_in} -> {d_out}; largest difference {diff:.2e}")
    report(times, baseline="loop")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.shapes:
        for dtype in (torch.float32, torch.bfloat16):
            case(name, dtype, args.repeats)


if __name__ == "__main__":
    main()
