"""The public API under misuse and faults (case C28; issue 37): what a user's trainer sees when
the library lives in its processes and no controller kills anything.

Each world (tests/helpers/api_world.py) is 2 FSDP2 training ranks (Gloo), the stand-in engine's
receivers and a coordinator (in training rank 0, or a process of its own), driven only through
``Sender`` / ``Coordinator`` / ``Receiver``. The matrix is role (training rank, coordinator,
inference rank) x stage (plan, prepare, write, release, commit) x fault (raise, kill, stall),
where the pair exists (a receiver runs no code per update: its faults are its process killed,
stopped, or its region closed while the writes land; a coordinator's stages are plan and commit,
its writes are the training ranks'). Every case asserts, on every training rank: the documented
exception type, what it names (role, rank, cause), the time bound; on every live receiver: no
byte changed under a complete label (its bytes equal a fresh engine's ``load_weights`` of the
published version, every byte of its arena, whenever it reads ``complete``), a refused push left
bytes and state untouched; and that the next update completes bit-exact where the case allows
one, and that no process is left at the end.
"""
from __future__ import annotations

import pytest

from tests.helpers.api_world import Fault, Push, World, run

pytestmark = pytest.mark.multiproc

T = 4.0
"""The control timeout of every world (seconds)."""
QUICK = 5.0
"""A raised fault is named within this (seconds): no wait for a timeout is involved."""
BOUND = T + 9.0
"""A killed or stalled rank is named within the control timeout plus the writer's grace
(5 s, ``Sender._run_watched``) and process start-up noise on 2 shared cores."""


def _misuse_and_stage_faults() -> World:
    F = Fault
    return World([
        Push(1),                                   # 0
        Push(2),                                   # 1
        Push(2),                                   # 2  the version repeated (C28)
        Push(1),                                   # 3  a lower one
        Push({0: 5, 1: 6}),                        # 4  the ranks disagree
        Push({0: 7, 1: "7"}),                      # 5  a version from os.environ
        Push(3),                                   # 6
        Push(4, F("train", 1, "prepare", "raise")),  # 7  C28: a rank raising in prepare
        Push(5),                                   # 8
        Push(6, F("train", 0, "write", "raise")),    # 9
        Push(7),                                   # 10
        Push(8, F("train", 1, "release", "raise")),  # 11
        Push(9),                                   # 12
        Push(10, F("coord", 0, "commit", "raise")),  # 13
        Push(11),                                  # 14
        Push(12, F("train", 1, "prepare", "stall")),  # 15
        Push(13),                                  # 16
        Push(14, F("coord", 0, "commit", "stall")),  # 17
        Push(15),                                  # 18
        Push(16, F("train", 0, "write", "stall")),   # 19 the coordinator's own rank stalls in a write
        Push(17),                                  # 20
    ], timeout=T)


def _killed(rank: int, stage: str) -> World:
    first = [] if stage == "plan" else [Push(1)]
    return World(first + [Push(2, Fault("train", rank, stage, "kill"), last=True)], tp=1, dp=1, timeout=T)


KILLS = [(1, "plan"), (1, "prepare"), (0, "write"), (1, "release")]
"""(training rank, stage) of the kill cases (rank 0 hosts the coordinator)."""

WORLDS = {
    "misuse_and_stage_faults": _misuse_and_stage_faults,
    "tp2_dp2_receivers": lambda: World([Push(1, Fault("train", 1, "plan", "raise")),
                                        Push(2),
                                        Push(3, Fault("infer", 1, "write", "stall")),
                                        Push(4, Fault("infer", 3, "write", "kill")),
                                        Push(5)], tp=2, dp=2, timeout=T),
    "coordinator_process": lambda: World([Push(1),
                                          Push(2, Fault("infer", 1, "write", "raise")),
                                          Push(3),
                                          Push(4, Fault("coord", 0, "commit", "kill"), last=True)],
                                         tp=1, dp=2, coordinator="process", timeout=T),
    **{f"train{r}_killed_in_{st}": (lambda r=r, st=st: _killed(r, st)) for r, st in KILLS},
    **{f"shadow_{m}": (lambda m=m: World([Push(1),
                                          Push(2, Fault("train", 1, "prepare", "raise")),
                                          Push(3),
                                          Push(4, Fault("train", 0, "write", "raise")),
                                          Push(5)], tp=2, dp=1, shadow=m, timeout=T)) for m in ("flip", "copy")},
    "plan_refused": lambda: World([Push(1, Fault("coord", 0, "plan", "raise"), last=True)], tp=1, dp=1, timeout=T),
    "coordinator_killed_planning": lambda: World([Push(1, Fault("coord", 0, "plan", "kill"), last=True)], tp=1, dp=1,
                                                 coordinator="process", timeout=T),
}
"""Every world of this module by name (``scripts/api_faults.py`` runs them and prints what each
rank saw): a builder of its :class:`World`."""


