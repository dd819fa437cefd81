"""The inference side of a trial when the engine is an unmodified vLLM (``--engine vllm``).

One process per vLLM instance (inference ranks ``d*tp .. d*tp+tp-1``): it writes the step-0
checkpoint and starts :class:`weight_transfer.engines.vllm.VllmEngine`.

The reference goes through vLLM's own weight-transfer API with this project's backend
(:mod:`weight_transfer.engines.vllm.backend.plugin`): the engine is started with
``weight_transfer_config={"backend": "one_sided"}`` and driven with vLLM's four calls through
:class:`weight_transfer.engines.vllm.backend.plugin.LLMClient`. ``init_weight_transfer_engine`` hands
every worker the trial's store (:class:`~weight_transfer.engines.vllm.backend.plugin.OneSidedInitInfo`:
host, port, ``first_rank = d * tp``, ``--vllm-targets``, the transport); each worker's engine
reports its runtime tensors (after ``process_weights_after_loading``), stages what vLLM keeps
opaque, registers its memory once and publishes the region descriptor, the destination metadata
and the :class:`weight_transfer.engines.vllm.worker.runtime.RuntimeLayout` (``meta/infer_runtime/{rank}``),
so the controller plans against the runtime layout (:func:`weight_transfer.plan.retarget.retarget`)
and the training ranks (:class:`weight_transfer.api.Sender`) write one-sidedly into it. Per
update: ``pause`` and ``start_weight_update`` when the controller announces the step (before any
write; the worker refuses when a destination moved since init); once every write of the step
completed (the controller's ``step/{s}/commit``) ``update_weights({"version": s})`` -- each
worker checks in the store that every training rank reported its writes of ``s`` ok, re-runs
vLLM's post-processing for its staged layers and reports its commit (``step/{s}/committed/{i}``)
-- then ``finish_weight_update(weight_version=str(s))``; after a failed update
``finish_weight_update("incomplete:s")`` (never ``s`` over mixed bytes). ``reset_prefix_cache``
and ``resume`` once the version is published. Every worker commits every update (the controller
waits for each one's report), staged layers or not.

Verification by vLLM itself: a fresh engine started from that step's checkpoint; every runtime
tensor byte and the greedy tokens + logprobs of fixed prompts (one longer than two KV blocks)
must be equal, the staged bytes must equal what ``load_weights`` makes from the checkpoint, and
vLLM's weight version (``LLM.get_weight_version``) must be the published one. The live bytes
are read with :meth:`weight_transfer.engines.vllm.VllmEngine.read` (``collective_rpc`` into
:mod:`weight_transfer.engines.vllm.extension`, which reads through the backend's own
:class:`~weight_transfer.engines.vllm.worker.state.WorkerTargets`): the harness's check, no part of
the update.

Baselines (``--method rank0_funnel|rpc``, ``--tp 1``): the method's own inference side
(:class:`weight_transfer.baselines.funnel.FunnelInference`, :class:`weight_transfer.baselines.rpc.RpcInference`) runs in this
process with :class:`VllmLoadPath` as its engine: every ``load_weights`` call becomes one
``collective_rpc`` into the worker's ``model.load_weights`` inside vLLM's in-place reload
(``initialize_layerwise_reload`` before the first tensor of an update,
``finalize_layerwise_reload`` at ``process_weights_after_loading``; see
:mod:`weight_transfer.engines.vllm.extension`), the path verl / OpenRLHF / TRL use; the engine has no
weight-transfer backend. Verification is the same as for the reference (the weight version
aside: vLLM's reload path does not set one).

Oracle cache: when ``WT_VLLM_ORACLE_DIR`` is set (``--method all`` sets it for its run), the
fresh engine's snapshot of a step is saved there and reused by the next method's trial of the
same model, step, seed and TP (the same checkpoint, prompts and vLLM: the same bytes and
outputs), so ``--method all`` starts one fresh engine per step instead of three; and
:func:`prefill_oracle` starts those engines before the first trial, one after another, when no
live engine or training rank holds memory.

Log lines are prefixed ``[vllm d]``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from weight_transfer.control import protocol as control
from weight_transfer.control import store as store_api
from weight_transfer.control.clients import InferenceClient

__all__ = ["vllm_instance_main", "prefill_oracle", "prefill_oracle_main", "KEY_RUNTIME", "KEY_PAUSED", "VllmLoadPath", "ORACLE_DIR_ENV", "own_process_group",
           "kill_group"]

ORACLE_DIR_ENV = "WT_VLLM_ORACLE_DIR"
"""Environment variable naming a directory for fresh-engine snapshots shared by the trials of
one ``--method all`` run (see module docstring)."""

from weight_transfer.method import RUNTIME_KEY as KEY_RUNTIME  # noqa: E402

KEY_PAUSED = "step/{step}/paused/{instance}"
"""Set by a vLLM instance once generation is paused for ``step`` (before the controller says go)."""


def _log(instance: int, msg: str) -> None:
    print(f"[vllm {instance}] {msg}", file=sys.stderr, flush=True)


class VllmLoadPath:
    """The engine a baseline's inference side drives, for a running vLLM (``tp = 1``): vLLM's
    own loading path through ``collective_rpc``, with the interface of the stand-in engine
    that the baselines use (``load_weights``, ``process_weights_after_loading``,
    ``tensor_metas``, ``arena.device``).

    ``load_weights(pairs)``: the first call of an update starts vLLM's in-place reload
    (:meth:`weight_transfer.engines.vllm.VllmEngine.reload_begin`); each call is one ``collective_rpc`` into
    ``model.load_weights`` with those full tensors. ``process_weights_after_loading()`` ends
    it (:meth:`weight_transfer.engines.vllm.VllmEngine.reload_finish`). ``tensor_metas()``: the runtime
    targets of ``layout`` (what lands per update: the tensors vLLM computes with)."""

    def __init__(self, engine, layout):
        import torch

        self.engine, self.layout = engine, layout
        self.arena = torch.empty(0, dtype=torch.uint8)  # the baselines read arena.device
        self.in_reload = False
        self.rpcs = 0

    def tensor_metas(self):
        return self.layout.dest_metas()

    def load_weights(self, weights) -> None:
        if not self.in_reload:
            self.engine.reload_begin()
            self.in_reload = True
        self.engine.load_weights(weights)
        self.rpcs += 1

    def process_weights_after_loading(self) -> None:
        self.end()

    def end(self) -> None:
        """Finish an open reload (also after a failed update: vLLM puts its running tensors
        back; the version is not published)."""
        if self.in_reload:
            self.in_reload = False
            self.engine.reload_finish()


def _oracle_path(mcfg, step: int, seed: int, tp: int) -> Path | None:
    root = os.environ.get(ORACLE_DIR_ENV)
    if not root:
        return None
    from weight_transfer.engines.vllm import hf_config, vllm_version
    from weight_transfer.engines.vllm.extension import HIDE_AMX_ENV

    # the host path vLLM takes (WT_VLLM_HIDE_AMX) changes its runtime tensors: part of the key
    key = json.dumps([hf_config(mcfg), step, seed, tp, vllm_version(), os.environ.get(HIDE_AMX_ENV, "")],
                     sort_keys=True, default=str)
    return Path(root) / f"fresh-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def _fresh_snapshot(mcfg, root: Path, v: int, cfg, instance: int, prompts) -> dict:
    """Snapshot of a fresh vLLM started from step ``v``'s checkpoint (or the cached one)."""
    import torch

    from weight_transfer.engines.vllm import VllmEngine, write_checkpoint
    from weight_transfer.engines.vllm.verify import snapshot

    path = _oracle_path(mcfg, v, cfg.run.seed, cfg.inference.tp)
    if path is not None and path.exists():
        _log(instance, f"version {v}: fresh-engine snapshot from the oracle cache {path.name}")
        snap = torch.load(path, weights_only=True)  # tensors, lists and numbers: no pickle from a shared cache
        # ranks of this instance (the cached one may come from instance 0)
        return {"tensors": {instance * cfg.inference.tp + (r - min(snap["tensors"])): t for r, t in snap["tensors"].items()},
                "outputs": snap["outputs"]}
    fresh_engine = VllmEngine(write_checkpoint(mcfg, root / f"step{v}", step=v, seed=cfg.run.seed), tp=cfg.inference.tp,
                              first_rank=instance * cfg.inference.tp, seed=cfg.run.seed, targets="direct")
    try:
        snap = snapshot(fresh_engine, fresh_engine.runtime_layouts(), prompts)
    finally:
        fresh_engine.close()
        shutil.rmtree(root / f"step{v}", ignore_errors=True)  # read once, by this engine
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(snap, tmp)
        os.replace(tmp, path)
    return snap


