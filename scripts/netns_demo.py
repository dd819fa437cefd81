"""Two "hosts" on one machine: a training-side and an inference-side process in two network
namespaces joined by a veth pair, moving weights with NIXL over TCP; verified bit-exact.

Run (as root; needs ``ip netns`` and NIXL)::

    .venv/bin/python scripts/netns_demo.py                 # 64 MiB in 257 writes
    .venv/bin/python scripts/netns_demo.py --mib 256 --ops 1024

What happens:

1. Two namespaces ``wt-train-<pid>`` / ``wt-infer-<pid>`` are created, a veth pair
   ``wtt<pid>`` / ``wti<pid>`` is moved into them and addressed 10.77.0.1/24 (training) and
   10.77.0.2/24 (inference), private test addresses that exist only inside these namespaces.
2. The inference side (``--role infer``, started with ``ip netns exec``) creates a
   ``NixlTransport(ucx_tls="tcp", net_devices=<its veth>)`` (progress thread on), registers a
   poisoned buffer and serves its descriptor on 10.77.0.2 (the control plane: one TCP socket,
   length-prefixed msgpack frames, each decoded strictly into the type the protocol expects
   there: the descriptor, a command, the digest; nothing received is unpickled).
3. The training side (``--role train``) connects, builds a seeded byte pattern, posts the
   writes (one batch, mixed sizes, shuffled destinations), waits, and asks the receiver for the
   SHA-256 of its buffer; it must equal the expected image. The veth's receive counter in the
   inference namespace must have grown by at least the payload: the bytes crossed the link.
4. The namespaces are deleted on exit (also on error or Ctrl-C); deleting a namespace removes
   its veth end.

Prints one line ``netns demo: ... bit-exact: True ...`` and exits 0 on success.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Literal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_IP, INFER_IP, PORT = "10.77.0.1", "10.77.0.2", 29577


MAX_FRAME = 1 << 20
"""Largest frame either side accepts (bytes): a descriptor, a command or a digest."""


def _send(s: socket.socket, obj) -> None:
    """One frame: 8-byte big-endian length, then ``obj`` as msgpack (data only)."""
    import msgspec

    b = msgspec.msgpack.encode(obj)
    s.sendall(struct.pack(">Q", len(b)) + b)


def _recv(s: socket.socket, type_):
    """The next frame, decoded strictly into ``type_`` (ValueError for anything else)."""
    import msgspec

    def exact(n):
        buf = b""
        while len(buf) < n:
            c = s.recv(n - len(buf))
            if not c:
                raise ConnectionError("peer closed")
            buf += c
        return buf
    (n,) = struct.unpack(">Q", exact(8))
    if n > MAX_FRAME:
        raise ValueError(f"refused a frame of {n} bytes (limit {MAX_FRAME})")
    try:
        return msgspec.msgpack.decode(exact(n), type=type_, strict=True)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"refused a frame that is not a {getattr(type_, '__name__', type_)}: {e}") from None


def _descriptor(s: socket.socket):
    """The receiver's region descriptor (``extra`` back to the nested tuples the transport compares)."""
    from weight_transfer.control.keys import fix_descriptor
    from weight_transfer.types import RegionDescriptor

    return fix_descriptor(_recv(s, RegionDescriptor))


