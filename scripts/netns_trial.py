"""A whole trial split over two "hosts" on one machine: the controller and the training ranks in
one network namespace, the inference ranks in another, weights moved with NIXL over TCP on the
veth pair between them; every update verified bit-exact, and the veth's receive counter shows
the bytes crossed the link.

Run (as root; needs ``ip netns`` and NIXL)::

    .venv/bin/python scripts/netns_trial.py                  # the main job's default config, transport nixl
    .venv/bin/python scripts/netns_trial.py --model qwen3-0.6b --override num_hidden_layers=2 --steps 3
    .venv/bin/python scripts/netns_trial.py --n-train 2 --tp 2 --results /tmp/netns.csv

Every option of ``weight-transfer run`` is accepted (``--model``, ``--override``,
``--n-train``, ``--tp``, ``--dp``, ``--quant``, ``--steps``, ``--watermark-mb``, ``--results``, ...)
and means the same (``weight_transfer.experiments.command.config_from_args``); the transport is always ``nixl``
and ``--method all`` is refused (one method per launch).

What happens:

1. Stale namespaces / veths of a killed earlier run (``wt-train-<tag>``, ``wt-infer-<tag>``,
   ``wtt<tag>``, ``wti<tag>`` whose launcher is gone) are deleted.
2. Namespaces ``wt-train-<pid>`` (A) and ``wt-infer-<pid>`` (B) are created, joined by a veth
   pair ``wtt<pid>`` / ``wti<pid>`` addressed 10.77.0.1/24 (A) and 10.77.0.2/24 (B), addresses
   that exist only inside these namespaces; ``lo`` is brought up in both.
3. Every task of the trial (:func:`weight_transfer.experiments.trial.task_role`: task 0 the controller, then the
   training ranks, then the inference ranks) is its own process, started with
   ``ip netns exec <ns> python scripts/netns_trial.py _task ...`` and calling
   :func:`weight_transfer.experiments.trial.run_task`: the controller and the training ranks in A, the
   inference ranks in B. The controller's store listens in A and every rank reaches it at
   10.77.0.1 (the inference ranks over the veth). The launcher makes the job secret first
   (:meth:`weight_transfer.security.secret.JobSecret.generate`, unless its own environment has one)
   and every task gets it in its environment (``WEIGHT_TRANSFER_SECRET``; never on the command
   line, never in a file). The trial config travels as JSON, the controller's result as msgpack
   (:mod:`weight_transfer.experiments.data`), both in the launcher's
   private temporary folder (mode 0700); nothing is pickled. Each process gets ``UCX_TLS=tcp`` and
   ``UCX_NET_DEVICES=<the veth of its namespace>`` (NIXL's UCX backend over TCP on the veth),
   and ``GLOO_SOCKET_IFNAME=<that veth>`` (the training ranks' Gloo group binds the veth
   address rather than whatever the host name resolves to).
4. The controller writes its TrialResult (as data); this launcher prints the usual table
   (``weight_transfer.experiments.report.format_table``) and a footer: the growth of ``rx_bytes`` of the
   inference-side veth during the trial, which must be at least the bytes written by all
   updates (warm-up included). Rows are appended to ``--results`` like ``weight-transfer
   run`` does.
5. The namespaces are deleted on exit, also on failure, Ctrl-C or SIGTERM (deleting a
   namespace removes its veth end); every task process is killed first.

A wire-bound link (``--link-rate RATE`` or ``--memory-wire-ratio X``; docs/DELTA.md, "On a
wire-bound link"): a ``tc`` token bucket (tbf) on the training-side veth's egress, the direction
the writes flow, at ``RATE`` (tc units: ``400mbit``, ``1.5gbit``, ``50mbps`` = MB/s) or at the
same run's single-thread memcpy bandwidth divided by ``X`` (measured here before the namespaces
exist; a cluster's HBM:NIC is ~100). Burst 128 KiB (two of veth's 64 KiB GSO packets; the
bucket's depth), queue ``max(4 MiB, 20 ms)``; no added delay (no netem in this kernel). The
report states the rate, the memcpy, their ratio, the veth's tx/rx counters and the bucket's
sent / dropped / overlimit counts, and each update's bytes on the link (``link_tx_bytes``: the
training veth's tx growth, read by the controller after every update); it compares the full
updates' p50 with ``bytes x 8 / rate`` and flags them when the wire is under 70% of it (not
wire-bound). Replayed RL steps and paired pushes (``--replay DIR --delta --delta-pairs``: every
step's weights pushed as a full update and as a delta in the same run) print the full-against-
delta table (:func:`weight_transfer.experiments.link.pair_table`) and append every row to
``--wire-csv`` (default results/runs/delta_wire.csv, untracked; ``make delta-wire`` records into
results/delta_wire.csv)::

    .venv/bin/python scripts/netns_trial.py --memory-wire-ratio 100 \
        --model qwen3-0.6b --override num_hidden_layers=2 --override vocab_size=8192 --n-train 2 --tp 1 \
        --replay results/runs/rl_steps/lr1e-6 --replay-start 1 --delta --delta-pairs --delta-op-cost 0 \
        --warmup 2 --steps 12
    make delta-wire      # NIXL installed if missing, the RL steps saved if missing, bf16 and FP8 at both lrs

Exit status: 0 when every update verified and the veth check holds; 1 otherwise; 2 for bad
input or when namespaces cannot be created. The last line is
``netns trial: ... verified N/N ... veth check: True``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TRAIN_IP, INFER_IP, STORE_PORT = "10.77.0.1", "10.77.0.2", 29578
_NS_RE = re.compile(r"^wt-(?:train|infer)-(\d+)$")
_DEV_RE = re.compile(r"^wt[ti](\d+)$")


def _demo():
    """scripts/netns_demo.py (its namespace helpers: ``sh``, ``netns_supported``, ``rx_bytes``)."""
    spec = importlib.util.spec_from_file_location("netns_demo", os.path.join(ROOT, "scripts", "netns_demo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------------------------
# one task (runs inside a namespace)


def task_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="netns_trial.py _task")
    ap.add_argument("--cfg", required=True, help="the TrialConfig as JSON (experiments/data.py)")
    ap.add_argument("--global-rank", type=int, required=True)
    ap.add_argument("--store", required=True, help="HOST:PORT of the controller's store")
    ap.add_argument("--result", default=None, help="(controller) where to write the TrialResult (msgpack)")
    a = ap.parse_args(argv)
    from weight_transfer.experiments.data import config_from_json, result_to_bytes
    from weight_transfer.experiments.trial import run_task

    with open(a.cfg, "rb") as f:
        cfg = config_from_json(f.read())
    host, port = a.store.rsplit(":", 1)
    progress = None
    if a.global_rank == 0:
        progress = lambda r: print(f"# step {r['step']}: {r['seconds']:.3f} s, verified={r['verified']}",  # noqa: E731
                                   file=sys.stderr, flush=True)
    link_dev = os.environ.get("WT_LINK_DEV")
    if a.global_rank == 0 and link_dev:  # each update's bytes on the training veth (tx; the controller is in its namespace)
        prev = [_sys_counter(link_dev, "tx_bytes"), _sys_counter(link_dev, "tx_packets")]

        def progress(r):
            now = [_sys_counter(link_dev, "tx_bytes"), _sys_counter(link_dev, "tx_packets")]
            r["link_tx_bytes"], r["link_tx_packets"] = now[0] - prev[0], now[1] - prev[1]
            prev[:] = now
            print(f"# step {r['step']}: {r['seconds']:.3f} s, verified={r['verified']}, {r.get('pair_mode') or r.get('delta') or 'full'}, "
                  f"{r.get('delta_bytes', r['bytes'])} B written, {r['link_tx_bytes']} B on the link", file=sys.stderr, flush=True)
    result = run_task(cfg, a.global_rank, host, int(port), progress=progress)
    if a.global_rank == 0 and a.result:
        with open(a.result + ".part", "wb") as f:
            f.write(result_to_bytes(result))
        os.replace(a.result + ".part", a.result)
    return 0


def _sys_counter(dev: str, name: str) -> int:
    """``/sys/class/net/<dev>/statistics/<name>`` of this process's namespace."""
    with open(f"/sys/class/net/{dev}/statistics/{name}") as f:
        return int(f.read())


