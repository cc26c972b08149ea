"""What each trainer rank sends in a distributed weight sync: its pipeline stage, from one rank.

Each stage has one sender, its tensor- and data-parallel rank 0 (``weight_sync_roles``' dense
role), which forms the stage's one weight-update group with the servers. It sends the stage's
dense layers, gathered over tensor parallelism, and every expert of the stage: its own, and each
other expert owner's (expert-tensor-parallel rank 0 of expert-data-parallel rank 0 in its
expert-parallel group), which that owner hands to it over the expert-parallel group, one tensor
at a time, as the sender reaches the same parameter (``common.comm`` send / recv). So a sync has
one group per pipeline stage, whatever the expert parallelism, and no rank holds more than its
shard plus one full tensor (the sender: plus the bucket it is filling).

The stage's sender is its expert-parallel group's rank 0 as megatron orders the ranks (tensor,
context, expert, data, pipeline: the first rank of a stage is rank 0 of every group it is in);
:func:`check_stage_senders` refuses a layout where it is not.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

import torch

from ..bridge.model import MegatronModel, detached_value_heads
from ..common import comm


def weight_sync_roles() -> tuple[bool, bool]:
    """(sends its stage, owns experts to export) for this rank in a distributed weight sync:
    a stage is sent by its tensor-parallel rank 0 of data-parallel rank 0; each expert is
    exported by its expert-parallel owner's expert-tensor-parallel rank 0 of expert-data-parallel
    rank 0, which hands it to its stage's sender. Together the owners hold every tensor once."""
    from megatron.core import parallel_state as mpu

    dense = mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank(with_context_parallel=True) == 0
    expert = mpu.get_expert_tensor_parallel_rank() == 0 and mpu.get_expert_data_parallel_rank() == 0
    return dense, expert


class Moves:
    """How the export moves tensors between ranks: ``common.comm``'s. A plan of the sync
    (``weight_sync.plan``) passes its own, which moves shapes only."""

    all_gather = staticmethod(comm.all_gather)
    send = staticmethod(comm.send)
    recv = staticmethod(comm.recv)
    group_ranks = staticmethod(comm.group_ranks)


def check_stage_senders() -> None:
    """Every expert owner's expert-parallel rank 0 is a stage's sender, on every rank (a
    collective), else ValueError on every rank naming the first that is not."""
    from megatron.core import parallel_state as mpu

    dense, expert = weight_sync_roles()
    ep_group = mpu.get_expert_model_parallel_group()
    root = comm.group_ranks(ep_group)[0] if expert and mpu.get_expert_model_parallel_world_size() > 1 else None
    facts = comm.all_gather_object((dense, root))
    bad = [(r, root) for r, (_, root) in enumerate(facts) if root is not None and not facts[root][0]]
    if bad:
        raise ValueError(f"rank {bad[0][0]}'s experts would go to rank {bad[0][1]}, which sends no stage: the "
                         "distributed weight sync needs megatron's default rank order (tp-cp-ep-dp-pp)")


def iter_owned_hf_weights(
    model: MegatronModel, dtype: Optional[torch.dtype] = None, moves: type[Moves] | Moves = Moves
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors this rank sends in a distributed weight sync: on a stage's sender
    (``weight_sync_roles``), the whole stage in the order of its parameters, each expert
    parameter followed by the same parameter of every other expert owner of the stage, in
    expert-parallel rank order; on any other rank nothing (an expert owner hands its experts to
    the sender inside). Gathered over tensor (or expert-tensor) parallelism only, never across
    pipeline stages.

    Every rank must consume the whole iterator, senders or not: the gathers and the hand-overs
    run inside, in the same order on every rank of a group. The output layer of tied embeddings
    is skipped at PP > 1 (the first stage sends the embedding). ``moves``: how tensors move
    between ranks (default ``common.comm``).
    """
    bridge, mpu = model.bridge, model.bridge.mpu
    dense_owner, expert_owner = weight_sync_roles()
    tied = bool(getattr(model.config, "share_embeddings_and_output_weights", False))
    hand_over = mpu.ep_size > 1 and expert_owner
    peers = moves.group_ranks(mpu.ep_group) if hand_over else []
    if hand_over and dense_owner and peers[0] != comm.rank():
        raise ValueError(f"rank {comm.rank()} sends its stage but rank {peers[0]} is its expert-parallel "
                         "rank 0: see check_stage_senders")
    with detached_value_heads(model), torch.no_grad():
        for chunk in model.unwrapped():
            local_to_global = bridge._weight_name_mapping_mcore_local_to_global(chunk, consider_ep=True)
            if hand_over and dense_owner:  # each peer's names of the same parameters, by mbridge's own map
                at_peer = [_names_at_ep_rank(bridge, chunk, e) for e in range(len(peers))]
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
                    size, group, mine = mpu.etp_size, mpu.etp_group, expert_owner and dense_owner
                else:
                    size, group, mine = mpu.tp_size, mpu.tp_group, dense_owner
                if size > 1 and (expert or getattr(param, "tensor_model_parallel", False)):
                    parts = moves.all_gather(param.detach(), group)
                    merged = bridge._weight_merge_across_tp(name, parts, param)
                else:
                    merged = param.detach()
                if expert and hand_over and not dense_owner:
                    moves.send(merged.contiguous(), peers[0], mpu.ep_group)  # to the stage's sender
                    continue
                if not mine:
                    continue
                yield from _to_hf(bridge, name, merged, dtype)
                if expert and hand_over:  # the stage's sender: the same parameter of every other owner
                    for e in range(1, len(peers)):
                        got = moves.recv(torch.empty_like(merged.contiguous()), peers[e], mpu.ep_group)
                        yield from _to_hf(bridge, at_peer[e][local], got, dtype)


def _names_at_ep_rank(bridge, chunk, ep_rank: int) -> dict[str, str]:
    """mbridge's local -> global names of ``chunk`` on expert-parallel rank ``ep_rank`` of this
    rank's group (every owner of a stage holds the same local parameters)."""
    own = bridge.mpu
    bridge.mpu = dataclasses.replace(own, ep_rank=ep_rank)
    try:
        return bridge._weight_name_mapping_mcore_local_to_global(chunk, consider_ep=True)
    finally:
        bridge.mpu = own


def _to_hf(bridge, name: str, merged: torch.Tensor, dtype: Optional[torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
    hf_names, hf_tensors = bridge._weight_to_hf_format(name, merged)
    for hf_name, t in zip(hf_names, hf_tensors):
        t = t.to(dtype) if dtype is not None and t.is_floating_point() else t.clone()
        yield hf_name, t.contiguous()
