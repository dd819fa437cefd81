"""The ``one_sided`` worker engine's transport choice and its one register-and-publish path
(engines/vllm/worker/state.py: :func:`choose_transport`, :meth:`WorkerTargets.receive`), without
vLLM: over plain ``nn.Module`` s, as the backend runs it over a vLLM model after
``process_weights_after_loading`` (issue 42 item 3).

Here (CPU): the choice from tensors' memory -- real host tensors, and device objects for CUDA
(the chooser reads nothing but ``.device``; a CUDA tensor cannot be made on this machine) --; the
refusal naming the tensor and the device (a ``meta`` tensor, a transport that cannot register the
memory, tensors on two devices) before anything is registered or published; the path end to end
over host memory (``cma``: one region of one part per allocation, published, the descriptor's
parts). Marked ``gpu`` (skipped here with the reason): the same path over a CUDA module through
``cuda_ipc`` (one IPC handle per part). The cross-process write is scripts/gpu_worker_receive.py
(tests/scripts/test_gpu_worker_receive.py here, gpu_check.sh's ``worker_cuda`` step on a GPU).
"""
from types import SimpleNamespace

import pytest
import torch

from weight_transfer.api import serve_store
from weight_transfer.engines.vllm.worker.runtime import runtime_layout
from weight_transfer.engines.vllm.worker.state import WorkerTargets, choose_transport, receive_transports

NO_CUDA = not torch.cuda.is_available()
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def on(device) -> SimpleNamespace:
    """A stand-in for a tensor on ``device``: all the chooser reads of a tensor."""
    return SimpleNamespace(device=torch.device(device))


def module(device="cpu") -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 24), torch.nn.LayerNorm(24))
    return m.to(device=device, dtype=torch.bfloat16)


def test_what_each_transport_receives_into():
    """From the transport classes: where each registers several allocations as one region and
    publishes memory it did not allocate (shm cannot: it publishes only its own segments)."""
    got = receive_transports()
    assert got["cma"] == ("cpu",) and got["cuda_ipc"] == ("cuda",) and got["nixl"] == ("cpu", "cuda")
    assert got["shm"] == () and got["verbs"] == ("cpu",)


def test_auto_chooses_from_the_tensors_memory():
    host = dict(module().named_parameters())
    assert choose_transport(host) == "cma"                        # host memory: process_vm_writev
    assert choose_transport({"w": on(CUDA0), "b": on(CUDA0)}) == "cuda_ipc"  # GPU memory on one host
    assert choose_transport({"w": on(CUDA1)}, "auto") == "cuda_ipc"


def test_a_named_transport_is_taken_when_it_registers_the_memory():
    host = dict(module().named_parameters())
    assert choose_transport(host, "cma") == "cma" and choose_transport(host, "nixl") == "nixl"
    assert choose_transport({"w": on(CUDA0)}, "nixl") == "nixl"   # trainers on other hosts
    assert choose_transport({"w": on(CUDA0)}, "cuda_ipc") == "cuda_ipc"


@pytest.mark.parametrize("tensors, requested, name, device, why", [
    ({"model.embed.weight": on(CUDA0), "b": on(CUDA0)}, "cma", "model.embed.weight", "cuda:0",
     r"transport 'cma' cannot register \(it registers cpu memory here\); for cuda memory use 'auto' or one of "
     r"\['cuda_ipc', 'nixl'\]"),
    ({"w": on(CUDA0)}, "shm", "w", "cuda:0", "transport 'shm' cannot register"),
    ({"w": on("cpu")}, "shm", "w", "cpu", r"publishes only memory it allocated itself \(ShmTransport.allocate\)"),
    ({"w": on("cpu")}, "cuda_ipc", "w", "cpu", r"transport 'cuda_ipc' cannot register \(it registers cuda memory"),
    ({"w": on(CUDA0)}, "verbs", "w", "cuda:0", "transport 'verbs' cannot register"),
    ({"a": on("cpu"), "m": on("meta")}, "auto", "m", "meta", "which no transport registers"),
    ({"m": on("meta")}, "nixl", "m", "meta", "which no transport registers"),
    ({"x": on("xpu")}, "auto", "x", "xpu", "which no transport registers"),
    ({"a": on(CUDA0), "b": on("cpu")}, "auto", "b", "cpu", "but 'a' on cuda:0: one inference rank registers one region"),
    ({"a": on(CUDA0), "b": on(CUDA1)}, "cuda_ipc", "b", "cuda:1", "one region, on one device"),
])
def test_refused_naming_the_tensor_and_the_device(tensors, requested, name, device, why):
    with pytest.raises(ValueError, match=why) as e:
        choose_transport(tensors, requested, who="inference 3 (vLLM worker pid 1)")
    msg = str(e.value)
    assert msg.startswith("inference 3 (vLLM worker pid 1): tensor ") and f"{name!r} is on device {device}" in msg
    assert "refusing before anything is registered or published" in msg


