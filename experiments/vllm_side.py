"""The inference side of a trial when the engine is an unmodified vLLM (``--engine vllm``).

One process per vLLM instance (inference ranks ``d*tp .. d*tp+tp-1``): it writes the step-0
checkpoint, starts :class:`weight_transfer.engines.vllm.VllmEngine`, and publishes for each of its ranks the
CMA region descriptor and the destination metadata *read from the running engine* (after
``process_weights_after_loading``), plus the :class:`weight_transfer.engines.vllm.runtime.RuntimeLayout` under
``meta/infer_runtime/{rank}`` so the controller plans against the runtime layout
(:func:`weight_transfer.retarget.retarget`). Per update, only control-plane calls reach vLLM:
``pause`` when the controller announces the step (before any write), ``reset_prefix_cache`` and
``resume`` once the version is published. Verification by vLLM itself: a fresh engine started
from that step's checkpoint; every runtime tensor byte and the greedy tokens + logprobs of fixed
prompts (one longer than two KV blocks) must be equal.

Baselines (``--method rank0_funnel|rpc``, ``--tp 1``): the method's own inference side
(:class:`weight_transfer.baselines.funnel.FunnelInference`, :class:`weight_transfer.baselines.rpc.RpcInference`) runs in this
process with :class:`VllmLoadPath` as its engine: every ``load_weights`` call becomes one
``collective_rpc`` into the worker's ``model.load_weights`` inside vLLM's in-place reload
(``initialize_layerwise_reload`` before the first tensor of an update,
``finalize_layerwise_reload`` at ``process_weights_after_loading``; see
:mod:`weight_transfer.engines.vllm.extension`), the path verl / OpenRLHF / TRL use. Verification is the same
as for the reference.

Oracle cache: when ``WT_VLLM_ORACLE_DIR`` is set (``--method all`` sets it for its run), the
fresh engine's snapshot of a step is saved there and reused by the next method's trial of the
same model, step, seed and TP (the same checkpoint, prompts and vLLM: the same bytes and
outputs), so ``--method all`` starts one fresh engine per step instead of three.

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

from weight_transfer import control

__all__ = ["vllm_instance_main", "KEY_RUNTIME", "KEY_PAUSED", "VllmLoadPath", "ORACLE_DIR_ENV", "own_process_group",
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
        snap = torch.load(path, weights_only=False)
        # ranks of this instance (the cached one may come from instance 0)
        return {"tensors": {instance * cfg.inference.tp + (r - min(snap["tensors"])): t for r, t in snap["tensors"].items()},
                "outputs": snap["outputs"]}
    fresh_engine = VllmEngine(write_checkpoint(mcfg, root / f"step{v}", step=v, seed=cfg.run.seed), tp=cfg.inference.tp,
                              first_rank=instance * cfg.inference.tp, seed=cfg.run.seed, targets="direct")
    try:
        snap = snapshot(fresh_engine, fresh_engine.runtime_layouts(), prompts)
    finally:
        fresh_engine.close()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(snap, tmp)
        os.replace(tmp, path)
    return snap


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


def vllm_instance_main(cfg, instance: int, addr: tuple[str, int], parent: int | None = None) -> None:
    """vLLM instance ``instance`` of the trial (see module docstring). Runs in a process group
    of its own (:func:`own_process_group`): no vLLM process outlives it."""
    own_process_group(parent)
    from weight_transfer.engines.vllm import VllmEngine, write_checkpoint
    from weight_transfer.engines.vllm.verify import compare_snapshots, coverage, fixed_prompts, snapshot, staging_oracle
    from weight_transfer.method import InferenceContext

    from .methods import get_method, serve_active_step

    tp = cfg.inference.tp
    ranks = [instance * tp + t for t in range(tp)]
    store = control.make_store(addr[0], addr[1], is_master=False, timeout=cfg.transfer.control.timeout)
    clients = {r: control.InferenceClient(store, r, timeout=max(cfg.transfer.control.timeout, 600.0)) for r in ranks}
    mcfg = cfg.model_config()
    root = Path(tempfile.mkdtemp(prefix=f"wt-vllm{instance}-"))
    side = loader = None
    engine = None
    try:
        _, _, infer_cls = get_method(cfg.run.method)
        t0 = time.perf_counter()
        # the reference stages what vLLM keeps opaque; a baseline uses vLLM's own reload (nothing staged)
        engine = VllmEngine(write_checkpoint(mcfg, root / "step0", step=0, seed=cfg.run.seed), tp=tp,
                            first_rank=instance * tp, seed=cfg.run.seed,
                            targets="direct" if infer_cls.active else cfg.run.vllm_targets)
        _log(instance, f"engine up in {time.perf_counter() - t0:.1f} s (tp={tp}, ranks {ranks})")
        layouts = engine.runtime_layouts()
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
                                                  store=store, transfer=cfg.transfer, method_options=cfg.baseline,
                                                  model_config=mcfg, layout=cfg.inference,
                                                  log=lambda m: _log(instance, m)))
            clients[rank].publish_meta(*payload)
        else:
            for r in ranks:
                lay = layouts[r]
                control.put(store, KEY_RUNTIME.format(rank=r), lay)
                clients[r].publish_meta(lay.descriptor(), lay.dest_metas())
    except Exception as e:
        store.set("abort", f"vLLM instance {instance} failed during setup: {type(e).__name__}: {e}".encode())
        traceback.print_exc()
        if engine is not None:
            engine.close()  # no vLLM process outlives a failed setup
        shutil.rmtree(root, ignore_errors=True)
        raise
    needs_commit = side is None and any(layouts[r].needs_commit for r in ranks)
    prompts = fixed_prompts(mcfg.vocab_size)
    last, step = -1, 1
    while True:
        # pause before the first write of `step`: the controller waits for this key before "go"
        key = f"step/{step}/load"
        while not store.check([key]):
            if store.check(["shutdown"]):
                break
            time.sleep(0.005)
        else:
            engine.pause()
            store.set(KEY_PAUSED.format(step=step, instance=instance), b"1")
        if store.check(["shutdown"]) and not store.check([key]):
            break
        if side is not None:  # a baseline takes part in the update (vLLM's own loading path)
            try:
                if not serve_active_step(clients[ranks[0]], side, step):
                    break
            finally:
                loader.end()
        elif needs_commit:  # staged targets: vLLM re-processes them once every write of the step landed
            if not clients[ranks[0]].wait_commit(step):
                break
            try:
                res = engine.commit()
                for r, c in zip(ranks, res):
                    clients[r].committed(step, ok=True, stats=c)
            except Exception as e:  # reported: the controller fails the update, naming us
                traceback.print_exc()
                for r in ranks:
                    clients[r].committed(step, ok=False, error=f"{type(e).__name__}: {e}")
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
        t0 = time.perf_counter()
        try:
            live = snapshot(engine, layouts, prompts)
            expected = None
            if live["staging"]:  # staged bytes vs what load_weights makes from the step's checkpoint
                from weight_transfer.testing.catalog import param_specs
                from weight_transfer.testing.weights import SyntheticCheckpoint

                ck = SyntheticCheckpoint(param_specs(mcfg), step=v, seed=cfg.run.seed)
                expected = staging_oracle(mcfg, {r: layouts[r] for r in ranks}, ck.__getitem__, ck.names(), tp=tp)
            fresh = _fresh_snapshot(mcfg, root, v, cfg, instance, prompts)
            res = compare_snapshots(live, fresh, staging_expected=expected)
            res["coverage"] = coverage({r: layouts[r] for r in ranks}, res)
            del live, fresh, expected
        except Exception as e:
            traceback.print_exc()
            res = {"ok": False, "mismatches": [f"verification failed: {type(e).__name__}: {e}"]}
        res["seconds"] = time.perf_counter() - t0
        cov = res.get("coverage") or {}
        lp = res.get("logprob_ulps")
        lp = "" if lp is None else f" (logprobs {'bit-identical' if lp == 0 else f'within {lp:.0f} ulp'})"
        _log(instance, f"version {v}: bytes {'ok' if res.get('bytes_ok') else 'MISMATCH'}"
                       f"{'' if res.get('staging_ok') is None else ', staging ' + ('ok' if res['staging_ok'] else 'MISMATCH')}"
                       f", outputs {'ok' if res.get('outputs_ok') else 'MISMATCH'}"
                       f"{lp}"
                       f" vs a fresh vLLM "
                       f"({res['seconds']:.0f} s; byte check {100 * cov.get('direct', 0):.1f}% of the engine's bytes)")
        for r in ranks:
            clients[r].report(v, res)
    if side is not None:
        side.teardown()
    engine.close()
    shutil.rmtree(root, ignore_errors=True)  # the step checkpoints written for this trial
