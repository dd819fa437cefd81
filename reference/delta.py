"""Delta updates: each sender writes only the byte runs of its outputs that differ from what it
last wrote there (``ExecutorOptions(delta=True)``, ``weight-transfer run --delta``).

The plan stays static: every write of the schedule still names one whole output and one
receiver. Per update, for every output a write reads (a view of a shard, or a slot the prepare
stage built in the output pool), the sender compares the output's bytes exactly with its
*shadow* -- a copy of what it wrote there last time -- at ``granularity`` bytes (blocks counted
from the output's first byte), coalesces changed blocks into runs (adjacent ones, and ones
separated by fewer than ``merge_gap`` unchanged bytes: writing those is cheaper than another
op), posts one op per run and receiver instead of one op per output and receiver, and copies
the changed blocks into the shadow. The receiver is passive as before (it holds exactly what
the sender wrote last, so unchanged bytes are already right) and the version protocol is the
control plane's, unchanged: ``writing v`` before the first byte, ``complete v`` after the last.

Memory on the trainer: one shadow byte per byte of every distinct output this rank writes (an
output written to several receivers, e.g. DP replicas, is compared and shadowed once), in one
buffer on the executor's device, allocated when the executor is built:
:attr:`DeltaState.shadow_bytes` (the log line and the run's ``delta_shadow_bytes`` column say
it). ``max_bytes`` bounds it: an executor whose plan needs more is refused at construction,
naming both numbers (``--delta-max-mb``).

When the receiver may not hold what the shadow says (case C26), the next update is **full**
(every output written whole, the shadow refreshed):

- the first update of an executor (a new plan, a new membership, a new receiver: every
  replan builds a new executor, so a newcomer's first update is full for every sender);
- after any update of this executor that failed or was aborted (``run`` raised);
- after an update that did not end ``complete`` in the control plane (another rank failed, a
  commit failed): :func:`check_published` reads the persistent ``complete/{v}`` key the
  coordinator sets when it publishes (checked by :class:`weight_transfer.api.Sender` before
  every update);
- when a receiver's descriptor changed since the last update (another epoch, key or address:
  the region was re-registered);
- :meth:`DeltaState.invalidate` (a caller that knows better).

Why these defaults (measured on the 2-core CI VM, ``weight-transfer bench-delta``; see
docs/DELTA.md): one op costs about 2.5-3.5 us of Python (the WriteOp, the base checks, the iovec
or memcpy) whatever its size, while a byte costs about 0.2 ns (4-5 GB/s), so an op is worth
about 12 KiB of bytes here. ``granularity`` 128 bytes is the FP8 row of
:mod:`weight_transfer.changes` (and 64 bf16 elements): finer blocks cost compare work for no
fewer ops once runs are merged; ``merge_gap`` 4 KiB keeps the op count bounded (at most one op
per 4 KiB of output and receiver) while writing at most 4 KiB of unchanged bytes per gap.
"""
from __future__ import annotations

import torch

__all__ = ["DeltaState", "changed_runs", "check_published", "COMPLETE_KEY"]

