"""Store protocol of the control plane (in one process, real TCPStore over loopback)."""
import threading
import time

import pytest

from weight_transfer.control import clients
from weight_transfer.control import protocol as control
from weight_transfer.control import store as store_api


@pytest.fixture()
def store():
    s = store_api.make_store("127.0.0.1", 0, is_master=True, timeout=10)
    yield s


def client(store):
    return store_api.make_store("127.0.0.1", store.port, is_master=False, timeout=10)


def test_timeout_names_missing_ranks(store):
    store.set("x/0", b"1")
    with pytest.raises(control.ControlError, match=r"rank\(s\) \[1, 2\]"):
        control.wait_keys(store, {0: "x/0", 1: "x/1", 2: "x/2"}, timeout=0.3, what="test")


def test_dead_rank_named_at_once(store):
    t0 = time.monotonic()
    with pytest.raises(control.ControlError, match="died: 1: exit 9"):
        control.wait_keys(store, {0: "y/0", 1: "y/1"}, timeout=30, what="t", liveness=lambda: {1: "exit 9"}, poll=0.05)
    assert time.monotonic() - t0 < 10


def test_version_published_only_when_every_rank_completed(store):
    ctl = control.Controller(store, n_train=2, n_infer=1, timeout=1.0)
    t0, t1 = clients.TrainerClient(client(store), 0), clients.TrainerClient(client(store), 1)
    inf = clients.InferenceClient(client(store), 0)
    assert inf.version() == -1
    # rank 1 fails: the version must not move
    threading.Timer(0.05, lambda: (t0.done(1, ok=True), t1.done(1, ok=False, error="BoundsError: x"))).start()
    with pytest.raises(control.ControlError, match="training 1: BoundsError"):
        ctl.transfer(1)
    assert inf.version() is None and inf.state().state == "incomplete"
    # rank 1 silent: timeout names it, no complete version
    threading.Timer(0.05, lambda: t0.done(2, ok=True)).start()
    with pytest.raises(control.ControlError, match=r"\[1\]"):
        ctl.transfer(2)
    assert inf.version() is None and str(inf.state()) == "incomplete (the update to version 2 failed)"
    # both ok: published
    threading.Timer(0.05, lambda: (t0.done(3, ok=True), t1.done(3, ok=True))).start()
    secs, res = ctl.transfer(3)
    assert inf.version() == 3 and secs > 0 and set(res) == {0, 1}


def test_metadata_and_plan_roundtrip(store):
    from weight_transfer.types import DestTensorMeta, ParamMeta, RegionDescriptor

    ctl = control.Controller(store, n_train=1, n_infer=1, timeout=2)
    m = ParamMeta(name="w", global_shape=(4, 2), dtype="bfloat16", mesh_ranks=((0, 1), (2, 3)), placements=("Shard(dim=0)",),
                  local_offset=(0, 0), local_shape=(2, 2))
    d = RegionDescriptor(transport="cma", host="h", pid=7, addr=4096, length=16, key=3, epoch=1,
                         extra=(("epochs", (8192, 0, 5)), ("parts", ((0, 8), (8, 8)))))
    t = DestTensorMeta(rank=0, name="w", shape=(4, 2), dtype="bfloat16", offset=0, nbytes=16)
    clients.TrainerClient(client(store), 0).publish_meta([m])
    clients.InferenceClient(client(store), 0).publish_meta(d, [t])
    train, infer = ctl.collect()
    assert train == {0: [m]} and infer == {0: (d, [t])}
    assert isinstance(infer[0][0].extra[0][1], tuple) and isinstance(train[0][0].mesh_ranks[0], tuple)


def test_abort_reason_propagates(store):
    store.set("abort", b"inference rank 1 failed during setup: boom")
    with pytest.raises(control.ControlError, match="boom"):
        control.wait_keys(store, {0: "z/0"}, timeout=5, what="w", poll=0.05)


def test_trainer_sees_shutdown(store):
    tc = clients.TrainerClient(client(store), 0, timeout=5)
    store.set("shutdown", b"1")
    assert tc.next_command(7) == "shutdown"


# --------------------------------------------------------------------------------------------
# the version protocol (issue 15 items 1, 9; C14, C19)


def test_item9_versions_only_increase(store):
    """Publishing 3 after 4 is refused with a clear error; the state does not move back."""
    ctl = control.Controller(store, n_train=1, n_infer=1, timeout=1.0)
    ctl.begin(4)
    ctl.publish(4)
    with pytest.raises(control.VersionError, match="version 3 refused: the weights are complete version 4"):
        ctl.begin(3)
    with pytest.raises(control.VersionError, match="version 3 refused"):
        ctl.publish(3)
    with pytest.raises(control.VersionError, match="version 4 refused"):
        ctl.begin(4)
    with pytest.raises(control.VersionError, match="version 5 refused"):
        ctl.publish(5)  # never begun: nothing says its writes completed
    assert ctl.state().complete and ctl.state().version == 4 and int(store.get("version")) == 4


