"""End to end through real processes: controller, FSDP2 training ranks (Gloo), inference
ranks, one-sided writes (process_vm_writev), bit-exact verification against the engine's own
load_weights. Small models; each trial takes a few seconds. Failure kinds of
shared/CASES.md named by id."""
import time

import pytest

from weight_transfer.control.protocol import ControlError
from weight_transfer.experiments.config import TrialConfig
from weight_transfer.experiments.trial import run_trial
from weight_transfer.types import PlanError

pytestmark = pytest.mark.multiproc

SMALL = dict(num_hidden_layers=2, vocab_size=1000, hidden_size=256, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def small(**kw):
    base = dict(model="qwen3-0.6b", overrides=SMALL, n_train=2, tp=2, steps=2, warmup=0, timeout=60)
    base.update(kw)
    return TrialConfig.from_flat(**base)


def assert_all_verified(res, n):
    assert len(res.rows) == n
    assert all(r["verified"] is True for r in res.rows), [r.get("verify_error") for r in res.rows]
    assert all(r["bytes"] > 0 for r in res.rows)


def test_c1_c10_consecutive_versions_bit_exact():
    """C1: every tensor changes at every step and lands (the oracle of each step differs from
    the previous one: weights.py guarantees every element changes). C10: consecutive versions
    reuse the same buffers, tensors packed back to back; every byte incl. byte 0, tensor
    edges, and untouched gaps checked after each version."""
    res = run_trial(small(steps=3))
    assert_all_verified(res, 3)
    assert len({r["bytes"] for r in res.rows}) == 1


def test_c11_poisoned_regions_restored_and_noop_fails_verification():
    res = run_trial(small(steps=1, poison=True))
    assert_all_verified(res, 1)
    bad = run_trial(small(steps=1, poison=True, method="tests.helpers.faults:"))
    assert [r["verified"] for r in bad.rows] == [False]
    assert bad.rows[0]["bytes"] == 0
    assert "mismatch" in bad.rows[0]["verify_error"] or "qkv_proj" in bad.rows[0]["verify_error"]


def test_c12_uneven_and_empty_shards_3_ranks():
    """3 FSDP ranks: every dim splits unevenly; DeepSeek's router bias [4] leaves rank 2 empty."""
    cfg = TrialConfig.from_flat(model="deepseek-v3", n_train=3, tp=2, steps=1, warmup=0, timeout=60,
                      overrides=dict(num_hidden_layers=2, first_k_dense_replace=1, num_experts=4, hidden_size=128,
                                     intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
                                     num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
                                     qk_rope_head_dim=16, v_head_dim=32, vocab_size=1001))
    assert_all_verified(run_trial(cfg), 1)


def test_c12_shard_shard_2x2_mesh():
    res = run_trial(small(n_train=4, train_layout="shard_shard", train_mesh=(2, 2), steps=1))
    assert_all_verified(res, 1)


def test_c9_row_parallel_column_slices_and_fp32_masters():
    """C9: o_proj / down_proj at TP=2 are column slices (non-contiguous views) of the gathered
    source; C8: fp32 training masters are cast on the way, never sent raw."""
    res = run_trial(small(train_dtype="float32", steps=1))
    assert_all_verified(res, 1)


def test_c3_missing_parameter_refused_before_any_write():
    missing = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(PlanError, match=missing.replace(".", r"\.")):
        run_trial(small(drop_params=(missing,), steps=1))


def test_extra_parameter_refused_naming_it():
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.adapter\.weight"):
        run_trial(small(extra_params=(("model.layers.0.mlp.adapter.weight", (8, 8)),), steps=1))


def test_world_that_cannot_shard_is_refused():
    with pytest.raises((ValueError, ControlError), match="3"):
        run_trial(small(tp=3, steps=1))


def test_shm_transport_trial_bit_exact():
    """``--transport shm``: the inference ranks allocate the engine's arena through the
    transport (a sealed memfd each sender maps once); every byte verified."""
    res = run_trial(small(steps=2, transport="shm"))
    assert_all_verified(res, 2)
    assert {r["transport"] for r in res.rows} == {"shm"}


def test_gather_all_and_local_writes_agree():
    """The published design (full_tensor() of every source) and local writes (copies sent from
    the ranks' own shards) both land bit-exact, uneven shards included."""
    for local in (False, True):
        res = run_trial(small(n_train=3, local_writes=local, local_min_bytes=0, steps=1,
                              overrides={**SMALL, "vocab_size": 1001}))
        assert_all_verified(res, 1)


def test_fp8_shard_local_prepare_bit_exact_and_gathers_little():
    """Shard-local prepare of fused and block-FP8 recipes (head_dim 128: every band 128-row
    aligned) in a real trial: verified against load_weights, and the plan gathers far less
    than --gather-all."""
    over = {**SMALL, "head_dim": 128, "hidden_size": 256, "intermediate_size": 512}
    runs = {local: run_trial(small(quant="fp8", local_writes=local, local_min_bytes=0, steps=1, overrides=over))
            for local in (True, False)}
    for res in runs.values():
        assert_all_verified(res, 1)
    gathered = {k: float(r.schedule_summary.split("gathers ")[1].split(" MB")[0]) for k, r in runs.items()}
    assert gathered[True] < gathered[False] / 10, gathered


# ---- --device cuda: every process on the GPU (docs/GPU.md; run by scripts/gpu_check.sh) -------
# Marked gpu: skipped, with the reason, without a CUDA GPU and a CUDA build of torch.


@pytest.mark.gpu
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kw", [
    # FSDP2 on a CUDA DeviceMesh (Gloo when the ranks share one GPU), block FP8 made on the GPU
    # from shard-local and gathered sources, verified on the host against the CPU oracle
    dict(quant="fp8", overrides={**SMALL, "head_dim": 128}),
    # [Shard(0), Shard(0)] on a 2x2 CUDA mesh: four training processes and two inference ones
    dict(n_train=4, train_layout="shard_shard", train_mesh=(2, 2)),
], ids=["fsdp-fp8", "shard_shard-2x2"])
def test_gpu_cuda_ipc_every_process_on_the_gpu(kw):
    res = run_trial(small(device="cuda", transport="cuda_ipc", steps=2, **kw))
    assert_all_verified(res, 2)
    assert all(r["device"] == "cuda" and r["transport"] == "cuda_ipc" for r in res.rows)


