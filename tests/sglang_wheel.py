"""SGLang's released wheel, for the tests that run its own code on CPU (tests/weight_sync).

The wheel named by ``requirements-sglang.txt`` (the rollout servers' environment, ``make
sglang-env``) is fetched once with ``pip download --no-deps`` into ``~/.cache/sorl_megatron/``
(``$XDG_CACHE_HOME`` respected) and read in place: a wheel is a zip, so a test takes the one
source file it needs and never installs it (SGLang's dependencies are GPU builds). Nothing of
SGLang is kept in this repository. Without a reachable package index the tests skip, saying so.
"""

from __future__ import annotations

import ast
import fcntl
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "requirements-sglang.txt"


def pins(path: Path = REQUIREMENTS) -> dict[str, str]:
    """``name==version`` lines of a requirements file (comments dropped), by name."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)==([^\s#;]+)\s*(#.*)?", line)
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def trainer_torch() -> str:
    """The trainer's torch pin (pyproject.toml)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d.split("==", 1)[1] for d in deps if d.startswith("torch=="))


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sorl_megatron"


def wheel(timeout_s: float = 180.0) -> Path:
    """The cached SGLang wheel; fetched first if absent, or the test skips (no index reachable)."""
    version = pins()["sglang"]
    where = cache_dir() / "sglang"
    where.mkdir(parents=True, exist_ok=True)
    # one fetch at a time: make test's workers (pytest-xdist) may ask at once, and pip copies the
    # wheel into place, so another process could read it half written
    with open(where / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetched(where, version, timeout_s)


def _fetched(where: Path, version: str, timeout_s: float) -> Path:
    found = sorted(where.glob(f"sglang-{version}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--timeout", "15", "--retries", "1",
               "-d", str(where), f"sglang=={version}"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.skip(f"the package index did not answer within {timeout_s:g} s ({' '.join(cmd[2:])})")
        found = sorted(where.glob(f"sglang-{version}-*.whl"))
        if out.returncode != 0 or not found:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"cannot fetch sglang=={version} (is the package index reachable?): {last}")
    return found[-1]


def source(member: str) -> str:
    """One file of the wheel, e.g. ``sglang/srt/utils/common.py``."""
    with zipfile.ZipFile(wheel()) as z:
        return z.read(member).decode()


def metadata() -> str:
    with zipfile.ZipFile(wheel()) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode()


def function_source(module_source: str, name: str, cls: str | None = None) -> str:
    """The exact source of a top-level function (or of method ``name`` of class ``cls``)."""
    tree = ast.parse(module_source)
    body = tree.body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(module_source, node)


def struct_fields(module_source: str, cls: str) -> tuple[set[str], set[str]]:
    """(all fields, required fields) of a class of annotated fields and its bases in the same
    module (SGLang's io_struct request types: msgspec structs)."""
    classes = {n.name: n for n in ast.parse(module_source).body if isinstance(n, ast.ClassDef)}
    fields, required = set(), set()
    todo = [cls]
    while todo:
        node = classes[todo.pop()]
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                fields.add(item.target.id)
                if item.value is None:
                    required.add(item.target.id)
        todo += [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
    return fields, required


def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _is_bool(annotation: ast.AST) -> bool:
    """``bool`` or ``Optional[bool]`` / ``bool | None``."""
    text = ast.unparse(annotation).replace(" ", "")
    return text in ("bool", "Optional[bool]", "bool|None", "None|bool")


def launch_server_options() -> dict[str, bool]:
    """Every option string ``sglang.launch_server`` accepts in this wheel, and whether it takes a
    value: the ``A[T, Arg(...)]`` fields of ``sglang/srt/arg_groups/fields/*.py`` (as
    ``add_cli_args_from_dataclass`` turns them into flags: ``--`` + the name with dashes, or
    ``cli_name``, plus ``aliases``; a ``bool`` is ``store_true``; ``no_cli`` fields have none) and
    the options ``ServerArgs.add_cli_args`` adds by hand."""
    options: dict[str, bool] = {}
    with zipfile.ZipFile(wheel()) as z:
        members = [n for n in z.namelist() if n.startswith("sglang/srt/arg_groups/fields/") and n.endswith(".py")]
        for member in members:
            for node in ast.walk(ast.parse(z.read(member).decode())):
                if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                        and isinstance(node.annotation, ast.Subscript) and ast.unparse(node.annotation.value) == "A"):
                    continue
                parts = node.annotation.slice.elts if isinstance(node.annotation.slice, ast.Tuple) else []
                if len(parts) < 2:
                    continue
                meta = {k.arg: _literal(k.value) for k in parts[1].keywords} if isinstance(parts[1], ast.Call) else {}
                if meta.get("no_cli"):
                    continue
                names = [meta.get("cli_name") or "--" + node.target.id.replace("_", "-"), *(meta.get("aliases") or [])]
                action = meta.get("action")
                takes = not (_is_bool(parts[0]) and action is None) and action not in ("store_true", "store_false")
                options.update({name: takes for name in names})
        server_args = ast.parse(z.read("sglang/srt/server_args.py").decode())
    for node in ast.walk(server_args):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("add_argument"):
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            action = next((_literal(k.value) for k in node.keywords if k.arg == "action"), None)
            options.update({name: action not in ("store_true", "store_false") for name in names})
    return options
