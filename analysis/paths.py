"""Where the analysis and the harness (``weight_transfer.experiments.paths``) read and write
``results/``: the checkout they run from, or the current directory when they run from an
installed wheel (whose modules live in site-packages, where no results belong). Kept free of
torch so that the command line stays fast to start."""
from __future__ import annotations

from pathlib import Path

__all__ = ["project_dir"]


def project_dir() -> Path:
    """The source checkout (the folder holding ``pyproject.toml`` beside ``analysis/``), else
    the current working directory."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "analysis").is_dir() else Path.cwd()
