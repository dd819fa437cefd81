"""Where the harness reads and writes ``results/``: :func:`weight_transfer.analysis.paths.project_dir`
(the checkout, or the current directory for an installed wheel), shared so both agree."""
from __future__ import annotations

from weight_transfer.analysis.paths import project_dir

__all__ = ["project_dir"]
