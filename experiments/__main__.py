"""The one command: ``weight-transfer {run,simulate,sweep,faults,bench-quant,bench-pipeline,bench-transports,bench-peers,analyze,timeline}``
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

Bad input (unknown model, world sizes that cannot shard, missing or extra tensors) exits with
status 2 and a one-line ``error:`` message before any byte is written; a bad option value
(an override of the wrong kind or without ``=``, an unknown or uninstalled transport, an
unwritable ``--trace``, a timeout <= 0, more rank processes than this machine's cap) before
any process starts (C18).
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from .paths import project_dir

DEFAULT_RESULTS = project_dir() / "results" / "runs" / "trials.csv"


class _Parser(argparse.ArgumentParser):
    """argparse, except that a bad command line is refused with one ``error:`` line (and a
    pointer to ``--help``) instead of the usage block: exit status 2 (C18)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _override(s: str) -> tuple[str, object]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"wants KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    try:
        val = ast.literal_eval(v)
    except (ValueError, SyntaxError):
        val = v
    return k, val


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The one CLI: ``run``, ``simulate``, ``sweep`` and the benchmarks (``bench-*``, their
    options generated from their config dataclasses by :mod:`weight_transfer.experiments.cli`). A benchmark's
    module (torch, pandas) is imported only when ``argv`` (default ``sys.argv[1:]``) selects it."""
    from weight_transfer.baselines.options import BaselineOptions

    from .bench import BENCHMARKS
    from .cli import add_dataclass_options

    ap = _Parser(prog="weight-transfer", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run one trial: controller + training world + inference world, verified")
    # Every option defaults to None = "as in the base config": the main job's embedded default
    # (weight_transfer.experiments.config.main_job_default) without --model, TrialConfig's defaults with it.
    run.add_argument("--model", default=None,
                     help="catalog model (reference/testing/configs/*.json); default: the main job's (see README)")
    run.add_argument("--override", action="append", type=_override, default=[], metavar="KEY=VALUE",
                     help="HF-config override for a smaller variant (repeatable)")
    run.add_argument("--method", default=None, help="reference | rank0_funnel | rpc | all (the three side by side, one table)")
    run.add_argument("--engine", choices=["stand-in", "vllm"], default=None,
                     help="inference side: the stand-in (default) or unmodified vLLM engines (make vllm)")
    run.add_argument("--vllm-targets", choices=["auto", "staged", "direct"], default=None,
                     help="--engine vllm, reference method: auto (default: direct where vLLM's runtime bytes are "
                          "addressable, staged where it keeps them opaque, e.g. oneDNN handles on CPUs without AMX), "
                          "staged (every post-processed layer staged), direct (opaque layers refused)")
    run.add_argument("--n-train", type=int, default=None, help="training ranks")
    run.add_argument("--train-layout", choices=["fsdp", "two_group", "shard_shard"], default=None,
                     help="fsdp: FSDP2 on a 1-D mesh; two_group: non-experts within node, experts across "
                          "nodes on --train-mesh; shard_shard: [Shard(0), Shard(0)] on --train-mesh")
    run.add_argument("--train-mesh", default=None, help="2-D training mesh for two_group / shard_shard, e.g. 2x2 (nodes x GPUs per node); "
                          "two_group also takes NODESxGPUSxW: experts FSDP-sharded over W nodes (MoE mesh width)")
    run.add_argument("--tp", type=int, default=None, help="inference tensor-parallel size")
    run.add_argument("--dp", type=int, default=None, help="inference replicas (engine instances)")
    run.add_argument("--ep", action="store_true", default=None, help="expert parallel over each instance's TP ranks")
    run.add_argument("--dp-attention", action="store_true", default=None,
                     help="data-parallel attention + EP (with --ep): non-expert tensors whole on every inference rank, "
                          "experts split over each instance's --tp ranks")
    run.add_argument("--quant", choices=["fp8", "none"], default=None,
                     help="fp8: serve block-FP8 e4m3 + weight_scale_inv; none: serve BF16")
    run.add_argument("--train-dtype", choices=["bfloat16", "float32"], default=None)
    run.add_argument("--transport", default=None, help="cma | nixl | verbs | cuda_ipc (docs/TRANSPORTS.md)")
    run.add_argument("--device", choices=["cpu", "cuda"], default=None,
                     help="where training shards and inference arenas live (default cpu); cuda: every process on "
                          "a GPU (one GPU shared by all on a one-GPU host), needs --transport cuda_ipc (one host), "
                          "nixl or verbs and a CUDA build of torch (docs/GPU.md)")
    run.add_argument("--steps", type=int, default=None, help="measured updates")
    run.add_argument("--warmup", type=int, default=None, help="updates before the measured ones")
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--max-chunk-mb", type=float, default=None, help="split recipe outputs above this (MB)")
    run.add_argument("--timeout", type=float, default=None, help="control-plane wait limit (s)")
    run.add_argument("--no-verify", action="store_true", help="skip verification (not for results you report)")
    run.add_argument("--gather-all", action="store_true",
                     help="full_tensor() every source (the published design; default: shard-local prepare: copies, "
                          "fused bands and 128-row-aligned FP8 blocks are made from the ranks' own shards)")
    run.add_argument("--serial", action="store_true",
                     help="stage-serialized executor (every stage of a task before the next); default pipelined")
    run.add_argument("--watermark-mb", type=float, default=None,
                     help="bound temporary memory in flight per training rank (MiB); default unbounded")
    run.add_argument("--offload", action="store_true",
                     help="training shards live in host memory; the executor's h2d stage copies them in")
    run.add_argument("--trace", default=None, metavar="DIR",
                     help="save each update's timeline as a Chrome trace DIR/step{N}.json (Perfetto)")
    run.add_argument("--results", default=str(DEFAULT_RESULTS), help="CSV to append tidy rows to")
    add_dataclass_options(run.add_argument_group("baselines (--method rank0_funnel | rpc | all)"), BaselineOptions,
                          dest_prefix="baseline.")
    sim = sub.add_parser("simulate", help="at-scale prediction: real planner on synthesized metadata + cost model "
                                          "(docs/SIMULATION.md)")
    sim.add_argument("config", nargs="?", help="named simulation config (see --list)")
    sim.add_argument("--list", action="store_true", help="list the simulation configs")
    sim.add_argument("--no-csv", action="store_true", help="do not append rows to the CSV")
    sim.add_argument("--gather-all", action="store_true",
                     help="plan with full_tensor() of every source (the published executor) instead of shard-local prepare")
    sim.add_argument("--csv", default=str(DEFAULT_RESULTS.parent.parent / "simulated.csv"), help="CSV to append rows to")
    sim.add_argument("--bench-planner", action="store_true",
                     help="time plan() and its peak RSS, each run in a fresh subprocess")
    sim.add_argument("--moe-width", type=int, default=None,
                     help="override the config's MoE mesh width (two_group: nodes per expert sub-mesh); the row's "
                          "config name gets a _w<W> suffix")
    sim.add_argument("--layers", type=int, default=None,
                     help="truncate the model to this many decoder layers (a quicker look; the row's config name gets "
                          "an _L<N> suffix)")
    sim.add_argument("--map", action="store_true",
                     help="Kimi-K2 map: predicted time against MoE mesh width x inference layout "
                          "(results/sim_kimi_map.csv; extrapolated from truncated models, see experiments/sim/layout_map.py)")
    sim.add_argument("--sensitivity", action="store_true",
                     help="also re-run the cost model with every assumed parameter halved and doubled (same schedule)")
    sim.add_argument("--repeat", type=int, default=3, help="--bench-planner runs (min / median / max reported)")
    sim.add_argument("--received", action="store_true",
                     help="--bench-planner on metadata pickled per rank, as the controller receives it")
    sim.add_argument("--checks", choices=("auto", "forked", "in-process"), default="auto",
                     help="--bench-planner: plan(parallel_checks=None / True / False); auto forks the checks "
                          "at Kimi-K2 scale")
    sw = sub.add_parser("sweep", help="run a named sweep with submitit: one job per trial, its tasks the ranks "
                                      "(docs/SWEEPS.md)")
    sw.add_argument("name", nargs="?", help="sweep or named config (see --list)")
    sw.add_argument("--list", action="store_true", help="list the sweeps and named configs")
    sw.add_argument("--cluster", choices=["local", "slurm", "debug"], default="local",
                    help="local: processes on this machine; slurm: sbatch; debug: in-process, one task")
    sw.add_argument("--nodes", type=int, default=1, help="nodes per trial job")
    sw.add_argument("--tasks-per-node", type=int, default=None,
                    help="default: the trial's 1 + n_train + n_infer tasks over --nodes")
    sw.add_argument("--gpus-per-node", type=int, default=0)
    sw.add_argument("--cpus-per-task", type=int, default=None)
    sw.add_argument("--partition", default=None, help="SLURM partition")
    sw.add_argument("--time", type=int, default=30, help="time limit per trial job (minutes)")
    sw.add_argument("--parallel", type=int, default=1, help="trial jobs in flight at once")
    sw.add_argument("--single-task", action="store_true", help="one task per trial that spawns its ranks locally")
    sw.add_argument("--slurm-extra", action="append", default=[], metavar="KEY=VALUE",
                    help="extra sbatch option, e.g. account=rl (repeatable)")
    sw.add_argument("--folder", default=str(DEFAULT_RESULTS.parent / "jobs"), help="submitit job folder (logs)")
    sw.add_argument("--results-dir", default=str(DEFAULT_RESULTS.parent.parent), help="rows -> DIR/<sweep>.csv")
    sw.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    from .faults import add_arguments as fault_arguments

    fault_arguments(sub.add_parser("faults", help="fault matrix: {kill, raise, stop} x {training, inference, "
                                                  "controller} x {early, middle, late} (docs/FAULTS.md)"))
    # analysis's own command lines, behind the one command (analysis imports no transfer code)
    for name, help_ in (("analyze", "results CSVs -> results/summary.md and PNG plots (weight_transfer.analysis)"),
                        ("timeline", "draw one update's pipeline from a --trace Chrome trace (weight_transfer.analysis.timeline)")):
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
    (:func:`weight_transfer.experiments.config.main_job_default`) when ``--model`` is not given (``--override``
    then adds to its overrides), else ``TrialConfig(model=...)``; every given option replaces
    the base's value."""
    import dataclasses

    from .config import TrialConfig, main_job_default

    base = main_job_default() if args.model is None else TrialConfig(model=args.model)
    ch: dict = {}
    if args.override:
        ch["overrides"] = {**(base.overrides if args.model is None else {}), **dict(args.override)}
    for field in ("method", "engine", "vllm_targets", "n_train", "train_layout", "tp", "dp", "ep", "dp_attention", "train_dtype",
                  "transport", "device", "steps",
                  "warmup", "seed", "timeout"):
        if getattr(args, field) is not None:
            ch[field] = getattr(args, field)
    if args.train_mesh is not None:
        ch["train_mesh"] = tuple(int(x) for x in args.train_mesh.lower().split("x")) if args.train_mesh else ()
    if args.quant is not None:
        ch["quant"] = None if args.quant == "none" else args.quant
    if args.max_chunk_mb is not None:
        ch["max_chunk_bytes"] = int(args.max_chunk_mb * (1 << 20))
    if args.no_verify:
        ch["verify"] = False
    if args.gather_all:
        ch["local_writes"] = False
    if args.serial:
        ch["pipeline"] = False
    if args.watermark_mb is not None:
        ch["watermark"] = int(args.watermark_mb * (1 << 20))
    if args.offload:
        ch["offload"] = True
    if args.trace:
        ch["trace_dir"] = args.trace
    from weight_transfer.baselines.options import BaselineOptions

    from .cli import dataclass_from_args

    if any(getattr(args, "baseline." + f.name, None) is not None for f in dataclasses.fields(BaselineOptions)):
        ch["baseline"] = dataclass_from_args(BaselineOptions, args, dest_prefix="baseline.")
    return dataclasses.replace(base, **ch) if ch else base


