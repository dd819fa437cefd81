"""At-scale simulation (experiments/sim): the cost model against hand computation, the
simulated executor's watermark and barrier semantics, and the synthesized metadata against what
a real 2x2 gloo training world publishes."""
import os
import socket

import pytest
import torch.multiprocessing as tmp

from weight_transfer.experiments.sim import metadata, model
from weight_transfer.experiments.sim.configs import SimConfig, get_config
from weight_transfer.experiments.sim.hardware import Hardware
from weight_transfer.plan import RecipeSet, build_recipes, plan
from weight_transfer.testing.catalog import load_config
from weight_transfer.types import DestTensorMeta, InferenceLayout, Output, ParamMeta, Piece, Recipe

SMALL = dict(num_hidden_layers=1, num_experts=4, hidden_size=64, moe_intermediate_size=32,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100)


def _one_write_world(rows=1024, cols=64):
    meta = ParamMeta(name="w", global_shape=(rows, cols), dtype="bfloat16", mesh_ranks=(0,), mesh_dim_names=("x",),
                     placements=("Shard(dim=0)",), local_offset=(0, 0), local_shape=(rows, cols))
    box = ((0, rows), (0, cols))
    rec = Recipe("w@0", (0,), (rows, cols), "bfloat16", (Piece("w", box, box),), "copy", (Output("w", box, "bfloat16"),))
    dest = DestTensorMeta(rank=0, name="w", shape=(rows, cols), dtype="bfloat16", offset=0, nbytes=rows * cols * 2)
    return RecipeSet([rec]), {0: [meta]}, {0: [dest]}


def test_trivial_plan_equals_hand_computed_time():
    rs, tm, dm = _one_write_world()
    sched = plan(rs, tm, dm)
    assert sched.n_tasks == 1 and sched.n_writes == 1
    hw = Hardware()
    res = model.simulate(sched, tm, hw)
    b = 1024 * 64 * 2
    prepare = (3 * b + b) / (hw.hbm_gbs * 1e9) + 2 * hw.kernel_us * 1e-6   # no all-gather: one shard
    write = hw.rdma_msg_us * 1e-6 + b / (hw.nic_gbps * 1e9 / 8) + hw.rdma_latency_us * 1e-6
    assert res.seconds == pytest.approx(prepare + write + hw.release_us * 1e-6, rel=1e-12)
    assert res.stage_busy["write"] == pytest.approx(write, rel=1e-12)
    assert res.floors["nic"] == pytest.approx(b / (hw.nic_line_gbps * 1e9 / 8))
    assert res.seconds > res.floor_seconds


_SMALL_LAYOUT = InferenceLayout(tp=2, dp=2, quant="fp8")


def _small_sched(nodes=2, g=2, layout=_SMALL_LAYOUT, **ov):
    cfg = load_config("qwen3-30b-a3b", **(ov or dict(num_hidden_layers=2, num_experts=8)))
    tm = metadata.train_metas(cfg, nodes, g)
    dm = metadata.dest_metas(cfg, layout)
    return plan(build_recipes(cfg, layout), tm, dm), tm


def _spans(res):
    out = {}
    for r, tid, st, a, b in res.events:
        out.setdefault(r, {}).setdefault(tid, {})[st] = (a, b)
    return out


