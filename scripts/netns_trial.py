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
   inference ranks in B. The controller's TCPStore listens in A and every rank reaches it at
   10.77.0.1 (the inference ranks over the veth). Each process gets ``UCX_TLS=tcp`` and
   ``UCX_NET_DEVICES=<the veth of its namespace>`` (NIXL's UCX backend over TCP on the veth),
   and ``GLOO_SOCKET_IFNAME=<that veth>`` (the training ranks' Gloo group binds the veth
   address rather than whatever the host name resolves to).
4. The controller writes its TrialResult; this launcher prints the usual table
   (``weight_transfer.experiments.report.format_table``) and a footer: the growth of ``rx_bytes`` of the
   inference-side veth during the trial, which must be at least the bytes written by all
   updates (warm-up included). Rows are appended to ``--results`` like ``weight-transfer
   run`` does.
5. The namespaces are deleted on exit, also on failure, Ctrl-C or SIGTERM (deleting a
   namespace removes its veth end); every task process is killed first.

Exit status: 0 when every update verified and the veth check holds; 1 otherwise; 2 for bad
input or when namespaces cannot be created. The last line is
``netns trial: ... verified N/N ... veth check: True``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

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
    ap.add_argument("--cfg", required=True, help="pickled TrialConfig")
    ap.add_argument("--global-rank", type=int, required=True)
    ap.add_argument("--store", required=True, help="HOST:PORT of the controller's TCPStore")
    ap.add_argument("--result", default=None, help="(controller) where to pickle the TrialResult")
    a = ap.parse_args(argv)
    from weight_transfer.experiments.trial import run_task

    with open(a.cfg, "rb") as f:
        cfg = pickle.load(f)
    host, port = a.store.rsplit(":", 1)
    progress = None
    if a.global_rank == 0:
        progress = lambda r: print(f"# step {r['step']}: {r['seconds']:.3f} s, verified={r['verified']}",  # noqa: E731
                                   file=sys.stderr, flush=True)
    result = run_task(cfg, a.global_rank, host, int(port), progress=progress)
    if a.global_rank == 0 and a.result:
        with open(a.result + ".part", "wb") as f:
            pickle.dump(result, f)
        os.replace(a.result + ".part", a.result)
    return 0


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
    ap.add_argument("--store-port", type=int, default=STORE_PORT, help="controller's TCPStore port (inside A)")
    ap.add_argument("--no-csv", action="store_true", help="do not append rows to --results")
    own, rest = ap.parse_known_args(argv)
    args = build_parser().parse_args(["run", *rest])
    return own, args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_task":
        return task_main(argv[1:])
    own, args = parse_args(argv)


    from weight_transfer.experiments.command import config_from_args
    from weight_transfer.types import PlanError

    try:
        if args.transport not in (None, "nixl"):
            raise ValueError(f"--transport {args.transport}: this launcher moves the weights with nixl only")
        cfg = config_from_args(args).replace(transport="nixl")
        if cfg.run.method == "all":
            raise ValueError("--method all: one method per launch here (reference, rank0_funnel or rpc)")
        cfg.model_config()
        from weight_transfer.experiments.methods import get_method

        get_method(cfg.run.method)
    except (ValueError, PlanError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2

    demo = _demo()
    sh = demo.sh
    ok, why = demo.netns_supported()
    if not ok:
        print(f"netns trial: cannot run: {why}", file=sys.stderr)
        return 2
    try:
        from weight_transfer.transport.nixl import load_nixl

        load_nixl()
    except ImportError as e:
        print(f"netns trial: cannot run: {e}", file=sys.stderr)
        return 2

    stale = cleanup_stale(sh)
    if stale:
        print(f"# removed stale namespaces/links of an earlier run: {' '.join(stale)}", file=sys.stderr)
    tag = os.getpid()
    ns_t, ns_i = f"wt-train-{tag}", f"wt-infer-{tag}"
    dev_t, dev_i = f"wtt{tag}", f"wti{tag}"
    procs: dict[int, subprocess.Popen] = {}
    tmp = tempfile.mkdtemp(prefix="wt-netns-trial-")

    def cleanup() -> None:
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

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    t_start = time.perf_counter()
    try:
        demo.make_veth_pair(ns_t, ns_i, dev_t, dev_i, TRAIN_IP, INFER_IP)

        cfg_path, res_path = os.path.join(tmp, "cfg.pkl"), os.path.join(tmp, "result.pkl")
        with open(cfg_path, "wb") as f:
            pickle.dump(cfg, f)
        from weight_transfer.experiments.trial import task_role, world_size

        n_tasks = world_size(cfg)
        print(f"# starting: controller + {cfg.train.n_train} training rank(s) in {ns_t} ({TRAIN_IP}, {dev_t}), "
              f"{cfg.n_infer} inference rank(s) in {ns_i} ({INFER_IP}, {dev_i}); NIXL/UCX tcp over the veth",
              file=sys.stderr, flush=True)
        rx0 = demo.rx_bytes(ns_i, dev_i)
        base_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                        UCX_TLS="tcp", OMP_NUM_THREADS="1")
        for g in range(n_tasks):
            role, _ = task_role(cfg, g)
            ns, dev = (ns_i, dev_i) if role == "infer" else (ns_t, dev_t)
            env = dict(base_env, UCX_NET_DEVICES=dev, GLOO_SOCKET_IFNAME=dev)
            cmd = ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), "_task",
                   "--cfg", cfg_path, "--global-rank", str(g), "--store", f"{TRAIN_IP}:{own.store_port}"]
            if g == 0:
                cmd += ["--result", res_path]
            procs[g] = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True)
        # wait for the controller; a rank that dies fails the trial at once
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
        if failed is not None or not os.path.exists(res_path):
            print(f"netns trial: FAILED: {failed or 'the controller wrote no result'}", file=sys.stderr)
            return 1
        rx = demo.rx_bytes(ns_i, dev_i) - rx0
        with open(res_path, "rb") as f:
            result = pickle.load(f)
    finally:
        cleanup()
        for s, h in old.items():
            signal.signal(s, h)

    from weight_transfer.experiments.report import append_csv, format_table

    rows = result.rows
    written = sum(r["bytes"] for r in rows)
    veth_ok = rx >= written
    n_ok = sum(1 for r in rows if r["verified"])
    all_ok = n_ok == len(rows) and all(r["verified"] for r in rows)
    print(format_table(result))
    print(f"# network namespaces: controller + training in {ns_t} ({TRAIN_IP}), inference in {ns_i} "
          f"({INFER_IP}); NIXL/UCX over TCP on veth {dev_t} <-> {dev_i} (UCX_TLS=tcp)")
    print(f"# veth {dev_i} rx_bytes grew by {rx} during the trial; bytes written by {len(rows)} updates "
          f"(warm-up included): {written}; crossed the link: {veth_ok}")
    if not own.no_csv:
        print(f"# rows appended to {append_csv(rows, args.results)}")
    print(f"netns trial: {cfg.model_config().label} {cfg.train.n_train} -> {cfg.n_infer} ranks, transport nixl over veth: "
          f"verified {n_ok}/{len(rows)}; veth rx {rx} >= {written} bytes written; veth check: {veth_ok}; "
          f"wall {time.perf_counter() - t_start:.1f} s")
    return 0 if all_ok and veth_ok else 1


if __name__ == "__main__":
    sys.exit(main())
