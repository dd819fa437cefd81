"""The vLLM instance's side of the one_sided backend's commit point in the harness
(``experiments/vllm_side.py``), without vLLM: a real control-plane store and a stand-in for
vLLM's four-call client (``VLLMWeightSyncClient``) that records the calls and raises where told.

What must hold: the commit point is seen as commit / failed / shutdown; a worker whose
``update_weights`` refused before reporting is reported failed in the store (so the controller
fails the update naming that rank, at once, instead of waiting for its timeout) while a rank
that reported keeps its own report; vLLM's weight version is ``str(v)`` after a commit and the
incomplete label after a failure, also when vLLM already closed the update session.
"""
import pytest

from weight_transfer.control import clients
from weight_transfer.control import protocol as control
from weight_transfer.control import store as store_api
from weight_transfer.experiments import vllm_side


class FakeClient:
    """Records each call; ``refuse``: ``update_weights`` raises it; ``closed_on_refusal``: after a
    refusal ``finish_weight_update`` raises until a new ``start_weight_update`` (vLLM's worker
    closes the session when ``update_weights`` raises)."""

    def __init__(self, refuse: Exception | None = None, closed_on_refusal: bool = False):
        self.calls: list[tuple] = []
        self.refuse, self.closed_on_refusal = refuse, closed_on_refusal
        self.active = True

    def start_weight_update(self):
        self.calls.append(("start",))
        self.active = True

    def update_weights(self, info):
        self.calls.append(("update", info))
        if self.refuse is not None:
            if self.closed_on_refusal:
                self.active = False
            raise self.refuse

    def finish_weight_update(self, weight_version=None):
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.calls.append(("finish", weight_version))
        self.active = False


@pytest.fixture()
def store():
    s = store_api.make_store("127.0.0.1", 0, is_master=True, timeout=10.0)
    yield s


def test_commit_sets_the_version(store):
    c = FakeClient()
    assert vllm_side._commit_through_backend(c, store, 3, [0, 1], 0, "incomplete:3")
    assert c.calls == [("update", {"version": 3}), ("finish", "3")]
    assert not store.check(["step/3/committed/0"]) and not store.check(["step/3/failed"])  # the workers report


def test_a_refusing_worker_is_reported_failed_and_labelled_incomplete(store):
    clients.InferenceClient(store, 0).committed(3, ok=True, stats={"seconds": 0.0})   # worker 0 reported
    c = FakeClient(refuse=RuntimeError("inference 1: update_weights(version=3) refused: training 1 failed"),
                   closed_on_refusal=True)
    assert not vllm_side._commit_through_backend(c, store, 3, [0, 1], 0, "incomplete:3")
    assert control.get(store, "step/3/committed/0")["ok"] is True                    # its own report kept
    r1 = control.get(store, "step/3/committed/1")
    assert r1["ok"] is False and "training 1 failed" in r1["error"] and r1["error"].startswith("update_weights failed")
    assert store.check(["step/3/failed"])
    # the session was closed by the refusal: a new one is opened only to set the label
    assert c.calls[-2:] == [("start",), ("finish", "incomplete:3")]
    assert ("finish", "3") not in c.calls


def test_label_when_the_session_is_still_open(store):
    c = FakeClient()
    vllm_side._label(c, "incomplete:5", 0)
    assert c.calls == [("finish", "incomplete:5")]


def test_commit_point_commit_failed_shutdown(store):
    ctl = control.Controller(store, 1, 1, timeout=10.0)
    store.set("step/1/commit", b"1")
    assert vllm_side._wait_commit_or_failed(store, 1) == "commit"
    ctl.begin(2)
    ctl.mark_incomplete(2, "training 0: boom")
    assert vllm_side._wait_commit_or_failed(store, 2) == "failed"
    store.set("shutdown", b"1")
    assert vllm_side._wait_commit_or_failed(store, 3) == "shutdown"
