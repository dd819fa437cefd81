"""The ``one_sided`` vLLM worker engine's own register-and-publish path over a CUDA ``nn.Module``,
written one-sidedly by another process through ``cuda_ipc`` (issue 42, item 3): gpu_check.sh's
``worker_cuda`` step.

    python scripts/gpu_worker_receive.py [--device cuda|cpu] [--timeout S]

No vLLM is needed (the lent H200 image has none): the path it drives is
:meth:`weight_transfer.engines.vllm.worker.state.WorkerTargets.receive`, which the backend's
``OneSidedWeightTransferEngine.init_transfer_engine`` calls after vLLM's post-processing, here over
a plain module instead of a vLLM model:

1. a small bf16 module on ``--device`` (an embedding, two linears, a layer norm: 6 parameters, each
   its own allocation), reported as a worker reports its model (``WorkerTargets.report`` ->
   :func:`weight_transfer.engines.vllm.worker.runtime.runtime_layout`);
2. ``WorkerTargets.receive(layout, transport="auto")``: the transport chosen from the tensors'
   memory (``cuda_ipc`` for CUDA, ``cma`` for host memory), one region of one part per
   allocation registered in a :class:`weight_transfer.api.Receiver` and published in the store;
3. a second process (this script with ``--sender``), as a training rank: reads the published
   descriptor and destination metadata, connects the transport named in the descriptor, checks
   that a write between two parts is refused before any byte moves, and writes new weights into
   every destination tensor (one batch);
4. back here: every parameter equals the new weights byte for byte, the forward pass runs, and
   the init refusals name the tensor and its device (the transport forced to ``cma`` for CUDA
   tensors -- ``cuda_ipc`` for host ones --, and a ``meta`` tensor).

``--device cpu`` runs the same on the host (``cma``): what the CPU tests run. Prints one line per
check (``[worker 0]`` / ``[sender]``) and a summary last. Exit status: 0 every check passed, 1 one
failed (named on the last line), 77 ``--device cuda`` where CUDA is not available (the reason on
the last line: a SKIP in gpu_check.sh), 2 bad arguments.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import zlib
from typing import TypedDict

SKIP = 77
PUBLISHED = "meta/infer/0"
"""Where the worker (inference rank 0) publishes ``(descriptor, metas)``: the library's key."""
SENT = "check/sender"
"""Where the sender reports what it did (:class:`SenderReport`)."""


class SenderReport(TypedDict):
    """The sender's report (``check/sender``): the transport it connected, the region's parts,
    the refusal of a write between two parts (``NOT REFUSED: ...`` when it went through; None
    without a gap), the bytes written, and the error that stopped it ('' when none)."""

    transport: str
    parts: int
    refused: str | None
    bytes: int
    error: str


def _register_keys() -> None:
    """The schema of :data:`SENT` (the store reads only keys with one: weight_transfer.control.wire)."""
    from weight_transfer.control import wire

    wire.register(SENT, SenderReport, "scripts/gpu_worker_receive.py: the sender's report")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_worker_receive.py", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the module lives (default cuda)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds the sender and each store wait may take")
    ap.add_argument("--sender", metavar="HOST:PORT", help=argparse.SUPPRESS)  # the second process
    a = ap.parse_args(argv)
    if not a.timeout > 0:
        ap.error(f"--timeout {a.timeout}: seconds > 0")
    return a


def new_value(name: str, shape, dtype: str):
    """The weights the sender writes into tensor ``name``: seeded by the name, so both processes
    make the same bytes without sharing anything."""
    import torch

    from weight_transfer.types import torch_dtype

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32).to(torch_dtype(dtype))


def make_model(device: str):
    import torch

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 96), torch.nn.LayerNorm(96),
                            torch.nn.Linear(96, 256, bias=False))
    return m.to(device=device, dtype=torch.bfloat16)


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"


