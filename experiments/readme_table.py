"""``weight-transfer report``: the README's results table, generated from the committed CSVs.

Every number in the README's results table comes from here: each group of rows reads one
committed CSV under ``results/`` (raw ``bytes`` and ``seconds``, one row per update), takes its
latest run, and derives p50, GB/s and the ratio to the group's reference row the way the
command that wrote the CSV prints them (p50: numpy's linear-interpolated median over the
measured updates, warm-up updates left out; GB/s = bytes / p50 / 1e9). Each row names the CSV
and the command that produces it, and says how loaded the machine was while it was measured
(the ``load`` column, :func:`load_cell`: the other processes' share of the CPUs, marked
``loaded`` above the threshold of :mod:`weight_transfer.experiments.load`, or ``not recorded``).
``tests/project/test_readme.py`` checks that the README's table, between
``<!-- results-table:begin -->`` and ``<!-- results-table:end -->``, is exactly what this command
prints.

Examples::

    weight-transfer report                 # the markdown table, from the committed CSVs
    weight-transfer report --root /path/to/checkout

Groups (:data:`GROUPS`): the main job (``make demo``), the reference against the two baselines
on the same job, the reference against peers, the three methods through an unmodified vLLM,
TRL's async GRPO with pause-based syncs against shadow targets (``bench-trl``), and the
simulated at-scale reproduction of the published Kimi-K2 update.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .paths import project_dir

BEGIN, END = "<!-- results-table:begin -->", "<!-- results-table:end -->"


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """One block of rows of the table: one committed CSV, the command that writes it."""

    title: str
    """The first cell of the group's first row (markdown)."""
    csv: str
    """The CSV, relative to the project root."""
    command: str
    """The command that appends the rows read here (run from the project root)."""
    kind: str
    """How the CSV is read: ``trial`` (a trial's rows, one run per method), ``peers``
    (``bench-peers``: one run, a row per peer and transport), ``sim`` (``simulate``: one
    run, a row per method) or ``trl`` (``bench-trl``: one run, a row per training-rank count and
    shadow mode, each against the pause-based row of its rank count)."""
    config: str = ""
    """``sim`` only: the simulation config whose latest run is shown."""


GROUPS: tuple[Group, ...] = (
    Group(title="**main job** (`make demo`)", csv="results/main_job.csv", kind="trial",
          command="weight-transfer run --results results/main_job.csv"),
    Group(title="main job, against the baselines", csv="results/main_job_methods.csv", kind="trial",
          command="weight-transfer run --method all --steps 2 --warmup 1 --results results/main_job_methods.csv"),
    Group(title="against peers (the main job's BF16 TP=2 tensors, same world)", csv="results/peers.csv", kind="peers",
          command="weight-transfer bench-peers --peers reference,torchstore --torchstore-transports shm "
                  "--reference-transports shm,cma --steps 4"),
    Group(title="through an unmodified vLLM (main job's model, BF16)", csv="results/vllm/trials_1p85gb_shards.csv",
          kind="trial", command="weight-transfer run --engine vllm --quant none --tp 1 --method all --steps 3 "
                                "--warmup 1 --results results/vllm/trials_1p85gb_shards.csv"),
    Group(title="inside TRL's async GRPO (61.9 M-parameter Qwen3, bf16; rollouts during syncs)",
          csv="results/trl_bench.csv", kind="trl", command="weight-transfer bench-trl"),
    Group(title="at scale, **simulated**: Kimi-K2 1T", csv="results/simulated.csv", kind="sim",
          config="kimi_k2_256xh200efa_to_128_dpa_ep32",
          command="weight-transfer simulate kimi_k2_256xh200efa_to_128_dpa_ep32"),
)

HEADER = ("| result | method | world | bytes per update | p50 (s) | GB/s | x reference p50 | verified | load | rows | "
          "command |\n|---|---|---|---|---|---|---|---|---|---|---|")

# simulate's method names -> what they are (docs/SIMULATION.md)
SIM_METHODS = {"overlapped_writes": "reference (this executor: every prepared task's writes in flight)",
               "rank0_funnel": "rank0_funnel", "rpc_update_weight": "rpc"}


def _col(df: pd.DataFrame, name: str):
    """Column ``name`` of ``df``, or nothing (a CSV written before it existed)."""
    return df[name] if name in df else ()


