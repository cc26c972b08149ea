"""The tensor transport (``rollout.weight_sync.transport: tensor``): the weights over HTTP.

Rank 0 gathers the whole model (``bridge.weights.iter_hf_weights``; every rank joins the
gathers), serializes each bucket (``wire.serialize_named_tensors``: safetensors, base64) and
posts it to every server with ``/update_weights_from_tensor``, between ``/begin_weight_update``
and ``/end_weight_update``; the last bucket carries the version and flushes the cache. Only the
embedded server reads these bodies (SGLang's come from a colocated CUDA process).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..bridge.weights import iter_hf_weights
from ..common import aio
from ..common.buckets import buckets
from ..common.comm import rank
from ..rollout.client import RolloutClient
from .base import SyncStats, SyncTargets, WeightSync, control_client, external_fp8, fp8_pairs
from .wire import serialize_named_tensors

TENSOR_BUCKET_BYTES = 256 * 1024**2  # per HTTP body, before base64


async def send_tensors(client: RolloutClient, named: Iterable[tuple[str, torch.Tensor]], version: str,
                       bucket_bytes: int = TENSOR_BUCKET_BYTES, load_format: str = "safetensors",
                       tp_size: int = 1) -> int:
    """Send HF-named tensors to ``client``'s servers in buckets of at most ``bucket_bytes``,
    labelled ``version``; returns the tensor bytes sent. A failure closes the sync on the servers
    that still answer (waiting on a hung one only the health policy) and is raised."""
    sent = 0
    await client.begin_weight_update()
    try:
        for bucket, last in buckets(named, bucket_bytes):
            payload = serialize_named_tensors(bucket, load_format)
            await client.update_weights_from_tensor(payload, load_format, flush_cache=last,
                                                    weight_version=version if last else None, tp_size=tp_size)
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
    except Exception:
        await client.end_weight_update(failed=True)
        raise
    await client.end_weight_update()
    return sent


class TensorWeightSync(WeightSync):
    embedded_servers_only = True
    """``sync``: the whole model from rank 0 over HTTP (FP8 pairs for external FP8 servers)."""

    bucket_bytes = TENSOR_BUCKET_BYTES

    def sync(self, model, targets: SyncTargets, version: str) -> SyncStats:
        tensors = iter_hf_weights(model)
        if rank() != 0:
            for _ in tensors:  # every rank joins the gathers inside the export
                pass
            return SyncStats()
        if external_fp8(self.settings):
            tensors = fp8_pairs(tensors)

        async def push() -> int:
            async with control_client(self.settings, targets.urls, targets.api_key, targets.on_failure) as client:
                return await send_tensors(client, tensors, version, self.bucket_bytes)

        return SyncStats(bytes_sent=aio.run(push()))
