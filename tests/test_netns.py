"""Multi-host on one machine: training and inference sides in two network namespaces (veth
pair, 10.77.0.1/24 <-> 10.77.0.2/24 inside the namespaces only), weights moved with NIXL over
TCP, verified bit-exact, and the veth's receive counter shows the bytes crossed the link.

Skipped without root / ``ip netns`` permission, or without NIXL. The command it runs is the
documented one: ``python scripts/netns_demo.py`` (docs/TRANSPORTS.md).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("netns_demo", os.path.join(ROOT, "scripts", "netns_demo.py"))
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


def _skip_reason() -> str | None:
    ok, why = demo.netns_supported()
    if not ok:
        return f"network namespaces not permitted here: {why}"
    try:
        from reference.transport.nixl import load_nixl

        load_nixl()
    except ImportError as e:
        return f"NIXL not installed: {e}"
    return None


def test_nixl_over_tcp_between_namespaces():
    why = _skip_reason()
    if why:
        pytest.skip(why)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "netns_demo.py"), "--mib", "8", "--ops", "33"],
                       capture_output=True, text=True, timeout=110, cwd=ROOT)
    line = next((x for x in r.stdout.splitlines() if x.startswith("netns demo:")), "")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bit-exact: True" in line and "(>= payload: True)" in line, line
    # namespaces cleaned up
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "wt-train-" not in left and "wt-infer-" not in left, left
