"""Peers side by side: the same tensor set and world through our reference and other systems.

    weight-transfer bench-peers                       # the default, every peer installed
    weight-transfer bench-peers --peers reference,mooncake --steps 3
    weight-transfer bench-peers --peers reference,torchstore --torchstore-transports shm
    pip install -e '.[peers]'                               # awex + Mooncake (docs/PEERS.md)
    bash scripts/install_torchstore.sh                      # torchstore, its own venv (docs/PEERS.md)

World: 2 training processes -> 2 inference processes (one TP=2 engine), BF16, the main job's
default model (``weight_transfer.experiments.config.main_job_default`` with ``quant=None``; ``--model`` and
``--override`` pick another). What lands per update is the TP=2 engine's tensors: their names,
shapes and bytes (``weight_transfer.engines.engine.engine_tensor_metas``), about 1.9 GB.

Rows (each a fresh set of processes, run one after the other in this command):

- ``reference``: this project's trial (``weight_transfer.experiments.trial.run_trial``): FSDP2 training ranks,
  the static plan, one-sided ``process_vm_writev`` writes into the engine's memory, every update
  verified against the engine's own ``load_weights`` on the full checkpoint.
- ``awex``: awex 0.9.0's ``MooncakeTransport`` (Mooncake transfer engine over TCP, one-sided
  *reads* by the inference side, a static ``TransferPlanBuilder`` plan computed once). Each
  engine tensor's global (pre-TP) tensor is held by the training ranks as even ``dim 0`` shards
  (FSDP's cut) and by the inference ranks as TP shards on vLLM's TP dimension (column-parallel
  tensors on dim 0, ``o_proj``/``down_proj``/``w2_weight`` on the last, ``w13_weight`` on 1,
  replicated ones whole): awex computes the overlaps and moves them. awex converts names and
  fuses projections in its own converters (Megatron -> SGLang/vLLM); those are not exercised
  here, only its plan and data path on the same bytes.
- ``mooncake``: the Mooncake transfer engine alone over TCP, the transport floor with no
  resharding: training rank ``r`` holds inference rank ``r``'s image and writes it with one
  ``batch_transfer_sync_write`` per update (one op per engine tensor, memory registered once).
- ``torchstore``: meta-pytorch/torchstore (git, pinned in ``scripts/install_torchstore.sh``) with
  torchmonarch 0.7.0, one row per transport it has on a CPU machine (``--torchstore-transports``):
  shared memory (its same-host default), monarch RDMA over its TCP fallback, DirectWeightSync
  (one-hop reads of the trainers' registered shards, same fallback), gloo, monarch RPC. The
  trainer ranks hold FSDP's even ``dim 0`` shards as DTensors and ``ts.put_batch`` them, the
  generators ``ts.get_batch`` their TP DTensors in place (torchstore reshards), same keys every
  update, one storage volume per trainer in the trainer's process. torchstore's 0.1.2 release
  pins ``torch==2.9.0``, so it lives in its own virtual environment (default
  ``/opt/wt-torchstore``, the project's torch 2.13.0); this command runs that row in that
  interpreter as a subprocess (``experiments/bench/torchstore_peer.py``, whose docstring says
  what it does), with the same tensor set, pattern and verification.

Every peer row is verified: each step's bytes are a pattern of (tensor, global index, step)
that the receivers recompute on their own and compare bit for bit (as int16, so NaN patterns
compare too). ``time`` is the controller's wall clock from "go" to the last rank's "done"
(store keys), per update; p50 over the measured updates. memcpy is measured in this command
before every row (one thread, 256 MiB, best of 3; the median of those is printed). A peer that
is not installed, or fails, is listed under the table with the reason.

Output: an nccl-tests-style table on stdout; tidy rows in ``--csv`` (raw bytes and seconds).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field

import torch

from .peer_tensors import PeerTensor, pattern, tensor_set  # noqa: F401  (re-exported)

PEERS = ("reference", "awex", "mooncake", "torchstore")
TORCHSTORE_TRANSPORTS = ("shm", "direct_tcp", "rdma_tcp", "gloo", "rpc")  # torchstore_peer.TRANSPORTS
TORCHSTORE_LABEL = {"shm": "shm, same keys", "direct_tcp": "direct, rdma tcp fallback", "rdma_tcp": "rdma tcp fallback",
                    "gloo": "gloo", "rpc": "monarch rpc"}
TORCHSTORE_VENV = "/opt/wt-torchstore"  # scripts/install_torchstore.sh


# --------------------------------------------------------------------------------------------
# torchstore: its own interpreter, experiments/bench/torchstore_peer.py as a subprocess


def torchstore_python(explicit: str = "") -> str | None:
    """The interpreter that imports torchstore and monarch: ``explicit``, else
    ``$WT_TORCHSTORE_PYTHON``, else ``/opt/wt-torchstore/bin/python`` (the install script's
    default), else this interpreter if it has torchstore; None if none exists."""
    from importlib.util import find_spec

    explicit = explicit or os.environ.get("WT_TORCHSTORE_PYTHON", "")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    default = os.path.join(TORCHSTORE_VENV, "bin", "python")
    if os.path.exists(default):
        return default
    return sys.executable if find_spec("torchstore") and find_spec("monarch") else None


def _torchstore_probe(py: str) -> tuple[str | None, dict]:
    """(None, versions) if ``py`` imports torchstore and monarch, else (why not, {})."""
    code = ("import json, importlib.metadata as m, torchstore, monarch.actor, torch; "
            "print(json.dumps({d: m.version(d) for d in ('torchstore', 'torchmonarch', 'torch')}))")
    try:
        r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{py}: {type(e).__name__}: {e}", {}
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{py} cannot import torchstore/monarch ({tail}); scripts/install_torchstore.sh (docs/PEERS.md)", {}
    try:
        vers = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        vers = {}
    commit = os.path.join(os.path.dirname(os.path.dirname(py)), "torchstore.commit")
    if os.path.exists(commit):
        vers["commit"] = open(commit).read().strip()[:7]
    return None, vers


def _run_torchstore(py: str, transport: str, tensors, n_train: int, tp: int, steps: int, warmup: int,
                    timeout: float) -> tuple[list[float | str], list[dict]]:
    """One torchstore row: the runner in torchstore's interpreter, its own process group (killed
    whole on a timeout). Returns per update its seconds or the verification error, and the
    per-update put/get phases."""
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchstore_peer.py")
    with tempfile.TemporaryDirectory(prefix="wt-torchstore-") as d:
        spec, out, log = (os.path.join(d, x) for x in ("spec.json", "out.json", "log.txt"))
        with open(spec, "w") as f:
            json.dump(dict(tensors=[[t.tid, t.name, list(t.global_shape), t.tp_dim] for t in tensors], n_train=n_train,
                           tp=tp, steps=steps, warmup=warmup, transport=transport, timeout=timeout), f)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
        with open(log, "w") as lf:
            p = subprocess.Popen([py, runner, spec, out], stdout=lf, stderr=subprocess.STDOUT, cwd=d, env=env,
                                 start_new_session=True)
            try:
                rc = p.wait(timeout=120 + timeout * (steps + warmup + 1))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                raise RuntimeError(f"torchstore {transport}: no result within {120 + timeout * (steps + warmup + 1):.0f} s") from None
            finally:
                try:  # monarch's proc meshes are children of the runner: none may outlive it
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        res = json.load(open(out)) if os.path.exists(out) else {}
        if "seconds" not in res:  # the runner writes its numbers before it exits
            why = res.get("failed") or (open(log).read().strip().splitlines() or [f"exit {rc}"])[-1]
            raise RuntimeError(f"torchstore {transport}: {why}")
    return [float(x) if isinstance(x, (int, float)) else str(x) for x in res["seconds"]], res.get("phases", [])


# --------------------------------------------------------------------------------------------
# the command


def _available(peer: str, ts_python: str = "") -> str | None:
    """None if ``peer`` can run here, else why not."""
    from importlib import import_module
    from importlib.metadata import PackageNotFoundError, version

    try:
        if peer == "awex":
            version("awex")
            for m in ("mooncake.engine", "transformers", "psutil", "megatron.core"):
                import_module(m)
        elif peer == "mooncake":
            import_module("mooncake.engine")
        elif peer == "torchstore":
            py = torchstore_python(ts_python)
            if py is None:
                where = ts_python or os.environ.get("WT_TORCHSTORE_PYTHON") or TORCHSTORE_VENV + "/bin/python"
                return (f"not installed: no {where} (torchstore 0.1.2 pins "
                        "torch==2.9.0, so it gets its own environment: scripts/install_torchstore.sh, docs/PEERS.md)")
            return _torchstore_probe(py)[0]
    except (PackageNotFoundError, ImportError) as e:
        if isinstance(e, PackageNotFoundError):
            return f"not installed ({e}); pip install -e '.[peers]' (docs/PEERS.md)"
        return f"cannot import ({e}); pip install -e '.[peers]', apt-get install libibverbs1 (docs/PEERS.md)"
    return None


def _version(dist: str) -> str:
    from importlib.metadata import version

    for d in (dist, f"{dist}-non-cuda"):
        try:
            return version(d)
        except Exception:
            pass
    return "-"


REFERENCE_LABEL = {"cma": "cma (process_vm_writev)", "shm": "shm (memcpy into mapping)"}
"""The reference's rows (``--reference-transports``): transport name -> table label."""


