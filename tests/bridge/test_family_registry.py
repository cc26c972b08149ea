"""A model family is one spec: each registered family is one module of
sorl_megatron/bridge/families/, has a tiny test model the bridge suite builds, and nothing else
in the package branches on a family's ``model_type`` string (pure Python, no megatron)."""

from __future__ import annotations

import ast
import importlib
import pathlib
from dataclasses import replace

import pytest

from sorl_megatron.bridge import ParallelLayout, UnsupportedModelError, validate_layout
from sorl_megatron.bridge.families import FAMILIES, SUPPORTED_MODEL_TYPES, FamilySpec, register_family
from sorl_megatron.bridge.hf_config import load_hf_config
from sorl_megatron.bridge.layout import SUPPORTED_MODEL_TYPES as LAYOUT_SUPPORTED

from .cases import SINGLE_CASES
from .tiny_models import CONFIGS

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "sorl_megatron"
FAMILIES_DIR = PACKAGE / "bridge" / "families"


def _family_names(node: ast.AST, names: set[str]) -> list[str]:
    """The family names ``node`` spells: a string constant, or one inside a tuple / list / set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [n for elt in node.elts for n in _family_names(elt, names)]
    return []


def family_branches(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, family)`` of each place ``source`` branches on a family's name: a comparison
    (``==``, ``!=``, ``in``, ``not in``, ``is``) with one, a ``match`` case on one, or a dict
    keyed by one (a dispatch table)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        spelled: list[str] = []
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                spelled += _family_names(operand, names)
        elif isinstance(node, ast.MatchValue):
            spelled = _family_names(node.value, names)
        elif isinstance(node, ast.Dict):
            spelled = [n for key in node.keys if key is not None for n in _family_names(key, names)]
        found += [(node.lineno, name) for name in spelled]
    return found


def test_the_scan_sees_each_kind_of_family_branch():
    source = '''
if hf_config.model_type == "deepseek_v3": pass
if mt in ("qwen3", "qwen3_moe"): pass
if "mixtral" != kind: pass
match mt:
    case "llama": pass
table = {"glm4_moe": 1}
if mt == "gemma3" or name == "deepseek": pass
'''
    assert sorted(family_branches(source, set(FAMILIES))) == [
        (2, "deepseek_v3"), (3, "qwen3"), (3, "qwen3_moe"), (4, "mixtral"), (6, "llama"), (7, "glm4_moe")]


def test_no_family_branch_outside_the_families_package():
    """Building, loading, FP8, the memory plan and conversion consult the family's spec
    (sorl_megatron.bridge.families): a ``model_type`` string comparison anywhere else is a family
    fact in the wrong place (move it into the family's module, as a FamilySpec field)."""
    names = set(FAMILIES)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if FAMILIES_DIR in path.parents:
            continue
        found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {name!r}"
                  for line, name in family_branches(path.read_text(), names)]
    assert found == [], "\n".join(found)


def test_supported_model_types_are_the_registry():
    assert SUPPORTED_MODEL_TYPES == LAYOUT_SUPPORTED == tuple(FAMILIES)
    assert SUPPORTED_MODEL_TYPES == (
        "qwen2", "qwen3", "llama", "qwen3_moe", "mixtral", "deepseek_v3", "qwen2_moe", "glm4_moe")


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_each_family_is_one_module_with_a_tiny_model_the_suite_builds(model_type):
    spec = FAMILIES[model_type]
    module = importlib.import_module(f"sorl_megatron.bridge.families.{model_type}")
    assert module.SPEC is spec and spec.model_type == model_type and spec.title
    config = spec.tiny_config()
    assert config.model_type == model_type
    validate_layout(ParallelLayout(), load_hf_config(config))
    # the bridge suite saves it (tests/bridge/conftest.py) and checks its logits and round trip
    assert CONFIGS[model_type]().to_json_string() == config.to_json_string()
    ids = {case["id"] for case in SINGLE_CASES}
    assert {f"logits/{model_type}/ws1", f"roundtrip/{model_type}/ws1"} <= ids


def test_a_registered_family_is_supported_and_registers_once():
    spec = FAMILIES["llama"]
    with pytest.raises(ValueError, match="'llama' is already registered"):
        register_family(spec)
    config, other = spec.tiny_config(), spec.tiny_config()
    config.model_type, other.model_type = "llama_like", "nothing"
    with pytest.raises(UnsupportedModelError, match="model_type='llama_like'"):
        validate_layout(ParallelLayout(), config)
    register_family(replace(spec, model_type="llama_like", mbridge_name="llama"))
    try:
        validate_layout(ParallelLayout(), config)
        with pytest.raises(UnsupportedModelError) as info:
            validate_layout(ParallelLayout(), other)
        assert str(info.value).endswith("supported: " + ", ".join([*SUPPORTED_MODEL_TYPES, "llama_like"]))
    finally:
        del FAMILIES["llama_like"]


def test_spec_defaults():
    spec = FamilySpec(model_type="x", title="X", tiny_config=dict)
    assert spec.mbridge_name == "x" and spec.sliding_window is None and spec.rope_scaling == ()
    with pytest.raises(ValueError, match="sliding_window"):
        FamilySpec(model_type="x", title="X", tiny_config=dict, sliding_window="sometimes")



def test_the_walk_through_shows_the_family_module_as_it_is():
    """docs/how-to/add-a-model-family.md walks through qwen2_moe.py, quoted whole: the quote is the file."""
    doc = (PACKAGE.parent / "docs" / "how-to" / "add-a-model-family.md").read_text()
    module = (FAMILIES_DIR / "qwen2_moe.py").read_text()
    assert f"```python\n{module}```\n" in doc
