"""The generation load (engines/generate.py): engine steps under the go-live lock, labels, spans,
samples that replay bit-exactly from the right version's weights, pause / resume. A tiny Qwen3
engine (tied embeddings) in-process; every test well under a second or two."""
from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

from weight_transfer.engines import Engine, expected_from_checkpoint
from weight_transfer.engines.generate import (
    DEFAULT_VOCAB_ROWS,
    GenerationLoad,
    default_vocab_rows,
    head_of,
    replay,
    step_tokens,
)
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.types import InferenceLayout


def cfg():
    return load_config("qwen3-0.6b", num_hidden_layers=2, vocab_size=1000, hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def version(seed: int) -> Engine:
    """The oracle engine (rank 0 of TP=1) for a random checkpoint of ``seed``."""
    g = torch.Generator().manual_seed(seed)
    c = cfg()
    ckpt = {p.name: torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in param_specs(c)}
    return expected_from_checkpoint(c, InferenceLayout(tp=1), 0, ckpt.__getitem__, ckpt)


@pytest.fixture(scope="module")
def versions():
    return version(0), version(1)


def wait_for(pred, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_step_math_and_vocab_rows(versions):
    v0, _ = versions
    p = v0.named_parameters()
    assert "lm_head.weight" not in p and head_of(p) is p["model.embed_tokens.weight"]  # tied
    assert default_vocab_rows(p) == min(DEFAULT_VOCAB_ROWS, 1024)
    tok = torch.tensor([1, 5, 7, 999])
    out = step_tokens(p, tok, 1024)
    h = p["model.embed_tokens.weight"][tok].float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * p["model.norm.weight"].float()
    assert out.tolist() == (h @ p["model.embed_tokens.weight"].float().T).argmax(-1).tolist()
    assert step_tokens(p, tok, 300).max() < 300
    untied = dict(p, **{"lm_head.weight": torch.randn(1024, 256).to(torch.bfloat16)})
    assert head_of(untied) is untied["lm_head.weight"]
    with pytest.raises(ValueError, match="vocab_rows"):
        step_tokens(p, tok, 2000)


def test_requests_are_replaced_and_seeded(versions):
    v0, _ = versions
    a, b = (GenerationLoad(v0.named_parameters, threading.Lock(), max_tokens=3, seed=7, sample_every=1)
            for _ in range(2))
    for _ in range(7):
        a.step(), b.step()
    sa, sb = a.snapshot(), b.snapshot()
    assert [(s["tokens_in"], s["tokens_out"]) for s in sa["samples"]] == [(s["tokens_in"], s["tokens_out"])
                                                                          for s in sb["samples"]]
    done = [r for r in sa["requests"] if r["done"]]
    assert len(done) == 8 and all(r["n_tokens"] == 3 and r["spans"] == [[None, 3]] for r in done)
    assert [r["n_tokens"] for r in sa["requests"] if not r["done"]] == [1] * 4
    assert sum(r["n_tokens"] for r in sa["requests"]) == sum(s[3] for s in sa["steps"]) == 28
    # a finished request's slot starts from a fresh prompt token, not from its last output
    s3 = sa["samples"][3]
    assert s3["tokens_in"] == [r["prompt"] for r in sa["requests"] if r["first_step"] == 3]
    assert len(sa["steps"]) == 7 and all(t0 <= t1 for t0, t1, _, _ in sa["steps"])
    pickle.dumps(sa)


def test_go_live_under_the_lock_changes_label_and_tokens(versions):
    v0, v1 = versions
    live = Engine(cfg(), InferenceLayout(tp=1), 0)
    live.arena.copy_(v0.arena)
    lock, ver = threading.Lock(), [0]
    load = GenerationLoad(live.named_parameters, lock, label=lambda: ver[0], sample_every=3, max_tokens=16).start()
    wait_for(lambda: load.n_steps >= 30)

    def mid_request() -> bool:  # every request in flight has tokens before and after: it spans the go-live
        # (all requests start together and end after max_tokens steps; a go-live on that boundary spans none;
        # the step just released may not be accounted yet, hence the margin of one)
        return all(1 <= r["n_tokens"] <= 16 - 2 for r in load.snapshot()["requests"] if not r["done"])

    while True:
        with lock:  # the go-live: new bytes land between two steps
            if mid_request():
                g0 = time.time()
                live.arena.copy_(v1.arena)
                ver[0] = 1
                g1 = time.time()
                break
        time.sleep(0.0005)
    n_at = load.n_steps
    wait_for(lambda: load.n_steps >= n_at + 30)
    assert load.stop() and not load.running
    snap = load.snapshot()
    steps = snap["steps"]
    assert all(label == (1 if t0 >= g1 else 0) for t0, _, label, _ in steps)
    assert all(t1 <= g0 for t0, t1, label, _ in steps if label == 0)  # no step overlaps the go-live
    p0, p1 = v0.named_parameters(), v1.named_parameters()
    by = {0: [s for s in snap["samples"] if s["label"] == 0], 1: [s for s in snap["samples"] if s["label"] == 1]}
    assert len(by[0]) >= 5 and len(by[1]) >= 5
    for label, right, wrong in ((0, p0, p1), (1, p1, p0)):
        for s in by[label]:
            assert replay(right, s) == s["tokens_out"]
        assert any(replay(wrong, s) != s["tokens_out"] for s in by[label])
    # requests in flight at the go-live carry two spans, old label first; tokens add up
    spans = [r["spans"] for r in snap["requests"]]
    assert any([x[0] for x in sp] == [0, 1] for sp in spans)
    assert all([x[0] for x in sp] in ([], [0], [1], [0, 1]) for sp in spans)  # []: just replaced
    assert sum(n for sp in spans for _, n in sp) == sum(s[3] for s in steps)


def test_re_pointed_params_are_used_from_the_next_step(versions):
    """A shadow flip: ``get_params`` returns another set of tensors after the go-live."""
    v0, v1 = versions
    lock, live = threading.Lock(), [v0.named_parameters(), 0]
    load = GenerationLoad(lambda: live[0], lock, label=lambda: live[1], sample_every=1).start()
    wait_for(lambda: load.n_steps >= 5)
    with lock:
        live[:] = [v1.named_parameters(), 1]
    n_at = load.n_steps
    wait_for(lambda: load.n_steps >= n_at + 5)
    load.stop()
    samples = load.snapshot()["samples"]
    assert {s["label"] for s in samples} == {0, 1}
    for s in samples:
        assert replay((v0 if s["label"] == 0 else v1).named_parameters(), s) == s["tokens_out"]


def test_pause_waits_for_the_step_and_resume_restarts(versions):
    v0, _ = versions
    load = GenerationLoad(v0.named_parameters, threading.Lock()).start()
    wait_for(lambda: load.n_steps >= 5)
    t_pause = load.pause()
    n = load.n_steps
    assert load.snapshot()["steps"][-1][1] <= t_pause  # the step in flight finished first
    time.sleep(0.1)
    assert load.n_steps == n and load.running
    t_resume = load.resume()
    wait_for(lambda: load.n_steps >= n + 5)
    load.stop()
    snap = load.snapshot()
    assert snap["pauses"] == [[t_pause, t_resume]]
    assert steps_after(snap, t_pause)[0][0] >= t_resume


def steps_after(snap, t):
    return [s for s in snap["steps"] if s[0] > t]


def test_stop_while_paused_and_errors_surface(versions):
    v0, _ = versions
    load = GenerationLoad(v0.named_parameters, threading.Lock()).start()
    wait_for(lambda: load.n_steps >= 1)
    load.pause()
    assert load.stop(timeout=2.0)
    bad = GenerationLoad(dict, threading.Lock()).start()  # no tensors: the first step fails
    wait_for(lambda: not bad.running)
    assert "model.embed_tokens.weight" in bad.snapshot()["error"]
    with pytest.raises(RuntimeError, match="generation load failed"):
        bad.stop()
    assert bad.stop(check=False)