def load_cell(df: pd.DataFrame, load_avg: str = "load_avg_1m") -> str:
    """The ``load`` cell of a table row whose CSV rows are ``df`` (its measured updates, or one
    job): :func:`weight_transfer.experiments.load.judge` over their ``other_cpu`` (the mean
    weighted by their ``seconds`` where the CSV has them), the load average in column ``load_avg``
    and ``cpus`` (columns a CSV may lack: ``not recorded``)."""
    from .load import cell, judge

    return cell(judge(_col(df, "other_cpu"), _col(df, load_avg), _col(df, "cpus"),
                      df["seconds"] if "seconds" in df else None))


def _p50(seconds) -> float:
    return float(np.percentile(np.asarray(seconds, dtype=float), 50))


def _bool(s: pd.Series) -> pd.Series:
    return s.astype(str).str.lower().isin(("true", "1"))


def _latest(df: pd.DataFrame, key: str = "run_id") -> pd.DataFrame:
    """The rows of the run (``key``) whose first row was written last."""
    last = df.sort_values("timestamp", kind="stable")[key].iloc[-1]
    return df[df[key] == last]


# how each method moves the bytes (the transport column of a baseline's rows is the unused reference's)
HOW = {"rank0_funnel": "gathered on training rank 0, Gloo broadcast", "rpc": "one ZeroMQ request per tensor"}


def _world(r: pd.Series) -> str:
    cols = ("engine", "transport") if r["method"] == "reference" else ("engine",)
    extra = ", ".join(str(r[c]) for c in cols if c in r and pd.notna(r[c]) and str(r[c]))
    return f"{int(r['n_train'])} -> {r['layout']} ({extra})" if extra else f"{int(r['n_train'])} -> {r['layout']}"


def _method(r: pd.Series) -> str:
    how = [HOW[r["method"]]] if r["method"] in HOW else []
    path = r.get("vllm_path")
    if isinstance(path, str) and path:
        how.append("vLLM's `one_sided` backend" if path == "one_sided" else f"vLLM's {path} path")
    return f"{r['method']} ({'; '.join(how)})" if how else str(r["method"])


def _trial_rows(df: pd.DataFrame) -> list[dict]:
    """One row per method: that method's latest run in the CSV (a ``--method all`` writes one run
    per method); p50 over its measured (non-warm-up) updates; verified = updates verified / all."""
    out = []
    for method in dict.fromkeys(df["method"]):  # in the order they were run
        run = _latest(df[df["method"] == method])
        warm = run[~_bool(run["warmup"])]
        p50 = _p50(warm["seconds"])
        nbytes = int(warm["bytes"].iloc[0])
        out.append(dict(method=_method(run.iloc[0]), world=_world(run.iloc[0]), bytes=f"{nbytes:,}", p50=p50,
                        gbps=f"{nbytes / p50 / 1e9:.3f}", verified=f"{int(_bool(run['verified']).sum())}/{len(run)}",
                        load=load_cell(warm)))
    return out


def _peer_rows(df: pd.DataFrame) -> list[dict]:
    """``bench-peers``' latest run: one row per (peer, transport); its CSV holds the measured updates only."""
    run = _latest(df)
    out = []
    for (peer, transport), g in run.groupby(["peer", "transport"], sort=False):
        p50, nbytes = _p50(g["seconds"]), int(g["bytes"].iloc[0])
        out.append(dict(method=f"{peer}: {transport}", world=f"{int(g['n_train'].iloc[0])} -> {int(g['n_infer'].iloc[0])}",
                        bytes=f"{nbytes:,}", p50=p50, gbps=f"{nbytes / p50 / 1e9:.3f}",
                        verified=f"{int(_bool(g['verified']).sum())}/{len(g)}", load=load_cell(g)))
    return out


def _sim_rows(df: pd.DataFrame, config: str) -> tuple[list[dict], str]:
    """``simulate``'s latest run of ``config``: the reference with this executor's write stage
    (``overlapped_writes``) and the two baselines; the published time and the floor as a note."""
    run = _latest(df[df["config"] == config])
    by = {m: r for m, r in run.set_index("method").iterrows()}
    out = []
    for method, label in SIM_METHODS.items():
        r = by[method]
        out.append(dict(method=label, world=f"{int(r['n_train'])} -> {int(r['n_infer'])} {r['layout']}",
                        bytes=f"{int(r['bytes']):,} (all receivers)", p50=float(r["seconds"]),
                        gbps=f"{int(r['bytes']) / float(r['seconds']) / 1e9:,.0f}", verified="simulated", load="-"))
    ref = by["overlapped_writes"]
    note = (f"published {float(ref['published_seconds']):.2f} s, floor {float(ref['floor_seconds']):.3f} s "
            f"({ref['hardware']})")
    return out, note


