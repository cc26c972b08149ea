"""The reference pages generated from the code are the committed ones (issue 48, item 2).

``docs/reference/recipe-keys.md`` is written from the recipe schema's dataclasses and
``docs/reference/server-flags.md`` from the CLIs' argument parsers by ``tools/reference_docs.py``;
a key or a flag added, removed or re-documented without re-running it fails here, naming the
command that brings the page up to date.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("_reference_docs", ROOT / "tools" / "reference_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()


@pytest.mark.parametrize("name", sorted(GEN.PAGES))
def test_committed_reference_page_is_the_generated_one(name):
    committed = (GEN.REFERENCE / name).read_text()
    assert committed == GEN.PAGES[name](), (
        f"docs/reference/{name} is stale: run `python tools/reference_docs.py` and commit the page")


def test_every_recipe_key_is_on_the_page():
    """Each leaf of the schema, under its recipe name (``rollout.async``, not ``async_``)."""
    from sorl_megatron.trainer.recipe.config import TrainConfig

    def leaves(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            key = prefix + f.metadata.get("key", f.name)
            if dataclasses.is_dataclass(value):
                yield from leaves(value, key + ".")
            elif f.init:
                yield key

    sections = {f.name: f.default_factory() for f in dataclasses.fields(TrainConfig)}
    page = (GEN.REFERENCE / "recipe-keys.md").read_text()
    keys = [k for name, section in sections.items() for k in leaves(section, name + ".")]
    assert "rollout.async.pause_mode" in keys and len(keys) > 100
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert not missing, f"recipe keys missing from docs/reference/recipe-keys.md: {missing}"


def test_every_recipe_key_says_what_it_does():
    """Each key's row on the generated page has a non-empty "what" cell: a field without a
    comment (a ``#`` line above it, one at the end of its line, or an ``Attributes:`` entry of
    its class) would leave the reader only its name."""
    page = GEN.PAGES["recipe-keys.md"]()
    rows = [re.split(r"(?<!\\)\|", line)[1:-1] for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) > 100 and all(len(cells) == 4 for cells in rows)  # key, type, default, what
    empty = [key.strip(" `") for key, _, _, what in rows if not what.strip()]
    assert not empty, f"recipe keys without a description (comment their dataclass fields): {empty}"


def test_check_mode_reports_a_stale_page(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(GEN, "REFERENCE", tmp_path)
    monkeypatch.setattr(GEN, "ROOT", tmp_path.parent)
    assert GEN.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().out
    assert GEN.main([]) == 0 and GEN.main(["--check"]) == 0
