"""An RL loop that learns, on an unmodified vLLM updated one-sidedly after every optimizer step.

2 FSDP2 training ranks (gloo, CPU) hold an fp32 master of a 2-layer Qwen3 (the catalog's
qwen3-0.6b, vocabulary 8192). vLLM serves it in bf16 with the ``one_sided`` weight-transfer
backend, as an offline ``LLM`` in training rank 0's process: vLLM's offline API is in-process,
the trainer engine's client (``LLMClient``) calls it directly, and its worker runs in an engine
core process of its own, so vLLM's torch.distributed state never meets the trainers' gloo group.
Each step vLLM samples 8 answers for each of 16 prompts ``[a, b]``; the reward is 1 when the
first answer token's parity is ``a + b``'s (a random model earns 0.5). Group-normalized
advantages, the PPO-clipped policy gradient with the ratio against vLLM's rollout logprobs,
AdamW, then ``send_weights(version)``. Checked: every rollout carries the version pushed before
it; after every push the engine's runtime and staging bytes equal an oracle's (a plain vLLM in
rank 1 loaded through vLLM's own reload path with the same weights), and at the end a fresh
vLLM's from the final checkpoint; greedy tokens and logprobs against both are recorded. The
pieces: weight_transfer.experiments.rl.

With --delta every step's weights are pushed twice, as a delta update and as a full one (the
same executor with its delta state set aside), alternating which goes first; both verified
against the oracle; one row per push in results/rl_delta.csv (docs/DELTA.md).

Run:  python examples/rl_loop.py [--steps 30] [--lr 5e-4] [--changes] [--delta] [--save-steps DIR] [--metrics-port 0] [--help]
      (= weight-transfer rl; --metrics-port / --vllm-metrics-port: Prometheus metrics, docs/METRICS.md)
Writes results/rl_<tag>.csv and .png (--changes: results/rl_changes.csv, docs/DELTA.md).
"""
import os, shutil, sys, tempfile, time, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3Config, Qwen3ForCausalLM
import weight_transfer as wt
from weight_transfer.experiments import rl, rl_metrics


def trainer(rank, port, o, ckpt0, workdir):
    torch.set_num_threads(1)
    from weight_transfer.engines.vllm import VllmEngine
    # rank 0: the engine we train; rank 1: its oracle, a plain vLLM. Both start (at once) from
    # synthetic weights, so version 1 -- the initial model -- must overwrite every byte.
    engine = VllmEngine(ckpt0, weight_transfer_config={"backend": "one_sided"} if rank == 0 else None,
                        targets="auto" if rank == 0 else "direct", **rl.engine_kwargs())
    try: train(rank, port, o, engine, workdir)
    finally: engine.close()   # also on a failure: a live vLLM would keep this process from exiting


