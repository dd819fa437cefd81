"""The static schedule: every destination byte written exactly once, senders inside the
owning mesh, balanced, deterministic; refusals name the tensors (C3, C12)."""
import re

import pytest

from tests.helpers.planning import MOE, SMALL, check_exact_cover, dest_metas, fsdp_metas
from weight_transfer.options import PlanOptions
from weight_transfer.plan import build_recipes, mesh_groups, plan
from weight_transfer.testing.catalog import load_config
from weight_transfer.types import InferenceLayout, ParamMeta, PlanError


@pytest.mark.parametrize("layout", [InferenceLayout(tp=1), InferenceLayout(tp=2), InferenceLayout(tp=4),
                                    InferenceLayout(tp=2, dp=2), InferenceLayout(tp=2, quant="fp8")])
def test_dense_plan_covers_every_byte_once(layout):
    cfg = load_config("qwen3-0.6b", **SMALL)
    dests = dest_metas(cfg, layout)
    sched = plan(build_recipes(cfg, layout), fsdp_metas(cfg, 3), dests)
    check_exact_cover(sched, dests)
    assert sched.total_bytes == sum(m.nbytes for ms in dests.values() for m in ms)


def test_moe_ep_fp8_plan_and_small_chunks():
    cfg = load_config("qwen3-30b-a3b", **MOE)
    layout = InferenceLayout(tp=4, ep=True, quant="fp8")
    dests = dest_metas(cfg, layout)
    sched = plan(build_recipes(cfg, layout), fsdp_metas(cfg, 2), dests, max_chunk_bytes=8 << 10)
    check_exact_cover(sched, dests)


def test_c12_uneven_30_ranks_and_2d_mesh():
    cfg = load_config("qwen3-0.6b", **{**SMALL, "hidden_size": 4096, "intermediate_size": 128,
                                       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
                                       "num_hidden_layers": 1, "vocab_size": 64})
    layout = InferenceLayout(tp=2)
    dests = dest_metas(cfg, layout)
    metas = fsdp_metas(cfg, 30)
    # dim 4096 over 30 ranks: 29 x 137 + 123; a 64-row tensor leaves ranks 22.. empty
    norm = [m for m in metas[29] if m.name == "model.norm.weight"][0]
    assert norm.local_shape == (123,)
    assert [m for m in metas[29] if m.name == "model.layers.0.self_attn.q_norm.weight"][0].local_shape == (0,)
    sched = plan(build_recipes(cfg, layout), metas, dests)
    check_exact_cover(sched, dests)
    senders = {r for r, p in sched.rank_plans.items() if p.send_bytes}
    assert len(senders) > 10  # writes spread over the mesh, not funneled
    m2 = fsdp_metas(cfg, 4, placements=("Shard(dim=0)", "Shard(dim=0)"), mesh_shape=(2, 2))
    check_exact_cover(plan(build_recipes(cfg, layout), m2, dests), dests)


def test_balanced_and_deterministic():
    cfg = load_config("qwen3-0.6b", **SMALL)
    layout = InferenceLayout(tp=2, dp=2)
    dests = dest_metas(cfg, layout)
    a = plan(build_recipes(cfg, layout), fsdp_metas(cfg, 4), dests, max_chunk_bytes=64 << 10)
    b = plan(build_recipes(cfg, layout), fsdp_metas(cfg, 4), dests, max_chunk_bytes=64 << 10)
    assert a.rank_plans == b.rank_plans
    biggest = max(asg.nbytes for p in a.rank_plans.values() for t in p.tasks for asg in t.assignments)
    s = a.send_bytes
    assert max(s.values()) - min(s.values()) <= biggest


def test_task_order_identical_on_every_rank_of_a_mesh():
    cfg = load_config("qwen3-0.6b", **SMALL)
    layout = InferenceLayout(tp=2)
    sched = plan(build_recipes(cfg, layout), fsdp_metas(cfg, 3), dest_metas(cfg, layout))
    orders = {r: [(t.id, t.sources) for t in p.tasks] for r, p in sched.rank_plans.items()}
    assert orders[0] == orders[1] == orders[2]