def _trainers(w: World, k: int) -> dict[int, dict]:
    return {r: w.results["train"][r].get(k) for r in range(w.n_train)}


def ok_everywhere(w: World, k: int, ranks=None, version=None) -> None:
    """Push ``k`` returned on every training rank and every receiver in ``ranks`` (default all)
    reads ``complete`` with bytes equal to a fresh engine's of that version."""
    for r, res in _trainers(w, k).items():
        assert res is not None and res["ok"], (k, r, res)
    for i in (range(w.n_infer) if ranks is None else ranks):
        c = w.results["infer"][i][k]
        assert c["state"] == "complete" and c["bytes_ok"], (k, i, c)
        if version is not None:
            assert c["version"] == version, (k, i, c)


def same_error_everywhere(w: World, k: int, typ: str, *names: str, bound: float = QUICK, ranks=None) -> None:
    """Push ``k`` raised ``typ`` on every training rank in ``ranks`` (default all), each message
    naming every string of ``names``, within ``bound`` seconds."""
    for r in (range(w.n_train) if ranks is None else ranks):
        res = w.results["train"][r].get(k)
        assert res is not None and not res["ok"], (k, r, res)
        assert res["type"] == typ, (k, r, res)
        for n in names:
            assert n in res["msg"], (k, r, n, res["msg"])
        assert res["seconds"] < bound, (k, r, res["seconds"], bound)


def untouched(w: World, k: int, ranks=None) -> None:
    """Push ``k`` (refused before any byte moved) left every receiver's state (same sequence
    number) and bytes as push ``k - 1`` left them."""
    for i in (range(w.n_infer) if ranks is None else ranks):
        a, b = w.results["infer"][i][k - 1], w.results["infer"][i][k]
        assert (a["state"], a["version"], a["seq"], a["digest"]) == (b["state"], b["version"], b["seq"],
                                                                     b["digest"]), (k, i, a, b)


def never_complete_over_other_bytes(w: World) -> None:
    """Across the whole run: whenever a receiver read ``complete``, its bytes were that version's."""
    for i, rec in w.results["infer"].items():
        for k, c in rec.items():
            if c["state"] == "complete":
                assert c["bytes_ok"], (i, k, c)


def nothing_left(w: World, killed=()) -> None:
    assert w.results["left"] == [], w.results["left"]
    for name, code in w.results["exit"].items():
        if name not in killed:
            assert code == 0, (name, code, w.results["exit"])


# ---------------------------------------------------------------------------------------------
# one world: misuse and every raise/stall fault that leaves the world alive, each followed by a
# complete update


