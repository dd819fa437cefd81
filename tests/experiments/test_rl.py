"""The RL loop's pieces without an engine (weight_transfer.experiments.rl, analysis/rl.py): the
task's rewards, group-normalized advantages, the clipped policy-gradient loss, options and
flags, item 2's tidy rows and their summary. The loop itself on vLLM: tests/engines/vllm/test_rl_loop.py."""
from __future__ import annotations

import csv
import types

import pytest
import torch

from weight_transfer.experiments import collectives, rl


def test_parity_task_rewards_and_prompts():
    o = rl.RLOptions(values=3, first_token=10)
    task = rl.ParityTask(o)
    assert task.prompts.shape == (9, 2) and task.prompts.min() == 10 and task.prompts.max() == 12
    prompts = torch.tensor([[10, 11], [10, 12]])                    # sums 21 (odd), 22 (even)
    answers = torch.tensor([[[3], [4], [5]], [[3], [4], [6]]])      # [P=2, G=3, T=1]
    assert task.reward(prompts, answers).tolist() == [[1, 0, 1], [0, 1, 1]]


def test_group_advantages():
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    a = rl.group_advantages(r)
    assert torch.allclose(a[0].mean(), torch.tensor(0.0)) and a[0, 0] > 0 > a[0, 1]
    assert torch.allclose(a[0].std(), torch.tensor(1.0), atol=1e-4)
    assert torch.equal(a[1], torch.zeros(4))                         # no signal in an all-equal group


class _Tiny(torch.nn.Module):
    """logits = a table lookup: position t's logits depend on token t only."""

    def __init__(self, vocab=8):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab) * 0.1)

    def forward(self, input_ids):
        return types.SimpleNamespace(logits=self.table[input_ids])


def test_clipped_pg_loss_on_policy_is_the_policy_gradient():
    torch.manual_seed(0)
    m = _Tiny()
    prompts = torch.tensor([[1, 2], [3, 4]])
    answers = torch.tensor([[5], [6]])
    with torch.no_grad():
        old = m(torch.cat([prompts, answers], 1)).logits[:, 1].log_softmax(-1).gather(1, answers)
    adv = torch.tensor([1.0, -1.0])
    loss, st = rl.clipped_pg_loss(m, prompts, answers, old, adv, clip=0.2)
    assert abs(loss.item()) < 1e-6 and st["logratio_max"] < 1e-6 and st["clip_frac"] == 0.0
    loss.backward()
    g = m.table.grad.clone()
    m.table.grad = None
    lp = m(torch.cat([prompts, answers], 1)).logits[:, 1].log_softmax(-1).gather(1, answers)[:, 0]
    (-(adv * lp).mean()).backward()
    assert torch.allclose(g, m.table.grad)                            # ratio 1: the REINFORCE gradient


def test_clipped_pg_loss_clips():
    m = _Tiny()
    prompts, answers = torch.tensor([[1, 2]]), torch.tensor([[5]])
    with torch.no_grad():
        lp = m(torch.cat([prompts, answers], 1)).logits[:, 1].log_softmax(-1).gather(1, answers)
    # the rollout policy gave the token less probability: ratio e^0.5 > 1.2, positive advantage -> clipped, no gradient
    loss, st = rl.clipped_pg_loss(m, prompts, answers, lp - 0.5, torch.tensor([1.0]), clip=0.2)
    assert st["clip_frac"] == 1.0 and abs(st["logratio_max"] - 0.5) < 1e-5
    loss.backward()
    assert torch.count_nonzero(m.table.grad) == 0
    assert loss.item() == pytest.approx(-1.2)


def test_options_and_flags():
    o = rl.options_from_argv(["--steps", "3", "--lr", "1e-6", "--changes", "--tag", "x"])
    assert (o.steps, o.lr, o.changes, o.verify, o.name) == (3, 1e-6, True, True, "x")
    assert rl.RLOptions(lr=1e-5).name == "lr1e-05"
    for bad in ({"group": 1}, {"lr": 0.0}, {"clip": 1.5}, {"steps": 0}, {"first_token": 8190, "values": 4}):
        with pytest.raises(ValueError):
            rl.RLOptions(**bad)
    cfg = rl.RLOptions().model_config()
    assert cfg.hf["num_hidden_layers"] == 2 and cfg.vocab_size == 8192


def test_command_line_rl_help():
    from weight_transfer.experiments.command import build_parser

    ap = build_parser(["rl", "--help"])
    sub = next(a for a in ap._actions if a.dest == "cmd").choices["rl"]
    flags = {s for a in sub._actions for s in a.option_strings}
    assert {"--steps", "--lr", "--group", "--changes", "--no-verify", "--out-dir"} <= flags
    from weight_transfer.experiments.command import main

    assert main(["rl", "--group", "1"]) == 2                          # refused before any process


