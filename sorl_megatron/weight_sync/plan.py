"""A distributed weight sync at full size without its memory: who sends what, in which buckets.

:func:`plan_sync` builds the real Megatron model of one pipeline stage at a time (mbridge's
``get_model`` through ``bridge.build``, the layout's real layer counts and shard shapes) on
torch's ``meta`` device, in a process that plays one rank of the layout's world under torch's
``fake`` process-group backend (megatron's own ``initialize_model_parallel`` forms every group;
no collective moves data). It then runs the transport's own code on every rank that may send:
``export.weight_sync_roles`` and ``export.iter_owned_hf_weights`` (with :class:`ShapeMoves` for
its collectives: same shapes, no data), the FP8 packing (``base.fp8_pairs``) when the servers
take block-FP8 weights, and ``common.buckets.buckets`` at the recipe's bucket size. The result,
per sending rank, is the exact stream of ``(HF name, shape, dtype)`` it sends per sync, in order,
with its bucket boundaries (:class:`SyncPlan`).

What the plan rests on, beyond the code it runs:

- the ranks of one pipeline stage build the same chunk (megatron gives every tensor-, data- and
  expert-parallel rank of a stage the same layers and shard shapes), so the chunk is built once
  per stage, at the stage's first rank, and every other rank of the stage exports that chunk with
  megatron's groups and mbridge's parallel state re-formed at its own rank (which is all the
  export reads of the rank: its roles, its expert offset, its gather sizes);
- the candidates: a stage's first rank (tensor- and data-parallel rank 0: the stage's sender)
  and the members of its expert-parallel group (the expert owners, which hand their experts to
  the sender: they send nothing to the servers); a rank outside them sends nothing
  (``weight_sync_roles``);
- the layer spec is the one this machine builds: the local spec without TransformerEngine. Its
  parameter names and shapes are TE's (``bridge.local_spec``); the order of a fused norm's weight
  against its linear's weight within one module may differ from TE's.

tests/weight_sync/test_sync_plan.py checks the plan against the real export of a small model at
several layouts, run with real processes and gloo.

Run it in a process of its own (it refuses a process that has a real process group):
``python -m sorl_megatron.weight_sync.plan CONFIG_JSON --layout tp=8,pp=4,ep=32,etp=1 --world 256``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from ..common.buckets import buckets
from ..common.cli_range import count

WEIGHT_FORMATS = ("bf16", "block_fp8")


@dataclass(frozen=True)
class Entry:
    """One tensor a rank sends: its HF name, shape and dtype (``torch`` name without the prefix)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


@dataclass
class SenderPlan:
    """What one sending rank sends per sync: ``entries`` in order, cut into buckets that end
    before the indices in ``bucket_ends`` (the last is ``len(entries)``)."""

    rank: int
    stage: int  # its pipeline rank
    roles: tuple[bool, bool]  # export.weight_sync_roles at this rank: (dense, expert)
    entries: list[Entry] = field(default_factory=list)
    bucket_ends: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def buckets(self) -> list[list[Entry]]:
        starts = [0, *self.bucket_ends[:-1]]
        return [self.entries[a:b] for a, b in zip(starts, self.bucket_ends)]


@dataclass
class SyncPlan:
    """The senders of one layout's distributed sync; each forms one weight-update group with
    every server rank (``distributed.DistributedSender``)."""

    model_type: str
    layout: str  # ParallelLayout.describe()
    world_size: int
    weight_format: str
    bucket_bytes: int
    senders: list[SenderPlan]

    @property
    def groups(self) -> int:
        return len(self.senders)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.senders)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for s in out["senders"]:
            s["entries"] = [[e["name"], list(e["shape"]), e["dtype"]] for e in s["entries"]]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SyncPlan":
        senders = [SenderPlan(rank=s["rank"], stage=s["stage"], roles=tuple(s["roles"]),
                              entries=[Entry(n, tuple(shape), d) for n, shape, d in s["entries"]],
                              bucket_ends=list(s["bucket_ends"])) for s in data["senders"]]
        return cls(**{**data, "senders": senders})