def test_c3_missing_training_parameter_refused_naming_it():
    cfg = load_config("qwen3-0.6b", **SMALL)
    layout = InferenceLayout(tp=2)
    missing = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(PlanError, match=missing.replace(".", r"\.")):
        plan(build_recipes(cfg, layout), fsdp_metas(cfg, 2, drop=(missing,)), dest_metas(cfg, layout))


def test_c2_extra_training_parameter_refused_naming_it():
    from weight_transfer.model_config import ParamSpec

    cfg = load_config("qwen3-0.6b", **SMALL)
    layout = InferenceLayout(tp=2)
    extra = ParamSpec(name="model.layers.0.mlp.bias_adapter.weight", shape=(8, 8))
    with pytest.raises(PlanError, match="bias_adapter"):
        plan(build_recipes(cfg, layout), fsdp_metas(cfg, 2, extra=(extra,)), dest_metas(cfg, layout))


def test_inconsistent_training_metadata_named():
    cfg = load_config("qwen3-0.6b", **SMALL)
    layout = InferenceLayout(tp=2)
    metas = fsdp_metas(cfg, 2)
    metas[1] = [m for m in metas[1] if m.name != "model.norm.weight"]
    with pytest.raises(PlanError, match=r"model\.norm\.weight: mesh ranks \[1\] did not publish it"):
        plan(build_recipes(cfg, layout), metas, dest_metas(cfg, layout))


def test_mesh_groups_disjoint_meshes_share_a_group():
    g = mesh_groups([(0, 1, 2, 3), (0, 2), (1, 3), (0, 1, 2, 3)])
    assert g == {(0, 1, 2, 3): 0, (0, 2): 1, (1, 3): 1}


def test_local_writes_read_only_own_rows():
    """Recipes are cut at shard boundaries and sent by a rank that holds the rows, with no
    gather; quantized recipes whose rows change hands inside a 128-row block (3 ranks over
    256 rows here) keep the gather (tests/plan/test_local.py covers the aligned case)."""
    cfg = load_config("qwen3-0.6b", **{**SMALL, "vocab_size": 1001})
    for layout in (InferenceLayout(tp=2), InferenceLayout(tp=2, quant="fp8")):
        dests = dest_metas(cfg, layout)
        metas = fsdp_metas(cfg, 3)
        sched = plan(build_recipes(cfg, layout), metas, dests, local_min_bytes=0)
        check_exact_cover(sched, dests)
        n_local = 0
        for r, rp in sched.rank_plans.items():
            own = {m.name: m.local_shape for m in metas[r]}
            for t in rp.tasks:
                if t.local_sources:
                    n_local += 1
                    assert t.sources == () and t.source_bytes == 0
                    for a in t.assignments:
                        assert a.recipe.transform == "copy" or a.recipe.shape[-2] % 128 == 0
                        for p in a.recipe.pieces:
                            if p.source is not None:  # local coordinates inside this rank's shard
                                assert 0 <= p.src_box[0][0] < p.src_box[0][1] <= own[p.source][0]
                else:
                    assert all(a.recipe.transform == "fp8_block" for a in t.assignments) or layout.quant is None
        assert n_local > 0
        if layout.quant is None:  # everything is a copy: no task gathers
            assert all(not t.sources for rp in sched.rank_plans.values() for t in rp.tasks)
    gathered = plan(build_recipes(cfg, InferenceLayout(tp=2)), fsdp_metas(cfg, 3), dest_metas(cfg, InferenceLayout(tp=2)),
                    local_writes=False)
    assert all(t.sources and not t.local_sources for rp in gathered.rank_plans.values() for t in rp.tasks)


