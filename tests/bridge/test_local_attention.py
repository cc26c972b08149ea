"""The TE-less layer spec's core attention: torch's SDPA (the default) computes megatron's
unfused softmax attention (``model.local_attention: unfused``) up to float rounding, on padded
rows with the engine's causal mask, without a mask and on packed segments, gradients included;
settings SDPA lacks fall back to the unfused path (tests/bridge/worker.py: op_local_attention)."""

from __future__ import annotations

import pytest

from .harness import result

ROUNDING = 1e-5  # fp32; the outputs are O(1)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mask", "no_mask", "packed"])
def test_sdpa_computes_the_unfused_attention(single_results, case):
    r = result(single_results, "local_attention")[case]
    assert r["shape"] == r["shape_unfused"]
    assert r["scale"] > 0.1  # outputs of the size the bound is meant for
    assert r["out"] <= ROUNDING and r["grad"] <= ROUNDING, r


@pytest.mark.slow
def test_sdpa_reads_the_engines_causal_mask_as_the_mask_types(single_results):
    assert result(single_results, "local_attention")["mask_vs_none"] <= ROUNDING


@pytest.mark.slow
def test_settings_sdpa_lacks_fall_back_to_the_unfused_path(single_results):
    s = result(single_results, "local_attention")["supported"]
    assert s == {"plain": True, "dropout_training": False, "dropout_eval": True, "bias": False}


@pytest.mark.slow
def test_the_recipe_the_options_the_cli_and_the_spec_name_the_same_attentions(single_results):
    from typing import get_args, get_type_hints

    from sorl_megatron.bridge.convert_cli import build_parser
    from sorl_megatron.bridge.model import LOCAL_ATTENTIONS, ModelOptions
    from sorl_megatron.trainer.recipe.config import ModelConfig

    recipe = get_args(get_type_hints(ModelConfig)["local_attention"])
    assert sorted(recipe) == sorted(LOCAL_ATTENTIONS) == result(single_results, "local_attention")["kinds"]
    with pytest.raises(ValueError, match="local_attention must be one of"):
        ModelOptions(local_attention="flash")
    for kind in LOCAL_ATTENTIONS:  # tools/convert.py verify --attention takes each
        assert build_parser().parse_args(["verify", "--hf", "x", "--attention", kind]).attention == kind
    assert build_parser().parse_args(["verify", "--hf", "x"]).attention == "sdpa"