def test_phase_columns_from_the_ranks_stats():
    """The report's per-phase and per-process columns (issue 28 item 4) from two ranks' stats."""
    from weight_transfer.experiments.columns import phase_columns
    from weight_transfer.pipeline.executor import BarrierRecord, StepStats, TaskRecord

    def rank(r, secs, sent, prep, write, wait):
        st = StepStats(rank=r, bytes_sent=sent, seconds=secs, peak_alloc_bytes=100 * (r + 1))
        rec = TaskRecord(0, 0, temp_bytes=1, send_bytes=sent, label="t")
        rec.stages.update(prepare=(0.0, prep), write=(prep, prep + write))
        st.records.append(rec)
        st.barriers.append(BarrierRecord(0, 0.0, (0.0, wait)))
        return st

    stats = [rank(0, 1.0, 4_000_000_000, 0.3, 0.6, 0.05), rank(1, 2.0, 2_000_000_000, 0.5, 1.2, 0.1)]
    results = {("commit", 0): {"ok": True, "stats": {"seconds": 0.25}}}
    out = phase_columns(stats, 2.5, 2.0, results, {0: 3_000_000_000, 1: 3_000_000_000}, 1000, 2)
    assert out["phase_prepare_s"] == 0.5 and out["phase_write_s"] == pytest.approx(1.2)
    assert out["phase_barrier_s"] == 0.1 and out["phase_commit_s"] == 0.25
    assert out["phase_publish_s"] == pytest.approx(0.25) and out["phase_h2d_s"] == 0.0
    assert out["slowest_sender"] == 1 and out["slowest_sender_s"] == 2.0 and out["sender_gbps_min"] == pytest.approx(1.0)
    assert out["slowest_receiver"] == 0 and out["receiver_gbps_min"] == pytest.approx(1.2)
    assert out["train_extra_bytes"] == 200 and out["infer_extra_bytes"] == 500
    none = phase_columns(stats, 2.5, None, {}, {}, 0, 2)
    assert none["slowest_receiver"] is None and none["phase_publish_s"] == 0.0  # no write time known: nothing after it


