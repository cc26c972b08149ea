"""The distributed transport (``rollout.weight_sync.transport: distributed``): SGLang's own update, a
torch.distributed broadcast from the trainer's sending ranks to every server rank: NCCL when
the trainer and every server hold CUDA tensors, gloo otherwise (:func:`group_backend`; a
server's device comes from its ``/server_info``).

Every rank exports its own part of the model (``export.iter_owned_hf_weights``: tensor-parallel
gathers, and each expert owner's experts handed to its stage's sender over the expert-parallel
group); each pipeline stage's sender (``export.weight_sync_roles``) broadcasts its stage bucket by
bucket to every server, so a sync has one weight-update group per stage. Rank 0 opens the sync
(``/begin_weight_update`` where the servers have weight-update sessions, SGLang >= 0.5.21) and
closes it with the version (``/update_weight_version``, ``/end_weight_update``, ``/flush_cache``
once idle). Servers started from an FP8-serialized checkpoint get the quantizer's block-FP8
pairs (``base.weight_format`` refuses a server that quantizes online). A
failure on any rank fails the sync on every rank, after every rank has finished its export (so
no gather is left waiting).

Each stage's sender (:class:`DistributedSender`) owns one group, ``<prefix>_r<rank>``: itself as
rank 0 plus every server rank (``rank_offset`` = 1 + the ranks of the servers before it, a
server holding its ``tp_size`` ranks). Per bucket (at most ``bucket_bytes``, a larger tensor
alone) it posts ``/update_weights_from_distributed`` (names, dtypes, shapes) to every server
and broadcasts the tensors meanwhile, so no rank ever holds more than its own shard plus one
bucket. The group is formed with the servers of the sync that first needs it and formed again
when they change (a restarted server comes back on a new URL).

Buckets of different senders never overlap: a sender holds ``lock`` (turns shared by the senders,
first come first served: ``turns.StoreMutex``) only while one bucket is on the wire, never during
a gather of the export, so a server is never asked to take part in two broadcasts at once (which a
real SGLang server, handling weight updates one at a time, could not) and no gather waits on it. On
GPU a gather returns before it has run (NCCL queues it on the stream, and the broadcast is
queued behind it): a sender therefore waits for its stream (``settle``) before it takes the
lock, else it could hold the lock while its broadcast waits on a gather that a tensor-parallel
peer, itself waiting for the lock, has not issued yet.
Every server must take in the whole model whichever rank sends it, so its inbound link
bounds the sync; senders in parallel would not make it faster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import torch

from ..common import aio, comm
from ..common.buckets import buckets
from ..common.http import RequestRejectedError, RetryPolicy, ServerError, request
from ..rollout.client import RolloutClient
from ..rollout.server_facts import WeightFormat
from .base import (
    SyncSettings,
    SyncStats,
    SyncTargets,
    WeightSync,
    control_client,
    flush_after_sync,
    fp8_pairs,
    weight_format,
)
from .export import check_stage_senders, iter_owned_hf_weights, weight_sync_roles
from .group import BucketSpec, GroupSpec, WeightGroup, WeightGroupError
from .turns import StoreMutex

log = logging.getLogger("sorl_megatron.weight_sync.distributed")


def address_towards(url: str) -> str:
    """This host's address on the route to ``url``'s host (no packet is sent)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def server_device(info: dict) -> str:
    """Where a server holds its weights, from its ``/server_info``: the embedded server says
    (``device``), as does SGLang's (its ``--device``); a server that does not is real SGLang on
    a GPU."""
    device = info.get("device") if isinstance(info, dict) else None
    return device if isinstance(device, str) and device else "cuda"


def group_backend(trainer_cuda: bool, server_devices: Iterable[str]) -> str:
    """NCCL when every end of the group holds CUDA tensors (the trainer and each server), gloo
    otherwise: NCCL moves CUDA memory only, and a CPU server in an NCCL group cannot receive."""
    devices = list(server_devices)
    return "nccl" if trainer_cuda and devices and all(d == "cuda" for d in devices) else "gloo"


