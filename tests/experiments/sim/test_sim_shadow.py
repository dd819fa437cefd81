"""Shadow targets in the at-scale simulation (experiments/sim/shadow.py, ``simulate --shadow``):
the rows follow from their inputs on the tiny config's real schedule (the shadow is each
inference rank's destination bytes, the copy stall 2 x the largest of them over the effective
HBM rate, a flip below a copy below a pause), the command writes them, and a shadow that does
not fit is refused before planning with one ``error:`` line naming the rank and its bytes."""
import dataclasses

import pandas as pd
import pytest

from weight_transfer.experiments.command import main
from weight_transfer.experiments.sim import model, shadow
from weight_transfer.experiments.sim.configs import get_config
from weight_transfer.experiments.sim.hardware import Hardware
from weight_transfer.experiments.sim.metadata import region_bytes
from weight_transfer.experiments.sim.options import SimulateOptions
from weight_transfer.experiments.sim.run import build
from weight_transfer.plan import plan


@pytest.fixture(scope="module")
def tiny():
    cfg = get_config("tiny_qwen3_moe_2x2")
    _, tm, dm, rs = build(cfg)
    sched = plan(rs, tm, dm, max_chunk_bytes=cfg.max_chunk_bytes)
    head = model.simulate(sched, model.first_metas(tm), cfg.hardware, watermark=cfg.watermark,
                          writes_in_flight="watermark", method="overlapped_writes")
    return cfg, sched, dm, head


def test_rows_follow_from_the_schedule(tiny):
    cfg, sched, dm, head = tiny
    spec = shadow.ShadowSpec()
    rows = {r["mode"]: r for r in shadow.shadow_rows(cfg, head, dm, spec)}
    assert list(rows) == ["pause", "flip", "copy"]
    recv = dict(sched.recv_bytes)  # the schedule's per-rank destination bytes
    assert set(recv) == set(dm) and all(b > 0 for b in recv.values())
    hw = cfg.hardware
    for m in ("flip", "copy"):
        r = rows[m]
        assert r["shadow_bytes_max"] == max(recv.values()) and r["shadow_bytes_min"] == min(recv.values())
        assert r["shadow_bytes_mean"] == pytest.approx(sum(recv.values()) / len(recv))
        assert r["mem_bytes_max"] == max(region_bytes(dm[k]) + recv[k] for k in dm)
    # every byte of a rank's registered region is written once per update: shadow = weights
    assert all(recv[k] == region_bytes(dm[k]) for k in dm)
    assert rows["pause"]["shadow_bytes_max"] == 0 and rows["pause"]["mem_bytes_max"] == max(recv.values())
    # pause: the whole transfer; copy: 2 x the largest destination bytes / (HBM rate x efficiency)
    assert rows["pause"]["stall_s"] == head.seconds == rows["copy"]["transfer_s"]
    assert rows["copy"]["stall_s"] == pytest.approx(2 * max(recv.values()) / (hw.hbm_gbs * 1e9 * shadow.COPY_EFFICIENCY))
    assert rows["flip"]["stall_s"] == pytest.approx(max(len(ms) for ms in dm.values()) * shadow.FLIP_US_PER_TENSOR * 1e-6)
    assert rows["flip"]["stall_s"] < rows["copy"]["stall_s"] < rows["pause"]["stall_s"]
    for r in rows.values():
        assert r["stall_vs_pause"] == pytest.approx(r["stall_s"] / head.seconds)
        assert r["hbm_bytes"] == 80e9 and r["usable_bytes"] == pytest.approx(0.8 * 80e9) and r["fits"]
        assert r["free_bytes_min"] == r["hbm_bytes"] - r["mem_bytes_max"]
    # a slower copy at half the efficiency takes twice as long; the flip does not change
    half = {r["mode"]: r for r in shadow.shadow_rows(cfg, head, dm, shadow.ShadowSpec(copy_efficiency=0.375))}
    assert half["copy"]["stall_s"] == pytest.approx(2 * rows["copy"]["stall_s"])
    assert half["flip"]["stall_s"] == rows["flip"]["stall_s"]


