import json
from pathlib import Path

import pytest

from sorl_megatron.algorithms import POLICY_LOSSES
from sorl_megatron.trainer.config import ConfigError, TrainConfig, dump_config, load_recipe, validate_layout_for_launch
from sorl_megatron.typed_config import build_dataclass

RECIPES = sorted(Path(__file__).resolve().parents[2].joinpath("recipes").rglob("*.yaml"))
BASE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_search_base.yaml"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_recipe_validates(recipe):
    cfg = load_recipe(recipe)
    assert cfg.algorithm.loss.name in POLICY_LOSSES
    assert "algorithm:" in dump_config(cfg)


def test_defaults_chain_and_dotted_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("schedule:\n  total_steps: 7\nalgorithm:\n  loss:\n    name: ppo\n")
    (tmp_path / "mid.yaml").write_text("defaults: [base]\nalgorithm:\n  loss:\n    name: so_ppo\n")
    (tmp_path / "top.yaml").write_text("defaults: [mid.yaml]\nrollout:\n  group_size: 2\n")
    cfg = load_recipe(tmp_path / "top.yaml", ["algorithm.loss.clip_bias.mode=scalar", "schedule.batch_size=8"])
    assert cfg.schedule.total_steps == 7 and cfg.algorithm.loss.name == "so_ppo"
    assert cfg.algorithm.loss.clip_bias.mode == "scalar" and cfg.schedule.batch_size == 8


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["algorithm.loss.nme=ppo"], r"algorithm.loss.nme \(did you mean algorithm.loss.name\?\)"),
        (["schedulee.total_steps=3"], r"schedulee \(did you mean schedule\?\)"),
        (["schedule.total_steps=abc"], r"schedule.total_steps must be an integer"),
        (["algorithm.loss.name=ppo3"], r"algorithm.loss.name: unknown policy loss 'ppo3'"),
        (["algorithm.loss.eps_low=0"], r"algorithm.loss.eps_low must be"),
        (["algorithm.loss.clip_bias.delta=-1"], r"algorithm.loss.clip_bias.delta must be"),
        (["algorithm.routing_replay=r4"], r"algorithm.routing_replay: 'r4' is not one of"),
        (["schedule.mini_batch_size=7"], r"schedule.mini_batch_size=7 must divide"),
        (["schedule.micro_batch_size=3"], r"schedule.micro_batch_size=3 must divide"),
        (["rollout.group_size=1", "schedule.mini_batch_size=8"], r"needs rollout.group_size >= 2"),
        (["rollout.top_p=1.5"], r"rollout.top_p"),
        (["sft.direct_answer_fraction=1.0"], r"sft.direct_answer_fraction must be in \[0, 1\)"),
        (["notakeyvalue"], r"is not key=value"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(BASE, overrides)


def test_missing_and_cyclic_recipes(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "a.yaml").write_text("defaults: [b]\n")
    (tmp_path / "b.yaml").write_text("defaults: [a]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("defaults: [missing_parent]\n")
    with pytest.raises(ConfigError, match="listed in the defaults of"):
        load_recipe(tmp_path / "c.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(tmp_path / "bad.yaml")


def test_layout_checks_against_world_size_and_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "num_experts": 4}
    ))
    def cfg(**par):
        return build_dataclass(TrainConfig, {"model": {"path": str(tmp_path)}, "parallelism": par,
                                             "schedule": {"mini_batch_size": 16, "micro_batch_size": 4}})
    validate_layout_for_launch(cfg(tp=2), world_size=2)
    validate_layout_for_launch(cfg(ep=2), world_size=2)
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        validate_layout_for_launch(cfg(tp=2), world_size=3)
    with pytest.raises(ConfigError, match="parallelism.tp=4 does not divide the model's 4 attention / 2 KV heads"):
        validate_layout_for_launch(cfg(tp=4), world_size=4)
    with pytest.raises(ConfigError, match="parallelism.pp x vpp = 4 does not divide the model's 2 layers"):
        validate_layout_for_launch(cfg(pp=2, vpp=2), world_size=2)
    with pytest.raises(ConfigError, match="parallelism.ep=3 does not divide the model's 4 experts"):
        validate_layout_for_launch(cfg(ep=3), world_size=3)
    with pytest.raises(ConfigError, match="micro_batch_size x data-parallel size = 4 x 8"):
        validate_layout_for_launch(cfg(), world_size=8)
