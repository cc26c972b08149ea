"""Process groups for a ParallelLayout: gloo on CPU; on GPU, NCCL for CUDA tensors beside gloo
for CPU ones.

Works single-process (no torchrun: a world of one on a free local port) and under torchrun
(RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment). Megatron's groups can
be torn down and rebuilt at another layout on the same world, which the checkpoint tests use.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .cpu_compat import apply_cpu_compat
from .layout import LayoutError, ParallelLayout

# On GPU the default group takes both devices: NCCL alone has no backend for CPU tensors
# ("No backend type associated with device type cpu"), and the object collectives of rank-0
# phases and small CPU statistics are cheaper on gloo than staged through GPU memory.
GPU_BACKEND = "cpu:gloo,cuda:nccl"


_COLLECTIVE_TIMEOUT_S: list[float] = []  # the default group's, given to megatron's sub-groups too


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600) -> None:
    """Create the default process group once (idempotent). ``timeout_s`` bounds every
    collective (the recipe's ``parallelism.collective_timeout_s``), in the default group and in
    every group megatron creates (:func:`init_parallel`)."""
    if dist.is_initialized():
        return
    _COLLECTIVE_TIMEOUT_S[:] = [float(timeout_s)]
    timeout = timedelta(seconds=timeout_s)
    if backend is None:
        backend = GPU_BACKEND if torch.cuda.is_available() else "gloo"
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ:  # torchrun (or a launcher like it): the env:// rendezvous
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # plain `python ...`: a world of one. Its store binds a port the system picks (0, unless
    # MASTER_PORT names one): no window in which another process takes a port chosen here first.
    # Nothing is written to os.environ: a child process this one starts (a benchmark, a study
    # cell, a test's subprocess) must start its own world, not inherit RANK and a bound port.
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore(addr, int(os.environ.get("MASTER_PORT", "0")), 1, True, timeout=timeout)
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)


def init_parallel(layout: ParallelLayout, seed: int = 1234, backend: Optional[str] = None) -> None:
    """Initialize megatron's model-parallel groups (and RNG trackers) for `layout`.

    Safe to call again with another layout: the previous megatron groups are destroyed first.
    """
    apply_cpu_compat()  # first: it also quiets megatron's CPU-only import warnings
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    init_distributed(backend)
    world = dist.get_world_size()
    if world % layout.model_parallel_size:
        raise LayoutError(
            f"world size {world} is not a multiple of TP x PP x CP = {layout.model_parallel_size} "
            f"({layout.describe()})"
        )
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    timeout = timedelta(seconds=(_COLLECTIVE_TIMEOUT_S or [600.0])[0])
    with _groups_bounded_by(timeout):
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            # megatron's own default is 30 minutes; its sub-groups (TP, PP, EP, DP) keep the recipe's
            # bound instead (timedelta takes the fraction)
            distributed_timeout_minutes=timeout.total_seconds() / 60,
        )
    model_parallel_cuda_manual_seed(seed)


@contextlib.contextmanager
def _groups_bounded_by(timeout: timedelta) -> Iterator[None]:
    """Every group created inside gets ``timeout`` where its creator gives none: megatron-core
    0.16.1 creates the expert-data-parallel gloo group (the distributed optimizer's checkpoint
    gathers run on it) without one, i.e. with gloo's 30-minute default."""
    real = dist.new_group

    def new_group(*args, **kwargs):
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = timeout
        return real(*args, **kwargs)

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = real


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default process group."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def current_layout() -> ParallelLayout:
    """The layout megatron is currently initialized with."""
    from megatron.core import parallel_state as mpu

    vpp = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    return ParallelLayout(
        tp=mpu.get_tensor_model_parallel_world_size(),
        pp=mpu.get_pipeline_model_parallel_world_size(),
        vpp=vpp,
        ep=mpu.get_expert_model_parallel_world_size(),
        etp=mpu.get_expert_tensor_parallel_world_size(),
        cp=mpu.get_context_parallel_world_size(),
    )
