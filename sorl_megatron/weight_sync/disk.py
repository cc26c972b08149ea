"""The disk transport (``rollout.weight_sync: disk``): a checkpoint the servers reload.

Every rank joins writing an HF checkpoint to ``<run dir>/weights_sync`` (rank 0 writes; FP8
pairs for external FP8 servers), then rank 0 asks every server to reload it with
``/update_weights_from_disk``. For servers that cannot reach the trainer but share its file
system.
"""

from __future__ import annotations

import asyncio

from ..bridge.weights import save_hf_checkpoint
from ..common.comm import rank
from .base import SyncStats, SyncTargets, WeightSync, control_client, external_fp8


class DiskWeightSync(WeightSync):
    """``sync``: write the checkpoint (every rank), then ``/update_weights_from_disk`` (rank 0)."""

    def sync(self, model, targets: SyncTargets, version: str) -> SyncStats:
        out = str((self.run_dir / "weights_sync").resolve())  # the servers resolve it, not us: absolute
        save_hf_checkpoint(model, out, fp8=external_fp8(self.settings))
        if rank() == 0:
            async def reload() -> None:
                async with control_client(self.settings, targets.urls, targets.api_key, targets.on_failure) as c:
                    await c.update_weights_from_disk(out, weight_version=version)

            asyncio.run(reload())
        return SyncStats()
