"""Every wait and retry count of the recipe has a maximum, checked when the recipe loads, and
the nonsense of issue 49 (item 9) is refused in one line naming the key (trainer/recipe/bounds.py).

The schema is walked, not listed: a new key ending in ``_s``, ``timeout`` or ``retries`` without
a maximum in ``RECIPE_MAXIMA`` fails ``test_every_wait_and_retry_count_has_a_maximum``."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from sorl_megatron.common.typed_config import config_key
from sorl_megatron.trainer.recipe.bounds import BOUNDED_NAME_ENDINGS, RECIPE_MAXIMA, markdown_table
from sorl_megatron.trainer.recipe.config import TrainConfig
from sorl_megatron.trainer.recipe.loader import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "recipes" / "tiny_search_base.yaml"


def schema_keys(cls: type = TrainConfig, prefix: str = "") -> dict[str, typing.Any]:
    """Every leaf key of the recipe schema (as a recipe spells it) -> its annotation."""
    hints, keys = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{config_key(f)}"
        if dataclasses.is_dataclass(hints[f.name]):
            keys.update(schema_keys(hints[f.name], key + "."))
        elif f.init:
            keys[key] = hints[f.name]
    return keys


def _needs_a_maximum(key: str) -> bool:
    return key.rsplit(".", 1)[-1].endswith(BOUNDED_NAME_ENDINGS)


BOUNDED = sorted(k for k in schema_keys() if _needs_a_maximum(k))


def test_every_wait_and_retry_count_has_a_maximum():
    assert len(BOUNDED) >= 14  # the walk sees the nested sections (fleet, weight_sync, async, wandb)
    assert [k for k in BOUNDED if k not in RECIPE_MAXIMA] == []
    assert [k for k in RECIPE_MAXIMA if k not in schema_keys()] == []  # no stale entry


def _error(*overrides: str) -> list[str]:
    with pytest.raises(RecipeError) as err:
        load_recipe(str(BASE), list(overrides))
    return str(err.value).splitlines()


@pytest.mark.parametrize("key", sorted(RECIPE_MAXIMA))
def test_a_value_above_the_maximum_is_refused_naming_the_key(key):
    high = RECIPE_MAXIMA[key].high
    above = int(high) + 1 if schema_keys()[key] is int else high * 10
    (line,) = _error(f"{key}={above}")
    assert line.startswith(f"{key} must be at most {high:g}") and f"got {above:g}" in line, line
    load_recipe(str(BASE), [f"{key}={int(high) if schema_keys()[key] is int else high}"])  # the maximum itself


def test_absurd_values_of_the_issue():
    (line,) = _error("retrieval.retries=1000000000")
    assert "retrieval.retries must be at most 100, got 1000000000" in line
    (line,) = _error("parallelism.rank0_phase_timeout_s=1e30")
    assert "parallelism.rank0_phase_timeout_s must be at most 604800 seconds (1 week), got 1e+30" in line


def test_a_lag_longer_than_the_run():
    lagged = ["rollout.mode=lagged", "rollout.staleness.max=50", "algorithm.loss.is_correction.mode=tis"]
    (line,) = _error(*lagged, "rollout.lagged.lag=50", "schedule.total_steps=10")
    assert line.startswith("rollout.lagged.lag=50 is longer than the run (schedule.total_steps=10)"), line
    assert "give rollout.lagged.lag <= 10" in line
    load_recipe(str(BASE), [*lagged, "rollout.lagged.lag=10", "schedule.total_steps=10"])
    load_recipe(str(BASE), ["rollout.lagged.lag=50", "schedule.total_steps=10"])  # not the selected mode


def test_print_memory_refuses_a_layout_the_model_cannot_run(capsys):
    from sorl_megatron.train import main

    config = ROOT / "recipes" / "gpu" / "model_configs" / "qwen2.5_7b.json"  # 28 heads, 4 KV heads
    code = main(["--config", str(BASE), "--print-memory", "--model-config", str(config), "parallelism.tp=3"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(err) == 1, err
    assert "parallelism.tp=3 does not divide the model's 28 attention / 4 KV heads (--model-config=" in err[0]
    code = main(["--config", str(BASE), "--print-memory", "--model-config", str(config), "parallelism.tp=2"])
    assert code in (0, 1) and "total" in capsys.readouterr().out  # a plan (1: it does not fit)


def test_the_security_page_shows_the_table_of_maxima():
    page = (ROOT / "docs" / "security.md").read_text()
    start, end = "<!-- bounds-table: generated from trainer/recipe/bounds.py -->", "<!-- /bounds-table -->"
    assert start in page and end in page, "docs/security.md lacks the bounds-table markers"
    shown = page.split(start, 1)[1].split(end, 1)[0].strip()
    assert shown == markdown_table(), "regenerate: python -m sorl_megatron.trainer.recipe.bounds"
