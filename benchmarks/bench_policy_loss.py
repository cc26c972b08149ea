"""The policy-loss path against a plain token-level PPO written from the textbook formula.

Forward + backward on the same tensors, the implementations timed in alternation over the
repeats; prints each one's ratio to the reference (median of the per-round ratios and the ratio
of the minimum times) and the machine load. Targets (issue 17): ``ppo`` <= 1.1x and ``so_ppo``
<= 1.3x the reference at B=256, T=4096.

    .venv/bin/python benchmarks/bench_policy_loss.py [--size full|quick] [--batch B --seq T] [--turns 5]
        [--cpu-time]   # thread CPU seconds instead of wall time, on a loaded machine

The reference is what every framework ships as its vanilla PPO loss: the ratio, the clipped
surrogate, the masked aggregation, and the two metrics all of them log (clip fraction and the
k1 KL estimate). Before timing, ``ppo`` is checked against it (same loss and gradient).
"""

from __future__ import annotations

import argparse
import time

import torch
from common import interleaved, load, multi_turn_batch, report

from sorl_megatron.algorithms import PolicyLossConfig, compute_policy_loss

SIZES = {"full": (256, 4096), "quick": (32, 2048)}


def vanilla_ppo(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, agg):
    """Token-level clipped PPO: ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` aggregated
    over the mask (``token-mean`` or ``seq-mean-token-mean``), plus clip fraction and k1 KL."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    m = mask.float()
    n = m.sum().clamp(min=1.0)
    if agg == "token-mean":
        loss = (per_token * m).sum() / n
    else:  # seq-mean-token-mean
        rows = m.sum(-1)
        loss = ((per_token * m).sum(-1) / rows.clamp(min=1.0)).sum() / (rows > 0).sum().clamp(min=1)
    with torch.no_grad():
        metrics = {"clip_frac": ((clipped > unclipped).float() * m).sum() / n, "approx_kl": (-log_ratio * m).sum() / n}
    return loss, metrics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--batch", type=int, help="overrides --size")
    ap.add_argument("--seq", type=int, help="overrides --size")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--agg", choices=["token-mean", "seq-mean-token-mean"], default="token-mean")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the thread's CPU seconds instead of wall time (a loaded machine)")
    args = ap.parse_args()
    batch, seq = SIZES[args.size]
    batch, seq = args.batch or batch, args.seq or seq
    lp, old, adv, mask = multi_turn_batch(batch, seq, args.turns)
    eps_low, eps_high = 0.2, 0.28
    print(f"B={batch} T={seq} turns/row={args.turns} policy tokens={int(mask.sum())} agg={args.agg} "
          f"torch threads={torch.get_num_threads()}; {load()}")

    cfgs = {name: PolicyLossConfig(name=name, eps_low=eps_low, eps_high=eps_high, loss_agg=args.agg)
            for name in ("ppo", "so_ppo")}

    def ours(name):
        def step():
            x = lp.clone().requires_grad_()
            loss, _ = compute_policy_loss(x, old, adv, mask, cfgs[name])
            loss.backward()
            return loss, x.grad
        return step

    def reference():
        x = lp.clone().requires_grad_()
        loss, _ = vanilla_ppo(x, old, adv, mask, eps_low, eps_high, args.agg)
        loss.backward()
        return loss, x.grad

    # same numbers first: token PPO is the reference's loss and gradient
    (l_ref, g_ref), (l_ppo, g_ppo) = reference(), ours("ppo")()
    torch.testing.assert_close(l_ppo, l_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_ppo, g_ref, rtol=1e-5, atol=1e-9)
    _, m = compute_policy_loss(lp.clone().requires_grad_(), old, adv, mask, cfgs["so_ppo"])
    assert float(m["clip_bias/norm"]) > 0  # the SO-PPO extras really ran
    print(f"so_ppo: clip_frac={float(m['clip_frac']):.4f} clip_bias/norm={float(m['clip_bias/norm']):.3g}")

    clock = time.thread_time if args.cpu_time else time.perf_counter
    times = interleaved({"vanilla_ppo": reference, "ppo": ours("ppo"), "so_ppo": ours("so_ppo")}, args.repeats,
                        clock=clock)
    report(times, "vanilla_ppo", targets={"ppo": 1.1, "so_ppo": 1.3})


if __name__ == "__main__":
    main()
