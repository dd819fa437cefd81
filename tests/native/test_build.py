"""weight_transfer.native.build.NativeKernel: build once into the cache, load, declare; refuse cleanly."""
import ctypes
import shutil

import pytest

from weight_transfer.native.build import NativeKernel

cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")),
                        reason="no C compiler on PATH")


def _declare(lib):
    lib.add3.argtypes = [ctypes.c_int64]
    lib.add3.restype = ctypes.c_int64


@cc
def test_builds_once_loads_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("WT_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "k.c"
    src.write_text("#include <stdint.h>\nint64_t add3(int64_t x) { return x + 3; }\n")
    k = NativeKernel(src, stem="k", env="WT_TEST_NATIVE", flag_sets=[("-definitely-not-a-flag",), ("-O2", "-fPIC", "-shared")],
                     declare=_declare)
    assert k.status() == "ok" and k.lib().add3(4) == 7
    built = sorted((tmp_path / "cache").glob("k-*.so"))
    assert len(built) == 1  # the failing flag set left no file behind
    again = NativeKernel(src, stem="k", env="WT_TEST_NATIVE", flag_sets=k.flag_sets, declare=_declare)
    assert again.build() == built[0]  # cached: same key, no rebuild
    src.write_text("#include <stdint.h>\nint64_t add3(int64_t x) { return x + 30; }\n")
    changed = NativeKernel(src, stem="k", env="WT_TEST_NATIVE", flag_sets=k.flag_sets, declare=_declare)
    assert changed.lib().add3(4) == 34  # a changed source gets a fresh build
    assert len(list((tmp_path / "cache").glob("k-*.so"))) == 2


@cc
def test_build_error_and_missing_symbol_are_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("WT_CACHE_DIR", str(tmp_path))
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    k = NativeKernel(bad, stem="bad", env="WT_TEST_NATIVE", flag_sets=[("-O2", "-fPIC", "-shared")], declare=_declare)
    assert k.lib() is None and "failed to build bad.c" in k.status()
    nosym = tmp_path / "nosym.c"
    nosym.write_text("int other(void) { return 1; }\n")
    k = NativeKernel(nosym, stem="nosym", env="WT_TEST_NATIVE", flag_sets=[("-O2", "-fPIC", "-shared")], declare=_declare)
    assert k.lib() is None and "add3" in k.status()


def test_disabled_by_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WT_TEST_NATIVE", "0")
    k = NativeKernel(tmp_path / "never_read.c", stem="x", env="WT_TEST_NATIVE", flag_sets=[()], declare=_declare)
    assert k.lib() is None and k.status() == "disabled by WT_TEST_NATIVE=0"


def test_no_compiler(tmp_path, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    k = NativeKernel(tmp_path / "k.c", stem="k", env="WT_TEST_NATIVE", flag_sets=[()], declare=_declare)
    assert k.lib() is None and "no C compiler" in k.status()