# --------------------------------------------------------------------------------------------
# orchestration (root namespace)


def _launcher_tags() -> set[int]:
    """Tags (pid, and pid % 100000 as scripts/netns_demo.py uses) of live netns launchers."""
    tags = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"netns_demo" in cmd or b"netns_trial" in cmd:
            tags |= {int(d), int(d) % 100000}
    return tags


def cleanup_stale(sh) -> list[str]:
    """Delete namespaces and root-namespace veths of earlier runs whose launcher is gone."""
    live = _launcher_tags()
    gone = []
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_RE.match(name)
        if m and int(m.group(1)) not in live:
            sh("ip", "netns", "del", name, check=False)
            gone.append(name)
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            m = _DEV_RE.match(name)
            if m and int(m.group(1)) not in live:
                sh("ip", "link", "del", name, check=False)
                gone.append(name)
    return gone


def parse_args(argv: list[str]):
    """(launcher options, the TrialConfig): every ``weight-transfer run`` option is
    parsed by that command's own parser."""
    from weight_transfer.experiments.command import build_parser

    ap = argparse.ArgumentParser(
        prog="netns_trial.py", description=__doc__.split("\n\n")[0],
        epilog="Every option of `weight-transfer run` is accepted as well (--model, --override, "
               "--n-train, --tp, --steps, --results, ...).")
    ap.add_argument("--store-port", type=int, default=STORE_PORT, help="controller's store port (inside A)")
    ap.add_argument("--no-csv", action="store_true", help="do not append rows to --results")
    lk = ap.add_mutually_exclusive_group()
    lk.add_argument("--link-rate", default=None, metavar="RATE",
                    help="rate-limit the link (tc tbf on the training veth): tc units, e.g. 400mbit, 2gbit, 50mbps (MB/s)")
    lk.add_argument("--memory-wire-ratio", type=float, default=None, metavar="X",
                    help="rate-limit the link to this run's single-thread memcpy bandwidth / X (a cluster's ~100)")
    ap.add_argument("--link-burst", type=int, default=None, metavar="BYTES",
                    help="the token bucket's burst (default 131072: two 64 KiB GSO packets)")
    ap.add_argument("--wire-csv", default=os.path.join(ROOT, "results", "runs", "delta_wire.csv"), metavar="PATH",
                    help="with a link rate: append every row (with the link's columns) here (default "
                         "results/runs/delta_wire.csv, untracked; the committed record is results/delta_wire.csv, "
                         "written by `make delta-wire`); '' for none")
    own, rest = ap.parse_known_args(argv)
    if own.link_rate is not None:
        from weight_transfer.experiments.link import parse_rate

        parse_rate(own.link_rate)  # ValueError: reported as one error line before anything starts
    if own.memory_wire_ratio is not None and not own.memory_wire_ratio > 1:
        raise ValueError(f"--memory-wire-ratio {own.memory_wire_ratio}: > 1 (a cluster's is ~100)")
    if own.link_burst is not None and own.link_burst < 65536 + 128:
        raise ValueError(f"--link-burst {own.link_burst}: at least 65664 (one 64 KiB GSO packet plus headers)")
    if own.link_burst is not None and own.link_rate is None and own.memory_wire_ratio is None:
        raise ValueError("--link-burst without --link-rate or --memory-wire-ratio")
    args = build_parser().parse_args(["run", *rest])
    return own, args


