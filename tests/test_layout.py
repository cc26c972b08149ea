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
    "weight_sync": 5,  # trainer -> server weight sync; the server side uses its group and wire
    "sglang_cpu": 5,  # the CPU SGLang-compatible server: the trainer starts it by module name, never imports it
    "trainer": 6,
    "toy_demo": 6,  # the toy demo: the algorithm core alone
    "train": 7,
    "cluster": 7,  # the Slurm launcher (TorchX)
    "study": 7,  # the stability study: grid runner and indicator analysis
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
        packages.setdefault(_top(module), set()).update(
            _top(t) for t in targets if _top(t) != _top(module))
    assert _strongly_connected(packages) == []


def test_every_import_points_down_the_layers():
    graph = import_graph()
    unknown = sorted({_top(m) for m in graph} - set(LAYERS))
    assert not unknown, f"packages without a layer in tests/test_layout.py: {unknown}"
    upward = sorted(
        f"{m} -> {t}" for m, targets in graph.items() for t in targets if LAYERS[_top(t)] > LAYERS[_top(m)]
    )
    assert upward == []


# The trainer's rooms, lower floors first: a module may import its own room or a lower floor.
# ``rerun`` (where a rerun picks up; the run directory's markers), ``engines``, ``checkpoints``
# and ``rl_loop`` (the loop) are single modules at the trainer's top level.
TRAINER_FLOORS = {
    "recipe": 0,  # schema, loader, checks, memory plan
    "metrics": 0,  # metrics log, plots, indicators, timers
    "groups": 0,  # prompt stream, group bookkeeping, the rollout phase and its scores
    "rerun": 1,
    "engines": 1,  # the run's actor, reference and critic, built from the recipe
    "checkpoints": 1,  # the run's RL checkpoints
    "serving": 1,  # rank 0's connections, the fleet, the embedded servers
    "stages": 2,  # SFT, PVPO's reference pass
    "sources": 3,  # one rollout source per mode
    "rl_loop": 4,
    "": 4,  # trainer/__init__.py
}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "trainer" else ""


def test_the_trainer_is_in_rooms_and_every_import_points_down_its_floors():
    graph = import_graph()
    trainer = {m: {t for t in targets if _top(t) == "trainer"} for m, targets in graph.items() if _top(m) == "trainer"}
    flat = sorted(m for m in trainer if m.count(".") == 2 and _room(m) not in TRAINER_FLOORS)
    assert flat == [], f"trainer modules outside a room (add a room or a floor in tests/test_layout.py): {flat}"
    unknown = sorted({_room(m) for m in trainer} - set(TRAINER_FLOORS))
    assert unknown == [], f"trainer rooms without a floor in tests/test_layout.py: {unknown}"
    upward = sorted(f"{m} -> {t}" for m, targets in trainer.items() for t in targets
                    if TRAINER_FLOORS[_room(t)] > TRAINER_FLOORS[_room(m)])
    assert upward == []
    rooms: dict[str, set[str]] = {}
    for m, targets in trainer.items():
        rooms.setdefault(_room(m), set()).update(_room(t) for t in targets if _room(t) != _room(m))
    assert _strongly_connected(rooms) == []


def test_the_room_checker_sees_an_arrow_up(monkeypatch):
    """The floors are not vacuous: a recipe module importing the rollout sources is found."""
    graph = import_graph()
    graph["sorl_megatron.trainer.recipe.config"] = graph["sorl_megatron.trainer.recipe.config"] | {
        "sorl_megatron.trainer.sources.modes"}
    monkeypatch.setattr(__import__(__name__, fromlist=["_"]), "import_graph", lambda: graph)
    with pytest.raises(AssertionError, match="recipe.config -> sorl_megatron.trainer.sources.modes"):
        test_the_trainer_is_in_rooms_and_every_import_points_down_its_floors()


def test_the_trainer_never_imports_the_cpu_server():
    """The trainer talks to rollout servers over HTTP only, SGLang's or the CPU one, which it starts
    as a subprocess by module name (trainer/serving/servers.py): it must not import it."""
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


MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 380
REPO = PACKAGE.parent


