"""The one command: ``weight-transfer {run,rl,simulate,sweep,faults,secret,vllm-recover,analyze,timeline,report,bench-quant,bench-pipeline,bench-transports,bench-peers,bench-delta,bench-stall,bench-control,bench-verify,bench-trl}``
(the console script of the ``weight-transfer`` distribution; ``python -m weight_transfer.experiments`` is the same).

Examples::

    weight-transfer run                                  # the README's main job
    weight-transfer run --model qwen3-30b-a3b --override num_hidden_layers=2 \\
        --override num_experts=16 --tp 2 --ep --quant fp8 --steps 3
    weight-transfer run --n-train 4 --tp 2 --dp 2 --train-dtype float32
    weight-transfer run --method all --override num_hidden_layers=2 --steps 3   # reference vs baselines
    weight-transfer run --watermark-mb 64 --offload --trace results/runs/trace   # pipeline options
    weight-transfer run --device cuda --transport cuda_ipc   # every rank on the GPU (docs/GPU.md)
    weight-transfer run --serial                         # stage-serialized executor
    weight-transfer rl --steps 30                        # an RL loop on vLLM that learns (examples/rl_loop.py)
    weight-transfer rl --lr 1e-5 --steps 20 --changes    # what one step changes (docs/DELTA.md)
    weight-transfer sweep --list                         # named sweeps (docs/SWEEPS.md)
    weight-transfer sweep qwen3_cpu_small --cluster local
    weight-transfer run --method rank0_funnel --bucket-bytes 67108864   # baselines' options
    weight-transfer bench-quant --repeats 3                # benchmarks (experiments/bench/)
    weight-transfer bench-pipeline --steps 2 --watermarks-mb 256,64,0 --offload
    weight-transfer bench-transports --mib 64 --transports memcpy,cma
    weight-transfer faults --quick                       # fault matrix subset (docs/FAULTS.md)
    weight-transfer bench-peers --peers reference,awex,mooncake   # docs/PEERS.md
    weight-transfer analyze                              # results CSVs -> results/summary.md + PNGs
    weight-transfer timeline results/runs/trace/step0002.json -o timeline.png   # one update's pipeline
    weight-transfer secret --out ~/.weight-transfer/secret   # a job secret for a multi-host job (docs/SECURITY.md)
    weight-transfer vllm-recover --url http://127.0.0.1:8000   # a vLLM server after a killed trainer (docs/VLLM.md)

Bad input (unknown model, world sizes that cannot shard, missing or extra tensors) exits with
status 2 and a one-line ``error:`` message before any byte is written; a bad option value
(an override of the wrong kind or without ``=``, an unknown or uninstalled transport, an
unwritable ``--trace``, a timeout <= 0, more rank processes than this machine's cap) before
any process starts (C18).
"""
from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
from pathlib import Path

from .paths import project_dir

DEFAULT_RESULTS = project_dir() / "results" / "runs" / "trials.csv"


