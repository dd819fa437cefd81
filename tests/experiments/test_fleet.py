"""Engines killed, restarted and scaled during one ``run`` (C24; weight_transfer.experiments.fleet).

Unit tests (default set): the options' parsing and every refusal before any process starts
(one ``error:`` line, exit 2), what happens at each update, the trial keys of trials without
the options unchanged, the table of a run whose fleet changed, the fault matrix's elastic
rows. The three multi-process trials (the acceptance scenario: 2 engines, one killed while
update 3 writes, a replacement before update 5; one killed between updates; 1 -> 3 -> 1
engines) start 5-6 processes each, 36-83 s each on the 2-core VM: marked ``long``."""
from __future__ import annotations

import argparse

import pytest

from weight_transfer.experiments.config import FleetOptions, TrialConfig, main_job_default, trial_key
from weight_transfer.experiments.engine_options import parse_kills, parse_pairs, text_of
from weight_transfer.experiments.fleet import plan_fleet

SMALL = dict(num_hidden_layers=1, vocab_size=1024, hidden_size=256, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def cfg(**kw):
    base = dict(model="qwen3-0.6b", overrides=SMALL, n_train=2, tp=1, dp=2, steps=6, warmup=0, timeout=60)
    base.update(kw)
    return TrialConfig.from_flat(**base)


def test_parsing_of_the_three_options():
    assert parse_kills("3:1") == ((3, 1, "during"),)
    assert parse_kills("2:0:before, 4:1") == ((2, 0, "before"), (4, 1, "during"))
    assert parse_pairs("1:1,3:3,5:1", "--engines-at", "N") == ((1, 1), (3, 3), (5, 1))
    assert text_of(((3, 1, "during"), (2, 0, "before"))) == "3:1,2:0:before"
    for bad, flag in (("3", "--kill-engine"), ("3:x", "--kill-engine"), ("3:1:later", "--kill-engine"),
                      ("a:1", "--kill-engine")):
        with pytest.raises(argparse.ArgumentTypeError, match=flag):
            parse_kills(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=r"--engines-at '3': wants STEP:N"):
        parse_pairs("3", "--engines-at", "N")
    # lists (a config from JSON) normalize to the options' tuples; 'during' filled in
    fo = FleetOptions(kill_engine=[[3, 1]], restart_engine=[[5, 1]])
    assert fo.kill_engine == ((3, 1, "during"),) and fo.restart_engine == ((5, 1),) and fo.active
    assert not FleetOptions().active


def test_what_happens_at_each_update():
    initial, ev = plan_fleet(FleetOptions(kill_engine=((3, 1, "during"),), restart_engine=((5, 1),)), 6, 2)
    assert initial == (0, 1) and sorted(ev) == [3, 5]
    assert ev[3].kill_during == [1] and ev[3].members == (0, 1)
    assert ev[5].start == [1] and ev[5].members == (0, 1)
    initial, ev = plan_fleet(FleetOptions(engines_at=((1, 1), (3, 3), (5, 1))), 6, 3)
    assert initial == (0,) and ev[3].start == [1, 2] and ev[3].members == (0, 1, 2)
    assert ev[5].leave == [2, 1] and ev[5].members == (0,)
    _, ev = plan_fleet(FleetOptions(kill_engine=((2, 0, "before"),), restart_engine=((4, 0),)), 5, 2)
    assert ev[2].kill_before == [0] and ev[2].members == (1,) and ev[4].members == (0, 1)
    from weight_transfer.experiments.fleet import planned_members

    assert planned_members(cfg(kill_engine=((3, 1, "during"),), restart_engine=((5, 1),))) == \
        {1: "0,1", 2: "0,1", 3: "0,1", 4: "0", 5: "0,1", 6: "0,1"}
    assert planned_members(cfg(tp=2, dp=2, kill_engine=((2, 1, "before"),), steps=3)) == {1: "0,1,2,3", 2: "0,1", 3: "0,1"}


@pytest.mark.parametrize("kw,msg", [
    (dict(kill_engine=((7, 1, "during"),)), r"--kill-engine 7:1: update 7 is outside the run \(updates 1..6"),
    (dict(kill_engine=((3, 2, "during"),)), r"--kill-engine 3:2: no engine 2 \(the layout has room for dp=2"),
    (dict(restart_engine=((5, 1),)), r"--restart-engine 5:1: engine 1 is running before update 5"),
    (dict(kill_engine=((3, 1, "during"),), restart_engine=((3, 1),)), r"--restart-engine 3:1: engine 1 is running"),
    (dict(kill_engine=((3, 1, "before"),), restart_engine=((3, 1),)),
     r"--restart-engine 3:1: engine 1 was not killed before update 3"),
    (dict(kill_engine=((3, 1, "during"), (4, 1, "during"))), r"--kill-engine 4:1: engine 1 is not running at update 4"),
    (dict(kill_engine=((3, 0, "during"), (3, 1, "during"))), r"no engine would survive update 3"),
    (dict(kill_engine=((2, 0, "before"), (2, 1, "before"))), r"no engine left for update 2"),
    (dict(kill_engine=((1, 0, "before"),)), r"--kill-engine 1:0:before: the engines start with the run"),
    (dict(engines_at=((3, 3),)), r"--engines-at 3:3: the layout has room for dp=2 engine\(s\); raise --dp to 3"),
    (dict(engines_at=((0, 1),)), r"--engines-at 0:1: updates are numbered from 1"),
    (dict(engines_at=((2, 0),)), r"at least 1 engine serves"),
    (dict(engines_at=((2, 1), (2, 2))), r"one count per update"),
    (dict(kill_engine=((3, 1, "during"), (3, 1, "during"))), r"--kill-engine 3:1 given twice"),
    (dict(kill_engine=((3, 1, "during"),), method="rank0_funnel"), r"with --method rank0_funnel: engines that come"),
    (dict(kill_engine=((3, 1, "during"),), transport="shm"), r"wired for --device cpu --transport cma"),
    (dict(engines_at=((2, 1),), engine="vllm", quant=None), r"with --engine vllm: wired for the stand-in"),
])
def test_bad_fleet_options_refused_naming_the_option(kw, msg):
    with pytest.raises(ValueError, match=msg):
        cfg(**kw)


def test_trial_keys_without_the_options_unchanged():
    # over cma, the transport those keys were recorded with (``auto`` resolves to it with the fleet options)
    assert trial_key(TrialConfig().replace(transport="cma")) == "99c2ce5942a4"
    assert trial_key(main_job_default().replace(transport="cma")) == "ec37f64c0aa7"
    a = cfg()
    assert trial_key(a) != trial_key(a.replace(kill_engine=((3, 1, "during"),)))
    assert trial_key(a.replace(engines_at=((1, 1), (2, 2)))) != trial_key(a.replace(engines_at=((1, 1), (3, 2))))
    assert {"kill_engine", "restart_engine", "engines_at"} <= set(a.flat())


@pytest.mark.parametrize("args,msg", [
    (["--kill-engine", "3"], "--kill-engine '3': wants STEP:E or STEP:E:before"),
    (["--kill-engine", "9:1"], "--kill-engine 9:1: update 9 is outside the run"),
    (["--restart-engine", "5:1"], "--restart-engine 5:1: engine 1 is running before update 5"),
    (["--engines-at", "2:4"], "--engines-at 2:4: the layout has room for dp=2"),
])
def test_cli_refuses_before_any_process_one_error_line_exit_2(args, msg, tmp_path, capsys):
    """``weight-transfer run`` with a bad fleet option: one ``error:`` line, status 2, nothing
    written (the results file is not even created: the config is refused first)."""
    from weight_transfer.experiments.command import main

    out = tmp_path / "rows.csv"
    argv = ["run", "--model", "qwen3-0.6b", "--override", "num_hidden_layers=1", "--tp", "1", "--dp", "2",
            "--steps", "6", "--warmup", "0", "--results", str(out), *args]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusal (a malformed option): the same one line, status 2
        rc = e.code
    assert rc == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], lines
    assert not out.exists()