@dataclass(kw_only=True, slots=True)
class PeersBenchConfig:
    """Options of ``weight-transfer bench-peers``."""

    peers: tuple[str, ...] = PEERS
    """Peers to run, comma-separated, in this order (reference, awex, mooncake, torchstore)."""
    model: str | None = None
    """Catalog model; default: the main job's (Qwen3-30B-A3B architecture, served BF16 here)."""
    override: tuple[str, ...] = ()
    """HF-config overrides ``KEY=VALUE``, comma-separated (on top of the main job's)."""
    steps: int = 3
    """Measured updates per peer."""
    warmup: int = 1
    """Updates before the measured ones, per peer (connections, registration, plans)."""
    timeout: float = 600.0
    """Seconds one update (or a rank's start) may take before the peer is reported failed."""
    csv: str = "results/peers.csv"
    """CSV the tidy rows are appended to (raw bytes and seconds); empty for none."""
    torchstore_transports: tuple[str, ...] = TORCHSTORE_TRANSPORTS
    """torchstore rows, one per transport, comma-separated (shm, direct_tcp, rdma_tcp, gloo, rpc)."""
    torchstore_python: str = ""
    """Interpreter with torchstore + torchmonarch; default $WT_TORCHSTORE_PYTHON, else /opt/wt-torchstore/bin/python."""
    reference_transports: tuple[str, ...] = ("shm", "cma")
    """Reference rows, one per transport, comma-separated: shm (a memcpy into the receiver's
    shared segment, mapped once; what ``weight-transfer run`` picks for these receivers), cma
    (process_vm_writev, what it writes into vLLM's tensors with)."""

    def __post_init__(self):
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps={self.steps}, warmup={self.warmup}: need steps >= 1, warmup >= 0")
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ValueError(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS)}")
        badr = [t for t in self.reference_transports if t not in REFERENCE_LABEL]
        if badr or not self.reference_transports:
            raise ValueError(f"unknown reference transport(s) {badr}; choose from {', '.join(REFERENCE_LABEL)}")
        bad = [t for t in self.torchstore_transports if t not in TORCHSTORE_TRANSPORTS]
        if bad or not self.torchstore_transports:
            raise ValueError(f"unknown torchstore transport(s) {bad}; choose from {', '.join(TORCHSTORE_TRANSPORTS)}")
        for kv in self.override:
            if "=" not in kv:
                raise ValueError(f"override {kv!r}: wants KEY=VALUE")


