"""The one place that reads ``rollout.weight_sync.transport``: the transport of a run, chosen once.

Adding a transport: one module in this package with a :class:`~.base.WeightSync` subclass,
registered in ``TRANSPORTS`` under the name a recipe gives (docs/concepts/rollout.md).
"""

from __future__ import annotations

from pathlib import Path

from .base import SyncSettings, WeightSync
from .disk import DiskWeightSync
from .distributed import DistributedWeightSync
from .tensor import TensorWeightSync

TRANSPORTS: dict[str, type[WeightSync]] = {
    "distributed": DistributedWeightSync,
    "tensor": TensorWeightSync,
    "disk": DiskWeightSync,
}


def transport_class(settings: SyncSettings) -> type[WeightSync]:
    """The transport ``settings.weight_sync.transport`` names (the recipe's ``rollout`` section);
    what a transport needs of the layout and the servers is its class's to say (``WeightSync``)."""
    transport = settings.weight_sync.transport
    cls = TRANSPORTS.get(transport)
    if cls is None:
        raise ValueError(f"rollout.weight_sync.transport: {transport!r} is not one of {sorted(TRANSPORTS)}")
    return cls


def make_weight_sync(settings: SyncSettings, run_dir: str | Path) -> WeightSync:
    """The run's weight sync; ``run_dir`` is where a transport may write (disk: the checkpoint)."""
    return transport_class(settings)(settings, run_dir)
