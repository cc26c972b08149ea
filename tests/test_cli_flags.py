"""Every numeric flag of every entry point is range-checked in one line naming the flag.

The parsers are found, not listed: every module of the package and every tool that builds an
``argparse.ArgumentParser`` is run up to its ``parse_args`` (which is stopped there), and each
flag of the parser it built (subcommands included) is read. A flag that takes a number must
have a ``common.cli_range.Range`` type (a new ``type=int`` flag fails here), its default in its
range, and absurd values (negative, 0 below a minimum of 1, 1e30, NaN, inf, not a number) are
argparse's error: exit 2, one ``error:`` line naming the flag, nothing run."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from pathlib import Path

import pytest

from sorl_megatron.common.cli_range import Range

ROOT = Path(__file__).resolve().parents[1]
# the rollout router's flags are sglang-router's own (rollout/router.py passes them through)
SOURCES = sorted([*(ROOT / "sorl_megatron").rglob("*.py"), *(ROOT / "tools").glob("*.py")])
ENTRY_POINTS = [p.relative_to(ROOT).as_posix() for p in SOURCES if "ArgumentParser(" in p.read_text()]


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _load(rel: str):
    if rel.startswith("sorl_megatron/"):
        return importlib.import_module(rel[:-3].replace("/", "."))
    spec = importlib.util.spec_from_file_location(f"_tool_{Path(rel).stem}", ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def built_parser(rel: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser the entry point ``rel`` builds, taken at its parse_args."""
    def stop(parser, *args, **kwargs):
        raise _Built(parser)

    module = _load(rel)
    entry = getattr(module, "main", None) or getattr(module, "parse_args")
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", stop)
        with pytest.raises(_Built) as built:
            entry([])
    return built.value.parser


def flags(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(argv prefix naming the subcommand, action) for each action that takes a value."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from flags(sub, (*prefix, name))
        elif action.nargs != 0 and action.option_strings:
            yield prefix, action


def _numeric(action: argparse.Action) -> bool:
    default = action.default
    return action.type in (int, float) or isinstance(action.type, Range) or (
        action.type is None and isinstance(default, (int, float)) and not isinstance(default, bool))


def absurd_values(kind: Range) -> list[str]:
    huge = str(10**30) if kind.kind is int else "1e30"
    values = [huge, f"-{huge}", "nan", "inf", "twelve"]
    if kind.low >= 0:
        values.append(str(kind.low) if kind.open_low else str(kind.low - 1))
    return values


def test_the_entry_points_are_found():
    for rel in ("sorl_megatron/train.py", "sorl_megatron/study/runner.py", "sorl_megatron/bridge/convert_cli.py",
                "tools/gpu_check.py", "sorl_megatron/sglang_cpu/server.py", "sorl_megatron/retrieval/server.py",
                "sorl_megatron/cluster.py"):
        assert rel in ENTRY_POINTS


@pytest.mark.parametrize("rel", ENTRY_POINTS)
def test_every_numeric_flag_is_bounded(rel, monkeypatch, capsys):
    parser = built_parser(rel, monkeypatch)
    actions = [(prefix, a) for prefix, a in flags(parser) if _numeric(a)]
    unbounded = [a.option_strings[0] for _, a in actions if not isinstance(a.type, Range)]
    assert unbounded == [], f"{rel}: numeric flags without a cli_range.Range type"
    for prefix, action in actions:
        flag = action.option_strings[-1]
        assert action.default is None or action.type.contains(action.default), (rel, flag, action.default)
        for value in absurd_values(action.type):
            capsys.readouterr()
            with pytest.raises(SystemExit) as exit_:
                parser.parse_args([*prefix, f"{flag}={value}"])
            errors = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
            assert exit_.value.code == 2 and len(errors) == 1, (rel, flag, value, errors)
            assert f"argument {'/'.join(action.option_strings)}: must be" in errors[0], (rel, flag, value, errors)
