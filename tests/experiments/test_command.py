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
    docs/*.md (backslash continuations joined, comments cut), less those with placeholders."""
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
            for m in re.finditer(r"weight-transfer ((?:run|sweep|simulate|faults|bench-[a-z]+)(?: [^`|#&;]*)?)", line):
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
                 "--serial", "--timeout TIMEOUT", "[s] (default: 120.0)", "--quant {fp8,none}", "(default: fp8)",
                 "--override KEY=VALUE", "(repeatable)", "--bucket-bytes"):
        assert text in help_, text


@pytest.mark.parametrize("sub", ["sweep", "simulate", "faults", "bench-quant", "bench-pipeline", "bench-transports",
                                 "bench-peers"])
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
