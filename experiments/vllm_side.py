"""The inference side of a trial when the engine is an unmodified vLLM (``--engine vllm``).

One process per vLLM instance (inference ranks ``d*tp .. d*tp+tp-1``): it writes the step-0
checkpoint, starts :class:`engines.vllm.VllmEngine`, and publishes for each of its ranks the
CMA region descriptor and the destination metadata *read from the running engine* (after
``process_weights_after_loading``), plus the :class:`engines.vllm.runtime.RuntimeLayout` under
``meta/infer_runtime/{rank}`` so the controller plans against the runtime layout
(:func:`reference.retarget.retarget`). Per update, only control-plane calls reach vLLM:
``pause`` when the controller announces the step (before any write), ``reset_prefix_cache`` and
``resume`` once the version is published. Verification by vLLM itself: a fresh engine started
from that step's checkpoint; every runtime tensor byte and the greedy tokens + logprobs of fixed
prompts (one longer than two KV blocks) must be equal.

Log lines are prefixed ``[vllm d]``.
"""
from __future__ import annotations

import sys
import tempfile
import time
import traceback
from pathlib import Path

from reference import control

__all__ = ["vllm_instance_main", "KEY_RUNTIME", "KEY_PAUSED"]

from reference.method import RUNTIME_KEY as KEY_RUNTIME  # noqa: E402

KEY_PAUSED = "step/{step}/paused/{instance}"
"""Set by a vLLM instance once generation is paused for ``step`` (before the controller says go)."""


def _log(instance: int, msg: str) -> None:
    print(f"[vllm {instance}] {msg}", file=sys.stderr, flush=True)


def vllm_instance_main(cfg, instance: int, addr: tuple[str, int]) -> None:
    """vLLM instance ``instance`` of the trial (see module docstring)."""
    from engines.vllm import VllmEngine, write_checkpoint
    from engines.vllm.verify import compare_snapshots, fixed_prompts, snapshot

    tp = cfg.tp
    ranks = [instance * tp + t for t in range(tp)]
    store = control.make_store(addr[0], addr[1], is_master=False, timeout=cfg.timeout)
    clients = {r: control.InferenceClient(store, r, timeout=max(cfg.timeout, 600.0)) for r in ranks}
    mcfg = cfg.model_config()
    root = Path(tempfile.mkdtemp(prefix=f"wt-vllm{instance}-"))
    try:
        t0 = time.perf_counter()
        engine = VllmEngine(write_checkpoint(mcfg, root / "step0", step=0, seed=cfg.seed), tp=tp,
                            first_rank=instance * tp, seed=cfg.seed)
        _log(instance, f"engine up in {time.perf_counter() - t0:.1f} s (tp={tp}, ranks {ranks})")
        layouts = engine.runtime_layouts()
        for r in ranks:
            lay = layouts[r]
            control.put(store, KEY_RUNTIME.format(rank=r), lay)
            clients[r].publish_meta(lay.descriptor(), lay.dest_metas())
    except Exception as e:  # noqa: BLE001
        store.set("abort", f"vLLM instance {instance} failed during setup: {type(e).__name__}: {e}".encode())
        traceback.print_exc()
        raise
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
        v = clients[ranks[0]].wait_version_after(last)
        if v is None:
            break
        engine.reset_prefix_cache()
        engine.resume()
        last, step = v, v + 1
        if not cfg.verify:
            for r in ranks:
                clients[r].report(v, {"ok": None})
            continue
        t0 = time.perf_counter()
        try:
            live = snapshot(engine, layouts, prompts)
            fresh_engine = VllmEngine(write_checkpoint(mcfg, root / f"step{v}", step=v, seed=cfg.seed), tp=tp,
                                      first_rank=instance * tp, seed=cfg.seed)
            try:
                fresh = snapshot(fresh_engine, fresh_engine.runtime_layouts(), prompts)
            finally:
                fresh_engine.close()
            res = compare_snapshots(live, fresh)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res = {"ok": False, "mismatches": [f"verification failed: {type(e).__name__}: {e}"]}
        res["seconds"] = time.perf_counter() - t0
        _log(instance, f"version {v}: bytes {'ok' if res.get('bytes_ok') else 'MISMATCH'}, outputs "
                       f"{'ok' if res.get('outputs_ok') else 'MISMATCH'} vs a fresh vLLM ({res['seconds']:.0f} s)")
        for r in ranks:
            clients[r].report(v, res)
    engine.close()