class DistributedSender:
    """One sending rank's group with every server: ``send`` per sync (it forms the group when
    there is none, or when the servers are not the ones it was formed with), ``close``.

    ``init_timeout_s`` bounds the group's formation and each broadcast; ``client``'s control
    policy bounds each HTTP call, which is never retried (a bucket must be received once).
    ``master_address``: where the servers reach this rank (default: this host's address on the
    route to the first server).
    """

    def __init__(self, client: RolloutClient, group_name: str, init_timeout_s: float, backend: str | None = None,
                 master_address: str | None = None):
        self.group_name = group_name
        self.timeout_s = init_timeout_s
        self.backend = backend  # None: chosen per group from both ends' devices (group_backend)
        self.master_address = master_address
        self.group: WeightGroup | None = None
        self.group_urls: tuple[str, ...] = ()  # the servers the group was formed with
        self.generations: tuple[int, ...] = ()  # of the servers to send to (SyncTargets.generations)
        self.group_generations: tuple[int, ...] = ()  # ... and of those the group was formed with
        self.bytes_sent = 0
        self.bind(client)

    def bind(self, client: RolloutClient) -> None:
        """Talk HTTP through ``client`` from now on (a client lives in one event loop; the group
        outlives it, from one sync to the next)."""
        self.client = client
        p = client.cfg.control_retry
        self._once = RetryPolicy(timeout_s=p.timeout_s, retries=0, connect_timeout_s=p.connect_timeout_s)

    async def _post_all(self, path: str, body: dict, policy: RetryPolicy | None = None,
                        urls: tuple[str, ...] | None = None) -> None:
        """POST to every server (``urls``: these) at once, never retried; an answer with success
        false is an error."""
        sess, urls = self.client.session(), urls or self.client.cfg.urls

        async def one(url: str):
            out = await request(sess, "POST", f"{url}{path}", body, policy or self._once)
            if isinstance(out, dict) and out.get("success") is False:
                raise RequestRejectedError(f"POST {url}{path}: {out.get('message')}", 400)

        results = await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            kind = RequestRejectedError if any(isinstance(e, RequestRejectedError) for e in errors) else ServerError
            msg = f"{path} failed on {len(errors)}/{len(urls)} rollout server(s): " + "; ".join(map(str, errors))
            raise (kind(msg, 400) if kind is RequestRejectedError else kind(msg))

    async def connect(self) -> None:
        """Form the group: ask each server's ranks, post ``/init_weights_update_group`` to all,
        and join as rank 0 meanwhile; bounded by ``init_timeout_s``."""
        from torch.distributed import TCPStore

        sess, urls = self.client.session(), self.client.cfg.urls
        infos = await asyncio.gather(*(  # SGLang's /server_info (every release server_facts accepts): tp_size, device
            request(sess, "GET", f"{u}/server_info", None, self.client.cfg.control_retry) for u in urls))
        offsets, size = [], 1
        for u, info in zip(urls, infos):
            offsets.append(size)
            size += int(info.get("tp_size") or 1)
        backend = self.backend or group_backend(torch.cuda.is_available(), [server_device(i) for i in infos])
        address = self.master_address or address_towards(urls[0])
        store = TCPStore(address, 0, size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=self.timeout_s))
        base = GroupSpec(address, int(store.port), 1, size, self.group_name, backend)
        policy = RetryPolicy(timeout_s=self.timeout_s + 30, retries=0)

        async def init(url: str, offset: int):
            body = {**base.to_json(), "rank_offset": offset}
            out = await request(sess, "POST", f"{url}/init_weights_update_group", body, policy)
            if isinstance(out, dict) and out.get("success") is False:
                raise RequestRejectedError(f"POST {url}/init_weights_update_group: {out.get('message')}", 400)

        posts = asyncio.ensure_future(asyncio.gather(*(init(u, o) for u, o in zip(urls, offsets))))
        join = asyncio.ensure_future(asyncio.to_thread(WeightGroup, base, 0, self.timeout_s, store))
        done, _ = await asyncio.wait({posts, join}, return_when=asyncio.FIRST_EXCEPTION)
        if posts in done and posts.exception() is not None:
            join.add_done_callback(lambda f: f.exception() or f.result().destroy())  # it ends at its timeout
            raise WeightGroupError(f"a rollout server refused the weight-update group: {posts.exception()}")
        self.group = await join  # raises WeightGroupError after the timeout
        self.group_urls, self.group_generations = urls, self.generations
        await posts

    async def send(self, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                   lock=contextlib.nullcontext, settle: Callable[[], None] | None = None) -> int:
        """Send ``named`` in buckets to the client's servers; returns the bytes this rank sent.
        ``settle()`` (default :func:`settle_device`) runs before each bucket takes ``lock``: the
        export's gathers must have finished by then."""
        settle = settle or settle_device
        members = (self.client.cfg.urls, self.generations)
        if self.group is not None and (self.group_urls, self.group_generations) != members:
            with lock():  # the servers changed (a restarted one, on a new URL or the same): leave the old group
                await self.close()
        if self.group is None:
            with lock():  # a server joins one group at a time (SGLang's init blocks until it forms)
                await self.connect()
        sent = 0
        for bucket, _ in buckets(named, bucket_bytes):  # the export's gathers run here, outside the lock
            spec = BucketSpec.of(bucket, self.group_name, flush_cache=False)
            settle()  # ... and have finished before it: never hold the lock while a gather is pending
            with lock():
                await self._send_bucket(spec, [t for _, t in bucket])
            sent += spec.nbytes
        self.bytes_sent += sent
        return sent

    async def _send_bucket(self, spec: BucketSpec, tensors: list[torch.Tensor]) -> None:
        group = self.group
        posts = asyncio.ensure_future(self._post_all("/update_weights_from_distributed", spec.to_json()))
        cast = _in_daemon_thread(group.broadcast, tensors)
        done, _ = await asyncio.wait({posts, cast}, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((f for f in (posts, cast) if f in done and f.exception() is not None), None)
        if failed is not None:
            for f in (posts, cast):  # the other one's outcome is the same failure seen from elsewhere
                f.add_done_callback(lambda f: f.cancelled() or f.exception())
            # the group is unusable now (a member left a broadcast half done): drop it, so that
            # the next sync forms a new one; the broadcast thread ends at the group's timeout
            self.group = None
            threading.Thread(target=_destroy_after, args=(cast, group), daemon=True).start()
            raise failed.exception()
        await posts
        await cast

    async def close(self) -> None:
        """``/destroy_weights_update_group`` on every server of the group (short health policy),
        then leave."""
        if self.group is None:
            return
        group, self.group = self.group, None
        try:
            await self._post_all("/destroy_weights_update_group", {"group_name": self.group_name},
                                 self.client.cfg.health_retry, urls=self.group_urls)
        except ServerError:
            pass  # a server that is gone has no group to destroy
        finally:
            group.destroy()


def settle_device() -> None:
    """Wait for the work queued on this rank's CUDA stream (the export's tensor-parallel gathers);
    nothing on CPU, where a gloo gather has finished when it returns."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def _in_daemon_thread(fn, *args) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread (not the loop's executor, which ``asyncio.run`` waits for:
    a broadcast abandoned after a refused bucket must not hold the error until its timeout)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def target() -> None:
        try:
            out = (True, fn(*args))
        except BaseException as exc:  # handed to the awaiting coroutine
            out = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, *out)

    threading.Thread(target=target, daemon=True, name="weight-sync-broadcast").start()
    return fut


def _destroy_after(fut: asyncio.Future, group: WeightGroup) -> None:
    deadline = time.monotonic() + group.timeout.total_seconds() + 5
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    group.destroy()


async def begin_update(client: RolloutClient, settings: SyncSettings | None = None) -> WeightFormat:
    """Check the servers (their version and flags: ``client.server_facts``; external ones, with
    ``settings``: the weight format they take, ``base.weight_format``), then open a sync on each:
    a weight-update session where the servers have them (SGLang >= 0.5.21). Returns the format
    the senders export in (embedded servers take what ``rollout.precision`` says)."""
    await client.server_facts()
    if settings is not None and settings.urls:
        fmt = await weight_format(client, settings)
    else:
        fmt = "block_fp8" if settings is not None and settings.precision == "fp8" else "bf16"
    await client.begin_weight_update()
    return fmt


async def end_update(client: RolloutClient, version: str, ok: bool = True, flush_idle_s: float = 0.0) -> None:
    """Label the sync ``version`` and close it (the servers switch weights and version together),
    then drop their prefix caches (``base.flush_after_sync``: never while requests run, each
    server waiting for idle at most ``flush_idle_s``, ``rollout.async.flush_idle_timeout_s``). After a
    failed sync (``ok`` false) only close it, waiting on a hung server no longer than the health
    policy."""
    if not ok:
        await client.end_weight_update(failed=True)
        return
    await client.update_weight_version(version)
    await client.end_weight_update()
    await flush_after_sync(client, flush_idle_s)


class DistributedWeightSync(WeightSync):
    update_group = True
    """The transport on every rank: each stage's sender keeps its :class:`DistributedSender` (and
    its group) from one sync to the next; ``close`` leaves the groups."""

    def __init__(self, settings: SyncSettings, run_dir: str | Path = "."):
        super().__init__(settings, run_dir)
        self.sender: Optional[DistributedSender] = None
        self.api_key: Optional[str] = None  # of the last sync, for close
        self.bytes_sent = 0  # by this rank in the last sync
        self.syncs = 0  # every rank counts them: each sync's turns have their own keys

    def _client(self, urls, api_key) -> RolloutClient:
        return control_client(self.settings, urls, api_key)  # no failure hook: a broadcast cannot leave one out

    async def _with_client(self, urls, api_key, fn) -> Any:
        client = self._client(urls, api_key)
        try:
            return await fn(client)
        finally:
            await client.close()

    async def _send(self, model, urls, api_key, fmt: WeightFormat, generations: tuple[int, ...] = ()) -> int:
        s = self.settings
        client = self._client(urls, api_key)
        try:
            if self.sender is None:
                self.sender = DistributedSender(client, f"sorl_wsync_r{comm.rank()}", s.weight_sync.init_timeout_s,
                                                master_address=s.weight_sync.master_address)
            self.sender.bind(client)
            self.sender.generations = generations
            kw = {}
            if comm.world_size() > 1:
                kw["lock"] = StoreMutex(comm.store(), f"sorl_wsync_lock/{self.syncs}", s.weight_sync.init_timeout_s)
            export = iter_owned_hf_weights(model)
            tensors = fp8_pairs(export) if fmt == "block_fp8" else export
            try:
                return await self.sender.send(tensors, s.weight_sync.bucket_mb * 1024**2, **kw)
            except BaseException:
                for _ in export:  # finish the export: this rank's tensor-parallel peers wait on its gathers
                    pass
                raise
        finally:
            await client.close()

    def sync(self, model, targets: SyncTargets, version: str) -> SyncStats:
        """Every rank calls it, rank 0 with the servers' URLs, generations and key (sent to every
        rank on each sync: a restarted server comes back on a new URL or as a new process on the
        same one, and the groups follow it)."""
        urls, self.api_key, gens = comm.broadcast_object((list(targets.urls), targets.api_key,
                                                          tuple(targets.generations)))
        if self.syncs == 0 and comm.world_size() > 1:
            check_stage_senders()  # the layout's experts reach a stage's sender (every rank, once)
        self.syncs += 1
        error: Optional[BaseException] = None
        fmt: Optional[WeightFormat] = None
        if comm.rank() == 0:
            try:
                fmt = aio.run(self._with_client(urls, self.api_key, lambda c: begin_update(c, self.settings)))
            except BaseException as exc:
                error = exc
        failed = comm.any_rank(error is not None)
        fmt = comm.broadcast_object(fmt)  # every sender exports in the format the servers take
        self.bytes_sent = 0
        if not failed:
            try:
                if weight_sync_roles()[0]:  # a stage's sender
                    self.bytes_sent = aio.run(self._send(model, urls, self.api_key, fmt, gens))
                else:
                    for _ in iter_owned_hf_weights(model):  # the gathers and hand-overs need every rank
                        pass
            except BaseException as exc:
                error = exc
            failed = comm.any_rank(error is not None)
        if comm.rank() == 0:
            flush_s, ok = self.settings.async_.flush_idle_timeout_s, not failed
            try:
                aio.run(self._with_client(urls, self.api_key, lambda c: end_update(c, version, ok, flush_s)))
            except BaseException as exc:
                error, failed = error or exc, True
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"the weight sync to version {version} failed on another rank (see its log)")
        return SyncStats(bytes_sent=self.bytes_sent)

    def close(self) -> None:
        """Leave this rank's group (``/destroy_weights_update_group`` on its servers)."""
        if self.sender is None or self.sender.group is None:
            return
        sender, self.sender = self.sender, None

        async def go(client):
            sender.bind(client)
            await sender.close()

        try:
            aio.run(self._with_client(sender.group_urls, self.api_key, go))
        except Exception as exc:  # the run's own outcome is what matters now
            log.warning("leaving the weight-update group failed: %s", exc)