def test_change_rows_tidy_csv_and_summary(tmp_path):
    torch.manual_seed(0)
    old = {"model.layers.0.self_attn.q_proj.weight": torch.randn(256, 256) * 0.02,
           "model.layers.0.input_layernorm.weight": torch.ones(256),
           "model.embed_tokens.weight": torch.randn(64, 256) * 0.02}
    new = {n: t.clone() for n, t in old.items()}
    new["model.layers.0.self_attn.q_proj.weight"][0, 0] += 0.01       # one element of one 128x128 block
    rows = rl.change_rows(1e-5, 1, old, new)
    by = {(r["kind"], r["granularity"]): r for r in rows}
    assert by[("attention", "bf16_elems")]["changed"] == 1 and by[("attention", "fp8_blocks")]["changed"] >= 1
    assert by[("norms", "bf16_elems")]["changed"] == 0 and by[("embeddings", "bf16_rows")]["changed"] == 0
    assert by[("all", "bf16_elems")]["total"] == 256 * 256 + 256 + 64 * 256
    path = tmp_path / "rl_changes.csv"
    rl.write_change_rows(path, 1e-5, rows)
    rl.write_change_rows(path, 1e-6, rl.change_rows(1e-6, 1, old, old))
    rl.write_change_rows(path, 1e-5, rows)                            # replaces 1e-5's rows, keeps 1e-6's
    got = list(csv.DictReader(open(path)))
    assert len(got) == 2 * len(rows) and list(got[0]) == rl.CHANGE_COLUMNS
    from weight_transfer.analysis.rl import changes_markdown, changes_summary, plot_changes

    s = changes_summary(path)
    assert set(s["lr"]) == {1e-5, 1e-6}
    md = changes_markdown(path)
    assert "**lr 1e-05**" in md and "| attention |" in md and "fp8_blocks" in md
    assert plot_changes(path, tmp_path / "c.png").stat().st_size > 0


def test_magnitude_rows_predict_bf16_changes():
    torch.manual_seed(0)
    w = {"model.layers.0.mlp.up_proj.weight": torch.randn(512, 512) * 0.02,
         "model.norm.weight": torch.ones(512)}
    rows = {r["kind"]: r for r in rl.magnitude_rows(w, lrs=(1e-6, 1e-5))}
    assert rows["norms"]["median_ulp"] == 2.0 ** -7 and rows["norms"]["median_abs"] == 1.0
    mlp = rows["mlp"]
    assert 0.018 < mlp["std"] < 0.022
    assert mlp["pred_frac_lr1e-06"] < mlp["pred_frac_lr1e-05"] < 1
    # measured: one step of exactly lr on every element changes about the predicted fraction
    x = w["model.layers.0.mlp.up_proj.weight"]
    for lr in (1e-6, 1e-5):
        changed = (x.to(torch.bfloat16) != (x + lr).to(torch.bfloat16)).float().mean().item()
        assert changed == pytest.approx(mlp[f"pred_frac_lr{lr:g}"], rel=0.15)


def test_delta_push_mode_overrides_and_table(tmp_path):
    """--delta: the backend options it asks for; a "full" push sets the executor's delta state
    aside and gives it back (a failed one makes the next delta full, C26); the table's p50s."""
    import pytest

    from weight_transfer.delta.runs import DeltaState
    from weight_transfer.experiments import rl

    assert rl.transfer_overrides(rl.RLOptions()) is None
    assert rl.transfer_overrides(rl.RLOptions(delta=True, delta_op_cost=-1)) == {
        "delta": True, "delta_granularity": None, "delta_op_cost": None, "delta_mode": "auto", "delta_format": "auto",
        "delta_wire_gbps": None,
        "delta_landing": 0.25}
    assert rl.transfer_overrides(rl.RLOptions(delta=True, delta_mode="packed", delta_wire_gbps=0.5))["delta_mode"] == "packed"
    with pytest.raises(ValueError):
        rl.RLOptions(delta_op_cost=-2)
    d = DeltaState([], device="cpu")
    d.full_reason = None
    ex = type("E", (), {"delta": d})()
    with rl.push_mode(ex, "full"):
        assert ex.delta is None
    assert ex.delta is d and d.full_reason is None
    with rl.push_mode(ex, "delta"):
        assert ex.delta is d
    with pytest.raises(RuntimeError), rl.push_mode(ex, "full"):
        raise RuntimeError("a write failed")
    assert ex.delta is d and "failed" in d.full_reason
    o = rl.RLOptions(delta=True, lr=1e-6, out_dir=str(tmp_path))
    u = type("U", (), {"version": 2, "seconds": 0.2, "write_seconds": 0.1, "bytes": 10, "n_writes": 4, "stats": {}})()
    rows = [rl.push_row(o, 1, "full", True, u, {"ok": True})]
    u.bytes, u.seconds = 1, 0.4
    rows.append(rl.push_row(o, 1, "delta", False, u, {"ok": True}))
    rows[0]["full_bytes"] = rows[1]["full_bytes"] = 10
    text = rl.delta_table(rl.save_pushes(o, rows))
    assert "delta/full p50: 2.000x seconds" in text and "0.1000x bytes" in text
    # the per-phase seconds and the modes of a delta push, from its ranks' step records and the commits
    from weight_transfer.pipeline.records import StepStats

    st = StepStats(rank=0, delta="delta", delta_compare_s=0.01, delta_pack_s=0.002, delta_wire_s=0.003,
                   delta_modes={"packed": {"mlp": [2, 100, 1000]}, "full": {"norms": [1, 50, 50]}},
                   delta_tensors=[("model.layers.0.mlp.down_proj.weight", "mlp", "packed", 1000, 100, 7)])
    u.stats = {0: st}
    row = rl.push_row(o, 2, "delta", True, u, {"ok": True}, [{"delta_apply_s": 0.004}, {}])
    assert (row["delta_pack_s"], row["delta_apply_s"], row["n_packed"], row["bytes_packed"], row["out_bytes_full"]) == \
        (0.002, 0.004, 2, 100, 50) and row["tensors"][0]["mode"] == "packed"
    row["full_bytes"] = 10
    text = rl.delta_table(rl.save_pushes(o, rows + [row]))
    assert "pack 0.0020" in text and "apply 0.0040" in text and "packed " in text
    assert (tmp_path / rl.TENSOR_CSV).read_text().count("down_proj") == 1