@dataclass
class _Run:
    """One ``bench-peers`` run: the trial config every row uses, its tensor set and world, the
    bytes one update carries, the environment, and torchstore's interpreter."""

    cfg: object
    tensors: list[PeerTensor]
    tp: int
    n_train: int
    nbytes: int
    env: dict
    run_id: str
    stamp: str
    label: str
    ts_py: str | None
    rows: list[dict] = field(default_factory=list)
    """One per row that ran: peer, transport, bytes, measured times, verified, errors, memcpy, phases, cold."""
    ref_rows: list[tuple[str, list[dict]]] = field(default_factory=list)
    """The reference's trial rows per transport label (measured updates)."""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    memcpys: list[float] = field(default_factory=list)


def _setup(a: PeersBenchConfig) -> _Run:
    """The run's trial config (the main job's, or ``a.model``; BF16, reference), tensor set and
    environment."""
    from weight_transfer.experiments.cli import key_value
    from weight_transfer.experiments.config import TrialConfig, main_job_default
    from weight_transfer.experiments.env import environment

    base = main_job_default() if a.model is None else TrialConfig.from_flat(model=a.model)
    ov = dict(base.model.overrides)
    ov.update(dict(key_value(s) for s in a.override))
    cfg = base.replace(overrides=ov, quant=None, steps=a.steps, warmup=a.warmup, method="reference",
                       timeout=max(base.transfer.control.timeout, a.timeout))
    tensors = tensor_set(cfg)
    tp, n_train = cfg.inference.tp, cfg.train.n_train
    nbytes = sum(2 * int(torch.Size(b - a for a, b in t.infer_box(r, tp)).numel()) for t in tensors for r in range(tp))
    return _Run(cfg=cfg, tensors=tensors, tp=tp, n_train=n_train, nbytes=nbytes, env=environment(),
                run_id=uuid.uuid4().hex[:8], stamp=dt.datetime.now().isoformat(timespec="seconds"),
                label=cfg.model_config().label, ts_py=torchstore_python(a.torchstore_python))