def test_table_of_a_run_whose_fleet_changed():
    """The rows a fleet run makes (a failed update, a membership change, a newcomer) shown:
    members and replan per update, the failed update named, the trainers' pids."""
    from weight_transfer.experiments.report import format_table
    from weight_transfer.experiments.trial import TrialResult

    c = cfg(kill_engine=((3, 1, "during"),), restart_engine=((5, 1),), steps=5)
    common = dict(n_writes=20, peak_temp_bytes=1 << 20, warmup=False, train_pids="11,12", kill_engine="3:1",
                  restart_engine="5:1", engines_at="", join_seconds=0.0, joined="", gone="", newcomer_first="")
    rows = [dict(step=1, bytes=1000, seconds=0.01, verified=True, members="0,1", epoch=0, replan_seconds=0.0,
                 outcome="complete", **common),
            dict(step=2, bytes=1000, seconds=0.01, verified=True, members="0,1", epoch=0, replan_seconds=0.0,
                 outcome="complete", **common),
            {**common, **dict(step=3, bytes=0, seconds=0.05, verified=None, members="0,1", epoch=0, replan_seconds=0.0,
                              outcome="failed", lost="1", weights_after="incomplete v3", seconds_to_error=0.06,
                              error="step 3: update failed: inference 1: process 9 exited with code -9 (SIGKILL) "
                                    "(also: training 0: ...)")},
            {**common, **dict(step=4, bytes=500, seconds=0.01, verified=True, members="0", epoch=1,
                              replan_seconds=0.003, gone="1", outcome="complete")},
            {**common, **dict(step=5, bytes=1000, seconds=0.01, verified=True, members="0,1", epoch=2,
                              replan_seconds=0.004, joined="1", newcomer_first="1", join_seconds=2.5,
                              outcome="complete")}]
    env = dict(host="h", cpus=2, torch="t", python="p", git_sha="g")
    text = format_table(TrialResult(c, rows, "plan", 0.1, 1.0, env))
    assert "FAILED" in text and "(step 3: update failed: inference 1: process 9 exited with code -9 (SIGKILL))" in text
    assert "verified bit-exact against the engine's load_weights: 4/4 updates" in text
    assert "# before update 4: members 0 (gone 1); plan recomputed for them in 0.0030 s (epoch 1)" in text
    assert "joined 1 (registered 2.50 s after its start)" in text
    assert "# newcomer rank(s) 1: first update 5 complete, verified bit-exact: yes" in text
    assert "# training ranks' pids: 11,12 at every update (unchanged" in text
    assert "named 0.06 s after the kill; weights incomplete v3" in text


