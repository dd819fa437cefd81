"""Delta mode of the at-scale simulation (experiments/sim/delta.py, ``simulate --delta-...``): the
expected runs against exhaustive enumeration, the fractions read from a CSV, and the cost
model's properties on the tiny config's real schedule (nothing changed -> only the fixed costs,
everything changed -> not below full, monotone in the fraction), bad inputs refused."""
import itertools
import math

import pytest

from tests.helpers import ROOT
from weight_transfer.experiments.sim import model
from weight_transfer.experiments.sim.configs import get_config
from weight_transfer.experiments.sim.delta import (
    MEASURED,
    RDMA_HEADER_BYTES,
    DeltaModel,
    Fractions,
    expected_runs_and_units,
    load_fractions,
    uniform_fractions,
)
from weight_transfer.experiments.sim.run import build
from weight_transfer.plan import plan


def _enumerate(n, p, g):
    """(E[runs], E[units written]) by enumerating all 2^n change patterns, runs per the
    executor's rule: consecutive changed units at most ``g`` unchanged units apart are one run,
    which writes every unit from its first to its last changed unit."""
    er = eu = 0.0
    for pat in itertools.product((0, 1), repeat=n):
        k = sum(pat)
        w = p ** k * (1 - p) ** (n - k)
        idx = [i for i, c in enumerate(pat) if c]
        runs, units = 0, 0
        if idx:
            start = prev = idx[0]
            for i in idx[1:]:
                if i - prev - 1 > g:
                    runs, units = runs + 1, units + prev - start + 1
                    start = i
                prev = i
            runs, units = runs + 1, units + prev - start + 1
        er += w * runs
        eu += w * units
    return er, eu


@pytest.mark.parametrize("n,g", [(1, 0), (2, 0), (7, 0), (10, 1), (11, 3), (12, 12), (9, 20)])
@pytest.mark.parametrize("p", [0.0, 0.05, 0.5, 0.9, 1.0])
def test_expected_runs_and_units_equal_enumeration(n, p, g):
    runs, units = expected_runs_and_units(n, p, g)
    er, eu = _enumerate(n, p, g)
    assert math.isclose(runs, er, rel_tol=1e-9, abs_tol=1e-12) and math.isclose(units, eu, rel_tol=1e-9, abs_tol=1e-12)


def test_fractions_from_csv_medians_lr_and_stand_ins(tmp_path):
    p = tmp_path / "changes.csv"
    lines = ["lr,step,kind,granularity,changed,total,fraction,delta_bytes,full_bytes"]
    for lr, fr in ((1e-6, (0.1, 0.3, 0.2)), (1e-5, (0.6, 0.5, 0.7))):
        for step, f in enumerate(fr, 1):
            for kind in ("all", "mlp", "attention"):
                for g in MEASURED:
                    lines.append(f"{lr},{step},{kind},{g},0,1,{f / (2 if kind == 'mlp' else 1)},0,0")
    p.write_text("\n".join(lines) + "\n")
    a = load_fractions(p, 1e-6)
    assert a.get("attention", "fp8_rows") == pytest.approx(0.2) and a.get("mlp", "fp8_rows") == pytest.approx(0.1)
    assert a.get("experts", "fp8_elems") == pytest.approx(0.1)      # the dense MLP stands in for the experts
    assert a.get("router", "bf16_elems") == pytest.approx(0.2)      # and the whole model for the router
    assert a.used_fallbacks == {("experts", "mlp"), ("router", "all")}
    assert load_fractions(p, 1e-5).get("norms", "scales") == pytest.approx(0.6)
    with pytest.raises(ValueError, match="learning rates there: 1e-06, 1e-05"):
        load_fractions(p, 3e-4)
    u = uniform_fractions(0.01)
    assert u.get("experts", "bf16_rows") == pytest.approx(1 - 0.99 ** 64)
    assert u.get("mlp", "fp8_elems") == pytest.approx(0.001, rel=0.01)
    one = uniform_fractions(1.0)
    assert all(one.get("attention", g) == 1.0 for g in MEASURED)