def _header(a: PeersBenchConfig, run: _Run) -> None:
    """The table's ``#`` header: the run, the host and the peers' versions, the world, the units."""
    env = run.env
    print(f"# bench-peers: the same tensor set and world through each system; run {run.run_id}, git {env['git_sha']}, "
          f"{run.stamp}")
    ts_vers = {}
    if "torchstore" in a.peers and run.ts_py:
        ts_vers = _torchstore_probe(run.ts_py)[1]
    ts_desc = (f"torchstore {ts_vers.get('commit') or ts_vers.get('torchstore', '-')} (torchmonarch "
               f"{ts_vers.get('torchmonarch', '-')}, torch {ts_vers.get('torch', '-')}, {run.ts_py})") if ts_vers else "torchstore -"
    print(f"# host {env['host']}: {env['cpus']} cpus, torch {env['torch']}, python {env['python']}; "
          f"awex {_version('awex')}, mooncake-transfer-engine {_version('mooncake-transfer-engine')}, {ts_desc}")
    print(f"# model: {run.label}; {run.n_train} training ranks -> {run.tp} inference ranks (TP={run.tp}), BF16, "
          f"{len(run.tensors)} engine tensors, {run.nbytes} B per update")
    print(f"# {a.warmup} warm-up + {a.steps} measured updates per peer, every update verified bit-exact; "
          f"time = 'go' to the last rank done")
    print("#")
    print(f"# {'peer':>10} {'transport':>26} {'bytes':>12} {'cold':>8} {'p50':>8} {'p95':>8} {'min':>8} {'max':>8} "
          f"{'algbw':>7} {'%memcpy':>8} {'ref/peer':>8} {'verified':>9}")
    print(f"# {'':>10} {'':>26} {'(B)':>12} {'(s)':>8} {'(s)':>8} {'(s)':>8} {'(s)':>8} {'(s)':>8} {'(GB/s)':>7} {'':>8} "
          f"{'(x)':>8} {'':>9}")


_TRANSPORT = {"reference": "cma (process_vm_writev)", "awex": "mooncake tcp, reads", "mooncake": "tcp, writes, 1 pair/rank"}
"""Table label of the peers with one row."""


def _run_one(a: PeersBenchConfig, run: _Run, peer: str, tr: str | None, label: str) -> tuple[list, list, int, list]:
    """One row's updates: per update its seconds or the verification error, whether it was a
    warm-up, the bytes one update carried, and torchstore's per-update phases. Raises what the
    peer raised."""
    if peer == "torchstore":
        secs, phases = _run_torchstore(run.ts_py, tr, run.tensors, run.n_train, run.tp, a.steps, a.warmup, a.timeout)
        return secs, [i < a.warmup for i in range(len(secs))], run.nbytes, phases
    if peer == "reference":
        from weight_transfer.experiments.trial import run_trial

        res = run_trial(run.cfg.replace(transport=tr))
        secs = [float(r["seconds"]) if r["verified"] else (r.get("verify_error") or "not verified") for r in res.rows]
        run.ref_rows.append((label, [r for r in res.rows if not r["warmup"]]))
        return secs, [r["warmup"] for r in res.rows], res.rows[0]["bytes"], []
    from .peer_worlds import run_world

    secs = run_world(peer, run.tensors, run.n_train, run.tp, a.steps, a.warmup, a.timeout)
    return secs, [i < a.warmup for i in range(len(secs))], run.nbytes, []


