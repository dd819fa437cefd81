"""Issue 37, items 5 and 6: timeouts honoured everywhere, arguments checked at the door.

Every constructor of the public API (Coordinator, Sender, Receiver, connect_store, serve_store)
refuses a bad argument with a TypeError / ValueError naming it -- before it reaches the store,
so nothing is published (``meta/world``, ``meta/train/0``, ``meta/infer/0`` stay absent) --;
an unreachable store fails with ControlError naming ``host:port`` within about ``timeout``
seconds; one live Receiver owns an inference rank (``replace=True`` takes it over; a replaced
receiver reads no complete version; a closed or dead owner's rank is free). Single process."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import weight_transfer as wt
from weight_transfer.api.receiver import OWNER_KEY, _take_ownership
from weight_transfer.args import check_bool, check_callable, check_int, check_seconds, check_type
from weight_transfer.control import protocol as control
from weight_transfer.testing.catalog import load_config

CFG = load_config("qwen3-0.6b", num_hidden_layers=1, vocab_size=1024)
KEYS = ["meta/world", "meta/train/0", "meta/infer/0"]


@pytest.fixture
def store():
    return wt.serve_store("127.0.0.1", 0, timeout=30)


def _nothing_published(store) -> None:
    assert [store.check([k]) for k in KEYS] == [False, False, False]


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ---- the validators ----------------------------------------------------------------------------


def test_check_int_refuses_str_bool_float_and_names_the_range():
    assert check_int(3, "rank", where="X") == 3 and type(check_int(True + 1, "r", where="X")) is int
    with pytest.raises(TypeError, match=r"^Sender: rank='1' is a str; an int is required \(from os.environ\? "
                                        r"convert it with int\(\)\)$"):
        check_int("1", "rank", where="Sender")
    with pytest.raises(TypeError, match=r"^Sender: rank=True is a bool; an int is required$"):
        check_int(True, "rank", where="Sender")
    with pytest.raises(TypeError, match=r"^Sender: rank=2.0 is a float"):
        check_int(2.0, "rank", where="Sender")
    with pytest.raises(ValueError, match=r"^Coordinator: n_train=0 is out of range; need n_train >= 1$"):
        check_int(0, "n_train", where="Coordinator", lo=1)
    with pytest.raises(ValueError, match=r"need 0 <= port <= 65535"):
        check_int(70000, "port", where="serve_store", lo=0, hi=65535)


def test_check_seconds_type_bool_str_and_range():
    from datetime import timedelta

    assert check_seconds(2, "timeout", where="X") == 2.0 and check_seconds(None, "t", where="X", allow_none=True) is None
    assert check_seconds(timedelta(seconds=1.5), "timeout", where="X") == 1.5
    with pytest.raises(TypeError, match=r"^Receiver: timeout='5' is a str; a number of seconds is required "
                                        r"\(from os.environ\? convert it with float\(\)\)$"):
        check_seconds("5", "timeout", where="Receiver")
    with pytest.raises(TypeError, match="timeout=None is None"):
        check_seconds(None, "timeout", where="Receiver")
    with pytest.raises(TypeError, match="timeout=True is a bool"):
        check_seconds(True, "timeout", where="Receiver")
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^Receiver: timeout=.*: need a finite number of seconds > 0$"):
            check_seconds(bad, "timeout", where="Receiver")
    with pytest.raises(TypeError, match=r"^X: layout is a dict; an InferenceLayout \(or None\) is required$"):
        check_type({}, "layout", wt.InferenceLayout, where="X", allow_none=True)
    with pytest.raises(TypeError, match="log=3 is an int; a callable"):
        check_callable(3, "log", where="X")
    with pytest.raises(TypeError, match="publish='false' is a str; True or False is required"):
        check_bool("false", "publish", where="X")


# ---- the store -------------------------------------------------------------------------------


def test_connect_store_malformed_address_bad_timeout_and_a_store_object(store):
    for bad in ("nowhere", ("127.0.0.1",), ("127.0.0.1", "x"), ("127.0.0.1", 0), ("", 1234), 1234, "h:99999"):
        with pytest.raises(ValueError, match=r"^connect_store: store=.*: a store handle, \(host, port\) or 'host:port'"):
            wt.connect_store(bad)
    with pytest.raises(TypeError, match="connect_store: timeout='2' is a str"):
        wt.connect_store(store, timeout="2")
    with pytest.raises(ValueError, match="connect_store: timeout=0.0"):
        wt.connect_store(("127.0.0.1", store.port), timeout=0)
    assert wt.connect_store(store) is store
    client = wt.connect_store(f"127.0.0.1:{store.port}", timeout=3)
    client.set("k", b"v")
    assert store.get("k") == b"v" and client.timeout.total_seconds() == 3
    with pytest.raises(TypeError, match="serve_store: port='0' is a str"):
        wt.serve_store("127.0.0.1", "0")
    with pytest.raises(ValueError, match="serve_store: timeout=-1"):
        wt.serve_store("127.0.0.1", 0, timeout=-1)


def test_connect_store_to_nothing_fails_within_the_timeout_naming_the_address():
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(wt.ControlError, match=rf"^connect_store: no store answers at 127.0.0.1:{port} within 2 s") as e:
        wt.connect_store(("127.0.0.1", port), timeout=2)
    assert 1.9 < time.monotonic() - t0 < 10 and isinstance(e.value.__cause__, OSError)


def test_connect_store_finds_a_store_started_later_and_refuses_a_service_that_is_not_one():
    port, box = _free_port(), {}
    t = threading.Timer(0.5, lambda: box.setdefault("store", wt.serve_store("127.0.0.1", port)))
    t.start()
    t0 = time.monotonic()
    client = wt.connect_store(("127.0.0.1", port), timeout=10)
    assert time.monotonic() - t0 < 5
    client.set("late", b"1")
    assert box["store"].get("late") == b"1"
    other = socket.socket()  # accepts connections, never answers
    other.bind(("127.0.0.1", 0))
    other.listen()
    try:
        t0 = time.monotonic()
        with pytest.raises(wt.ControlError, match="accepts connections but no store answered"):
            wt.connect_store(("127.0.0.1", other.getsockname()[1]), timeout=1)
        assert time.monotonic() - t0 < 10
    finally:
        other.close()


# ---- the Coordinator --------------------------------------------------------------------------


def test_coordinator_refuses_bad_arguments_before_publishing(store, tmp_path):
    ok = {"n_train": 1, "n_infer": 1}
    cases = [
        (TypeError, r"Coordinator: n_train='1' is a str; an int is required \(from os.environ\?", {"n_train": "1"}),
        (TypeError, "Coordinator: n_infer=True is a bool", {"n_infer": True}),
        (TypeError, "Coordinator: n_train=1.0 is a float", {"n_train": 1.0}),
        (ValueError, "Coordinator: n_train=0 is out of range; need n_train >= 1", {"n_train": 0}),
        (ValueError, "Coordinator: n_infer=-1 is out of range", {"n_infer": -1}),
        (TypeError, "Coordinator: layout is a dict; an InferenceLayout", {"layout": {"tp": 1}}),
        (TypeError, "Coordinator: options is a dict; a TransferOptions", {"options": {}}),
        (TypeError, "Coordinator: timeout='30' is a str", {"timeout": "30"}),
        (ValueError, "Coordinator: timeout=0.0: need a finite number of seconds > 0", {"timeout": 0}),
        (ValueError, "Coordinator: stall=-1.0", {"stall": -1}),
        (TypeError, "Coordinator: liveness_train=.* a callable", {"liveness_train": {0: "dead"}}),
        (TypeError, "Coordinator: log='stderr' is a str; a callable", {"log": "stderr"}),
        (TypeError, "Coordinator: model_config is an int; a ModelConfig, a config.json path", {"model_config": 7}),
    ]
    for err, match, kw in cases:
        with pytest.raises(err, match=match):
            wt.Coordinator(store, **(ok | kw))
    missing = tmp_path / "nope" / "config.json"
    with pytest.raises(ValueError, match=rf"Coordinator: model_config='{missing}' is not a readable .*FileNotFoundError"):
        wt.Coordinator(store, **ok, model_config=str(missing))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"model_config='{tmp_path}' is not a readable .*JSONDecodeError"):
        wt.Coordinator(store, **ok, model_config=tmp_path)  # a directory: its config.json
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')  # any architecture is planned (traced), none is not
    with pytest.raises(ValueError, match=r"model_config=.* is not a readable .*names no architecture"):
        wt.Coordinator(store, **ok, model_config=tmp_path / "config.json")
    _nothing_published(store)


def test_coordinator_checks_everything_before_reaching_the_store():
    t0 = time.monotonic()  # an unreachable address: the bad argument is refused at once, not after the timeout
    with pytest.raises(ValueError, match="model_config='/no/such/config.json'"):
        wt.Coordinator(("127.0.0.1", _free_port()), n_train=1, n_infer=1, model_config="/no/such/config.json",
                       timeout=30)
    assert time.monotonic() - t0 < 10


def test_unreachable_store_fails_each_role_within_the_timeout():
    port = _free_port()
    addr = ("127.0.0.1", port)
    make = {
        "Coordinator": lambda: wt.Coordinator(addr, n_train=1, n_infer=1, model_config=CFG, timeout=2),
        "Sender": lambda: wt.Sender({"w": torch.zeros(2)}, rank=0, world_size=1, store=addr, timeout=2),
        "Receiver": lambda: wt.Receiver({"w": torch.zeros(2)}, rank=0, store=addr, timeout=2),
    }
    for who, build in make.items():
        t0 = time.monotonic()
        with pytest.raises(wt.ControlError, match=rf"127.0.0.1:{port} within 2 s"):
            build()
        assert time.monotonic() - t0 < 10, who


# ---- the Sender -------------------------------------------------------------------------------


def test_sender_refuses_bad_arguments_before_publishing(store):
    p = {"w": torch.zeros(2)}
    ok = {"rank": 0, "world_size": 1, "store": store}
    cases = [
        (TypeError, r"Sender: rank='0' is a str; an int is required \(from os.environ\? convert it with int\(\)\)",
         {"rank": "0"}),
        (TypeError, "Sender: world_size=1.0 is a float", {"world_size": 1.0}),
        (TypeError, "Sender: rank=False is a bool", {"rank": False}),
        (ValueError, "Sender: world_size=0 is out of range; need world_size >= 1", {"world_size": 0}),
        (ValueError, r"Sender: rank=-1, world_size=1: need 0 <= rank < world_size", {"rank": -1}),
        (ValueError, r"Sender: rank=1, world_size=1", {"rank": 1}),
        (TypeError, "Sender: coordinator is a str; a Coordinator", {"coordinator": "rank 0"}),
        (TypeError, "Sender: options is a dict", {"options": {}}),
        (TypeError, "Sender: timeout='60' is a str", {"timeout": "60"}),
        (ValueError, "Sender: timeout=-5.0", {"timeout": -5}),
        (TypeError, "Sender: group_barrier=1 is an int; a callable", {"group_barrier": 1}),
        (TypeError, "Sender: publish=1 is an int; True or False", {"publish": 1}),
        (ValueError, r"connect_store: store='nowhere'", {"store": "nowhere"}),
    ]
    for err, match, kw in cases:
        with pytest.raises(err, match=match):
            wt.Sender(p, **(ok | kw))
    with pytest.raises(ValueError, match="params: no parameters"):
        wt.Sender({}, **ok)
    _nothing_published(store)


def test_sender_world_size_must_be_the_coordinators_n_train(store):
    coord = wt.Coordinator(store, n_train=2, n_infer=1, timeout=5)  # publishes meta/world
    assert control.get(store, "meta/world") == {"n_train": 2, "n_infer": 1}
    with pytest.raises(ValueError, match=r"Sender: world_size=1 but the Coordinator's n_train=2 \('meta/world'\)"):
        wt.Sender({"w": torch.zeros(2)}, rank=0, world_size=1, store=store)
    with pytest.raises(ValueError, match=r"Sender: world_size=1 but the coordinator's n_train=2"):
        wt.Sender({"w": torch.zeros(2)}, rank=0, world_size=1, store=store, coordinator=coord)
    assert not store.check(["meta/train/0"])


# ---- the Receiver -----------------------------------------------------------------------------


def test_receiver_refuses_bad_arguments_before_publishing(store):
    t = {"w": torch.zeros(4)}
    cases = [
        (TypeError, r"Receiver: rank='0' is a str; an int is required \(from os.environ\?", {"rank": "0"}),
        (ValueError, "Receiver: rank=-1 is out of range; need rank >= 0", {"rank": -1}),
        (TypeError, "Receiver: timeout=None is None", {"timeout": None}),
        (ValueError, "Receiver: timeout=0.0", {"timeout": 0}),
        (TypeError, "Receiver: transport is an int; a str", {"transport": 1}),
        (ValueError, "unknown transport|transport", {"transport": "pigeon"}),
        (TypeError, "Receiver: publish='yes' is a str", {"publish": "yes"}),
        (TypeError, "Receiver: replace=1 is an int", {"replace": 1}),
    ]
    for err, match, kw in cases:
        with pytest.raises(err, match=match):
            wt.Receiver(t, **({"rank": 0, "store": store} | kw))
    with pytest.raises(TypeError, match="Receiver: tensors is a list; a mapping name -> tensor"):
        wt.Receiver([torch.zeros(4)], rank=0, store=store)
    with pytest.raises(ValueError, match="Receiver: region= needs metas="):
        wt.Receiver(region=torch.zeros(8, dtype=torch.uint8), rank=0, store=store)
    _nothing_published(store)
    assert not store.check([OWNER_KEY.format(rank=0)])


def test_a_second_live_receiver_for_a_rank_is_refused_replace_takes_it_over(store):
    a, b, c = torch.zeros(16), torch.ones(16), torch.full((16,), 2.0)
    rx1 = wt.Receiver({"w": a}, rank=0, store=store)
    host = socket.gethostname()
    with pytest.raises(ValueError, match=rf"^Receiver: inference rank 0 is already registered by a live receiver "
                                         rf"\(host {host}, pid {os.getpid()}\); .*replace=True"):
        wt.Receiver({"w": b}, rank=0, store=store)
    assert control.get(store, "meta/infer/0")[0] == rx1.descriptor  # the refused one published nothing
    store.set("weights", control.WeightsState(4, "complete", 3).encode())  # no Coordinator: the global state
    assert rx1.version() == 3

    rx2 = wt.Receiver({"w": b}, rank=0, store=store, replace=True)
    assert rx2.replaced is not None and rx2.replaced.startswith(f"{host}:{os.getpid()}:")
    assert control.get(store, "meta/infer/0")[0] == rx2.descriptor and rx2.version() == 3
    # the replaced receiver reads nothing as complete, and says who took its rank
    assert rx1.state() == control.WeightsState(4, "none", -1) and rx1.version() == -1
    who = rf"inference rank 0 was taken over by another receiver \(host {host}, pid {os.getpid()}\)"
    with pytest.raises(wt.ControlError, match=who):
        rx1.wait_version(3, timeout=5)
    with pytest.raises(wt.ControlError, match=who):
        rx1.read_consistent(lambda: a.clone(), wait=False)
    assert rx2.read_consistent(lambda: 1)[1] == 1
    rx1.close()  # announces nothing: the rank is rx2's
    assert not store.check(["infer/leave/0"]) and rx2.version() == 3
    rx2.close()  # leaves and gives the rank up
    assert store.check(["infer/leave/0"]) and store.get(OWNER_KEY.format(rank=0)).startswith(b"left:")

    rx3 = wt.Receiver({"w": c}, rank=0, store=store)  # a closed rank is registered again without replace=True
    assert rx3.replaced is None and rx3.version() == 3 and not store.check(["infer/leave/0"])
    rx3.close()


def test_a_dead_or_leaving_owner_is_replaced_without_replace(store):
    key = OWNER_KEY.format(rank=1)
    store.set(key, f"{socket.gethostname()}:{_dead_pid()}:deadbeef")  # an engine that was killed
    rx = wt.Receiver({"w": torch.zeros(4)}, rank=1, store=store)
    assert rx.replaced.endswith(":deadbeef")
    rx.transport.close()  # drop it without close(): its rank stays held by this live process
    rx.transport = None
    with pytest.raises(ValueError, match="already registered by a live receiver"):
        wt.Receiver({"w": torch.zeros(4)}, rank=1, store=store)
    store.set("infer/leave/1", b"1")  # ... until it announces leaving
    wt.Receiver({"w": torch.zeros(4)}, rank=1, store=store).close()


def test_ownership_is_taken_by_exactly_one_of_concurrent_receivers(store):
    clients = [wt.connect_store(("127.0.0.1", store.port), timeout=10) for _ in range(8)]
    won, lost, start = [], [], threading.Barrier(len(clients))

    def take(i):
        start.wait()
        try:
            _take_ownership(clients[i], 5, f"h:{os.getpid()}:{i}", replace=False)
            won.append(i)
        except ValueError:
            lost.append(i)
    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == len(clients) - 1
    assert store.get(OWNER_KEY.format(rank=5)).decode() == f"h:{os.getpid()}:{won[0]}"