class ShapeMoves:
    """The export's moves on meta tensors: a gather over ``n`` ranks gives ``n`` tensors of the
    local shard's shape (what every rank of a tensor-parallel group holds); a hand-over from an
    expert owner arrives in the buffer the receiver made (the owners of a stage hold the same
    shapes); a send goes nowhere."""

    @staticmethod
    def all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
        import torch.distributed as dist

        return [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]

    @staticmethod
    def send(tensor: torch.Tensor, dst: int, group=None) -> None:
        pass

    @staticmethod
    def recv(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
        return tensor

    @staticmethod
    def group_ranks(group=None) -> list[int]:
        import torch.distributed as dist

        return list(dist.get_process_group_ranks(group))


def plan_sync(hf_config, layout, world_size: int, weight_format: str = "bf16",
              bucket_bytes: int = 512 * 1024**2, dtype: torch.dtype = torch.bfloat16) -> SyncPlan:
    """The plan of a distributed sync of ``hf_config`` (a ``PretrainedConfig``) at ``layout``
    (a ``bridge.layout.ParallelLayout``) on ``world_size`` ranks, the model in ``dtype`` and the
    servers taking ``weight_format`` (``bf16``: the model's tensors; ``block_fp8``: the
    quantizer's pairs). Leaves no process group behind."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("plan_sync plays every rank of the layout itself: run it in a process without a "
                           "process group (python -m sorl_megatron.weight_sync.plan)")
    try:
        stages = _stage_roots(layout, world_size)
        senders = []
        for stage, root in enumerate(stages):
            _play_rank(layout, world_size, root)
            model = _build_on_meta(hf_config, layout, dtype)
            for rank in _candidates(root):
                _play_rank(layout, world_size, rank)
                plan = _export_plan(model, rank, stage, weight_format, bucket_bytes)
                if plan is not None:
                    senders.append(plan)
            del model
    finally:
        _leave()
    return SyncPlan(hf_config.model_type, layout.describe(), world_size, weight_format, bucket_bytes, senders)


def _play_rank(layout, world_size: int, rank: int) -> None:
    """Megatron's groups as ``rank`` of ``world_size`` sees them, under the fake backend."""
    import torch.distributed as dist

    from ..bridge.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    from megatron.core import parallel_state as mpu

    _leave()
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        create_gloo_process_groups=False,  # a gloo group would need real peers
    )
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)  # the RNG trackers the layers fork while they are built


def _leave() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _stage_roots(layout, world_size: int) -> list[int]:
    """The first rank of each pipeline stage (rank 0's pipeline group, in stage order)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    _play_rank(layout, world_size, 0)
    return list(dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group()))


def _candidates(root: int) -> list[int]:
    """The ranks of a stage that may send, with megatron's groups formed at its first rank: that
    rank and its expert-parallel group (in expert-parallel rank order)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    group = mpu.get_expert_model_parallel_group()
    ranks = list(dist.get_process_group_ranks(group)) if group is not None else []
    return [root, *(r for r in ranks if r != root)]


class _OnMeta(TorchFunctionMode):
    """Every tensor a factory makes goes to the meta device, a device named or not (megatron and
    the local layer spec name the CPU when ``use_cpu_initialization`` is set)."""

    FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.arange,
                 torch.eye, torch.tensor}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self.FACTORIES:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def _build_on_meta(hf_config, layout, dtype: torch.dtype):
    from ..bridge.build import build_model
    from ..bridge.model import ModelOptions

    # initialized as a run initializes (megatron marks a tensor-parallel weight while it initializes
    # it: the export gathers what is marked); on meta that costs nothing
    options = ModelOptions(dtype=dtype, use_te=False)
    with _OnMeta():
        model = build_model(hf_config, layout, options, load_weights=False)
    held = [n for c in model.unwrapped() for n, t in [*c.named_parameters(), *c.named_buffers()]
            if t.device.type != "meta"]
    if held:
        raise RuntimeError(f"the plan's model holds memory for {len(held)} tensors (first: {held[0]})")
    return model


