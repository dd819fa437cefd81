"""The wire-bound link's pure parts (weight_transfer.experiments.link; no root needed): tc rate
parsing, the memory:wire computation, the token bucket's command, tc's counters, the wire-bound
check and the full-against-delta table; and scripts/netns_trial.py refusing bad link options
with one ``error:`` line, exit 2, before anything starts. The netns run itself (root, NIXL) is
tests/scripts/test_netns_trial.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from weight_transfer.experiments import link


@pytest.mark.parametrize("text,bits", [("400mbit", 400_000_000), ("1.5gbit", 1_500_000_000), ("50mbps", 400_000_000),
                                       ("8kbit", 8000), ("2GBit", 2_000_000_000), ("2000 bps", 16000), ("1e3mbit", 10 ** 9)])
def test_parse_rate_tc_units(text, bits):
    assert link.parse_rate(text) == bits


@pytest.mark.parametrize("text,msg", [("400", "a number and a tc unit"), ("fast", "a number and a tc unit"),
                                      ("400mb", "unknown unit"), ("1bit", "outside"), ("20tbit", "outside")])
def test_parse_rate_refuses(text, msg):
    with pytest.raises(ValueError, match=msg):
        link.parse_rate(text)


def test_memory_wire_ratio_sets_the_rate():
    bits, how = link.wire_rate_bits(ratio=100, memcpy_gbps=12.5)
    assert bits == 1_000_000_000 and "--memory-wire-ratio 100" in how and "12.50 GB/s" in how
    assert link.memory_wire_ratio(12.5, bits) == pytest.approx(100.0)
    assert link.wire_rate_bits(link_rate="400mbit") == (400_000_000, "--link-rate 400mbit")
    with pytest.raises(ValueError, match="give one of"):
        link.wire_rate_bits(link_rate="1gbit", ratio=100, memcpy_gbps=10)
    with pytest.raises(ValueError, match="give one of"):
        link.wire_rate_bits()
    with pytest.raises(ValueError, match="> 1"):
        link.wire_rate_bits(ratio=0.5, memcpy_gbps=10)
    with pytest.raises(ValueError, match="memcpy"):
        link.wire_rate_bits(ratio=100, memcpy_gbps=None)


def test_tbf_command_burst_and_limit():
    cmd = link.tbf_command("wtt1", 1_000_000_000)
    assert cmd[:7] == ["tc", "qdisc", "replace", "dev", "wtt1", "root", "tbf"]
    kv = dict(zip(cmd[7::2], cmd[8::2]))
    assert kv == {"rate": "1000000000bit", "burst": str(128 << 10), "limit": str(4 << 20)}
    assert link.queue_limit(10 ** 10) == int(10 ** 10 / 8 * 0.02)  # 20 ms at 10 Gbit/s > 4 MiB
    with pytest.raises(ValueError, match="GSO"):
        link.tbf_command("wtt1", 10 ** 9, burst=1500)


def test_parse_tc_stats():
    text = ("qdisc tbf 8001: root refcnt 2 rate 1Gbit burst 128Kb lat 33.6ms \n"
            " Sent 447590474 bytes 833908 pkt (dropped 0, overlimits 15029 requeues 3) \n backlog 0b 0p requeues 3")
    assert link.parse_tc_stats(text) == {"bytes": 447590474, "packets": 833908, "dropped": 0, "overlimits": 15029,
                                         "requeues": 3}
    assert link.parse_tc_stats("qdisc noqueue 0: dev lo") == {}


def _rows():
    full, delta = 80_000_000, 4_000_000
    rows = [{"step": 1, "warmup": True, "pair_mode": "full", "seconds": 1.0, "bytes": full, "delta_bytes": full,
             "verified": True}]
    for step, (mode, s) in enumerate([("full", 0.70), ("delta", 0.10), ("delta", 0.12), ("full", 0.72)], start=3):
        rows.append({"step": step, "warmup": False, "pair_mode": mode, "seconds": s, "bytes": full, "n_writes": 40,
                     "delta_bytes": full if mode == "full" else delta, "verified": True, "phase_write_s": s * 0.9,
                     "link_tx_bytes": (full if mode == "full" else delta) + 1000,
                     **({"delta_compare_s": 0.02, "delta_pack_s": 0.01, "delta_wire_s": 0.05, "delta_apply_s": 0.01}
                        if mode == "delta" else {})})
    return rows


def test_wire_check_flags_a_link_that_is_not_the_limit():
    w = link.wire_check(_rows(), 10 ** 9)  # 80 MB at 125 MB/s = 0.64 s of 0.71 s: wire-bound
    assert w["full_p50_s"] == pytest.approx(0.71) and w["wire_s"] == pytest.approx(0.64)
    assert w["wire_bound"] and w["n"] == 2
    assert not link.wire_check(_rows(), 10 ** 10)["wire_bound"]  # 0.064 s of 0.71 s: not the limit
    assert link.wire_check([r for r in _rows() if r["pair_mode"] == "delta"], 10 ** 9) == {}


def test_pair_table_phases_and_ratios():
    text, m = link.pair_table(_rows(), 10 ** 9)
    assert m["full"]["p50_s"] == pytest.approx(0.71) and m["delta"]["p50_s"] == pytest.approx(0.11)
    assert m["ratio_p50"] == pytest.approx(0.11 / 0.71)
    assert m["n_pairs"] == 2 and m["pairs_delta_faster"] == 2
    assert m["pair_ratio_p50"] == pytest.approx((0.10 / 0.70 + 0.12 / 0.72) / 2)
    assert m["delta"]["pack"] == 0.01 and m["delta"]["apply"] == 0.01 and m["delta"]["wire"] == 0.05
    assert m["full"]["wire"] == pytest.approx(0.71 * 0.9)  # the write stage's seconds
    assert m["verified"] and "every update verified bit-exact: True" in text
    assert "delta/full p50: 0.155x seconds, 0.0500x bytes written" in text
    rows = _rows()
    rows[3]["verified"] = False
    assert not link.pair_table(rows, 10 ** 9)[1]["verified"]


@pytest.mark.parametrize("args,msg", [(["--link-rate", "fast"], "error: --link-rate 'fast'"),
                                      (["--memory-wire-ratio", "0.5"], "error: --memory-wire-ratio 0.5"),
                                      (["--link-burst", "1000", "--link-rate", "1gbit"], "error: --link-burst 1000"),
                                      (["--link-burst", "200000"], "error: --link-burst without")])
def test_netns_trial_refuses_bad_link_options_before_anything_starts(args, msg):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "netns_trial.py"), *args],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines == [lines[0]] and lines[0].startswith(msg), r.stderr
