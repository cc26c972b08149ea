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

BASE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_search_base.yaml"
GPU_BASE = BASE.parent / "gpu" / "search_r1_base.yaml"  # gives rollout.weight_sync as a section


def _default(key: str) -> Any:
    """The value ``key`` has in the base recipe (walking the schema by config key)."""
    node: Any = load_recipe(BASE)
    for part in key.split("."):
        (f,) = [f for f in dataclasses.fields(node) if config_key(f) == part]
        node = getattr(node, f.name)
    return node


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