def _run_peers(a: PeersBenchConfig, run: _Run) -> None:
    """Every row in turn (a peer not available here, or failing, goes to ``run.skipped``), the
    memcpy measured before each; fills ``run.rows``. Each row's load columns
    (experiments/load.py): the load average before its memcpy, the other processes' CPU from the
    start to the end of its processes (this process's tree its own: the peers' processes are
    its descendants)."""
    from weight_transfer.experiments.env import measure_memcpy_gbps
    from weight_transfer.experiments.load import LoadMeter

    jobs = [(p, t) for p in a.peers for t in (a.torchstore_transports if p == "torchstore" else
                                              a.reference_transports if p == "reference" else (None,))]
    why_not: dict[str, str | None] = {}
    for peer, ts_tr in jobs:
        if peer not in why_not:
            why_not[peer] = None if peer == "reference" else _available(peer, a.torchstore_python)
            if why_not[peer]:
                run.skipped.append((peer, why_not[peer]))
        if why_not[peer]:
            continue
        label = (REFERENCE_LABEL[ts_tr] if peer == "reference" else TORCHSTORE_LABEL[ts_tr] if ts_tr
                 else _TRANSPORT.get(peer, "-"))
        load = LoadMeter()
        run.memcpys.append(measure_memcpy_gbps())
        load.start()
        try:
            secs, warm, got_bytes, phases = _run_one(a, run, peer, ts_tr, label)
        except Exception as e:
            run.skipped.append((peer if not ts_tr else f"{peer} {ts_tr}",
                                f"failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"))
            continue
        load.stop()
        meas = [x for x, w in zip(secs, warm) if not w]
        ok = all(isinstance(x, float) for x in secs)
        times = [x for x in meas if isinstance(x, float)]
        run.rows.append(dict(peer=peer, transport=label, bytes=got_bytes, times=times, ok=ok,
                             errors=[x for x in secs if not isinstance(x, float)], memcpy=run.memcpys[-1],
                             phases=[ph for ph, w in zip(phases, warm) if not w], cold=secs[0] if secs else None,
                             load=load.columns()))


def _table(run: _Run, mem: float, ref_gbps: float | None) -> list[dict]:
    """Print one table line per row (``mem``: the run's memcpy, GB/s; ``ref_gbps``: the
    reference's p50 bandwidth); returns the tidy CSV rows, one per measured update."""
    from weight_transfer.experiments.report import percentile

    out_rows = []
    for r in run.rows:
        if not r["times"]:
            print(f"  {r['peer']:>10} {r['transport'][:26]:>26} {r['bytes']:>12} {'-':>8} {'-':>8} {'-':>8} {'-':>8} "
                  f"{'-':>8} {'-':>7} {'-':>8} {'-':>8} {'NO':>9}")
            continue
        p50 = statistics.median(r["times"])
        gbps = r["bytes"] / p50 / 1e9
        ratio = f"{ref_gbps / gbps:.2f}" if ref_gbps else "-"
        cold = f"{r['cold']:>8.3f}" if isinstance(r["cold"], float) else f"{'-':>8}"
        print(f"  {r['peer']:>10} {r['transport'][:26]:>26} {r['bytes']:>12} {cold} {p50:>8.3f} "
              f"{percentile(r['times'], 95):>8.3f} {min(r['times']):>8.3f} "
              f"{max(r['times']):>8.3f} {gbps:>7.3f} {100 * gbps / mem:>7.1f}% {ratio:>8} {'yes' if r['ok'] else 'NO':>9}")
        for i, s in enumerate(r["times"]):
            out_rows.append(dict(run_id=run.run_id, git_sha=run.env["git_sha"], timestamp=run.stamp, host=run.env["host"],
                                 peer=r["peer"], transport=r["transport"], model=run.label, n_train=run.n_train,
                                 n_infer=run.tp, step=i, bytes=r["bytes"], seconds=f"{s:.6f}",
                                 memcpy_gbps=f"{r['memcpy']:.3f}", verified=r["ok"], **r["load"]))
    return out_rows