def _check_rows(rows, want_members, failed_steps, trainer_pids=None):
    assert [r["step"] for r in rows] == sorted(want_members)
    assert {r["step"]: r["members"] for r in rows} == want_members
    assert {r["step"] for r in rows if r["outcome"] == "failed"} == failed_steps
    assert all(r["verified"] is True for r in rows if r["outcome"] == "complete"), \
        [(r["step"], r.get("verify_error")) for r in rows]
    pids = {r["train_pids"] for r in rows}
    assert len(pids) == 1 and "?" not in next(iter(pids))  # the trainers never restarted


@pytest.mark.multiproc
@pytest.mark.long
@pytest.mark.timeout(600)
def test_c24_kill_engine_at_3_replacement_at_5_survivors_go_on():
    """Acceptance (issue 27 item 1, C24): 2 engines; engine 1 SIGKILLed while update 3 writes
    (that update fails naming inference 1, weights incomplete v3); updates 4 and later complete
    on the survivors (4 on engine 0 alone, replanned); a fresh engine 1 (poisoned memory) joins
    before update 5: its first update is complete and bit-exact; the trainers' pids never change."""
    from weight_transfer.experiments.trial import run_trial

    res = run_trial(cfg(kill_engine=((3, 1, "during"),), restart_engine=((5, 1),)), stall=10)
    rows = res.rows
    _check_rows(rows, {1: "0,1", 2: "0,1", 3: "0,1", 4: "0", 5: "0,1", 6: "0,1"}, {3})
    f = rows[2]
    assert "inference 1: process" in f["error"] and "(SIGKILL)" in f["error"] and f["weights_after"] == "incomplete v3"
    assert f["seconds_to_error"] is not None and f["seconds_to_error"] < 5
    assert rows[3]["gone"] == "1" and rows[3]["epoch"] == 1 and rows[3]["replan_seconds"] > 0
    assert rows[3]["bytes"] * 2 == rows[1]["bytes"]  # one replica's bytes
    assert rows[4]["joined"] == "1" and rows[4]["newcomer_first"] == "1" and rows[4]["verified"] is True
    assert rows[4]["epoch"] == 2 and rows[5]["epoch"] == 2 and rows[5]["replan_seconds"] == 0.0