def test_no_module_or_class_is_a_hub():
    """A module over 600 lines or a class over 380 mixes owners: cut it by who owns the state (a
    smoke alarm: a module near its cap is cut along an owner, never trimmed to pass)."""
    big = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            big.append(f"{path.relative_to(REPO)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{path.relative_to(REPO)}::{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert big == []


def _attribute_reads(path: pathlib.Path, names: set[str], owner: str = "rollout") -> list[int]:
    """Lines of ``path`` that read ``<anything>.<owner>.<name>`` for a name in ``names``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Attribute)
                and node.value.attr == owner):
            out.append(node.lineno)
    return out


def _reads_outside(path: pathlib.Path, names: set[str], owner: str, picker: str | None) -> list[int]:
    """``_attribute_reads`` of ``path`` outside the function ``picker`` (None: anywhere)."""
    allowed: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef) and node.name == picker:
            allowed.update(range(node.lineno, node.end_lineno + 1))
    return [n for n in _attribute_reads(path, names, owner) if n not in allowed]


def test_the_trainer_never_branches_on_the_rollout_mode_or_the_sync_transport():
    """``rollout.mode`` is read by the one function that picks the rollout source (nothing else in
    the trainer) and ``rollout.weight_sync.transport`` by the one that picks the transport
    (nothing else in the package)."""
    for path in sorted((PACKAGE / "trainer").rglob("*.py")):
        reads = _reads_outside(path, {"mode"}, "rollout", "source_class" if path.name == "modes.py" else None)
        assert reads == [], f"{path.relative_to(REPO)} reads rollout.mode at lines {reads}"
    for path in sorted(PACKAGE.rglob("*.py")):
        picker = "transport_class" if path.relative_to(PACKAGE).as_posix() == "weight_sync/factory.py" else None
        reads = _reads_outside(path, {"transport"}, "weight_sync", picker)
        assert reads == [], f"{path.relative_to(REPO)} reads rollout.weight_sync.transport at lines {reads}"


def test_the_checker_sees_a_mode_branch(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def f(cfg):\n    return cfg.rollout.mode == 'async'\n")
    assert _attribute_reads(path, {"mode"}) == [2]
    path.write_text("def make_weight_sync(s):\n    return s.weight_sync.transport\n"
                    "def g(cfg):\n    return cfg.rollout.weight_sync.transport\n")
    assert _reads_outside(path, {"transport"}, "weight_sync", "make_weight_sync") == [4]


def _tracked_files() -> list[pathlib.Path]:
    import subprocess

    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / line for line in out.splitlines() if line and (REPO / line).is_file()]


def test_no_file_points_outside_the_repository():
    """Papers are cited by title and arXiv id: a user of this repository has none of the files outside it."""
    needle = "shared" + "/"
    found = []
    for path in _tracked_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if needle in line and "/dev/shm" not in line:
                found.append(f"{path.relative_to(REPO)}:{i}")
    assert found == []


COLLECTIVES = {
    "all_reduce", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list", "barrier",
    "reduce_scatter", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
    "gather", "scatter", "reduce", "send", "recv", "isend", "irecv", "gather_object", "scatter_object_list",
}


def _direct_collectives(path: pathlib.Path) -> list[str]:
    """``torch.distributed.<collective>(...)`` / ``dist.<collective>(...)`` calls in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in COLLECTIVES:
            continue
        owner = ast.unparse(node.func.value)
        if owner in ("torch.distributed", "dist"):
            found.append(f"{path.name}:{node.lineno} {owner}.{node.func.attr}")
    return found


def test_every_collective_goes_through_the_comm_module():
    """NCCL takes CUDA tensors only; ``common/comm.py`` puts each collective's tensors on the
    group's device, so no other module calls a ``torch.distributed`` collective itself."""
    found = [c for path in PACKAGE.rglob("*.py") if path.name != "comm.py" or path.parent.name != "common"
             for c in _direct_collectives(path)]
    assert found == []


def test_the_checker_sees_a_direct_collective(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("import torch\ndef f(t):\n    torch.distributed.all_reduce(t)\n")
    assert _direct_collectives(path) == ["x.py:3 torch.distributed.all_reduce"]


if __name__ == "__main__":  # pragma: no cover - a quick look at the graph
    for module, targets in sorted(import_graph().items()):
        print(module, "->", ", ".join(sorted(targets)))
    pytest.main([__file__])
