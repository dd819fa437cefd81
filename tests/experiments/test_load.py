"""The load columns of the result rows (weight_transfer.experiments.load): the arithmetic on
given samples, the /proc parsing on a fake /proc, the platform without /proc, the judgement the
report makes, and, on Linux, that a busy process is counted as the own tree's when it is a
descendant of the root and as other load when it is not (each assertion holds whatever else
the machine runs: other processes only add to the machine's busy seconds)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from weight_transfer.experiments import load
from weight_transfer.experiments.load import CpuSample, LoadMeter, cell, fractions, judge, summary_line

HZ = os.sysconf("SC_CLK_TCK")
LINUX = os.path.exists("/proc/stat") and os.path.exists(f"/proc/{os.getpid()}/stat")


def test_fractions_are_the_others_and_the_own_share_of_the_cpus():
    a = CpuSample(t=10.0, busy_s=100.0, cpus=2, own_s=5.0)
    b = CpuSample(t=12.0, busy_s=102.0, cpus=2, own_s=6.6)  # 2 s x 2 CPUs: 2.0 busy, 1.6 own
    other, own = fractions(a, b)
    assert other == pytest.approx(0.1) and own == pytest.approx(0.4)


def test_fractions_are_clamped_and_nan_for_what_the_samples_do_not_say():
    a = CpuSample(t=0.0, busy_s=0.0, cpus=2, own_s=0.0)
    assert fractions(a, CpuSample(t=1.0, busy_s=0.5, cpus=2, own_s=0.6)) == (0.0, pytest.approx(0.3))  # ticks apart
    assert fractions(a, CpuSample(t=1.0, busy_s=9.0, cpus=2, own_s=0.0)) == (1.0, 0.0)
    for b in (None, CpuSample(t=1.0, busy_s=1.0, cpus=2, own_s=None), CpuSample(t=0.0, busy_s=1.0, cpus=2, own_s=0.0),
              CpuSample(t=1.0, busy_s=1.0, cpus=4, own_s=0.0)):
        assert all(math.isnan(x) for x in fractions(a, b))
    assert all(math.isnan(x) for x in fractions(None, a))


def _stat(pid: int, comm: str, ppid: int, utime: int, stime: int, cutime: int = 0, cstime: int = 0) -> str:
    return (f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 100 0 0 0 {utime} {stime} {cutime} {cstime} "
            f"20 0 1 0 100 1000 10 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0\n")


def _fake_proc(root, procs: dict[int, str], stat: str):
    (root / "self").mkdir(parents=True)
    (root / "stat").write_text(stat)
    for pid, text in procs.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "stat").write_text(text)
    return str(root)


def test_tree_cpu_seconds_sums_the_root_and_its_descendants_only(tmp_path):
    proc = _fake_proc(tmp_path / "proc", {
        1: _stat(1, "init", 0, 500, 500),
        10: _stat(10, "python", 1, 100, 20, cutime=7, cstime=3),   # the root: its reaped children count
        11: _stat(11, "a b) c", 10, 40, 10),                        # a command with spaces and ')'
        12: _stat(12, "rank", 11, 30, 0),                           # a grandchild
        20: _stat(20, "other", 1, 900, 100),                        # not in the tree
        21: "21 (broken",                                           # a stat cut short: skipped
    }, "cpu  1 2 3 4 5 6 7 8 0 0\n")
    assert load.tree_cpu_seconds(10, proc) == pytest.approx((130 + 50 + 30) / HZ)
    assert load.tree_cpu_seconds(12, proc) == pytest.approx(30 / HZ)
    assert load.tree_cpu_seconds(99, proc) is None
    assert load.tree_cpu_seconds(10, str(tmp_path / "none")) is None


def test_machine_busy_counts_the_allowed_cpus_busy_ticks(tmp_path):
    stat = ("cpu  600 60 300 9000 50 6 3 7 0 0\n"
            "cpu0 100 10 50 3000 10 1 1 5 0 0\n"     # busy 100+10+50+1+1 = 162 (steal 5 left out)
            "cpu1 200 20 100 3000 20 2 1 1 0 0\n"    # 323
            "cpu2 300 30 150 3000 20 3 1 1 0 0\n"    # 484
            "intr 1 2 3\n")
    proc = _fake_proc(tmp_path / "proc", {}, stat)
    assert load.machine_busy(proc, cpus={0, 1}) == (pytest.approx((162 + 323) / HZ), 2)
    assert load.machine_busy(proc, cpus={0, 1, 2, 3}) == (pytest.approx((162 + 323 + 484) / HZ), 3)
    assert load.machine_busy(str(tmp_path / "none")) is None


def test_without_proc_or_a_load_average_the_columns_are_nan_and_nothing_fails(tmp_path, monkeypatch):
    def no_loadavg():
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", no_loadavg)
    m = LoadMeter(proc=str(tmp_path / "no-proc"))
    m.start()
    m.stop()
    cols = m.columns()
    assert set(cols) == set(load.COLUMNS) and cols["cpus"] == os.cpu_count()
    assert all(math.isnan(cols[k]) for k in ("load_avg_1m", "other_cpu", "own_cpu"))
    assert load.sample(os.getpid(), str(tmp_path / "no-proc")) is None
    assert judge([cols["other_cpu"]], [cols["load_avg_1m"]], [cols["cpus"]]).state == "not recorded"


def test_a_meter_without_an_own_tree_records_the_load_average_only():
    m = LoadMeter(root=None, load_avg_1m=0.25, cpus=2)
    m.start()
    m.stop()
    cols = m.columns()
    assert cols["load_avg_1m"] == 0.25 and cols["cpus"] == 2 and math.isnan(cols["other_cpu"])


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        rest = f.read().rsplit(b")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / HZ


@pytest.fixture
def busy_child():
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield p
    p.kill()
    p.wait()


def _until_busy(pid: int, seconds: float, t0: float) -> None:
    """Wait until ``pid`` has used ``seconds`` of CPU beyond ``t0`` (however loaded the machine)."""
    deadline = time.monotonic() + 120
    while _cpu_seconds(pid) - t0 < seconds:
        assert time.monotonic() < deadline, "the busy child got no CPU in 120 s"
        time.sleep(0.05)


@pytest.mark.skipif(not LINUX, reason="/proc")
def test_a_busy_descendant_is_the_own_trees(busy_child):
    own0, c0 = load.tree_cpu_seconds(os.getpid()), _cpu_seconds(busy_child.pid)
    m = LoadMeter()
    m.start()
    _until_busy(busy_child.pid, 0.3, c0)
    m.stop()
    c1, own1 = _cpu_seconds(busy_child.pid), load.tree_cpu_seconds(os.getpid())
    assert own1 - own0 >= (c1 - c0) - 2 / HZ  # the child's seconds are inside the tree's
    assert 0 < m.own_cpu <= 1 and 0 <= m.other_cpu <= 1


@pytest.mark.skipif(not LINUX, reason="/proc")
def test_a_busy_process_outside_the_tree_is_other_load(busy_child):
    idle = subprocess.Popen(["sleep", "600"])
    try:
        m = LoadMeter(root=idle.pid)  # the busy child is no descendant of the idle one
        c0 = _cpu_seconds(busy_child.pid)
        m.start()
        t0 = m._start.t
        _until_busy(busy_child.pid, 0.3, c0)
        m.stop()
        wall = time.monotonic() - t0
        got = _cpu_seconds(busy_child.pid) - c0
        # others' CPU seconds >= the busy child's, up to /proc/stat's tick sampling
        assert m.other_cpu * wall * m.cpus >= got - 0.05, (m.columns(), wall, got)
        assert m.own_cpu <= 0.05
    finally:
        idle.kill()
        idle.wait()


@pytest.mark.multiproc
@pytest.mark.skipif(not LINUX, reason="/proc")
def test_a_trials_rows_carry_the_load_columns():
    from weight_transfer.experiments.config import TrialConfig
    from weight_transfer.experiments.trial import run_trial

    small = dict(num_hidden_layers=1, vocab_size=1000, hidden_size=256, intermediate_size=512,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    res = run_trial(TrialConfig.from_flat(model="qwen3-0.6b", overrides=small, n_train=2, tp=2, steps=2, warmup=0,
                                          timeout=60))
    assert len(res.rows) == 2
    for r in res.rows:
        assert set(load.COLUMNS) <= set(r)
        assert r["load_avg_1m"] >= 0 and r["cpus"] >= 1
        assert 0 <= r["other_cpu"] <= 1 and 0 <= r["own_cpu"] <= 1


def test_judge_loaded_quiet_and_not_recorded():
    assert judge([0.3, 0.2], [0.1], [2]).state == "loaded"
    q = judge([0.02, 0.04, float("nan")], [3.0], [2])  # other_cpu decides when there is one
    assert q.state == "quiet" and q.other_cpu == pytest.approx(0.03)
    assert judge([0.1], [], []).state == "quiet"  # the threshold itself is quiet
    w = judge([0.9, 0.0, 0.5], [], [], weights=[0.01, 1.0, float("nan")])  # a long window outweighs a short one
    assert w.state == "quiet" and w.other_cpu == pytest.approx(0.009 / 1.01)
    assert judge([float("nan")], [1.5], [2]).state == "loaded"  # the load average per CPU: 0.75
    assert judge(["", None], [0.8], [2.0]).state == "quiet"
    assert judge([], [0.8], []).state == "not recorded"  # a load average without its CPU count
    assert judge().state == "not recorded"


def test_cells_say_the_load_and_mark_the_loaded():
    assert cell(judge([0.02], [0.5], [2])) == "0.02 (loadavg 0.50)"
    assert cell(judge([0.02], [], [2])) == "0.02"
    assert cell(judge([0.31], [0.5], [2])) == "**0.31 (loadavg 0.50) loaded**"
    assert cell(judge([], [0.4], [2])) == "loadavg 0.40 / 2 CPUs"
    assert cell(judge([], [3.1], [2])) == "**loadavg 3.10 / 2 CPUs loaded**"
    assert cell(judge([], [1.09], [])) == "not recorded (loadavg 1.09)"
    assert cell(judge()) == "not recorded"


def test_summary_line():
    rows = [dict(other_cpu=0.3, load_avg_1m=1.5, cpus=2), dict(other_cpu=0.1, load_avg_1m=1.5, cpus=2)]
    line = summary_line(rows, " [rpc]")
    assert line.startswith("# load [rpc]: other processes kept 20% of the 2 CPU(s) busy") and "LOADED" in line
    assert "LOADED" not in summary_line([dict(other_cpu=0.01, load_avg_1m=0.2, cpus=2)])
    assert summary_line([{}]) == "# load: not recorded"
