"""``python -m weight_transfer.experiments``: the same as the ``weight-transfer`` command
(:mod:`weight_transfer.experiments.command`)."""
import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