def trial_config(args):
    """The TrialConfig of the parsed ``weight-transfer run`` options, transport nixl. Raises
    ValueError (another transport, ``--method all``) or PlanError (a model it cannot plan)."""
    from weight_transfer.experiments.command import config_from_args

    transport = getattr(args, "transport", None)  # options not given are absent from the namespace
    if transport not in (None, "nixl"):
        raise ValueError(f"--transport {transport}: this launcher moves the weights with nixl only")
    cfg = config_from_args(args).replace(transport="nixl")
    if cfg.run.method == "all":
        raise ValueError("--method all: one method per launch here (reference, rank0_funnel or rpc)")
    cfg.model_config()
    from weight_transfer.experiments.methods import get_method

    get_method(cfg.run.method)
    return cfg


def _cannot_run(demo, own) -> str | None:
    """Why this machine cannot run the launch (no network namespaces, no NIXL, no tc for a
    rate-limited link); None when it can."""
    ok, why = demo.netns_supported()
    if not ok:
        return why
    try:
        from weight_transfer.transport.nixl import load_nixl

        load_nixl()
    except ImportError as e:
        return f"{e} (install it: make nixl, or {sys.executable} -m pip install 'nixl-cu12==1.5.1')"
    if (own.link_rate is not None or own.memory_wire_ratio is not None) and shutil.which("tc") is None:
        return "--link-rate / --memory-wire-ratio need tc (iproute2)"
    return None


