"""What each trainer rank sends in a distributed weight sync: its own part of the model.

A stage's dense layers go from its tensor-parallel rank 0 of data-parallel rank 0, each expert
from its expert-parallel owner (the per-owner expert buckets), gathered over tensor (or
expert-tensor) parallelism only, so no rank holds more than its shard plus one full tensor.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from ..bridge.model import MegatronModel, detached_value_heads
from ..common import comm


def weight_sync_roles() -> tuple[bool, bool]:
    """(sends dense tensors, sends expert tensors) for this rank in a distributed weight sync:
    a stage's dense layers go from its tensor-parallel rank 0 of data-parallel rank 0, each
    expert from its expert-parallel owner's expert-tensor-parallel rank 0 of expert-data-parallel
    rank 0. Together the senders hold every tensor exactly once."""
    from megatron.core import parallel_state as mpu

    dense = mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank(with_context_parallel=True) == 0
    expert = mpu.get_expert_tensor_parallel_rank() == 0 and mpu.get_expert_data_parallel_rank() == 0
    return dense, expert


class Moves:
    """How the export moves tensors between ranks: ``common.comm``'s collectives. A plan of the
    sync (``weight_sync.plan``) passes its own, which moves shapes only."""

    all_gather = staticmethod(comm.all_gather)


def iter_owned_hf_weights(
    model: MegatronModel, dtype: Optional[torch.dtype] = None, moves: type[Moves] | Moves = Moves
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors this rank sends in a distributed weight sync (``weight_sync_roles``):
    its local parameters, gathered over tensor (or expert-tensor) parallelism only, never across
    pipeline stages or expert owners, so no rank holds more than its shard plus one full tensor.

    Every rank must consume the whole iterator, senders or not: the tensor-parallel gathers run
    inside, in the same order on every rank of a group. The output layer of tied embeddings is
    skipped at PP > 1 (the first stage sends the embedding). ``moves``: the collectives (default
    ``common.comm``'s).
    """
    bridge, mpu = model.bridge, model.bridge.mpu
    dense_owner, expert_owner = weight_sync_roles()
    tied = bool(getattr(model.config, "share_embeddings_and_output_weights", False))
    with detached_value_heads(model), torch.no_grad():
        for chunk in model.unwrapped():
            local_to_global = bridge._weight_name_mapping_mcore_local_to_global(chunk, consider_ep=True)
            params = dict(chunk.named_parameters())
            extra = {k: v for k, v in chunk.state_dict().items()
                     if "_extra_state" not in k and "expert_bias" in k and k not in params}
            for local, param in [*params.items(), *extra.items()]:
                if local not in local_to_global:
                    continue
                name = local_to_global[local]
                if tied and name == "output_layer.weight":
                    continue
                expert = ".mlp.experts.linear_fc" in name
                if expert:
                    size, group, mine = mpu.etp_size, mpu.etp_group, expert_owner
                else:
                    size, group, mine = mpu.tp_size, mpu.tp_group, dense_owner
                if size > 1 and (expert or getattr(param, "tensor_model_parallel", False)):
                    parts = moves.all_gather(param.detach(), group)
                    merged = bridge._weight_merge_across_tp(name, parts, param)
                else:
                    merged = param.detach()
                if not mine:
                    continue
                hf_names, hf_tensors = bridge._weight_to_hf_format(name, merged)
                for hf_name, t in zip(hf_names, hf_tensors):
                    t = t.to(dtype) if dtype is not None and t.is_floating_point() else t.clone()
                    yield hf_name, t.contiguous()