def test_unknown_transport_and_no_tensor():
    with pytest.raises(ValueError, match="transport 'tcp': unknown; known: cma, cuda_ipc, nixl, shm, verbs, or 'auto'"):
        choose_transport({"w": on("cpu")}, "tcp")
    with pytest.raises(ValueError, match="no destination tensor"):
        choose_transport({})


def _receive(model, **kw):
    targets = WorkerTargets(model, None, 0)
    lay = runtime_layout(targets.report(), 0)
    store = serve_store("127.0.0.1", 0, timeout=30)
    return targets, lay, store, lambda **more: targets.receive(lay, rank=0, store=store, timeout=30, who="inference 0",
                                                               **kw, **more)


def test_one_path_over_host_memory_one_part_per_allocation():
    """auto -> cma; one region spanning every parameter, one part per allocation; the plan's
    offsets from the lowest destination byte (the runtime layout's base), unchanged; published
    with the runtime layout; the descriptor carries the parts the senders' writes are held to."""
    from weight_transfer.control import protocol as control
    from weight_transfer.control.store import RUNTIME_KEY

    m = module()
    params = dict(m.named_parameters())
    targets, lay, store, receive = _receive(m)
    seen = []
    rx = receive(before_publish=lambda r: seen.append(store.check(["meta/infer/0"])))
    try:
        assert rx.transport.name == "cma" and seen == [False]   # before_publish runs before the publication
        d = rx.descriptor
        assert (d.transport, d.addr, d.length) == ("cma", lay.base, lay.length) and lay.registered == d
        parts = dict(d.extra)["parts"]
        assert parts == rx.region.parts and len(parts) == len(params) == 5
        assert {(m_.offset, m_.nbytes) for m_ in rx.metas} == set(parts)  # each parameter its own allocation
        assert {m_.name: m_.offset for m_ in rx.metas} == {n: p.data_ptr() - lay.base for n, p in params.items()}
        desc, metas = control.get(store, "meta/infer/0")
        assert desc == d and metas == lay.dest_metas()
        assert control.get(store, RUNTIME_KEY.format(rank=0)).base == lay.base
    finally:
        rx.close()


@pytest.mark.parametrize("device, requested, name, where", [
    ("meta", "auto", "0.weight", "meta"),          # a model not materialized
    ("cpu", "cuda_ipc", "0.weight", "cpu"),        # a transport that cannot register host memory
])
def test_refusal_before_anything_is_registered_or_published(device, requested, name, where):
    """The refusal is one ValueError naming the tensor and its device; the store holds nothing of
    this rank afterwards (no descriptor, no ownership, no join)."""
    targets, lay, store, receive = _receive(module(device), transport=requested)
    with pytest.raises(ValueError, match=rf"inference 0: tensor '{name}' is on device {where}"):
        receive()
    assert not store.check(["meta/infer/0"]) and not store.check(["infer/owner/0"])
    assert store.num_keys() <= 1  # only the store's own bookkeeping key, if any


def test_before_publish_failing_publishes_nothing_and_frees_the_rank():
    from weight_transfer.api.receiver import OWNER_KEY
    from weight_transfer.control import protocol as control

    targets, lay, store, receive = _receive(module())

    def boom(rx):
        raise RuntimeError("engine info failed")

    with pytest.raises(RuntimeError, match="engine info failed"):
        receive(before_publish=boom)
    assert not store.check(["meta/infer/0"])
    assert control.get_text(store, OWNER_KEY.format(rank=0)).startswith("left:")  # the rank is free again
    rx = receive()  # and can be registered again
    rx.close()


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU and a CUDA build of torch")
def test_cuda_module_through_cuda_ipc_one_handle_per_allocation():
    """On a GPU: the same path over a CUDA module chooses ``cuda_ipc`` and registers one region
    of one part per parameter allocation, each exported with its own IPC handle; ``cma`` forced
    is refused naming the tensor and ``cuda:0``."""
    m = module("cuda")
    params = dict(m.named_parameters())
    targets, lay, store, receive = _receive(m)
    rx = receive()
    try:
        d = rx.descriptor
        x = dict(d.extra)
        assert rx.transport.name == "cuda_ipc" and (d.addr, d.length) == (lay.base, lay.length)
        assert len(x["parts"]) == len(params) and len(x["handles"]) == len(params)
        assert [(o, n) for o, n, *_ in x["handles"]] == list(x["parts"])
    finally:
        rx.close()
    targets, lay, store, receive = _receive(m, transport="cma")
    with pytest.raises(ValueError, match=r"tensor '0.weight' is on device cuda:0, which transport 'cma' cannot"):
        receive()
    assert not store.check(["meta/infer/0"])
