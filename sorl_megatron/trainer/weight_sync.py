"""The trainer's distributed weight sync (``rollout.weight_sync: distributed``), every rank.

Every rank exports its own part of the model (``iter_owned_hf_weights``: tensor-parallel
gathers only); the senders (``weight_sync_roles``: a stage's dense layers, each expert owner's
experts) broadcast it bucket by bucket to every server, each in its own group
(``rollout.weight_sync.DistributedSender``), one bucket on the wire at a time (a mutex in the
training world's store). Rank 0 opens the sync (``/begin_weight_update``) and closes it with
the version (``/update_weight_version``, ``/end_weight_update``, ``/flush_cache``). FP8
rollouts get the quantizer's block-FP8 pairs. A failure on any rank fails the sync on every
rank, after every rank has finished its export (so no gather is left waiting).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

import torch

from ..bridge.weights import iter_owned_hf_weights, weight_sync_roles
from ..common.fp8 import quantize_hf_tensor
from ..common.http import RetryPolicy
from ..rollout.client import RolloutClient, RolloutClientConfig
from ..rollout.weight_sync import DistributedSender, StoreMutex, begin_update, end_update
from .config import RolloutConfig

log = logging.getLogger("sorl_megatron.trainer.weight_sync")


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (a collective: every rank calls it)."""
    if _world() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item() > 0)


class DistributedWeightSync:
    """One per run and rank: ``sync`` after each step (a collective), ``close`` at the end."""

    def __init__(self, rollout: RolloutConfig):
        self.r = rollout
        self.sender: Optional[DistributedSender] = None
        self.peer: Optional[tuple[list[str], Optional[str]]] = None  # (urls, api key), rank 0's
        self.bytes_sent = 0  # by this rank in the last sync

    def _client(self) -> RolloutClient:
        r = self.r
        urls, key = self.peer
        return RolloutClient(RolloutClientConfig(
            urls=tuple(urls), control_retry=RetryPolicy(timeout_s=r.weight_sync_timeout_s, retries=r.retries),
            health_retry=RetryPolicy(timeout_s=r.health_timeout_s, retries=r.retries), api_key=key))

    async def _on_rank0(self, fn) -> Any:
        client = self._client()
        try:
            return await fn(client)
        finally:
            await client.close()

    async def _send(self, model) -> int:
        r = self.r
        client = self._client()
        try:
            if self.sender is None:
                self.sender = DistributedSender(client, f"sorl_wsync_r{_rank()}", r.weight_sync_init_timeout_s,
                                                master_address=r.weight_sync_master_address)
            self.sender.bind(client)
            kw = {}
            if _world() > 1:
                store = torch.distributed.distributed_c10d._get_default_store()
                kw["lock"] = StoreMutex(store, "sorl_wsync_lock", r.weight_sync_init_timeout_s)
            export = iter_owned_hf_weights(model)
            tensors = export
            if r.precision == "fp8":
                tensors = (pair for name, t in export for pair in quantize_hf_tensor(name, t))
            try:
                return await self.sender.send(tensors, r.weight_sync_bucket_mb * 1024**2, **kw)
            except BaseException:
                for _ in export:  # finish the export: this rank's tensor-parallel peers wait on its gathers
                    pass
                raise
        finally:
            await client.close()

    def sync(self, model, urls: list[str], api_key: Optional[str], version: str) -> int:
        """Push ``model`` (a MegatronModel) to the servers as ``version``; every rank calls it,
        rank 0 with the servers' ``urls`` and key. Returns the bytes this rank sent."""
        if self.peer is None:
            box = [(list(urls), api_key)]
            if _world() > 1:
                torch.distributed.broadcast_object_list(box, src=0)  # our own ranks: pickling is safe
            self.peer = box[0]
        error: Optional[BaseException] = None
        if _rank() == 0:
            try:
                asyncio.run(self._on_rank0(begin_update))
            except BaseException as exc:
                error = exc
        failed = _any_rank(error is not None)
        self.bytes_sent = 0
        if not failed:
            try:
                if any(weight_sync_roles()):
                    self.bytes_sent = asyncio.run(self._send(model))
                else:
                    for _ in iter_owned_hf_weights(model):  # the gathers need every rank
                        pass
            except BaseException as exc:
                error = exc
            failed = _any_rank(error is not None)
        if _rank() == 0:
            try:
                asyncio.run(self._on_rank0(lambda c: end_update(c, version, ok=not failed)))
            except BaseException as exc:
                error, failed = error or exc, True
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"the weight sync to version {version} failed on another rank (see its log)")
        return self.bytes_sent

    def close(self) -> None:
        """Leave this rank's group (``/destroy_weights_update_group`` on the servers)."""
        if self.sender is None or self.sender.group is None:
            return
        sender, self.sender = self.sender, None

        async def go(client):
            sender.bind(client)
            await sender.close()

        try:
            asyncio.run(self._on_rank0(go))
        except Exception as exc:  # the run's own outcome is what matters now
            log.warning("leaving the weight-update group failed: %s", exc)