@pytest.mark.multiproc
@pytest.mark.long
@pytest.mark.timeout(600)
def test_c24_kill_between_updates_planned_without_no_update_fails():
    """``--kill-engine 2:1:before``: engine 1 is SIGKILLed before update 2's load, found gone
    before the go and planned without: update 2 completes on engine 0 (no failed update); a
    replacement joins before update 4 and its first update is bit-exact."""
    from weight_transfer.experiments.trial import run_trial

    res = run_trial(cfg(kill_engine=((2, 1, "before"),), restart_engine=((4, 1),), steps=4), stall=10)
    _check_rows(res.rows, {1: "0,1", 2: "0", 3: "0", 4: "0,1"}, set())
    assert res.rows[1]["gone"] == "1" and res.rows[3]["joined"] == "1" and res.rows[3]["epoch"] == 2


@pytest.mark.multiproc
@pytest.mark.long
@pytest.mark.timeout(600)
def test_c24_scale_1_3_1_every_update_verified_replan_timed():
    """Scale 1 -> 3 -> 1 engines in one run: engine 0 alone for updates 1-2, engines 0-2 for
    3-4 (two newcomers, their first update bit-exact), engine 0 alone again for 5-6 (engines 2
    and 1 leave: deregister and exit 0); every update verified on exactly its engines, the
    replan timed at each change, the trainers' pids unchanged."""
    from weight_transfer.experiments.report import format_table
    from weight_transfer.experiments.trial import run_trial

    res = run_trial(cfg(dp=3, engines_at=((1, 1), (3, 3), (5, 1))), stall=10)
    rows = res.rows
    _check_rows(rows, {1: "0", 2: "0", 3: "0,1,2", 4: "0,1,2", 5: "0", 6: "0"}, set())
    assert rows[2]["joined"] == "1,2" and rows[4]["gone"] == "1,2"
    assert all(rows[i]["replan_seconds"] > 0 for i in (2, 4)) and rows[2]["epoch"] == 1 and rows[4]["epoch"] == 2
    assert rows[2]["bytes"] == 3 * rows[0]["bytes"] == 3 * rows[4]["bytes"]
    text = format_table(res)
    assert "# before update 3: members 0,1,2 (joined 1,2" in text and "# before update 5: members 0 (gone 1,2)" in text


def test_fault_matrix_elastic_rows_table_and_verdict():
    """The matrix's elastic rows: a row is good only when it exits 0, names the killed engine,
    leaves nothing and its rows went as planned with the trainers' pids unchanged."""
    from weight_transfer.experiments.faults import ELASTIC, ElasticRow, all_faults, format_matrix, parse_row, row_ok

    assert set(ELASTIC) == {"engine-dies-replacement-joins", "scale-1-3-1"}
    assert [f.spec() for f in all_faults()][-2:] == list(ELASTIC) and len(all_faults()) == 29
    kill, scale = parse_row("engine-dies-replacement-joins"), parse_row("scale-1-3-1")
    assert isinstance(kill, ElasticRow) and kill.name == "inference 1" and scale.name == "-"
    good = dict(error="step 3: update failed: inference 1: process 9 exited with code -9 (SIGKILL)",
                seconds_to_error=0.08, state="incomplete v3", restored=True, ok=True, replan=0.01, pids_same=True,
                members="1:0,1 2:0,1 3:0,1(failed) 4:0 5:0,1 6:0,1", exit=0, left=0)
    calm = dict(error=None, seconds_to_error=None, state=None, restored=True, ok=True, replan=0.01, pids_same=True,
                members="1:0 2:0 3:0,1,2 4:0,1,2 5:0 6:0", exit=0, left=0)
    assert row_ok(kill, good) and row_ok(scale, calm)
    assert not row_ok(kill, {**good, "ok": False}) and not row_ok(kill, {**good, "left": 1})
    assert not row_ok(kill, {**good, "exit": 1}) and not row_ok(scale, {**calm, "error": good["error"]})
    text = format_matrix([(kill, good), (scale, calm)], stall=5.0)
    assert "engine-dies-replacement-joins      0.08  inference 1" in text and "3:0,1(failed) 4:0" in text
    assert text.endswith("# rows named, bounded and clean: 2/2")
