"""One-sided updates of a live vLLM engine from one training process holding whole tensors.

The smallest complete path, used by the vLLM tests and by ``python -m weight_transfer.engines.vllm.demo``:
the runtime layout the engine reports -> recipes aimed at it (:func:`weight_transfer.engines.vllm.worker.runtime.retarget`)
-> the real planner -> the real executor -> ``process_vm_writev`` into the vLLM worker
process(es). Around the writes only control-plane calls reach vLLM: pause, reset the prefix
cache, resume. The multi-process trial (``weight-transfer run --engine vllm``) uses the
same pieces with FSDP2 training ranks.
"""
from __future__ import annotations

import time

import torch

from weight_transfer.engines.vllm.worker.runtime import retarget
from weight_transfer.pipeline.executor import Executor
from weight_transfer.plan import build_recipes, plan
from weight_transfer.plan.metadata import whole_metas
from weight_transfer.transport import make_transport
from weight_transfer.types import InferenceLayout, ParamMeta, dtype_name

__all__ = ["OneSidedUpdater", "source_metas"]


def source_metas(sources: dict[str, torch.Tensor]) -> dict[int, list[ParamMeta]]:
    """Training rank 0 holding every tensor whole (a 1-rank mesh)."""
    return {0: whole_metas(sources, 0)}


class OneSidedUpdater:
    """Plans once against ``engine``'s runtime layout and writes whole-tensor ``sources``.

    ``cfg``: the model (:class:`weight_transfer.model_config.ModelConfig`); ``engine``: a
    :class:`weight_transfer.engines.vllm.VllmEngine`. Raises :class:`weight_transfer.plan.PlanError` from
    :meth:`plan` when some runtime tensor cannot be written (named, with vLLM's step)."""

    def __init__(self, cfg, engine):
        self.cfg, self.engine = cfg, engine
        self.layouts = engine.runtime_layouts()
        self.descriptors = {r: lay.descriptor() for r, lay in self.layouts.items()}
        self.tx = make_transport("cma")
        self.tx.connect(list(self.descriptors.values()))
        self.schedule = None
        self.recipes = None

    def plan(self, sources: dict[str, torch.Tensor]):
        layout = InferenceLayout(tp=self.engine.tp)
        rs = build_recipes(self.cfg, layout, source_dtypes={n: dtype_name(t.dtype) for n, t in sources.items()})
        self.recipes = retarget(rs, self.layouts)
        self.schedule = plan(self.recipes, source_metas(sources),
                             {r: lay.dest_metas() for r, lay in self.layouts.items()})
        return self.schedule

    def update(self, sources: dict[str, torch.Tensor]) -> dict:
        """pause -> one-sided writes (direct and staged targets) -> commit (vLLM re-processes
        the staged layers) -> reset prefix cache -> resume. Returns ``{"bytes", "writes",
        "seconds", "write_seconds", "commit_seconds", "bytes_staged"}`` (seconds: the whole
        sequence; commit: the slowest worker's)."""
        if self.schedule is None:
            self.plan(sources)
        t0 = time.perf_counter()
        self.engine.pause()
        try:
            t1 = time.perf_counter()
            stats = self._executor(sources).run()
            t2 = time.perf_counter()
            commit = self.engine.commit()
            self.engine.reset_prefix_cache()
        finally:
            self.engine.resume()
        return {"bytes": stats.bytes_sent, "writes": stats.n_writes, "seconds": time.perf_counter() - t0,
                "write_seconds": t2 - t1, "commit_seconds": max(c["seconds"] for c in commit),
                "bytes_staged": sum(lay.staged_bytes for lay in self.layouts.values())}

    def _executor(self, sources: dict[str, torch.Tensor]) -> Executor:
        """The executor of the plan, built once (its memory registered once) and kept while the
        sources are the same storages; rebuilt (the old one's registrations released) when a
        caller hands tensors in other memory."""
        key = tuple((n, t.untyped_storage().data_ptr()) for n, t in sources.items())
        if getattr(self, "_ex", None) is None or self._ex_key != key:
            if getattr(self, "_ex", None) is not None:
                self._ex.close()
            self._ex = Executor(self.schedule.rank_plans[0], sources, self.tx, self.descriptors)
            self._ex_key = key
        return self._ex

    def close(self) -> None:
        if getattr(self, "_ex", None) is not None:
            self._ex.close()
            self._ex = None
        self.tx.close()

