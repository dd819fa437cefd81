"""The simulation's delta rows with measured costs (issue 40 item 4): the cost measurement
(compare, pack, apply against memcpy; the applied record reproduces the new bytes), the CSV
round trip and its refusals, the packed mode's model (one record per output and receiver, the
receiver's apply added), and ``simulate --delta-costs`` on the tiny config writing the rows."""
from __future__ import annotations

import pytest

from tests.helpers import ROOT
from weight_transfer.experiments.sim import model
from weight_transfer.experiments.sim.configs import get_config
from weight_transfer.experiments.sim.delta import MEASURED, DeltaModel, Fractions, masks_record
from weight_transfer.experiments.sim.delta_costs import DeltaCosts, load_costs, measure, write_costs
from weight_transfer.experiments.sim.run import build
from weight_transfer.plan import plan


def test_measure_small_and_round_trip(tmp_path):
    from weight_transfer.delta.runs import KERNEL

    if KERNEL.lib() is None:
        pytest.skip("the native delta kernel is not built here (no C compiler)")
    r = measure(1 << 20, 0.01, repeats=1)
    lo = 64 + 2 * r["runs"] + r["changed_bytes"]  # format 2: 1-9 bytes per varint, two per run
    assert r["runs"] > 0 and lo <= r["record_bytes"] < lo + 16 * r["runs"] + 64
    assert min(r["compare_passes"], r["pack_passes"], r["apply_passes"]) > 0
    p = write_costs([r, {**r, "fraction": 0.09, "compare_passes": 7.0}], tmp_path / "c.csv")
    c = load_costs(p, 0.08)
    assert c.compare == 7.0 and "9.00%" in c.source
    assert load_costs(p).compare == pytest.approx(r["compare_passes"])
    with pytest.raises(ValueError, match="no such file"):
        load_costs(tmp_path / "none.csv")
    (tmp_path / "bad.csv").write_text("fraction,compare_passes\n0.01,1\n")
    with pytest.raises(ValueError, match="needs rows with columns"):
        load_costs(tmp_path / "bad.csv")
    assert load_costs(p, 0.01, fmt="masks") is None  # no format-3 row


