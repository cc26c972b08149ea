"""Token log-probs and entropy from vocabulary-sharded logits, without gathering the vocabulary.

Each TP rank holds logits ``[..., V / tp]`` for its slice of the vocabulary. Log-probs use
megatron's ``tensor_parallel.vocab_parallel_cross_entropy`` (all-reduced max and sum-exp,
the target's logit from the rank that owns it). Entropy

    H = logsumexp(l) - sum_i p_i l_i,      dH/dl_j = -p_j (l_j - sum_i p_i l_i)

needs three all-reduces over TP (max, sum exp, sum exp * l) of ``[...]``-shaped tensors, and
its backward is local (no communication): every rank owns its slice of ``p`` and ``l``.
Both work at TP = 1 too (the reductions are then no-ops).
"""

from __future__ import annotations

import torch


def _tp_group():
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_group() if mpu.model_parallel_is_initialized() else None


def _tp_size() -> int:
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1


def _all_reduce(t: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
    if _tp_size() > 1:
        torch.distributed.all_reduce(t, op=op, group=_tp_group())
    return t


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[target]`` for vocab-sharded ``logits [..., V/tp]`` (float32 math).

    ``targets`` hold global vocabulary ids, shape ``logits.shape[:-1]``. Differentiable.
    """
    from megatron.core import tensor_parallel

    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} != logits shape without vocab {tuple(logits.shape[:-1])}")
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets)


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        global_max = _all_reduce(local_max.clone(), torch.distributed.ReduceOp.MAX)
        shifted = logits - global_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1))
        sum_exp_logit = _all_reduce((exp * shifted).sum(dim=-1))
        probs = exp / sum_exp.unsqueeze(-1)
        mean_shifted = sum_exp_logit / sum_exp  # E_p[l] - max
        entropy = sum_exp.log() - mean_shifted
        ctx.save_for_backward(probs, shifted, mean_shifted)
        return entropy

    @staticmethod
    def backward(ctx, grad_entropy: torch.Tensor):
        probs, shifted, mean_shifted = ctx.saved_tensors
        grad = -grad_entropy.unsqueeze(-1) * probs * (shifted - mean_shifted.unsqueeze(-1))
        return grad


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the full (sharded) vocabulary, shape ``logits.shape[:-1]``."""
    return _VocabParallelEntropy.apply(logits)


def shift_to_token_positions(per_prediction: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Values computed from the logits at position t (about token t+1) moved to position t+1.

    ``[B, S] -> [B, S]`` with ``fill`` at t = 0: the layout of the batch contract.
    """
    out = torch.full_like(per_prediction, fill)
    out[:, 1:] = per_prediction[:, :-1]
    return out


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """``targets[:, t] = input_ids[:, t+1]`` (the last position gets a dummy 0)."""
    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    return targets
