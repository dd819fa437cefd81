"""Store protocol of the control plane (in one process, real TCPStore over loopback)."""
import threading
import time

import pytest

from reference import control


@pytest.fixture()
def store():
    s = control.make_store("127.0.0.1", 0, is_master=True, timeout=10)
    yield s


def client(store):
    return control.make_store("127.0.0.1", store.port, is_master=False, timeout=10)


def test_timeout_names_missing_ranks(store):
    store.set("x/0", b"1")
    with pytest.raises(control.ControlError, match=r"rank\(s\) \[1, 2\]"):
        control.wait_keys(store, {0: "x/0", 1: "x/1", 2: "x/2"}, timeout=0.3, what="test")


def test_dead_rank_named_at_once(store):
    t0 = time.monotonic()
    with pytest.raises(control.ControlError, match="died: 1: exit 9"):
        control.wait_keys(store, {0: "y/0", 1: "y/1"}, timeout=30, what="t", liveness=lambda: {1: "exit 9"}, poll=0.05)
    assert time.monotonic() - t0 < 5


def test_version_published_only_when_every_rank_completed(store):
    ctl = control.Controller(store, n_train=2, n_infer=1, timeout=1.0)
    t0, t1 = control.TrainerClient(client(store), 0), control.TrainerClient(client(store), 1)
    inf = control.InferenceClient(client(store), 0)
    assert inf.version() == -1
    # rank 1 fails: the version must not move
    threading.Timer(0.05, lambda: (t0.done(1, ok=True), t1.done(1, ok=False, error="BoundsError: x"))).start()
    with pytest.raises(control.ControlError, match="training 1: BoundsError"):
        ctl.transfer(1)
    assert inf.version() == -1
    # rank 1 silent: timeout names it, version unchanged
    threading.Timer(0.05, lambda: t0.done(2, ok=True)).start()
    with pytest.raises(control.ControlError, match=r"\[1\]"):
        ctl.transfer(2)
    assert inf.version() == -1
    # both ok: published
    threading.Timer(0.05, lambda: (t0.done(3, ok=True), t1.done(3, ok=True))).start()
    secs, res = ctl.transfer(3)
    assert inf.version() == 3 and secs > 0 and set(res) == {0, 1}


def test_metadata_and_plan_roundtrip(store):
    ctl = control.Controller(store, n_train=1, n_infer=1, timeout=2)
    control.TrainerClient(client(store), 0).publish_meta(["m"])
    control.InferenceClient(client(store), 0).publish_meta("desc", ["t"])
    train, infer = ctl.collect()
    assert train == {0: ["m"]} and infer == {0: ("desc", ["t"])}


def test_abort_reason_propagates(store):
    store.set("abort", b"inference rank 1 failed during setup: boom")
    with pytest.raises(control.ControlError, match="boom"):
        control.wait_keys(store, {0: "z/0"}, timeout=5, what="w", poll=0.05)


def test_trainer_sees_shutdown(store):
    tc = control.TrainerClient(client(store), 0, timeout=5)
    store.set("shutdown", b"1")
    assert tc.next_command(7) == "shutdown"