def sender(addr: str, device: str, timeout: float) -> int:
    """A training rank's side: connect to what the worker published, write new weights."""
    import torch

    from weight_transfer.api import connect_store
    from weight_transfer.control import protocol as control
    from weight_transfer.transport import BoundsError, WriteOp, make_transport

    _register_keys()
    store = connect_store(addr, timeout=timeout)
    desc, metas = control.get(store, PUBLISHED)
    out = {"transport": desc.transport, "parts": len(dict(desc.extra).get("parts") or ()), "refused": None,
           "bytes": 0, "error": ""}
    try:
        if device == "cuda":
            torch.cuda.set_device(0)
        t = make_transport(desc.transport)
        t.connect([desc])
        src = torch.cat([new_value(m.name, m.shape, m.dtype).reshape(-1).view(torch.uint8) for m in metas]).to(device)
        loc = t.register(src)
        ops, pos = [], 0
        for m in metas:
            ops.append(WriteOp(loc, pos, desc, m.offset, m.nbytes))
            pos += m.nbytes
        parts = dict(desc.extra).get("parts") or ()
        gap = next((o + n for (o, n), (o2, _) in zip(parts, parts[1:]) if o + n < o2), None)
        if gap is not None:  # a batch with one write between two parts: refused whole, before any byte moves
            try:
                t.write([ops[0], WriteOp(loc, 0, desc, gap, 1)])
                out["refused"] = f"NOT REFUSED: a write at byte {gap}, between two parts"
            except BoundsError as e:
                out["refused"] = _first_line(e)
        out["bytes"] = t.write(ops).wait(timeout)
        t.close()
    except Exception as e:
        out["error"] = _first_line(e)
    control.put(store, SENT, out)
    print(f"[sender] {out}", flush=True)
    return 0 if not out["error"] else 1


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"error: {sys.executable} has no torch ({e})", file=sys.stderr)
        return 2
    if a.sender:
        return sender(a.sender, a.device, a.timeout)
    if a.device == "cuda" and not torch.cuda.is_available():
        print(f"skipped: --device cuda but torch.cuda.is_available() is False here (torch {torch.__version__}, "
              f"CUDA build {torch.version.cuda or 'none'}): the worker's cuda_ipc registration needs a GPU", flush=True)
        return SKIP
    try:
        from weight_transfer.api import serve_store
        from weight_transfer.control import protocol as control
        from weight_transfer.engines.vllm.worker.runtime import runtime_layout
        from weight_transfer.engines.vllm.worker.state import WorkerTargets, choose_transport
    except ImportError as e:
        print(f"error: {sys.executable} cannot import weight_transfer ({e}); run with a python that has the project "
              "installed (pip install -e .)", file=sys.stderr)
        return 2
    _register_keys()

    t0 = time.perf_counter()
    failed: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"[worker 0] {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            failed.append(what)

    dev = a.device
    if dev == "cuda":
        torch.cuda.set_device(0)
    model = make_model(dev)
    params = dict(model.named_parameters())
    want_transport = "cuda_ipc" if dev == "cuda" else "cma"
    targets = WorkerTargets(model, None, 0)
    lay = runtime_layout(targets.report(), 0)
    check(sorted(t.name for t in lay.targets) == sorted(params), f"runtime layout: {len(lay.targets)} targets, "
          f"one per parameter, {len({p.untyped_storage().data_ptr() for p in params.values()})} allocations")

    # the refusals at init: before anything is registered or published, naming the tensor and its device
    name, p = next(iter(params.items()))
    forced = "cma" if dev == "cuda" else "cuda_ipc"
    for what, tensors, req in ((f"transport forced to {forced!r}", params, forced),
                               ("a meta tensor", {"meta.weight": torch.empty(4, device="meta")}, "auto")):
        who = "meta.weight" if req == "auto" else name
        where = "meta" if req == "auto" else str(p.device)
        try:
            choose_transport(tensors, req, who="worker 0")
            check(False, f"refused at init: {what} (it was not refused)")
        except ValueError as e:
            msg = str(e)
            check(repr(who) in msg and where in msg, f"refused at init: {what}: {msg[:160]}")

    store = serve_store("127.0.0.1", 0, timeout=max(a.timeout, 10.0))
    rx = targets.receive(lay, rank=0, store=store, transport="auto", timeout=a.timeout, who="worker 0")
    try:
        parts = rx.region.parts or ()
        check(rx.transport.name == want_transport, f"transport chosen from the tensors' memory: {rx.transport.name}")
        check(len(parts) == len(params), f"one region of {len(parts)} parts (one per allocation), "
              f"{rx.region.length} bytes spanned from {lay.base:#x}")
        check(store.check([PUBLISHED]), f"published under {PUBLISHED!r}: descriptor + {len(rx.metas)} tensor metas")
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # with the job secret serve_store exported
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--sender", f"127.0.0.1:{store.port}",
                            "--device", dev, "--timeout", str(a.timeout)], env=env, capture_output=True, text=True,
                           timeout=a.timeout + 30, check=False)
        print(r.stdout.strip(), flush=True)
        if r.returncode != 0 or not store.check([SENT]):
            check(False, f"sender process: exit {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1]}")
            sent = {}
        else:
            sent = control.get(store, SENT)
        if sent:
            check(not sent["error"], f"sender wrote {sent['bytes']} bytes through {sent['transport']} "
                  f"{'(error: ' + sent['error'] + ')' if sent['error'] else ''}")
            ref = sent["refused"]
            check(ref is not None and not ref.startswith("NOT"), f"a write between two parts refused: {ref}")
        if dev == "cuda":
            torch.cuda.synchronize()
        bad = [n for n, p in params.items()
               if not torch.equal(p.detach().cpu().view(torch.uint8), new_value(n, p.shape, "bfloat16").view(torch.uint8))]
        check(not bad, f"every parameter holds the new weights byte for byte ({len(params) - len(bad)}/{len(params)})"
              + (f"; differ: {bad}" if bad else ""))
        with torch.no_grad():
            y = model(torch.tensor([[1, 2, 3]], device=dev))
        check(bool(torch.isfinite(y.float()).all()), f"forward pass on the new weights: {tuple(y.shape)}, finite")
    finally:
        rx.close()
    secs = time.perf_counter() - t0
    if failed:
        print(f"worker_{dev}: FAILED: {failed[0]} ({len(failed)} check(s) failed, {secs:.1f} s)", flush=True)
        return 1
    print(f"worker_{dev}: {want_transport}, {len(params)} parameters in {len(params)} allocations -> 1 region of "
          f"{len(params)} parts, written by another process and verified; gap write and {forced}/meta refused "
          f"({secs:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