def test_local_writes_with_replicated_rows_hsdp():
    cfg = load_config("qwen3-0.6b", **SMALL)
    layout = InferenceLayout(tp=2)
    dests = dest_metas(cfg, layout)
    metas = fsdp_metas(cfg, 4, placements=("Replicate()", "Shard(dim=0)"), mesh_shape=(2, 2))
    sched = plan(build_recipes(cfg, layout), metas, dests, local_min_bytes=0)
    check_exact_cover(sched, dests)
    assert sum(1 for p in sched.rank_plans.values() if p.send_bytes) == 4  # replicas share the sending


def test_small_tensors_are_cut_unless_that_takes_many_tiny_writes():
    """A norm on 3 FSDP ranks into 2 TP ranks: cut into 3 bands x 2 receivers = 6 writes, with no
    collective, under the default ``local_max_writes`` (16); gathered once the cut would take
    more writes than allowed (the reason names the bound); a tensor at or past
    ``local_min_bytes`` is cut whatever it costs."""
    cfg = load_config("qwen3-0.6b", **SMALL)
    layout = InferenceLayout(tp=2)
    recipes, metas, dests = build_recipes(cfg, layout), fsdp_metas(cfg, 3), dest_metas(cfg, layout)

    def norm_tasks(sched):
        return [t for rp in sched.rank_plans.values() for t in rp.tasks
                if "model.norm.weight" in t.sources or any(a.recipe.name.startswith("model.norm.weight")
                                                         for a in t.assignments)]

    cut = plan(recipes, metas, dests)
    check_exact_cover(cut, dests)
    tasks = norm_tasks(cut)
    assert tasks and all(t.local_sources and not t.sources for t in tasks)
    assert sum(len(a.recipe.ranks) for t in tasks for a in t.assignments) == 6
    assert not any("writes" in g[0] for g in cut.gathers)
    for writes in (5, 0):
        gathered = plan(recipes, metas, dests, local_max_writes=writes)
        check_exact_cover(gathered, dests)
        tasks = norm_tasks(gathered)
        assert tasks and all(not t.local_sources and t.sources == ("model.norm.weight",) for t in tasks)
        assert any(f"more than {writes} writes" in g[0] for g in gathered.gathers)
    big = plan(recipes, metas, dests, local_min_bytes=1, local_max_writes=0)
    assert all(t.local_sources for t in norm_tasks(big))
    with pytest.raises(ValueError, match="local_max_writes"):
        PlanOptions(local_max_writes=-1)


def _planned(metas, cfg, layout, **kw):
    return plan(build_recipes(cfg, layout), metas, dest_metas(cfg, layout), **kw)


@pytest.mark.parametrize("parallel", [False, True], ids=["in-process", "forked-checks"])
@pytest.mark.parametrize("case", ["shape", "dtype", "mesh", "placements", "duplicate", "outside", "shards"])
def test_every_metadata_inconsistency_is_named(case, parallel):
    """Each check of the training metadata fires on one bad record among many ranks that
    agree, and names the parameter (or rank): the checks compare whole rank lists at once.
    With ``parallel_checks`` the checks run in a forked child and its error is raised here."""
    from dataclasses import replace

    cfg = load_config("qwen3-0.6b", **SMALL)
    layout = InferenceLayout(tp=2)
    metas = fsdp_metas(cfg, 4)
    name = "model.layers.1.mlp.down_proj.weight"
    i = next(k for k, m in enumerate(metas[2]) if m.name == name)
    m = metas[2][i]
    want = re.escape(name)
    if case == "shape":
        metas[2][i] = replace(m, global_shape=(m.global_shape[0] + 4, m.global_shape[1]))
    elif case == "dtype":
        metas[2][i] = replace(m, dtype="float32")
    elif case == "mesh":
        metas[2][i] = replace(m, mesh_ranks=(0, 1, 2, 5))
    elif case == "placements":
        metas[2][i] = replace(m, placements=("Replicate()",))
    elif case == "duplicate":
        metas[2].append(m)
        want = rf"rank 2 publishes {re.escape(name)} more than once"
    elif case == "outside":
        metas[7] = [replace(m, local_shape=(0, m.local_shape[1]))]
        want = rf"rank 7 publishes {re.escape(name)} but is not in its mesh"
    elif case == "shards":
        metas[2][i] = replace(m, local_shape=(m.local_shape[0] - 1, m.local_shape[1]))
        want = rf"{re.escape(name)}: shards hold"
    with pytest.raises(PlanError, match=want):
        _planned(metas, cfg, layout, parallel_checks=parallel)