def test_measure_masks_rows(tmp_path):
    """Format 3's row: one changed chunk per index entry, the record laid out as the executor's
    (64 + 12 bytes per chunk + changed bytes, 64-aligned), and its passes loaded by format."""
    from weight_transfer.delta.packed import record_size
    from weight_transfer.delta.runs import KERNEL

    if KERNEL.lib() is None:
        pytest.skip("the native delta kernel is not built here (no C compiler)")
    r = measure(1 << 20, 0.01, repeats=1, fmt="masks")
    m, c = r["runs"], r["changed_bytes"]
    assert r["format"] == "masks" and 0 < m <= (1 << 20) // 64 and m <= c
    assert r["record_bytes"] == record_size(8 * m + -(-4 * m // 8) * 8, c)
    assert min(r["compare_passes"], r["pack_passes"], r["apply_passes"]) > 0
    runs = measure(1 << 20, 0.01, repeats=1)
    p = write_costs([runs, r], tmp_path / "c.csv")
    assert load_costs(p, 0.01).compare == pytest.approx(runs["compare_passes"])
    got = load_costs(p, 0.01, fmt="masks")
    assert got.compare == pytest.approx(r["compare_passes"]) and "format 3" in got.source
    with pytest.raises(ValueError, match="format"):
        measure(1 << 16, 0.01, repeats=1, fmt="bits")


def test_masks_record_expectation():
    """A chunk changes when any of its elements does; nothing changed, no record; everything
    changed, every chunk and byte."""
    assert masks_record(1 << 20, 2, 0.0) == (0.0, 0.0, 0.0)
    rec, chunks, changed = masks_record(1 << 20, 2, 0.01)
    assert chunks == pytest.approx((1 << 14) * (1 - 0.99 ** 32)) and changed == pytest.approx(0.01 * (1 << 20))
    assert rec % 64 == 0 and 64 + 12 * chunks + changed <= rec < 64 + 12 * chunks + changed + 72
    rec, chunks, changed = masks_record(1 << 20, 1, 1.0)
    assert chunks == 1 << 14 and changed == 1 << 20 and rec == 64 + 12 * (1 << 14) + (1 << 20)


@pytest.fixture(scope="module")
def tiny():
    cfg = get_config("tiny_qwen3_moe_2x2")
    _, tm, dm, rs = build(cfg)
    return cfg, plan(rs, tm, dm, max_chunk_bytes=cfg.max_chunk_bytes), model.first_metas(tm)


def _sim(tiny, mode, costs, p=0.01):
    cfg, sched, first = tiny
    fr = Fractions("all", {"all": {k: (p if k != "fp8_blocks" else 1.0) for k in MEASURED}})
    dm = DeltaModel(fr, cfg.hardware, granularity="block8", merge_gap=0, mode=mode, costs=costs)
    return model.simulate(sched, first, cfg.hardware, watermark=cfg.watermark, writes_in_flight="watermark", delta=dm)


def test_packed_is_one_record_per_write_and_pays_its_apply(tiny):
    cfg, sched, _ = tiny
    c = DeltaCosts(3.0, 10.0, 2.0, "test")
    sc, pk = _sim(tiny, "scattered", c), _sim(tiny, "packed", c)
    assert pk.extra["ops"] <= sched.n_writes < sc.extra["ops"]  # one record per write, not one WRITE per run
    assert pk.extra["wire_bytes"] > 0 and pk.extra["apply_seconds_max"] > 0
    assert sc.extra.get("apply_seconds_max", 0.0) == 0.0
    # apply is the busiest receiver's record bytes at the scaling rule
    recv = max(pk.rank_bytes["infer_recv"].values())
    assert pk.extra["apply_seconds_max"] == pytest.approx(c.seconds(c.apply, recv, cfg.hardware.hbm_gbs))
    # costlier passes cost more; nothing changed costs no apply
    assert _sim(tiny, "packed", DeltaCosts(30.0, 100.0, 20.0)).seconds > pk.seconds
    assert _sim(tiny, "packed", c, p=0.0).extra["apply_seconds_max"] == 0.0
    with pytest.raises(ValueError, match="needs measured costs"):
        DeltaModel(Fractions("all", {"all": dict.fromkeys(MEASURED, 0.0)}), cfg.hardware, mode="packed")
    with pytest.raises(ValueError, match="needs measured costs"):
        DeltaModel(Fractions("all", {"all": dict.fromkeys(MEASURED, 0.0)}), cfg.hardware, mode="masks")


def test_masks_mode_is_one_format3_record_per_write(tiny):
    """Format 3 in the model: one record per write like format 2, at most 12 index bytes per
    changed chunk, so more bytes than format 2's ~2 per run at a sparse step; its apply paid at
    the commit; nothing changed, nothing sent."""
    cfg, sched, _ = tiny
    c = DeltaCosts(1.0, 2.0, 2.0, "test")
    pk, mk = _sim(tiny, "packed", c), _sim(tiny, "masks", c)
    assert mk.extra["ops"] <= sched.n_writes and mk.extra["apply_seconds_max"] > 0
    assert pk.extra["wire_bytes"] < mk.extra["wire_bytes"] < sched.total_bytes
    recv = max(mk.rank_bytes["infer_recv"].values())
    assert mk.extra["apply_seconds_max"] == pytest.approx(c.seconds(c.apply, recv, cfg.hardware.hbm_gbs))
    none = _sim(tiny, "masks", c, p=0.0)
    assert none.extra["wire_bytes"] == 0 and none.extra["apply_seconds_max"] == 0.0


def _refused(capsys, argv):
    from weight_transfer.experiments.command import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_cli_delta_costs_rows(tmp_path, capsys):
    import pandas as pd

    from weight_transfer.experiments.command import main

    costs = write_costs([{"fraction": 0.0128, "format": "runs", "compare_passes": 9.0, "pack_passes": 40.0,
                          "apply_passes": 10.0},
                         {"fraction": 0.0128, "format": "masks", "compare_passes": 2.0, "pack_passes": 3.0,
                          "apply_passes": 4.0}], tmp_path / "costs.csv")
    base = ["simulate", "tiny_qwen3_moe_2x2", "--csv", str(tmp_path / "sim.csv")]
    assert "needs --delta-fractions or --delta-fraction" in _refused(capsys, base + ["--delta-costs", str(costs)])
    assert "no such file" in _refused(capsys, base + ["--delta-fraction", "0.01", "--delta-costs", str(tmp_path / "x")])
    assert main(base + ["--delta-fractions", str(ROOT / "results" / "rl_changes.csv"), "--delta-lr", "1e-6",
                        "--delta-fraction", "0.0002", "--delta-costs", str(costs)]) == 0
    out = capsys.readouterr().out
    assert "packed*" in out and "# measured: scaling rule" in out
    d = pd.read_csv(tmp_path / "sim_tiny_qwen3_moe_2x2_delta.csv")
    assert set(d["mode"]) == {"scattered", "packed", "masks"} and len(d) == 2 * 4
    assert "masks*" in out
    mk = d[d["mode"] == "masks"]
    assert (mk.granularity == "chunk64").all() and (mk.compare_passes == 2.0).all() and (mk.apply_seconds > 0).all()
    pk = d[(d["mode"] == "packed")]
    assert (pk.granularity == "block8").all() and (pk.compare_passes == 9.0).all() and (pk.apply_seconds > 0).all()