def test_table_shows_the_cold_update_phases_and_percentiles():
    from types import SimpleNamespace

    from weight_transfer.experiments.config import TrialConfig
    from weight_transfer.experiments.report import format_table

    cfg = TrialConfig.from_flat(model="qwen3-0.6b", overrides={"num_hidden_layers": 1, "vocab_size": 1024})
    base = dict(bytes=1_000_000_000, n_writes=10, peak_temp_bytes=1, verified=True, phase_prepare_s=0.1,
                phase_write_s=0.2, phase_publish_s=0.01, slowest_sender=1, slowest_sender_s=0.4, sender_gbps_min=1.0,
                slowest_receiver=0, receiver_gbps_min=2.0, train_extra_bytes=5e6, infer_extra_bytes=0)
    rows = [dict(base, step=1, warmup=True, seconds=2.0)] + [dict(base, step=s, warmup=False, seconds=0.5)
                                                             for s in (2, 3, 4)]
    env = {"host": "h", "cpus": 2, "torch": "t", "python": "p", "git_sha": "g"}
    res = SimpleNamespace(cfg=cfg, env=env, rows=rows, schedule_summary="s", plan_seconds=0.1, memcpy_gbps=4.0)
    text = format_table(res)
    first = next(line for line in text.splitlines() if line.split()[:1] == ["1"])
    assert first.endswith("(cold)") and "prepare" in text and "publish" in text
    assert "# cold first update (step 1, reported, not in the warm statistics): 2.0000 s" in text
    assert "p95 0.5000" in text and "max 0.5000" in text
    assert "phases, p50 busy seconds" in text and "prepare 0.1000" in text
    assert "slowest sender (slowest update): training 1" in text and "25% of memcpy" in text
    assert "busiest receiver: inference 0, 2.000 GB/s = 50% of memcpy" in text


def test_delta_trial_every_update_bit_exact_nothing_everything_partial():
    """``run --delta --change-fraction 1,0,1,0.01`` on the stand-in engine (issue 26 item 3): the
    first update is full, the step where nothing changed writes no byte, the one where
    everything changed writes (nearly) every byte, the 1% one less; ``bytes`` stays the update's
    size and ``delta_bytes`` says what was written; every update verified against a fresh oracle."""
    res = run_trial(small(steps=4, delta=True, change_fraction=(1.0, 0.0, 1.0, 0.01), quant="fp8"))
    assert_all_verified(res, 4)
    rows = res.rows
    full = rows[0]["bytes"]
    assert all(r["bytes"] == full for r in rows)
    assert rows[0]["delta"] == "full: first update" and rows[0]["delta_bytes"] == full
    assert rows[1]["delta"] == "delta" and rows[1]["delta_bytes"] == 0
    assert rows[2]["delta"] == "delta" and 0.95 * full < rows[2]["delta_bytes"] <= full
    assert rows[3]["delta"] == "delta" and 0 < rows[3]["delta_bytes"] < full
    assert rows[0]["delta_shadow_bytes"] > 0
    from weight_transfer.experiments.report import format_table

    text = format_table(res)
    assert "delta_bytes" in text and "delta updates: bytes written p50" in text


def test_c29_traced_architecture_on_the_stand_in_engine(tmp_path, monkeypatch):
    """C29 without a vLLM engine: OPT (no hand-written rules) on the stand-in engine at TP 2, its
    tensors and plan from vLLM's loader traced in a child process (cached once for every rank),
    each update verified against vLLM's own load_weights of the step's checkpoint (a CPU
    skeleton, real bytes); the baselines, which need a load_weights, are refused before any
    process starts."""
    from weight_transfer.engines.vllm.engine import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed (make vllm): a traced architecture needs vLLM's loader")
    from weight_transfer.testing.tiny import TINY_TRACED

    monkeypatch.setenv("WT_TRACE_CACHE", str(tmp_path / "traces"))
    cfg = small(model="opt-125m", overrides=dict(TINY_TRACED["opt-125m"]), steps=1)
    res = run_trial(cfg)
    assert_all_verified(res, 1)
    assert len(list((tmp_path / "traces").glob("*.msgpack"))) == 1  # the data-only cache (engines/vllm/trace/loader.py)
    with pytest.raises(ValueError, match="no stand-in load_weights .* --engine vllm"):
        run_trial(small(model="opt-125m", overrides=dict(TINY_TRACED["opt-125m"]), method="rank0_funnel"))
    from weight_transfer.experiments.command import main
    from weight_transfer.testing.tiny import override_args

    t0 = time.monotonic()  # --method all: every method refused before the first one starts
    assert main(["run", "--model", "opt-125m", *override_args(TINY_TRACED["opt-125m"]), "--method", "all",
                 "--steps", "1", "--warmup", "0", "--results", str(tmp_path / "rows.csv")]) == 2
    rows = tmp_path / "rows.csv"
    assert time.monotonic() - t0 < 30 and (not rows.exists() or len(rows.read_text().splitlines()) <= 1)