@dataclass
class _Wire:
    """The link of one launch: this run's single-thread memcpy (GB/s) and, when rate-limited,
    the token bucket's rate (bits/s), how it was chosen and its burst (bytes)."""

    memcpy: float
    rate_bits: float | None
    how: str | None
    burst: int


def _wire(own, cfg):
    """(the link, the config): the memcpy is measured now, before the namespaces exist; a
    rate-limited delta run prices its bytes at the link's rate."""
    from weight_transfer.experiments import link
    from weight_transfer.experiments.env import measure_memcpy_gbps

    memcpy = measure_memcpy_gbps()  # the same run's local memory bandwidth (one thread, 256 MiB, best of 3)
    rate_bits = how = None
    if own.link_rate is not None or own.memory_wire_ratio is not None:
        rate_bits, how = link.wire_rate_bits(link_rate=own.link_rate, ratio=own.memory_wire_ratio, memcpy_gbps=memcpy)
    ex = cfg.transfer.executor
    if rate_bits and ex.delta and getattr(ex, "delta_wire_gbps", "absent") is None:
        cfg = cfg.replace(delta_wire_gbps=rate_bits / 8e9)  # the delta cost model prices bytes at the link's rate
    return _Wire(memcpy, rate_bits, how, own.link_burst or link.BURST_BYTES), cfg


def _cleanup(sh, procs: dict[int, subprocess.Popen], names: tuple[str, str, str, str], tmp: str) -> None:
    """Kill every task process, delete both namespaces (their veth ends go with them), the
    training veth if setup broke before moving it, and the temporary folder."""
    ns_t, ns_i, dev_t, _ = names
    for p in procs.values():
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs.values():
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass
    for ns in (ns_t, ns_i):
        sh("ip", "netns", "del", ns, check=False)
    sh("ip", "link", "del", dev_t, check=False)  # only left in the root namespace if setup broke early
    shutil.rmtree(tmp, ignore_errors=True)


def _on_signal(signum, _frame):
    """SIGTERM / SIGHUP: leave through the cleanup like Ctrl-C."""
    raise SystemExit(128 + signum)


def _counters(sh, names: tuple[str, str, str, str]) -> dict[str, int]:
    """tx bytes / packets of the training veth and rx bytes / packets of the inference veth."""
    ns_t, ns_i, dev_t, dev_i = names
    return {k: int(sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/{k}").stdout)
            for ns, dev, keys in ((ns_t, dev_t, ("tx_bytes", "tx_packets")), (ns_i, dev_i, ("rx_bytes", "rx_packets")))
            for k in keys}


def task_env() -> dict[str, str]:
    """The environment every task starts with: this launcher's, with the job secret (this
    environment's, else a fresh one: :mod:`weight_transfer.security.secret`) -- the controller serves
    the store with it and the ranks prove membership with it -- and the project on the path."""
    from weight_transfer.security.secret import ENV_INSECURE, ENV_SECRET, JobSecret, insecure_requested

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               UCX_TLS="tcp", OMP_NUM_THREADS="1")
    if insecure_requested():
        env[ENV_INSECURE] = "1"
    elif JobSecret.from_env() is None:
        env[ENV_SECRET] = JobSecret.generate().hex()
    return env


