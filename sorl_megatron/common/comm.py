"""The package's one door to ``torch.distributed``: ranks and every collective.

Each collective puts its tensors on a device the group's backend takes and copies results
back in place, so a caller's tensors stay where they are (CPU statistics stay on the CPU).
NCCL takes CUDA tensors only: torch 2.13 answers a CPU tensor on an NCCL group with "No backend
type associated with device type cpu", which a CPU test under gloo (that takes both) never
shows. The devices a group takes are read from its backend config (``cpu:gloo,cuda:nccl``).
Without a process group every call is the identity on a world of one.

Object collectives pickle: use them only between this run's own ranks.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: Optional[Any] = None) -> int:
    """This process's rank in ``group`` (the world by default); 0 without a process group."""
    return dist.get_rank(group) if initialized() else 0


def world_size(group: Optional[Any] = None) -> int:
    return dist.get_world_size(group) if initialized() else 1


def group_ranks(group: Optional[Any] = None) -> list[int]:
    """The global ranks of ``group`` (the world by default), in group-rank order."""
    if not initialized():
        return [0]
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def group_devices(group: Optional[Any] = None) -> tuple[str, ...]:
    """Device types ``group``'s backend takes, e.g. ``("cpu", "cuda")`` for gloo,
    ``("cuda",)`` for NCCL."""
    config = dist.get_backend_config(group)
    return tuple(part.split(":", 1)[0] for part in config.split(",") if ":" in part)


def device_for(tensor: torch.Tensor, group: Optional[Any] = None) -> torch.device:
    """Where ``tensor`` must be for a collective on ``group``: where it is if the backend takes
    that device, else the group's device (the current CUDA device for NCCL)."""
    devices = group_devices(group)
    if tensor.device.type in devices:
        return tensor.device
    if "cuda" in devices:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(devices[0] if devices else "cpu")


def _on_group_device(tensor: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    return tensor.to(device_for(tensor, group)).contiguous()


def _reduce_op(op: str):
    return getattr(dist.ReduceOp, _OPS[op])


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Optional[Any] = None) -> torch.Tensor:
    """``tensor`` reduced over ``group`` (``op``: sum, max, min), in place; returns it."""
    if world_size(group) == 1:
        return tensor
    work = _on_group_device(tensor, group)
    dist.all_reduce(work, op=_reduce_op(op), group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group: Optional[Any] = None) -> torch.Tensor:
    """``src``'s ``tensor`` (a global rank) on every rank of ``group``, in place; returns it."""
    if world_size(group) == 1:
        return tensor
    work = _on_group_device(tensor, group)
    dist.broadcast(work, src=src, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def send(tensor: torch.Tensor, dst: int, group: Optional[Any] = None) -> None:
    """``tensor`` to global rank ``dst`` (which calls :func:`recv` with a tensor of its shape and dtype)."""
    dist.send(_on_group_device(tensor, group), dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group: Optional[Any] = None) -> torch.Tensor:
    """Global rank ``src``'s :func:`send` into ``tensor``, in place; returns it."""
    work = _on_group_device(tensor, group)
    dist.recv(work, src=src, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_gather(tensor: torch.Tensor, group: Optional[Any] = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on every rank), in group-rank order, on ``tensor``'s device."""
    n = world_size(group)
    if n == 1:
        return [tensor]
    work = _on_group_device(tensor, group)
    parts = [torch.empty_like(work) for _ in range(n)]
    dist.all_gather(parts, work, group=group)
    return [p.to(tensor.device) for p in parts]


def any_rank(flag: bool, group: Optional[Any] = None) -> bool:
    """Whether ``flag`` is true on any rank (a collective: every rank calls it)."""
    t = torch.tensor([1.0 if flag else 0.0])
    return bool(all_reduce(t, "max", group).item() > 0)


def barrier(group: Optional[Any] = None) -> None:
    if world_size(group) > 1:
        dist.barrier(group=group)


def broadcast_object(obj: Any, src: int = 0, group: Optional[Any] = None) -> Any:
    """``src``'s ``obj`` on every rank of ``group`` (pickled: this run's own ranks only)."""
    if world_size(group) == 1:
        return obj
    box = [obj if rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group: Optional[Any] = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled: this run's own ranks only)."""
    n = world_size(group)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


class RankZeroPhaseError(RuntimeError):
    """Another rank gave up waiting for rank 0's phase, or rank 0 failed in it."""


_phase_seq = 0  # every rank counts the rank-0 phases in the same order


def store():
    """The default process group's key-value store (rank-0 phases, the weight-sync lock)."""
    return dist.distributed_c10d._get_default_store()


def on_rank0(fn, phase: str, timeout_s: float) -> Any:
    """``fn()`` on rank 0 and its result on every rank (pickled: this run's own ranks only).

    The other ranks wait on the process group's store, polling, at most ``timeout_s`` seconds,
    not inside a collective: an NCCL collective that waits longer than the group's timeout is
    killed by the watchdog with a message that names neither the phase nor the setting. A rank
    that gives up raises :class:`RankZeroPhaseError` naming ``phase``; so does every other rank
    when ``fn`` raises on rank 0 (which raises its own error)."""
    global _phase_seq
    if world_size() == 1:
        return fn()
    _phase_seq += 1
    key = f"sorl_megatron/rank0_phase/{_phase_seq}"
    kv = store()
    if rank() == 0:
        try:
            result = fn()
        except BaseException as err:
            kv.set(key, f"failed: {type(err).__name__}: {err}"[:2000])
            raise
        kv.set(key, "ok")
    else:
        from datetime import timedelta

        try:
            kv.wait([key], timedelta(seconds=timeout_s))
        except Exception:  # DistStoreError on timeout (its message names only the key)
            raise RankZeroPhaseError(
                f"rank {rank()} waited {timeout_s:g} s for rank 0 to finish {phase} "
                "(parallelism.rank0_phase_timeout_s)") from None
        status = kv.get(key).decode()
        if status != "ok":
            raise RankZeroPhaseError(f"rank 0 {status.replace('failed: ', 'failed in ' + phase + ': ', 1)}")
        result = None
    return broadcast_object(result)
