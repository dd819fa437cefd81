"""The import graph of reference/: it imports nothing from the harness (engines/, baselines/,
experiments/, analysis/), and no module is over 600 lines (DESIGN.md)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "reference"
UPWARD = ("engines", "baselines", "experiments", "analysis")
MAX_LINES = 600
MODULES = sorted(REFERENCE.rglob("*.py"))


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative ones resolved."""
    pkg = path.relative_to(ROOT).with_suffix("").parts[:-1]  # the package the module is in
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(pkg[:len(pkg) - node.level + 1]) if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.append((node.lineno, mod))
    return out


def test_the_walk_finds_the_modules():
    names = {p.relative_to(REFERENCE).as_posix() for p in MODULES}
    assert {"types.py", "executor.py", "plan/__init__.py", "plan/schedule.py"} <= names


def test_resolves_relative_imports():
    got = dict((m, n) for n, m in _imported(REFERENCE / "plan" / "schedule.py"))
    assert "reference.types" in got and "reference.plan.recipes" in got


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(REFERENCE).as_posix())
def test_reference_imports_nothing_from_the_harness(path):
    bad = [f"line {n}: {m}" for n, m in _imported(path) if m.split(".")[0] in UPWARD]
    assert not bad, f"{path.relative_to(ROOT)} imports from the harness: {bad}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(REFERENCE).as_posix())
def test_reference_module_at_most_600_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines (at most {MAX_LINES})"


# ---- the whole project: DESIGN.md's arrows, and no cycle between modules ----------------------

PACKAGES = ("reference", "engines", "baselines", "experiments", "analysis")
ALLOWED = {
    "reference": {"reference"},
    "engines": {"engines", "reference"},
    "baselines": {"baselines", "reference", "engines"},
    "experiments": {"experiments", "reference", "baselines", "engines", "analysis"},
    "analysis": {"analysis"},
}
"""DESIGN.md: experiments -> {reference, baselines, engines}, baselines -> {reference, engines},
engines -> reference, analysis -> results files only. experiments may call analysis's plotting
(the simulation draws its own figures); analysis imports no transfer code."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    names = {_module_name(p) for p in files}
    graph = {}
    for p in files:
        deps = set()
        for _, m in _imported(p):
            # an import of a package attribute resolves to the longest known module prefix
            while m and m not in names:
                m = m.rpartition(".")[0]
            if m and m != _module_name(p):
                deps.add(m)
        graph[_module_name(p)] = deps
    return graph


def test_package_arrows_follow_the_design():
    bad = [f"{a} -> {b}" for a, deps in _graph().items() for b in deps
           if b.split(".")[0] not in ALLOWED[a.split(".")[0]]]
    assert not bad, bad


def test_no_import_cycle_between_modules():
    """Every import counts, also one inside a function: a lazy import that closes a cycle is
    still a cycle in the design. A package's ``__init__`` importing its own submodules is not."""
    graph = _graph()
    for a, deps in graph.items():  # a package re-exporting its submodules is not a cycle
        graph[a] = {b for b in deps if not b.startswith(a + ".")}
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
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)
