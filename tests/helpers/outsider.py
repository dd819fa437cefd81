"""An outsider of a job (case C30): a separate process that holds only the store's ``host:port``
-- not the job secret -- and tries, for every key a member reads, to run code through it (a
pickle whose loading runs ``touch MARKER``), to forge it, read it, delete it, add to it and swap
it (``compare_set``); to read what grants memory access (region descriptors, plans, landing
regions); and to flood the server with connections. Every attempt is one line of JSON in the
output file: ``{"stage", "via", "key", "action", "ok", "seconds", "why"}`` -- ``ok`` true would
mean the store answered the outsider.

Run: ``python -m tests.helpers.outsider HOST PORT STAGE PUSH VERSION OUT MARKER [--tcpstore]
[--flood]``, or from a test :func:`run_outsider` (a process of its own without the secret in its
environment) and :func:`check_refused` on its rows: tests/helpers/api_world.py runs it inside an
update, at the stage named; tests/engines/vllm/backend/test_plugin.py and tests/helpers/trl_job.py inside
and between the vLLM backend's updates.

Ways in (``via``): ``tls-nocert`` (our framing over TLS without a certificate: the server wants a
member's), ``tls-otherjob`` (a member certificate of another job's secret), ``raw`` (a pickle and a
TCPStore-shaped request over plain TCP), ``tcpstore`` (torch's own ``TCPStore`` client, as the
issue's outsider did), ``flood`` (2 x MAX_PENDING connections that never handshake, held 1 s).
"""
from __future__ import annotations

import json
import os
import pickle
import socket
import ssl
import struct
import sys
import time


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def keys_of(n: int, v: int) -> list[str]:
    """Every key a member reads around push ``n`` / version ``v`` (training ranks, coordinator, receivers)."""
    ks = [f"push/{n}/decision", f"push/{n}/outcome", f"push/{n}/ready/0", f"push/{n}/ready/1",
          f"push/{n + 1}/decision", f"step/{v}/go", f"step/{v}/done/0", f"step/{v}/done/1", f"step/{v}/commit",
          f"step/{v}/committed/0", f"step/{v}/failed", f"step/{v}/shift", f"step/{v}/where/0",
          "weights", "version", "weights/attempted", "weights/shadow", "weights/reason", f"complete/{v}",
          "plan/0", "plan/1", "plan/epoch", "plan/error", "meta/infer/0", "meta/infer/1", "meta/train/0",
          "meta/world", "meta/coordinator", "meta/train_proc/0", "meta/engine", "meta/infer_shadow/0",
          "meta/infer_runtime/0", "infer/delta_landing/0", "infer/joins", "infer/join/0", "infer/leave/0",
          "infer/owner/0", "infer/member/0", "abort", "shutdown", "fatal", "fatal/train0", "hb/controller",
          "hb/train0", "pg/0"]
    return ks


ACTIONS = ("set-pickle", "set-forged", "get", "delete", "add", "compare_set")


def _frame(op, *args) -> bytes:
    import msgspec

    body = msgspec.msgpack.encode([op, *args])
    return struct.pack(">I", len(body)) + body


def _request(action: str, key: str, marker: str) -> bytes:
    blob = pickle.dumps(Payload(marker))
    forged = b"9 complete 99" if key == "weights" else blob
    return {"set-pickle": _frame("set", key, blob), "set-forged": _frame("set", key, forged),
            "get": _frame("get", key, 0.1), "delete": _frame("del", key), "add": _frame("add", key, 1),
            "compare_set": _frame("cas", key, b"", blob)}[action]


def _answered(sock) -> tuple[bool, str]:
    """(whether the server answered with a frame, why not)."""
    try:
        sock.settimeout(5)
        head = sock.recv(4)
        if len(head) < 4:
            return False, "closed without an answer"
        return True, f"answered {head!r}"
    except (ssl.SSLError, OSError) as e:
        return False, f"{type(e).__name__}: {e}"


def try_tls(host, port, ctx, payload: bytes) -> tuple[bool, str]:
    try:
        with socket.create_connection((host, port), timeout=5) as raw:
            try:
                t = ctx.wrap_socket(raw)
            except (ssl.SSLError, OSError) as e:
                return False, f"handshake: {type(e).__name__}: {e}"
            with t:
                try:
                    # our protocol's hello comes first for a member; an outsider gets an alert or EOF
                    t.sendall(payload)
                except (ssl.SSLError, OSError) as e:
                    return False, f"send: {type(e).__name__}: {e}"
                return _answered(t)
    except OSError as e:
        return False, f"connect: {type(e).__name__}: {e}"


def try_raw(host, port, payload: bytes) -> tuple[bool, str]:
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(payload)
            return _answered(s)
    except OSError as e:
        return False, f"{type(e).__name__}: {e}"


def try_tcpstore(host, port, key: str, marker: str) -> tuple[bool, str]:
    import datetime

    import torch.distributed as dist
    try:
        s = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=1), wait_for_workers=False)
        s.set(key, pickle.dumps(Payload(marker)))
        return True, "connected and set"
    except Exception as e:
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


MARKER = "OUTSIDER_CODE_RAN"
"""The file a pickle's loading would create (``touch``), in the output file's folder by default."""


