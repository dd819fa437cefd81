"""bench-peers: the tensor set, the receivers' independent pattern, and (where the peers are
installed) a tiny end-to-end run of each peer, verified. torchstore lives in its own
environment (scripts/install_torchstore.sh); its test is skipped, with the reason, without it."""
import importlib.util

import pytest
import torch

from weight_transfer.engines.engine import engine_tensor_metas
from weight_transfer.experiments.bench.peers import PEERS, PeersBenchConfig, _available, main, pattern, tensor_set
from weight_transfer.experiments.command import main as cli_main
from weight_transfer.experiments.config import TrialConfig

TINY = dict(num_hidden_layers=1, vocab_size=512, hidden_size=128, intermediate_size=256,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64)


def test_tensor_set_lands_the_engines_bytes():
    cfg = TrialConfig.from_flat(model="qwen3-30b-a3b", overrides=dict(TINY, num_experts=4, moe_intermediate_size=64), tp=2)
    ts = tensor_set(cfg)
    for r in range(2):
        metas = {m.name: m for m in engine_tensor_metas(cfg.model_config(), cfg.inference, r)}
        assert {t.name for t in ts} == set(metas)
        for t in ts:
            shape = tuple(b - a for a, b in t.infer_box(r, 2))
            assert shape == tuple(metas[t.name].shape), t.name
    assert any(t.tp_dim is None for t in ts) and any(t.tp_dim == 2 for t in ts)  # norms; w2_weight


def test_pattern_is_position_and_step_dependent():
    full = pattern(((0, 300), (0, 70)), tid=3, step=1).view(torch.int16)
    part = pattern(((100, 250), (10, 40)), tid=3, step=1).view(torch.int16)
    assert torch.equal(full[100:250, 10:40], part)
    assert not torch.equal(full, pattern(((0, 300), (0, 70)), tid=3, step=2).view(torch.int16))
    assert not torch.equal(full, pattern(((0, 300), (0, 70)), tid=4, step=1).view(torch.int16))
    assert full.unique().numel() > 1000


def _peer_rank(port: int) -> None:
    """A spawned rank of the peer bench's store: reads what the parent put (awex's shape), answers."""
    from weight_transfer.experiments.bench.peer_worlds import _store, _StoreMeta

    meta = _StoreMeta(_store(port, False, timeout=30))
    endpoint, entries = meta.get_object("buffers", timeout=30)
    sig, addr, size, shape, dtype = entries[0]
    ok = (endpoint == "127.0.0.1:4242" and sig == ("a", "b", (0, 1), ((0, 4, 1),)) and shape == (2, 2)
          and (addr, size, dtype) == (1 << 40, 8, "torch.bfloat16"))
    meta.put_object("done", "" if ok else f"got {endpoint!r} {entries!r}")


def test_peer_bench_store_is_authenticated_and_carries_data_not_pickles():
    """The awex / Mooncake rows' store: the project's authenticated one (a rank spawned after it
    inherits the secret) and awex's rendezvous values as msgpack, arrays back as the tuples awex
    compares; an object that is not data is refused when put."""
    import multiprocessing as mp

    from weight_transfer.experiments.bench.peer_worlds import _store, _StoreMeta, dumps, loads
    from weight_transfer.security.secure_store import SecureStore

    store = _store(None, True, timeout=30)
    assert isinstance(store, SecureStore)
    meta = _StoreMeta(store)
    meta.put_object("buffers", ("127.0.0.1:4242", [(("a", "b", (0, 1), ((0, 4, 1),)), 1 << 40, 8, (2, 2), "torch.bfloat16")]))
    p = mp.get_context("spawn").Process(target=_peer_rank, args=(store.port,), daemon=True)
    p.start()
    try:
        assert meta.get_object("done", timeout=60) == ""
    finally:
        p.join(30)
    assert p.exitcode == 0
    assert store.get("buffers")[:1] != b"\x80"  # not a pickle
    assert loads(dumps({"k": [1, [2, 3]]})) == {"k": (1, (2, 3))}
    with pytest.raises(TypeError):
        dumps(object())


def test_unknown_peer_is_refused(capsys):
    with pytest.raises(ValueError, match="unknown peer"):
        PeersBenchConfig(peers=("nope",))
    assert cli_main(["bench-peers", "--peers", "nope", "--csv", ""]) == 2
    assert "unknown peer" in capsys.readouterr().err


def test_unknown_torchstore_transport_and_missing_interpreter():
    with pytest.raises(ValueError, match="unknown torchstore transport"):
        PeersBenchConfig(torchstore_transports=("nvlink",))
    with pytest.raises(ValueError, match="unknown reference transport"):
        PeersBenchConfig(reference_transports=("verbs",))
    assert PeersBenchConfig(reference_transports=("cma", "shm")).reference_transports == ("cma", "shm")
    why = _available("torchstore", "/nonexistent/wt-torchstore/bin/python")
    assert why.startswith("not installed") and "install_torchstore.sh" in why


@pytest.mark.multiproc
@pytest.mark.peers
@pytest.mark.parametrize("peer", [p for p in PEERS if p != "torchstore"])
def test_peer_runs_verified(peer, capsys):
    if peer == "awex" and importlib.util.find_spec("awex") is None:
        pytest.skip("awex not installed (pip install -e '.[peers]')")
    if peer in ("awex", "mooncake") and importlib.util.find_spec("mooncake") is None:
        pytest.skip("mooncake-transfer-engine not installed (pip install -e '.[peers]')")
    rc = main(PeersBenchConfig(peers=(peer,), model="qwen3-0.6b", steps=1, csv="",
                               override=tuple(f"{k}={v}" for k, v in TINY.items())))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "cold" in out and "p95" in out
    if peer == "reference":  # a row per transport (shm, then cma); its own phases, slowest sender and receiver
        assert "verified bit-exact: 2/2 peers" in out
        for label in ("shm (memcpy into mapping)", "cma (process_vm_writev)"):
            assert (f"# reference {label}: phases, p50 busy seconds" in out
                    and f"# reference {label}: slowest sender" in out), label
    else:
        assert "verified bit-exact: 1/1 peers" in out


@pytest.mark.multiproc
@pytest.mark.peers
def test_torchstore_runs_verified(capsys):
    """torchstore's shared-memory row, 2 updates of a small model, each verified on the receivers."""
    why = _available("torchstore")
    if why:
        pytest.skip(f"torchstore: {why}")
    rc = main(PeersBenchConfig(peers=("torchstore",), torchstore_transports=("shm",), model="qwen3-0.6b", steps=2,
                               warmup=0, csv="", override=tuple(f"{k}={v}" for k, v in TINY.items())))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "verified bit-exact: 1/1 peers" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("torchstore"))
    assert "shm, same keys" in row and row.split()[-1] == "yes", row
    assert "p50 put" in out and "not run" not in out
