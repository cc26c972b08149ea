"""Turn-ratio path: vectorized segments vs a per-row, per-turn Python loop (ROLL-style).

Both compute ``log w_k = mean_{t in turn k} log r_t`` broadcast to the turn's tokens (SORL
eq. 4) and backpropagate through it, on the same tensors, in one run. The loop is timed on
the first ``--loop-rows`` rows and scaled linearly to the full batch (rows are independent
and of the same size distribution), which the output says.

    .venv/bin/python benchmarks/bench_turn_ratio.py [--batch 512 --seq 4096 --turns 5 --loop-rows 512]
"""

from __future__ import annotations

import argparse

import torch
from common import best_of, multi_turn_batch

from sorl_megatron.algorithms import segment_mean_broadcast, segment_turns


def loop_turn_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The per-segment loop: each row's turn boundaries, then one mean per turn, stitched
    back with ``cat`` (differentiable, no in-place writes into a leaf's graph)."""
    rows = []
    edges = torch.diff(torch.nn.functional.pad(mask, (1, 1)), dim=1)  # +1 at a turn start, -1 past its end
    for b in range(mask.shape[0]):
        starts = (edges[b] == 1).nonzero().flatten().tolist()
        ends = (edges[b] == -1).nonzero().flatten().tolist()
        pieces, pos = [], 0
        for start, end in zip(starts, ends):
            pieces.append(log_ratio.new_zeros(start - pos))
            pieces.append(log_ratio[b, start:end].mean().expand(end - start))
            pos = end
        pieces.append(log_ratio.new_zeros(mask.shape[1] - pos))
        rows.append(torch.cat(pieces))
    return torch.stack(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--loop-rows", type=int, default=512, help="rows the Python loop is timed on")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    lp, old, _, mask = multi_turn_batch(args.batch, args.seq, args.turns)
    grad_out = torch.randn_like(lp)
    seg = segment_turns(mask)
    print(f"B={args.batch} T={args.seq} turns/row={seg.turns_per_row.float().mean():.2f} "
          f"policy tokens={int(mask.sum())} torch threads={torch.get_num_threads()}")

    def vectorized(rows: slice = slice(None)):
        x = lp[rows].clone().requires_grad_()
        s = segment_turns(mask[rows])  # segmentation is part of the per-step cost
        out = segment_mean_broadcast(x - old[rows], s)
        out.backward(grad_out[rows])
        return out, x.grad

    def loop(rows: slice = slice(None)):
        x = lp[rows].clone().requires_grad_()
        out = loop_turn_log_ratio(x - old[rows], mask[rows])
        out.backward(grad_out[rows])
        return out, x.grad

    sub = slice(0, args.loop_rows)
    (va, vg), (la, lg) = vectorized(sub), loop(sub)
    torch.testing.assert_close(va, la, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vg, lg, atol=1e-5, rtol=1e-5)

    def mean_broadcast_only():
        x = lp.clone().requires_grad_()
        segment_mean_broadcast(x - old, seg).backward(grad_out)

    t_vec = best_of(vectorized, args.repeats)
    t_mb = best_of(mean_broadcast_only, args.repeats)
    t_loop_sub = best_of(lambda: loop(sub), max(1, args.repeats // 2))
    scale = args.batch / args.loop_rows
    t_loop = t_loop_sub * scale
    note = "measured" if scale == 1 else f"measured on {args.loop_rows} rows, x{scale:g} (linear in rows)"
    print(f"vectorized (segment_turns + mean-broadcast, fwd+bwd): {t_vec * 1e3:9.1f} ms")
    print(f"  of which mean-broadcast fwd+bwd (segments reused):  {t_mb * 1e3:9.1f} ms")
    print(f"python loop per row/turn (fwd+bwd):                   {t_loop * 1e3:9.1f} ms  [{note}]")
    print(f"speed-up: {t_loop / t_vec:.1f}x")


if __name__ == "__main__":
    main()
