"""Versions and failures (issue 15; shared/CASES.md C13-C16, C19): readers never obtain torn
weights under a complete version, a failed update is marked incomplete and the next one
restores, any rank's failure ends the update fast and names it, a stopped rank is named after
its deadline, and nothing is left running. In-process where possible (tests/helpers/loopback.py: the
real planner, executor and CMA writes into this process's engines); the multi-process ones
inject faults with weight_transfer.experiments.faults (in-process raises, real SIGKILL / SIGSTOP)."""
import os
import threading
import time

import pytest
import torch

from tests.helpers.loopback import Loopback
from weight_transfer.control import clients
from weight_transfer.control import protocol as control
from weight_transfer.control import store as store_api
from weight_transfer.engines import UpdateInProgress, expected_from_checkpoint
from weight_transfer.engines.engine import GUARD, GUARD_BYTE
from weight_transfer.experiments.faults import Fault
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.testing.weights import SyntheticCheckpoint
from weight_transfer.types import InferenceLayout

SMALL = dict(num_hidden_layers=1, vocab_size=512, hidden_size=256, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def ckpt(cfg, step):
    return {n: t for n, t in SyntheticCheckpoint(param_specs(cfg), step=step, seed=0)}


@pytest.fixture()
def store():
    return store_api.make_store("127.0.0.1", 0, is_master=True, timeout=10)


def client(store):
    return store_api.make_store("127.0.0.1", store.port, is_master=False, timeout=10)


def test_c13_reader_never_gets_a_mixed_set_under_a_complete_version(store):
    """Updates written in place by real one-sided writes (CMA) while a reader copies every
    destination byte of rank 0 under the seqlock protocol: every read it gets equals one
    version exactly; during updates it is told "update in progress"."""
    cfg = load_config("qwen3-0.6b", **SMALL)
    lb = Loopback(cfg, InferenceLayout(tp=2))
    ctl = control.Controller(store, n_train=1, n_infer=2, timeout=5)
    inf = clients.InferenceClient(client(store), 0)
    sources = {v: ckpt(cfg, v) for v in (1, 2, 3, 4)}
    ctl.begin(1)
    lb.transfer(sources[1])
    ctl.publish(1)
    expected = {v: expected_from_checkpoint(cfg, InferenceLayout(tp=2), 0, src.__getitem__, list(src)).arena.clone()
                for v, src in sources.items()}
    assert torch.equal(lb.engines[0].arena, expected[1])
    eng = lb.engines[0]
    stop = threading.Event()
    got, busy, torn = [], [0], []

    def reader():
        while not stop.is_set():
            try:
                s, t = eng.read_weights(inf.state, wait=False)
            except UpdateInProgress as e:
                assert not e.state.complete
                busy[0] += 1
                continue
            flat = torch.cat([x.contiguous().view(-1).view(torch.uint8) for x in t.values()])
            ref = torch.cat([x.contiguous().view(-1).view(torch.uint8)
                             for x in lb2_views(expected[s.version], eng).values()])
            (got if torch.equal(flat, ref) else torn).append(s.version)

    th = threading.Thread(target=reader)
    th.start()
    try:
        for v in (2, 3, 4):
            ctl.begin(v)
            lb.transfer(sources[v])
            time.sleep(0.05)  # the reader keeps reading while "writing" is up
            ctl.publish(v)
            time.sleep(0.05)
    finally:
        stop.set()
        th.join()
    assert not torn, f"mixed sets read under a complete version: {torn[:5]}"
    assert busy[0] > 0 and len(set(got)) >= 2, (busy, sorted(set(got)))


def lb2_views(arena, eng):
    """``eng``'s parameter views laid over another arena of the same layout."""
    return {m.name: arena[m.offset:m.offset + m.nbytes] for m in eng.tensor_metas()}


def test_c13_naive_version_check_is_not_enough(store):
    """What issue 15 item 2 saw: with the version read before and after, an in-place update
    in between is invisible unless the state moves first. Under the protocol the state read
    after differs from the one before (seq moved), so the seqlock retries."""
    ctl = control.Controller(store, n_train=1, n_infer=1, timeout=5)
    inf = clients.InferenceClient(client(store), 0)
    ctl.begin(1)
    ctl.publish(1)
    before = inf.state()
    ctl.begin(2)  # an update starts while the reader reads
    assert inf.state() != before and not inf.state().complete and inf.version() is None


def test_item8_guard_bytes_around_the_region_are_checked():
    """Bytes just outside the registered region hold a guard pattern; a stray write there
    fails verification (before: the gap check was vacuous on the default arenas)."""
    from weight_transfer.experiments.verify import verify_engine

    cfg = load_config("qwen3-0.6b", **SMALL)
    lb = Loopback(cfg, InferenceLayout(tp=2))
    src = ckpt(cfg, 1)
    lb.transfer(src)
    eng = lb.engines[1]
    ok = verify_engine(eng, cfg, InferenceLayout(tp=2), 1, step=1, seed=0)
    assert ok["ok"] and eng.guard_damage() == []
    buf = eng._buffer
    assert buf.numel() == eng.arena.numel() + 2 * GUARD
    assert eng.arena.data_ptr() == buf.data_ptr() + GUARD
    buf[GUARD + eng.arena.numel()] = 0  # one byte past the region's end
    buf[GUARD - 3] = 7  # three bytes before its start
    bad = verify_engine(eng, cfg, InferenceLayout(tp=2), 1, step=1, seed=0)
    assert not bad["ok"] and bad["guards_written"] == [("before", 1, 2), ("after", 1, 0)]
    buf[GUARD + eng.arena.numel()] = GUARD_BYTE
    buf[GUARD - 3] = GUARD_BYTE
    assert eng.guard_damage() == []


def test_c14_in_process_failed_update_marked_incomplete_then_restored(store):
    """A sender fails after some of its writes of version 2: the bytes are a mix, the state
    says incomplete (never "complete 1"); version 3 then restores every byte."""
    cfg = load_config("qwen3-0.6b", **SMALL)
    lb = Loopback(cfg, InferenceLayout(tp=2))
    ctl = control.Controller(store, n_train=1, n_infer=2, timeout=5)
    inf = clients.InferenceClient(client(store), 0)
    ctl.begin(1)
    lb.transfer(ckpt(cfg, 1))
    ctl.publish(1)
    real_write, calls = lb.tx.write, [0]

    def failing(ops):
        calls[0] += 1
        if calls[0] > 5:
            raise RuntimeError("injected: sender died")
        return real_write(ops)

    lb.tx.write = failing
    ctl.begin(2)
    with pytest.raises(RuntimeError, match="injected"):
        lb.transfer(ckpt(cfg, 2))
    ctl.mark_incomplete(2, "training 0: RuntimeError: injected")
    bad = lb.verify(ckpt(cfg, 1))
    assert bad and lb.verify(ckpt(cfg, 2)), "the failed update changed some tensors, not all"
    s = inf.state()
    assert s.state == "incomplete" and inf.version() is None
    with pytest.raises(UpdateInProgress):
        lb.engines[0].read_weights(inf.state, wait=False)
    lb.tx.write = real_write
    ctl.begin(3)
    lb.transfer(ckpt(cfg, 3))
    ctl.publish(3)
    assert lb.verify(ckpt(cfg, 3)) == [] and inf.version() == 3


# --------------------------------------------------------------------------------------------
# multi-process: real ranks, injected faults


BOUND = 5.0
"""Seconds from a fault to the named error: the target is 2 s (docs/FAULTS.md measures 0.03-0.5 s);
the slack is for a loaded CI machine, where the injected fault itself (a watcher thread in the
target) may wait for a core."""


def trial_cfg(**kw):
    from weight_transfer.experiments.faults import small_config

    base = dict(steps=2, warmup=0, timeout=180.0)
    base.update(kw)
    return small_config(**base)


def live_children() -> list[int]:
    """Processes whose parent is this one, not zombies (multiprocessing's resource tracker,
    started once per interpreter by the spawn context, is not a rank)."""
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                try:
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        if b"resource_tracker" in f.read():
                            continue
                except OSError:
                    continue
                out.append(int(d))
    return out


@pytest.mark.multiproc
def test_c14_c15_training_rank_raises_midway():
    """Issue 15 items 1 and 4: training rank 1 raises after half of its writes of update 2.
    The update ends within seconds naming ``training 1`` and its cause (not rank 0, blocked
    in a collective on it); the weights are marked incomplete (not "complete 1"); the
    training world is restarted and update 3 restores a complete version bit-exactly."""
    from weight_transfer.experiments.trial import run_trial

    probe, seen = {}, []
    run_trial(trial_cfg(steps=3), progress=seen.append, fault=Fault.parse("raise:train:1:middle:2"), stall=10,
              restarts=1, probe=probe)
    assert "training 1: RuntimeError: rank 1: stage write" in probe["error"] and "InjectedFault" in probe["error"]
    assert probe["t_error"] - probe["fired"] < BOUND
    assert probe["state_after_fault"] == "incomplete v2"
    assert [(r["step"], r["verified"]) for r in seen] == [(1, True), (3, True)]
    assert live_children() == []


@pytest.mark.multiproc
def test_c15_inference_rank_killed_midway():
    """Issue 15 item 3: inference rank 0 is SIGKILLed mid-update. The update ends within
    seconds naming ``inference 0`` (not a pid, not a training rank in Gloo); weights are
    marked incomplete; every process is gone."""
    from weight_transfer.experiments.trial import run_trial

    probe = {}
    with pytest.raises(control.ControlError, match=r"inference 0: process \d+ exited with code -9 \(SIGKILL\)"):
        run_trial(trial_cfg(), fault=Fault.parse("kill:infer:0:middle:2"), stall=10, probe=probe)
    assert probe["t_error"] - probe["fired"] < BOUND
    assert probe["state_after_fault"] == "incomplete v2"
    assert live_children() == []


@pytest.mark.multiproc
def test_c16_stopped_training_rank_named_and_nothing_left(tmp_path):
    """Issue 15 item 5: training rank 1 is SIGSTOPped mid-update. After the stall deadline the
    error names ``training 1`` (no heartbeat), not rank 0 waiting on it; the command (its own
    process tree here, as the CLI would be) exits and leaves no process behind."""
    from weight_transfer.experiments.faults import matrix_row

    stall = 4.0
    res = matrix_row(Fault.parse("stop:train:1:middle:2"), stall=stall, limit=150)
    assert "training 1: no heartbeat for" in (res["error"] or ""), res["stderr_tail"]
    assert stall - 1 <= res["seconds_to_error"] < stall + 4  # the last beat precedes the stop by < 1 s
    assert res["left"] == 0 and not res["timed_out"]
    assert res["state"] == "incomplete v2" and res["restored"]


# `long` (make test-long): about a minute of CI's 25; its three rows are the cases this file tests one
# by one in the default set (test_c14_c15_training_rank_raises_midway, test_c15_inference_rank_killed_midway,
# test_c16_stopped_training_rank_named_and_nothing_left); this test adds the `faults` command's report.
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.long
def test_fault_matrix_quick_rows_named_bounded_clean(capsys):
    """``weight-transfer faults --quick``: three rows (a training rank raising, an
    inference rank killed, a training rank stopped), each its own process tree; every row names
    the faulted rank, ends, and leaves nothing behind."""
    import argparse

    from weight_transfer.experiments.faults import add_arguments, main

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert main(ap.parse_args(["--quick", "--stall", "4"])) == 0
    out = capsys.readouterr().out
    assert "rows named, bounded and clean: 3/3" in out