def _start_tasks(cfg, own, names, cfg_path: str, res_path: str, procs: dict[int, subprocess.Popen]) -> None:
    """Start every task of the trial in its namespace (into ``procs`` as they start, so the
    cleanup finds them): the controller and the training ranks in A, the inference ranks in B,
    every one with the job secret in its environment (:func:`task_env`)."""
    from weight_transfer.experiments.trial import task_role, world_size

    ns_t, ns_i, dev_t, dev_i = names
    base_env = task_env()
    for g in range(world_size(cfg)):
        role, _ = task_role(cfg, g)
        ns, dev = (ns_i, dev_i) if role == "infer" else (ns_t, dev_t)
        env = dict(base_env, UCX_NET_DEVICES=dev, GLOO_SOCKET_IFNAME=dev)
        if g == 0:
            env["WT_LINK_DEV"] = dev_t  # the controller records each update's bytes on the link
        cmd = ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), "_task",
               "--cfg", cfg_path, "--global-rank", str(g), "--store", f"{TRAIN_IP}:{own.store_port}"]
        if g == 0:
            cmd += ["--result", res_path]
        procs[g] = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True)


def _wait_tasks(cfg, procs: dict[int, subprocess.Popen]) -> str | None:
    """Wait for the controller; a rank that dies fails the trial at once. Then the others (60 s
    at most). What failed, or None."""
    from weight_transfer.experiments.trial import task_role

    failed = None
    while procs[0].poll() is None:
        bad = {g: p.returncode for g, p in procs.items() if g and p.poll() not in (None, 0)}
        if bad:
            failed = "; ".join(f"task {g} ({'/'.join(map(str, task_role(cfg, g)))}) exited with {rc}"
                               for g, rc in sorted(bad.items()))
            break
        time.sleep(0.2)
    if failed is None and procs[0].returncode:
        failed = f"controller exited with {procs[0].returncode}"
    if failed is None:
        deadline = time.monotonic() + 60
        for p in procs.values():
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        bad = {g: p.returncode for g, p in procs.items() if p.returncode != 0}
        if bad:
            failed = "; ".join(f"task {g} exited with {rc}" for g, rc in sorted(bad.items()))
    return failed


def _run_in_namespaces(demo, own, cfg, wire: _Wire, names, procs, tmp: str) -> dict | None:
    """The veth pair (and its token bucket), the trial's tasks, the link's counters around them;
    the controller's TrialResult with ``rx`` (the inference veth's rx growth), the counters
    before / after and the bucket's statistics. None when the trial failed (said on stderr)."""
    from weight_transfer.experiments import link

    sh = demo.sh
    ns_t, ns_i, dev_t, dev_i = names
    demo.make_veth_pair(ns_t, ns_i, dev_t, dev_i, TRAIN_IP, INFER_IP)
    if wire.rate_bits:  # the wire-bound link: a token bucket on the training side's egress (the writes' direction)
        tbf = link.tbf_command(dev_t, wire.rate_bits, burst=wire.burst)
        sh("ip", "netns", "exec", ns_t, *tbf)
        print(f"# link: {' '.join(tbf)} in {ns_t} ({wire.how}); "
              f"{link.format_rate(wire.rate_bits)}; memcpy {wire.memcpy:.2f} GB/s -> memory:wire "
              f"{link.memory_wire_ratio(wire.memcpy, wire.rate_bits):.1f}:1", file=sys.stderr, flush=True)
    c0 = _counters(sh, names)
    cfg_path, res_path = os.path.join(tmp, "cfg.json"), os.path.join(tmp, "result.msgpack")
    from weight_transfer.experiments.data import config_to_json, result_from_bytes

    with open(cfg_path, "wb") as f:
        f.write(config_to_json(cfg))
    print(f"# starting: controller + {cfg.train.n_train} training rank(s) in {ns_t} ({TRAIN_IP}, {dev_t}), "
          f"{cfg.n_infer} inference rank(s) in {ns_i} ({INFER_IP}, {dev_i}); NIXL/UCX tcp over the veth",
          file=sys.stderr, flush=True)
    rx0 = demo.rx_bytes(ns_i, dev_i)
    _start_tasks(cfg, own, names, cfg_path, res_path, procs)
    failed = _wait_tasks(cfg, procs)
    if failed is not None or not os.path.exists(res_path):
        print(f"netns trial: FAILED: {failed or 'the controller wrote no result'}", file=sys.stderr)
        return None
    rx = demo.rx_bytes(ns_i, dev_i) - rx0
    c1 = _counters(sh, names)
    tc_stats = link.parse_tc_stats(sh("ip", "netns", "exec", ns_t, "tc", "-s", "qdisc", "show", "dev", dev_t,
                                      check=False).stdout) if wire.rate_bits else {}
    with open(res_path, "rb") as f:
        result = result_from_bytes(f.read())
    return {"result": result, "rx": rx, "c0": c0, "c1": c1, "tc_stats": tc_stats}