class _Parser(argparse.ArgumentParser):
    """argparse, except that a bad command line is refused with one ``error:`` line (and a
    pointer to ``--help``) instead of the usage block: exit status 2 (C18)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The one CLI: ``run``, ``simulate``, ``sweep`` and the benchmarks (``bench-*``, their
    options generated from their config dataclasses by :mod:`weight_transfer.experiments.cli`). A benchmark's
    module (torch, pandas) is imported only when ``argv`` (default ``sys.argv[1:]``) selects it."""
    from .bench import BENCHMARKS
    from .cli import add_dataclass_options

    ap = _Parser(prog="weight-transfer", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    from .config import OPTION_META, TrialConfig, main_job_default

    run = sub.add_parser("run", help="run one trial: controller + training world + inference world, verified",
                         description="Run one trial: controller + training world + inference world, every update "
                                     "verified. Every option is a field of TrialConfig's parts "
                                     "(weight_transfer.experiments.config); without --model the defaults are the "
                                     "main job's (README), shown here.")
    # every option defaults to None = "as in the base config": the main job's embedded default
    # (main_job_default) without --model, TrialConfig's defaults with it
    add_dataclass_options(run, TrialConfig, meta=OPTION_META, defaults=main_job_default().flat())
    run.add_argument("--results", default=str(DEFAULT_RESULTS), help="CSV to append tidy rows to (default: %(default)s)")
    rl = sub.add_parser("rl", help="an RL loop on an unmodified vLLM, pushed one-sidedly after every step and verified "
                                    "(examples/rl_loop.py)",
                        description="2 FSDP2 training ranks, vLLM (one_sided backend) sampling a group per prompt, "
                                    "GRPO-clipped policy gradient, AdamW, a push after every step verified against a "
                                    "reload oracle, the end against a fresh vLLM (examples/rl_loop.py; options: "
                                    "weight_transfer.experiments.rl.RLOptions).")
    from .rl_options import RLOptions

    add_dataclass_options(rl, RLOptions)
    sim = sub.add_parser("simulate", help="at-scale prediction: real planner on synthesized metadata + cost model "
                                          "(docs/SIMULATION.md)")
    sim.add_argument("config", nargs="?", help="named simulation config (see --list)")
    from .sim.options import SimulateOptions

    add_dataclass_options(sim, SimulateOptions, namespace_defaults=True)
    sw = sub.add_parser("sweep", help="run a named sweep with submitit: one job per trial, its tasks the ranks "
                                      "(docs/SWEEPS.md)")
    sw.add_argument("name", nargs="?", help="sweep or named config (see --list)")
    from .sweep import LaunchOptions

    sw.add_argument("--list", action="store_true", help="list the sweeps and named configs")
    add_dataclass_options(sw, LaunchOptions, namespace_defaults=True)
    sw.add_argument("--results-dir", default=str(DEFAULT_RESULTS.parent.parent),
                    help="rows -> DIR/<sweep>.csv (default: %(default)s)")
    sw.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    from .faults import add_arguments as fault_arguments

    fault_arguments(sub.add_parser("faults", help="fault matrix: {kill, raise, stop} x {training, inference, "
                                                  "controller} x {early, middle, late} (docs/FAULTS.md)"))
    sec = sub.add_parser("secret", help="make a fresh job secret: print it (hex), or write it to a file only you can "
                                        "read (docs/SECURITY.md)",
                         description="Make a fresh job secret (32 random bytes from the OS): only processes that hold "
                                     "it can connect to a job's control-plane store. Printed as hex on stdout (for "
                                     "WEIGHT_TRANSFER_SECRET), or written to PATH (mode 0600) with the line that "
                                     "points every member at it printed instead. A one-host job needs none: "
                                     "the store's process makes one and its children inherit it; a multi-host job "
                                     "hands the same one to every host (docs/SECURITY.md).")
    sec.add_argument("--out", metavar="PATH", default=None,
                     help="write the secret to PATH (created or replaced, mode 0600) and print "
                          "`export WEIGHT_TRANSFER_SECRET_FILE=PATH` (default: print the secret itself)")
    rec = sub.add_parser("vllm-recover", help="return a vLLM server's one_sided backend to a fresh server's state "
                                              "after a training run that did not end cleanly (docs/VLLM.md)",
                         description="Release what a training run that is gone left in a vLLM server's workers "
                                     "(registration, shadow targets, staging, an update session left open), label the "
                                     "weights incomplete:v when an interrupted update had begun writing them, and "
                                     "resume generation. A run whose store still answers is kept unless --force. The "
                                     "next trainer's first sync does the same by itself (docs/VLLM.md).")
    rec.add_argument("--url", required=True, help="the vLLM server, http://host:port (VLLM_SERVER_DEV_MODE=1)")
    rec.add_argument("--force", action="store_true", help="release a run whose store still answers too")
    rec.add_argument("--timeout", type=float, default=120.0, help="seconds for the server's answer (default 120)")
    # analysis's own command lines, behind the one command (analysis imports no transfer code)
    for name, help_ in (("analyze", "results CSVs -> results/summary.md and PNG plots (weight_transfer.analysis)"),
                        ("timeline", "draw one update's pipeline from a --trace Chrome trace (weight_transfer.analysis.timeline)"),
                        ("report", "the README's results table from the committed CSVs (weight_transfer.experiments.readme_table)")):
        a = sub.add_parser(name, help=help_, add_help=False)
        a.add_argument("rest", nargs=argparse.REMAINDER, help="its own options (see weight-transfer NAME --help)")
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, cls_name, help_) in BENCHMARKS.items():
        b = sub.add_parser(name, help=help_, description=f"{help_} ({module}; options: {cls_name})")
        if name == chosen:
            import importlib

            cls = getattr(importlib.import_module(module), cls_name)
            add_dataclass_options(b, cls)
            b.set_defaults(bench=(module, cls))
    return ap


def config_from_args(args):
    """The TrialConfig a ``run`` command line means: the main job's default
    (:func:`weight_transfer.experiments.config.main_job_default`) when ``--model`` is not given
    (``--override`` then adds to its overrides), else ``TrialConfig`` with that model; every
    given option replaces the base's value (:func:`weight_transfer.experiments.cli.dataclass_from_args`)."""
    from .cli import given, replace_flat
    from .config import TrialConfig, main_job_default

    flat = given(TrialConfig, args)
    if "model" not in flat:
        base = main_job_default()
        if "overrides" in flat:
            flat["overrides"] = {**base.model.overrides, **flat["overrides"]}
    else:
        base = TrialConfig.from_flat(model=flat["model"])
    return replace_flat(base, **flat) if flat else base


