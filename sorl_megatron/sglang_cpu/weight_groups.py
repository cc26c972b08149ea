"""The server's side of distributed weight updates: the torch.distributed groups it has joined.

``/init_weights_update_group``, ``/update_weights_from_distributed`` and
``/destroy_weights_update_group`` run here on HTTP worker threads (they wait on the other
group members) while the scheduler keeps generating; a received bucket is applied by
``ServedModel.update_from_tensors`` on the scheduler thread, so the weights are untouched
until the whole bucket is here. The group itself is ``sorl_megatron/weight_sync/group.py``.

Joins run on threads of their own, at most ``max_joins`` at once (one more is refused at once,
:class:`JoinsBusy`), each bounded as a whole by its join timeout: joins that hang (a master
that never comes) hold neither ``/generate`` nor a valid join behind them. torch's TCPStore
client bounds its connection by that timeout but not its first exchange with the master: a
master that accepts the connection and never answers held a join (and its slot) for a minute
or more. So a watchdog ends a join at its bound (:func:`_unblock`: the join's connections to
its master are shut down, which fails the exchange at once); a join that still does not return
is answered as failed, its slot freed, and its thread left behind is counted against
``max_joins`` stuck ones, beyond which joins are refused too.

A broadcast carries no size: the receiver posts a buffer and gloo fills it with what the
sender sent. A received bucket is therefore checked against its announcement before it is
applied (:func:`received`): every buffer starts as NaN, with room beyond the announced size
(gloo only, ``RECEIVE_HEADROOM``); a tensor sent smaller leaves NaN in the announced part, a
larger one writes into the room beyond it. Either drops the group, keeps the weights and
answers 400. A tensor larger than the announcement plus the room aborts the process inside
gloo (an ``EnforceNotMet`` in its transport thread, which Python cannot catch): docs/security.md.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, InvalidStateError

import torch

from ..weight_sync.group import BucketSpec, GroupSpec, WeightGroup
from .model import ServedModel
from .weights import WeightError, check_bucket

log = logging.getLogger(__name__)

# Room beyond each received tensor's announced size, as a fraction of it (gloo): a sender that
# sends up to this much more is refused (400) instead of aborting the process.
RECEIVE_HEADROOM = 1.0
UNBLOCK_GRACE_S = 2.0  # after its bound, how long a join's shut-down connections get to fail it


def _sockets_to(address: str, port: int) -> list[int]:
    """This process's TCP sockets connected to ``address:port`` (Linux ``/proc``; [] elsewhere)."""
    try:
        ips = {ipaddress.ip_address(a[4][0]) for a in socket.getaddrinfo(address, port, proto=socket.IPPROTO_TCP)}
    except (OSError, ValueError):
        return []
    inodes = set()
    for table, width in (("/proc/self/net/tcp", 4), ("/proc/self/net/tcp6", 16)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            ip_hex, port_hex = fields[2].rsplit(":", 1)
            if int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(ip_hex)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(raw[:width])
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            if ip in ips:
                inodes.add(fields[9])
    out = []
    for fd in os.listdir("/proc/self/fd") if inodes else []:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            out.append(int(fd))
    return out


def _unblock(address: str, port: int) -> int:
    """Shut down this process's connections to a group's master (a join blocked in a read on one
    fails at once); returns how many."""
    count = 0
    for fd in _sockets_to(address, port):
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
    return count


class WeightGroupJoinTimeout(WeightError):
    """A join that did not return within its bound (answered 400, as a join that failed)."""


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
        self._stuck = 0  # joins answered at their bound whose thread has not returned yet
        self._joining: dict[threading.Thread, GroupSpec] = {}  # join threads alive, and whom they join

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
        """``join`` on a thread of its own, answered (the future) within ``join_timeout_s`` plus
        :data:`UNBLOCK_GRACE_S` whatever the master does; :class:`JoinsBusy` at once when
        ``max_joins`` are in flight, or as many are stuck."""
        with self._lock:
            if self._joins >= self.max_joins or self._stuck >= self.max_joins:
                what = (f"{self._joins} weight-update group joins are in flight" if self._joins >= self.max_joins
                        else f"{self._stuck} weight-update group joins never returned from their master")
                raise JoinsBusy(f"{what} (--max-weight-group-joins {self.max_joins}); try again later")
            self._joins += 1
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        fut.add_done_callback(self._join_done)
        stuck = threading.Event()  # set by the watchdog: this join's thread counts as stuck

        def run() -> None:
            try:
                result = self.join(spec, timeout_s, join_timeout_s)
            except BaseException as err:  # handed to the HTTP call
                try:
                    fut.set_exception(err)
                except InvalidStateError:  # answered at its bound already
                    pass
            else:
                try:
                    fut.set_result(result)
                except InvalidStateError:  # answered as failed at its bound (join() left the late group)
                    pass
            finally:
                with self._lock:
                    self._joining.pop(thread, None)
                    if stuck.is_set():
                        self._stuck -= 1

        # not a daemon: a thread inside torch's C++ when the interpreter exits aborts the process
        # (every join ends: at its bound, unblocked by the watchdog, or by destroy_all)
        thread = threading.Thread(target=run, name=f"weight-group-join-{spec.group_name}", daemon=False)
        with self._lock:
            self._joining[thread] = spec
        thread.start()
        threading.Thread(target=self._watch, args=(fut, thread, stuck, spec, join_timeout_s), daemon=True,
                         name=f"weight-group-watch-{spec.group_name}").start()
        return fut

    def _watch(self, fut: Future, thread: threading.Thread, stuck: threading.Event, spec: GroupSpec,
               join_timeout_s: float) -> None:
        """At the join's bound: unblock it (its connections to the master shut down), and if it
        still has not returned, answer it as failed, free its slot and count its thread stuck."""
        thread.join(join_timeout_s)
        deadline = time.monotonic() + UNBLOCK_GRACE_S
        while thread.is_alive() and time.monotonic() < deadline:
            _unblock(spec.master_address, spec.master_port)
            thread.join(0.2)
        if not thread.is_alive():
            return
        with self._lock:
            if not thread.is_alive():
                return
            stuck.set()
            self._stuck += 1
            if self._groups.get(spec.group_name, (True, None))[0] is None:
                self._groups.pop(spec.group_name, None)  # its reservation: the name may be joined again
        log.warning("weight-update group %r: the join did not return within %g s (the master %s:%s accepted the "
                    "connection but never answered); answered as failed", spec.group_name, join_timeout_s,
                    spec.master_address, spec.master_port)
        try:
            fut.set_exception(WeightGroupJoinTimeout(
                f"weight-update group {spec.group_name!r} (rank {spec.rank_offset} of {spec.world_size}, "
                f"{spec.backend}) could not be formed within {join_timeout_s:g} s: the master "
                f"{spec.master_address}:{spec.master_port} accepted the connection but never answered"))
        except InvalidStateError:
            pass

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
            reservation = self._groups[spec.group_name] = (None, threading.Lock())  # reserved while it forms
        try:
            group = WeightGroup(spec, spec.rank_offset, timeout_s, join_timeout_s=join_timeout_s)
        except BaseException:
            with self._lock:
                if self._groups.get(spec.group_name) is reservation:
                    self._groups.pop(spec.group_name)
            raise
        with self._lock:
            late = self._groups.get(spec.group_name) is not reservation  # the watchdog gave the name up
            if not late:
                self._groups[spec.group_name] = (group, reservation[1])
        if late:  # answered as failed at its bound: nobody will use this group
            group.destroy()
            raise WeightGroupJoinTimeout(f"weight-update group {spec.group_name!r} formed after its join's bound")
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
        """Leave every joined group and end the joins in flight (the engine stops)."""
        with self._lock:
            groups = [g for g, _ in self._groups.values() if g is not None]
            self._groups.clear()
            joining = list(self._joining.values())
        for spec in joining:
            _unblock(spec.master_address, spec.master_port)
        for g in groups:
            g.destroy()