def _link_report(own, cfg, wire: _Wire, names, got: dict, written: int) -> dict:
    """With a rate-limited link or paired pushes: the link's columns on every row, the link's
    lines (rate, counters, the wire-bound check), the full-against-delta table, the rows in
    ``--wire-csv``. Returns the wire-bound check (:func:`weight_transfer.experiments.link.wire_check`)."""
    from weight_transfer.experiments import link
    from weight_transfer.experiments.report import append_csv

    _, _, dev_t, dev_i = names
    rows, rate_bits, memcpy, burst = got["result"].rows, wire.rate_bits, wire.memcpy, wire.burst
    grown = {k: got["c1"][k] - got["c0"][k] for k in got["c0"]}
    tc_stats, wire_check = got["tc_stats"], {}
    lr = None
    if cfg.run.replay:
        lr = cfg.run.step_source().manifest.get("lr")
    for r in rows:
        r.update(link_rate_bits=rate_bits or 0, link_burst=burst if rate_bits else 0, memcpy_gbps=memcpy,
                 memory_wire_ratio=link.memory_wire_ratio(memcpy, rate_bits) if rate_bits else None,
                 replay=os.path.basename(cfg.run.replay) if cfg.run.replay else "", replay_lr=lr,
                 delta_op_cost=cfg.transfer.executor.delta_op_cost,
                 delta_mode=getattr(cfg.transfer.executor, "delta_mode", "") if cfg.transfer.executor.delta else "",
                 delta_format=getattr(cfg.transfer.executor, "delta_format", "") if cfg.transfer.executor.delta else "",
                 delta_wire_gbps=getattr(cfg.transfer.executor, "delta_wire_gbps", None))
    if rate_bits:
        print(f"# link: tbf rate {link.format_rate(rate_bits)} ({wire.how}), burst {burst} B, limit "
              f"{link.queue_limit(rate_bits)} B, no delay; memcpy (1 thread, this run) {memcpy:.2f} GB/s; "
              f"memory:wire {link.memory_wire_ratio(memcpy, rate_bits):.1f}:1")
        print(f"# link counters over the trial: {dev_t} tx {grown['tx_bytes']} B / {grown['tx_packets']} packets, "
              f"{dev_i} rx {grown['rx_bytes']} B / {grown['rx_packets']} packets "
              f"({grown['tx_bytes'] / max(1, grown['tx_packets']):.0f} B per packet); tbf sent {tc_stats.get('bytes')} B, "
              f"dropped {tc_stats.get('dropped')}, overlimits {tc_stats.get('overlimits')} (packets held for tokens); "
              f"link bytes / bytes written {grown['tx_bytes'] / max(1, written):.3f}")
        wire_check = link.wire_check(rows, rate_bits)
        if wire_check:
            print(f"# wire-bound check: full updates p50 {wire_check['full_p50_s']:.4f} s against bytes x 8 / rate = "
                  f"{wire_check['full_bytes']:.0f} B -> {wire_check['wire_s']:.4f} s on the wire "
                  f"({100 * wire_check['share']:.0f}% of the update): "
                  f"{'wire-bound' if wire_check['wire_bound'] else 'NOT WIRE-BOUND (the link is not the limit)'}")
    if cfg.run.delta_pairs or cfg.transfer.executor.delta:
        table, _ = link.pair_table(rows, rate_bits)
        print(table)
    if own.wire_csv and not own.no_csv:
        print(f"# rows appended to {append_csv(rows, own.wire_csv)}")
    return wire_check