def sweep_main(args) -> int:
    """``weight-transfer sweep``: list, or run a named sweep / config with submitit."""

    from .configs import get_sweep, list_text
    from .sweep import LaunchOptions, executor_parameters, format_summary, run_sweep

    if args.list or not args.name:
        print(list_text())
        return 0
    try:
        sweep = get_sweep(args.name)
        from .cli import dataclass_from_args

        opt = dataclass_from_args(LaunchOptions, args)
        from .report import check_output_dir

        check_output_dir(args.results_dir, "--results-dir")  # C25: before any job is submitted
        check_output_dir(opt.folder, "--folder")
        from weight_transfer.security.secret import JobSecret

        JobSecret.from_env()  # a secret set in this environment is used for every job: it must be one
        if opt.cluster == "slurm" and not shutil.which("sbatch"):
            raise ValueError("--cluster slurm: no sbatch on PATH (a SLURM client is needed here; "
                             "scripts/slurm_local.sh start runs a one-node cluster on this machine)")
        for cfg in sweep.trials:
            if cfg.fleet.active:  # the local launcher holds the engine processes it kills and starts
                raise ValueError(f"sweep {sweep.name}: --kill-engine/--restart-engine/--engines-at run under "
                                 "weight-transfer run only (the local launcher)")
            executor_parameters(cfg, opt)
            if opt.cluster != "slurm":
                cfg.preflight(local=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# sweep {sweep.name}: {len(sweep)} trials on cluster={opt.cluster}; rows -> "
          f"{Path(args.results_dir) / (sweep.name + '.csv')}; job logs in {opt.folder}", file=sys.stderr)
    summary = run_sweep(sweep, opt, results_dir=Path(args.results_dir), progress=not args.no_progress)
    print(format_summary(summary))
    return 0 if not summary.failed else 1


def recover_main(args) -> int:
    """``weight-transfer vllm-recover --url URL [--force]``: the server's recovery
    (:func:`weight_transfer.engines.vllm.backend.recover.recover_http`); prints what it released, the
    weight version and whether generation resumed, one line each. Exit 2 with one ``error:``
    line for a bad URL or timeout, 1 when the server refuses or does not answer."""
    if not args.url.startswith(("http://", "https://")) or not args.timeout > 0:
        print(f"error: --url {args.url!r} --timeout {args.timeout}: an http(s):// URL and seconds > 0",
              file=sys.stderr)
        return 2
    from weight_transfer.engines.vllm.backend.recover import ServerError, recover_http

    try:
        out = recover_http(args.url, stale_only=not args.force, timeout=args.timeout)
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for w in out["workers"]:
        what = ("released" if w["released"] else "kept (its store answers; --force releases it)" if w["alive"]
                else "nothing to release")
        extra = " (an update was interrupted" + (" while writing the live weights)" if w["mixed"] else ")") \
            if w["interrupted"] else ""
        print(f"inference {w['rank']}: {what}{'' if w['holder'] is None else ' run at ' + w['holder']}{extra}")
    print(f"weight version: {out['label']}; generation {'resumed' if out['resumed'] else 'left as it was'}")
    return 0


def secret_main(args) -> int:
    """``weight-transfer secret [--out PATH]``: a fresh job secret, as hex on stdout, or in a
    file only this user can read (then ``export WEIGHT_TRANSFER_SECRET_FILE=PATH`` on stdout, the
    path absolute and shell-quoted). Exit 2 with one ``error:`` line when PATH cannot be written."""
    import os
    import shlex

    from weight_transfer.security.secret import ENV_SECRET_FILE, JobSecret

    secret = JobSecret.generate()
    if args.out is None:
        print(secret.hex())
        return 0
    path = os.path.abspath(os.path.expanduser(args.out))
    try:
        if os.path.isdir(path):
            raise ValueError(f"--out {args.out!r} is a directory")
        secret.write_file(path)
        JobSecret.from_file(path)  # readable back, and by no one else (owner, mode): what every member checks
    except OSError as e:
        print(f"error: --out {args.out!r}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"export {ENV_SECRET_FILE}={shlex.quote(path)}")
    return 0


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: raised in the main thread, so the trial's cleanup runs (the
    controller marks an update in flight incomplete, every child process is stopped)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, _frame):
    raise Interrupted(signum)


