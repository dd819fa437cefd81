"""Case C30 through the public API: an outsider holding only the store's ``host:port`` attacks a
running job at every stage of an update, and a forged value that did reach the store's table is
refused by every member.

The job is started as the README shows (``wt.serve_store("127.0.0.1", 0)`` in the launching
process, members started from it inherit the secret): tests/helpers/api_world.py's world of 2
FSDP2 training ranks (the coordinator in rank 0) and 2 receivers of a TP=2 stand-in engine.
Inside each stage of the updates -- the coordinator planning, after every rank said ready and
before the decision, a training rank preparing, writing, releasing, the commit before ``complete
v`` -- the stage waits while tests/helpers/outsider.py runs in a process of its own without the
secret: for every key a member reads it sends a pickle whose loading would run ``touch``, a
forged value (``weights`` = ``complete 99``), a read, a delete, an add and a compare_set, over TLS
without a certificate and with a member certificate of another job; raw pickles and TCPStore
frames over plain TCP; torch's own ``TCPStore`` client; and a flood of connections.
"""
import json
import socket
import time

import pytest

from tests.helpers.api_world import Fault, Push, World, run

pytestmark = pytest.mark.multiproc

STAGES = [("coord", 0, "plan", "outsider"), ("coord", 0, "decide", "outsider+tcpstore"),
          ("train", 1, "prepare", "outsider"), ("train", 0, "write", "outsider+tcpstore+flood"),
          ("train", 1, "release", "outsider"), ("coord", 0, "commit", "outsider")]


def _sealed(store):
    """What the server's table holds of the keys that grant memory access: (key, bytes)."""
    t = store.server.table.d
    return {k: v[1] for k, v in t.items() if k.startswith(("meta/infer/", "plan/"))}


def test_c30_an_outsider_at_every_stage_changes_nothing_and_reads_nothing(tmp_path):
    w = World([Push(v, Fault(role, rank, stage, kind)) for v, (role, rank, stage, kind) in enumerate(STAGES, 1)],
              timeout=60.0)
    t0 = time.monotonic()
    run(w, str(tmp_path), limit=400, inspect=_sealed)
    res = w.results
    # the job: every push completed on every rank, every receiver holds each version exactly
    for r in range(w.n_train):
        for k in range(len(STAGES)):
            assert res["train"][r][k]["ok"], (r, k, res["train"][r][k])
    for i in range(w.n_infer):
        for k in range(len(STAGES)):
            c = res["infer"][i][k]
            assert c["state"] == "complete" and c["version"] == k + 1 and c["bytes_ok"], (i, k, c)
    assert res["left"] == []
    # the outsider: it tried at every stage, nothing answered it, nothing of it ran
    rows = [json.loads(line) for line in open(tmp_path / "outsider.jsonl")]
    stages = {r["stage"] for r in rows}
    assert len(stages) == len(STAGES), stages
    answered = [r for r in rows if r["ok"]]
    assert not answered, answered[:5]
    vias = {r["via"] for r in rows}
    assert vias == {"tls-nocert", "tls-otherjob", "raw", "tcpstore", "flood"}, vias
    assert max(r["seconds"] for r in rows if r["via"] != "flood") < 10
    flood = next(r for r in rows if r["via"] == "flood")
    closed = int(flood["why"].split(": ")[1].split()[0])
    assert closed >= 60, flood  # beyond MAX_PENDING (64) of the 128, closed at once; the update went on
    assert len(rows) > 6 * 45 * 7
    assert not (tmp_path / "OUTSIDER_CODE_RAN").exists()
    # what grants memory access is sealed in the server's memory: the descriptors' field names and the
    # host name (when long enough not to turn up in random bytes) appear nowhere in clear
    host = socket.gethostname().encode()
    needles = [b"transport", b"epochs", b"RankPlan", b"remote_offset"] + ([host] if len(host) >= 8 else [])
    for key, raw in res["inspect"].items():
        assert raw[:1] == b"\x01" and not any(n in raw for n in needles), key
    assert time.monotonic() - t0 < 300


# --------------------------------------------------------------------------- a forged value in the table


def test_c30_forged_values_in_the_table_are_refused_by_every_rank_bounded(tmp_path):
    """Were a value to reach the table without the job's key (the server's own process, or a
    member's bug), the issue's two attacks. Before push 2's decision a pickle sits in
    ``push/1/decision`` (the outsider "publishing the next push's decision ahead of the
    coordinator"): every training rank raises ControlError within the timeout, the key named, no
    code runs, nothing is published complete. During push 4's writes ``weights`` says ``complete
    99``: a reader then refuses it naming the key, no receiver ever reports version 99, and the
    coordinator -- the only writer of ``weights``, which never reads it back -- publishes
    ``complete 4`` over it. Pushes 1, 3, 4 and 5 complete, every byte checked."""
    import pickle
    import threading

    from tests.helpers.outsider import Payload
    from weight_transfer.control import protocol as control

    marker = tmp_path / "FORGED_CODE_RAN"
    forge = {"push/1/decision": pickle.dumps(Payload(str(marker))), "weights": b"9 complete 99"}
    stop, reads = threading.Event(), []

    def forger(store):
        def loop():
            while not stop.is_set():
                for key, raw in forge.items():
                    if f"forge-request/{key}" in store.server.table.d and f"forged/{key}" not in store.server.table.d:
                        store.server.table.set(key, raw)  # bypasses the job's key: no member sealed it
                        if key == "weights":  # a reader now: it must refuse, never see 99
                            try:
                                reads.append(str(control.read_state(store)))
                            except control.ControlError as e:
                                reads.append(f"{type(e).__name__}: {e}")
                        store.set(f"forged/{key}", b"1")
                time.sleep(0.002)
        threading.Thread(target=loop, daemon=True).start()

    w = World([Push(1), Push(2, Fault("coord", 0, "decide", "forge:push/1/decision")), Push(3),
               Push(4, Fault("train", 0, "write", "forge:weights")), Push(5)], timeout=4.0)
    try:
        run(w, str(tmp_path), limit=300, on_start=forger)
    finally:
        stop.set()
    train, infer = w.results["train"], w.results["infer"]
    for r in range(w.n_train):
        for k in (0, 2, 3, 4):
            assert train[r][k]["ok"], (r, k, train[r][k])
        t = train[r][1]
        assert not t["ok"] and t["type"] in ("ControlError", "AuthenticationError"), (r, t)
        assert t["seconds"] < 2 * w.timeout + 10, (r, t)
    assert any("push/1/decision" in train[r][1]["msg"] for r in range(w.n_train)), [train[r][1] for r in train]
    assert reads and all("AuthenticationError: store key 'weights'" in x for x in reads), reads
    for i in range(w.n_infer):
        assert infer[i][1]["state"] != "complete" or infer[i][1]["version"] == 1, infer[i][1]
        for k, c in infer[i].items():
            assert c["version"] != 99, (i, k, c)
            if c["state"] == "complete":
                assert c["bytes_ok"], (i, k, c)
        for k, v in ((0, 1), (2, 3), (3, 4), (4, 5)):
            assert infer[i][k]["state"] == "complete" and infer[i][k]["version"] == v, (i, k, infer[i][k])
    assert not marker.exists()