COMPLETE_KEY = "complete/{version}"
"""Control-plane key the coordinator sets when it publishes ``complete version`` (persistent:
later states overwrite ``weights``, not this)."""


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` (flat uint8) viewed as the widest integers its address and length allow."""
    for dt, k in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if t.numel() % k == 0 and t.data_ptr() % k == 0:
            return t.view(dt)
    return t


def changed_blocks(new: torch.Tensor, old: torch.Tensor, granularity: int) -> torch.Tensor:
    """Bool per ``granularity``-byte block of flat uint8 ``new`` (the last one may be short):
    True where any byte differs from ``old``."""
    n = new.numel()
    g = granularity
    body = (n // g) * g
    parts = []
    if body:
        a, b = _words(new[:body]), _words(old[:body])
        parts.append((a != b).view(n // g, -1).any(1))
    if body < n:
        parts.append(torch.ne(new[body:], old[body:]).any().view(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def changed_runs(new: torch.Tensor, old: torch.Tensor, granularity: int = 128,
                 merge_gap: int = 0) -> list[tuple[int, int]]:
    """Byte runs ``[(start, length)]`` of flat uint8 ``new`` that differ from ``old`` at
    ``granularity``-byte blocks (a run covers whole blocks, the last one clipped to the end),
    adjacent changed blocks coalesced, runs separated by at most ``merge_gap`` unchanged bytes
    merged. Empty when nothing changed."""
    n = new.numel()
    if n == 0:
        return []
    m = changed_blocks(new, old, granularity)
    idx = m.nonzero().flatten()
    if idx.numel() == 0:
        return []
    gap_blocks = max(0, merge_gap // granularity)
    brk = ((idx[1:] - idx[:-1]) > gap_blocks + 1).nonzero().flatten()
    starts = torch.cat([idx[:1], idx[brk + 1]])
    ends = torch.cat([idx[brk], idx[-1:]]) + 1
    s = (starts * granularity).tolist()
    e = (ends * granularity).clamp_(max=n).tolist()
    return [(a, b - a) for a, b in zip(s, e)]


class DeltaState:
    """One executor's delta bookkeeping: the shadow of every output its writes read, and whether
    the next update must be full (the module docstring). ``places``: the executor's
    :attr:`weight_transfer.memory.RegisteredMemory.places` (per task, per assignment, per
    output: None or an object with ``nbytes``). Raises ValueError when the shadow would exceed
    ``max_bytes``."""

    def __init__(self, places, *, device, granularity: int = 128, merge_gap: int = 4096,
                 max_bytes: int | None = None, rank: int = 0):
        if granularity < 1 or merge_gap < 0:
            raise ValueError(f"delta: granularity={granularity} (bytes >= 1), merge_gap={merge_gap} (bytes >= 0)")
        self.granularity, self.merge_gap = granularity, merge_gap
        self._at: dict[tuple[int, int, int], tuple[int, int]] = {}
        off = 0
        for i, per_a in enumerate(places):
            for j, outs in enumerate(per_a):
                for k, p in enumerate(outs):
                    if p is not None and p.nbytes:
                        self._at[(i, j, k)] = (off, p.nbytes)
                        off += p.nbytes
        self.shadow_bytes = off
        """Bytes of the shadow (one per byte of every distinct output this rank writes)."""
        if max_bytes is not None and off > max_bytes:
            raise ValueError(
                f"rank {rank}: delta updates need a shadow of {off} bytes ({off / 2**20:.1f} MiB: a copy of every "
                f"output this rank writes) but delta_max_bytes is {max_bytes} ({max_bytes / 2**20:.1f} MiB); raise "
                "--delta-max-mb, train on more ranks (smaller shares), or run without --delta")
        self.shadow = torch.empty(off, dtype=torch.uint8, device=device)
        self.full_reason: str | None = "first update"
        """Why the next update is full (None: it is a delta)."""
        self.last_version: int | None = None
        """The version of the last update this executor completed (its writes all landed)."""
        self._sig = None
        self.full = True
        """Whether the update in progress is full."""

    def invalidate(self, reason: str) -> None:
        """Make the next update full (``reason`` says why; the first reason wins)."""
        if self.full_reason is None:
            self.full_reason = reason

    def begin(self, remote: dict) -> bool:
        """Before an update: decide full or delta (returns True for full). ``remote``: the
        executor's inference rank -> descriptor (a changed descriptor forces full)."""
        sig = {r: (d.pid, d.addr, d.length, d.key, d.epoch) for r, d in remote.items()}
        if self._sig is not None and sig != self._sig:
            changed = sorted(r for r in set(sig) | set(self._sig) if sig.get(r) != self._sig.get(r))
            self.invalidate(f"receiver region(s) of inference rank(s) {changed} re-registered or new")
        self._sig = sig
        self.full = self.full_reason is not None
        self.reason = self.full_reason
        self.full_reason = "an update in progress did not finish"  # cleared by end(ok=True)
        return self.full

    def end(self, version: int | None, ok: bool) -> None:
        """After an update: ``ok`` False (it raised) makes the next one full."""
        if ok:
            self.full_reason = None
            self.last_version = version
        else:
            self.full_reason = f"the update to version {version} failed"

    def runs(self, key: tuple[int, int, int], data: torch.Tensor) -> list[tuple[int, int]] | None:
        """The runs of output ``key`` (task index, assignment, output) to write now, its bytes
        ``data`` (flat uint8, ``nbytes`` of the plan): None for the whole output (a full
        update), else the changed runs (possibly none). The shadow takes ``data``'s changed
        bytes (all of them in a full update)."""
        at = self._at.get(key)
        if at is None:
            return None
        off, n = at
        old = self.shadow[off:off + n]
        if self.full:
            old.copy_(data)
            return None
        g = self.granularity
        runs = changed_runs(data, old, g, self.merge_gap)
        if runs:
            changed = sum(r[1] for r in runs)
            if changed * 4 > n or len(runs) > 64:
                old.copy_(data)
            else:
                for s, m in runs:
                    old[s:s + m].copy_(data[s:s + m])
        return runs


def check_published(executor, store) -> None:
    """Before an update (:class:`weight_transfer.api.Sender`): when ``executor`` runs delta
    updates and the version it last wrote was not published complete (``complete/{v}`` unset:
    another rank or a commit failed, C26), make its next update full. A no-op otherwise."""
    d = getattr(executor, "delta", None)
    if d is None or d.last_version is None or d.full_reason is not None:
        return
    if not store.check([COMPLETE_KEY.format(version=d.last_version)]):
        d.invalidate(f"version {d.last_version} was not published complete")
