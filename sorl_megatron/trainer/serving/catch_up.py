"""A phase the rollout servers serve, across a restart of the only one: a restarted server waits
for a weight sync before it serves (the fleet's ``FleetRejoining``), so when no server serves a
phase, every rank runs a weight sync of the weights the actor holds (the servers' own version:
such a phase comes before the next update) and the phase runs again, at most
``CATCH_UP_SYNCS`` times."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

from ...common import comm
from ...common.http import ServerError, ServerUnavailableError
from .connections import Connections

log = logging.getLogger("sorl_megatron.trainer")

CATCH_UP_SYNCS = 2  # per phase: weight syncs that bring a restarted server back before the phase gives up


class _NoServer:
    """Rank 0's answer to a phase no rollout server could serve (a restarted one waits for a sync)."""


def served(fn: Callable[[], Any], phase: str, conn: Optional[Connections], on_rank0: Callable[[Callable], Any],
           catch_up: Callable[[], None], version: int, run_dir: Path) -> Any:
    """``on_rank0(fn)`` (rank 0 runs it, every rank gets its result), with a catch-up weight sync
    (``catch_up``, on every rank) and a retry whenever rank 0's connections say that no server
    served it because the fleet is waiting for a restarted server to rejoin."""

    def or_no_server():
        try:
            return fn()
        except ServerError:
            if conn is None or not conn.fleet_rejoining():
                raise
            return _NoServer()

    for attempt in range(CATCH_UP_SYNCS + 1):
        out = on_rank0(or_no_server)
        if not isinstance(out, _NoServer):
            return out
        if attempt == CATCH_UP_SYNCS:
            break
        if comm.rank() == 0:
            log.warning("no rollout server serves %s: the restarted server gets the weights of version step_%d "
                        "first", phase, version)
        catch_up()
    raise ServerUnavailableError(f"no rollout server served {phase} after {CATCH_UP_SYNCS} weight syncs that "
                                 f"were to bring a restarted one back (see {run_dir / 'servers'})")