def prefill_oracle_main(cfg, versions: list[int], parent: int | None = None) -> None:
    """The fresh-engine snapshots of ``versions`` into the oracle cache (``WT_VLLM_ORACLE_DIR``,
    required), one engine after another, in a process group of its own: what each trial's
    verification would start itself, started before any trial, when neither a live engine nor
    training ranks hold memory (see :func:`prefill_oracle`)."""
    own_process_group(parent)
    from weight_transfer.engines.vllm.verify import fixed_prompts

    if not os.environ.get(ORACLE_DIR_ENV):
        raise RuntimeError(f"prefill_oracle_main: {ORACLE_DIR_ENV} is not set")
    mcfg = cfg.model_config()
    prompts = fixed_prompts(mcfg.vocab_size)
    root = Path(tempfile.mkdtemp(prefix="wt-vllm-oracle-ck-"))
    try:
        for v in versions:
            t0 = time.perf_counter()
            _fresh_snapshot(mcfg, root, v, cfg, 0, prompts)
            _log(0, f"oracle cache: version {v}'s fresh engine snapshotted in {time.perf_counter() - t0:.0f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def prefill_oracle(cfg) -> bool:
    """``--method all --engine vllm``: fill the oracle cache with the fresh-engine snapshot of
    every version the trials will verify (1 .. warmup + steps), before the first trial starts,
    so no trial starts a second vLLM beside its live engine and training ranks (at the 1.85 GB
    size the two engines, the trainers and the copies together outgrew a 23 GB host). Same
    engines, same checkpoints, same prompts and environment (``OMP_NUM_THREADS=1``, as
    :func:`weight_transfer.experiments.trial.run_trial` sets for the trial's processes) as a
    trial's own. Returns False (the trials then start their fresh engines themselves) when the
    cache is off or the process failed; no vLLM process outlives it."""
    import multiprocessing as mp

    if not os.environ.get(ORACLE_DIR_ENV) or not cfg.run.verify:
        return False
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    versions = list(range(1, cfg.run.warmup + cfg.run.steps + 1))
    p = mp.get_context("spawn").Process(target=prefill_oracle_main, args=(cfg, versions),
                                        kwargs=dict(parent=os.getpid()), name="vllm-oracle")
    p.start()
    try:
        p.join()
    finally:
        if p.is_alive():
            p.terminate()
            p.join(10)
        kill_group(p.pid)
    if p.exitcode != 0:
        print(f"# oracle cache: prefill exited with code {p.exitcode}; the trials start their fresh engines "
              "themselves", file=sys.stderr, flush=True)
    return p.exitcode == 0


def own_process_group(parent: int | None = None) -> None:
    """Make this process the leader of a process group of its own, which vLLM's children
    (EngineCore, its workers, a verification engine's) inherit, so that the group can be ended
    as one (:func:`kill_group`): on SIGTERM or SIGINT this process SIGKILLs its whole group,
    and with ``parent`` (the launcher's pid, Linux) it gets SIGTERM when the launcher dies
    (``PR_SET_PDEATHSIG``), even by SIGKILL. A vLLM instance killed from outside leaves no
    EngineCore or worker behind (issue: 3 of 4 refused trials left 2.4 GB orphaned under pid 1)."""
    import signal

    try:
        os.setpgid(0, 0)
    except OSError:  # already a session/group leader (a SLURM task): the group is ours anyway
        pass

    def _end(signum, _frame):
        kill_group(os.getpgid(0))
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, _end)
    signal.signal(signal.SIGINT, _end)
    if parent is not None and sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before prctl
            _end(signal.SIGTERM, None)


def kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` (no error if it is gone)."""
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _init_backend(engine, cfg, instance: int, addr: tuple[str, int], store, ranks: list[int]):
    """``init_weight_transfer_engine`` of the ``one_sided`` backend in every worker of ``engine``
    (see the module docstring); returns ``(client, {rank: RuntimeLayout})``, the layouts as the
    workers published them (each with its registered region). RuntimeError naming the rank when
    a worker published nothing."""
    from weight_transfer.engines.vllm.backend.plugin import LLMClient

    client = LLMClient(engine.llm, reset_prefix_cache=False)  # the harness resets after publishing
    client.init_weight_transfer_engine({
        "store_host": addr[0], "store_port": int(addr[1]), "first_rank": instance * cfg.inference.tp,
        "targets": cfg.run.vllm_targets, "transport": cfg.transport,
        "timeout": float(cfg.transfer.control.timeout)})
    missing = [r for r in ranks if not store.check([KEY_RUNTIME.format(rank=r)])]
    if missing:
        raise RuntimeError(f"vLLM instance {instance}: init_weight_transfer_engine returned but inference rank(s) "
                           f"{missing} published no runtime layout (is the engine's backend 'one_sided'?)")
    return client, {r: control.get(store, KEY_RUNTIME.format(rank=r)) for r in ranks}


def _wait_commit_or_failed(store, step: int, poll: float = 0.001) -> str:
    """The backend's commit point of ``step``: ``"commit"`` once the controller asks for it
    (every write completed), ``"failed"`` when the update was published incomplete instead,
    ``"shutdown"`` when the job ends first."""
    for _ in control.backoff(None, poll):
        if store.check([f"step/{step}/commit"]):
            return "commit"
        s = control.read_state(store)
        if s.state == "incomplete" and s.version == step:
            return "failed"
        if store.check(["shutdown"]):
            return "shutdown"
    return "shutdown"  # pragma: no cover (backoff(None) never ends)


def _commit_through_backend(client, store, step: int, ranks: list[int], instance: int, failed_label: str) -> bool:
    """``update_weights({"version": step})`` then ``finish_weight_update(str(step))`` through
    ``client`` (a ``VLLMWeightSyncClient``). Each worker reports its own commit in the store; a
    rank of ``ranks`` whose worker raised before reporting (a check that refused) is reported
    failed here, with vLLM's error, so the controller fails the update naming it at once. After
    a failure vLLM's weight version becomes ``failed_label`` (``incomplete:step``). True when
    committed."""
    try:
        client.update_weights({"version": step})
    except Exception as e:
        traceback.print_exc()
        why = f"update_weights failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        for r in ranks:
            if not store.check([f"step/{step}/committed/{r}"]):
                InferenceClient(store, r).committed(step, ok=False, error=why)
        _label(client, failed_label, instance)
        return False
    client.finish_weight_update(weight_version=str(step))
    return True


def _label(client, label: str, instance: int) -> None:
    """Close vLLM's update session with weight version ``label`` (after a failed update: the
    workers' ``update_weights`` raising may have closed it already; then open one to label)."""
    try:
        client.finish_weight_update(weight_version=label)
        return
    except Exception:
        pass
    try:
        client.start_weight_update()
        client.finish_weight_update(weight_version=label)
    except Exception as e:
        _log(instance, f"could not set vLLM's weight version to {label!r}: {type(e).__name__}: {e}")


def _start_instance(cfg, instance: int, addr: tuple[str, int], store, clients: dict, ranks: list[int], mcfg,
                    root: Path):
    """Start vLLM instance ``instance`` from the step-0 checkpoint (written under ``root``): for
    the reference with vLLM's weight-transfer API and the one_sided backend (every worker
    reported, staged, registered and published its layout), for a baseline with vLLM's own
    reload path and the baseline's inference side (tp 1). Returns ``(engine, runtime layouts
    by rank, weight-transfer client or None, baseline side or None, its loader or None)``; on
    an error the abort key names the instance and no vLLM process outlives it."""
    from weight_transfer.engines.vllm import VllmEngine, write_checkpoint
    from weight_transfer.engines.vllm.backend.plugin import BACKEND
    from weight_transfer.method import InferenceContext

    from .methods import get_method

    tp = cfg.inference.tp
    side = loader = wt = None
    engine = None
    try:
        _, _, infer_cls = get_method(cfg.run.method)
        t0 = time.perf_counter()
        ck0 = write_checkpoint(mcfg, root / "step0", step=0, seed=cfg.run.seed)
        if infer_cls.active:  # a baseline: vLLM's own reload path, no weight-transfer backend, nothing staged
            engine = VllmEngine(ck0, tp=tp, first_rank=instance * tp, seed=cfg.run.seed, targets="direct")
        else:  # the reference: vLLM's weight-transfer API with the one_sided backend
            engine = VllmEngine(ck0, tp=tp, first_rank=instance * tp, seed=cfg.run.seed, targets="direct",
                                weight_transfer_config={"backend": BACKEND})
        _log(instance, f"engine up in {time.perf_counter() - t0:.1f} s (tp={tp}, ranks {ranks}"
                       f"{'' if infer_cls.active else f', weight transfer backend {BACKEND!r}'})")
        if infer_cls.active:
            layouts = engine.runtime_layouts()
        else:
            t0 = time.perf_counter()
            wt, layouts = _init_backend(engine, cfg, instance, addr, store, ranks)
            _log(instance, f"init_weight_transfer_engine: {time.perf_counter() - t0:.2f} s (every worker reported, "
                           f"staged, registered and published its layout)")
        lay0 = layouts[ranks[0]]
        if lay0.staged:
            _log(instance, f"staged {len(lay0.staged)} layer(s) vLLM post-processes "
                           f"({', '.join(sorted({st['why'] for st in lay0.staged.values()}))}): "
                           f"{lay0.staged_bytes / 1e6:.1f} MB of staging per rank, direct {lay0.direct_bytes / 1e6:.1f} MB")
        if infer_cls.active:  # a baseline: its inference side, with vLLM's own loading path
            if tp != 1:
                raise ValueError(f"method {cfg.run.method!r} with vLLM needs tp 1, got {tp}")
            rank = ranks[0]
            loader = VllmLoadPath(engine, layouts[rank])
            side = infer_cls()
            payload = side.setup(InferenceContext(rank=rank, n_train=cfg.train.n_train, n_infer=cfg.n_infer, engine=loader,
                                                  store=store, transfer=cfg.resolved_transfer, method_options=cfg.baseline,
                                                  model_config=mcfg, layout=cfg.inference,
                                                  log=lambda m: _log(instance, m)))
            clients[rank].publish_meta(*payload)
    except Exception as e:
        store.set("abort", f"vLLM instance {instance} failed during setup: {type(e).__name__}: {e}".encode())
        traceback.print_exc()
        if engine is not None:
            engine.close()  # no vLLM process outlives a failed setup
        shutil.rmtree(root, ignore_errors=True)
        raise
    return engine, layouts, wt, side, loader


def _verify_version(engine, layouts: dict, wt, cfg, mcfg, root: Path, v: int, instance: int, ranks: list[int],
                    prompts) -> dict:
    """Verify published version ``v`` of this instance against a fresh vLLM loaded from the
    step's checkpoint: every addressable runtime byte, the staged bytes against what
    ``load_weights`` makes of the checkpoint, greedy outputs, and vLLM's own weight version;
    timed and logged. A verification that raises is a failed result naming the error."""
    from weight_transfer.engines.vllm.verify import compare_snapshots, coverage, snapshot, staging_oracle

    t0 = time.perf_counter()
    try:
        # the fresh engine first, while this process holds no copy of the live bytes: at 1.85 GB the
        # live engine, the fresh one, the trainers and these copies together outgrew a 23 GB host
        fresh = _fresh_snapshot(mcfg, root, v, cfg, instance, prompts)
        live = snapshot(engine, layouts, prompts)
        expected = None
        if live["staging"]:  # staged bytes vs what load_weights makes from the step's checkpoint
            from weight_transfer.testing.catalog import param_specs
            from weight_transfer.testing.weights import SyntheticCheckpoint

            ck = SyntheticCheckpoint(param_specs(mcfg), step=v, seed=cfg.run.seed)
            expected = staging_oracle(mcfg, {r: layouts[r] for r in ranks}, ck.__getitem__, ck.names(), tp=cfg.inference.tp)
        res = compare_snapshots(live, fresh, staging_expected=expected)
        res["coverage"] = coverage({r: layouts[r] for r in ranks}, res)
        if wt is not None:  # vLLM's own label of the weights: the version published, set by finish_weight_update
            res["weight_version"] = engine.llm.get_weight_version()
            if res["weight_version"] != str(v):
                res["ok"] = False
                res["mismatches"] = [*res["mismatches"],
                                     f"vLLM's weight version {res['weight_version']!r}, published {v}"]
        del live, fresh, expected
    except Exception as e:
        traceback.print_exc()
        res = {"ok": False, "mismatches": [f"verification failed: {type(e).__name__}: {e}"]}
    res["seconds"] = time.perf_counter() - t0
    cov = res.get("coverage") or {}
    lp = res.get("logprob_ulps")
    lp = "" if lp is None else f" (logprobs {'bit-identical' if lp == 0 else f'within {lp:.0f} ulp'})"
    wv = "" if "weight_version" not in res else f", weight version {res['weight_version']!r}"
    _log(instance, f"version {v}: bytes {'ok' if res.get('bytes_ok') else 'MISMATCH'}"
                   f"{'' if res.get('staging_ok') is None else ', staging ' + ('ok' if res['staging_ok'] else 'MISMATCH')}"
                   f", outputs {'ok' if res.get('outputs_ok') else 'MISMATCH'}"
                   f"{lp}{wv}"
                   f" vs a fresh vLLM "
                   f"({res['seconds']:.0f} s; byte check {100 * cov.get('direct', 0):.1f}% of the engine's bytes)")
    return res


def _pause_at_load(engine, wt, store, step: int, instance: int, ranks: list[int]) -> bool:
    """Pause generation before the first write of ``step``, once its "load" is out (the
    controller waits for :data:`KEY_PAUSED` before "go"), and open vLLM's update session.
    Returns without pausing at a shutdown; False when the session could not start (the abort
    key names this instance)."""
    key = f"step/{step}/load"
    while not store.check([key]):
        if store.check(["shutdown"]):
            return True
        time.sleep(0.005)
    engine.pause()
    if wt is not None:  # vLLM's update session; the workers refuse if a destination moved since init
        try:
            wt.start_weight_update()
        except Exception as e:
            traceback.print_exc()
            store.set("abort", f"inference {ranks[0]} (vLLM instance {instance}): start_weight_update of "
                               f"version {step} failed: {type(e).__name__}: {str(e).splitlines()[0]}".encode())
            return False
    store.set(KEY_PAUSED.format(step=step, instance=instance), b"1")
    return True


def vllm_instance_main(cfg, instance: int, addr: tuple[str, int], parent: int | None = None) -> None:
    """vLLM instance ``instance`` of the trial (see module docstring). Runs in a process group
    of its own (:func:`own_process_group`): no vLLM process outlives it."""
    own_process_group(parent)
    from weight_transfer.engines.vllm.backend.plugin import INCOMPLETE
    from weight_transfer.engines.vllm.verify import fixed_prompts

    from .methods import serve_active_step

    tp = cfg.inference.tp
    ranks = [instance * tp + t for t in range(tp)]
    store = store_api.make_store(addr[0], addr[1], is_master=False, timeout=cfg.transfer.control.timeout)
    clients = {r: InferenceClient(store, r, timeout=max(cfg.transfer.control.timeout, 600.0)) for r in ranks}
    mcfg = cfg.model_config()
    root = Path(tempfile.mkdtemp(prefix=f"wt-vllm{instance}-"))
    engine, layouts, wt, side, loader = _start_instance(cfg, instance, addr, store, clients, ranks, mcfg, root)
    prompts = fixed_prompts(mcfg.vocab_size)
    last, step = -1, 1
    while True:
        if not _pause_at_load(engine, wt, store, step, instance, ranks):
            break
        if store.check(["shutdown"]) and not store.check([f"step/{step}/load"]):
            break
        if side is not None:  # a baseline takes part in the update (vLLM's own loading path)
            try:
                if not serve_active_step(clients[ranks[0]], side, step):
                    break
            finally:
                loader.end()
        else:  # the backend commits every update: update_weights, finish_weight_update
            what = _wait_commit_or_failed(store, step)
            if what == "shutdown":
                _label(wt, INCOMPLETE.format(version=step), instance)
                break
            if what == "failed" or not _commit_through_backend(wt, store, step, ranks, instance,
                                                               INCOMPLETE.format(version=step)):
                if what == "failed":
                    _label(wt, INCOMPLETE.format(version=step), instance)
                engine.resume()
                step += 1  # the controller fails the trial or goes on with the next step
                continue
        v = clients[ranks[0]].wait_version_after(last)
        if v is None:
            break
        engine.reset_prefix_cache()
        engine.resume()
        last, step = v, v + 1
        if not cfg.run.verify:
            for r in ranks:
                clients[r].report(v, {"ok": None})
            continue
        res = _verify_version(engine, layouts, wt, cfg, mcfg, root, v, instance, ranks, prompts)
        for r in ranks:
            clients[r].report(v, res)
    if side is not None:
        side.teardown()
    if wt is not None:
        try:
            engine.llm.shutdown_weight_transfer_engine()  # releases the workers' registrations
        except Exception as e:
            _log(instance, f"shutdown_weight_transfer_engine: {type(e).__name__}: {e}")
    engine.close()
    shutil.rmtree(root, ignore_errors=True)  # the step checkpoints written for this trial
