"""Case C24: inference engines that come and go between updates (weight_transfer.control.membership,
the Coordinator's replanning, the Sender's plan epochs, the Receiver's per-rank version).

2 receivers in processes of their own, a 1-rank trainer and the coordinator in this process:
receiver 1 is killed before update 3 (that update fails, named, incomplete; the trainer keeps
its pid), update 4 completes on the survivor after a replan, a replacement for rank 1 with
fresh memory joins before update 5 and its first version is complete and bit-exact; a third
receiver joins and leaves (scale 2 -> 3 -> 2). Every completed update is verified in every
receiver holding it against the engine's own load_weights."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

import weight_transfer as wt
from weight_transfer.control import membership
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.testing.weights import SyntheticCheckpoint

CFG = load_config("qwen3-0.6b", num_hidden_layers=1, vocab_size=1024)
LAYOUT = wt.InferenceLayout(tp=1, dp=3)  # room for 3 replicas; the members are a subset


def _weights(step: int) -> dict[str, torch.Tensor]:
    ck = SyntheticCheckpoint(param_specs(CFG), step=step, seed=7)
    return {n: ck[n].clone() for n in ck.names()}


def receiver_main(rank: int, addr, versions: list[int]) -> None:
    """Register a fresh engine, then verify each version in ``versions`` once this rank holds it;
    report ``ok/{rank}/{v}``; stop at ``stop/{rank}``."""
    from weight_transfer.engines import Engine, expected_from_checkpoint

    torch.set_num_threads(1)
    store = wt.connect_store(addr)
    engine = Engine(CFG, LAYOUT, rank)
    engine.arena.fill_(0x5A)
    rx = wt.Receiver.from_arena(engine.arena, engine.tensor_metas(), rank=rank, store=store)
    store.set(f"up/{rank}/{os.getpid()}", b"1")
    assert rx.version() in (-1, None) or rx.state().state == "none"
    for v in versions:
        rx.wait_version(v, timeout=120)
        _, got = rx.read_consistent(lambda: {n: t.clone() for n, t in engine.named_parameters().items()})
        w = _weights(v)
        want = expected_from_checkpoint(CFG, LAYOUT, rank, w.__getitem__, list(w)).named_parameters()
        ok = all(torch.equal(t.view(-1).view(torch.uint8), want[n].view(-1).view(torch.uint8)) for n, t in got.items())
        store.set(f"ok/{rank}/{v}", b"1" if ok else b"0")
    store.wait([f"stop/{rank}"])
    rx.close()


@pytest.mark.multiproc
def test_c24_engine_dies_a_replacement_joins_and_the_fleet_scales(tmp_path):
    store = wt.serve_store("127.0.0.1", 0)
    addr = ("127.0.0.1", store.port)
    ctx = mp.get_context("spawn")

    def start(rank, versions):
        p = ctx.Process(target=receiver_main, args=(rank, addr, versions), daemon=True)
        p.start()
        return p

    r0 = start(0, [1, 2, 4, 5, 6, 7])
    r1 = start(1, [1, 2])
    coord = wt.Coordinator(addr, n_train=1, n_infer=2, model_config=CFG, layout=LAYOUT, timeout=30)
    params = _weights(1)
    tx = wt.Sender(params, rank=0, world_size=1, store=addr, coordinator=coord)
    trainer_pid = os.getpid()

    def step(v):
        new = _weights(v)
        for n, t in params.items():
            t.copy_(new[n])
        return tx.push(v)

    def ok(rank, v):
        store.wait([f"ok/{rank}/{v}"])
        return store.get(f"ok/{rank}/{v}") == b"1"

    for v in (1, 2):
        step(v)
        assert ok(0, v) and ok(1, v)
    os.kill(r1.pid, signal.SIGKILL)  # engine 1 dies between updates 2 and 3 ...
    r1.join(10)
    step(3)  # ... and is found gone before the go of update 3: planned without it, no failure at all
    assert coord.replans[-1]["gone"] == [1] and coord.members == {0}
    step(4)
    assert ok(0, 4)
    r1b = start(1, [5, 6])  # a replacement with fresh memory joins
    while membership.new_joins(store, coord._joins_seen)[0] == []:
        pass
    step(5)
    assert coord.replans[-1]["joined"] == [1] and coord.members == {0, 1}
    assert ok(0, 5) and ok(1, 5)  # the newcomer's first version: complete and bit-exact
    assert membership.member_since(store, 1) == 5
    r2 = start(2, [6])  # scale 2 -> 3
    while membership.new_joins(store, coord._joins_seen)[0] == []:
        pass
    step(6)
    assert coord.members == {0, 1, 2} and ok(0, 6) and ok(1, 6) and ok(2, 6)
    store.set("stop/2", b"1")  # 3 -> 2: receiver 2 leaves
    r2.join(30)
    step(7)
    assert coord.members == {0, 1} and coord.replans[-1]["gone"] == [2] and ok(0, 7)
    assert os.getpid() == trainer_pid and [r["epoch"] for r in coord.replans] == [1, 2, 3, 4]
    for r in (0, 1):
        store.set(f"stop/{r}", b"1")
    for p in (r0, r1b):
        p.join(30)
        assert p.exitcode == 0
    tx.close()


@pytest.mark.multiproc
def test_c24_an_engine_killed_mid_update_fails_that_update_named_and_the_next_completes():
    store = wt.serve_store("127.0.0.1", 0)
    addr = ("127.0.0.1", store.port)
    ctx = mp.get_context("spawn")
    r0 = ctx.Process(target=receiver_main, args=(0, addr, [1, 3]), daemon=True)
    r1 = ctx.Process(target=receiver_main, args=(1, addr, [1]), daemon=True)
    r0.start()
    r1.start()
    coord = wt.Coordinator(addr, n_train=1, n_infer=2, model_config=CFG, layout=LAYOUT, timeout=30)
    params = _weights(1)
    tx = wt.Sender(params, rank=0, world_size=1, store=addr, coordinator=coord)
    tx.push(1)
    store.wait(["ok/0/1", "ok/1/1"])
    tx.plan()
    real = tx.executor.run

    def dies_midway(step=None, cancel=None):  # engine 1 dies after the go, while the update writes
        os.kill(r1.pid, signal.SIGKILL)
        r1.join(10)
        return real(step, cancel=cancel)
    tx.executor.run = dies_midway
    new = _weights(2)
    for n, t in params.items():
        t.copy_(new[n])
    with pytest.raises(wt.ControlError, match=r"inference rank\(s\) \[1\] gone") as err:
        tx.push(2)
    assert "inference 1: process" in str(err.value) and "is gone" in str(err.value)  # the root cause, named
    assert coord.state().state == "incomplete"
    new = _weights(3)
    for n, t in params.items():
        t.copy_(new[n])
    tx.push(3)  # the dead engine is dropped before the go; the survivor's update completes
    store.wait(["ok/0/3"])
    assert coord.members == {0} and store.get("ok/0/3") == b"1"
    store.set("stop/0", b"1")
    r0.join(30)
    assert r0.exitcode == 0
    tx.close()


def test_change_members_keys_epoch_and_the_empty_membership_error():
    """membership.change_members on its own (the Coordinator's and the fleet's replan share it):
    the new members and payloads, the plan called with them and the next epoch, member keys
    dropped/set, plan/epoch, ctl.n_infer grown; no member left: ControlError before any key."""
    import torch.distributed as dist

    store = dist.HashStore()
    for r in (0, 1):
        membership.set_member(store, r, 0)

    class Ctl:
        n_infer = 2
    ctl, calls = Ctl(), []

    def plan(payloads, epoch):
        calls.append((dict(payloads), epoch))
        return "sched", {"commit_ranks": ()}
    ch = membership.change_members(store, ctl, members={0, 1}, payloads={0: "p0", 1: "p1"}, gone={1},
                                   added={3: "p3"}, plan=plan, epoch=2, version=7, where="version 7")
    assert calls == [({0: "p0", 3: "p3"}, 3)]
    assert (ch.members, ch.payloads, ch.schedule, ch.epoch, ch.dropped) == ({0, 3}, {0: "p0", 3: "p3"}, "sched", 3, {1})
    assert ch.seconds >= 0 and ctl.n_infer == 4 and store.get(membership.EPOCH_KEY) == b"3"
    assert [membership.member_since(store, r) for r in (0, 1, 3)] == [0, None, 7]
    # a member that re-registered (gone and added): its fresh payload, kept a member from the version
    ch = membership.change_members(store, ctl, members={0, 3}, payloads=ch.payloads, gone={3}, added={3: "q3"},
                                   plan=plan, epoch=3, version=8, where="version 8")
    assert ch.payloads == {0: "p0", 3: "q3"} and ch.dropped == set() and membership.member_since(store, 3) == 8
    with pytest.raises(wt.ControlError, match=r"^update 9: no inference rank left \(gone: \[0, 3\]\)$"):
        membership.change_members(store, ctl, members={0, 3}, payloads=ch.payloads, gone={0, 3}, added={},
                                  plan=plan, epoch=4, version=9, where="update 9")
    assert len(calls) == 2 and store.get(membership.EPOCH_KEY) == b"4" and membership.member_since(store, 0) == 0