def _footer(run: _Run, mem: float, ref_gbps: float | None) -> int:
    """The ``#`` footer: memcpy, the reference's phases, torchstore's put / get and how the
    reference compares with it, verification, errors, rows not run. Returns the failed rows."""
    rows = run.rows
    print("#")
    print(f"# memcpy on this machine (same run, 1 thread, 256 MiB, median of {len(run.memcpys)}): {mem:.2f} GB/s")
    if run.ref_rows:  # the reference's own phases, slowest sender and receiver, extra memory (docs/PERFORMANCE.md)
        from weight_transfer.experiments.report import phase_lines

        for lab, rr in run.ref_rows:
            print("\n".join(line.replace("# ", f"# reference {lab}: ", 1) for line in phase_lines(rr, mem)))
    ts_rows = [r for r in rows if r["peer"] == "torchstore" and r["times"] and r["ok"]]
    for r in ts_rows:
        put = statistics.median(ph["put"] for ph in r["phases"]) if r["phases"] else float("nan")
        get = statistics.median(ph["get"] for ph in r["phases"]) if r["phases"] else float("nan")
        cold = f"{r['cold']:.3f} s" if isinstance(r["cold"], float) else "-"
        print(f"# torchstore {r['transport']}: p50 put {put:.3f} s (trainers) + get {get:.3f} s (generators); "
              f"cold first update {cold}")
    if ts_rows and ref_gbps:
        best = min(ts_rows, key=lambda r: statistics.median(r["times"]))
        best_gbps = best["bytes"] / statistics.median(best["times"]) / 1e9
        for r in [r for r in rows if r["peer"] == "reference" and r["times"] and r["ok"]]:
            g = r["bytes"] / statistics.median(r["times"]) / 1e9
            print(f"# reference {r['transport']} / best torchstore ({best['transport']}): {g / best_gbps:.2f}x "
                  f"({g:.3f} vs {best_gbps:.3f} GB/s, same run, both verified)")
    from weight_transfer.experiments.load import summary_line

    for r in rows:  # how loaded the machine was through each row's processes (experiments/load.py)
        print(summary_line([r["load"]], f" [{r['peer']} {r['transport']}]", window="its run"))
    n_bad = sum(not r["ok"] for r in rows)
    print(f"# verified bit-exact: {len(rows) - n_bad}/{len(rows)} peers" + ("" if not n_bad else "  <-- FAILED"))
    for r in rows:
        for e in r["errors"][:2]:
            print(f"#   {r['peer']}: {e}")
    for peer, why in run.skipped:
        print(f"# not run: {peer}: {why}")
    return n_bad


def _append_csv(path: str, out_rows: list[dict]) -> None:
    """Append the tidy rows to ``path`` (a header when the file is new; a file whose header lacks a
    column, e.g. the load columns, is rewritten with the union: its old rows leave them empty);
    nothing for '' or no rows."""
    if path and out_rows:
        from weight_transfer.experiments.report import append_csv

        append_csv(out_rows, path)
        print(f"# results: {path} (+{len(out_rows)} rows)")


def main(a: PeersBenchConfig) -> int:
    """Run each peer in turn, print the table, append ``a.csv``. Returns 0 when every peer that
    ran was verified, 1 otherwise (or when none ran)."""
    # imported in the steps: torchstore's own environment loads peer_tensors.py by path, and the
    # harness's modules are not there
    from weight_transfer.experiments.env import measure_memcpy_gbps

    run = _setup(a)
    _header(a, run)
    _run_peers(a, run)
    mem = statistics.median(run.memcpys) if run.memcpys else measure_memcpy_gbps()
    ref = next((r for r in run.rows if r["peer"] == "reference" and r["times"]), None)
    ref_gbps = ref["bytes"] / statistics.median(ref["times"]) / 1e9 if ref else None
    out_rows = _table(run, mem, ref_gbps)
    n_bad = _footer(run, mem, ref_gbps)
    _append_csv(a.csv, out_rows)
    return 0 if run.rows and not n_bad else 1


if __name__ == "__main__":  # python -m weight_transfer.experiments.bench.peers [options] = weight-transfer bench-peers
    from weight_transfer.experiments.cli import add_dataclass_options, dataclass_from_args

    _ap = argparse.ArgumentParser(prog="python -m weight_transfer.experiments.bench.peers", description=__doc__.split("\n")[0])
    add_dataclass_options(_ap, PeersBenchConfig)
    try:
        _cfg = dataclass_from_args(PeersBenchConfig, _ap.parse_args())
    except ValueError as _e:
        print(f"error: {_e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(_cfg))
