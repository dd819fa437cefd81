"""Planning: the static schedule of a weight update -- who sends which bytes to whom, and in
what order. Computed once, read in one direction:

- :mod:`.recipes` (with the per-family vLLM rules of :mod:`.rules`): what every destination
  byte is made of (:func:`build_recipes`, a :class:`RecipeSet`);
- :mod:`.checks` (and :mod:`.sources`, :mod:`.screen`): every check, before a schedule is returned;
- :mod:`.schedule`: the tasks and writes, one sender policy (:mod:`.assign`, its C kernel
  ``_greedy.c``); :mod:`.local`: which recipes
  the ranks make from their own shards (shard-local prepare) and which need ``full_tensor()``,
  from :mod:`.owners`: which training rank holds which rows.

The plan's types (:class:`~weight_transfer.types.Schedule`, :class:`~weight_transfer.types.RankPlan`,
:class:`~weight_transfer.types.Task`, :class:`~weight_transfer.types.Assignment`,
:class:`~weight_transfer.types.WriteSpec`) and :class:`~weight_transfer.types.PlanError` are in
:mod:`weight_transfer.types`.

:func:`plan` is a pure function of (training metadata, recipes, inference metadata). It

1. checks the training side is consistent (every rank agrees on a parameter's global shape,
   dtype, mesh and placements; the shards of each parameter tile it) and validates the recipes
   against both sides (:func:`weight_transfer.plan.checks.validate`: every destination byte covered once,
   missing / unused / mismatched tensors named) -- all before any byte moves, and before a
   schedule is returned (at Kimi-K2 scale in a forked child process while steps 2-4 run);
2. turns each fusion group (recipes sharing sources, e.g. q/k/v -> every TP rank's
   ``qkv_proj``) into a :class:`Task`; every rank of the sources' DeviceMesh runs the task's
   ``full_tensor()`` calls in the same order, so any of them can make any output;
3. splits outputs larger than ``max_chunk_bytes`` into row bands and assigns each
   (recipe, receiving rank) write to one rank of the mesh, greedily to the least-loaded sender
   (bytes), ties to the one that sends least to that receiver: the busiest NIC sets the time;
4. orders tasks by mesh group (disjoint meshes run in parallel; groups are separated by a
   barrier) then checkpoint order.

Deterministic: same inputs, same schedule. Errors are :class:`weight_transfer.types.PlanError`
naming the tensors or ranks.

The schedule's fast record constructors (:mod:`.fast`) and the recipes of per-tensor and
per-channel FP8 (:mod:`.scaled`) serve the same steps. Beside the planner: :mod:`.metadata` (what a training rank publishes about its parameters,
the planner's input) and :mod:`.retarget` (recipes aimed at the runtime tensors a live engine
reports).

Imports: ``types``, ``model_config``, ``native``, ``convert``.
"""
from __future__ import annotations

import contextlib
import gc
import warnings
from functools import partial

from ..types import Assignment, DestTensorMeta, ParamMeta, PlanError, RankPlan, Schedule, Task, WriteSpec
from .checks import (  # noqa: F401
    PARALLEL_CHECKS_MIN_RECORDS,
    _check_sources,
    _fork_checks_by_default,
    _ForkedChecks,
    _index_sources,
    _IndexUnconfirmed,
    _run_checks,
    validate,
)
from .recipes import (
    QUANT_BLOCK,
    VOCAB_PAD,
    RecipeSet,
    build_recipes,
    expected_dest_shapes,
    expected_dests,
    fusion_groups,
    make_dest_metas,
)
from .schedule import _schedule, mesh_groups

__all__ = [
    "gc_paused",
    "plan", "build_recipes", "RecipeSet", "fusion_groups", "validate", "expected_dests", "expected_dest_shapes",
    "make_dest_metas", "mesh_groups", "PlanError", "Schedule", "RankPlan", "Task", "Assignment", "WriteSpec",
    "VOCAB_PAD", "QUANT_BLOCK", "PARALLEL_CHECKS_MIN_RECORDS",
]


