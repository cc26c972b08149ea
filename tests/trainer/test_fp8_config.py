"""model.fp8 (TransformerEngine FP8): schema keys, the launch-time refusal, and nothing changes when off."""

from pathlib import Path

import pytest

from sorl_megatron.bridge import te_fp8
from sorl_megatron.bridge.model import ModelOptions
from sorl_megatron.bridge.te_fp8 import Fp8Options, forward_only_fp8
from sorl_megatron.trainer.recipe.config import RecipeError
from sorl_megatron.trainer.recipe.launch_checks import validate_layout_for_launch
from sorl_megatron.trainer.recipe.loader import load_recipe
from sorl_megatron.trainer.recipe.model_options import model_options

BASE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_search_base.yaml"
FP8_ON = ["model.fp8.enabled=true", "model.fp8.format=hybrid", "model.fp8.recipe=blockwise"]


def test_keys_parse_and_default_off():
    cfg = load_recipe(BASE)
    assert cfg.model.fp8 == Fp8Options(enabled=False, format="e4m3", recipe="delayed", forward_only=True)
    on = load_recipe(BASE, FP8_ON + ["model.fp8.forward_only=false"])
    assert on.model.fp8 == Fp8Options(enabled=True, format="hybrid", recipe="blockwise", forward_only=False)
    assert model_options(on).fp8 is on.model.fp8


@pytest.mark.parametrize("override,key", [("model.fp8.format=e5m2", "model.fp8.format"),
                                          ("model.fp8.recipe=mxfp8", "model.fp8.recipe")])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(RecipeError, match=key):
        load_recipe(BASE, [override])


def test_print_config_works_with_fp8_on_without_te(capsys):
    """The schema accepts the keys on a CPU machine; only the launch refuses."""
    from sorl_megatron.train import main

    assert main(["--config", str(BASE), "--print-config", *FP8_ON]) == 0
    assert "fp8" in capsys.readouterr().out


def test_launch_refuses_where_fp8_cannot_run(monkeypatch):
    cfg = load_recipe(BASE, FP8_ON)
    monkeypatch.setattr(te_fp8, "fp8_unavailable_reason", lambda: "no CUDA device")
    with pytest.raises(RecipeError, match=r"model\.fp8\.enabled=true needs TransformerEngine FP8.*no CUDA device"):
        validate_layout_for_launch(cfg, world_size=1)


def test_unavailable_reason_on_this_machine():
    # CPU CI: no TE or no CUDA; a GPU runner with TE and an H100 would give None
    import torch

    reason = te_fp8.fp8_unavailable_reason()
    if not torch.cuda.is_available():
        assert reason is not None and ("transformer_engine" in reason or "CUDA" in reason)


def test_off_changes_nothing():
    off = Fp8Options()
    assert off.build_overrides() == {}
    assert Fp8Options(enabled=True).build_overrides() == {}  # forward-only FP8: the built model is unchanged
    assert Fp8Options(enabled=True, forward_only=False).build_overrides() == {"fp8": "e4m3", "fp8_recipe": "delayed"}
    config = object()
    for options in (None, off, Fp8Options(enabled=False, forward_only=False)):
        with forward_only_fp8(config, options):  # no megatron / TE import, no config touched
            pass
    assert ModelOptions().fp8 is None


def test_local_spec_refuses_fp8():
    from sorl_megatron.bridge.build import _use_te

    with pytest.raises(ValueError, match="model.fp8.enabled=true needs the TransformerEngine layer spec"):
        _use_te(ModelOptions(use_te=False, fp8=Fp8Options(enabled=True)))
    assert _use_te(ModelOptions(use_te=False, fp8=Fp8Options())) is False