def _exit_with(code, delay):
    import time as _t

    _t.sleep(delay)
    raise SystemExit(code)


def test_supervise_stops_the_other_trainers_when_one_fails():
    """A trainer that fails (exit 3) gets its peer, which would wait for it forever, terminated;
    all succeeding return 0."""
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_exit_with, args=(3, 0.2)), ctx.Process(target=_exit_with, args=(0, 600))]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    assert rl.supervise(procs, poll=0.05) != 0
    assert time.monotonic() - t0 < 60 and not any(p.is_alive() for p in procs)
    assert procs[0].exitcode == 3 and procs[1].exitcode != 0  # terminated
    ok = [ctx.Process(target=_exit_with, args=(0, 0.1)) for _ in range(2)]
    for p in ok:
        p.start()
    assert rl.supervise(ok, poll=0.05) == 0


def _gloo_rank(rank: int, port: int, q) -> None:
    """One of two training ranks exchanging what the RL loop exchanges (as data, over gloo)."""
    import torch.distributed as dist

    import weight_transfer as wt

    store = wt.connect_store(("127.0.0.1", port), timeout=30)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2)
    try:
        names = rl.broadcast(["b.weight", "a.weight"] if rank == 0 else None)
        batch = None
        if rank == 0:
            batch = {"answers": torch.arange(24).view(2, 3, 4), "logprobs": torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)),
                     "versions": {(("3", 0, 1),)}, "seconds": 0.5}
        got = rl.broadcast_rollout(batch)
        check = collectives.all_gather(({"a.weight": f"d{rank}"}, [([1, 2], [-0.5, float("-inf")])], None if rank else True, [],
                               100 + rank), type_=collectives._CheckMsg)
        q.put((rank, names, got["answers"].tolist(), got["logprobs"].tolist(), got["versions"], got["seconds"], check))
    finally:
        dist.destroy_process_group()


def test_training_ranks_exchange_data_not_pickles():
    """What the RL loop's two training ranks send each other over their gloo group (the engine's
    tensor names, rank 0's rollout, each rank's oracle check) arrives as sent, tensors bit for
    bit, through msgpack; a message that is not what the receiver expects is refused."""
    import multiprocessing as mp

    import msgspec

    import weight_transfer as wt

    store = wt.serve_store("127.0.0.1", 0, timeout=60)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, store.port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = dict((r[0], r[1:]) for r in (q.get(timeout=120), q.get(timeout=120)))
    finally:
        for p in procs:
            p.join(30)
    want_lp = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)).tolist()
    checks = [({"a.weight": "d0"}, [([1, 2], [-0.5, float("-inf")])], True, [], 100),
              ({"a.weight": "d1"}, [([1, 2], [-0.5, float("-inf")])], None, [], 101)]
    for r in (0, 1):
        names, answers, lps, versions, seconds, check = out[r]
        assert names == ["b.weight", "a.weight"] and answers == torch.arange(24).view(2, 3, 4).tolist()
        assert lps == want_lp and versions == {(("3", 0, 1),)} and seconds == 0.5
        assert check == checks
    assert all(p.exitcode == 0 for p in procs)
    with pytest.raises(ValueError, match="refused"):
        collectives._decode(msgspec.msgpack.encode({"answers": 1}), collectives._Rollout, "a test message")
    t = collectives.TensorData("bfloat16", (2, 2), b"\x00" * 6)
    with pytest.raises(ValueError, match="8 bytes, got 6"):
        t.tensor()
