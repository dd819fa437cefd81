"""Packed delta updates in a vLLM worker of the ``one_sided`` backend: the landing region,
registered once beside the worker's targets, and the scatter its ``update_weights`` runs
(:mod:`weight_transfer.delta.packed` has the format and the checks).

- :func:`attach` (``init_transfer_engine``, after the targets are registered and published):
  with ``OneSidedInitInfo.delta_landing > 0`` (the trainer sets it from its
  ``ExecutorOptions.delta_landing`` when it runs delta updates that may pack), allocate
  ``delta_landing x`` the worker's target bytes of host memory, register it with the
  receiver's own transport and publish its descriptor
  (:data:`weight_transfer.delta.packed.LANDING_KEY`); the senders read it when they build their
  executors. CPU targets only (``cma``; a GPU worker would scatter with a kernel: not built), so a
  worker on another transport publishes none and gets no packed records.
- :func:`apply_delta` (``update_weights(v)``, after the backend checked every training rank
  reported ``ok`` for ``v``, before the staged layers are post-processed or the shadow goes
  live): every record of version ``v`` checked, then scattered into the registered target
  region -- the staging tensors of staged layers, the runtime bytes of direct ones, the shadow
  with shadow targets (the trainers' offsets already point there). A malformed payload is
  refused before any byte is scattered; any failure is reported as this rank's failed commit
  (``step/{v}/committed/{rank}``) and raised, so the version is not published complete and the
  next update is full (C26). With ``defer`` (the commit re-runs vLLM's post-processing of staged
  layers, no shadow targets) the format-3 records that land in the staging arena are checked
  with the rest but not scattered yet: the commit copies each staging tensor into the layer
  vLLM post-processes anyway, and :func:`copy_in` applies those records during that copy (one
  pass over the staging bytes instead of a scatter and then a copy). Only records inside a
  staging tensor of a ``"copy"`` layer are deferred (the tensors the commit copies), so none is
  left after a commit that completed; :func:`finish` checks that and fails the commit if one
  was (its bytes would be in the staging but not in the layer vLLM computes with).
- :func:`close` (``shutdown``): unpublish and deregister.
"""
from __future__ import annotations

__all__ = ["attach", "apply_delta", "copy_in", "finish", "close"]


def attach(engine, rx, layout, store, rank: int, fraction: float):
    """Register and publish a landing region of ``fraction`` x the target bytes of ``layout``
    for the worker whose receiver is ``rx``; returns the
    :class:`~weight_transfer.delta.packed.Landing`, or None (``fraction`` 0, a transport other
    than ``cma``/``shm``, or GPU targets). ValueError for a fraction outside [0, 4]."""
    from weight_transfer.control.wire import put
    from weight_transfer.delta.packed import LANDING_KEY, Landing

    fraction = float(fraction or 0.0)
    if not 0 <= fraction <= 4:
        raise ValueError(f"delta_landing={fraction}: a fraction of the target bytes in [0, 4]")
    try:
        store.delete_key(LANDING_KEY.format(rank=rank))  # a predecessor's, if any
    except Exception:
        pass
    tx = getattr(rx, "transport", None)
    if not fraction or tx is None or tx.name not in ("cma", "shm"):
        return None
    target = sum(m.nbytes for m in layout.dest_metas())
    landing = Landing(Landing.size_for(target, fraction), tx)
    put(store, LANDING_KEY.format(rank=rank), landing.descriptor)  # the senders read it at their executor's build
    landing.rank = rank
    return landing


def apply_delta(engine, version: int, defer: bool = False) -> dict:
    """Scatter the packed records of ``version`` in ``engine.delta_landing`` (none: ``{}``) into
    the registered target region of ``engine.receiver``; with ``defer``, format-3 records inside
    a staging tensor of a ``"copy"`` layer (``engine.targets.staged``) are left to
    :func:`copy_in`. Returns the
    apply's stats (``delta_apply_s`` seconds, ``delta_records``, ``delta_runs``,
    ``delta_bytes``, ``delta_deferred``); on any error reports this rank's commit failed in the
    store and raises RuntimeError."""
    landing = getattr(engine, "delta_landing", None)
    if landing is None:
        return {}
    from weight_transfer.transport.ops import parts_bounds

    try:
        d = engine.receiver.descriptor
        pb = parts_bounds(d)
        parts = list(zip(*pb)) if pb is not None else [(0, d.length)]
        staged = (getattr(getattr(engine, "targets", None), "staged", None) or {}) if defer else {}
        ranges = tuple((t.data_ptr() - d.addr, t.data_ptr() - d.addr + t.numel() * t.element_size())
                       for st in staged.values() if st["mode"] == "copy" for t in st["params"].values()
                       if t.device.type == "cpu")
        return landing.apply(version, d.addr, parts, defer=ranges)
    except Exception as e:
        _failed(engine, version, e)


def copy_in(engine):
    """The commit's copy of a staging tensor for ``engine`` (``WorkerTargets.commit(copy_in=...)``):
    ``(dst, src) -> bool``, :meth:`weight_transfer.delta.packed.Landing.copy_in` against the
    receiver's region; None when there is no landing region or nothing was deferred."""
    landing = getattr(engine, "delta_landing", None)
    if landing is None or not landing.deferred:
        return None
    base = engine.receiver.descriptor.addr
    return lambda dst, src: landing.copy_in(dst, src, base)


def finish(engine, version: int, stats: dict) -> dict:
    """After the commit: add ``delta_patch_s`` (seconds of the commit's copies with records
    applied: the copies the commit makes anyway, plus the scatter) to ``stats``. A deferred
    record the commit's copies did not take means a staging tensor the commit did not copy:
    its bytes are scattered into the staging, and since the layer vLLM computes with lacks
    them, this rank's commit is reported failed and RuntimeError raised (the version is not
    published complete; the next update is full)."""
    landing = getattr(engine, "delta_landing", None)
    if landing is None:
        return stats

    try:
        flushed = landing.flush(engine.receiver.descriptor.addr)
        if flushed:
            raise RuntimeError(f"{flushed} deferred record(s) were not applied by the commit's staging copies")
    except Exception as e:
        _failed(engine, version, e)
    return {**stats, "delta_patch_s": landing.patch_s}


def _failed(engine, version: int, e: Exception):
    """Report this rank's commit of ``version`` failed because its packed delta was not applied
    (``step/{v}/committed/{rank}``) and raise RuntimeError from ``e``."""
    from weight_transfer.control import protocol as control

    why = f"packed delta of version {version} not applied: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    control.put(engine.store, f"step/{version}/committed/{engine.rank}", {"ok": False, "error": why, "stats": None})
    raise RuntimeError(f"{engine._who()}: {why}") from e


def close(engine) -> None:
    """Unpublish and deregister ``engine.delta_landing`` (idempotent)."""
    landing = getattr(engine, "delta_landing", None)
    if landing is None:
        return
    engine.delta_landing = None
    from weight_transfer.delta.packed import LANDING_KEY

    try:
        engine.store.delete_key(LANDING_KEY.format(rank=landing.rank))
    except Exception:
        pass
    landing.close()