@pytest.fixture(scope="module")
def tiny():
    cfg = get_config("tiny_qwen3_moe_2x2")
    _, tm, dm, rs = build(cfg)
    sched = plan(rs, tm, dm, max_chunk_bytes=cfg.max_chunk_bytes)
    first = model.first_metas(tm)
    return cfg, sched, first


def _run(tiny, fractions, *, granularity="rows", gap=4096, wif="watermark", hw=None):
    cfg, sched, first = tiny
    hw = hw or cfg.hardware
    dm = None if fractions is None else DeltaModel(fractions, hw, granularity=granularity, merge_gap=gap)
    return model.simulate(sched, first, hw, watermark=cfg.watermark, writes_in_flight=wif, delta=dm)


def _all(v):
    return Fractions("all", {"all": dict.fromkeys(MEASURED, v)})


@pytest.mark.parametrize("wif", ["task", "watermark"])
def test_nothing_changed_costs_only_the_fixed_costs(tiny, wif):
    full = _run(tiny, None, wif=wif)
    for g in ("elems", "rows", "blocks"):
        d = _run(tiny, _all(0.0), granularity=g, wif=wif)
        assert d.bytes == 0 and d.n_writes == 0 and d.extra["ops"] == 0 and d.stage_busy["write"] == 0
        # the prepare stage still runs in full, plus the compare of every output byte with its shadow
        assert d.stage_busy["prepare"] > full.stage_busy["prepare"]
        assert d.seconds >= d.stage_busy["prepare"] and d.seconds < 0.5 * full.seconds
        # no write byte on any link: what the busiest NIC carries is the all-gathers alone
        assert not any(d.rank_bytes["infer_recv"].values())
        assert d.link_bytes["nic"] == max(d.rank_bytes["train_fabric"].values(), default=0)
    # the shadow: one byte per distinct output byte a rank writes (an output sent to both DP replicas once)
    distinct = {r: sum(sum({w.output: w.length for w in a.writes}.values()) for t in rp.tasks for a in t.assignments)
                for r, rp in tiny[1].rank_plans.items()}
    assert d.extra["shadow_bytes_max"] == max(distinct.values()) < max(tiny[1].send_bytes.values())


@pytest.mark.parametrize("wif", ["task", "watermark"])
@pytest.mark.parametrize("g", ["elems", "rows", "blocks"])
def test_everything_changed_is_not_below_full(tiny, wif, g):
    full = _run(tiny, None, wif=wif)
    d = _run(tiny, _all(1.0), granularity=g, wif=wif)
    sched = tiny[1]
    assert d.n_writes == sched.n_writes                      # one run per write: each output whole
    assert d.bytes == pytest.approx(sched.total_bytes + RDMA_HEADER_BYTES * sched.n_writes)
    assert d.seconds >= full.seconds and d.floor_seconds >= full.floor_seconds


def test_monotone_in_the_fraction(tiny):
    fs = [0.0, 1e-6, 1e-5, 1e-4, 1e-3, 3e-3]
    for g in ("elems", "rows"):
        rs = [_run(tiny, uniform_fractions(f), granularity=g, gap=0) for f in fs]
        for a, b in zip(rs, rs[1:]):
            assert b.bytes >= a.bytes and b.extra["ops"] >= a.extra["ops"] and b.seconds >= a.seconds - 1e-12
        assert rs[-1].seconds > rs[0].seconds
    # bytes grow with the fraction at any merge gap; ops do not: merged runs end at one per write
    gs = [_run(tiny, uniform_fractions(f), gap=4096) for f in (1e-4, 1e-3, 1e-2, 0.1, 1.0)]
    assert all(b.bytes >= a.bytes for a, b in zip(gs, gs[1:]))
    assert gs[-1].n_writes == tiny[1].n_writes < max(r.extra["ops"] for r in gs)


