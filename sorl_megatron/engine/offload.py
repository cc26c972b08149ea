"""``model.offload_idle``: an engine's model (and for a trained one its gradients and Adam state)
waits on the CPU between its passes, and comes to the GPU for each (``@resident`` methods).

The reference and the critic offload; the actor, used in every phase, stays. Moves go through
megatron's RL offload hooks (the DDP buffers' storage is freed and refilled, so every view into
them, ``param.data`` and ``main_grad``, stays valid; the optimizer's state tensors move). On a
CPU-only machine the idle and compute devices are the same and nothing moves.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch


def device() -> torch.device:
    """Where an engine computes: this rank's current GPU, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def idle_device(offload_idle: bool, compute: torch.device) -> torch.device:
    """Where an engine's model waits between its passes: the CPU when it offloads, else where it computes."""
    return torch.device("cpu") if offload_idle else compute


def resident(method: Callable) -> Callable:
    """Run an engine method with the engine's state on the compute device (``Offloadable.on_device``)."""

    @functools.wraps(method)
    def wrapper(self: "Offloadable", *args: Any, **kwargs: Any) -> Any:
        with self.on_device():
            return method(self, *args, **kwargs)

    return wrapper


class Offloadable:
    """Where an engine's state lives (``resides``) and the moves between its idle and compute devices.
    The engine sets ``offload_idle``, ``model`` and ``optimizer`` and calls ``_init_placement``."""

    offload_idle = False
    model: Any
    optimizer: Any

    def _init_placement(self, compute: torch.device) -> None:
        self._compute = compute
        self.resides = compute  # built there
        self._device_depth = 0
        self._move_state(idle_device(self.offload_idle, compute))

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The state on the compute device for the block; back to the idle device after the
        outermost one (a pass inside an update moves nothing)."""
        self._move_state(self._compute)
        self._device_depth += 1
        try:
            yield
        finally:
            self._device_depth -= 1
            if self._device_depth == 0:
                self._move_state(idle_device(self.offload_idle, self._compute))

    def _move_state(self, target: torch.device) -> None:
        if target != self.resides:
            place_state(self.model.chunks, self.optimizer, target)
            self.resides = target


def place_state(chunks: list[torch.nn.Module], optimizer: Any, target: torch.device) -> None:
    """Move model chunks (weights; DDP gradient buffers) and the optimizer's state to ``target``."""
    from megatron.core.distributed import DistributedDataParallel

    to_cpu = target.type == "cpu"
    for chunk in chunks:
        if not isinstance(chunk, DistributedDataParallel):
            chunk.to(target)  # a frozen model: plain parameters
            continue
        buffers = chunk.buffers + chunk.expert_parallel_buffers
        for buf in buffers:
            (buf.offload_to_cpu if to_cpu else buf.reload_from_cpu)(move_params=True, move_grads=True)
            if buf.param_data is None:  # no distributed optimizer: the weights are plain tensors
                for p in buf.params:
                    p.data = p.data.to(target)
    if optimizer is not None:
        optimizer.offload_to_cpu() if to_cpu else optimizer.restore_from_cpu()
    if to_cpu and torch.cuda.is_available():
        torch.cuda.empty_cache()