def _export_plan(model, rank: int, stage: int, weight_format: str, bucket_bytes: int) -> Optional[SenderPlan]:
    """What ``rank`` sends (None: nothing), with megatron's groups formed at ``rank``."""
    from mbridge.core.parallel_states import ParallelStates

    from .base import fp8_pairs
    from .export import iter_owned_hf_weights, weight_sync_roles

    roles = weight_sync_roles()
    model.bridge.mpu = ParallelStates.get_parallel_state()  # the rank's expert offset and gather sizes
    export = iter_owned_hf_weights(model, moves=ShapeMoves)
    named = fp8_pairs(export) if weight_format == "block_fp8" else export
    plan = SenderPlan(rank, stage, roles)
    for bucket, _ in buckets(named, bucket_bytes):
        plan.entries += [Entry(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in bucket]
        plan.bucket_ends.append(len(plan.entries))
    return plan if plan.entries else None


def config_from_json(path: str):
    """An HF ``PretrainedConfig`` from a ``config.json`` file (recipes/gpu/model_configs/) or a
    model directory, with the fields mbridge expects (``bridge.hf_config.load_hf_config``)."""
    import os

    from transformers import AutoConfig

    from ..bridge.hf_config import load_hf_config

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(file) as f:
        data = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    return load_hf_config(AutoConfig.for_model(**data))


def main(argv: Optional[list[str]] = None) -> None:
    from ..bridge.layout import ParallelLayout

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="?", help="an HF config.json (or a model directory)")
    ap.add_argument("--layout", default="", help="tp=..,pp=..,ep=..,etp=..,first_stage_layers=..")
    ap.add_argument("--world", type=count(1, 1 << 20))
    ap.add_argument("--format", default="bf16", choices=WEIGHT_FORMATS)
    ap.add_argument("--bucket-mb", type=count(1, 1 << 20), default=512)
    ap.add_argument("--jobs", help="a JSON list of {config, layout, world, format, bucket_mb or bucket_bytes} "
                                   "to plan instead")
    ap.add_argument("--json", help="write the plan (with --jobs: the list of plans) here")
    args = ap.parse_args(argv)
    if args.jobs:
        with open(args.jobs) as f:
            jobs = json.load(f)
    elif args.config and args.world:
        jobs = [{"config": args.config, "layout": args.layout, "world": args.world, "format": args.format,
                 "bucket_mb": args.bucket_mb}]
    else:
        ap.error("give CONFIG and --world, or --jobs")
    plans = [plan_sync(config_from_json(j["config"]), ParallelLayout.from_string(j["layout"]), int(j["world"]),
                       j.get("format", "bf16"), int(j.get("bucket_bytes") or j.get("bucket_mb", 512) * 1024**2))
             for j in jobs]
    if args.json:
        with open(args.json, "w") as f:
            json.dump([p.to_json() for p in plans] if args.jobs else plans[0].to_json(), f)
    for p in plans:
        print(summary(p))


def summary(plan: SyncPlan) -> str:
    gib = 1024**3
    lines = [f"{plan.model_type} at {plan.layout} on {plan.world_size} ranks, {plan.weight_format}, "
             f"buckets of {plan.bucket_bytes / 1024**2:g} MiB: {plan.groups} weight-update groups, "
             f"{plan.nbytes / gib:.2f} GiB per sync"]
    for s in plan.senders:
        lines.append(f"  rank {s.rank} (stage {s.stage}, roles {s.roles}): {len(s.entries)} tensors, "
                     f"{len(s.bucket_ends)} buckets, {s.nbytes / gib:.3f} GiB")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