def _refused(capsys, argv):
    from weight_transfer.experiments.command import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_delta_inputs_refused(tmp_path, capsys):
    base = ["simulate", "tiny_qwen3_moe_2x2", "--csv", str(tmp_path / "s.csv")]
    csv = str(ROOT / "results" / "rl_changes.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("lr,step,kind\n1e-6,1,all\n")
    assert "[0, 1]" in _refused(capsys, base + ["--delta-fraction", "1.5"])
    assert "[0, 1]" in _refused(capsys, base + ["--delta-fraction", "nan"])
    assert "[0, 1]" in _refused(capsys, base + ["--delta-fraction", "-0.1"])
    assert "no such file" in _refused(capsys, base + ["--delta-fractions", str(tmp_path / "none.csv"), "--delta-lr", "1e-6"])
    assert "no column" in _refused(capsys, base + ["--delta-fractions", str(bad), "--delta-lr", "1e-6"])
    assert "learning rates there" in _refused(capsys, base + ["--delta-fractions", csv, "--delta-lr", "3e-3"])
    assert "needs --delta-lr" in _refused(capsys, base + ["--delta-fractions", csv])
    assert "needs --delta-fractions" in _refused(capsys, base + ["--delta-lr", "1e-6"])
    assert "--delta-granularity" in _refused(capsys, base + ["--delta-fraction", "0.01", "--delta-granularity", "bits"])
    assert "--delta-merge-gap" in _refused(capsys, base + ["--delta-fraction", "0.01", "--delta-merge-gap", "-1"])
    assert "--delta-post-us" in _refused(capsys, base + ["--delta-fraction", "0.01", "--delta-post-us", "0"])
    assert "not supported" in _refused(capsys, ["simulate", "--map", "--delta-fraction", "0.01"])
    assert "no reference schedule" in _refused(capsys, ["simulate", "kimi_k2_256xh20_ckpt_engine", "--csv",
                                                        str(tmp_path / "s.csv"), "--delta-fraction", "0.01"])
    assert not (tmp_path / "s.csv").exists() or (tmp_path / "s.csv").stat().st_size == 0  # no row written


def test_cli_delta_tiny(tmp_path, capsys):
    import pandas as pd

    from weight_transfer.experiments.command import main

    csv = tmp_path / "sim.csv"
    assert main(["simulate", "tiny_qwen3_moe_2x2", "--csv", str(csv), "--delta-fractions",
                 str(ROOT / "results" / "rl_changes.csv"), "--delta-lr", "1e-6", "--delta-fraction", "0,1",
                 "--delta-granularity", "elems,rows", "--delta-post-us", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "# delta mode (SIMULATED" in out and "# assumption: one RDMA WRITE per run" in out
    assert "stand-ins: experts <- mlp" in out
    d = pd.read_csv(tmp_path / "sim_tiny_qwen3_moe_2x2_delta.csv")
    assert len(d) == 3 * 2 * 2 and set(d.rdma_msg_us) == {1.0, 0.1} and set(d.granularity) == {"elems", "rows"}
    full = pd.read_csv(csv).query("method == 'overlapped_writes'")
    assert (d.full_seconds == full.seconds.item()).all() and (d.full_floor_seconds == full.floor_seconds.item()).all()
    zero = d[d.fractions.str.startswith("uniform 0.0")]
    assert (zero.wire_bytes == 0).all() and (zero.seconds < zero.full_seconds).all()
    every = d[d.fractions.str.startswith("uniform 100")]
    assert len(every) == 4 and (every.seconds >= every.full_seconds).all()


def test_packed_index_per_run_is_format_2_varints():
    """The packed record's index the model charges per run (two LEB128 varints: mean gap, mean
    length) against the real format-2 index of uniformly scattered 1-byte changes."""
    import torch

    from weight_transfer.delta.runs import changed_runs_native, index_size
    from weight_transfer.experiments.sim.delta import expected_runs_and_units, index_per_run

    assert index_per_run(1000, 0, 0) == 0.0
    assert index_per_run(1000, 10, 10) == 2.0  # gap 99 units, length 1: one byte each
    assert index_per_run(10**6, 10, 10) == 4.0  # gap ~1e5 units: a 3-byte varint
    g = torch.Generator().manual_seed(3)
    for p in (0.001, 0.012, 0.1):
        n = 1 << 20
        old = torch.zeros(n, dtype=torch.uint8)
        new = (torch.rand(n, generator=g) < p).to(torch.uint8)
        runs = changed_runs_native(new, old, 1, update=False)
        real = index_size(runs, n, 1)[1] / len(runs)
        r, u = expected_runs_and_units(n, p, 0)
        assert abs(index_per_run(n, r, u) - real) < 0.35, (p, real, index_per_run(n, r, u))
