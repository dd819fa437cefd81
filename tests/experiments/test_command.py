"""The one command (``weight-transfer``, :mod:`weight_transfer.experiments.command`): every
command line the README and docs/ write parses, and ``--help`` of every subcommand lists
every option of its config with its default."""
from __future__ import annotations

import re
import shlex

import pytest

from tests.helpers import ROOT
from weight_transfer.experiments.cli import leaves
from weight_transfer.experiments.command import build_parser
from weight_transfer.experiments.config import OPTION_META, TrialConfig

PLACEHOLDER = re.compile(r"[<\[*]|\.\.\.|\bX\b|\bDIR\b|\bCSV\b")


def documented_commands() -> list[tuple[str, list[str]]]:
    """(file:line, argv) of every ``weight-transfer <subcommand> ...`` written in README.md and
    docs/*.md (backslash continuations and inline code spans broken over lines joined, comments
    cut), less those with placeholders."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            line, where = lines[i], f"{path.name}:{i + 1}"
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            # an inline code span that goes on on the next line (markdown joins it with a space)
            while line.count("`") % 2 and not line.lstrip().startswith("```") and i < len(lines):
                line = line + " " + lines[i].strip()
                i += 1
            for m in re.finditer(r"weight-transfer ((?:run|rl|sweep|simulate|faults|secret|bench-[a-z]+)(?: [^`|#&;]*)?)",
                                 line):
                cmd = m.group(1).strip()
                if PLACEHOLDER.search(cmd) or "--help" in cmd:
                    continue
                try:
                    out.append((where, shlex.split(cmd)))
                except ValueError:
                    continue
    return out


COMMANDS = documented_commands()


def test_the_docs_write_commands():
    assert len(COMMANDS) > 20 and any(argv[0] == "run" for _, argv in COMMANDS)


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[f"{w} {' '.join(a)[:50]}" for w, a in COMMANDS])
def test_every_documented_command_parses(where, argv):
    try:
        build_parser(argv).parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: weight-transfer {' '.join(argv)} is refused (exit {e.code})")


def test_run_help_lists_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit):
        build_parser(["run", "--help"]).parse_args(["run", "--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    for lf in leaves(TrialConfig):
        md = {**lf.field.metadata, **OPTION_META.get(lf.flat, {})}
        if md.get("cli") is False:
            continue
        flag = md.get("flag", "--" + lf.flat.replace("_", "-"))
        assert flag in help_, flag
    for text in ("--watermark-mb MiB", "[MiB] (default: none)", "[MiB] (default: 64)", "--gather-all",
                 "--serial", "--timeout TIMEOUT", "[s] (default: 120.0)", "--quant {fp8,fp8-tensor,fp8-channel,none}", "(default: fp8)",
                 "--override KEY=VALUE", "(repeatable)", "--bucket-bytes"):
        assert text in help_, text


@pytest.mark.parametrize("sub", ["rl", "sweep", "simulate", "faults", "secret", "bench-quant", "bench-pipeline",
                                 "bench-transports", "bench-peers"])
def test_every_subcommand_has_help_with_defaults(sub, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser([sub, "--help"]).parse_args([sub, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: weight-transfer " + sub in out and "default" in out


def test_watermark_mb_reaches_the_executor_options():
    argv = ["run", "--watermark-mb", "16", "--serial", "--gather-all", "--max-chunk-mb", "0.5", "--quant", "none"]
    from weight_transfer.experiments.command import config_from_args

    cfg = config_from_args(build_parser(argv).parse_args(argv))
    ex, plan = cfg.transfer.executor, cfg.transfer.plan
    assert (ex.watermark, ex.pipeline, plan.local_writes, plan.max_chunk_bytes) == (16 << 20, False, False, 1 << 19)
    assert cfg.inference.quant is None and cfg.model.name == "qwen3-30b-a3b"


def test_secret_prints_a_fresh_secret_or_writes_a_private_file(tmp_path, capsys):
    """``weight-transfer secret``: 64 hex digits, fresh each time; ``--out PATH``: the file (mode
    0600, what JobSecret.from_file accepts) and the export line naming it, the secret not printed."""
    import os
    import stat

    from weight_transfer.experiments.command import main
    from weight_transfer.security.secret import JobSecret

    assert main(["secret"]) == 0 and main(["secret"]) == 0
    a, b = capsys.readouterr().out.split()
    assert re.fullmatch(r"[0-9a-f]{64}", a) and a != b and JobSecret.parse(a).hex() == a
    path = tmp_path / "keys dir" / "job.secret"
    assert main(["secret", "--out", str(path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == f"export WEIGHT_TRANSFER_SECRET_FILE={shlex.quote(str(path))}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    secret = JobSecret.from_file(path)
    assert secret.hex() not in out
    assert main(["secret", "--out", str(path)]) == 0  # replaced by a fresh one
    capsys.readouterr()
    assert JobSecret.from_file(path).hex() != secret.hex()


@pytest.mark.parametrize("where,want", [("dir", "is a directory"), ("missing", "No such file or directory")])
def test_secret_out_that_cannot_be_written_is_one_error_line(where, want, tmp_path, capsys):
    from weight_transfer.experiments.command import main

    out = {"dir": tmp_path, "missing": "/proc/no-such-dir/secret"}[where]
    assert main(["secret", "--out", str(out)]) == 2
    got = capsys.readouterr()
    err = got.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out ") and want in err[0], err
    assert got.out == ""


# ---- the command as a user runs it: bad outputs refused, rows kept, signals (C25, issue 27) ----

TINY = ["--model", "qwen3-0.6b", "--quant", "none", "--tp", "1", "--n-train", "1", "--warmup", "0",
        "--override", "num_hidden_layers=1", "--override", "hidden_size=256", "--override", "intermediate_size=512",
        "--override", "num_attention_heads=4", "--override", "num_key_value_heads=2", "--override", "head_dim=64",
        "--override", "vocab_size=1024"]


def _start(args, tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "weight_transfer.experiments", "run", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _lines_until(p, prefix: str, timeout: float = 120.0) -> list[str]:
    import time

    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stderr.readline()
        if not line:
            break
        seen.append(line.rstrip("\n"))
        if line.startswith(prefix):
            return seen
    raise AssertionError(f"no line {prefix!r} within {timeout} s; got {seen[-10:]}")


def test_c25_results_dev_full_refused_before_any_process(tmp_path):
    p = _start([*TINY, "--results", "/dev/full"], tmp_path)
    err = p.stderr.read()
    assert p.wait(60) == 2
    assert err.splitlines() == ["error: --results '/dev/full' is not a regular file; give a file path "
                                "(rows are appended to it)"], err


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_c25_disk_fills_mid_run_rows_before_are_in_the_csv(tmp_path):
    """A results file on a 2 MiB tmpfs, filled by another writer after the first update: the
    run ends with one ``error:`` line saying where the rows are, exit 1, and the CSV holds
    every update finished before the disk filled, whole."""
    import os
    import subprocess

    import pandas as pd

    d = tmp_path / "tmpfs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        p = _start([*TINY, "--steps", "200", "--results", str(d / "trials.csv")], tmp_path)
        seen = _lines_until(p, "# step 2:")
        fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT)  # another writer fills the file system
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        rest = p.stderr.read().splitlines()
        rc = p.wait(120)
        steps = [line for line in seen + rest if line.startswith("# step ")]
        assert rc == 1, rest[-5:]
        assert rest[-1].startswith("error: appending a row to ") and "intact in" in rest[-1], rest[-5:]
        df = pd.read_csv(d / "trials.csv")
        assert len(df) == len(steps) >= 2 and df["verified"].astype(bool).all()  # a step is printed once in the CSV
        assert list(df["step"]) == list(range(1, len(df) + 1))
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig,code,group", [("SIGINT", 130, False), ("SIGTERM", 143, False), ("SIGINT", 130, True)],
                         ids=["SIGINT", "SIGTERM", "ctrl-c"])
def test_signal_mid_run_one_error_line_and_no_process_left(tmp_path, sig, code, group):
    """SIGINT / SIGTERM to ``weight-transfer run`` mid-trial, and SIGINT to its whole process
    group (a Ctrl-C in the terminal: every rank gets it too): exit 128 + the signal, one
    ``error:`` line naming it (no traceback from the command or any rank), every process of the
    command gone, and the rows of the updates that finished in the CSV."""
    import os
    import signal

    import pandas as pd

    from tests.helpers.processes import kill_session, wait_none_left

    p = _start([*TINY, "--steps", "500", "--results", str(tmp_path / "trials.csv")], tmp_path)
    try:
        _lines_until(p, "# step 2:")
        (os.killpg if group else os.kill)(p.pid, getattr(signal, sig))  # its own session: pgid = pid
        rest = p.stderr.read().splitlines()
        assert p.wait(60) == code, rest[-5:]
        errors = [line for line in rest if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: interrupted by {sig}"), rest[-8:]
        assert not any("Traceback" in line for line in rest), rest[-20:]
        assert wait_none_left(p.pid, 30) == []
        assert len(pd.read_csv(tmp_path / "trials.csv")) >= 2
    finally:
        kill_session(p.pid)


BAD_INPUT = [
    (["simulate", "tiny_qwen3_moe_2x2", "--layers", "0"], "--layers 0: must be >= 1"),
    (["simulate", "tiny_qwen3_moe_2x2", "--layers", "-3"], "--layers -3: must be >= 1"),
    (["simulate", "tiny_qwen3_moe_2x2", "--moe-width", "0"], "--moe-width 0: must be >= 1"),
    (["simulate", "tiny_qwen3_moe_2x2", "--bench-planner", "--repeat", "0"], "--repeat 0: must be >= 1"),
    (["simulate", "tiny_qwen3_moe_2x2", "--csv", "/dev/full"], "--csv '/dev/full' is not a regular file"),
    (["run", "--override", "num_experts=0"], "override num_experts=0: num_experts must be >= 1"),
    (["run", "--override", "hidden_size=-1"], "override hidden_size=-1: hidden_size must be >= 1"),
    (["run", "--override", "num_hidden_layers=0"], "num_hidden_layers must be >= 1"),
    (["run", "--override", "vocab_size=1000000000000"], "GB available; use smaller overrides"),
    (["run", "--train-mesh", "abc"], "argument --train-mesh: wants AxB or AxBxW (integers), got 'abc'"),
    (["run", "--results", "/dev/full"], "--results '/dev/full' is not a regular file"),
    (["sweep", "ci_cpu_regression", "--results-dir", "/dev/null"], "--results-dir '/dev/null' is a file"),
    (["sweep", "ci_cpu_regression", "--cluster", "slurm"], "--cluster slurm: no sbatch on PATH"),
    (["run", "--model", "glm-4.5-air", "--override", "num_hidden_layers=2", "--override", "num_experts=8",
      "--quant", "fp8-channel"], "has MoE experts, which per-tensor / per-channel FP8 does not plan; use --quant fp8"),
]


@pytest.mark.parametrize("argv,want", BAD_INPUT, ids=[" ".join(a)[:60] for a, _ in BAD_INPUT])
def test_bad_input_refused_before_work_with_one_error_line(argv, want, capsys, monkeypatch, tmp_path):
    """Issue 27 item 3: every option and override checked before any process starts or any
    planning: exit 2, one ``error:`` line naming the option or the override."""
    import shutil

    from weight_transfer.experiments.command import main

    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "sbatch" else real_which(name, *a, **k))
    if argv[0] == "sweep" and "--folder" not in argv:
        argv = [*argv, "--folder", str(tmp_path / "jobs")]
    import contextlib

    rc = None
    with pytest.raises(SystemExit) if "--train-mesh" in argv else contextlib.nullcontext() as e:  # argparse exits
        rc = main(argv)
    rc = e.value.code if e is not None else rc
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and want in err[0], err

