"""Full SO-PPO loss vs plain token PPO, forward + backward, same tensors, one run.

SO-PPO (SORL eq. 3-4, 8, 9, 12) adds turn segmentation, turn ratios, the clip-bias vector and
its norm on top of the token-PPO surrogate; this prints what that costs per micro-batch.

    .venv/bin/python benchmarks/bench_policy_loss.py [--batch 512 --seq 4096 --turns 5]
"""

from __future__ import annotations

import argparse

import torch
from common import best_of, multi_turn_batch

from sorl_megatron.algorithms import PolicyLossConfig, compute_policy_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    lp, old, adv, mask = multi_turn_batch(args.batch, args.seq, args.turns)
    print(f"B={args.batch} T={args.seq} turns/row={args.turns} policy tokens={int(mask.sum())} "
          f"torch threads={torch.get_num_threads()}")

    times, metrics = {}, {}
    for name in ("ppo", "so_ppo"):
        cfg = PolicyLossConfig(name=name, eps_low=0.2, eps_high=0.28, loss_agg="seq-mean-token-mean")

        def step():
            x = lp.clone().requires_grad_()
            loss, m = compute_policy_loss(x, old, adv, mask, cfg)
            loss.backward()
            return m

        metrics[name] = step()
        times[name] = best_of(step, args.repeats)
        print(
            f"{name:7s} fwd+bwd: {times[name] * 1e3:8.1f} ms   clip_frac={float(metrics[name]['clip_frac']):.4f} "
            f"clip_bias/norm={float(metrics[name].get('clip_bias/norm', 0.0)):.4f} "
            f"factor={float(metrics[name]['clip_bias/factor']):.4f}"
        )
    assert float(metrics["so_ppo"]["clip_bias/norm"]) > 0  # the SO-PPO extras really ran
    print(f"so_ppo / ppo time ratio: {times['so_ppo'] / times['ppo']:.2f}x")


if __name__ == "__main__":
    main()
