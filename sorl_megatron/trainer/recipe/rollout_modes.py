"""The rollout modes a recipe may name (``rollout.mode``): each mode's own settings and checks.

:data:`ROLLOUT_MODES` is the one registry of mode names: the recipe's ``rollout.mode`` takes
its names (:data:`RolloutModeName`), and ``trainer/sources/modes.py`` maps the same names to
the rollout sources that run them (a test holds the two to the same names). A mode with keys
of its own has a section of the rollout recipe under its name (``rollout.lagged.lag``,
``rollout.async.pause_mode``); the staleness bound the lagged modes share is one section,
``rollout.staleness``. Adding a mode: a :class:`ModeSettings` subclass here, listed in
``ROLLOUT_MODES`` (with its section in ``RolloutConfig`` if it has keys), and its source.

Each mode checks its own keys (``validate``, every section, selected or not, as every section
of a recipe is checked) and what it asks of the shared ones when ``rollout.mode`` names it
(``check_selected``); nothing branches on a mode's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from .checks import RecipeError, _check_finite, _positive_int, _positive_seconds


@dataclass
class StalenessConfig:
    """``rollout.staleness``: how many weight versions a group's oldest token may be behind the
    trainer (``max``) and what happens to a group beyond it. Every mode's batches are checked
    against it (and its ``rollout/version_lag_*`` metrics counted up to it); the lagged modes
    (one_step_off, lagged, async) ask it to hold their lag."""

    max: int = 1  # in weight versions (one_step_off, async: >= 1; lagged: >= lagged.lag)
    # a group beyond it: dropped (and replaced), or kept: trained with the IS correction of
    # algorithm.loss.is_correction on its true behaviour log-probs
    stale_groups: Literal["drop", "keep"] = "drop"

    def validate(self, prefix: str = "rollout.staleness") -> None:
        _positive_int(f"{prefix}.max", self.max, minimum=0)


@dataclass
class ModeSettings:
    """A rollout mode: its name, its own keys (the dataclass fields) and its checks."""

    name: ClassVar[str] = ""  # its rollout.mode
    stale: ClassVar[bool] = True  # trains on tokens that older weights sampled

    def validate(self, prefix: str) -> None:
        """The mode's own keys (``prefix``: its section, ``rollout.<name>``)."""
        _check_finite(self, prefix)

    def check_selected(self, rollout: str, staleness: StalenessConfig) -> None:
        """What the mode asks of the shared keys when ``rollout.mode`` names it (``rollout``:
        the rollout section's prefix)."""

    def check_run_length(self, rollout: str, total_steps: int) -> None:
        """What the mode asks of ``schedule.total_steps`` when ``rollout.mode`` names it."""


@dataclass
class SyncMode(ModeSettings):
    """``sync``: each step's batch is generated with the step's own weights."""

    name: ClassVar[str] = "sync"
    stale: ClassVar[bool] = False


@dataclass
class OneStepOffMode(ModeSettings):
    """``one_step_off``: step k+1's batch is generated while step k trains, on the weights step
    k started from (a lag of exactly one version)."""

    name: ClassVar[str] = "one_step_off"

    def check_selected(self, rollout: str, staleness: StalenessConfig) -> None:
        if staleness.max < 1:
            raise RecipeError(f"{rollout}.mode=one_step_off trains on batches one weight version old: "
                              f"{rollout}.staleness.max must be >= 1")


@dataclass
class LaggedMode(ModeSettings):
    """``rollout.lagged`` (a study axis): step k trains on the batch generated on weights
    k - lag (min(k, lag) while the pipeline fills)."""

    name: ClassVar[str] = "lagged"
    lag: int = 2  # in weight versions, >= 1; mode lagged: <= schedule.total_steps and <= rollout.staleness.max

    def validate(self, prefix: str = "rollout.lagged") -> None:
        super().validate(prefix)
        _positive_int(f"{prefix}.lag", self.lag)

    def check_selected(self, rollout: str, staleness: StalenessConfig) -> None:
        if staleness.max < self.lag:
            raise RecipeError(f"{rollout}.mode=lagged trains on batches {rollout}.lagged.lag={self.lag} versions old: "
                              f"{rollout}.staleness.max={staleness.max} must be >= {self.lag}")

    def check_run_length(self, rollout: str, total_steps: int) -> None:
        if self.lag > total_steps:  # step k trains on weights k - min(k, lag): a longer lag is never reached
            raise RecipeError(f"{rollout}.lagged.lag={self.lag} is longer than the run (schedule.total_steps="
                              f"{total_steps}), so no step trains on a batch that old: give {rollout}.lagged.lag "
                              f"<= {total_steps}, or more steps")


@dataclass
class AsyncMode(ModeSettings):
    """``rollout.async``: episodes stay in flight across weight updates (partial rollouts); a
    step trains on finished groups whose oldest token is at most ``rollout.staleness.max``
    versions behind the trainer."""

    name: ClassVar[str] = "async"
    # SGLang's /pause_generation mode around each weight update (off: never pause; a server
    # without the endpoint answers 404 and the update lands between its requests)
    pause_mode: Literal["retract", "in_place", "off"] = "retract"
    # a sync ends with /flush_cache, which SGLang refuses while requests run (pause_mode in_place
    # or off): a background call then asks each server to flush once idle, waiting at most this
    # long; still busy, a warning (the next sync flushes again)
    flush_idle_timeout_s: float = 30.0

    def validate(self, prefix: str = "rollout.async") -> None:
        super().validate(prefix)
        _positive_seconds(f"{prefix}.flush_idle_timeout_s", self.flush_idle_timeout_s)

    def check_selected(self, rollout: str, staleness: StalenessConfig) -> None:
        if staleness.max < 1:
            raise RecipeError(f"{rollout}.mode=async with {rollout}.staleness.max=0 would drop every group that was "
                              f"in flight at a weight update: use {rollout}.mode=sync, or {rollout}.staleness.max >= 1")


# the registry: mode name -> its settings (the recipe's rollout.mode takes these names, in this order)
ROLLOUT_MODES: dict[str, type[ModeSettings]] = {
    cls.name: cls for cls in (SyncMode, OneStepOffMode, LaggedMode, AsyncMode)
}
RolloutModeName = Literal[tuple(ROLLOUT_MODES)]  # the type of rollout.mode