def test_metadata_as_the_controller_receives_it_plans_identically():
    """Rank lists that went through pickle (as weight_transfer.control.protocol.put/get move them) hold their
    own copies of every shape and mesh; the checks then compare values, and the schedule is the
    same as on shared objects."""
    import pickle

    cfg = load_config("qwen3-30b-a3b", **MOE)
    layout = InferenceLayout(tp=2, ep=True, quant="fp8")
    metas = fsdp_metas(cfg, 4, placements=("Replicate()", "Shard(dim=0)"), mesh_shape=(2, 2))
    received = {r: pickle.loads(pickle.dumps(ms)) for r, ms in metas.items()}
    assert received[1][0].mesh_ranks is not received[2][0].mesh_ranks
    a, b = _planned(metas, cfg, layout), _planned(received, cfg, layout)
    assert a.rank_plans == b.rank_plans and a.send_bytes == b.send_bytes and a.recv_bytes == b.recv_bytes
    from dataclasses import replace

    for bad in (dict(global_shape=(7, 7)), dict(mesh_ranks=((0, 1), (3, 2)))):
        wrong = {r: list(ms) for r, ms in received.items()}
        wrong[3][5] = replace(wrong[3][5], **bad)
        with pytest.raises(PlanError, match=re.escape(wrong[3][5].name) + ": rank 3 publishes"):
            _planned(wrong, cfg, layout)


def test_fast_constructors_equal_the_dataclass_ones():
    from weight_transfer.plan.fast import _assignment, _task, _write_spec
    from weight_transfer.types import Assignment, Task, WriteSpec

    cfg = load_config("qwen3-0.6b", **SMALL)
    rec = build_recipes(cfg, InferenceLayout(tp=1)).recipes[0]
    w = _write_spec(1, 2, 3, 4)
    assert w == WriteSpec(1, 2, 3, 4) and type(w) is WriteSpec and w.length == 4
    a = _assignment(rec, (w,))
    assert a == Assignment(rec, (w,)) and a.nbytes == 4
    t = _task(7, 1, ("x",), (0, 1), (a,), 10, 14, ())
    assert t == Task(7, 1, ("x",), (0, 1), (a,), 10, 14) and t.send_bytes == 4
    from weight_transfer.plan.fast import _piece, _recipe
    from weight_transfer.types import Piece, Recipe

    pc = _piece("a", ((0, 2), (0, 3)), ((1, 3), (0, 3)))
    want = Piece("a", ((0, 2), (0, 3)), ((1, 3), (0, 3)))
    assert pc == want and type(pc) is Piece and hash(pc) == hash(want)
    fields = (rec.name, rec.ranks, rec.shape, rec.assembled_dtype, rec.pieces, rec.transform, rec.outputs)
    r2 = _recipe(*fields)
    assert r2 == Recipe(*fields) == rec and type(r2) is Recipe and repr(r2) == repr(rec)


