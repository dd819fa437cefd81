"""The import graph: the library (``reference/``, installed as ``weight_transfer``) imports
nothing from the harness (``weight_transfer.engines``, ``.baselines``, ``.experiments``,
``.analysis``), the harness follows DESIGN.md's arrows, no module imports another in a cycle,
no module of any package folder is over 600 lines (DESIGN.md; issue 41: the harness too), no
function of the harness's ``experiments/``, ``engines/`` or ``scripts/`` is over 100 lines, and no
code uses the old top-level names.

Every import counts: absolute ones, relative ones (``from .x import y``, and ``from . import x``,
which names a module, not an attribute), and those inside functions."""
import ast
import re
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from tests.helpers import ROOT

FOLDERS = {"reference": "weight_transfer", "engines": "weight_transfer.engines",
           "baselines": "weight_transfer.baselines", "experiments": "weight_transfer.experiments",
           "analysis": "weight_transfer.analysis"}
"""Source folder -> installed package (pyproject.toml: [tool.setuptools] package-dir)."""
COMPONENT = {v: k for k, v in FOLDERS.items()} | {"weight_transfer.testing": "testing"}
"""Installed package -> component; ``weight_transfer.testing`` (``reference/testing/``: the
catalog, synthetic weights, model builders) is a component of its own: fixtures, not library."""
REFERENCE = ROOT / "reference"
MAX_LINES = 600
MODULES = sorted(REFERENCE.rglob("*.py"))


def module_name(path: Path) -> str:
    """The installed name of a source file (``engines/vllm/worker/runtime.py`` ->
    ``weight_transfer.engines.vllm.worker.runtime``; a package's ``__init__`` is the package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join([FOLDERS[parts[0]], *parts[1:]])


def component(name: str) -> str | None:
    """The design card's folder a module name belongs to (None outside the project)."""
    if name != "weight_transfer" and not name.startswith("weight_transfer."):
        return None
    for pkg in sorted(COMPONENT, key=len, reverse=True):
        if name == pkg or name.startswith(pkg + "."):
            return COMPONENT[pkg]
    return None


