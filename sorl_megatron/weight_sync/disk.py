"""The disk transport (``rollout.weight_sync.transport: disk``): a checkpoint the servers reload.

Every rank joins writing an HF checkpoint to ``<run dir>/weights_sync`` (rank 0 writes; FP8
pairs for external FP8 servers), then rank 0 asks every server to reload it with
``/update_weights_from_disk``, then ``/flush_cache`` once they are idle. For servers that
cannot reach the trainer but share its file system.
"""

from __future__ import annotations

from ..bridge.weights import save_hf_checkpoint
from ..common import aio
from ..common.comm import rank
from .base import SyncStats, SyncTargets, WeightSync, control_client, external_fp8, flush_after_sync, weight_format


class DiskWeightSync(WeightSync):
    """``sync``: write the checkpoint (every rank), then ``/update_weights_from_disk`` (rank 0)."""

    def sync(self, model, targets: SyncTargets, version: str) -> SyncStats:
        out = str((self.run_dir / "weights_sync").resolve())  # the servers resolve it, not us: absolute
        save_hf_checkpoint(model, out, fp8=external_fp8(self.settings))
        if rank() == 0:
            async def reload() -> None:
                async with control_client(self.settings, targets.urls, targets.api_key, targets.on_failure) as c:
                    await c.server_facts()  # refuses a server this run cannot use
                    if self.settings.urls:
                        await weight_format(c, self.settings)  # the checkpoint's format is the one it serves
                    # not flushed by the reload: SGLang's flush there fails its scheduler while requests run
                    await c.update_weights_from_disk(out, weight_version=version, flush_cache=False)
                    await flush_after_sync(c, self.settings.async_.flush_idle_timeout_s)

            aio.run(reload())
        return SyncStats()
