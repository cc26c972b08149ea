"""The one interface of a weight sync, and what its transports share.

A transport (``distributed``, ``tensor``, ``disk``; chosen once by ``factory``) pushes the
trainer's model to the rollout servers: ``sync(model, targets, version)`` after each step, on
every rank (the export's gathers need them all), ``close()`` at the end of the run. The targets
are passed on every call, never kept from an earlier one: a server that was restarted comes
back on a new URL.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional, Protocol

import torch

from ..common import aio
from ..common.fp8 import quantize_hf_tensor
from ..common.http import RequestRejectedError, RetryPolicy
from ..rollout.client import FailureHook, RolloutClient, RolloutClientConfig
from ..rollout.server_facts import WeightFormat, served_weight_format

log = logging.getLogger("sorl_megatron.weight_sync")


class TransportSettings(Protocol):
    """``rollout.weight_sync``: the transport and its settings."""

    transport: str  # the transport's name: read by the factory only
    timeout_s: float
    init_timeout_s: float
    bucket_mb: int
    master_address: Optional[str]


class FlushSettings(Protocol):
    """``rollout.async``: how long a sync's ``/flush_cache`` may wait for busy servers."""

    flush_idle_timeout_s: float


class SyncSettings(Protocol):
    """The ``rollout.*`` settings the transports read (the recipe's rollout section has them)."""

    weight_sync: TransportSettings
    precision: str
    urls: list[str]  # external servers (none: the trainer's embedded ones)
    retries: int
    health_timeout_s: float
    async_: FlushSettings  # rollout.async: requests run during a sync only in that mode


@dataclass(frozen=True)
class SyncTargets:
    """Where one sync goes, as the trainer knows it now (rank 0; other ranks pass none).

    ``on_failure``: the fleet's hook for a server that failed a control call (a dead one is
    dropped and the sync stands on the others); the tensor and disk transports send through it.
    The distributed transport cannot leave a member out of a broadcast: it fails the sync.
    ``generations``: per URL, the fleet's count of that server's failures (a server back on the
    same URL is a new process, with no weight-update group; the distributed sender forms its
    group again when they change).
    """

    urls: tuple[str, ...] = ()
    api_key: Optional[str] = None
    on_failure: Optional[FailureHook] = None
    generations: tuple[int, ...] = ()


@dataclass(frozen=True)
class SyncStats:
    """What one sync did on this rank: ``bytes_sent``, the tensor bytes it put on the wire
    (distributed: its own broadcasts; tensor: rank 0's bodies before encoding; disk: 0)."""

    bytes_sent: int = 0


class WeightSync(ABC):
    """One per run and rank: ``sync`` after each step (every rank calls it), ``close`` at the end."""

    # it joins an NCCL weight-update group with the servers (the memory plan counts its communicator)
    update_group: ClassVar[bool] = False
    # it posts bodies only this project's embedded server reads (a run refuses any other server)
    embedded_servers_only: ClassVar[bool] = False

    def __init__(self, settings: SyncSettings, run_dir: str | Path):
        self.settings = settings
        self.run_dir = Path(run_dir)

    @abstractmethod
    def sync(self, model, targets: SyncTargets, version: str) -> SyncStats:
        """Push ``model`` (a MegatronModel) to ``targets`` labelled weight version ``version``;
        raises when the servers did not all get it."""

    def close(self) -> None:
        """Release what the transport holds between syncs (nothing, unless it says otherwise)."""




def control_client(settings: SyncSettings, urls: Iterable[str], api_key: Optional[str],
                   on_failure: Optional[FailureHook] = None) -> RolloutClient:
    """A client for the sync's control calls: each bounded by ``rollout.weight_sync.timeout_s``,
    the close of a failed sync by ``rollout.health_timeout_s``."""
    s = settings
    return RolloutClient(RolloutClientConfig(
        urls=tuple(urls), control_retry=RetryPolicy(timeout_s=s.weight_sync.timeout_s, retries=s.retries),
        health_retry=RetryPolicy(timeout_s=s.health_timeout_s, retries=s.retries), api_key=api_key),
        on_failure=on_failure)


def fp8_pairs(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The block-FP8 packing an FP8 server reads: each linear weight as its ``(weight,
    weight_scale_inv)`` pair (``common.fp8.quantize_hf_tensor``), other tensors unchanged."""
    return (pair for name, t in named for pair in quantize_hf_tensor(name, t))


def external_fp8(settings: SyncSettings) -> bool:
    """Whether the tensor and disk transports send FP8: external servers with ``rollout.precision:
    fp8`` get the quantizer's pairs; the embedded ones quantize what they receive themselves."""
    return settings.precision == "fp8" and bool(settings.urls)


async def weight_format(client: RolloutClient, settings: SyncSettings) -> WeightFormat:
    """What every server takes (``rollout.server_facts.served_weight_format``: block-FP8 pairs
    only into a server started from an FP8-serialized checkpoint), the same for all; a server
    that agrees with neither ``rollout.precision`` nor anything a sync sends is refused, with the
    command that makes the right checkpoint."""
    facts = await client.server_facts()
    formats = {served_weight_format(f, settings.precision, "<model.path>") for f in facts.values()}
    if len(formats) > 1:
        raise RuntimeError(f"the rollout servers take different weight formats {sorted(formats)}: "
                           "start them all from one checkpoint with the same flags")
    return formats.pop()


async def flush_after_sync(client: RolloutClient, wait_idle_s: float) -> bool:
    """``/flush_cache`` once the servers hold the new weights (their prefix caches hold KV of the
    old ones); True when every server flushed at once. SGLang refuses a flush (400) while
    requests run, as in async mode with ``rollout.async.pause_mode`` in_place or off: the flush
    is then left to a background call that each server holds until it is idle, at most ``wait_idle_s``
    (``rollout.async.flush_idle_timeout_s``; SGLang's own deferral), so the trainer never waits on
    requests it cannot end; its outcome is logged."""
    try:
        await client.flush_cache()
        return True
    except RequestRejectedError as err:
        if err.status != 400:
            raise
        log.info("the rollout servers are busy: the cache flush waits for them to be idle (%s)", err)
    if wait_idle_s > 0:
        threading.Thread(target=_flush_when_idle, args=(client.cfg, wait_idle_s), daemon=True,
                         name="flush-when-idle").start()
    return False


def _flush_when_idle(cfg: RolloutClientConfig, wait_idle_s: float) -> None:
    async def go() -> None:
        async with RolloutClient(cfg) as client:
            await client.flush_cache(wait_idle_s=wait_idle_s)

    try:
        aio.run(go())
        log.info("the rollout servers' caches were flushed once idle")
    except Exception as err:  # a background call: its failure is reported, the run goes on
        log.warning("prefix cache not flushed after the weight sync (the servers were not idle within "
                    "rollout.async.flush_idle_timeout_s = %g s; the next sync flushes again): %s", wait_idle_s, err)
