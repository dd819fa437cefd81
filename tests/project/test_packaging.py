"""Packaging: the distribution ``weight-transfer`` installs one top-level package,
``weight_transfer`` (DESIGN.md; pyproject.toml's ``[tool.setuptools] package-dir`` maps the
design card's folders), as an editable install and as a built wheel, with one console script."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.helpers import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUP = PYPROJECT["tool"]["setuptools"]
GENERIC = {"reference", "engines", "baselines", "experiments", "analysis"}


def test_every_subpackage_is_mapped():
    """Every folder with an ``__init__.py`` is listed under its installed name (a new
    subpackage left out of pyproject.toml would be missing from the wheel)."""
    dirs = {v: k for k, v in SETUP["package-dir"].items()}
    want = set()
    for folder, pkg in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            want.add(".".join([pkg, *rel]))
    assert set(SETUP["packages"]) == want
    assert {p.split(".")[0] for p in SETUP["packages"]} == {"weight_transfer"}


def test_console_script_runs():
    exe = Path(sys.executable).with_name("weight-transfer")
    assert PYPROJECT["project"]["scripts"]["weight-transfer"] == "weight_transfer.experiments.command:main"
    if not exe.exists():
        pytest.skip(f"the console script is not installed next to {sys.executable} (pip install -e .)")
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for cmd in ("run", "sweep", "simulate", "faults", "bench-quant", "bench-pipeline", "bench-transports",
                "bench-peers", "analyze", "timeline"):
        assert cmd in r.stdout, (cmd, r.stdout)


def test_wheel_installs_one_namespace(tmp_path):
    """Build the wheel, install it (no dependencies) into a fresh venv: the only top-level
    names are ``weight_transfer`` and its dist-info, it imports, and its light modules find
    ``results/`` in the current directory (not in site-packages)."""
    import shutil

    src = tmp_path / "src"  # a copy: setuptools leaves build/ in the tree it builds from
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    for folder in SETUP["package-dir"].values():
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                        str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = dist.glob("weight_transfer-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                        str(whl)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    top = {p.name for p in site.iterdir() if not p.name.startswith(("_", ".")) and p.name != "bin"}  # --target: scripts in bin/
    top_level = (next(site.glob("weight_transfer-*.dist-info")) / "top_level.txt").read_text().split()
    assert top_level == ["weight_transfer"], top_level
    assert not top & GENERIC, top
    assert {n for n in top if not n.endswith(".dist-info")} == {"weight_transfer"}, top
    assert (site / "weight_transfer" / "testing" / "configs" / "qwen3-30b-a3b.json").is_file()
    c_sources = sorted(p.relative_to(ROOT / "reference").as_posix() for p in (ROOT / "reference").rglob("*.c"))
    missing = [c for c in c_sources if not (site / "weight_transfer" / c).is_file()]  # the native kernels build on first use
    assert c_sources and not missing, f"C sources not in the wheel (pyproject package-data): {missing}"
    code = ("import weight_transfer, weight_transfer.experiments.paths as p, weight_transfer.analysis.paths as a; "
            "import os; print(weight_transfer.__file__); assert str(p.project_dir()) == os.getcwd() == str(a.project_dir())")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().startswith(str(site)), r.stdout
