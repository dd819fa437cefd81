"""Shadow targets (reference/api/shadow.py, C27): the double buffer and the copy shadow, the
controller's shadow protocol, the receiver's go-live server."""
import threading
import time

import pytest
import torch

from weight_transfer.api.shadow import GUARD_BYTE, GoLiveServer, Shadow, check_mode
from weight_transfer.control import clients
from weight_transfer.control import protocol as control
from weight_transfer.control import store as store_api
from weight_transfer.types import DestTensorMeta


@pytest.fixture()
def store():
    return store_api.make_store("127.0.0.1", 0, is_master=True, timeout=10)


def client(store):
    return store_api.make_store("127.0.0.1", store.port, is_master=False, timeout=10)


def _arena():
    arena = torch.arange(1000, dtype=torch.int32).view(torch.uint8)[:1000].clone()
    metas = [DestTensorMeta(rank=0, name="a", shape=(100,), dtype="uint8", offset=0, nbytes=100),
             DestTensorMeta(rank=0, name="b", shape=(50,), dtype="float32", offset=128, nbytes=200)]
    return arena, metas


def test_flip_moves_the_engine_into_half_a_and_each_go_live_swaps_halves():
    arena, metas = _arena()
    seen = []
    sh = Shadow.of_arena("flip", arena, metas, adopt=seen.append)
    assert torch.equal(seen[-1], arena) and seen[-1].data_ptr() == sh.region.data_ptr()  # half A, same bytes
    assert sh.shift == sh.stride and sh.stride >= arena.numel() + 64  # the next update writes half B
    b = sh.region[sh.shift:sh.shift + arena.numel()]
    b[0:100].fill_(7)
    b[128:328].fill_(9)
    stats = sh.go_live()
    assert stats["mode"] == "flip" and stats["bytes"] == 0
    assert seen[-1].data_ptr() == b.data_ptr() and int(seen[-1][0]) == 7 and int(seen[-1][200]) == 9
    assert torch.equal(seen[-1][100:128], arena[100:128])  # bytes between tensors: the engine's own, both halves
    assert sh.shift == 0 and sh.live_index == 1 and sh.info()["golives"] == 1
    assert sh.guard_damage() == []
    sh._buffer[64 + arena.numel() + 3] = 0  # a write that strayed between the halves
    assert sh.guard_damage() == [("between", 1)]


def test_copy_writes_each_tensor_shadow_to_live_and_never_the_bytes_between():
    arena, metas = _arena()
    before = arena.clone()
    sh = Shadow.of_arena("copy", arena, metas)
    assert sh.shift == 0 and sh.region.data_ptr() != arena.data_ptr() and sh.extra_bytes >= arena.numel()
    assert int(sh.region.sum()) == 0  # zeroed: every update writes every destination byte
    sh.region.fill_(3)
    assert torch.equal(arena, before)  # nothing live moves before the go-live
    stats = sh.go_live()
    assert stats["bytes"] == 300
    assert (arena[:100] == 3).all() and (arena[128:328] == 3).all()
    assert torch.equal(arena[100:128], before[100:128]) and torch.equal(arena[328:], before[328:])


def test_of_tensors_compact_layout_flip_and_copy():
    t = {"x": torch.ones(10), "y": torch.zeros(3, dtype=torch.bfloat16)}
    sh = Shadow.of_tensors("copy", t, rank=2)
    assert [m.rank for m in sh.metas] == [2, 2] and all(m.offset % 64 == 0 for m in sh.metas)
    sh.views(0)["x"].fill_(5)
    sh.go_live()
    assert torch.equal(t["x"], torch.full((10,), 5.0))
    adopted = []
    fl = Shadow.of_tensors("flip", {"w": torch.arange(4.0)}, adopt=adopted.append)
    assert torch.equal(adopted[-1]["w"], torch.arange(4.0))
    fl.views(fl.shadow_index)["w"].fill_(1)
    fl.go_live()
    assert torch.equal(adopted[-1]["w"], torch.ones(4))