def train(rank, port, o, engine, workdir):
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from weight_transfer.engines.vllm.backend.plugin import LLMClient, OneSidedTrainerInitInfo
    store = wt.connect_store(("127.0.0.1", port), timeout=o.timeout)  # the parent's (the job secret inherited)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2)
    cfg, task = o.model_config(), rl.ParityTask(o)
    torch.manual_seed(o.seed); model = Qwen3ForCausalLM(Qwen3Config(**cfg.hf))  # fp32 master weights
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers: fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    push = WeightTransferTrainerFactory.trainer_init(      # plans once, against vLLM's runtime layout
        OneSidedTrainerInitInfo(rank=rank, world_size=2, timeout=o.timeout, options=rl.transfer_overrides(o),
                                metrics=rl_metrics.coordinator_metrics(o, rank)),   # --metrics-port: the coordinator's
        client=LLMClient(engine.llm) if rank == 0 else None, source=ModuleSource(model))
    check, out = rl.OracleCheck(rank, engine, cfg), rl.StepLog(o) if rank == 0 else None
    pushes = []                                            # --delta: one row per push (rank 0)
    scrapes = rl_metrics.scrapes(o, rank, push.coordinator)   # rank 0, --(vllm-)metrics-port: /metrics after each push

    def publish(version, mode=None, step=0, first=True, reload=True):  # one push, then the engine's bytes against the oracle's
        if mode and o.delta_settle: time.sleep(o.delta_settle)   # --delta: vLLM's workers idle, as after training
        t = time.perf_counter()
        with rl.push_mode(push.sender.executor, mode): push.send_weights(version)   # --delta: "full" or "delta"
        call = time.perf_counter() - t
        if scrapes: scrapes.add(step, version, mode)       # the coordinator's and vLLM's /metrics, now
        served = rl.served_weights(model)                  # the step's weights in bf16, gathered
        res = check(served, reload=reload) if o.verify else {"ok": None, "bytes": 0, "seconds": 0.0}
        assert res["ok"] is not False, f"version {version}: the engine's bytes differ from the oracle's: {res}"
        u = push.last_result if rank == 0 else None        # rank 0: the update as the coordinator saw it
        if u is not None and mode: pushes.append(rl.push_row(o, step, mode, first, u, res, rl.commit_stats(push.store, version)))
        return served, {"pushed_version": version, "push_call_seconds": call, "verified": res["ok"],
                        "verified_bytes": res["bytes"], "verify_s": res["seconds"],
                        "oracle_outputs_equal": res.get("outputs_ok"), "oracle_logprob_ulps": res.get("logprob_ulps"),
                        "oracle_logprob_maxdiff": res.get("logprob_maxdiff"), **({"push_seconds": u.seconds,
                        "push_bytes": u.bytes, "push_writes": u.n_writes, "fingerprints": u.verify,   # --fingerprints
                        "fp_bytes": u.verified_bytes, "fp_s": u.verify_seconds} if u else {})}

    served, rec = publish(1)
    if rank == 0: out.add(step=0, **rec); first = served; rl.save_served(o, 0, served)   # --save-steps DIR
    changes, version = [], 1
    for step in range(1, o.steps + 1):
        t0 = time.perf_counter()
        batch = rl.rollout(engine.llm, task.prompts, group=o.group, seed=(o.seed * 1000 + step) * 10**5) if rank == 0 else None
        batch = rl.broadcast_rollout(batch)                # rank 0's rollout -> both ranks (as data)
        assert batch["versions"] == {((str(version), 0, 1),)}, f"step {step}: rollout versions {batch['versions']}"
        rewards = task.reward(task.prompts, batch["answers"])   # [prompts, group]
        adv = rl.group_advantages(rewards)
        mine, G = slice(rank, None, 2), o.group            # this rank's half of the groups
        t1, rv = time.perf_counter(), version
        loss, st = rl.clipped_pg_loss(model, task.prompts[mine].repeat_interleave(G, 0), batch["answers"][mine].flatten(0, 1),
                                      batch["logprobs"][mine].flatten(0, 1), adv[mine].flatten(), o.clip)
        loss.backward(); opt.step(); opt.zero_grad()
        lsum = loss.detach().clone(); dist.all_reduce(lsum)
        t2 = time.perf_counter()
        if o.delta:   # the same weights twice, as a delta and as a full update, alternating which goes first
            if o.verify: check.reload(rl.served_weights(model))   # the oracle loads them once, before both pushes
            for k, mode in enumerate(("full", "delta") if step % 2 else ("delta", "full")):
                version += 1
                new, r = publish(version, mode, step, first=k == 0, reload=False)
                if mode == "delta": rec = r
        else:
            version += 1
            new, rec = publish(version, step=step)         # version step + 1 = the weights after this step
        t3 = time.perf_counter()
        if rank == 0 and o.changes: changes += rl.change_rows(o.lr, step, served, new)
        if rank == 0: rl.save_served(o, step, new)       # --save-steps: the weights after this step, as served
        served = new
        if rank == 0:
            r = out.add(step=step, rollout_version=rv, reward_mean=float(rewards.mean()), loss=float(lsum) / 2, **st,
                        rollout_s=batch["seconds"], train_s=t2 - t1, changes_s=time.perf_counter() - t3,
                        step_s=time.perf_counter() - t0, **rec)
            rl.log(rank, f"step {step}: reward {r['reward_mean']:.3f} (version {rv}), loss {r['loss']:+.4f}, "
                         f"push v{r['pushed_version']} {r['push_bytes'] / 1e6:.1f} MB in {r['push_seconds']:.3f} s, "
                         f"{'verified' if r['verified'] else 'unverified'}, step {r['step_s']:.1f} s")
    fin = rl.final_check(rank, check, cfg, served, workdir) if o.verify else {}   # a fresh vLLM, in rank 1
    if scrapes: scrapes.close()
    push.shutdown()
    if rank == 0:
        if fin: rl.log(0, f"final, against a fresh vLLM from the final checkpoint: runtime and staging bytes "
                          f"{'equal' if fin['bytes_ok'] and fin['staging_ok'] is not False else 'DIFFER'}, greedy tokens and "
                          f"logprobs {'equal' if fin['outputs_ok'] else 'differ'} (max {fin['logprob_maxdiff']} nats; {fin['seconds']:.0f} s)")
        out.finish(final_bytes_ok=fin.get("bytes_ok"), final_outputs_ok=fin.get("outputs_ok"),
                   final_logprob_ulps=fin.get("logprob_ulps"), final_logprob_maxdiff=fin.get("logprob_maxdiff"))
        if o.changes: rl.save_changes(o, changes, first)
        if o.delta: rl.save_pushes(o, pushes)
    assert not fin or fin["ok"], f"the engine's bytes differ from a fresh vLLM's: {fin}"
    dist.destroy_process_group()


def run(o):
    from weight_transfer.engines.vllm import write_checkpoint
    workdir = tempfile.mkdtemp(prefix="wt-rl-")
    ckpt0 = write_checkpoint(o.model_config(), os.path.join(workdir, "ckpt0"), step=0, seed=o.seed + 1)
    # the trainers' rendezvous, held here for the run: a port picked and released could be taken
    # by a vLLM engine starting in a trainer before rank 0 binds it; an authenticated store whose
    # job secret the trainers, spawned next, inherit
    store = wt.serve_store("127.0.0.1", 0)
    rl_metrics.prometheus_dir(o, workdir)   # --vllm-metrics-port: vLLM's multiprocess metrics, in every process
    procs = [mp.get_context("spawn").Process(target=trainer, args=(r, store.port, o, ckpt0, workdir)) for r in range(2)]
    for p in procs: p.start()
    try: return rl.supervise(procs)                       # the first trainer that fails stops the other
    finally: shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(run(rl.options_from_argv(sys.argv[1:])))