def test_c14_failed_update_never_leaves_the_old_number(store):
    """"writing v" before go; after a failure the state is incomplete (never the old complete
    version over changed bytes) and the legacy ``version`` key says -1; the next successful
    update publishes a complete version again."""
    ctl = control.Controller(store, n_train=1, n_infer=1, timeout=5.0)
    t0 = clients.TrainerClient(client(store), 0)
    inf = clients.InferenceClient(client(store), 0)
    threading.Timer(0.05, lambda: t0.done(1, ok=True)).start()
    ctl.transfer(1)
    assert inf.version() == 1
    seen = []

    def fail():
        seen.append(inf.state())  # "go" was set after "writing 2" was published
        t0.done(2, ok=False, error="RuntimeError: injected")
    threading.Timer(0.05, fail).start()
    with pytest.raises(control.ControlError, match="training 0: RuntimeError: injected"):
        ctl.transfer(2)
    assert seen[0].state == "writing" and seen[0].version == 2
    s = inf.state()
    assert s.state == "incomplete" and s.version == 2 and not s.complete
    assert inf.version() is None and int(store.get("version")) == -1
    threading.Timer(0.05, lambda: t0.done(3, ok=True)).start()
    ctl.transfer(3)
    assert inf.version() == 3 and inf.state().seq > s.seq


def test_c15_reported_failure_ends_the_wait_at_once(store):
    """A rank that reported failure ends the update in well under the timeout, named, even
    while another rank is still silent (blocked in a collective on the failed one)."""
    ctl = control.Controller(store, n_train=2, n_infer=1, timeout=30.0)
    t1 = clients.TrainerClient(client(store), 1)
    threading.Timer(0.05, lambda: t1.done(1, ok=False, error="RuntimeError: boom")).start()
    t = time.monotonic()
    with pytest.raises(control.ControlError, match="training 1: RuntimeError: boom"):
        ctl.transfer(1)
    assert time.monotonic() - t < 10


def test_c14_published_reason_is_the_culprit_whichever_wait_found_it(store):
    """The reason published with ``incomplete`` is the culprit ("training 1: ..."), the same
    whether the failure was seen while another rank was still writing (the wait finds
    ``step/N/failed``) or after every rank had reported (the results): it never depends on
    which poll won the race (CI on a no-AMX host saw ``step 4 transfer: training 0: ...``)."""
    ctl = control.Controller(store, n_train=2, n_infer=1, timeout=30.0)
    t0, t1 = clients.TrainerClient(client(store), 0), clients.TrainerClient(client(store), 1)
    inf = clients.InferenceClient(client(store), 0)
    reasons = []
    for step, report in ((1, lambda s: t1.done(s, ok=False, error="RuntimeError: boom")),   # rank 0 still writing
                         (2, lambda s: (t0.done(s, ok=True), t1.done(s, ok=False, error="RuntimeError: boom")))):
        threading.Timer(0.05, report, args=(step,)).start()
        with pytest.raises(control.ControlError, match=f"step {step}: update failed, weights marked incomplete: "
                                                       "training 1: RuntimeError: boom"):
            ctl.transfer(step)
        assert inf.state().state == "incomplete"
        reasons.append(store.get("weights/reason").decode())
    assert reasons == ["training 1: RuntimeError: boom"] * 2


def test_c15_dead_inference_rank_named_during_transfer(store):
    """A dead inference process ends a passive method's transfer at once, named as
    ``inference i``, ahead of the trainers' echo of it."""
    dead = {}
    ctl = control.Controller(store, n_train=1, n_infer=2, timeout=30.0, liveness_infer=lambda: dead)
    t0 = clients.TrainerClient(client(store), 0)

    def kill():  # the trainer's echo lands first, the reaping of the process a moment later
        t0.done(1, ok=False, error="RemoteGoneError: inference 1 (pid 4242) is gone")
        time.sleep(0.05)
        dead[1] = "process 4242 exited with code -9 (SIGKILL)"
    threading.Timer(0.05, kill).start()
    t = time.monotonic()
    with pytest.raises(control.ControlError, match=r"inference 1: process 4242 exited with code -9") as ei:
        ctl.transfer(1)
    assert time.monotonic() - t < 10 and "also: training 0" in str(ei.value)


