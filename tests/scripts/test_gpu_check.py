"""scripts/gpu_check.sh, gpu_wheels.sh, gpu_report.py and gpu_nixl_check.py: everything that can
be checked without a GPU (syntax, arguments, dry runs, the table and CSV writer). The GPU steps
themselves run on a GPU machine (docs/GPU.md), never here."""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

CHECK = ROOT / "scripts" / "gpu_check.sh"
WHEELS = ROOT / "scripts" / "gpu_wheels.sh"
STEPS = ["env", "install", "tests", "quant", "cuda_ipc", "nixl", "worker_cuda", "vllm_backends"]

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_report  # noqa: E402


def sh(*args, env=None, timeout=120):
    e = dict(os.environ, PYTHON=sys.executable)
    e.pop("OUT", None)
    e.update(env or {})
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, cwd=ROOT, env=e, check=False,
                          timeout=timeout)


@pytest.mark.parametrize("script", [CHECK, WHEELS])
def test_bash_syntax_and_help(script):
    assert sh("-n", script).returncode == 0
    r = sh(script, "--help")
    assert r.returncode == 0 and "Exit status" in r.stdout and "set -" not in r.stdout


def test_list_steps_and_time_budget():
    r = sh(CHECK, "--list")
    assert r.returncode == 0
    rows = [l.split() for l in r.stdout.splitlines()]
    assert [n for n, _ in rows] == STEPS
    assert sum(int(t) for _, t in rows) <= 10 * 60  # the whole check within 10 minutes
    assert dict((n, int(t)) for n, t in rows)["vllm_backends"] <= 120  # a modest limit for the newest step


@pytest.mark.parametrize("args, msg", [
    (["--bogus"], "unknown argument: --bogus"),
    (["--steps", "quant,foo"], "unknown step 'foo'"),
    (["--steps"], "--steps needs a value"),
    (["--steps="], "--steps needs a value"),
    (["--results"], "--results needs a value"),
    (["--python"], "--python needs a value"),
    (["--python", "/nonexistent/python3"], "--python '/nonexistent/python3' does not run"),
])
def test_bad_arguments_exit_2_before_anything_runs(args, msg, tmp_path):
    r = sh(CHECK, *args, "--dry-run")
    assert r.returncode == 2, r.stdout + r.stderr
    assert msg in r.stderr and "[dry-run]" not in r.stdout


def test_dry_run_prints_every_step_and_writes_only_the_table(tmp_path):
    out = tmp_path / "res"
    r = sh(CHECK, "--dry-run", "--results", out)
    assert r.returncode == 0, r.stderr
    for s in STEPS:
        assert f"[dry-run] {s} (limit" in r.stdout
    assert "0 passed, 0 failed, 8 skipped" in r.stdout
    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [x["step"] for x in rows] == STEPS and {x["status"] for x in rows} == {"SKIP"}
    assert sorted(p.name for p in out.iterdir()) == ["logs", "steps.tsv", "summary.csv", "table.txt"]
    assert "pip install -q --no-index --no-deps" in r.stdout  # the wheel path of the install step
    assert "--retries 1 --timeout 15" in r.stdout  # the registry path fails fast without network
    assert "still missing after the install" in r.stdout  # the install is checked, not trusted
    assert "run --device cuda --transport cuda_ipc" in r.stdout and "--timeout 60" in r.stdout
    assert "bench-quant --device cuda" in r.stdout
    # the vLLM worker engine's own registration over a CUDA module, through cuda_ipc (issue 42)
    wc = next(l for l in r.stdout.splitlines() if l.startswith("[dry-run] worker_cuda (limit"))
    assert "scripts/gpu_worker_receive.py --device cuda" in wc
    # vLLM's backends beside ours: only with a CUDA vLLM, else a SKIP saying why (exit 77)
    vb = next(l for l in r.stdout.splitlines() if l.startswith("[dry-run] vllm_backends (limit"))
    assert "scripts/gpu_vllm_backends.py --device cuda" in vb and "p.is_cuda()" in vb
    assert "skipped: no CUDA vLLM in" in vb and "exit 77" in vb
    # the tests step: only files with GPU-marked tests, and a skipped GPU test fails it
    tests_cmd = next(l for l in r.stdout.splitlines() if l.startswith("[dry-run] tests"))
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                   if "pytest.mark.gpu" in f.read_text())
    assert "tests/experiments/test_trial.py" in files and "tests/transport/test_cuda_ipc.py" in files
    assert sorted(w for w in tests_cmd.split() if w.startswith("tests/")) == files
    assert "gpu_report.py --junit" in tests_cmd and "-m gpu" in tests_cmd


