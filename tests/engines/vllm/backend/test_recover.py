"""engines/vllm/backend/recover.py without a server (fast): the engine-core names of ``collective_rpc``
(the go-live and the recovery reach the engine core, every other method the workers), the
recovery's decisions on a stand-in engine core and stand-in workers (a live trainer's
registration kept, a gone one's released, an interrupted update's session closed and the label
``incomplete``, the scheduler resumed only when asked), the store probe, and the server's own
reason taken from an error response. The live server: tests/engines/vllm/trl/test_trainer.py (C32)."""
import socket
import threading

import pytest

pytest.importorskip("vllm")

from weight_transfer.engines.vllm.backend import recover
from weight_transfer.engines.vllm.backend.worker import OneSidedWeightTransferEngine


class Core:
    """A stand-in ``EngineCore``: workers, a label, a pause state, a prefix-cache reset count."""

    def __init__(self, workers):
        self.workers, self.label, self.paused, self.resets = workers, "1", True, 0

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if callable(method):
            return [method(w, *args) for w in self.workers]
        return [f"worker {method}{tuple(args)}" for _ in self.workers]

    def set_weight_version(self, v):
        self.label = v

    def get_weight_version(self):
        return self.label

    def reset_prefix_cache(self, reset_running_requests=False):
        self.resets += 1
        return True

    def is_scheduler_paused(self):
        return self.paused

    def resume_scheduler(self):
        self.paused = False


class Engine(OneSidedWeightTransferEngine):
    """The worker engine without vLLM: only what the recovery reads and calls."""

    def __init__(self, holder, *, shadow=None, active=None, version=1):
        self.holder, self.shadow, self._active, self.version, self.rank = holder, shadow, active, version, 0
        self.calls = []

    def finish_weight_update(self):
        self.calls.append("finish")

    def reset_weight_update_target(self):
        self.calls.append("reset_target")

    def shutdown(self):
        self.calls.append("shutdown")


class Worker:
    def __init__(self, engine, active=False):
        self.weight_transfer_engine, self._weight_update_active = engine, active


class Wrapper:  # vLLM's WorkerWrapperBase: the worker behind .worker
    def __init__(self, worker):
        self.worker = worker


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_store():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                srv.accept()[0].close()
            except OSError:
                pass
    th = threading.Thread(target=accept, daemon=True)
    th.start()
    yield ("127.0.0.1", srv.getsockname()[1])
    stop.set()
    th.join(5)
    srv.close()


def test_the_engine_core_names_and_everything_else_to_the_workers():
    class EC(Core):
        pass
    seen = []
    recover.install(EC, lambda self, v, reset: seen.append((v, reset)) or {"seconds": 0.0, "reset": reset})
    recover.install(EC, None)  # idempotent: the first wrapper stays
    core = EC([Worker(None)])
    assert core.collective_rpc(recover.GO_LIVE_RPC, args=("3", "false")) == [{"seconds": 0.0, "reset": False}]
    assert seen == [(3, False)]
    assert core.collective_rpc("wt_steps", args=("0",)) == ["worker wt_steps('0',)"]
    out = core.collective_rpc(recover.RECOVER_RPC, args=("true", "false"))[0]
    assert out["released"] is False and out["resumed"] is False and core.paused  # no one_sided engine: nothing


def test_a_gone_trainer_is_released_a_live_one_kept(live_store):
    gone = Engine(("127.0.0.1", _dead_port()), active=-1, version=4)
    core = Core([Wrapper(Worker(gone, active=True))])
    out = recover.engine_core_recover(core, stale_only=True, resume=True)
    assert gone.calls == ["finish", "reset_target", "shutdown"]
    assert core.workers[0].worker._weight_update_active is False
    w = out["workers"][0]
    assert w["released"] and w["interrupted"] and w["mixed"] and not w["alive"], w
    assert core.label == "incomplete:5" and core.resets == 1  # the interrupted update wrote live bytes
    assert out["resumed"] and not core.paused

    alive = Engine(live_store)
    core = Core([Worker(alive)])
    out = recover.engine_core_recover(core, stale_only=True)
    assert alive.calls == [] and out["kept"] == [f"{live_store[0]}:{live_store[1]}"] and not out["released"]
    assert core.paused and core.label == "1"
    out = recover.engine_core_recover(core, stale_only=False, resume=False)  # --force; the caller's pause kept
    assert alive.calls == ["shutdown"] and out["released"] and core.paused and not out["resumed"]


def test_an_interrupted_shadow_update_touched_nothing_live():
    from types import SimpleNamespace

    eng = Engine(("127.0.0.1", _dead_port()), shadow=SimpleNamespace(), active=-1, version=2)
    core = Core([Worker(eng, active=True)])
    out = recover.engine_core_recover(core)
    assert out["workers"][0]["interrupted"] and not out["workers"][0]["mixed"]
    assert core.label == "1" and core.resets == 0  # the label stays: the live bytes are the last version's


def test_the_store_probe_and_the_servers_reason(live_store):
    from types import SimpleNamespace

    assert recover.store_alive(*live_store) and not recover.store_alive("127.0.0.1", _dead_port())
    r = SimpleNamespace(json=lambda: {"error": {"message": "Worker failed with error 'initialized already'"}},
                        text="")
    assert recover.server_message(r) == "Worker failed with error 'initialized already'"
    r = SimpleNamespace(json=lambda: {"detail": "Not Found"}, text="")
    assert recover.server_message(r) == "Not Found"
    r = SimpleNamespace(json=lambda: (_ for _ in ()).throw(ValueError()), text="plain text " * 50)
    assert recover.server_message(r) == ("plain text " * 50).strip()[:300]
    with pytest.raises(recover.ServerError, match=r"did not answer the release .* \(POST /collective_rpc\)") as e:
        recover.recover_http(f"http://127.0.0.1:{_dead_port()}", timeout=5)
    assert e.value.status is None
