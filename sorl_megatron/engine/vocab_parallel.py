"""Token log-probs and entropy from vocabulary-sharded logits, without gathering the vocabulary.

Each TP rank holds logits ``[..., V / tp]`` for its slice of the vocabulary. Both quantities
come from the kernels' one dispatch (``sorl_megatron.algorithms.dispatch``: the Triton kernel
on CUDA tensors, the chunked torch path otherwise), which computes per-row partials on the
local shard (max, sum-exp, sum-exp * logit, the target's logit where this rank owns it); the
engine combines them across the TP group with the all-reduce below. The backward is local
(no communication): every rank owns its slice of the softmax. Works at TP = 1 too.
"""

from __future__ import annotations

import torch

from ..algorithms import dispatch
from ..common import comm


def _tp():
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        return None, 1, 0
    return (
        mpu.get_tensor_model_parallel_group(),
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_tensor_model_parallel_rank(),
    )


def _tp_all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
    group, size, _ = _tp()
    if size > 1:
        comm.all_reduce(t, "max" if op == "max" else "sum", group)
    return t


def vocab_parallel_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log softmax(logits)[target], entropy)`` for vocab-sharded ``logits [..., V/tp]``.

    ``targets`` hold global vocabulary ids, shape ``logits.shape[:-1]``. Both differentiable;
    fp32 results.
    """
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} != logits shape without vocab {tuple(logits.shape[:-1])}"
        )
    _, _, rank = _tp()
    return dispatch.token_logprobs_entropy(
        logits, targets, vocab_start=rank * logits.shape[-1], all_reduce=_tp_all_reduce
    )


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the full (sharded) vocabulary, shape ``logits.shape[:-1]``."""
    targets = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return vocab_parallel_logprobs_entropy(logits, targets)[1]


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