TRL_MODES = {"off": "`shadow=off`: /pause per sync", "auto": "`shadow=auto`: no pause, go-live between steps",
             "copy": "`shadow=copy`: no pause", "flip": "`shadow=flip`: no pause"}


def _trl_rows(df: pd.DataFrame) -> list[dict]:
    """``bench-trl``'s latest run: one row per (ranks, mode) that completed; p50 = the sync's
    window (rank 0's ``_sync_weight``), the rollout tokens/s during syncs against between in the
    method cell, the ratio against the pause-based row of the same rank count; the load over the
    job (the load average before it: ``load_avg_1m``, else the older ``load1_start``)."""
    run = _latest(df)
    run = run[run["error"].isna()] if "error" in run else run
    out = []
    for _, r in run.iterrows():
        off = run[(run["ranks"] == r["ranks"]) & (run["mode"] == "off")]
        nbytes, p50 = int(r["update_bytes"]), float(r["sync_s_p50"])
        fsdp = ", FSDP2" if int(r["ranks"]) > 1 else ""
        out.append(dict(method=f"{TRL_MODES.get(r['mode'], r['mode'])}; rollouts during syncs "
                               f"{float(r['tok_s_during']):.0f} tok/s = {float(r['during_over_between']):.2f} x between, "
                               f"engine busy {float(r['busy_during']):.2f} vs {float(r['busy_between']):.2f}",
                        world=f"{int(r['ranks'])} -> TP1 (vllm, TRL 1.16{fsdp})", bytes=f"{nbytes:,}", p50=p50,
                        gbps=f"{nbytes / p50 / 1e9:.3f}", verified=f"{int(_bool(pd.Series([r['verified']])).sum())}/1",
                        ref=float(off["sync_s_p50"].iloc[0]) if len(off) else p50,
                        load=load_cell(_trl_load(run, r))))
    return out


def _trl_load(run: pd.DataFrame, r: pd.Series) -> pd.DataFrame:
    """Row ``r`` of a ``bench-trl`` run as a frame for :func:`load_cell`, its load average from
    ``load1_start`` where ``load_avg_1m`` is missing (rows from before it)."""
    one = run.loc[[r.name]].copy()
    if "load1_start" in one:
        one["load_avg_1m"] = one["load_avg_1m"].fillna(one["load1_start"]) if "load_avg_1m" in one else one["load1_start"]
    return one


def group_rows(group: Group, root: Path) -> list[str]:
    """The markdown rows of one group, the reference first, ratios against it."""
    df = pd.read_csv(root / group.csv)
    title = group.title
    if group.kind == "trial":
        rows = _trial_rows(df)
    elif group.kind == "peers":
        rows = _peer_rows(df)
    elif group.kind == "trl":
        rows = _trl_rows(df)
    else:
        rows, note = _sim_rows(df, group.config)
        title = f"{title}; {note}"
    lines = []
    for i, r in enumerate(rows):
        first = i == 0
        ref = r.get("ref", rows[0]["p50"])
        lines.append(f"| {title if first else ''} | {r['method']} | {r['world']} | {r['bytes']} | {r['p50']:.3f} | "
                     f"{r['gbps']} | {r['p50'] / ref:.2f} | {r['verified']} | {r['load']} | "
                     f"{'`' + group.csv + '`' if first else ''} | "
                     f"{'`' + group.command + '`' if first else ''} |")
    return lines


def table(root: Path | None = None) -> str:
    """The README's results table (markdown), from the CSVs under ``root`` (default: this checkout)."""
    root = Path(root) if root is not None else project_dir()
    lines = [HEADER]
    for g in GROUPS:
        lines += group_rows(g, root)
    return "\n".join(lines)


def readme_table(readme: str) -> str:
    """The table between the README's markers (without them), stripped."""
    try:
        return readme.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    except IndexError:
        raise ValueError(f"README has no {BEGIN} ... {END} block") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="weight-transfer report",
                                 description="Print the README's results table (markdown), generated from the "
                                             "committed CSVs under results/; each row names its CSV and command.")
    ap.add_argument("--root", default=None, help="project root holding results/ (default: this checkout)")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        print(table(a.root))
    except (OSError, KeyError, IndexError, ValueError) as e:
        print(f"error: weight-transfer report: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
