"""Every SGLang launch line the project shows (recipe headers, docs, the Slurm launcher's help)
is one SGLang 0.5.21 accepts and one the trainer's own server checks accept
(``rollout/launch_check.py``, which turns the line into the ``/server_info`` fields
``rollout/server_facts.py`` judges). SGLang's options are read from its released wheel
(``tests/sglang_wheel.py``), so a flag it does not know, or an ambiguous prefix, fails here."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from sorl_megatron.rollout.launch_check import FLAGS, launch_line_problem

from . import sglang_wheel

ROOT = Path(__file__).resolve().parents[1]
FP8_EXPORT = {"quant_method": "fp8", "weight_block_size": [128, 128]}


def sglang_parser() -> argparse.ArgumentParser:
    """``sglang.launch_server``'s options (names and arity only; values are not checked)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=True)
    for name, takes_value in sglang_wheel.launch_server_options().items():
        parser.add_argument(name, dest=name, **({} if takes_value else {"action": "store_true"}))
    return parser


def launch_lines() -> list[tuple[str, list[str]]]:
    """(where, the flags after ``sglang.launch_server``) for every such line in recipes and docs."""
    found = []
    for path in sorted([*ROOT.glob("recipes/**/*.yaml"), *ROOT.glob("docs/**/*.md"), ROOT / "README.md"]):
        text = re.sub(r"\\\n\s*", " ", path.read_text())  # shell continuations
        for line in text.splitlines():
            m = re.search(r"sglang\.launch_server\s+([^`\n]*)", line)
            if m:
                found.append((f"{path.relative_to(ROOT)}: {line.strip()[:80]}", shlex.split(m.group(1).rstrip(".)"))))
    return found


def _context(where: str) -> tuple[str, bool]:
    """(rollout.precision, R3 on) of the recipe a header belongs to; docs lines: fp8 iff they serve an FP8 export."""
    path = where.split(":", 1)[0]
    if path.startswith("recipes/"):
        from sorl_megatron.trainer.recipe.loader import load_recipe

        cfg = load_recipe(str(ROOT / path), [])
        return cfg.rollout.precision, cfg.algorithm.routing_replay == "r3"
    return "bf16", False


def test_the_project_shows_launch_lines():
    assert len(launch_lines()) >= 5  # recipes and docs; if this drops, the scan stopped finding them


@pytest.mark.parametrize("where,argv", launch_lines(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_launch_line_is_accepted_by_sglang_and_by_the_trainer(where, argv):
    _, unknown = sglang_parser().parse_known_args(argv)
    assert not [u for u in unknown if u.startswith("-")], (where, unknown)
    precision, routes = _context(where)
    model = argv[argv.index("--model-path") + 1]
    fp8_export = "fp8" in model  # the project's convention: an FP8 export's directory says so
    if not where.startswith("recipes/"):
        precision = "fp8" if fp8_export else precision
    problem = launch_line_problem(argv, precision, routes, FP8_EXPORT if fp8_export else None)
    assert problem is None, (where, problem)


def test_the_launchers_help_example_is_accepted():
    from sorl_megatron.cluster import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["slurm"]
    help_text = next(a.help for a in sub._actions if "--sglang-args" in a.option_strings)
    example = shlex.split(re.search(r"'([^']+)'", help_text).group(1))
    assert not [u for u in sglang_parser().parse_known_args(example)[1] if u.startswith("-")]
    assert launch_line_problem(["--model-path", "/m", *example], "bf16", True) is None


def test_the_trainers_flags_are_sglangs():
    """The flags ``launch_check`` reads exist in SGLang 0.5.21 with the same arity, and ``--tp``
    (which the docs use) is argparse's unique prefix of ``--tp-size``."""
    options = sglang_wheel.launch_server_options()
    for flag, (_, takes_value) in FLAGS.items():
        assert options.get(flag) is takes_value, (flag, options.get(flag))
    assert [o for o in options if o.startswith("--tp")] == ["--tp-size"]


def test_the_fp8_launch_on_a_bf16_checkpoint_is_refused():
    """The launch the FP8 recipes used to document; the trainer refuses such a server at its first sync."""
    problem = launch_line_problem(["--model-path", "/models/Qwen3-30B-A3B", "--tp", "4", "--quantization", "fp8",
                                   "--enable-return-routed-experts"], "fp8", True)
    assert problem and "quantizes a BF16 checkpoint online" in problem


def test_no_router_policy_needs_an_endpoint_sglang_dropped():
    """sglang-router's power_of_two polls /get_load; SGLang 0.5.21 serves /v1/loads and no /get_load."""
    from sorl_megatron.cluster import ROUTER_POLICIES

    http = sglang_wheel.source("sglang/srt/entrypoints/http_server.py")
    assert '"/get_load"' not in http and "/v1/loads" in sglang_wheel.source("sglang/srt/entrypoints/v1_loads.py")
    assert "power_of_two" not in ROUTER_POLICIES
