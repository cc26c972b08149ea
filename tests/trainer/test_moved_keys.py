"""Keys that moved into a section (``loader.MOVED_KEYS``, issue 44): the old key, in an override
or a recipe file, is a one-line error naming the new key; the new key is in the schema."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from sorl_megatron.common.typed_config import config_key
from sorl_megatron.trainer.recipe.config import RecipeError
from sorl_megatron.trainer.recipe.loader import MOVED_KEYS, load_recipe
from sorl_megatron.trainer.recipe.rollout_config import RolloutConfig

BASE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_search_base.yaml"
GPU_BASE = BASE.parent / "gpu" / "search_r1_base.yaml"  # gives rollout.weight_sync as a section


def _default(key: str) -> Any:
    """The value ``key`` has in the base recipe."""
    return _walk(load_recipe(BASE), key)


# The rollout section before issue 44: its 41 flat keys and the defaults of those that moved. Kept
# here, apart from the loader's table, so that a moved key missing from MOVED_KEYS is found.
ROLLOUT_KEYS_BEFORE = (
    "urls", "precision", "group_size", "temperature", "top_p", "top_k", "max_turns", "max_turn_tokens",
    "max_total_tokens", "max_obs_tokens", "concurrency", "deterministic", "timeout_s", "weight_sync_timeout_s",
    "health_timeout_s", "retries", "weight_sync", "weight_sync_bucket_mb", "weight_sync_init_timeout_s",
    "weight_sync_master_address", "num_servers", "router", "router_url", "router_policy",
    "router_balance_abs_threshold", "start_timeout_s", "failover_retries", "restart_servers", "restart_command", "mode",
    "max_staleness", "lag", "stale_groups", "pause_mode", "flush_idle_timeout_s", "dynamic_sampling",
    "dynamic_sampling_max_groups", "overlong", "overlong_buffer", "overlong_penalty", "inject",
)
DEFAULTS_BEFORE = {
    "weight_sync": "distributed", "weight_sync_timeout_s": 600.0, "weight_sync_bucket_mb": 512,
    "weight_sync_init_timeout_s": 120.0, "weight_sync_master_address": None, "num_servers": 1, "router": "none",
    "router_url": None, "router_policy": "cache_aware", "router_balance_abs_threshold": 4, "start_timeout_s": 300.0,
    "failover_retries": 2, "restart_servers": True, "restart_command": None, "max_staleness": 1, "lag": 2,
    "stale_groups": "drop", "pause_mode": "retract", "flush_idle_timeout_s": 30.0,
}


def _walk(node: Any, key: str) -> Any:
    for part in key.split("."):
        (f,) = [f for f in dataclasses.fields(node) if config_key(f) == part]
        node = getattr(node, f.name)
    return node


def test_every_key_of_the_old_rollout_section_is_kept_or_moved_with_its_default():
    """An old key that is no longer a key of the section (or is a section now) has an entry;
    every entry is an old key; a moved key keeps its old default at its new place."""
    today = {config_key(f): f for f in dataclasses.fields(RolloutConfig)}
    moved = {old.removeprefix("rollout."): new for old, new in MOVED_KEYS.items()}
    section_now = {k for k in ROLLOUT_KEYS_BEFORE if k in today and k not in ("inject",)
                   and dataclasses.is_dataclass(_walk(RolloutConfig(), k))}
    assert section_now == {"weight_sync"}
    missing = [k for k in ROLLOUT_KEYS_BEFORE if (k not in today or k in section_now) and k not in moved]
    assert missing == [], f"old keys without an entry in loader.MOVED_KEYS: {missing}"
    assert set(moved) <= set(ROLLOUT_KEYS_BEFORE) and set(moved) == set(DEFAULTS_BEFORE)
    for old, new in moved.items():
        assert new.startswith("rollout.")
        assert _walk(RolloutConfig(), new.removeprefix("rollout.")) == DEFAULTS_BEFORE[old], old


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _expected(old: str, new: str, value: str) -> str:
    if new.startswith(old + "."):  # a value where a section is now
        return f"{old}={value} moved to {new}={value} ({old} is a section now"
    return f"{old} moved to {new}"


@pytest.mark.parametrize("old,new", sorted(MOVED_KEYS.items()))
def test_an_old_key_in_an_override_names_its_new_key(old, new):
    value = _yaml(_default(new))
    load_recipe(BASE, [f"{new}={value}"])  # the new key exists and takes the value
    with pytest.raises(RecipeError) as err:
        load_recipe(BASE, [f"{old}={value}"])
    message = str(err.value)
    assert _expected(old, new, value) in message and f"override '{old}={value}'" in message
    assert "\n" not in message


@pytest.mark.parametrize("old,new", sorted(MOVED_KEYS.items()))
def test_an_old_key_in_a_recipe_file_names_its_new_key_and_the_file(old, new, tmp_path):
    value = _yaml(_default(new))
    *sections, leaf = old.split(".")
    text = "".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(sections)) + f"{'  ' * len(sections)}{leaf}: {value}\n"
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"defaults: [{BASE}]\n{text}")
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe)
    message = str(err.value)
    assert _expected(old, new, value) in message and str(recipe) in message and "\n" not in message


def test_every_old_key_of_a_recipe_is_named_at_once():
    with pytest.raises(RecipeError) as err:
        load_recipe(BASE, ["rollout.weight_sync_bucket_mb=256", "rollout.weight_sync=disk"])
    message = str(err.value)
    assert "rollout.weight_sync_bucket_mb moved to rollout.weight_sync.bucket_mb" in message
    assert "rollout.weight_sync=disk moved to rollout.weight_sync.transport=disk" in message


def test_an_old_value_over_a_recipe_section_is_named_before_the_merge():
    """A recipe that gives the section, and an override that gives the old value: the moved key
    is named (not OmegaConf's merge error of a value over a mapping)."""
    with pytest.raises(RecipeError, match=r"^rollout.weight_sync=disk moved to rollout.weight_sync.transport=disk"):
        load_recipe(GPU_BASE, ["rollout.weight_sync=disk"])
    assert load_recipe(GPU_BASE, ["rollout.weight_sync.transport=disk"]).rollout.weight_sync.transport == "disk"


def test_a_section_is_not_mistaken_for_its_old_value():
    cfg = load_recipe(BASE, ["rollout.weight_sync={transport: tensor, bucket_mb: 64}"])
    assert (cfg.rollout.weight_sync.transport, cfg.rollout.weight_sync.bucket_mb) == ("tensor", 64)
