"""Command line: ``python -m experiments run [options]``.

Examples::

    python -m experiments run                                  # the README's main job
    python -m experiments run --model qwen3-30b-a3b --override num_hidden_layers=2 \\
        --override num_experts=16 --tp 2 --ep --quant fp8 --steps 3
    python -m experiments run --n-train 4 --tp 2 --dp 2 --train-dtype float32

Bad input (unknown model, world sizes that cannot shard, missing or extra tensors) exits with
status 2 and a one-line ``error:`` message before any byte is written.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

DEFAULT_RESULTS = Path(__file__).resolve().parent.parent / "results" / "runs" / "trials.csv"


def _override(s: str) -> tuple[str, object]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"--override wants KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    try:
        val = ast.literal_eval(v)
    except (ValueError, SyntaxError):
        val = v
    return k, val


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run one trial: controller + training world + inference world, verified")
    run.add_argument("--model", default="qwen3-0.6b", help="catalog model (reference/configs/*.json)")
    run.add_argument("--override", action="append", type=_override, default=[], metavar="KEY=VALUE",
                     help="HF-config override for a smaller variant (repeatable)")
    run.add_argument("--method", default="reference", help="reference | rank0_funnel | rpc")
    run.add_argument("--n-train", type=int, default=2, help="training ranks")
    run.add_argument("--train-layout", choices=["fsdp", "two_group", "shard_shard"], default="fsdp",
                     help="fsdp: FSDP2 on a 1-D mesh; two_group: non-experts within node, experts across "
                          "nodes on --train-mesh; shard_shard: [Shard(0), Shard(0)] on --train-mesh")
    run.add_argument("--train-mesh", default="", help="2-D training mesh for two_group / shard_shard, e.g. 2x2")
    run.add_argument("--tp", type=int, default=2, help="inference tensor-parallel size")
    run.add_argument("--dp", type=int, default=1, help="inference replicas (engine instances)")
    run.add_argument("--ep", action="store_true", help="expert parallel over each instance's TP ranks")
    run.add_argument("--quant", choices=["fp8"], default=None, help="serve block-FP8 e4m3 on the inference side")
    run.add_argument("--train-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    run.add_argument("--transport", default="cma")
    run.add_argument("--steps", type=int, default=5, help="measured updates")
    run.add_argument("--warmup", type=int, default=1, help="updates before the measured ones")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--max-chunk-mb", type=float, default=64.0, help="split recipe outputs above this (MB)")
    run.add_argument("--timeout", type=float, default=120.0, help="control-plane wait limit (s)")
    run.add_argument("--no-verify", action="store_true", help="skip verification (not for results you report)")
    run.add_argument("--results", default=str(DEFAULT_RESULTS), help="CSV to append tidy rows to")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from reference.control import ControlError
    from reference.mapping import PlanError

    from .config import TrialConfig
    from .report import append_csv, format_table
    from .trial import run_trial

    try:
        mesh = tuple(int(x) for x in args.train_mesh.lower().split("x")) if args.train_mesh else ()
        cfg = TrialConfig(model=args.model, overrides=dict(args.override), n_train=args.n_train, tp=args.tp,
                          method=args.method, train_layout=args.train_layout, train_mesh=mesh,
                          dp=args.dp, ep=args.ep, quant=args.quant, train_dtype=args.train_dtype,
                          transport=args.transport, steps=args.steps, warmup=args.warmup, seed=args.seed,
                          max_chunk_bytes=int(args.max_chunk_mb * (1 << 20)), timeout=args.timeout,
                          verify=not args.no_verify)
        cfg.model_config()
        from .methods import get_method

        get_method(cfg.method)
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
    print(f"# rows appended to {path}")
    return 0 if all(r["verified"] in (True, None) for r in result.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
