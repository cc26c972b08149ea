"""The package's import graph: no circles, every arrow points down the layers, no giant package.

Read from the source with ``ast`` (every ``import``, at module level or inside a function,
``TYPE_CHECKING`` blocks included), so a lazy import cannot hide a circle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "sorl_megatron"

# Lower numbers are lower layers; a module may import only its own layer or below. Packages
# of one layer may use each other as long as that makes no circle (checked separately).
LAYERS = {
    "common": 0,
    "algorithms": 1,
    "bridge": 2,
    "engine": 3,
    "data": 4,
    "retrieval": 4,
    "rewards": 4,
    "rollout": 4,
    "weight_sync": 5,
    "sglang_cpu": 5,  # the CPU SGLang-compatible server: the trainer starts it by module name, never imports it
    "trainer": 6,
    "demo": 6,  # the toy demo: the algorithm core alone
    "train": 7,
    "cluster": 7,  # the Slurm launcher (TorchX)
    "study": 7,
    "": 7,  # sorl_megatron/__init__.py
}


def _module_name(path: pathlib.Path) -> tuple[str, bool]:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p)[0]: p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                targets = submodules if len(submodules) == len(node.names) else [target, *submodules]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` names a.b.c's module
                    target = target.rpartition(".")[0]
                if target.startswith(PACKAGE.name) and target != name:
                    graph[name].add(target)
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of size > 1 (the import circles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_circle_between_modules():
    assert _strongly_connected(import_graph()) == []


def test_no_import_circle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        packages.setdefault(_top(module), set()).update(_top(t) for t in targets if _top(t) != _top(module))
    assert _strongly_connected(packages) == []


def test_every_import_points_down_the_layers():
    graph = import_graph()
    unknown = sorted({_top(m) for m in graph} - set(LAYERS))
    assert not unknown, f"packages without a layer in tests/test_layout.py: {unknown}"
    upward = sorted(
        f"{m} -> {t}" for m, targets in graph.items() for t in targets if LAYERS[_top(t)] > LAYERS[_top(m)]
    )
    assert upward == []


def test_the_trainer_never_imports_the_cpu_server():
    """The trainer talks to rollout servers over HTTP only, SGLang's or the CPU one, which it starts
    as a subprocess by module name (trainer/servers.py): it must not import it."""
    graph = import_graph()
    assert any(m.startswith("sorl_megatron.sglang_cpu.") for m in graph)  # the checker sees the package
    trainer = {m: targets for m, targets in graph.items() if _top(m) == "trainer"}
    assert sorted(f"{m} -> {t}" for m, targets in trainer.items() for t in targets if _top(t) == "sglang_cpu") == []


def test_the_largest_package_holds_at_most_a_quarter_of_the_lines():
    lines: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        lines[_top(_module_name(path)[0])] = lines.get(_top(_module_name(path)[0]), 0) + len(
            path.read_text().splitlines()
        )
    total = sum(lines.values())
    largest = max(lines, key=lines.__getitem__)
    assert lines[largest] <= total / 4, f"{largest}: {lines[largest]} of {total} lines"


def test_the_checker_sees_a_lazy_circle(tmp_path, monkeypatch):
    """The graph is not vacuous: a circle through a function-level import is found."""
    pkg = tmp_path / "sorl_megatron"
    (pkg / "common").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "common" / "__init__.py").write_text("")
    (pkg / "common" / "a.py").write_text("from .b import x\n")
    (pkg / "common" / "b.py").write_text("def x():\n    from . import a\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["_"]), "PACKAGE", pkg)
    assert _strongly_connected(import_graph()) == [["sorl_megatron.common.a", "sorl_megatron.common.b"]]


if __name__ == "__main__":  # pragma: no cover - a quick look at the graph
    for module, targets in sorted(import_graph().items()):
        print(module, "->", ", ".join(sorted(targets)))
    pytest.main([__file__])
