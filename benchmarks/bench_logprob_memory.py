"""Peak memory of log-probs + entropy from logits: vocabulary-chunked path vs ``log_softmax``.

Each (path, T) runs in a fresh subprocess on identical tensors (same seed): bf16 logits
``[T, V]`` with ``requires_grad``, targets, and upstream gradients for both outputs. Peak
memory is the kernel's resident-set high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` right before the measured phase) minus the resident set after the
inputs exist, so it counts every tensor the path allocates: saved activations, fp32
temporaries and the bf16 ``logits.grad`` itself (``T x V x 2`` bytes, needed by any path).
``tracemalloc`` cannot see torch's allocator, hence the kernel counter.

    .venv/bin/python benchmarks/bench_logprob_memory.py \
        [--vocab 152064 --tokens 1024 2048 8192 --baseline-max-tokens 2048]

``log_softmax`` runs only up to ``--baseline-max-tokens`` (at T = 8k it needs tens of GB);
its peak is linear in T (every tensor it allocates is ``[T, V]``), so larger T are
extrapolated from the largest measured T and marked as such.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import torch

MIB = 1024 * 1024


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def child(path: str, tokens: int, vocab: int) -> dict:
    from sorl_megatron.algorithms import dispatch
    from sorl_megatron.algorithms.logprobs import log_softmax_logprobs_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.empty(tokens, vocab, dtype=torch.bfloat16)
    for start in range(0, tokens, 256):  # fill in slices: no full-size fp32 temporary
        logits[start : start + 256] = (torch.randn(min(256, tokens - start), vocab, generator=g) * 2).to(torch.bfloat16)
    logits.requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    g_lp, g_ent = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)
    fn = dispatch.token_logprobs_entropy if path == "chunked" else log_softmax_logprobs_entropy

    _reset_peak()
    base = _status("VmRSS")
    lp, ent = fn(logits, targets)
    fwd = _status("VmHWM") - base
    _reset_peak()
    (lp * g_lp + ent * g_ent).sum().backward()
    bwd = _status("VmHWM") - base
    return {"path": path, "T": tokens, "V": vocab, "fwd_peak": fwd, "fwd_bwd_peak": bwd,
            "grad_bytes": logits.grad.numel() * logits.grad.element_size(),
            "lp_sum": float(lp.sum()), "ent_sum": float(ent.sum())}


def run_child(path: str, tokens: int, vocab: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", path, str(tokens), str(vocab)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 8192])
    ap.add_argument("--baseline-max-tokens", type=int, default=2048)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return

    print(f"V={args.vocab}, bf16 logits; peaks in MiB above the inputs; 'fp32 copy' = T*V*4 bytes")
    print(f"{'T':>6} {'path':>12} {'fwd peak':>10} {'fwd+bwd peak':>13} {'of which grad':>14} {'fp32 copy':>10}")
    baseline_per_token: float | None = None
    for tokens in args.tokens:
        rows = []
        chunked = run_child("chunked", tokens, args.vocab)
        rows.append((chunked, ""))
        if tokens <= args.baseline_max_tokens:
            base = run_child("log_softmax", tokens, args.vocab)
            # Same tensors, same numbers: the two paths must agree before their memory is compared.
            assert abs(base["lp_sum"] - chunked["lp_sum"]) <= 1e-4 * abs(base["lp_sum"]), (base, chunked)
            assert abs(base["ent_sum"] - chunked["ent_sum"]) <= 1e-4 * abs(base["ent_sum"]), (base, chunked)
            baseline_per_token = (base["fwd_peak"] / tokens, base["fwd_bwd_peak"] / tokens)
            rows.append((base, ""))
        elif baseline_per_token is not None:
            est = {"path": "log_softmax", "fwd_peak": baseline_per_token[0] * tokens,
                   "fwd_bwd_peak": baseline_per_token[1] * tokens, "grad_bytes": chunked["grad_bytes"]}
            rows.append((est, " (extrapolated, linear in T)"))
        for row, note in rows:
            print(f"{tokens:>6} {row['path']:>12} {row['fwd_peak'] / MIB:>10.0f} {row['fwd_bwd_peak'] / MIB:>13.0f} "
                  f"{row['grad_bytes'] / MIB:>14.0f} {tokens * args.vocab * 4 / MIB:>10.0f}{note}")
        if len(rows) == 2:
            c, b = rows[0][0], rows[1][0]
            print(
                f"{'':>6} {'ratio':>12} {b['fwd_peak'] / c['fwd_peak']:>9.1f}x "
                f"{b['fwd_bwd_peak'] / c['fwd_bwd_peak']:>12.1f}x  (log_softmax / chunked)"
            )


if __name__ == "__main__":
    main()
