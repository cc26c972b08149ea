"""The weight sync after each step, as the loop sees it: the servers' health, a pause around the
push where the rollout mode asks for one, the transport's push to the servers serving now
(``rollout.weight_sync``'s transport, ``weight_sync/``), and the flush after it. Every rank joins
the export; only rank 0 holds the connections."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ...common.http import ServerUnavailableError
from ...weight_sync.base import SyncTargets
from ...weight_sync.factory import make_weight_sync
from ..recipe.config import RolloutConfig
from .connections import Connections
from .fleet import FleetRejoining


class WeightPush:
    def __init__(self, rollout: RolloutConfig, run_dir: Path):
        self.transport = make_weight_sync(rollout, run_dir)
        self.run_dir = Path(run_dir)

    def sync(self, actor: Any, conn: Optional[Connections], step: int) -> None:
        """Push the actor engine's weights after ``step`` RL steps (HF names, bucketed), labelled
        weight version ``step_<step>``; ``conn`` is rank 0's connections (None on the other ranks).
        The servers' health is checked before the engine is touched; servers restarted since the
        last sync get this one before they serve (with none serving, it is what brings one back)."""
        version = f"step_{step}"
        if conn is None:
            self._push(actor, None, version)
            return
        try:
            conn.check_servers(f"the weight sync to version {version}", retrieval=False)
        except FleetRejoining:
            pass  # the restarted servers are what this sync is for: prepare_sync waits for them
        conn.prepare_sync()
        if not conn.rollout_urls:
            states = ", ".join(f"{w.url} {w.state}" for w in conn.get_fleet().workers)
            raise ServerUnavailableError(f"no rollout server left for the weight sync to version {version}: {states} "
                                         f"(see {self.run_dir / 'servers'})")
        paused = conn.pause()
        try:
            self._push(actor, conn, version)
        finally:
            if paused:
                conn.resume()
        conn.finish_sync()

    def _push(self, actor: Any, conn: Optional[Connections], version: str) -> None:
        """The sync itself, to the servers serving now."""
        targets = SyncTargets()
        if conn is not None:
            fleet = conn.get_fleet()
            targets = SyncTargets(tuple(conn.rollout_urls), conn.api_keys.get("rollout"), on_failure=fleet.on_failure,
                                  generations=fleet.generations(conn.rollout_urls))
        self.transport.sync(actor.model, targets, version)

    def close(self) -> None:
        self.transport.close()
