"""Every shell command in README.md and docs/**/*.md runs as written (issue 21).

The commands assume the README's set-up: ``make setup`` (or ``make demo``), then
``source .venv/bin/activate``, so ``python`` and ``torchrun`` are the virtual environment's.
This test reads the commands out of the Markdown (fenced ``bash`` blocks and inline code
spans that start with a program), and for each one checks that the program is in the
environment, that the module or script exists and answers ``--help`` with every flag the
command uses, that training and study overrides pass the recipe schema, and that ``make``
targets exist. Commands of other projects (SGLang) are named in ``EXTERNAL`` and skipped.
The ``python`` code blocks run too, against embedded servers where they talk to one, unless
marked ``<!-- not run: why -->`` (see "Python snippets" below).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
VENV_BIN = Path(sys.executable).parent
EXTERNAL = {"sglang.launch_server", "sglang_router.launch_router", "pytest"}  # other projects' modules
# their first word is a subcommand
SUBCOMMANDS = {"tools/convert.py", "sorl_megatron.bridge.convert_cli", "sorl_megatron.cluster"}
OTHER_PROGRAMS = {"make", "source", "pip", "rm",
                  ".venv-sglang/bin/python"}  # SGLang's own environment (make sglang-env), not the trainer's
DEMO_RUN = Path("runs/tiny_search/so_grpo")  # the demo's run directory: examples must not write into it


@dataclass
class Command:
    doc: str
    text: str
    program: str
    target: str = ""  # module (python -m) or script path
    is_module: bool = False
    subcommand: str = ""
    flags: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    config: str = ""


def _unwrap_optional(text: str) -> str:
    """``[--flag X]`` -> ``--flag X`` (the flag must exist); ``[key=value ...]`` and other
    placeholder groups are dropped; a bracket right after ``=`` is a value (``seeds=[1]``)."""
    pattern = re.compile(r"(?<![=\w])\[([^\[\]]*)\]")
    while (m := pattern.search(text)) is not None:
        inner = m.group(1)
        text = text[: m.start()] + (inner if inner.lstrip().startswith("--") else "") + text[m.end():]
    return text


def _snippets(text: str) -> list[str]:
    """Shell lines of fenced bash blocks (continuations joined) and inline code spans."""
    out, rest, in_bash, block = [], [], False, None
    for line in text.splitlines():
        if line.startswith("```"):
            if block is None:
                block, in_bash = [], line.strip() in ("```bash", "```sh", "```shell")
            else:
                if in_bash:
                    out.extend(re.sub(r"\\\n\s*", " ", "\n".join(block)).splitlines())
                block = None
            continue
        if block is not None:
            block.append(line)
        else:
            rest.append(line)
    for span in re.findall(r"`([^`]+)`", "\n".join(rest)):
        span = " ".join(span.split())
        words = span.split()
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words and words[0] in ("python", "torchrun") and len(words) > 1:
            out.append(span)
    return [s for s in (line.strip() for line in out) if s]


def _parse(doc: str, line: str) -> Command | None:
    words = shlex.split(_unwrap_optional(line), comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    words = [w for w in words if w not in ("&", "...")]
    if not words:
        return None
    cmd = Command(doc, line, words[0])
    if cmd.program not in ("python", "torchrun"):
        return cmd
    args = words[1:]
    if cmd.program == "torchrun":  # skip torchrun's own options
        while args and args[0].startswith("-") and args[0] != "-m":
            args = args[1:] if "=" in args[0] or len(args) < 2 or args[1].startswith("-") else args[2:]
    if not args:
        return None  # a fragment in prose (`torchrun --nproc_per_node=2`)
    if args[:1] == ["-m"]:
        cmd.target, cmd.is_module, args = args[1], True, args[2:]
    else:
        cmd.target, args = args[0], args[1:]
    if cmd.target in SUBCOMMANDS and args and not args[0].startswith("-"):
        cmd.subcommand, args = args[0], args[1:]
    cmd.flags = sorted({a.split("=", 1)[0] for a in args if a.startswith("--")})
    cmd.overrides = [a for a in args if "=" in a and not a.startswith("-")]
    if "--config" in args:
        cmd.config = args[args.index("--config") + 1]
    return cmd


def doc_commands() -> list[Command]:
    cmds = []
    for path in DOCS:
        for line in _snippets(path.read_text()):
            cmd = _parse(path.name, line)
            if cmd is not None:
                cmds.append(cmd)
    return cmds


COMMANDS = doc_commands()
OURS = [c for c in COMMANDS if c.program in ("python", "torchrun") and c.target not in EXTERNAL]


def test_the_commands_are_found():
    """The reader finds the commands that matter (a parser regression would test nothing)."""
    targets = {c.target for c in OURS}
    for expected in ("sorl_megatron.train", "sorl_megatron.study", "sorl_megatron.sglang_cpu.server",
                     "sorl_megatron.retrieval.server", "sorl_megatron.data.synthetic", "tools/convert.py",
                     "tools/plot.py", "tools/demo.py"):
        assert expected in targets, f"no command runs {expected}"
    assert {c.program for c in COMMANDS} >= {"python", "torchrun", "make", "source"}
    convert = {c.subcommand for c in OURS if c.target == "tools/convert.py"}
    assert convert >= {"hf-to-megatron", "megatron-to-hf", "verify"}
    assert any("--enable-return-routed-experts" in c.flags for c in OURS)


def test_programs_exist_in_the_environment():
    """``python`` and ``torchrun`` are the activated virtual environment's; nothing else is
    assumed but make, source, pip and rm."""
    for cmd in COMMANDS:
        if cmd.program in ("python", "torchrun"):
            assert (VENV_BIN / cmd.program).exists(), f"{cmd.doc}: `{cmd.text}` needs {VENV_BIN / cmd.program}"
        else:
            assert cmd.program in OTHER_PROGRAMS, f"{cmd.doc}: `{cmd.text}` runs an unknown program {cmd.program}"


def test_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    for cmd in COMMANDS:
        if cmd.program == "make":
            target = cmd.text.split()[1]
            assert target in targets, f"{cmd.doc}: `{cmd.text}`: the Makefile has no target {target}"


def _help_cases() -> dict[tuple[str, str], list[Command]]:
    cases: dict[tuple[str, str], list[Command]] = {}
    for cmd in OURS:
        cases.setdefault((cmd.target, cmd.subcommand), []).append(cmd)
    return cases


HELP_CASES = _help_cases()


@pytest.mark.parametrize("target,sub", sorted(HELP_CASES), ids=lambda x: x or "-")
def test_each_command_answers_help_with_its_flags(target, sub):
    cmds = HELP_CASES[(target, sub)]
    where = "; ".join(sorted({c.doc for c in cmds}))
    if cmds[0].is_module:
        assert target.startswith("sorl_megatron"), f"{where}: unknown module {target} (add it to EXTERNAL?)"
        assert importlib.util.find_spec(target) is not None, f"{where}: no module {target}"
        argv = ["-m", target]
    else:
        script = ROOT / target
        assert script.is_file(), f"{where}: no script {target}"
        if "argparse" not in script.read_text():
            return  # a benchmark without options: --help would run it
        argv = [target]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    res = subprocess.run([sys.executable, *argv, *([sub] if sub else []), "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{where}: `{' '.join(argv)} {sub} --help` failed:\n{res.stderr[-3000:]}"
    assert "usage:" in res.stdout
    for cmd in cmds:
        for flag in cmd.flags:
            assert re.search(rf"{re.escape(flag)}\b", res.stdout), f"{cmd.doc}: `{cmd.text}`: no flag {flag}"


DEMO_RECIPE = "recipes/tiny_search_so_grpo.yaml"  # tools/demo.py's default --recipe
for _c in OURS:
    if _c.target == "tools/demo.py" and not _c.config:
        _c.config = DEMO_RECIPE
TRAIN = [c for c in OURS if c.target in ("sorl_megatron.train", "tools/demo.py") and c.config
         and (ROOT / c.config).is_file()]
STUDY = [c for c in OURS if c.target == "sorl_megatron.study" and c.config and (ROOT / c.config).is_file()]


@pytest.mark.parametrize("cmd", TRAIN, ids=lambda c: f"{c.doc}:{Path(c.config).stem}")
def test_training_commands_pass_the_schema_and_keep_out_of_the_demo_run(cmd, capsys):
    """The overrides are keys of the schema; an example never trains in the demo's run
    directory (it would resume, or share, the demo's checkpoints); an example starting from
    the demo's SFT policy does not run SFT again."""
    from sorl_megatron.train import main
    from sorl_megatron.trainer.recipe.loader import load_recipe

    assert main(["--config", str(ROOT / cmd.config), "--print-config", *cmd.overrides]) == 0, capsys.readouterr()
    cfg = load_recipe(ROOT / cmd.config, cmd.overrides)
    assert Path(cfg.logging.dir) / cfg.logging.run_name != DEMO_RUN, f"{cmd.doc}: `{cmd.text}` writes the demo's run"
    if "sft_model" in cfg.model.path:
        assert not cfg.sft.enabled, f"{cmd.doc}: `{cmd.text}` starts from an SFT policy but runs SFT again"


@pytest.mark.parametrize("cmd", STUDY, ids=lambda c: f"{c.doc}:{' '.join(c.overrides) or '-'}")
def test_study_commands_pass_the_schema(cmd):
    from sorl_megatron.study.runner import load_study

    load_study(ROOT / cmd.config, cmd.overrides)


def test_example_outputs_are_git_ignored():
    """What the examples write (runs/, data/) stays out of ``git status``; the package
    directories named data (sorl_megatron/data) are not ignored."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    res = subprocess.run(["git", "check-ignore", "--no-index", "-v", "data/synth/model", "runs/x"], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 2, res.stdout + res.stderr
    res = subprocess.run(["git", "check-ignore", "--no-index", "sorl_megatron/data/synthetic.py",
                          "tests/data/x.py"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 1, f"package files ignored: {res.stdout}"


# -- every flag of every CLI has help text ---------------------------------------------------

class _Captured(Exception):
    pass


def _capture_parser(monkeypatch, call) -> argparse.ArgumentParser:
    """The parser a CLI builds, caught when it parses (nothing runs)."""
    seen = []

    def grab(self, *args, **kwargs):
        seen.append(self)
        raise _Captured

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", grab)
    with pytest.raises(_Captured):
        call()
    return seen[0]


def _script_main(path: str):
    spec = importlib.util.spec_from_file_location(f"_cli_{Path(path).stem}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _cli_entry_points():
    from sorl_megatron import cluster, toy_demo, train
    from sorl_megatron.bridge import convert_cli
    from sorl_megatron.data import synthetic
    from sorl_megatron.retrieval import server as retrieval_server
    from sorl_megatron.sglang_cpu import server as sglang_cpu_server
    from sorl_megatron.study import runner as study

    return {
        "sorl_megatron.train": lambda: train.main([]),
        "sorl_megatron.study": lambda: study.main([]),
        "sorl_megatron.cluster": lambda: cluster.main([]),
        "sorl_megatron.toy_demo": lambda: toy_demo.main([]),
        "sorl_megatron.sglang_cpu.server": lambda: sglang_cpu_server.parse_args([]),
        "sorl_megatron.retrieval.server": lambda: retrieval_server.parse_args([]),
        "sorl_megatron.data.synthetic": lambda: synthetic.main([]),
        "tools/convert.py": lambda: convert_cli.main([]),
        "tools/plot.py": lambda: _script_main("tools/plot.py")([]),
        "tools/demo.py": lambda: _script_main("tools/demo.py")([]),
    }


def _actions(parser: argparse.ArgumentParser, prefix: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{prefix}{name} ")
        elif not isinstance(action, argparse._HelpAction):
            yield prefix + ("/".join(action.option_strings) or action.dest), action


def test_every_cli_flag_has_help(monkeypatch):
    missing = []
    for name, call in _cli_entry_points().items():
        parser = _capture_parser(monkeypatch, call)
        missing += [f"{name}: {flag}" for flag, action in _actions(parser) if not (action.help or "").strip()]
    assert not missing, f"flags without help text: {missing}"


# -- Python snippets ----------------------------------------------------------------------------
# Every ```python block of README.md and docs/**/*.md runs, unless the line before its opening
# fence is `<!-- not run: REASON -->` (a fragment, or one that needs GPUs, torchrun or a model
# directory). A snippet talks to the servers at the addresses the docs give them (rollout
# http://127.0.0.1:30000, retrieval http://127.0.0.1:8000) and reads the demo's files under
# runs/tiny/: the test starts both embedded servers on a tiny model and data set and rewrites
# those addresses and that directory to its own. The snippets read the files the by-hand server
# commands serve (data/synth/ of "Starting the servers by hand"), so a snippet run as written
# talks to a server on the same model (a tokenizer or routing shape of another model: HTTP 400).

NOT_RUN = re.compile(r"<!--\s*not run\b(.*)-->")
SERVED = {"http://127.0.0.1:30000": "rollout", "http://127.0.0.1:8000": "retrieval"}
SNIPPET_DATA = ("data/synth/", "runs/tiny/")  # the by-hand servers' data, the demo's


@dataclass
class Snippet:
    doc: str
    line: int  # of the opening fence, 1-based
    code: str
    run: bool

    @property
    def needs_servers(self) -> bool:
        return any(url in self.code for url in SERVED) or any(d in self.code for d in SNIPPET_DATA)


def python_snippets() -> list[Snippet]:
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != "```python":
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = next((text for text in reversed(lines[:i]) if text.strip()), "")
            marker = NOT_RUN.search(before)
            if marker and not marker.group(1).strip(": "):
                raise AssertionError(f"{path.name}:{i}: `<!-- not run -->` needs a reason: `<!-- not run: why -->`")
            found.append(Snippet(path.name, i + 1, "\n".join(lines[i + 1:end]), run=marker is None))
    return found


SNIPPETS = python_snippets()


def test_the_python_snippets_are_found():
    runs = {(s.doc, s.needs_servers) for s in SNIPPETS if s.run}
    assert {("algorithms.md", False), ("rollout.md", True)} <= runs
    assert {s.doc for s in SNIPPETS if not s.run} >= {"convert.md", "engine.md", "kernels.md"}


def test_snippets_read_the_model_the_by_hand_server_serves():
    """A snippet that talks to the rollout server at 127.0.0.1:30000 loads the model directory
    the doc's by-hand ``sglang_cpu.server --model-path`` command serves (issue 48: the client
    snippet once read the demo's hidden-128 model while the command served a hidden-64 one)."""
    served: dict[str, str] = {}  # the page's first such command: "Starting the servers by hand"
    for c in OURS:
        if c.target == "sorl_megatron.sglang_cpu.server" and "--model-path" in c.text:
            words = shlex.split(c.text)
            served.setdefault(c.doc, words[words.index("--model-path") + 1])
    checked = 0
    for snippet in SNIPPETS:
        if "http://127.0.0.1:30000" not in snippet.code:
            continue
        assert snippet.doc in served, f"{snippet.doc}:{snippet.line}: no by-hand server command in the same page"
        read = set(re.findall(r'(?:load_hf_config|from_pretrained|update_weights_from_disk)\(\s*"([^"]+)"',
                              snippet.code))
        assert read == {served[snippet.doc]}, (f"{snippet.doc}:{snippet.line} reads {sorted(read)}; the page's "
                                               f"server serves {served[snippet.doc]}")
        checked += 1
    assert checked >= 2


@pytest.fixture(scope="module")
def doc_servers(tmp_path_factory):
    """The tiny data set (as runs/tiny/) and both embedded servers on it, API keys in the environment."""
    from tests.trainer.e2e_helpers import make_tiny_data, shared_embedded_servers

    data = make_tiny_data(tmp_path_factory.mktemp("docs_data"))
    with shared_embedded_servers(data, tmp_path_factory.mktemp("docs_servers")) as servers:
        yield data, servers


@pytest.mark.parametrize("snippet", [pytest.param(s, marks=[pytest.mark.slow] if s.needs_servers else [])
                                     for s in SNIPPETS if s.run], ids=lambda s: f"{s.doc}:{s.line}")
def test_python_snippets_run(snippet, request, capsys):
    code = snippet.code
    if snippet.needs_servers:
        data, servers = request.getfixturevalue("doc_servers")
        for url, name in SERVED.items():
            code = code.replace(url, servers[name])
        for directory in SNIPPET_DATA:
            code = code.replace(directory, f"{data}/")
    # compiled under the doc's name: a failure's traceback names the page and the snippet's line
    exec(compile(code, f"{snippet.doc}:{snippet.line}", "exec"), {"__name__": "__doc_snippet__"})
