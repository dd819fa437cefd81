"""Where the analysis reads and writes ``results/``: the checkout it runs from, or the current
directory when it runs from an installed wheel (whose modules live in site-packages, where no
results belong). Kept free of torch so that the command line stays fast to start."""
from __future__ import annotations

from pathlib import Path

__all__ = ["project_dir"]


def project_dir() -> Path:
    """The source checkout (the folder holding ``pyproject.toml`` beside ``analysis/``), else
    the current working directory."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "analysis").is_dir() else Path.cwd()