def test_sender_choice_equals_the_policy():
    """The sender choice (``_greedy.c``, and :func:`_greedy_py`, its Python fallback) is
    :func:`least_loaded` -- ties on bytes sent and on bytes to the receiver included -- write
    by write, largest first, on random tasks with overlapping candidate sets and receivers."""
    import random

    import numpy as np

    from weight_transfer.plan import assign as A

    rng = random.Random(0)
    for trial in range(30):
        n_slots, n_dst = rng.randint(2, 12), rng.randint(1, 5)
        tasks = []
        for _ in range(rng.randint(1, 6)):
            recs = []
            for _ in range(rng.randint(0, 5)):
                cands = tuple(sorted(rng.sample(range(n_slots), rng.randint(1, n_slots))))
                dsts = tuple(sorted(rng.sample(range(n_dst), rng.randint(1, n_dst))))
                recs.append((rng.choice((1, 2, 2, 4)), cands, dsts))  # equal sizes: ties
            tasks.append(recs)
        # the definition, item by item
        send, pair = [0] * n_slots, [[0] * n_slots for _ in range(n_dst)]
        want = []
        g0 = 0
        for recs in tasks:
            items = sorted((-nb, g0 + ri, d) for ri, (nb, _, ds) in enumerate(recs) for d in ds)
            for negb, g, d in items:
                r = A.least_loaded(recs[g - g0][1], send, pair[d])
                send[r] -= negb
                pair[d][r] -= negb
                want.append((g, d, r))
            g0 += len(recs)
        flat = [x for recs in tasks for x in recs]
        per_rec = [len(ds) for _, _, ds in flat]
        item_rec = np.repeat(np.arange(len(flat), dtype=np.int32), per_rec)
        item_dst = np.array([d for _, _, ds in flat for d in ds], np.int32)
        rec_start = np.cumsum([0] + per_rec)
        task_start = rec_start[np.cumsum([0] + [len(t) for t in tasks])].astype(np.int64)
        rec_nb = np.array([nb for nb, _, _ in flat], np.int64)
        dst_slot = np.arange(n_dst, dtype=np.int32)
        for native in (True, False):
            if native and A._native() is None:
                continue
            fn = A._native
            if not native:
                A._native = lambda: None
            try:
                order, sender, s_, _ = A._choose(task_start, item_rec, item_dst, rec_nb, [c for _, c, _ in flat],
                                                 dst_slot, n_slots, n_dst)
            finally:
                A._native = fn
            got = {(int(item_rec[i]), int(item_dst[i])): int(sender[i]) for i in range(len(item_rec))}
            assert got == {(g, d): r for g, d, r in want}, (trial, native)
            assert s_.tolist() == send
            # per task, grouped by sender, then recipe
            for t in range(len(tasks)):
                seg = order[task_start[t]:task_start[t + 1]].tolist()
                keys = [(int(sender[i]), int(item_rec[i])) for i in seg]
                assert keys == sorted(keys)