def test_watermark_bounds_temporary_bytes_and_stage_order():
    sched, tm = _small_sched()
    hw = Hardware(gpus_per_node=2, nics_per_node=2)
    free = model.simulate(sched, tm, hw, watermark=None, record=True)
    temps = [t.temp_bytes for p in sched.rank_plans.values() for t in p.tasks]
    wm = sorted(temps)[len(temps) // 2]          # half the tasks are larger than the watermark
    bounded = model.simulate(sched, tm, hw, watermark=wm, record=True)
    assert free.peak_temp_bytes > max(wm, max(temps))            # unbounded: tasks overlap
    assert bounded.peak_temp_bytes <= max(wm, max(temps))        # bounded, big tasks alone
    one = model.simulate(sched, tm, hw, watermark=1, record=True)  # every task alone
    assert one.peak_temp_bytes == max(temps)
    # per rank: tasks in plan order through prepare -> write -> release, one at a time per stage
    for res in (free, bounded, one):
        for r, tasks in _spans(res).items():
            order = [t.id for t in sched.rank_plans[r].tasks]
            prev = {}
            for tid in order:
                st = tasks[tid]
                assert st["prepare"][1] <= st["write"][0] + 1e-12 <= st["release"][0] + 2e-12
                for s in ("prepare", "write", "release"):
                    assert st[s][0] >= prev.get(s, 0.0) - 1e-12
                    prev[s] = st[s][1]
    # watermark=1: a task is admitted only after the previous one is released
    for r, tasks in _spans(one).items():
        order = [t.id for t in sched.rank_plans[r].tasks]
        for a, b in zip(order, order[1:]):
            assert tasks[b]["prepare"][0] >= tasks[a]["release"][1] - 1e-12


def test_mesh_group_barrier_order():
    sched, tm = _small_sched()
    assert sched.n_groups == 2
    hw = Hardware(gpus_per_node=2, nics_per_node=2, barrier_us=5000.0)
    res = model.simulate(sched, tm, hw, record=True)
    group = {t.id: t.group for p in sched.rank_plans.values() for t in p.tasks}
    prep = [(group[tid], a, b) for _, tid, st, a, b in res.events if st == "prepare"]
    end0 = max(b for g, _, b in prep if g == 0)
    start1 = min(a for g, a, _ in prep if g == 1)
    assert start1 >= end0 + hw.barrier_us * 1e-6 - 1e-12
    # collectives: every rank of a task's mesh starts its prepare at the same time
    starts = {}
    for _, tid, st, a, _ in res.events:
        if st == "prepare":
            starts.setdefault(tid, set()).add(a)
    assert all(len(s) == 1 for s in starts.values())


def test_floor_counts_fabric_all_gathers_and_receivers():
    sched, tm = _small_sched()
    hw = Hardware(gpus_per_node=2, nics_per_node=2)
    res = model.simulate(sched, tm, hw)
    assert res.link_bytes["nic"] >= max(sched.recv_bytes.values())
    assert res.seconds >= res.floor_seconds
    whole = metadata.train_metas(load_config("qwen3-30b-a3b", num_hidden_layers=2, num_experts=8), 2, 2,
                                 layout="expert_whole")
    lay = InferenceLayout(tp=2, dp=2, quant="fp8")
    cfg = load_config("qwen3-30b-a3b", num_hidden_layers=2, num_experts=8)
    s2 = plan(build_recipes(cfg, lay), whole, metadata.dest_metas(cfg, lay))
    r2 = model.simulate(s2, whole, hw)
    assert r2.stage_busy["prepare"] < res.stage_busy["prepare"]   # experts no longer gathered over the fabric


def test_dest_metas_equal_engine_for_every_rank():
    from weight_transfer.engines.engine import engine_tensor_metas

    cfg = load_config("qwen3-30b-a3b", **SMALL)
    for lay in (InferenceLayout(tp=2, dp=3, quant="fp8"), InferenceLayout(tp=2, dp=2, ep=True)):
        dm = metadata.dest_metas(cfg, lay)
        assert all(dm[r] == engine_tensor_metas(cfg, lay, r) for r in range(lay.world_size))
        regs = metadata.regions(dm, 8)
        assert all(d.transport == "sim" and d.length == metadata.region_bytes(dm[r]) for r, d in regs.items())


def test_baselines_and_cli_tiny(tmp_path):
    from weight_transfer.experiments.command import main

    csv = tmp_path / "sim.csv"
    assert main(["simulate", "tiny_qwen3_moe_2x2", "--csv", str(csv)]) == 0
    import pandas as pd

    df = pd.read_csv(csv)
    assert set(df.method) == {"reference", "overlapped_writes", "rank0_funnel", "nccl_broadcast_funnel", "rpc_update_weight"}
    assert df.local_writes.all()
    assert df.simulated.all() and (df.seconds >= df.floor_seconds).all()
    for c in ("method", "model", "n_train", "n_infer", "layout", "bytes", "seconds", "floor_seconds", "busy_write_seconds"):
        assert c in df.columns
    ref = df[df.method == "reference"].seconds.item()
    assert ref < df[df.method == "rank0_funnel"].seconds.item() < df[df.method == "rpc_update_weight"].seconds.item()
    assert main(["simulate", "tiny_qwen3_moe_2x2", "--csv", str(csv), "--gather-all"]) == 0
    ga = pd.read_csv(csv).query("config == 'tiny_qwen3_moe_2x2_gather_all'")
    assert len(ga) == 5 and not ga.local_writes.any()
    with pytest.raises(ValueError):
        get_config("nope")
    with pytest.raises(ValueError):
        SimConfig(name="x", model="kimi-k2", methods=("teleport",))


def test_planner_benchmark_tiny(capsys):
    """--bench-planner plans in fresh subprocesses, on synthesized and on pickled (as
    received) metadata, checks in-process or forked, and reports min / median / max (and the
    checks' child's peak RSS when there is one)."""
    from weight_transfer.experiments.command import main

    assert main(["simulate", "tiny_qwen3_moe_2x2", "--bench-planner", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 fresh subprocess(es)" in out and "plan() wall s: min" in out and "peak RSS" in out
    assert main(["simulate", "tiny_qwen3_moe_2x2", "--bench-planner", "--repeat", "1", "--received"]) == 0
    out = capsys.readouterr().out
    assert "as the controller receives it" in out and "checks' child process" not in out  # tiny: in-process
    assert main(["simulate", "tiny_qwen3_moe_2x2", "--bench-planner", "--repeat", "1", "--checks", "forked"]) == 0
    out = capsys.readouterr().out
    assert "checks forked" in out and "checks' child process" in out


@pytest.mark.parametrize("layout", ["two_group", "expert_whole"])
def test_synthesized_metadata_rank_lists(layout):
    """Built rank by rank (as the controller holds them after unpickling each rank's list):
    each rank lists, in parameter order, every non-expert parameter and exactly its experts."""
    from weight_transfer.experiments.sim import metadata
    from weight_transfer.testing.catalog import param_specs
    from weight_transfer.testing.training import expert_id, is_expert_param

    cfg = load_config("qwen3-30b-a3b", **SMALL)
    tm = metadata.train_metas(cfg, 2, 2, layout=layout)
    order = [s.name for s in param_specs(cfg)]
    dense = [n for n in order if not is_expert_param(n)]
    held: dict[str, list[int]] = {}
    for r, ms in tm.items():
        names = [m.name for m in ms]
        assert names == sorted(names, key=order.index)
        assert [n for n in names if not is_expert_param(n)] == dense
        for m in ms:
            held.setdefault(m.name, []).append(r)
            if is_expert_param(m.name):
                assert r in m.mesh_flat and (layout == "expert_whole" or expert_id(m.name) % 2 == r % 2)
    experts = [n for n in order if is_expert_param(n)]
    assert all(len(held[n]) == (2 if layout == "two_group" else 1) for n in experts)


# ----------------------------------------------------------------------- real 2x2 world


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world_rank(rank, world, port, q, moe_width=None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from weight_transfer.plan.metadata import collect_metas
    from weight_transfer.testing.training import build_two_group_params

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = load_config("qwen3-30b-a3b", **SMALL)
        params = build_two_group_params(cfg, 2, 2, moe_width)
        q.put((rank, collect_metas(params, offloaded=rank % 2 == 1)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("moe_width", [None, 1])
def test_synthesized_metadata_equals_real_2x2_world(moe_width):
    """Every rank's synthesized ParamMeta list equals what build_two_group_params publishes on
    a real 2x2 gloo world: experts sharded across both nodes (MoE mesh width 2, the default)
    or held whole per node group (width 1: two groups of one node)."""
    ctx = tmp.get_context("fork")  # torch is imported already: forking skips 4 imports
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_world_rank, args=(r, 4, port, q, moe_width)) for r in range(4)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=100) for _ in range(4))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    cfg = load_config("qwen3-30b-a3b", **SMALL)
    for off in (False, True):
        syn = metadata.train_metas(cfg, 2, 2, offloaded=off, moe_width=moe_width)
        for r in range(4):
            if (r % 2 == 1) == off:
                assert syn[r] == got[r], r
    # and the planner accepts it
    lay = InferenceLayout(tp=2, dp=2, quant="fp8")
    plan(build_recipes(cfg, lay), metadata.train_metas(cfg, 2, 2, moe_width=moe_width), metadata.dest_metas(cfg, lay))


def test_local_tasks_are_not_collectives():
    """BF16 layouts give *local* tasks (no sources: a rank reads its own shards); each runs on
    its own rank, so the simulation must not wait for the rest of the mesh (it used to stall)."""
    sched, tm = _small_sched(layout=InferenceLayout(tp=2, dp=2))
    local = [(r, t.id) for r, p in sched.rank_plans.items() for t in p.tasks if not t.sources]
    assert local
    res = model.simulate(sched, tm, Hardware(gpus_per_node=2, nics_per_node=2), record=True)
    assert res.seconds > 0 and res.seconds >= res.floor_seconds
    done = {(r, tid) for r, tid, st, _, _ in res.events if st == "release"}
    assert set(local) <= done


@pytest.mark.parametrize("width", [1, 2, 4])
def test_moe_mesh_width_synthesis(width):
    """Experts on sub-meshes of ``width`` nodes: each expert's mesh has ``width`` ranks on
    distinct nodes, one intra-node rank; the expert sub-meshes tile the world; fabric
    all-gather bytes per rank shrink with the width (none at width 1)."""
    from weight_transfer.testing.training import expert_id, is_expert_param

    cfg = load_config("qwen3-30b-a3b", **{**SMALL, "num_experts": 8})
    tm = metadata.train_metas(cfg, 4, 2, moe_width=width)
    first = model.first_metas(tm)
    meshes = {m.mesh_ranks for m in first.values() if is_expert_param(m.name)}
    assert all(len(mr) == width and len({r // 2 for r in mr}) == width and len({r % 2 for r in mr}) == 1 for mr in meshes)
    assert sorted(r for mr in meshes for r in mr) == list(range(8))
    for n, m in first.items():
        if is_expert_param(n):
            e = expert_id(n)
            assert m.mesh_ranks[0] % 2 == e % 2 and (m.mesh_ranks[0] // 2) // width == (e // 2) % (4 // width)
    hw = Hardware(gpus_per_node=2, nics_per_node=2)
    src = model.source_info(first, hw)
    for n in first:
        if is_expert_param(n):
            assert src[n].n == width and src[n].fabric == (width > 1)
    lay = InferenceLayout(tp=2, dp=1, ep=True, quant="fp8")
    sched = plan(build_recipes(cfg, lay), tm, metadata.dest_metas(cfg, lay))
    res = model.simulate(sched, tm, hw)
    assert res.seconds >= res.floor_seconds
    # fabric all-gather bytes, all ranks: each of the w ranks of a sub-mesh receives (w-1)/w
    ag, per_rank = model._task_costs(sched, src, hw)
    fabric = sum(ag[tid][2] * len(t.mesh) for tid, t in {t.id: t for p in sched.rank_plans.values() for t in p.tasks}.items())
    expert_bytes = sum(src[n].nbytes for n in first if is_expert_param(n))
    assert fabric == pytest.approx(expert_bytes * (width - 1), rel=1e-3)
    with pytest.raises(ValueError, match="must divide"):
        metadata.train_metas(cfg, 4, 2, moe_width=3)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_two_group_moe_width_real_run_bit_exact():
    """A real 4-rank trial (2 nodes x 2 GPUs, gloo) with the MoE mesh width 1
    (``--train-mesh 2x2x1``): experts whole per node group, updates verified bit-exact
    against the engine's own load_weights."""
    from weight_transfer.experiments.config import TrialConfig
    from weight_transfer.experiments.trial import run_trial

    moe = dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, vocab_size=1000, hidden_size=128,
               intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    cfg = TrialConfig.from_flat(model="qwen3-30b-a3b", overrides=moe, n_train=4, train_layout="two_group", train_mesh=(2, 2, 1),
                      tp=2, ep=True, quant="fp8", steps=1, warmup=0, timeout=300)
    res = run_trial(cfg)
    assert res.rows and all(r["verified"] is True for r in res.rows), [r.get("verify_error") for r in res.rows]
    with pytest.raises(ValueError, match="must divide"):
        TrialConfig.from_flat(model="qwen3-30b-a3b", n_train=4, train_layout="two_group", train_mesh=(2, 2, 3))


def test_sensitivity_gantt_and_byte_table_tiny(tmp_path, capsys):
    """``simulate --sensitivity`` re-runs the cost model per assumption (x0.5, x2) on the same
    schedule; the per-GPU byte table and the Gantt rows of the recorded ranks are written."""
    import pandas as pd

    from weight_transfer.experiments.command import main
    from weight_transfer.experiments.sim.hardware import SENSITIVITY

    csv = tmp_path / "sim.csv"
    assert main(["simulate", "tiny_qwen3_moe_2x2", "--csv", str(csv), "--sensitivity"]) == 0
    out = capsys.readouterr().out
    assert "per-GPU bytes" in out and "inference GPU receives" in out and "sensitivity of the prediction" in out
    sens = pd.read_csv(tmp_path / "sim_tiny_qwen3_moe_2x2_sensitivity.csv")
    assert set(sens.parameter) == {*SENSITIVITY, "watermark"} and set(sens.factor) == {0.5, 2.0}
    base = sens.base_seconds.iloc[0]
    nic = sens[sens.parameter == "nic_gbps"].set_index("factor").seconds
    assert nic[0.5] > base > nic[2.0]                      # the NIC-bound tiny world follows the NIC rate
    g = pd.read_csv(tmp_path / "sim_tiny_qwen3_moe_2x2_gantt.csv.gz")
    assert set(g["rank"]) == {0, 1, 2, 3} and (g.end >= g.start).all() and set(g.stage) >= {"prepare", "write", "release"}
    assert set(g.method) == {"reference", "overlapped_writes"} and set(sens.writes_in_flight) == {"watermark"}
    for m in ("reference", "overlapped_writes"):
        assert g[g.method == m].end.max() == pytest.approx(pd.read_csv(csv).query(f"method == '{m}'").seconds.item())
    df = pd.read_csv(csv)
    ref = df[df.method == "reference"].iloc[0]
    assert ref.recv_min_bytes <= ref.recv_median_bytes <= ref.recv_max_bytes and ref.recv_max_bytes > 0
    from weight_transfer.analysis.simulation import plot_gantt

    assert plot_gantt(tmp_path / "sim_tiny_qwen3_moe_2x2_gantt.csv.gz").exists()


def test_sglang_pp_broadcast_and_ckpt_engine_hand_computed():
    """The two baselines as they run, against hand computation on one tiny model: SGLang's
    per-PP-stage broadcast is bound by one inference NIC receiving the whole model (or the
    slowest stage's gathers + broadcast); checkpoint-engine's 8 GiB buckets pipeline H2D,
    broadcast and load_weights."""
    cfg = load_config("qwen3-30b-a3b", **SMALL)
    first = model.first_metas(metadata.train_metas(cfg, 2, 2))
    hw = Hardware()
    r = model.sglang_pp_broadcast(first, hw, n_infer=4, recv_bytes=1, pp=1, tp=8, ep=32, bucket_bytes=1 << 40)
    total = sum(model.numel(m.global_shape) * model.itemsize(m.dtype) for m in first.values())
    assert r.floors["nic"] == pytest.approx(total / hw.nic_line_Bps)
    assert r.stage_busy["broadcast"] == pytest.approx(total / hw.nic_Bps + hw.nccl_call_us * 1e-6)
    assert r.seconds == pytest.approx(max(r.stage_busy["gather"] + r.stage_busy["broadcast"], r.stage_busy["broadcast"])
                                      + r.stage_busy["load_weights"])
    c = model.ckpt_engine_broadcast(10 * (8 << 30), 100, 16, hw)
    assert c.n_writes == 10
    h2d = (8 << 30) / (hw.pcie_gbs * 1e9)
    assert c.stage_busy["h2d"] == pytest.approx(10 * h2d) and c.seconds > 10 * h2d   # H2D-bound: the pace is H2D


def test_dp_attention_layout_recipes_and_engine():
    """Data-parallel attention + EP: every inference rank holds all non-expert tensors whole
    (same shapes as at tp=1), experts split over the instance's ranks; recipes validate
    against the stand-in engine's tensors; the planner spreads the replicated tensors over
    the senders (every training rank sends, every inference rank receives the same bytes)."""
    from weight_transfer.engines.engine import engine_tensor_metas
    from weight_transfer.testing.training import is_expert_param

    cfg = load_config("qwen3-30b-a3b", **{**SMALL, "num_experts": 8})
    dpa = InferenceLayout(tp=4, dp=2, ep=True, quant="fp8", dp_attention=True)
    one = InferenceLayout(tp=1, dp=1, ep=True, quant="fp8")
    full = {m.name: m.shape for m in engine_tensor_metas(cfg, one, 0)}
    for r in range(dpa.world_size):
        ms = engine_tensor_metas(cfg, dpa, r)
        for m in ms:
            if ".experts." in m.name:
                assert m.shape[0] == 8 // 4  # 2 experts per rank
            else:
                assert m.shape == full[m.name], m.name
    assert dpa.describe() == "DPA+EP4xDP2-fp8" and dpa.dense_tp == 1
    with pytest.raises(ValueError, match="needs ep"):
        InferenceLayout(tp=2, dp_attention=True)
    tm = metadata.train_metas(cfg, 2, 4)
    sched = plan(build_recipes(cfg, dpa), tm, metadata.dest_metas(cfg, dpa))
    assert len(set(sched.recv_bytes.values())) == 1
    sends = sorted(sched.send_bytes.values())
    assert sends[0] > 0 and sends[-1] / sends[0] < 1.5
    # non-expert bytes dominate here and are written to all 8 ranks
    ne = sum(w.length for p in sched.rank_plans.values() for t in p.tasks for a in t.assignments for w in a.writes
             if not any(is_expert_param(pc.source or "") for pc in a.recipe.pieces))
    assert ne > 0


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_dp_attention_real_run_bit_exact():
    """A real run (2 training ranks, 1 x DPA+EP2 FP8 instance) verified bit-exact against the
    engine's own load_weights."""
    from weight_transfer.experiments.config import TrialConfig
    from weight_transfer.experiments.trial import run_trial

    moe = dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, vocab_size=1000, hidden_size=128,
               intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    res = run_trial(TrialConfig.from_flat(model="qwen3-30b-a3b", overrides=moe, n_train=2, tp=2, dp=2, ep=True, dp_attention=True,
                                quant="fp8", steps=1, warmup=0, timeout=300))
    assert res.rows and all(r["verified"] is True for r in res.rows), [r.get("verify_error") for r in res.rows]
    assert all("DPA+EP2" in r["layout"] for r in res.rows)


def test_layout_map_tiny(tmp_path):
    """The map's cells: the real planner + cost model on the model truncated to l1 and l2
    layers, extrapolated linearly to the full depth; one row per (width, layout) with the
    per-GPU weight bytes and whether they fit; the heatmap draws from the CSV."""
    import pandas as pd

    from weight_transfer.analysis.simulation import plot_map
    from weight_transfer.experiments.sim.layout_map import layout_map

    lays = (("2 x TP2+EP", InferenceLayout(tp=2, dp=2, ep=True, quant="fp8")),
            ("2 x DPA+EP2", InferenceLayout(tp=2, dp=2, ep=True, quant="fp8", dp_attention=True)))
    rows = layout_map("tiny_qwen3_moe_2x2", widths=(1, 2), layouts=lays, l1=1, l2=2, log=lambda m: None)
    assert len(rows) == 4
    full = load_config("qwen3-30b-a3b").num_layers
    for r in rows:
        assert r["seconds_extrapolated"] == pytest.approx(r["seconds_l2"] + (full - 2) * (r["seconds_l2"] - r["seconds_l1"]))
        assert r["floor_seconds"] > 0
        assert r["seconds_l2"] > r["seconds_l1"] > 0 and r["weights_per_gpu_bytes"] > 0
    dpa = [r for r in rows if "DPA" in r["layout_label"]]
    tp = [r for r in rows if "TP2" in r["layout_label"]]
    assert dpa[0]["weights_per_gpu_bytes"] > tp[0]["weights_per_gpu_bytes"]   # attention replicated
    pd.DataFrame(rows).to_csv(tmp_path / "sim_kimi_map.csv", index=False)
    assert plot_map(tmp_path / "sim_kimi_map.csv").exists()


def test_cli_dp_attention_and_moe_width_parse():
    """``run --dp-attention --ep`` and ``--train-mesh NxGxW`` reach the TrialConfig."""
    from weight_transfer.experiments.command import build_parser, config_from_args

    args = build_parser().parse_args(["run", "--model", "qwen3-30b-a3b", "--n-train", "4", "--train-layout", "two_group",
                                      "--train-mesh", "2x2x1", "--tp", "2", "--ep", "--dp-attention", "--quant", "fp8"])
    cfg = config_from_args(args)
    assert cfg.train.mesh == (2, 2, 1) and cfg.inference.dp_attention and cfg.inference.dp_attention
    assert cfg.inference.describe() == "DPA+EP2-fp8"


def _write_spans(res):
    """rank -> [(task, prepare end, write start, write end)] from the recorded events."""
    sp = _spans(res)
    return {r: [(t, d["prepare"][1], d["write"][0], d["write"][1]) for t, d in ts.items() if "write" in d]
            for r, ts in sp.items()}


def test_writes_in_flight_task_vs_watermark():
    """``writes_in_flight="task"`` (reference/pipeline/executor.py: one write thread, a task's batch is
    waited on before the next) never has two tasks' writes of one rank in flight together;
    ``"watermark"`` (the published executor) posts every task's writes the moment its prepare
    ends, so writes of several tasks overlap; both move the same bytes and keep the watermark."""
    sched, tm = _small_sched(nodes=2, g=2)
    hw = Hardware(gpus_per_node=2, nics_per_node=2)
    wm = 64 << 20
    task = model.simulate(sched, tm, hw, watermark=wm, record=True)
    over = model.simulate(sched, tm, hw, watermark=wm, record=True, writes_in_flight="watermark")
    waited = overlapped = 0
    for lst in _write_spans(task).values():
        lst.sort(key=lambda x: x[2])
        for (_, _, _, e0), (_, _, s1, _) in zip(lst, lst[1:]):
            assert s1 >= e0 - 1e-15                      # one task's writes at a time
        waited += sum(1 for _, pe, ws, _ in lst if ws > pe + 1e-12)
    for lst in _write_spans(over).values():
        assert all(ws == pytest.approx(pe, abs=1e-15) for _, pe, ws, _ in lst)  # posted at prepare end
        lst.sort(key=lambda x: x[2])
        overlapped += sum(1 for (_, _, _, e0), (_, _, s1, _) in zip(lst, lst[1:]) if s1 < e0 - 1e-12)
    assert waited > 0 and overlapped > 0
    assert over.bytes == task.bytes and over.n_writes == task.n_writes and over.rank_bytes == task.rank_bytes
    assert over.peak_temp_bytes <= max(wm, max(t.temp_bytes for rp in sched.rank_plans.values() for t in rp.tasks))
    assert over.method == "reference" and model.simulate(sched, tm, hw, method="overlapped_writes").method == "overlapped_writes"


def test_watermark_zero_leaves_one_task_in_flight():
    """With a watermark of 0 every task runs alone, so at most one task's writes can be in
    flight in either mode: the two modes give the same prediction."""
    sched, tm = _small_sched(nodes=2, g=2)
    hw = Hardware(gpus_per_node=2, nics_per_node=2)
    a = model.simulate(sched, tm, hw, watermark=0)
    b = model.simulate(sched, tm, hw, watermark=0, writes_in_flight="watermark")
    assert a.seconds == pytest.approx(b.seconds, rel=1e-12)


def test_writes_in_flight_rejects_unknown_mode():
    sched, tm = _small_sched(nodes=2, g=2)
    with pytest.raises(ValueError, match="writes_in_flight"):
        model.simulate(sched, tm, Hardware(gpus_per_node=2, nics_per_node=2), writes_in_flight="all")


def test_traced_architecture_simulated_from_vllms_loader(tmp_path, monkeypatch, capsys):
    """C29: an architecture without hand-written rules (GLM-4.5-Air, tiny) is planned from vLLM's
    loader traced in a child process (cached: the second run traces nothing), its destinations
    are what the traced recipes write, and the run says so."""
    from weight_transfer.engines.vllm.engine import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed (make vllm): traced recipes need vLLM's loader")
    from weight_transfer.engines.vllm.trace.loader import parse_layout
    from weight_transfer.experiments.sim.run import build, run
    from weight_transfer.experiments.traced import layout_spec, recipes_for, trace_cache_dir

    for lay in (InferenceLayout(tp=8, dp=2, ep=True), InferenceLayout(tp=2), InferenceLayout(tp=2, dp=2),
                InferenceLayout(tp=4, ep=True)):
        assert parse_layout(layout_spec(lay)) == lay, lay
    monkeypatch.setenv("WT_TRACE_CACHE", str(tmp_path / "traces"))
    cfg = get_config("tiny_glm45_2x2_traced")
    mcfg, tm, dm, rs = build(cfg)
    assert not mcfg.hand_written and len(list(trace_cache_dir().glob("*.msgpack"))) == 1
    assert sorted(dm) == list(range(cfg.layout.world_size)) and all(dm.values())
    assert {s for r in rs for s in r.sources} == {m.name for ms in tm.values() for m in ms}  # every tensor planned
    _, how = recipes_for(mcfg, cfg.layout)  # from the cache
    assert how.startswith("traced from vllm ") and "Glm4MoeForCausalLM.load_weights" in how
    out = run(cfg)
    assert out.plan_summary and "traced from vLLM loader" in capsys.readouterr().out
    from weight_transfer.engines.vllm import engine as vllm_engine
    from weight_transfer.experiments.command import main

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)  # without vLLM: one error line, exit 2
    assert main(["simulate", "tiny_glm45_2x2_traced", "--no-csv"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: simulation config tiny_glm45_2x2_traced: model glm-4.5-air[num_hidden_layers=2,num_experts=8]: "
                   "architecture 'Glm4MoeForCausalLM' is planned from vLLM's traced loader and vLLM is not installed "
                   "(make vllm)"], err