def _imported(path: Path, known: set[str] | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative ones resolved; for
    ``from P import x`` also ``P.x`` when that is a module of the project (``known``)."""
    name = module_name(path)
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.append((node.lineno, mod))
            for a in node.names:
                if known is not None and f"{mod}.{a.name}" in known:
                    out.append((node.lineno, f"{mod}.{a.name}"))
    return out


def _files() -> list[Path]:
    return [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]


def test_the_walk_finds_the_modules():
    names = {p.relative_to(REFERENCE).as_posix() for p in MODULES}
    assert {"types.py", "pipeline/executor.py", "plan/__init__.py", "plan/schedule.py"} <= names
    assert module_name(ROOT / "engines" / "vllm" / "worker" / "runtime.py") == "weight_transfer.engines.vllm.worker.runtime"
    assert module_name(REFERENCE / "plan" / "__init__.py") == "weight_transfer.plan"


def test_resolves_relative_imports():
    got = {m for _, m in _imported(REFERENCE / "plan" / "schedule.py")}
    assert "weight_transfer.types" in got and "weight_transfer.plan.recipes" in got
    known = {module_name(p) for p in _files()}
    got = {m for _, m in _imported(ROOT / "experiments" / "sim" / "layout_map.py", known)}
    assert "weight_transfer.experiments.sim.run" in got  # ``from . import run`` names the module


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(REFERENCE).as_posix())
def test_reference_imports_nothing_from_the_harness(path):
    mine = component(module_name(path))
    ok = (None, "reference") if mine == "reference" else (None, "reference", "testing")
    bad = [f"line {n}: {m}" for n, m in _imported(path) if component(m) not in ok]
    assert not bad, f"{path.relative_to(ROOT)} imports from the harness or the test fixtures: {bad}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(REFERENCE).as_posix())
def test_reference_module_at_most_600_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines (at most {MAX_LINES})"


# ---- rooms in the harness (issue 41): every package folder's modules, and functions -----------

MAX_FUNCTION_LINES = 100
HARNESS = sorted(p for folder in FOLDERS if folder != "reference" for p in (ROOT / folder).rglob("*.py"))
"""Every module of the package folders other than the library (which the test above holds)."""
ROOMY = sorted(p for folder in ("experiments", "engines", "scripts") for p in (ROOT / folder).rglob("*.py"))
"""The folders whose functions are held to :data:`MAX_FUNCTION_LINES`."""


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``name (line N): L lines`` for every ``def`` / ``async def`` of ``path`` (nested ones
    included, each measured alone: ``end_lineno - lineno + 1``, its decorators not counted)
    longer than ``limit`` lines."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                out.append(f"{node.name} (line {node.lineno}): {n} lines")
    return out


def test_the_limits_walk_finds_the_folders():
    names = {p.relative_to(ROOT).as_posix() for p in HARNESS}
    assert {"experiments/sweep.py", "engines/engine.py", "baselines/__init__.py"} <= names
    assert not any(n.startswith("reference/") for n in names)
    roomy = {p.relative_to(ROOT).as_posix() for p in ROOMY}
    assert {"experiments/sweep.py", "engines/engine.py", "scripts/netns_trial.py"} <= roomy


def test_long_functions_measures_nested_and_async_defs(tmp_path):
    body = "\n".join(f"    x = {i}" for i in range(98))
    src = (f"def short():\n{body}\n\n\n"  # 99 lines
           f"async def long():\n{body}\n    y = 1\n    z = 2\n\n\n"  # 101 lines
           f"class C:\n    def outer(self):\n        def inner():\n"
           + "\n".join(f"            x = {i}" for i in range(100)) + "\n        return inner\n")
    f = tmp_path / "m.py"
    f.write_text(src)
    got = long_functions(f)
    # not ``short`` (99 lines); ``outer`` counts its nested ``inner``, which is measured alone as well
    assert got == ["long (line 102): 101 lines", "outer (line 206): 103 lines", "inner (line 207): 101 lines"]


@pytest.mark.parametrize("path", HARNESS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_harness_module_at_most_600_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines (at most {MAX_LINES})"


@pytest.mark.parametrize("path", ROOMY, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_function_over_100_lines(path):
    long = long_functions(path)
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {'; '.join(long)}"


# ---- the whole project: DESIGN.md's arrows, and no cycle between modules ----------------------

ALLOWED = {
    "reference": {"reference"},
    "testing": {"testing", "reference"},
    "engines": {"engines", "reference", "testing"},
    "baselines": {"baselines", "reference", "engines", "testing"},
    "experiments": {"experiments", "reference", "baselines", "engines", "analysis", "testing"},
    "analysis": {"analysis"},
}
"""DESIGN.md: experiments -> {reference, baselines, engines}, baselines -> {reference, engines},
engines -> reference, analysis -> results files only. experiments may call analysis's plotting
(the simulation draws its own figures, the command hands ``analyze`` / ``timeline`` to it);
analysis imports no transfer code. The library never imports the fixtures (``testing``); the
harness does (models from the catalog, synthetic weights)."""


def graph_of(files: list[Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a package attribute resolves to the longest
    known module prefix)."""
    names = {module_name(p) for p in files}
    graph = {}
    for p in files:
        deps = set()
        for _, m in _imported(p, names):
            while m and m not in names:
                m = m.rpartition(".")[0]
            if m and m != module_name(p):
                deps.add(m)
        graph[module_name(p)] = deps
    return graph


def cycles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles; a package's ``__init__`` importing its own submodules is not one."""
    graph = {a: {b for b in deps if not b.startswith(a + ".")} for a, deps in graph.items()}
    state, cycles = {}, []

    def visit(n, path):
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycles.append(path[path.index(m):] + [m])
            elif m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return cycles


def test_package_arrows_follow_the_design():
    bad = [f"{a} -> {b}" for a, deps in graph_of(_files()).items() for b in deps
           if component(b) not in ALLOWED[component(a)]]
    assert not bad, bad


def test_no_import_cycle_between_modules():
    cycles = cycles_of(graph_of(_files()))
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


def test_a_planted_relative_cycle_is_found(tmp_path, monkeypatch):
    """``from . import x`` closing a cycle (the kind the walk once missed: sim/layout_map.py <->
    sim/run.py) is reported."""
    pkg = tmp_path / "experiments" / "toy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n    return b\n")
    (pkg / "b.py").write_text("from .a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    files = sorted(pkg.glob("*.py"))
    assert cycles_of(graph_of(files)) == [["weight_transfer.experiments.toy.a", "weight_transfer.experiments.toy.b",
                                           "weight_transfer.experiments.toy.a"]]


def test_no_old_top_level_names():
    """Nothing imports ``reference``, ``engines``, ``baselines``, ``experiments`` or ``analysis``
    as top-level packages (the installed names are under ``weight_transfer``)."""
    old = set(FOLDERS)
    bad = []
    for p in _files() + sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            bad += [f"{p.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in old]
    assert not bad, bad


def test_tests_mirror_the_package_and_import_no_other_test():
    """Every test module is ``tests/<package path>/test_<module>.py`` (library modules at
    ``tests/``, a subpackage's under its path, e.g. ``tests/plan/test_local.py`` for
    ``weight_transfer.plan.local``; ``tests/project`` and ``tests/scripts`` for the checkout
    itself), and imports no other test module: shared code lives in ``tests/helpers``."""
    tests = ROOT / "tests"
    bad = []
    for p in sorted(tests.rglob("*.py")):
        rel = p.relative_to(tests)
        if rel.parts[0] == "helpers" or p.name in ("__init__.py", "conftest.py"):
            continue
        if not p.name.startswith("test_"):
            bad.append(f"{rel}: not a test module and not in tests/helpers")
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{rel}:{node.lineno}: imports {m}" for m in mods
                    if (m.startswith("tests.") and not m.startswith("tests.helpers")) or m.split(".")[0].startswith("test_")]
    for d in sorted(q for q in tests.rglob("*") if q.is_dir() and q.name != "__pycache__"):
        rel = d.relative_to(tests)
        if rel.parts[0] in ("helpers", "project", "scripts", "data"):
            continue
        src = ROOT / rel if rel.parts[0] in FOLDERS else REFERENCE / rel
        if not (src / "__init__.py").exists():
            bad.append(f"tests/{rel.as_posix()}: mirrors no package of the project ({src.relative_to(ROOT)})")
    assert not bad, bad


# The library's rooms.
#
# The library's rooms (``reference/``, installed as ``weight_transfer``): one folder per
# concern, each ``__init__`` saying what it owns and, on its ``Imports:`` line, which other rooms
# and top-level modules it may import. This test holds the code to those lines: every import of
# every module (relative or absolute, inside functions too) stays in its room or goes to one its
# room declares; the declarations form no cycle, so imports run one way; the top level keeps at
# most 12 modules. The top-level modules' own allowances are :data:`TOP_LEVEL` below.
#
# docs/HOW_IT_WORKS.md draws the same rooms from a ``push()`` to the bytes in the engine.


TOP_LEVEL = {
    "types": set(), "args": set(), "timeline": set(), "errors": {"types"}, "model_config": {"types"},
    "metrics": {"args"}, "options": {"transport"}, "method": {"types", "options", "control", "api"},
}
"""Top-level module -> what it may import (``__init__`` imports its public names lazily, by name)."""
MAX_TOP_LEVEL = 12


def room_of(name: str) -> str | None:
    """The room (or top-level module) of an installed module name; ``__init__`` for the package
    itself; None outside the library."""
    parts = name.split(".")
    if parts[0] != "weight_transfer":
        return None
    return "__init__" if len(parts) == 1 else parts[1]


def declared(init_source: str) -> set[str] | None:
    """The rooms an ``__init__`` docstring's ``Imports:`` line names (``set()`` for "nothing of
    the package"); None when it has no such line."""
    doc = ast.get_docstring(ast.parse(init_source)) or ""
    m = re.search(r"^Imports: (.*(?:\n(?!\n).*)*)", doc, re.M)
    if m is None:
        return None
    return set(re.findall(r"``(\w+)``", m.group(1)))


def rooms() -> dict[str, set[str]]:
    """Every room and top-level module -> what it may import."""
    out = dict(TOP_LEVEL)
    for init in sorted(REFERENCE.glob("*/__init__.py")):
        out[init.parent.name] = declared(init.read_text())
    return out


def violations(allowed: dict[str, set[str]], imports) -> list[str]:
    """``file:line: room -> module`` for every import in ``imports`` (``(path, line, importing
    module, imported module)``) that leaves its room for one the room does not declare."""
    bad = []
    for path, line, src, dst in imports:
        a, b = room_of(src), room_of(dst)
        if b is None or a == b or a == "__init__" or b.startswith("engines") or b in ("experiments", "baselines",
                                                                                     "analysis"):
            continue
        if b not in allowed.get(a, set()):
            bad.append(f"{path}:{line}: {a} -> {dst}")
    return bad


def _all_imports():
    known = {module_name(p) for p in MODULES}
    for p in MODULES:
        for line, m in _imported(p, known):
            yield p.relative_to(REFERENCE.parent), line, module_name(p), m


def test_every_room_declares_what_it_imports():
    missing = [room for room, deps in rooms().items() if deps is None]
    assert not missing, f"rooms without an `Imports:` line in their __init__ docstring: {missing}"
    unknown = {room: deps - set(rooms()) for room, deps in rooms().items() if deps - set(rooms())}
    assert not unknown, f"`Imports:` names what is no room or top-level module: {unknown}"


def test_imports_run_one_way_between_the_rooms():
    assert not violations(rooms(), _all_imports())
    try:
        order = list(TopologicalSorter(rooms()).static_order())
    except CycleError as e:
        pytest.fail(f"the rooms' declared imports form a cycle: {e.args[1]}")
    assert order.index("types") < order.index("plan") < order.index("api")


def test_the_checker_catches_an_import_against_the_direction():
    allowed = {"delta": {"types"}, "api": {"delta", "types"}, "types": set()}
    imports = [("reference/delta/runs.py", 3, "weight_transfer.delta.runs", "weight_transfer.api.receiver"),
               ("reference/delta/runs.py", 4, "weight_transfer.delta.runs", "weight_transfer.types"),
               ("reference/api/x.py", 5, "weight_transfer.api.x", "weight_transfer.delta.masks")]
    assert violations(allowed, imports) == ["reference/delta/runs.py:3: delta -> weight_transfer.api.receiver"]
    with pytest.raises(CycleError):
        list(TopologicalSorter({"a": {"b"}, "b": {"a"}}).static_order())
    assert declared('"""x\n\nImports: ``types``, ``native``.\n"""') == {"types", "native"}
    assert declared('"""x\n\nImports: nothing of the package.\n"""') == set()
    assert declared('"""x"""') is None


def test_the_top_level_keeps_few_modules():
    top = sorted(p.name for p in REFERENCE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top
    assert {p.removesuffix(".py") for p in top} - {"__init__"} == set(TOP_LEVEL)