def plan(recipes: RecipeSet, train_metas: dict[int, list[ParamMeta]], dest_metas: dict[int, list[DestTensorMeta]],
         *, max_chunk_bytes: int = 64 << 20, local_writes: bool = True, local_min_bytes: int = 256 << 10,
         local_max_writes: int = 16, parallel_checks: bool | None = False, pause_gc: bool = False) -> Schedule:
    """Compute the static schedule (see module docstring).

    ``train_metas``: per training rank, what it publishes; ``dest_metas``: per inference rank,
    its tensors in its region. ``max_chunk_bytes`` bounds one recipe output before it is split
    into row bands spread over senders. Raises PlanError naming tensors or ranks; no schedule
    is returned unless every check passed.

    The caller's process is left as it was unless it asks otherwise (a trainer embedding this
    may run NCCL or Gloo threads, where an unasked-for fork is a hazard):

    ``parallel_checks``: ``False`` (default) runs the checks (training metadata consistency,
    :func:`validate`; ~0.7 s CPU at Kimi-K2 scale with 357k training records, ~2 s with 2.4
    million) in this process before the schedule is built. ``True`` runs them in a forked child
    process while this one builds the schedule (:class:`_ForkedChecks`); ``None`` does so when
    the metadata has at least :data:`PARALLEL_CHECKS_MIN_RECORDS` records, on Linux with two or
    more usable CPUs (what the harness asks for: ``ReferenceController``, the simulation). When
    the schedule's construction fails too, the checks' error is raised (it names the cause).
    The schedule is the same either way.

    ``pause_gc``: pause the cyclic garbage collector while planning (and restore the state it
    found): at Kimi-K2 scale the schedule is millions of small acyclic objects and each full
    collection would rescan all of them and the metadata (the harness asks for it). ``False``
    (default) leaves the GC alone."""
    with gc_paused() if pause_gc else contextlib.nullcontext():
        return _plan(recipes, train_metas, dest_metas, max_chunk_bytes=max_chunk_bytes, local_writes=local_writes,
                     local_min_bytes=local_min_bytes, local_max_writes=local_max_writes,
                     parallel_checks=parallel_checks)


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector inside the block and restore the state it found (for a
    planning process of its own, e.g. a controller: building recipes and a schedule at Kimi-K2
    scale makes millions of small acyclic objects, and each full collection would rescan them
    all; the harness plans under it). Not thread-local: the GC is the process's."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan(recipes, train_metas, dest_metas, *, max_chunk_bytes, local_writes, local_min_bytes, local_max_writes,
          parallel_checks):
    """:func:`plan`'s body (the GC already as the caller wants it)."""
    kw = dict(max_chunk_bytes=max_chunk_bytes, local_writes=local_writes, local_min_bytes=local_min_bytes,
              local_max_writes=local_max_writes)
    dests = {(m.rank, m.name): m for ms in dest_metas.values() for m in ms}
    if parallel_checks is None:
        parallel_checks = _fork_checks_by_default(train_metas)
    ix = _index_sources(train_metas, exact=False)  # confirmed by the checks
    if parallel_checks:
        try:
            forked = _ForkedChecks(partial(_run_checks, recipes, train_metas, ix, dests, confirm_index=True))
        except OSError as e:  # cannot fork (memory, process limit): check here
            warnings.warn(f"plan(): cannot fork the checks ({str(e) or type(e).__name__}); checking in this process",
                          RuntimeWarning, stacklevel=3)
        else:
            try:
                try:
                    sched = _schedule(recipes, train_metas, dest_metas, ix, dests, **kw)
                except Exception:
                    forked.join()  # bad input usually breaks the construction too: raise what the checks found
                    raise
                forked.join()
                return sched
            except _IndexUnconfirmed:
                ix = None  # a rank publishes other names than its sampled twin: index exactly, plan again
            finally:
                forked.close()
    if ix is not None:
        try:
            _run_checks(recipes, train_metas, ix, dests, confirm_index=True)
        except _IndexUnconfirmed:
            ix = None
    if ix is None:
        ix = _index_sources(train_metas)
        _run_checks(recipes, train_metas, ix, dests)
    return _schedule(recipes, train_metas, dest_metas, ix, dests, **kw)