def run_outsider(host: str, port: int, stage: str, out, *, n: int = 0, v: int = 0, marker=None,
                 tcpstore: bool = False, flood: bool = False, timeout: float = 120.0) -> list[dict]:
    """Run this module now in a process of its own that holds only ``host:port`` -- no
    ``WEIGHT_TRANSFER_*`` variable in its environment, so no job secret -- and wait for it.
    ``stage``: a name for its rows; ``n`` / ``v``: the push and version whose keys it attacks
    (:func:`keys_of`); ``out``: the JSON-lines file its rows are appended to; ``marker``: the file
    its pickles would create (default: :data:`MARKER` beside ``out``); ``tcpstore`` / ``flood``:
    the optional ways in (module docstring). Returns this run's rows. RuntimeError naming its
    stderr when the process fails."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = os.path.abspath(os.fspath(out))
    marker = os.fspath(marker) if marker is not None else os.path.join(os.path.dirname(out), MARKER)
    env = {k: x for k, x in os.environ.items() if not k.startswith("WEIGHT_TRANSFER")}
    env["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # torch's client logs every refused attempt
    flags = ["--tcpstore"] * tcpstore + ["--flood"] * flood
    seen = sum(1 for _ in open(out)) if os.path.exists(out) else 0
    p = subprocess.run([sys.executable, "-m", "tests.helpers.outsider", host, str(int(port)), stage.replace(" ", "_"),
                        str(int(n)), str(int(v)), out, marker, *flags], env=env, cwd=root, timeout=timeout,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"the outsider ({stage}) exited {p.returncode}: {p.stderr[-2000:]}")
    with open(out) as f:
        return [json.loads(line) for line in f.read().splitlines()[seen:]]


def check_refused(rows: list[dict], marker, *, stages=(), vias=("tls-nocert", "tls-otherjob", "raw")) -> dict:
    """Assert what case C30 asks of an outsider's ``rows``: it tried (every stage of ``stages``,
    every way in of ``vias``, every key of :func:`keys_of` over TLS), the store answered none of
    its attempts, each was refused within 10 s (the flood aside: it holds its connections 1 s),
    and the pickles' code ran nowhere (no ``marker`` file). Returns ``{"rows", "stages", "vias",
    "max_seconds"}``."""
    assert rows, "the outsider recorded no attempt"
    got_stages, got_vias = {r["stage"] for r in rows}, {r["via"] for r in rows}
    assert set(stages) <= got_stages, (sorted(stages), sorted(got_stages))
    assert set(vias) <= got_vias, (sorted(vias), sorted(got_vias))
    for s in got_stages:
        tried = {r["key"] for r in rows if r["stage"] == s and r["via"] == "tls-nocert"}
        assert len(tried) >= len(keys_of(0, 0)), (s, len(tried))
    answered = [r for r in rows if r["ok"]]
    assert not answered, answered[:5]
    slow = [r for r in rows if r["via"] != "flood" and not r["seconds"] < 10]
    assert not slow, slow[:5]
    assert not os.path.exists(marker), f"{marker}: an outsider's pickle ran as code"
    return {"rows": len(rows), "stages": sorted(got_stages), "vias": sorted(got_vias),
            "max_seconds": max(r["seconds"] for r in rows if r["via"] != "flood")}


def main(argv: list[str]) -> int:
    host, port, stage, n, v, out, marker = argv[:7]
    port, n, v = int(port), int(n), int(v)
    rows = []

    def rec(via, key, action, ok, t0, why):
        rows.append({"stage": stage, "via": via, "key": key, "action": action, "ok": ok,
                     "seconds": round(time.monotonic() - t0, 4), "why": why[:300]})

    nocert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    nocert.check_hostname, nocert.verify_mode = False, ssl.CERT_NONE
    from weight_transfer.security.secret import JobSecret

    other = JobSecret.generate().tls_context(server=False)  # a member of another job
    for key in keys_of(n, v):
        for action in ACTIONS:
            payload = _request(action, key, marker)
            t0 = time.monotonic()
            ok, why = try_tls(host, port, nocert, payload)
            rec("tls-nocert", key, action, ok, t0, why)
        t0 = time.monotonic()
        ok, why = try_tls(host, port, other, _request("set-pickle", key, marker))
        rec("tls-otherjob", key, "set-pickle", ok, t0, why)
    for key in ("weights", f"push/{n}/decision", "meta/infer/0"):
        t0 = time.monotonic()
        blob = pickle.dumps(Payload(marker))
        ok, why = try_raw(host, port, blob)
        rec("raw", key, "pickle", ok, t0, why)
        t0 = time.monotonic()  # TCPStore's wire form of SET: a query type byte, the key, the value
        ok, why = try_raw(host, port, b"\x02" + struct.pack("<Q", len(key)) + key.encode()
                          + struct.pack("<Q", len(blob)) + blob)
        rec("raw", key, "tcpstore-set", ok, t0, why)
    if "--tcpstore" in argv:
        for key in (f"push/{n}/decision", "weights"):
            t0 = time.monotonic()
            ok, why = try_tcpstore(host, port, key, marker)
            rec("tcpstore", key, "set-pickle", ok, t0, why)
    if "--flood" in argv:
        from weight_transfer.security.secure_store import MAX_PENDING

        t0 = time.monotonic()
        held = []
        for _ in range(2 * MAX_PENDING):
            try:
                held.append(socket.create_connection((host, port), timeout=2))
            except OSError:
                pass
        time.sleep(1.0)
        closed = pending = answered = 0
        for s in held:  # the server closes what is beyond MAX_PENDING at once and answers none of them
            try:
                s.settimeout(0.05)
                got = s.recv(4)
                closed += got == b""
                answered += bool(got)
            except TimeoutError:
                pending += 1
            except OSError:
                closed += 1
            s.close()
        rec("flood", "-", f"{len(held)} connections", answered > 0, t0,
            f"{len(held)} opened: {closed} closed by the server, {pending} waiting for a handshake, {answered} answered")
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