def _report(own, args, cfg, wire: _Wire, names, got: dict, t_start: float) -> int:
    """The trial's table, the namespaces and the veth check, the link's report, the rows in
    ``--results``, and the last line. Returns the exit status."""
    from weight_transfer.experiments import link
    from weight_transfer.experiments.report import append_csv, format_table

    ns_t, ns_i, dev_t, dev_i = names
    result, rx, rate_bits = got["result"], got["rx"], wire.rate_bits
    rows = result.rows
    written = sum(r.get("delta_bytes", r["bytes"]) for r in rows)  # what was written (a delta writes less than `bytes`)
    veth_ok = rx >= written
    n_ok = sum(1 for r in rows if r["verified"])
    all_ok = n_ok == len(rows) and all(r["verified"] for r in rows)
    print(format_table(result))
    print(f"# network namespaces: controller + training in {ns_t} ({TRAIN_IP}), inference in {ns_i} "
          f"({INFER_IP}); NIXL/UCX over TCP on veth {dev_t} <-> {dev_i} (UCX_TLS=tcp)")
    print(f"# veth {dev_i} rx_bytes grew by {rx} during the trial; bytes written by {len(rows)} updates "
          f"(warm-up included): {written}; crossed the link: {veth_ok}")
    wire_check = {}
    if rate_bits or cfg.run.delta_pairs:
        wire_check = _link_report(own, cfg, wire, names, got, written)
    if not own.no_csv:
        print(f"# rows appended to {append_csv(rows, args.results)}")
    print(f"netns trial: {cfg.model_config().label} {cfg.train.n_train} -> {cfg.n_infer} ranks, transport nixl over veth: "
          f"verified {n_ok}/{len(rows)}; veth rx {rx} >= {written} bytes written; veth check: {veth_ok}; "
          + (f"link {link.format_rate(rate_bits)}, wire-bound: {wire_check.get('wire_bound')}; " if rate_bits else "")
          + f"wall {time.perf_counter() - t_start:.1f} s")
    return 0 if all_ok and veth_ok else 1


def main(argv: list[str] | None = None) -> int:
    """The launcher (``_task ...``: one task, :func:`task_main`): parse, check this machine,
    set up the namespaces and run the trial there, report. Returns the exit status (module
    docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_task":
        return task_main(argv[1:])
    try:
        own, args = parse_args(argv)
    except ValueError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    from weight_transfer.types import PlanError

    try:
        cfg = trial_config(args)
    except (ValueError, PlanError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    demo = _demo()
    why = _cannot_run(demo, own)
    if why:
        print(f"netns trial: cannot run: {why}", file=sys.stderr)
        return 2
    wire, cfg = _wire(own, cfg)

    stale = cleanup_stale(demo.sh)
    if stale:
        print(f"# removed stale namespaces/links of an earlier run: {' '.join(stale)}", file=sys.stderr)
    tag = os.getpid()
    names = (f"wt-train-{tag}", f"wt-infer-{tag}", f"wtt{tag}", f"wti{tag}")
    procs: dict[int, subprocess.Popen] = {}
    tmp = tempfile.mkdtemp(prefix="wt-netns-trial-")
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    t_start = time.perf_counter()
    try:
        got = _run_in_namespaces(demo, own, cfg, wire, names, procs, tmp)
    finally:
        _cleanup(demo.sh, procs, names, tmp)
        for s, h in old.items():
            signal.signal(s, h)
    if got is None:
        return 1
    return _report(own, args, cfg, wire, names, got, t_start)


if __name__ == "__main__":
    sys.exit(main())