def test_c16_stalled_rank_named_by_heartbeat(store):
    """A rank whose heartbeat stops (SIGSTOP) is named after ``stall`` seconds; the rank that
    keeps beating (blocked in a collective on it) is not blamed."""
    ctl = control.Controller(store, n_train=2, n_infer=1, timeout=30.0, stall=0.6)
    hb0 = control.Heartbeat(("127.0.0.1", store.port), "train0", period=0.1)
    hbi = control.Heartbeat(("127.0.0.1", store.port), "infer0", period=0.1)
    hb1 = control.Heartbeat(("127.0.0.1", store.port), "train1", period=0.1)
    threading.Timer(0.4, hb1.stop).start()  # rank 1 stops beating (as under SIGSTOP)
    try:
        t = time.monotonic()
        with pytest.raises(control.ControlError, match=r"training 1: no heartbeat for") as ei:
            ctl.transfer(1)
        assert time.monotonic() - t < 10 and "training 0" not in str(ei.value)
    finally:
        hb0.stop()
        hbi.stop()


def test_heartbeat_guard_fires_when_peer_stops(store):
    fired = []
    beat = control.Heartbeat(("127.0.0.1", store.port), "controller", period=0.05)
    hb = control.Heartbeat(("127.0.0.1", store.port), "train0", period=0.05, watch="controller", stall=0.5,
                           on_stall=fired.append)
    time.sleep(0.8)
    assert not fired
    beat.stop()
    t = time.monotonic()
    while not fired and time.monotonic() - t < 5:
        time.sleep(0.05)
    hb.stop()
    assert fired and "controller: no heartbeat" in fired[0]


def test_c19_waiter_for_skipped_or_failed_version_gets_an_answer(store):
    ctl = control.Controller(store, n_train=1, n_infer=1, timeout=1.0)
    inf = clients.InferenceClient(client(store), 0, timeout=30)
    ctl.begin(2)
    ctl.publish(2)
    assert inf.wait_version(2).version == 2
    ctl.begin(4)  # 3 is skipped
    t = time.monotonic()
    with pytest.raises(control.VersionError, match="version 3 was skipped"):
        inf.wait_version(3)
    ctl.mark_incomplete(4, "training 1: RuntimeError: boom")
    with pytest.raises(control.ControlError, match="update to version 4 failed.*training 1: RuntimeError: boom"):
        inf.wait_version(4)
    with pytest.raises(control.ControlError, match="version 9 not published within"):
        inf.wait_version(9, timeout=0.2)
    assert time.monotonic() - t < 10


def test_c22_commit_after_every_write_and_before_publish(store):
    """An engine with staged targets commits each update: the controller asks for the commit
    only after every trainer completed, publishes only after every commit rank reported, and a
    failed commit leaves the version incomplete, naming the rank."""
    ctl = control.Controller(store, n_train=1, n_infer=2, timeout=5.0)
    t0 = clients.TrainerClient(client(store), 0)
    infs = [clients.InferenceClient(client(store), i) for i in range(2)]
    seen = []

    def commit_side(i, step, ok=True):
        assert infs[i].wait_commit(step)
        seen.append((i, store.check([f"step/{step}/done/0"]), infs[i].state().state))
        infs[i].committed(step, ok=ok, error="" if ok else "RuntimeError: commit of staged layer x failed",
                          stats={"seconds": 0.01, "layers": 3, "bytes": 64})

    ths = [threading.Thread(target=commit_side, args=(i, 1)) for i in range(2)]
    for th in ths:
        th.start()
    threading.Timer(0.1, lambda: t0.done(1, ok=True)).start()
    secs, res = ctl.transfer(1, commit_ranks=(0, 1))
    for th in ths:
        th.join()
    # each commit started after the trainer's done and while the version was still being written
    assert sorted(seen) == [(0, True, "writing"), (1, True, "writing")]
    assert infs[0].state().complete and infs[0].version() == 1
    assert res[("commit", 1)]["stats"]["layers"] == 3
    assert ctl.last_write_seconds <= secs
    # a failed commit: incomplete, named
    th = threading.Thread(target=commit_side, args=(1, 2, False))
    th.start()
    threading.Thread(target=commit_side, args=(0, 2)).start()
    threading.Timer(0.05, lambda: t0.done(2, ok=True)).start()
    with pytest.raises(control.ControlError, match="inference 1: commit failed: RuntimeError"):
        ctl.transfer(2, commit_ranks=(0, 1))
    th.join()
    assert infs[0].state().state == "incomplete" and infs[0].version() is None


def test_c22_no_commit_when_a_trainer_failed(store):
    """A trainer's failure ends the update before any commit is asked for."""
    ctl = control.Controller(store, n_train=1, n_infer=1, timeout=2.0)
    t0 = clients.TrainerClient(client(store), 0)
    threading.Timer(0.05, lambda: t0.done(1, ok=False, error="BoundsError: y")).start()
    with pytest.raises(control.ControlError, match="training 0: BoundsError"):
        ctl.transfer(1, commit_ranks=(0,))
    assert not store.check(["step/1/commit"])
    store.set("shutdown", b"1")
    assert clients.InferenceClient(client(store), 0).wait_commit(1) is False