def test_dry_run_without_results_leaves_results_gpu_alone():
    summary = ROOT / "results" / "gpu" / "summary.csv"
    before = summary.stat().st_mtime_ns if summary.exists() else None
    r = sh(CHECK, "--dry-run", "--steps", "quant")
    assert r.returncode == 0
    assert (summary.stat().st_mtime_ns if summary.exists() else None) == before


def test_selected_steps_only(tmp_path):
    r = sh(CHECK, "--dry-run", "--steps", "quant,nixl", "--results", tmp_path)
    assert "[dry-run] quant" in r.stdout and "[dry-run] nixl" in r.stdout
    assert "[dry-run] env" not in r.stdout and "[dry-run] tests" not in r.stdout


def test_gpu_steps_fail_loudly_without_a_gpu(tmp_path):
    """Not a dry run: quant, cuda_ipc and nixl run here for real, through a python wrapper that
    records what each step's environment holds. Without a GPU every one fails (never a silent
    pass), each with its reason as the table's headline; TRITON_INTERPRET is unset inside."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: these steps would run for real")
    seen = tmp_path / "seen.txt"
    wrapper = tmp_path / "py"
    wrapper.write_text(f'#!/bin/bash\necho "TRITON_INTERPRET=${{TRITON_INTERPRET-unset}} '
                       f'PYTHONPATH=$PYTHONPATH" >> {seen}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    res = tmp_path / "res"
    r = sh(CHECK, "--steps", "quant,cuda_ipc,nixl", "--results", res, "--python", wrapper,
           env={"TRITON_INTERPRET": "1"}, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    with open(res / "summary.csv") as f:
        rows = {x["step"]: x for x in csv.DictReader(f)}
    assert {k: v["status"] for k, v in rows.items()} == {"quant": "FAIL", "cuda_ipc": "FAIL", "nixl": "FAIL"}
    assert "torch.cuda.is_available() is False" in rows["quant"]["headline"]
    assert "device='cuda' but torch.cuda.is_available() is False" in rows["cuda_ipc"]["headline"]
    assert "needs a CUDA GPU" in rows["nixl"]["headline"]
    lines = seen.read_text().splitlines()  # the first: the script's check that --python runs
    assert all(l.startswith("TRITON_INTERPRET=unset ") for l in lines), lines
    assert sum(l.startswith(f"TRITON_INTERPRET=unset PYTHONPATH={ROOT}") for l in lines) >= 3, lines
    assert not (res / "main_cuda_ipc.csv").exists() and not (res / "quant_bench.csv").exists()


def test_vllm_backends_step_skips_without_a_cuda_vllm(tmp_path):
    """Not a dry run: the vllm_backends step runs here for real with a python whose ``import
    vllm`` fails (a stand-in module first on PYTHONPATH; fast). It is a SKIP, not a pass or a
    failure: the table's headline gives the reason, the script never started, exit status 0."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "vllm.py").write_text('raise ImportError("no vllm in this python (test)")\n')
    res = tmp_path / "res"
    r = sh(CHECK, "--steps", "vllm_backends", "--results", res, env={"PYTHONPATH": str(fake)})
    assert r.returncode == 0, r.stdout + r.stderr
    with open(res / "summary.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["step"], row["status"], row["exit_code"]) == ("vllm_backends", "SKIP", "77")
    assert row["headline"].startswith("skipped: no CUDA vLLM in ") and "no vllm in this python (test)" in row["headline"]
    assert "the H200 image has none" in row["headline"]
    assert not (res / "vllm_backends.csv").exists()


def test_worker_cuda_step_skips_without_cuda(tmp_path):
    """Not a dry run: the worker_cuda step runs here for real (scripts/gpu_worker_receive.py
    --device cuda). Without CUDA it is a SKIP (exit 77), the reason as the table's headline,
    exit status 0; on a GPU machine it runs and passes."""
    import torch

    res = tmp_path / "res"
    r = sh(CHECK, "--steps", "worker_cuda", "--results", res, timeout=120)
    with open(res / "summary.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["step"] == "worker_cuda" and r.returncode == 0, r.stdout + r.stderr
    if torch.cuda.is_available():
        assert row["status"] == "PASS", row
        return
    assert (row["status"], row["exit_code"]) == ("SKIP", "77")
    assert row["headline"].startswith("skipped: --device cuda but torch.cuda.is_available() is False")


def test_env_step_really_runs_and_reports(tmp_path):
    """Not a dry run: the env step runs here for real. Without a GPU it fails (exit 1, FAIL in
    the table, its log and the CSVs copied to $OUT); on a GPU machine it passes."""
    res, out = tmp_path / "res", tmp_path / "out"
    r = sh(CHECK, "--steps", "env", "--results", res, env={"OUT": str(out)})
    with open(res / "summary.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["step"] == "env" and row["status"] in ("PASS", "FAIL")
    assert (r.returncode == 0) == (row["status"] == "PASS"), r.stdout
    assert (res / "logs" / "env.log").is_file()
    got = sorted(p.name for p in out.iterdir())
    assert "summary.csv" in got and "table.txt" in got and "gpu_check.log" in got and len(got) <= 8
    if shutil.which("nvidia-smi") is None:
        assert row["status"] == "FAIL"


# ---- the table and CSV writer -----------------------------------------------------------------


def _write(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_report_reads_each_steps_csv(tmp_path):
    (tmp_path / "device.txt").write_text("NVIDIA H200, 580.159.04, 143771 MiB\ntorch 2.11.0\n")
    log = tmp_path / "tests.log"
    log.write_text("collected 9 items\n\n3 failed, 6 passed in 12.0s\n")
    q = [{"shape": s, "impl": i, "bytes": b, "seconds_min": t, "identical": same}
         for s, b in (("small", 1000), ("8 experts", 400_000_000))
         for i, t, same in (("memcpy", 1e-4, ""), ("triton", 1.25e-4, "True"), ("torch reference", 4e-4, "True"))]
    _write(tmp_path / "quant_bench.csv", q)
    _write(tmp_path / "main_cuda_ipc.csv", [
        {"step": 1, "warmup": True, "bytes": 10**9, "seconds": 10.0, "verified": True},
        {"step": 2, "warmup": False, "bytes": 10**9, "seconds": 0.5, "verified": True},
        {"step": 3, "warmup": False, "bytes": 10**9, "seconds": 0.25, "verified": True},
        {"step": 4, "warmup": False, "bytes": 10**9, "seconds": 1.0, "verified": True}])
    _write(tmp_path / "nixl_cuda.csv", [
        {"case": "ucx-default", "gbps": 300.0, "copy_gbps": 2000.0, "verified": True, "error": ""},
        {"case": "cuda_ipc", "gbps": "", "copy_gbps": 2000.0, "verified": False, "error": "TransportError: no"}])
    steps = tmp_path / "steps.tsv"
    steps.write_text("".join(f"{n}\t{st}\t1.5\t{rc}\t{lg}\tcmd {n}\n" for n, st, rc, lg in [
        ("env", "PASS", 0, ""), ("tests", "FAIL", 1, str(log)), ("quant", "PASS", 0, ""),
        ("cuda_ipc", "PASS", 0, ""), ("nixl", "TIMEOUT", 124, ""), ("install", "SKIP", 0, "")]))
    rows = gpu_report.summarize(gpu_report.read_steps(steps), tmp_path)
    by = {r["step"]: r for r in rows}
    assert by["quant"]["headline"].startswith("triton 80% / torch reference 25% of d2d copy (4000 GB/s in); 8 experts")
    assert by["cuda_ipc"]["headline"] == "p50 2.00 GB/s over 3 updates, verified: yes"
    assert by["tests"]["headline"] == "3 failed, 6 passed in 12.0s"
    assert by["env"]["device"] == "NVIDIA H200, 580.159.04, 143771 MiB"
    assert gpu_report.nixl_headline(tmp_path).startswith("ucx-default 300 GB/s (15% of d2d copy); cuda_ipc FAILED")
    table = gpu_report.format_table(rows)
    assert "on NVIDIA H200" in table and "3 passed, 2 failed (tests, nixl), 1 skipped" in table
    assert gpu_report.main([str(steps), str(tmp_path)]) == 1
    with open(tmp_path / "summary.csv") as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["PASS", "FAIL", "PASS", "PASS", "TIMEOUT", "SKIP"]


def test_report_vllm_backends_headline(tmp_path):
    rows = [{"backend": "one_sided", "update": u, "status": "ok", "verified": True, "gbps": g}
            for u, g in ((1, 0.5), (2, 0.25), (3, 1.0))]
    rows += [{"backend": "ipc", "update": 1, "status": "ok", "verified": True, "gbps": 2.0},
             {"backend": "ipc", "update": 2, "status": "NOT VERIFIED", "verified": False, "gbps": 4.0},
             {"backend": "nccl", "update": "", "status": "skipped: NCCL refuses two ranks on one GPU", "verified": "",
              "gbps": ""}]
    _write(tmp_path / "vllm_backends.csv", rows)
    head = gpu_report.vllm_backends_headline(tmp_path)
    assert head == ("one_sided p50 0.50 GB/s 3/3 verified; ipc p50 3.00 GB/s 1/2 verified; NOT VERIFIED; "
                    "nccl skipped: NCCL refuses two ranks on one GPU")
    steps = tmp_path / "steps.tsv"
    steps.write_text("vllm_backends\tPASS\t50.0\t0\t\tcmd\n")
    (row,) = gpu_report.summarize(gpu_report.read_steps(steps), tmp_path)
    assert row["headline"] == head
    assert gpu_report.format_table([row]).splitlines()[3].startswith("vllm_backends PASS ")


def test_report_refuses_malformed_steps(tmp_path, capsys):
    bad = tmp_path / "steps.tsv"
    bad.write_text("env\tMAYBE\t1\t0\t\tcmd\n")
    with pytest.raises(ValueError, match="steps.tsv:1"):
        gpu_report.read_steps(bad)
    assert gpu_report.main([str(bad), str(tmp_path)]) == 2
    assert gpu_report.main([]) == 2
    assert "error" in capsys.readouterr().err


def _junit(path: Path, cases: list[tuple[str, str]]) -> None:
    body = "".join(
        f'<testcase classname="tests.test_x" name="{n}" time="1.5">'
        + {"passed": "", "failed": '<failure message="AssertionError: q differs">tb</failure>',
           "error": '<error message="fixture failed">tb</error>',
           "skipped": '<skipped type="pytest.skip" message="needs a CUDA GPU">why</skipped>'}[o]
        + "</testcase>" for n, o in cases)
    path.write_text(f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" '
                    f'tests="{len(cases)}">{body}</testsuite></testsuites>')


def test_junit_verdict_of_the_tests_step(tmp_path, capsys):
    """The tests step passes only when GPU tests ran and every one passed: a skip on the GPU
    machine (a missing package, CUDA not seen) fails it, as does an empty run."""
    x, out = tmp_path / "t.xml", tmp_path / "gpu_tests.csv"
    _junit(x, [("a", "passed"), ("b", "passed")])
    assert gpu_report.main(["--junit", str(x), str(out)]) == 0
    assert "2 passed, 0 failed, 0 errors, 0 skipped" in capsys.readouterr().out
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [(r["test"], r["outcome"], r["seconds"]) for r in rows] == [("tests.test_x::a", "passed", "1.5"),
                                                                      ("tests.test_x::b", "passed", "1.5")]
    assert gpu_report.tests_headline(tmp_path) == "2 passed, 0 failed, 0 errors, 0 skipped (GPU-marked tests)"
    for cases, want in (([("a", "passed"), ("b", "skipped")], "SKIPPED: tests.test_x::b: needs a CUDA GPU"),
                        ([("a", "failed")], "FAILED: tests.test_x::a: AssertionError: q differs"),
                        ([("a", "error")], "ERROR: tests.test_x::a: fixture failed"),
                        ([], "(no test ran)")):
        _junit(x, cases)
        assert gpu_report.main(["--junit", str(x), str(out)]) == 1
        assert want in capsys.readouterr().out
    x.write_text("not xml")
    assert gpu_report.main(["--junit", str(x), str(out)]) == 2
    assert gpu_report.main(["--junit", str(tmp_path / "absent.xml"), str(out)]) == 2


# ---- the wheels script and the NIXL check's arguments ------------------------------------------


def test_wheels_dry_run_and_arguments():
    r = sh(WHEELS, "--dry-run")
    assert r.returncode == 0
    assert "nixl-cu13==1.5.1 pyzmq submitit" in r.stdout and "--python-version 3.12" in r.stdout
    assert "scripts/slim_wheel.py" in r.stdout
    assert "slim_wheel" not in sh(WHEELS, "--dry-run", "--no-slim").stdout
    assert "--platform manylinux_2_28_x86_64" in r.stdout and "--no-deps" in r.stdout
    r = sh(WHEELS, "--dry-run", "--cuda", "12", "--with-torch", "--with-triton")
    assert "nixl-cu12==1.5.1" in r.stdout and "triton==3.8.0" in r.stdout
    assert "torch==2.13.0" in r.stdout and "whl/cu128" in r.stdout
    for args, msg in ((["--cuda", "11"], "--cuda is 12 or 13"), (["--python-version", "x"], "3.12"),
                      (["--nope"], "unknown argument")):
        r = sh(WHEELS, *args, "--dry-run")
        assert r.returncode == 2 and msg in r.stderr


def test_nixl_check_arguments():
    script = ROOT / "scripts" / "gpu_nixl_check.py"
    r = subprocess.run([sys.executable, str(script), "--cases", "bogus"], capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "unknown cases ['bogus']" in r.stderr
    r = subprocess.run([sys.executable, str(script), "--mib", "0"], capture_output=True, text=True, check=False)
    assert r.returncode == 2
    import torch

    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, str(script), "--out", os.devnull], capture_output=True, text=True, check=False)
        assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr


def _wheel(path: Path, files: dict[str, str]) -> None:
    import zipfile

    dist = "nixl_cu13-1.5.1.dist-info"
    files = {**files, f"{dist}/METADATA": "Metadata-Version: 2.1\nName: nixl-cu13\nVersion: 1.5.1\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
        z.writestr(f"{dist}/RECORD", record)


def test_slim_wheel_drops_nixl_ep_and_headers_and_pip_installs_it(tmp_path):
    """scripts/slim_wheel.py on a made-up wheel laid out like nixl-cu13 1.5.1: the nixl_ep
    package and the headers go, from the archive and from RECORD; pip installs the result."""
    import zipfile

    sys.path.insert(0, str(ROOT / "scripts"))
    import slim_wheel

    whl = tmp_path / "nixl_cu13-1.5.1-py3-none-any.whl"
    _wheel(whl, {"nixl_cu13/__init__.py": "X = 1\n", "nixl_ep_cu13/__init__.py": "raise ImportError\n",
                 "nixl_ep_cu13/big.so": "x" * 100_000, "nixl_cu13-1.5.1.data/headers/nixl.h": "// h\n"})
    other = tmp_path / "pyzmq-27.3.0-py3-none-any.whl"
    other.write_bytes(whl.read_bytes())
    assert slim_wheel.main([str(whl), str(other)]) == 0
    names = zipfile.ZipFile(whl).namelist()
    assert "nixl_cu13/__init__.py" in names and not [n for n in names if "nixl_ep" in n or "/headers/" in n]
    record = zipfile.ZipFile(whl).read("nixl_cu13-1.5.1.dist-info/RECORD").decode()
    assert "nixl_ep" not in record and "headers" not in record and "nixl_cu13/__init__.py" in record
    assert len(zipfile.ZipFile(other).namelist()) == len(names) + 3  # not a NIXL wheel: untouched
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), str(whl)], capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (site / "nixl_cu13" / "__init__.py").is_file() and not (site / "nixl_ep_cu13").exists()
    assert slim_wheel.main([str(tmp_path / "absent.whl")]) == 2 and slim_wheel.main([]) == 2
