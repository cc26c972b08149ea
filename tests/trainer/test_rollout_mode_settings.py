"""The rollout modes' one registry (``recipe/rollout_modes.py``), the sources that run them, and
each mode's own checks (issue 44): the messages name the nested keys."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from sorl_megatron.trainer.recipe.config import RecipeError
from sorl_megatron.trainer.recipe.loader import load_recipe
from sorl_megatron.trainer.recipe.rollout_config import RolloutConfig
from sorl_megatron.trainer.recipe.rollout_modes import ROLLOUT_MODES, ModeSettings, RolloutModeName
from sorl_megatron.trainer.sources import modes

BASE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_search_base.yaml"


def test_the_recipe_and_the_sources_name_the_same_modes():
    assert list(ROLLOUT_MODES) == ["sync", "one_step_off", "lagged", "async"]
    assert typing.get_type_hints(RolloutConfig)["mode"] == RolloutModeName
    assert typing.get_args(RolloutModeName) == tuple(ROLLOUT_MODES)  # rollout.mode's names are the registry's
    assert sorted(modes.SOURCES) == sorted(ROLLOUT_MODES)
    for name, settings in ROLLOUT_MODES.items():
        assert settings.name == name and modes.SOURCES[name].name == name


def test_a_mode_without_a_source_is_an_error_naming_both_registries(monkeypatch):
    cfg = load_recipe(BASE, ["rollout.mode=lagged", "rollout.staleness.max=2"])
    assert modes.source_class(cfg) is modes.LaggedSource
    monkeypatch.setattr(modes, "SOURCES", {k: v for k, v in modes.SOURCES.items() if k != "lagged"})
    with pytest.raises(RuntimeError, match=r"rollout.mode=lagged has no rollout source: ROLLOUT_MODES "
                                           r"\(trainer/recipe/rollout_modes.py\) names it, SOURCES .* has only "
                                           r"\['async', 'one_step_off', 'sync'\]"):
        modes.source_class(cfg)


def test_each_mode_with_keys_has_its_section_under_its_name():
    r = RolloutConfig()
    sections = r.mode_sections()
    assert sorted(sections) == ["async", "lagged"]
    for name, settings in ROLLOUT_MODES.items():
        if dataclasses.fields(settings):
            assert type(sections[name]) is settings, name
        else:
            assert name not in sections
    for name in ROLLOUT_MODES:  # the selected mode's settings: its section, or its defaults
        settings = dataclasses.replace(r, mode=name).mode_settings
        assert type(settings) is ROLLOUT_MODES[name] and isinstance(settings, ModeSettings)
        assert name not in sections or settings is sections[name]


@pytest.mark.parametrize("overrides,message", [
    (["rollout.mode=one_step_off", "rollout.staleness.max=0"],
     "rollout.mode=one_step_off trains on batches one weight version old: rollout.staleness.max must be >= 1"),
    (["rollout.mode=lagged", "rollout.lagged.lag=3"],
     "rollout.mode=lagged trains on batches rollout.lagged.lag=3 versions old: rollout.staleness.max=1 must be >= 3"),
    (["rollout.mode=async", "rollout.staleness.max=0"],
     "rollout.mode=async with rollout.staleness.max=0 would drop every group that was in flight at a weight update: "
     "use rollout.mode=sync, or rollout.staleness.max >= 1"),
    (["rollout.lagged.lag=0"], "rollout.lagged.lag must be >= 1, got 0"),
    (["rollout.staleness.max=-1"], "rollout.staleness.max must be >= 0, got -1"),
    (["rollout.async.flush_idle_timeout_s=0"], "rollout.async.flush_idle_timeout_s must be > 0 seconds, got 0.0"),
    (["rollout.async.flush_idle_timeout_s=.inf"],
     "rollout.async.flush_idle_timeout_s must be a finite number, got inf"),
    (["rollout.async.pause_mode=never"],
     "rollout.async.pause_mode: 'never' is not one of ['retract', 'in_place', 'off']"),
    (["rollout.staleness.stale_groups=maybe"],
     "rollout.staleness.stale_groups: 'maybe' is not one of ['drop', 'keep']"),
    (["rollout.mode=eventually"],
     "rollout.mode: 'eventually' is not one of ['sync', 'one_step_off', 'lagged', 'async']"),
    (["rollout.mode=async", "rollout.staleness.stale_groups=keep"],
     "rollout.staleness.stale_groups=keep trains on groups beyond rollout.staleness.max with the IS correction of "
     "their behaviour log-probs: set algorithm.loss.is_correction.mode (tis or mis), or drop them "
     "(rollout.staleness.stale_groups=drop)"),
])
def test_each_mode_checks_its_own_settings_naming_the_nested_keys(overrides, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(BASE, overrides)
    assert str(err.value) == message


def test_the_selected_mode_alone_asks_its_bound_of_the_staleness_section():
    """One_step_off, lagged and async ask the bound to hold their lag only when selected (the
    sections of the others are checked for their own values alone); sync trains on no stale
    token, so keeping stale groups needs no correction there."""
    load_recipe(BASE, ["rollout.mode=sync", "rollout.staleness.max=0", "rollout.lagged.lag=5"])
    load_recipe(BASE, ["rollout.mode=sync", "rollout.staleness.stale_groups=keep"])
    cfg = load_recipe(BASE, ["rollout.mode=lagged", "rollout.lagged.lag=3", "rollout.staleness.max=3",
                             "rollout.async.pause_mode='off'"])  # quoted: YAML reads a bare off as false
    assert (cfg.rollout.lagged.lag, cfg.rollout.staleness.max, cfg.rollout.async_.pause_mode) == (3, 3, "off")
    with pytest.raises(RecipeError, match=r"^rollout.lagged.lag must be >= 1"):  # its own values: always
        load_recipe(BASE, ["rollout.mode=async", "rollout.lagged.lag=0"])


def test_the_async_mode_decides_whether_the_servers_pause():
    for pause_mode, pauses in (("retract", True), ("in_place", True), ("off", False)):
        cfg = load_recipe(BASE, ["rollout.mode=async", f"rollout.async.pause_mode='{pause_mode}'"])
        assert modes.source_class(cfg).pauses(cfg.rollout) is pauses
    cfg = load_recipe(BASE, ["rollout.mode=sync"])
    assert modes.source_class(cfg).pauses(cfg.rollout) is False
