"""The maxima of the recipe's waits and retry counts: one table, checked when a recipe loads.

Every float timeout (a key ending in ``_s`` or ``timeout``) and every retry count (``retries``)
of the schema has its maximum here, in :data:`RECIPE_MAXIMA`; ``TrainConfig.validate`` checks
them after each section's own checks (which own the minima: > 0 seconds, >= 0 retries), so
``--print-config`` refuses a value above one in one line naming the key, the value and the
maximum. A test walks the schema and fails for such a key without a maximum, and the table in
docs/security.md is :func:`markdown_table`'s (a test holds the page to it).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from ...common.typed_config import config_key
from .checks import RecipeError

HOUR = 3600
DAY = 24 * HOUR
WEEK = 7 * DAY
MAX_RETRIES = 100

# the key names that must have a maximum (tests/trainer/test_recipe_bounds.py walks the schema)
BOUNDED_NAME_ENDINGS = ("_s", "timeout", "retries")


@dataclass(frozen=True)
class Bound:
    """A key's maximum (``unit``: "seconds" or "" for a count) and what it bounds."""

    high: float
    unit: str
    what: str

    def shown(self) -> str:
        return f"{self.high:g} {self.unit}".strip() + (f" ({_span(self.high)})" if self.unit == "seconds" else "")


def _span(seconds: float) -> str:
    for size, name in ((WEEK, "week"), (DAY, "day"), (HOUR, "hour"), (60, "minute")):
        if seconds >= size and seconds % size == 0:
            count = int(seconds // size)
            return f"{count} {name}{'s' * (count != 1)}"
    return f"{seconds:g} s"


RECIPE_MAXIMA: dict[str, Bound] = {
    "parallelism.collective_timeout_s": Bound(WEEK, "seconds", "a collective of the process group (a timedelta)"),
    "parallelism.rank0_phase_timeout_s": Bound(WEEK, "seconds", "the other ranks waiting for a rank-0 phase"),
    "rollout.timeout_s": Bound(DAY, "seconds", "one /generate call"),
    "rollout.health_timeout_s": Bound(10 * 60, "seconds", "one GET /health of a rollout server"),
    "rollout.retries": Bound(MAX_RETRIES, "", "reconnects to a refused or 5xx rollout server, per call"),
    "rollout.weight_sync.timeout_s": Bound(DAY, "seconds", "one weight-sync or control call"),
    "rollout.weight_sync.init_timeout_s": Bound(DAY, "seconds", "forming the weight-update group, each broadcast"),
    "rollout.fleet.start_timeout_s": Bound(DAY, "seconds", "an embedded server's or the router's start"),
    "rollout.fleet.failover_retries": Bound(MAX_RETRIES, "", "resends of a /generate call a failed server lost"),
    "rollout.async.flush_idle_timeout_s": Bound(HOUR, "seconds", "a flush waiting for a busy server to go idle"),
    "retrieval.timeout_s": Bound(DAY, "seconds", "one /retrieve call"),
    "retrieval.health_timeout_s": Bound(10 * 60, "seconds", "one GET /health of the retrieval server"),
    "retrieval.retries": Bound(MAX_RETRIES, "", "reconnects to a refused or 5xx retrieval server, per call"),
    "logging.wandb.init_timeout_s": Bound(HOUR, "seconds", "wandb.init (online: the W&B server)"),
    "rollout.fleet.num_servers": Bound(256, "", "embedded rollout servers, each a process of its own"),
}


def value_at(cfg: Any, key: str) -> Any:
    """The value of the dotted recipe ``key`` in the config ``cfg`` (keys as a recipe spells them)."""
    obj = cfg
    for part in key.split("."):
        (f,) = [f for f in dataclasses.fields(obj) if config_key(f) == part]
        obj = getattr(obj, f.name)
    return obj


def check_maxima(cfg: Any) -> None:
    """Each key of :data:`RECIPE_MAXIMA` at most its maximum, else a RecipeError naming it."""
    for key, bound in RECIPE_MAXIMA.items():
        value = value_at(cfg, key)
        if value is not None and value > bound.high:
            shown = f"{value:g}" if isinstance(value, float) else value
            raise RecipeError(f"{key} must be at most {bound.shown()}, got {shown}: it bounds {bound.what}")


def markdown_table() -> str:
    """The table of maxima docs/security.md shows (between its ``bounds-table`` markers)."""
    rows = [f"| `{key}` | {bound.shown()} | {bound.what} |" for key, bound in RECIPE_MAXIMA.items()]
    return "\n".join(["| key | maximum | what it bounds |", "|---|---|---|", *rows])


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="python -m sorl_megatron.trainer.recipe.bounds",
                            description="Print the table of the recipe's maxima that docs/security.md shows.",
                            ).parse_args(argv)
    print(markdown_table())


if __name__ == "__main__":
    main()
