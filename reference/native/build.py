"""C kernels compiled on first use and loaded with ctypes: :class:`NativeKernel`.

Two hot loops of this project are hand-written C: the FP8 block quantizer
(:mod:`weight_transfer.convert.quant`, ``_fp8_cpu.c``) and the planner's sender choice
(:mod:`weight_transfer.plan.assign`, ``plan/_greedy.c``). Both are built the same way, here: with the
system C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``), once per machine, into a cache
folder keyed by the source, the flags, the compiler and the CPU, so a changed source or a
different CPU gets a fresh build; concurrent builders each write a private file and rename it
into place. No compiler, a failed build or the kernel's environment switch set to ``0``: the
kernel reports why (:meth:`NativeKernel.status`) and its caller uses its Python path.

Why not a build backend (setuptools ``Extension``, ``torch.utils.cpp_extension``): the package
installs as pure Python (``pip install -e .`` with no compiler needed, as CI and the README's
first command do), and ``cpp_extension`` would pull in ninja and C++ for two C files; a
ctypes load of a cached shared object is a page of code and falls back cleanly.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["NativeKernel", "cache_dir", "cpu_signature"]


def cpu_signature() -> str:
    """What compiled code depends on: the CPU model and its feature flags (``/proc/cpuinfo``)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [l for l in lines if l.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """``$WT_CACHE_DIR``, else ``$XDG_CACHE_HOME/weight-transfer`` (``~/.cache``), else a
    per-user folder in the temp directory when those are not writable. Created if missing."""
    if os.environ.get("WT_CACHE_DIR"):
        d = Path(os.environ["WT_CACHE_DIR"])
    else:
        d = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "weight-transfer"
    try:
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    d = Path(tempfile.gettempdir()) / f"weight-transfer-{os.getuid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


class NativeKernel:
    """One C source, compiled on first use and loaded once per process (thread-safe).

    ``src``: the ``.c`` file; ``stem``: the cached object's name prefix; ``flag_sets``: compiler
    flags to try in order (e.g. with and without ``-march=native``), the first that builds
    wins; ``libs``: extra link arguments (``-lm``); ``env``: the variable that disables the
    kernel when set to ``0``; ``declare``: sets ``argtypes`` / ``restype`` on the loaded
    library. :meth:`lib` returns the ``ctypes.CDLL`` or None; :attr:`error` says why not."""

    def __init__(self, src: Path, *, stem: str, flag_sets: Sequence[Sequence[str]], env: str,
                 declare: Callable[[ctypes.CDLL], None], libs: Sequence[str] = ()):
        self.src, self.stem, self.env = src, stem, env
        self.flag_sets = [tuple(f) for f in flag_sets]
        self.libs, self.declare = tuple(libs), declare
        self._lock = threading.Lock()
        self.loaded: ctypes.CDLL | None = None
        self.error: str | None = None

    def build(self) -> Path:
        """The compiled shared object's path, building it if the cache lacks it. Raises
        RuntimeError without a compiler or when every flag set fails (the compiler's last
        400 characters of stderr in the message)."""
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if not cc:
            raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
        key = hashlib.sha256(b"\0".join([self.src.read_bytes(), " ".join(self.flag_sets[0]).encode(), cc.encode(),
                                           cpu_signature().encode()])).hexdigest()[:20]
        so = cache_dir() / f"{self.stem}-{key}.so"
        if so.exists():
            return so
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
        os.close(fd)
        try:
            for flags in self.flag_sets:
                r = subprocess.run([cc, *flags, str(self.src), "-o", tmp, *self.libs], capture_output=True, text=True,
                                   check=False)
                if r.returncode == 0:
                    os.replace(tmp, so)
                    return so
            raise RuntimeError(f"{cc} failed to build {self.src.name}: {r.stderr.strip()[-400:]}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def lib(self) -> ctypes.CDLL | None:
        """The loaded library, or None (reason in :attr:`error`). Built once per process."""
        if self.loaded is not None or self.error is not None:
            return self.loaded
        with self._lock:
            if self.loaded is None and self.error is None:
                if os.environ.get(self.env, "1") == "0":
                    self.error = f"disabled by {self.env}=0"
                else:
                    try:
                        lib = ctypes.CDLL(str(self.build()))
                        self.declare(lib)
                        self.loaded = lib
                    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                        self.error = str(e)
        return self.loaded

    def status(self) -> str:
        """``"ok"`` when the kernel is loaded, else why not (no compiler, build error, disabled)."""
        return "ok" if self.lib() is not None else str(self.error)