def test_capacity_and_defaults():
    assert shadow.hbm_bytes(Hardware()) == 80e9
    assert shadow.hbm_bytes(get_config("kimi_k2_256xh200efa_to_128_dpa_ep32").hardware) == 141e9
    assert shadow.hbm_bytes(get_config("kimi_k2_256xh20_ckpt_engine").hardware) == 96e9
    with pytest.raises(ValueError, match="no GPU memory capacity known"):
        shadow.hbm_bytes(dataclasses.replace(Hardware(), name="B200, 8 x 400 Gb/s"))
    o = SimulateOptions()
    assert (o.shadow_reserve, o.shadow_copy_efficiency) == (shadow.DEFAULT_RESERVE, shadow.COPY_EFFICIENCY)
    assert shadow.copy_seconds(8e9, dataclasses.replace(Hardware(), hbm_gbs=4000.0), 1.0) == pytest.approx(4e-3)


def test_kimi_k2_fit_at_scale():
    """Before any planning, from the destination metadata alone: the headline layout (46 GB per
    H200) fits with its shadow; 8 x DPA+EP16 (78 GB per H200) does not."""
    spec = shadow.ShadowSpec()
    spec.check(get_config("kimi_k2_256xh200efa_to_128_dpa_ep32"))
    with pytest.raises(ValueError, match=r"inference rank 0 holds 77\.\d\d GB|inference rank 0 holds \d+ B"):
        spec.check(get_config("kimi_k2_256xh200efa_to_128_dpa_ep16"))


def _refused(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_cli_writes_rows_and_refuses_what_does_not_fit(tmp_path, capsys, tiny):
    cfg, sched, dm, _ = tiny
    base = ["simulate", "tiny_qwen3_moe_2x2", "--csv", str(tmp_path / "s.csv")]
    assert main(base + ["--shadow", "--shadow-copy-efficiency", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "# shadow targets (SIMULATED" in out and "# assumption: copy: 2 x bytes" in out
    d = pd.read_csv(tmp_path / "sim_tiny_qwen3_moe_2x2_shadow.csv")
    assert list(d["mode"]) == ["pause", "flip", "copy"] and d.fits.all() and (d.copy_efficiency == 0.5).all()
    full = pd.read_csv(tmp_path / "s.csv").query("method == 'overlapped_writes'")
    assert (d.transfer_s == full.seconds.item()).all() and d.method.eq("overlapped_writes").all()
    biggest = max(sched.recv_bytes.values())
    assert d.set_index("mode").loc["copy", "stall_s"] == pytest.approx(2 * biggest / (cfg.hardware.hbm_gbs * 1e9 * 0.5))
    assert d.set_index("mode").loc["copy", "shadow_bytes_max"] == biggest

    # 1% of an 80 GB H100 left for weights + shadow: 0.8 GB, below 2 x 0.68 GB -> refused before planning
    for f in ("s.csv", "sim_tiny_qwen3_moe_2x2_shadow.csv"):
        (tmp_path / f).unlink()
    err = _refused(capsys, base + ["--shadow", "--shadow-reserve", "0.99"])
    w = region_bytes(dm[0])
    assert "does not fit" in err and "inference rank 0" in err and f"{w} B" in err and f"{2 * w} B" in err
    assert not (tmp_path / "s.csv").exists() or (tmp_path / "s.csv").stat().st_size == 0  # no row written
    assert not (tmp_path / "sim_tiny_qwen3_moe_2x2_shadow.csv").exists()
    assert "--shadow-reserve" in _refused(capsys, base + ["--shadow", "--shadow-reserve", "1"])
    assert "--shadow-copy-efficiency" in _refused(capsys, base + ["--shadow", "--shadow-copy-efficiency", "0"])
    assert "not supported" in _refused(capsys, ["simulate", "--map", "--shadow"])
    assert "no reference schedule" in _refused(capsys, ["simulate", "kimi_k2_256xh20_ckpt_engine", "--csv",
                                                        str(tmp_path / "s.csv"), "--shadow"])
