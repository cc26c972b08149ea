"""Uneven sequence-parallel all-gather on gloo (used by the `uneven_gather_on_gloo` CpuPatch).

With expert tensor parallelism and expert parallelism together (ETP > 1 and EP > 1, e.g.
TP2 x EP2 on four ranks), megatron's alltoall token dispatcher gathers the tokens an expert-TP
group received with ``gather_from_sequence_parallel_region(..., output_split_sizes=...)``: the
number of tokens differs per rank. NCCL's all-gather takes a list of tensors of different
sizes; gloo's does not (``ProcessGroupGloo::allgather: invalid tensor size``). (The matching
uneven reduce-scatter of the combine step runs on gloo as it is.)

The replacement, used only when split sizes are given (the even path stays megatron's): every
rank pads its rows to the largest split, an even all-gather runs, and each rank's first
``split`` rows are concatenated. Pure data movement: bit for bit what NCCL returns.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch

from ..common import comm


def _uneven_gather(original: Callable) -> Callable:
    @functools.wraps(original)
    def gather(input_, group, output_split_sizes: Optional[Sequence[int]] = None, use_global_buffer=False):
        if output_split_sizes is None or group is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        padded = input_.new_zeros((max(sizes),) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = comm.all_gather(padded, group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)], dim=0)

    gather.__wrapped_for_cpu__ = original  # type: ignore[attr-defined]
    return gather


def uneven_gather_targets() -> list[tuple[Any, str, Any]]:
    """``megatron.core.tensor_parallel.mappings._gather_along_first_dim`` (the autograd functions
    of the sequence-parallel regions look it up there at call time, forward and backward)."""
    from megatron.core.tensor_parallel import mappings

    return [(mappings, "_gather_along_first_dim", _uneven_gather(mappings._gather_along_first_dim))]