def test_c28_refusals_and_failures_in_every_stage_leave_no_rank_behind(tmp_path):
    pushes = WORLDS["misuse_and_stage_faults"]().pushes
    w = run(WORLDS["misuse_and_stage_faults"](), str(tmp_path))
    ok_everywhere(w, 0, version=1)
    ok_everywhere(w, 1, version=2)
    same_error_everywhere(w, 2, "VersionError", "push(version=2): version 2 refused", "complete version 2")
    untouched(w, 2)
    same_error_everywhere(w, 3, "VersionError", "version 1 refused")
    untouched(w, 3)
    same_error_everywhere(w, 4, "ValueError", "different versions", "{0: 5, 1: 6}")
    untouched(w, 4)
    same_error_everywhere(w, 5, "TypeError", "training 1", "version='7'", "int()")
    untouched(w, 5)
    ok_everywhere(w, 6, version=3)
    for k, who, cause in [(7, "training 1", "injected: training rank 1 fails in prepare"),
                          (9, "training 0", "injected: training rank 0 fails in write"),
                          (11, "training 1", "injected: training rank 1 fails in release"),
                          (13, "commit failed", "injected: coordinator commit of version 10")]:
        same_error_everywhere(w, k, "ControlError", who, cause)
        failing = int(who.split()[1]) if who.startswith("training") else 0
        assert w.results["train"][failing][k]["cause"] is not None  # the stage's own exception, chained
        for i in range(w.n_infer):
            c = w.results["infer"][i][k]
            assert c["state"] == "incomplete" and c["version"] == pushes[k].version, (k, i, c)
        ok_everywhere(w, k + 1, version=pushes[k + 1].version)
    # stalls: named within the control timeout
    same_error_everywhere(w, 15, "ControlError", "training 1: stalled in prepare", "holding the others up",
                          bound=BOUND, ranks=[0])
    same_error_everywhere(w, 15, "ControlError", bound=BOUND + T + 3, ranks=[1])  # it slept timeout + 3 s
    ok_everywhere(w, 16, version=13)
    same_error_everywhere(w, 17, "ControlError", "commit of step 14 did not return within", bound=BOUND)
    ok_everywhere(w, 18, version=15)
    same_error_everywhere(w, 19, "ControlError", "no answer within", "training 0", bound=BOUND + T + 3)
    ok_everywhere(w, 20, version=17)
    never_complete_over_other_bytes(w)
    nothing_left(w)


# ---------------------------------------------------------------------------------------------
# receivers: killed, stopped, closed mid-update; a training rank failing to set up its plan


def test_c28_tp2_dp2_a_receiver_killed_mid_update_drops_its_group_and_the_next_completes(tmp_path):
    """C28 at TP=2 x DP=2: one rank of one TP group killed mid-update fails that update, named,
    on every training rank; the next push plans without the whole group (a TP engine missing a
    rank serves nothing) and completes bit-exact on the other; the dropped group's surviving
    rank never reads a version again. Before it: a training rank whose plan set-up fails refuses
    the first push on every rank (nothing moved), and a receiver stopped (SIGSTOP) while the
    writes land is no failure at all (its memory takes one-sided writes; it reads the version
    once it runs again)."""
    w = run(WORLDS["tp2_dp2_receivers"](), str(tmp_path))
    same_error_everywhere(w, 0, "ControlError", "training 1: setting up the plan failed",
                          "injected: training rank 1 fails in plan")
    for i in range(4):
        c = w.results["infer"][i][0]
        assert c["state"] == "none" and c["canary"], (i, c)  # nothing moved
    ok_everywhere(w, 1, version=2)
    ok_everywhere(w, 2, version=3)
    same_error_everywhere(w, 3, "ControlError", "inference 3", "inference rank(s) [2, 3] gone")
    ok_everywhere(w, 4, ranks=[0, 1], version=5)
    assert w.results["infer"][2][4]["state"] == "none"  # dropped with its group: reads no version
    never_complete_over_other_bytes(w)
    nothing_left(w, killed={"infer3"})


def test_coordinator_of_its_own_a_receiver_closing_mid_update_and_the_coordinator_killed(tmp_path):
    """The coordinator in a process of its own (``Coordinator.serve``), TP=1 x DP=2: a receiver
    that closes its region while the writes land (its engine shut down) fails that update,
    named, and the next completes on the other; the coordinator killed in its commit: every
    training rank raises ControlError naming it, within the timeout, and no receiver reads the
    version that was being written as complete."""
    w = run(WORLDS["coordinator_process"](), str(tmp_path))
    ok_everywhere(w, 0, version=1)
    same_error_everywhere(w, 1, "ControlError", "inference", "1")
    assert "inference rank(s) [1] gone" in w.results["train"][0][1]["msg"]
    ok_everywhere(w, 2, ranks=[0], version=3)
    same_error_everywhere(w, 3, "ControlError", "coordinator: process", "is gone", bound=BOUND)
    c = w.results["infer"][0][3]
    assert c["state"] == "writing" and c["version"] == 4, c  # never complete: the coordinator died before
    never_complete_over_other_bytes(w)
    nothing_left(w, killed={"coord"})


