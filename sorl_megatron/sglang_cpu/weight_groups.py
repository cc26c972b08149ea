"""The server's side of distributed weight updates: the torch.distributed groups it has joined.

``/init_weights_update_group``, ``/update_weights_from_distributed`` and
``/destroy_weights_update_group`` run here on HTTP worker threads (they wait on the other
group members) while the scheduler keeps generating; a received bucket is applied by
``ServedModel.update_from_tensors`` on the scheduler thread, so the weights are untouched
until the whole bucket is here. The group itself is ``sorl_megatron/weight_sync/group.py``.
"""

from __future__ import annotations

import threading

import torch

from ..weight_sync.group import BucketSpec, GroupSpec, WeightGroup
from .model import ServedModel
from .weights import WeightError, check_bucket


class WeightGroups:
    """Weight-update groups by name; each has a lock so that its buckets arrive one at a time."""

    def __init__(self, served: ServedModel):
        self.served = served
        self._groups: dict[str, tuple[WeightGroup | None, threading.Lock]] = {}  # None: still forming
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Groups joined or forming."""
        with self._lock:
            return len(self._groups)

    @property
    def device(self) -> str:
        """Where this server holds its weights, so where it receives them (``/server_info``'s
        ``device``: the trainer picks the group's backend from it)."""
        return next(iter(self.served.state.values())).device.type

    def join(self, spec: GroupSpec, timeout_s: float) -> str:
        """Join ``spec`` as rank ``rank_offset``; returns once every member has."""
        with self._lock:
            if spec.group_name in self._groups:
                raise WeightError(f"group_name {spec.group_name!r} is already initialized (destroy it first)")
            if spec.backend == "nccl" and self.device != "cuda":
                raise WeightError(f"this server holds its weights on {self.device}, where NCCL cannot receive "
                                  "them: initialize the group with backend 'gloo'")
            self._groups[spec.group_name] = (None, threading.Lock())  # reserved while it forms
        try:
            group = WeightGroup(spec, spec.rank_offset, timeout_s)
        except BaseException:
            with self._lock:
                self._groups.pop(spec.group_name, None)
            raise
        with self._lock:
            self._groups[spec.group_name] = (group, self._groups[spec.group_name][1])
        return f"joined weight-update group {spec.group_name!r} as rank {spec.rank_offset} of {spec.world_size}"

    def _get(self, name: str) -> tuple[WeightGroup, threading.Lock]:
        with self._lock:
            entry = self._groups.get(name)
        if entry is None or entry[0] is None:
            known = sorted(k for k, v in self._groups.items() if v[0] is not None)
            raise WeightError(
                f"group_name {name!r} is not initialized (call /init_weights_update_group first; "
                f"initialized: {known})"
            )
        return entry  # type: ignore[return-value]

    def receive_bucket(self, spec: BucketSpec) -> dict[str, torch.Tensor]:
        """Receive one announced bucket from its group's rank 0.

        The bucket is checked against the served weights before anything is received; a
        broadcast that fails or times out drops the group (the trainer must re-initialize it)
        and leaves the weights unchanged: the tensors are applied only by ``update_from_tensors``.
        """
        group, lock = self._get(spec.group_name)
        check_bucket(self.served.state, spec.names, spec.dtypes, spec.shapes, self.served.cfg.fp8_block_size)
        timeout = group.timeout.total_seconds()
        if not lock.acquire(timeout=timeout):
            raise WeightError(f"group {spec.group_name!r} is busy with another bucket for more than {timeout:g} s")
        try:
            tensors = [torch.empty(s, dtype=d, device=self.device) for s, d in zip(spec.shapes, spec.dtypes)]
            try:
                group.broadcast(tensors)
            except Exception:
                self.destroy(spec.group_name)
                raise
        finally:
            lock.release()
        return dict(zip(spec.names, tensors))

    def destroy(self, name: str) -> str:
        group, _ = self._get(name)
        with self._lock:
            self._groups.pop(name, None)
        group.destroy()
        return f"destroyed weight-update group {name!r}"

    def destroy_all(self) -> None:
        """Leave every joined group (the engine stops)."""
        with self._lock:
            groups = [g for g, _ in self._groups.values() if g is not None]
            self._groups.clear()
        for g in groups:
            g.destroy()
