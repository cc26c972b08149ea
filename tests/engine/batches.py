"""Deterministic RL batches for the engine tests (same on every rank)."""

from __future__ import annotations

import torch

from sorl_megatron.engine.rl_batch import RLBatch


def make_batch(rows: int = 8, seq: int = 12, vocab: int = 128, seed: int = 0, spread: float = 0.3) -> RLBatch:
    """Right-padded rows: a prompt (loss 0), a response (loss 1), a tool observation (loss 0),
    another response turn, then padding. old_logprobs are perturbed so that some tokens clip."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    lengths = torch.randint(seq // 2 + 2, seq + 1, (rows,), generator=g)
    pos = torch.arange(seq).unsqueeze(0)
    att = (pos < lengths.unsqueeze(1)).long()
    loss = att.clone()
    loss[:, :3] = 0  # prompt
    obs_start = 3 + torch.randint(1, 3, (rows,), generator=g)
    loss[(pos >= obs_start.unsqueeze(1)) & (pos < obs_start.unsqueeze(1) + 2)] = 0  # tool observation
    adv = torch.randn(rows, generator=g).unsqueeze(1).expand(rows, seq).clone() * loss
    old = (-2.0 - torch.rand(rows, seq, generator=g) * 3.0) * att
    rollout = old + spread * 0.3 * torch.randn(rows, seq, generator=g) * att
    ref = old + 0.1 * torch.randn(rows, seq, generator=g) * att
    returns = torch.randn(rows, seq, generator=g) * loss
    values = torch.randn(rows, seq, generator=g) * loss
    return RLBatch(
        input_ids=ids, attention_mask=att, loss_mask=loss, old_logprobs=old, advantages=adv,
        rollout_logprobs=rollout, ref_logprobs=ref, returns=returns, values=values,
        group_ids=torch.arange(rows) // 2,
    )
