"""The torch.distributed group of SGLang's distributed weight update, for both of its ends.

SGLang's protocol (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``; docs/concepts/rollout.md): a trainer rank (group rank 0, the only
source of every broadcast) and every rollout server rank (``rank_offset + tp_rank``) join one
process group; per bucket the trainer announces ``names``, ``dtypes`` and ``shapes`` over HTTP
and broadcasts the tensors in that order, one broadcast per tensor.

The group is built outside the training world (its own ``TCPStore`` on ``master_address:
master_port``, hosted by rank 0, never the default process group), with the store keys SGLang's
own join uses (``PrefixStore(group_name)``, then torch's ``"<group_name>/"`` and ``"<device>/"``
prefixes) and the group's sequence number that torch's group creation exchanges, so either end
interoperates with the other's implementation (tests/weight_sync/test_sglang_interop.py runs
SGLang's own join against it). A gloo group makes the one context torch makes for a ``"gloo"``
group (``cpu/``); NCCL makes one (``cuda/``). Every wait (store, connection, broadcast) is
bounded by the group's timeout.

This module holds only what both ends share (field names and checks, dtype names, the group);
the trainer's sender is ``weight_sync.distributed``, the embedded server's receiver its engine.
It imports nothing of the trainer's side (no bridge, no megatron), so the server can use it.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ..common.protocol import ProtocolError, check_text, short

BACKENDS = ("gloo", "nccl")
DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default

# dtype names as SGLang reads them (``getattr(torch, name)``); "torch." prefixes are accepted.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The protocol's name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot be sent in a weight update (one of {list(DTYPES)})")
    return name


def parse_dtype(value: Any, where: str) -> torch.dtype:
    if not isinstance(value, str) or value.removeprefix("torch.") not in DTYPES:
        raise ProtocolError(f"{where} = {short(value)} is not a dtype name (one of {list(DTYPES)})")
    return DTYPES[value.removeprefix("torch.")]


def _int(body: dict, key: str, lo: int, hi: int) -> int:
    v = body.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(f"{key} must be an integer in [{lo}, {hi}], got {short(v)}")
    return v


def parse_group_name(body: dict) -> str:
    name = body.get("group_name", DEFAULT_GROUP_NAME)
    if not isinstance(name, str) or not name or len(name) > 128:
        raise ProtocolError(f"group_name must be a non-empty string of at most 128 characters, got {short(name)}")
    check_text(name, "group_name")
    return name


@dataclass(frozen=True)
class GroupSpec:
    """The body of ``/init_weights_update_group`` (SGLang's field names)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"

    @classmethod
    def from_json(cls, body: dict) -> "GroupSpec":
        addr = body.get("master_address")
        if not isinstance(addr, str) or not addr or len(addr) > 255 or any(c.isspace() for c in addr):
            raise ProtocolError(f"master_address must be a host name or IP address, got {short(addr)}")
        check_text(addr, "master_address")
        backend = body.get("backend", "nccl")
        if backend not in BACKENDS:
            raise ProtocolError(f"backend must be one of {list(BACKENDS)}, got {short(backend)}")
        world = _int(body, "world_size", 2, 1 << 16)
        return cls(
            master_address=addr,
            master_port=_int(body, "master_port", 1, 65535),
            rank_offset=_int(body, "rank_offset", 1, world - 1),  # rank 0 is the trainer
            world_size=world,
            group_name=parse_group_name(body),
            backend=backend,
        )

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class BucketSpec:
    """The body of ``/update_weights_from_distributed``: one bucket's tensors, in broadcast order."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str
    flush_cache: bool = True
    weight_version: str | None = None

    @classmethod
    def from_json(cls, body: dict, max_tensors: int = 1 << 16) -> "BucketSpec":
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        for key, v in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
            if not isinstance(v, list) or not v:
                raise ProtocolError(f"{key} must be a non-empty list (one entry per tensor)")
            if len(v) > max_tensors:
                raise ProtocolError(f"{key} has {len(v)} entries; at most {max_tensors} tensors per bucket")
        if not len(names) == len(dtypes) == len(shapes):
            raise ProtocolError(
                f"names, dtypes and shapes must have one entry per tensor, got {len(names)}, {len(dtypes)}, "
                f"{len(shapes)}"
            )
        if len(set(map(str, names))) != len(names):
            raise ProtocolError("names must not repeat within a bucket")
        for i, n in enumerate(names):
            if not isinstance(n, str) or not n:
                raise ProtocolError(f"names[{i}] = {short(n)} is not a tensor name")
            check_text(n, f"names[{i}]")
        out_shapes = []
        for i, s in enumerate(shapes):
            if not isinstance(s, list) or not all(type(d) is int and 0 <= d < (1 << 40) for d in s):
                raise ProtocolError(f"shapes[{i}] = {short(s)} is not a list of non-negative integers")
            out_shapes.append(tuple(s))
        flush = body.get("flush_cache", True)
        if not isinstance(flush, bool):
            raise ProtocolError("flush_cache must be a boolean")
        version = body.get("weight_version")
        if version is not None:
            if not isinstance(version, str):
                raise ProtocolError("weight_version must be a string")
            check_text(version, "weight_version")
        return cls(
            names=tuple(names),
            dtypes=tuple(parse_dtype(d, f"dtypes[{i}]") for i, d in enumerate(dtypes)),
            shapes=tuple(out_shapes),
            group_name=parse_group_name(body),
            flush_cache=flush,
            weight_version=version,
        )

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]], group_name: str, flush_cache: bool = True,
           weight_version: str | None = None) -> "BucketSpec":
        return cls(tuple(n for n, _ in named), tuple(t.dtype for _, t in named),
                   tuple(tuple(t.shape) for _, t in named), group_name, flush_cache, weight_version)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "names": list(self.names),
            "dtypes": [dtype_name(d) for d in self.dtypes],
            "shapes": [list(s) for s in self.shapes],
            "group_name": self.group_name,
            "flush_cache": self.flush_cache,
        }
        if self.weight_version is not None:
            body["weight_version"] = self.weight_version
        return body

    @property
    def nbytes(self) -> int:
        return sum(
            torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in zip(self.shapes, self.dtypes)
        )


class WeightGroupError(RuntimeError):
    """A weight-update group that could not be formed or whose broadcast failed (names the group)."""


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


class WeightGroup:
    """One member of a weight-update group: ``broadcast`` (rank 0 sends, others receive) and
    ``destroy``. The constructor returns once every member has joined, or raises
    ``WeightGroupError`` after ``join_timeout_s`` (default ``timeout_s``); ``timeout_s`` bounds
    each broadcast."""

    def __init__(self, spec: GroupSpec, rank: int, timeout_s: float, store: Any = None,
                 join_timeout_s: float | None = None):
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} is outside the group of {spec.world_size}")
        self.spec, self.rank, self.timeout = spec, rank, timedelta(seconds=timeout_s)
        join = timedelta(seconds=timeout_s if join_timeout_s is None else join_timeout_s)
        from torch.distributed import PrefixStore, TCPStore

        try:
            if store is None:
                store = TCPStore(spec.master_address, spec.master_port, spec.world_size, is_master=rank == 0,
                                 timeout=join, wait_for_workers=False)
            self._store = store  # rank 0 hosts it: keep it alive as long as the group
            base = PrefixStore(f"{spec.group_name}/", PrefixStore(spec.group_name, store))
            self.device = "cuda" if spec.backend == "nccl" else "cpu"
            if spec.backend == "gloo":
                from torch.distributed import ProcessGroupGloo

                # torch builds one gloo context for a "gloo" group, under its first device's prefix
                backend = ProcessGroupGloo(PrefixStore("cpu/", base), rank, spec.world_size, join)
            else:
                from torch.distributed import ProcessGroupNCCL

                opts = ProcessGroupNCCL.Options()
                opts.is_high_priority_stream = False
                opts._timeout = join
                backend = ProcessGroupNCCL(PrefixStore("cuda/", base), rank, spec.world_size, opts)
            # as torch's group creation does: rank 0 publishes the group's sequence number in the
            # store and the other ranks wait for it (SGLang's join does not finish without it)
            backend._set_sequence_number_for_group()
            self._backends = [backend]
        except Exception as exc:
            hint = "" if _is_loopback(spec.master_address) else (
                f" (can every member reach {spec.master_address}:{spec.master_port}?)")
            raise WeightGroupError(
                f"weight-update group {spec.group_name!r} (rank {rank} of {spec.world_size}, {spec.backend}) "
                f"could not be formed within {join.total_seconds():g} s: {type(exc).__name__}: {exc}{hint}"
            ) from None

    @property
    def port(self) -> int:
        return int(self._store.port)

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast each tensor from rank 0, in order (SGLang's one broadcast per tensor)."""
        from torch.distributed import BroadcastOptions

        pg = self._backends[0]
        works = []
        try:
            for t in tensors:
                if self.spec.backend == "gloo":
                    if t.is_cuda and self.rank == 0:
                        t = t.cpu()  # a CUDA trainer sending to CPU servers: the gloo group is on the CPU
                    if t.dtype == torch.float8_e4m3fn:
                        t = t.view(torch.uint8)  # gloo has no float8 type: the same bytes
                opts = BroadcastOptions()
                opts.rootRank, opts.rootTensor = 0, 0
                opts.timeout = self.timeout  # the group was formed with the join's bound
                works.append(pg.broadcast([t], opts))
            for w in works:
                w.wait(self.timeout)
        except Exception as exc:
            raise WeightGroupError(
                f"broadcast in weight-update group {self.spec.group_name!r} (rank {self.rank}) failed: "
                f"{type(exc).__name__}: {exc}"
            ) from None

    def destroy(self) -> None:
        for b in self._backends:
            shutdown = getattr(b, "shutdown", None) or getattr(b, "abort", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:  # already broken: nothing more to release
                    pass
        self._backends = []
        self._store = None