def main(argv=None) -> int:
    """The ``weight-transfer`` command. Returns the exit status: 0 done (every update verified),
    1 a failure at run time, 2 bad input (one ``error:`` line, nothing started), 130 / 143
    interrupted by SIGINT / SIGTERM (one ``error:`` line naming the signal; children stopped)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    else:
        old = {}
    try:
        return _main(argv)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"error: interrupted by {signal.Signals(signum).name}: stopped every process of this command; "
              "an update in flight is marked incomplete, rows of finished updates are in the results file",
              file=sys.stderr)
        return 128 + signum
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# subcommands parsed by their module's own main(argv)
_OWN_PARSERS = {"analyze": "weight_transfer.analysis.__main__", "timeline": "weight_transfer.analysis.timeline",
                "report": "weight_transfer.experiments.readme_table"}


def _main(argv: list[str]) -> int:
    if argv and argv[0] in _OWN_PARSERS:  # handed whole to the module's own parser (its own --help)
        import importlib

        return importlib.import_module(_OWN_PARSERS[argv[0]]).main(argv[1:])
    args = build_parser(argv).parse_args(argv)
    if args.cmd == "simulate":
        from .cli import dataclass_from_args
        from .report import check_output_file
        from .sim.options import SimulateOptions

        try:
            opts = dataclass_from_args(SimulateOptions, args)  # ranges checked before any planning
            if not (opts.no_csv or opts.list):
                check_output_file(opts.csv, "--csv")
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if getattr(args, "map", False):
            from .sim.layout_map import main as map_main

            return map_main(args)
        from .sim.run import main as simulate_main

        return simulate_main(args)
    if args.cmd == "rl":
        from .cli import dataclass_from_args
        from .rl import main as rl_main
        from .rl_options import RLOptions

        try:
            opts = dataclass_from_args(RLOptions, args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return rl_main(opts)
    if args.cmd == "faults":
        from .faults import main as faults_main

        return faults_main(args)
    if args.cmd == "sweep":
        return sweep_main(args)
    if args.cmd == "secret":
        return secret_main(args)
    if args.cmd == "vllm-recover":
        return recover_main(args)
    if args.cmd.startswith("bench-"):
        import importlib

        from .cli import dataclass_from_args

        module, cls = args.bench
        try:
            bcfg = dataclass_from_args(cls, args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return importlib.import_module(module).main(bcfg)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    """``weight-transfer run``: one trial (or, with ``--method all``, the reference and the
    baselines side by side), checked before any process starts, each row appended to
    ``--results`` as its update finishes, then the table. Exit status 0 when every update
    verified, 1 when one did not or the results file failed, 2 on bad input (one ``error:``
    line); with ``--method all``, :func:`weight_transfer.experiments.compare.run_all`'s."""
    from weight_transfer.control.protocol import ControlError
    from weight_transfer.types import PlanError

    from .report import append_csv, check_output_file, format_table
    from .trial import run_trial

    try:
        cfg = config_from_args(args)  # TrialConfig.__post_init__: names, ranges, model overrides
        cfg.model_config()
        cfg.preflight(local=True)  # before any process: transport importable, trace dir, process count
        check_output_file(args.results, "--results")  # C25: refused before any process starts
        if cfg.run.method == "all":  # reference and baselines side by side (experiments/compare.py)
            from .compare import run_all

            return run_all(cfg, results_path=args.results)
        from .methods import get_method

        get_method(cfg.run.method)
        from .trial import preflight

        preflight(cfg)
        print(f"# starting: {cfg.train.n_train} training + {cfg.n_infer} inference processes ...", file=sys.stderr, flush=True)

        def on_row(r: dict) -> None:  # each row is in the CSV as soon as its update finished (C25)
            append_csv([r], args.results)
            if r.get("outcome") == "failed":  # an engine lost mid-update (C24): named; the survivors go on
                print(f"# step {r['step']}: FAILED after {r['seconds']:.3f} s: {r['error'].split(' (also: ')[0]}; "
                      f"going on without rank(s) {r['lost']}", file=sys.stderr, flush=True)
                return
            print(f"# step {r['step']}: {r['seconds']:.3f} s, verified={r['verified']}", file=sys.stderr, flush=True)

        result = run_trial(cfg, progress=on_row)
    except OSError as e:  # a results file that failed mid-run: the rows before are in it
        print(f"error: {e.strerror or e}", file=sys.stderr)
        return 1
    except (ValueError, PlanError, ControlError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        rest = str(e).splitlines()[1:]
        for line in rest[:20]:
            print(f"       {line}", file=sys.stderr)
        return 2
    print(format_table(result))
    path = Path(args.results)
    if cfg.transfer.executor.trace_dir:
        from weight_transfer.timeline import merge_step_traces

        merged = merge_step_traces(cfg.transfer.executor.trace_dir, remove_parts=True)
        if merged:
            print(f"# timelines (Chrome trace, one per update): {merged[0].parent}/step*.json; "
                  f"draw one with: weight-transfer timeline {merged[-1]} -o timeline.png")
    print(f"# rows appended to {path}")
    return 0 if all(r["verified"] in (True, None) for r in result.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