def _expected(nbytes: int, n_ops: int, seed: int):
    """The source pattern, the ops ``(src offset, dst offset, length)`` and the receiver's
    expected final image (POISON where nothing is written)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, nbytes), n_ops - 1)) if n_ops > 1 else []
    bounds = [0] + cuts + [nbytes]
    pieces = [(a, b - a) for a, b in zip(bounds, bounds[1:])]
    dst_order = pieces[:]
    rng.shuffle(dst_order)  # destination layout: the same pieces, permuted
    ops, pos = [], 0
    for a, n in dst_order:
        ops.append((a, pos, n))
        pos += n
    image = torch.empty_like(src)
    for a, d, n in ops:
        image[d:d + n] = src[a:a + n]
    return src, ops, image


def infer_main(a) -> None:
    import torch

    from weight_transfer.transport.nixl import NixlTransport

    t = NixlTransport(ucx_tls="tcp", net_devices=a.dev)
    buf = torch.full((a.mib << 20,), 0xA5, dtype=torch.uint8)
    region = t.register(buf)
    srv = socket.create_server((INFER_IP, PORT))
    print(f"[infer] listening on {INFER_IP}:{PORT}, agent {t.agent_name}", file=sys.stderr, flush=True)
    conn, _ = srv.accept()
    with conn:
        _send(conn, region.descriptor())
        while True:
            cmd = _recv(conn, Literal["sha256", "exit"])
            if cmd == "sha256":
                _send(conn, hashlib.sha256(buf.numpy().tobytes()).hexdigest())
            elif cmd == "exit":
                _send(conn, True)
                break
    t.close()


def train_main(a) -> None:
    from weight_transfer.transport import WriteOp
    from weight_transfer.transport.nixl import NixlTransport

    t = NixlTransport(ucx_tls="tcp", net_devices=a.dev, progress_thread=False)
    deadline = time.monotonic() + 30
    while True:
        try:
            s = socket.create_connection((INFER_IP, PORT), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with s:
        desc = _descriptor(s)
        t.connect([desc])
        src, ops, image = _expected(a.mib << 20, a.ops, a.seed)
        loc = t.register(src)
        t0 = time.perf_counter()
        n = t.write([WriteOp(loc, so, desc, do, ln) for so, do, ln in ops]).wait(120)
        dt = time.perf_counter() - t0
        _send(s, "sha256")
        got = _recv(s, str)
        want = hashlib.sha256(image.numpy().tobytes()).hexdigest()
        _send(s, "exit")
        _recv(s, bool)
    t.close()
    print(f"RESULT bytes={n} seconds={dt:.4f} ops={len(ops)} sha256={got} expected={want} ok={got == want}", flush=True)


# --------------------------------------------------------------------------------------------
# orchestration (root namespace)


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def make_veth_pair(ns_a: str, ns_b: str, dev_a: str, dev_b: str, ip_a: str, ip_b: str) -> None:
    """Two namespaces joined by a veth pair, ``ip_a/24`` on ``dev_a`` in ``ns_a`` and
    ``ip_b/24`` on ``dev_b`` in ``ns_b``, links and loopback up (the store and Gloo of a
    namespace connect to themselves over ``lo``)."""
    sh("ip", "netns", "add", ns_a)
    sh("ip", "netns", "add", ns_b)
    sh("ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
    sh("ip", "link", "set", dev_a, "netns", ns_a)
    sh("ip", "link", "set", dev_b, "netns", ns_b)
    for ns, dev, ip in ((ns_a, dev_a, ip_a), (ns_b, dev_b, ip_b)):
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")


def netns_supported() -> tuple[bool, str]:
    """Whether this process may create network namespaces (creates and deletes a probe)."""
    if os.geteuid() != 0:
        return False, "needs root (ip netns add)"
    try:
        name = f"wt-probe-{os.getpid()}"
        r = sh("ip", "netns", "add", name, check=False)
        if r.returncode:
            return False, f"ip netns add failed: {r.stderr.strip()}"
        sh("ip", "netns", "del", name, check=False)
        return True, ""
    except FileNotFoundError:
        return False, "the ip command (iproute2) is not installed"


def rx_bytes(ns: str, dev: str) -> int:
    r = sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes")
    return int(r.stdout.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["orchestrate", "infer", "train"], default="orchestrate")
    ap.add_argument("--mib", type=int, default=64, help="payload size in MiB")
    ap.add_argument("--ops", type=int, default=257, help="writes in the batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dev", default=None, help="(internal) the veth inside the namespace")
    a = ap.parse_args()
    if a.role == "infer":
        infer_main(a)
        return 0
    if a.role == "train":
        train_main(a)
        return 0

    ok, why = netns_supported()
    if not ok:
        print(f"netns demo: cannot run: {why}", file=sys.stderr)
        return 2
    tag = os.getpid() % 100000
    ns_t, ns_i = f"wt-train-{tag}", f"wt-infer-{tag}"
    dev_t, dev_i = f"wtt{tag}", f"wti{tag}"
    procs: list[subprocess.Popen] = []

    def cleanup(*_):
        for p in procs:
            if p.poll() is None:
                p.kill()
        for ns in (ns_t, ns_i):
            sh("ip", "netns", "del", ns, check=False)

    signal.signal(signal.SIGTERM, lambda *x: (cleanup(), sys.exit(1)))
    try:
        make_veth_pair(ns_t, ns_i, dev_t, dev_i, TRAIN_IP, INFER_IP)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        base = [sys.executable, os.path.abspath(__file__), "--mib", str(a.mib), "--ops", str(a.ops),
                "--seed", str(a.seed)]
        before = rx_bytes(ns_i, dev_i)
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns_i, *base, "--role", "infer", "--dev", dev_i],
                                      env=env, cwd=ROOT))
        tr = subprocess.run(["ip", "netns", "exec", ns_t, *base, "--role", "train", "--dev", dev_t],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        procs[0].wait(30)
        after = rx_bytes(ns_i, dev_i)
        line = next((x for x in tr.stdout.splitlines() if x.startswith("RESULT")), None)
        if tr.returncode or line is None:
            print(tr.stdout + tr.stderr, file=sys.stderr)
            print(f"netns demo: training side failed (rc {tr.returncode})", file=sys.stderr)
            return 1
        f = dict(kv.split("=", 1) for kv in line.split()[1:])
        nbytes, secs = int(f["bytes"]), float(f["seconds"])
        crossed = after - before
        exact = f["ok"] == "True"
        over_link = crossed >= nbytes
        print(f"netns demo: {ns_t} ({TRAIN_IP}) -> {ns_i} ({INFER_IP}) NIXL/UCX tcp over veth: "
              f"{nbytes} bytes in {f['ops']} writes, {secs:.3f} s ({nbytes / secs / 1e9:.2f} GB/s); "
              f"veth rx {crossed} bytes (>= payload: {over_link}); bit-exact: {exact}")
        return 0 if exact and over_link else 1
    finally:
        cleanup()


if __name__ == "__main__":
    sys.exit(main())
