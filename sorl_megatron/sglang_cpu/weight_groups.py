"""The server's side of distributed weight updates: the torch.distributed groups it has joined.

``/init_weights_update_group``, ``/update_weights_from_distributed`` and
``/destroy_weights_update_group`` run here on HTTP worker threads (they wait on the other
group members) while the scheduler keeps generating; a received bucket is applied by
``ServedModel.update_from_tensors`` on the scheduler thread, so the weights are untouched
until the whole bucket is here. The group itself is ``sorl_megatron/weight_sync/group.py``.

Joins run in a pool of their own, at most ``max_joins`` at once (one more is refused at once,
:class:`JoinsBusy`), each bounded by its join timeout: joins that hang (a master that never
comes) hold neither ``/generate`` nor a valid join behind them.

A broadcast carries no size: the receiver posts a buffer and gloo fills it with what the
sender sent. A received bucket is therefore checked against its announcement before it is
applied (:func:`received`): every buffer starts as NaN, with room beyond the announced size
(gloo only, ``RECEIVE_HEADROOM``); a tensor sent smaller leaves NaN in the announced part, a
larger one writes into the room beyond it. Either drops the group, keeps the weights and
answers 400. A tensor larger than the announcement plus the room aborts the process inside
gloo (an ``EnforceNotMet`` in its transport thread, which Python cannot catch): docs/security.md.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..weight_sync.group import BucketSpec, GroupSpec, WeightGroup
from .model import ServedModel
from .weights import WeightError, check_bucket

# Room beyond each received tensor's announced size, as a fraction of it (gloo): a sender that
# sends up to this much more is refused (400) instead of aborting the process.
RECEIVE_HEADROOM = 1.0


class JoinsBusy(RuntimeError):
    """``max_joins`` group joins are in flight: answered 503 at once."""

    status = 503


def _nan_mask(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:  # no isnan for float8: its NaN is every exponent and mantissa bit set
        return (t.view(torch.uint8) & 0x7F) == 0x7F
    return torch.isnan(t)


def receive_buffers(spec: BucketSpec, device: str, headroom: float) -> list[torch.Tensor]:
    """Flat NaN-filled buffers, each its announced size plus ``headroom`` of it."""
    out = []
    for shape, dtype in zip(spec.shapes, spec.dtypes):
        n = torch.Size(shape).numel()
        out.append(torch.full((n + int(n * headroom) + 1 if headroom else n,), float("nan"), dtype=dtype,
                              device=device))
    return out


def received(spec: BucketSpec, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The announced tensors from filled ``buffers``; ``WeightError`` naming the first tensor
    sent smaller (NaN left in its announced part: no weight is NaN), larger (a byte past it)
    or holding a non-finite value."""
    out = {}
    for name, shape, buf in zip(spec.names, spec.shapes, buffers):
        n = torch.Size(shape).numel()
        body, room = buf[:n], buf[n:]
        if room.numel() and not bool(_nan_mask(room).all()):
            raise WeightError(f"{name}: the broadcast tensor is larger than announced ({shape}); bucket refused")
        bad = _nan_mask(body) if body.dtype == torch.float8_e4m3fn else ~torch.isfinite(body)
        if bool(bad.any()):
            raise WeightError(f"{name}: the broadcast left {int(bad.sum())} of {n} announced values unset or "
                              "non-finite (a tensor smaller than announced, or NaN/inf weights); bucket refused")
        out[name] = body.view(shape)
    return out


class WeightGroups:
    """Weight-update groups by name; each has a lock so that its buckets arrive one at a time.
    ``max_joins`` bounds the joins in flight (their own pool)."""

    def __init__(self, served: ServedModel, max_joins: int = 4):
        self.served = served
        self._groups: dict[str, tuple[WeightGroup | None, threading.Lock]] = {}  # None: still forming
        self._lock = threading.Lock()
        self.max_joins = max_joins  # the HTTP front sets it (--max-weight-group-joins) before the first join
        self._joins = 0  # in flight
        self._join_pool: ThreadPoolExecutor | None = None  # made at the first join, max_joins threads

    def __len__(self) -> int:
        """Groups joined or forming."""
        with self._lock:
            return len(self._groups)

    @property
    def device(self) -> str:
        """Where this server holds its weights, so where it receives them (``/server_info``'s
        ``device``: the trainer picks the group's backend from it)."""
        return next(iter(self.served.state.values())).device.type

    def start_join(self, spec: GroupSpec, timeout_s: float, join_timeout_s: float) -> Future:
        """``join`` in the join pool; :class:`JoinsBusy` at once when ``max_joins`` are in flight."""
        with self._lock:
            if self._joins >= self.max_joins:
                raise JoinsBusy(f"{self._joins} weight-update group joins are in flight (--max-weight-group-joins "
                                f"{self.max_joins}); try again later")
            self._joins += 1
            if self._join_pool is None:
                self._join_pool = ThreadPoolExecutor(self.max_joins, thread_name_prefix="weight-group-join")
        fut = self._join_pool.submit(self.join, spec, timeout_s, join_timeout_s)
        fut.add_done_callback(self._join_done)
        return fut

    def _join_done(self, _: Future) -> None:
        with self._lock:
            self._joins -= 1

    def join(self, spec: GroupSpec, timeout_s: float, join_timeout_s: float | None = None) -> str:
        """Join ``spec`` as rank ``rank_offset``; returns once every member has (at most
        ``join_timeout_s``, default ``timeout_s``, which bounds each broadcast)."""
        with self._lock:
            if spec.group_name in self._groups:
                raise WeightError(f"group_name {spec.group_name!r} is already initialized (destroy it first)")
            if spec.backend == "nccl" and self.device != "cuda":
                raise WeightError(f"this server holds its weights on {self.device}, where NCCL cannot receive "
                                  "them: initialize the group with backend 'gloo'")
            self._groups[spec.group_name] = (None, threading.Lock())  # reserved while it forms
        try:
            group = WeightGroup(spec, spec.rank_offset, timeout_s, join_timeout_s=join_timeout_s)
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

        The bucket is checked against the served weights before anything is received, and what
        arrived against the announcement after (:func:`received`); a broadcast that fails, times
        out or disagrees with its announcement drops the group (the trainer must re-initialize
        it) and leaves the weights unchanged: the tensors are applied only by ``update_from_tensors``.
        """
        group, lock = self._get(spec.group_name)
        check_bucket(self.served.state, spec.names, spec.dtypes, spec.shapes, self.served.cfg.fp8_block_size)
        timeout = group.timeout.total_seconds()
        if not lock.acquire(timeout=timeout):
            raise WeightError(f"group {spec.group_name!r} is busy with another bucket for more than {timeout:g} s")
        try:
            # NCCL needs the sender's count exactly (a larger buffer would wait): no room there
            buffers = receive_buffers(spec, self.device, RECEIVE_HEADROOM if group.spec.backend == "gloo" else 0.0)
            try:
                group.broadcast(buffers)
                return received(spec, buffers)
            except Exception:
                self.destroy(spec.group_name)
                raise
        finally:
            lock.release()

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
        if self._join_pool is not None:
            self._join_pool.shutdown(wait=False, cancel_futures=True)