# ---------------------------------------------------------------------------------------------
# a training rank killed: the survivor raises within the timeout, nothing reads as complete


@pytest.mark.parametrize("rank,stage", KILLS)
def test_a_training_rank_killed_in_each_stage(tmp_path, rank, stage):
    """The other training rank raises ControlError within the control timeout naming the dead
    one (training rank 0 hosts the coordinator: killing it leaves rank 1 naming the
    coordinator), even where its writer stays blocked in a Gloo collective with the dead peer;
    no receiver reads the update's version as complete; every other process ends."""
    first = stage == "plan"
    w = run(WORLDS[f"train{rank}_killed_in_{stage}"](), str(tmp_path))
    k = len(w.pushes) - 1
    if not first:
        ok_everywhere(w, 0, version=1)
    other = 1 - rank
    same_error_everywhere(w, k, "ControlError", "coordinator" if rank == 0 else "training 1", bound=BOUND,
                          ranks=[other])
    assert "gone" in w.results["train"][other][k]["msg"]
    assert k not in w.results["train"][rank]  # it died in the push
    c = w.results["infer"][0][k]
    assert c["state"] != "complete" or c["version"] < 2, c
    never_complete_over_other_bytes(w)
    nothing_left(w, killed={f"train{rank}"})


def test_a_refused_plan_is_the_same_plan_error_on_every_rank(tmp_path):
    """The coordinator's plan refused (a PlanError naming what cannot be planned): every
    training rank raises that PlanError, same message, at the first push; nothing moved."""
    w = run(WORLDS["plan_refused"](), str(tmp_path))
    same_error_everywhere(w, 0, "PlanError", "injected: the coordinator's plan is refused")
    c = w.results["infer"][0][0]
    assert c["state"] == "none" and c["canary"], c
    nothing_left(w)


def test_the_coordinator_process_killed_while_planning(tmp_path):
    """A coordinator of its own killed in its planning step: every training rank's first push
    raises ControlError naming the coordinator's process within the timeout; nothing moved."""
    w = run(WORLDS["coordinator_killed_planning"](), str(tmp_path))
    same_error_everywhere(w, 0, "ControlError", "coordinator: process", "is gone", bound=BOUND)
    c = w.results["infer"][0][0]
    assert c["state"] == "none" and c["canary"], c
    nothing_left(w, killed={"coord"})


@pytest.mark.parametrize("mode", ["flip", "copy"])
def test_c27_shadow_targets_a_failed_update_leaves_the_last_version_serving_complete(tmp_path, mode):
    """C27 through the public API: receivers with shadow targets (each serving its go-lives).
    Updates 1, 3, 5 go live (bit-exact, complete); a training rank raising in prepare (update 2)
    and in a write (update 4) fails the update on every rank alike, saying nothing live was
    touched, and every receiver keeps serving the last complete version: state ``complete``
    at that version (not ``incomplete``), its live bytes unchanged and bit-exact, and the
    next update goes live."""
    w = run(WORLDS[f"shadow_{mode}"](), str(tmp_path))
    nothing_left(w)
    never_complete_over_other_bytes(w)
    for k, v in ((0, 1), (2, 3), (4, 5)):
        ok_everywhere(w, k, version=v)
        for i in range(w.n_infer):
            assert w.results["infer"][i][k]["live_version"] == v, (k, i, w.results["infer"][i][k])
    for k, failing in ((1, "training 1"), (3, "training 0")):
        same_error_everywhere(w, k, "ControlError", failing, "nothing live was touched")
        for i in range(w.n_infer):
            a, b = w.results["infer"][i][k - 1], w.results["infer"][i][k]
            assert b["state"] == "complete" and b["version"] == a["version"] and b["bytes_ok"], (k, i, b)
            assert b["digest"] == a["digest"] and b["live_version"] == a["live_version"], (k, i, a, b)
