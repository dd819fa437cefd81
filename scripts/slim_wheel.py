"""Drop parts of a wheel the GPU check does not use, so the wheels fit in what one device call
carries (64 MiB together with the working tree).

    python scripts/slim_wheel.py WHEEL [WHEEL ...]

For each ``nixl_cu12`` / ``nixl_cu13`` wheel, rewritten in place: the ``nixl_ep_cu*`` package
(NIXL's expert-parallel kernels, one 31 MB extension per torch minor: 26.6 MiB of the 56 MiB
``nixl-cu13`` 1.5.1 wheel, never imported by ``nixl_cu*._api`` or by this project) and the
C++ headers under ``*.data/headers/`` go, with their lines of ``*.dist-info/RECORD`` (pip
installs a wheel from its RECORD, so the two must agree). Every other wheel is left alone.
Prints one line per wheel (MiB before -> after). Exit status 0, or 2 when a file is not a
readable wheel. Standard library only.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import zipfile
from pathlib import Path

SLIM = re.compile(r"^nixl_cu1\d-")
"""Wheels that are slimmed (file name prefix)."""
DROP = re.compile(r"^(nixl_ep_cu\d+/|[^/]+\.data/headers/)")
"""Archive paths dropped from them."""


def slim(path: Path) -> tuple[int, int, int]:
    """Rewrite wheel ``path`` without the :data:`DROP` paths; returns (bytes before, bytes after,
    files dropped). A wheel not matching :data:`SLIM` is not touched (dropped = 0)."""
    before = path.stat().st_size
    if not SLIM.match(path.name):
        return before, before, 0
    with zipfile.ZipFile(path) as zin:
        infos = zin.infolist()
        drop = {i.filename for i in infos if DROP.match(i.filename)}
        if not drop:
            return before, before, 0
        fd, tmp = tempfile.mkstemp(suffix=".whl", dir=path.parent)
        os.close(fd)
        try:
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zout:
                for i in infos:
                    if i.filename in drop:
                        continue
                    data = zin.read(i.filename)
                    if i.filename.endswith(".dist-info/RECORD"):
                        lines = data.decode().splitlines(keepends=True)
                        data = "".join(l for l in lines if l.split(",", 1)[0] not in drop).encode()
                    zout.writestr(i, data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    return before, path.stat().st_size, len(drop)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python scripts/slim_wheel.py WHEEL [WHEEL ...]", file=sys.stderr)
        return 2
    for a in argv:
        try:
            b, n, k = slim(Path(a))
        except (OSError, zipfile.BadZipFile) as e:
            print(f"error: {a}: {e}", file=sys.stderr)
            return 2
        note = f"dropped {k} files (nixl_ep, headers)" if k else "unchanged"
        print(f"  {Path(a).name}: {b / 2**20:.1f} -> {n / 2**20:.1f} MiB, {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