def test_bad_modes_and_arguments_are_refused():
    assert check_mode("off") is None and check_mode(None) is None and check_mode("copy") == "copy"
    with pytest.raises(ValueError, match="shadow mode 'swap'"):
        check_mode("swap")
    arena, metas = _arena()
    with pytest.raises(ValueError, match="needs adopt"):
        Shadow.of_arena("flip", arena, metas)
    with pytest.raises(ValueError, match="not contiguous"):
        Shadow.of_tensors("copy", {"x": torch.ones(4, 4).t()})


def test_controller_shadow_protocol_keeps_the_served_version_complete(store):
    """With shadow targets: ``begin`` leaves ``complete v-1`` readable, a failure before the
    go-live keeps it complete (not incomplete) and the failed version is never reused, the
    commit (go-live) comes before ``complete v``, the flip shift is handed to the trainers."""
    ctl = control.Controller(store, n_train=1, n_infer=1, timeout=10.0)
    ctl.shadow = {0: {"mode": "flip", "shift": 4096}}
    control.put(store, control.SHADOW_KEY.format(rank=0), {"mode": "flip", "stride": 4096, "shift": 4096,
                                                           "live_index": 0, "extra_bytes": 4096, "golives": 0})
    t0, inf = clients.TrainerClient(client(store), 0), clients.InferenceClient(client(store), 0)

    def ok_and_commit(step):
        assert inf.state().state != "writing"  # readers never see "writing" with shadows
        t0.done(step, ok=True)
        assert inf.wait_commit(step)
        inf.committed(step, ok=True, stats={"seconds": 0.001})
    threading.Timer(0.05, ok_and_commit, args=(1,)).start()
    ctl.transfer(1, commit_ranks=(0,))
    assert str(inf.state()) == "complete version 1" and control.get(store, "step/1/shift") == {0: 4096}
    threading.Timer(0.05, lambda: t0.done(2, ok=False, error="RuntimeError: boom")).start()
    with pytest.raises(control.ControlError, match="before any go-live, nothing live was touched .*complete version 1"):
        ctl.transfer(2, commit_ranks=(0,))
    s = inf.state()
    assert s.state == "complete" and s.version == 1
    with pytest.raises(control.VersionError, match="version 2 was attempted"):
        ctl.transfer(2, commit_ranks=(0,))
    threading.Timer(0.05, ok_and_commit, args=(3,)).start()
    ctl.transfer(3, commit_ranks=(0,))
    assert inf.state().version == 3 and inf.state().complete


def test_a_failed_go_live_is_incomplete(store):
    ctl = control.Controller(store, n_train=1, n_infer=1, timeout=10.0)
    ctl.shadow = {0: {"mode": "copy", "shift": 0}}
    t0, inf = clients.TrainerClient(client(store), 0), clients.InferenceClient(client(store), 0)

    def fail_commit():
        t0.done(1, ok=True)
        inf.wait_commit(1)
        inf.committed(1, ok=False, error="go-live failed: boom")
    threading.Timer(0.05, fail_commit).start()
    with pytest.raises(control.ControlError, match="weights marked incomplete"):
        ctl.transfer(1, commit_ranks=(0,))
    assert inf.state().state == "incomplete"


def test_go_live_server_holds_the_engine_lock_and_labels_inside_it():
    """The server's go-live waits for the step in progress (the engine's lock) and changes the
    label inside the same window."""
    class Rx:
        rank, live_version = 0, -1
        store = type("S", (), {"check": staticmethod(lambda keys: False)})()
        asked = 1

        def commit_requested(self):
            return self.asked if self.asked > self.live_version else None

        def go_live(self, v, then=None):
            self.live_version = v
            then(v, {"mode": "copy", "seconds": 0.0, "bytes": 0})
            return {"mode": "copy", "seconds": 0.0, "bytes": 0}
    lock, labels = threading.Lock(), []
    with lock:  # a step in progress
        srv = GoLiveServer(Rx(), lock, lambda v, st: labels.append((v, time.time())), poll=0.001)
        time.sleep(0.05)
        t_step_end = time.time()
    time.sleep(0.05)
    srv.stop()
    assert labels and labels[0][0] == 1 and labels[0][1] >= t_step_end
    assert srv.golives[0]["t0"] >= t_step_end


def test_guard_byte_is_not_a_value_the_tests_write():
    assert GUARD_BYTE not in (0, 3, 7, 9, 0xA5)