def test_row_owners_equal_reading_every_record():
    """:func:`weight_transfer.plan.owners.row_owners` against reading each record one by one: two
    name sequences (HSDP non-experts on every rank, experts on sub-meshes), an empty shard,
    a column-sharded and a 0-d parameter (no owners)."""
    from weight_transfer.plan.owners import local_offset, row_owners
    from weight_transfer.plan.sources import _index_sources

    def meta(name, shape, mesh, pl, off, loc):
        return ParamMeta(name=name, global_shape=shape, dtype="bfloat16", mesh_ranks=mesh, placements=pl,
                         local_offset=off, local_shape=loc)

    full, col0, col1 = ((0, 1), (2, 3)), (0, 2), (1, 3)
    metas = {}
    for r in range(4):
        j = r % 2  # HSDP: rows split over the 2 ranks of a node, replicated across nodes
        ms = [meta("w", (8, 4), full, ("Replicate()", "Shard(dim=0)"), (4 * j, 0), (4, 4)),
              meta("odd", (3, 4), full, ("Replicate()", "Shard(dim=0)"), (2 * j, 0), (2 - j, 4)),
              meta("c", (4, 8), full, ("Replicate()", "Shard(dim=1)"), (0, 4 * j), (4, 4)),
              meta("s", (), full, ("Replicate()", "Replicate()"), (), ())]
        ms += [meta(f"e{e}", (6, 2), col0 if e % 2 == 0 else col1, ("Shard(dim=0)",), (3 * (r // 2), 0), (3, 2))
               for e in range(4) if e % 2 == j]
        ms += [meta("tiny", (1, 2), full, ("Replicate()", "Shard(dim=0)"), (min(j, 1), 0), (1 - j, 2))]
        metas[r] = ms
    ix = _index_sources(metas)
    names = {m.name for ms in metas.values() for m in ms}
    owners, keys = row_owners(ix, names)
    want: dict = {}
    for r in sorted(metas):
        for m in metas[r]:
            if m.global_shape and set(m.placements) <= {"Shard(dim=0)", "Replicate()"} and m.local_shape[0] > 0 \
                    and all(m.local_shape):
                want.setdefault(m.name, []).append((m.local_offset[0], m.local_offset[0] + m.local_shape[0], r))
    assert owners == want
    assert "c" not in keys and "s" not in keys and "tiny" in keys and "tiny" in owners
    for a in keys:
        for b in keys:
            assert (keys[a] == keys[b]) == (owners.get(a) == owners.get(b)), (a, b)
    assert keys["e0"] == keys["e2"] != keys["e1"]
    assert all(local_offset(ix, m.name, r) == m.local_offset[0] for r, ms in metas.items() for m in ms if m.global_shape)


def _same_schedule(a, b):
    return (a.rank_plans == b.rank_plans and a.send_bytes == b.send_bytes and a.recv_bytes == b.recv_bytes
            and a.n_tasks == b.n_tasks and a.n_groups == b.n_groups)


def _moe_world(n=4):
    cfg = load_config("qwen3-30b-a3b", **MOE)
    layout = InferenceLayout(tp=2, ep=True, quant="fp8")
    return cfg, layout, fsdp_metas(cfg, n, placements=("Replicate()", "Shard(dim=0)"), mesh_shape=(2, 2))


def test_forked_checks_give_the_same_schedule():
    """plan(parallel_checks=True) checks in a forked child while it builds the schedule; the
    schedule is the one the in-process path makes, on shared and on unpickled metadata."""
    import pickle

    cfg, layout, metas = _moe_world()
    a = _planned(metas, cfg, layout, parallel_checks=False)
    assert _same_schedule(a, _planned(metas, cfg, layout, parallel_checks=True))
    received = {r: pickle.loads(pickle.dumps(ms)) for r, ms in metas.items()}
    assert _same_schedule(a, _planned(received, cfg, layout, parallel_checks=True))


@pytest.mark.parametrize("bad", ["missing-source", "unused-source", "unknown-dest"])
def test_forked_checks_raise_the_validation_errors(bad):
    """Recipe validation runs in the child too: its PlanError reaches the caller unchanged, also
    when the schedule's construction fails on the same bad input first."""
    from weight_transfer.model_config import ParamSpec

    cfg = load_config("qwen3-0.6b", **SMALL)
    layout = InferenceLayout(tp=2)
    rs, dests = build_recipes(cfg, layout), dest_metas(cfg, layout)
    if bad == "missing-source":
        metas, want = fsdp_metas(cfg, 3, drop=("model.layers.1.self_attn.k_proj.weight",)), r"lacks parameter .*k_proj"
    elif bad == "unused-source":
        metas, want = fsdp_metas(cfg, 3, extra=(ParamSpec(name="model.extra.weight", shape=(8, 8)),)), r"model\.extra\.weight"
    else:
        metas = fsdp_metas(cfg, 3)
        dests = {r: [m for m in ms if m.name != "model.norm.weight"] for r, ms in dests.items()}
        want = r"writes 'model\.norm\.weight' on rank 0, which that rank does not have"
    msgs = []
    for parallel in (False, True):
        with pytest.raises(PlanError, match=want) as e:
            plan(rs, metas, dests, parallel_checks=parallel)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]


def test_forked_checks_confirm_the_sampled_name_index():
    """Ranks are first grouped by their length and 17 sampled names; a rank that publishes the
    same names in another order at unsampled positions is caught by the checks (in-process or
    in the forked child) and the plan is redone with the exact index."""
    cfg, layout, metas = _moe_world()
    plain = _planned(metas, cfg, layout, parallel_checks=False)
    metas = {r: list(ms) for r, ms in metas.items()}
    ms = metas[3]
    n = len(ms)
    step = n // 16
    assert step >= 2, "the test needs unsampled positions"
    i = 1 + step  # positions 1 + step and 2 + step are between two sampled positions
    ms[i], ms[i + 1] = ms[i + 1], ms[i]
    from weight_transfer.plan.checks import _check_sources, _index_sources, _IndexUnconfirmed

    with pytest.raises(_IndexUnconfirmed, match="rank 3"):
        _check_sources(metas, _index_sources(metas, exact=False), confirm_index=True)
    _check_sources(metas, _index_sources(metas))
    for parallel in (False, True):  # rank 0 publishes first: the same schedule as without the swap
        assert _same_schedule(plain, _planned(metas, cfg, layout, parallel_checks=parallel))


@pytest.mark.parametrize("how", ["crash", "exit", "hang"])
def test_forked_checks_that_fail_rerun_in_process(how, monkeypatch):
    """A checks' child that raises something other than PlanError, dies without an answer, or
    hangs (killed after the wait) is not trusted: the checks run again in this process, with a
    RuntimeWarning, and the schedule is returned only after they pass -- or their error raised."""
    import os
    import time

    import weight_transfer.plan.checks as P

    cfg, layout, metas = _moe_world()
    parent = os.getpid()
    real = P._check_sources

    def flaky(*a, **k):
        if os.getpid() != parent:
            if how == "crash":
                raise RuntimeError("boom")
            if how == "exit":
                os._exit(3)
            time.sleep(120)
        return real(*a, **k)

    monkeypatch.setattr(P, "_check_sources", flaky)
    monkeypatch.setattr(P, "_CHECKS_WAIT_S", 0.5)
    want = {"crash": "crash: Traceback", "exit": "died", "hang": "timeout"}[how]
    with pytest.warns(RuntimeWarning, match=f"checks' child process failed \\({want}"):
        sched = _planned(metas, cfg, layout, parallel_checks=True)
    assert _same_schedule(sched, _planned(metas, cfg, layout, parallel_checks=False))
    metas[2] = [m for m in metas[2] if m.name != "model.norm.weight"]
    with pytest.warns(RuntimeWarning), pytest.raises(PlanError, match=r"model\.norm\.weight: mesh ranks \[2\]"):
        _planned(metas, cfg, layout, parallel_checks=True)


def test_forked_checks_by_default_only_for_large_metadata(monkeypatch):
    import os

    import weight_transfer.plan.checks as P

    _, _, metas = _moe_world()
    assert not P._fork_checks_by_default(metas)  # a few hundred records: in-process
    monkeypatch.setattr(P, "PARALLEL_CHECKS_MIN_RECORDS", 1)
    assert P._fork_checks_by_default(metas) == (len(os.sched_getaffinity(0)) > 1)


def test_plan_leaves_an_embedding_callers_process_alone(monkeypatch):
    """By default plan() forks no child and leaves the garbage collector alone, even at a size
    where the harness's auto policy would fork (a trainer with NCCL or Gloo threads must not be
    forked behind its back); ``pause_gc=True`` pauses and restores the GC state it found."""
    import gc

    import weight_transfer.plan as P

    calls = []
    monkeypatch.setattr(P, "_ForkedChecks", lambda *a, **k: calls.append("fork") or (_ for _ in ()).throw(OSError))
    monkeypatch.setattr(P, "_fork_checks_by_default", lambda metas: True)  # "large": auto would fork
    real_disable = gc.disable
    monkeypatch.setattr(gc, "disable", lambda: calls.append("gc.disable") or real_disable())
    cfg, layout, metas = _moe_world()
    a = _planned(metas, cfg, layout)
    assert calls == [] and gc.isenabled()
    gc.disable()
    try:
        _planned(metas, cfg, layout, pause_gc=True)
        assert not gc.isenabled()                      # it found the GC off: it leaves it off
    finally:
        gc.enable()
    calls.clear()
    with pytest.warns(RuntimeWarning, match=r"cannot fork the checks \(OSError\); checking in this process"):
        b = _planned(metas, cfg, layout, parallel_checks=None, pause_gc=True)   # the harness's choice
    assert calls == ["gc.disable", "fork"] and gc.isenabled() and _same_schedule(a, b)