def sweep_main(args) -> int:
    """``weight-transfer sweep``: list, or run a named sweep / config with submitit."""

    from .configs import get_sweep, list_text
    from .sweep import LaunchOptions, executor_parameters, format_summary, run_sweep

    if args.list or not args.name:
        print(list_text())
        return 0
    try:
        sweep = get_sweep(args.name)
        extra = dict(kv.split("=", 1) for kv in args.slurm_extra)
        opt = LaunchOptions(cluster=args.cluster, folder=Path(args.folder), nodes=args.nodes,
                            tasks_per_node=args.tasks_per_node, gpus_per_node=args.gpus_per_node,
                            cpus_per_task=args.cpus_per_task, partition=args.partition, time_min=args.time,
                            parallel=args.parallel, single_task=args.single_task, slurm_extra=extra)
        for cfg in sweep.trials:
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("analyze", "timeline"):  # handed whole to analysis's parsers (their own --help)
        if argv[0] == "analyze":
            from weight_transfer.analysis.__main__ import main as analyze_main

            return analyze_main(argv[1:])
        from weight_transfer.analysis.timeline import main as timeline_main

        return timeline_main(argv[1:])
    args = build_parser(argv).parse_args(argv)
    if args.cmd == "simulate":
        if getattr(args, "map", False):
            from .sim.layout_map import main as map_main

            return map_main(args)
        from .sim.run import main as simulate_main

        return simulate_main(args)
    if args.cmd == "faults":
        from .faults import main as faults_main

        return faults_main(args)
    if args.cmd == "sweep":
        return sweep_main(args)
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
    from weight_transfer.control import ControlError
    from weight_transfer.types import PlanError

    from .report import append_csv, format_table
    from .trial import run_trial

    try:
        cfg = config_from_args(args)  # TrialConfig.__post_init__: names, ranges, model overrides
        cfg.model_config()
        cfg.preflight(local=True)  # before any process: transport importable, trace dir, process count
        if cfg.method == "all":  # reference and baselines side by side (experiments/compare.py)
            from .compare import run_all

            return run_all(cfg, results_path=args.results)
        from .methods import get_method

        get_method(cfg.method)
        from .trial import preflight

        preflight(cfg)
        print(f"# starting: {cfg.n_train} training + {cfg.n_infer} inference processes ...", file=sys.stderr, flush=True)
        result = run_trial(cfg, progress=lambda r: print(
            f"# step {r['step']}: {r['seconds']:.3f} s, verified={r['verified']}", file=sys.stderr, flush=True))
    except (ValueError, PlanError, ControlError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        rest = str(e).splitlines()[1:]
        for line in rest[:20]:
            print(f"       {line}", file=sys.stderr)
        return 2
    print(format_table(result))
    path = append_csv(result.rows, args.results)
    if args.trace:
        from weight_transfer.timeline import merge_step_traces

        merged = merge_step_traces(args.trace, remove_parts=True)
        if merged:
            print(f"# timelines (Chrome trace, one per update): {merged[0].parent}/step*.json; "
                  f"draw one with: weight-transfer timeline {merged[-1]} -o timeline.png")
    print(f"# rows appended to {path}")
    return 0 if all(r["verified"] in (True, None) for r in result.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
