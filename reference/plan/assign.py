"""Step 3 of :mod:`weight_transfer.plan`: every (recipe, receiving rank) write to one sender, and the
plan's records built from the choices (:func:`assign`).

The sender policy is :func:`least_loaded` (the busiest NIC sets the time). At Kimi-K2 scale
the plan has about two million writes; choosing their senders one by one in Python, with the
grouping into tasks and assignments around it, was two thirds of ``plan()``. So the choice
runs in one call of a C kernel (``_greedy.c``: the policy, nothing else; compiled on first use
with the system C compiler and cached like :mod:`weight_transfer.convert.quant`'s ``_fp8_cpu.c``, falling
back to :func:`_greedy_py`, the same loop in Python, when there is no compiler or
``WT_PLAN_NATIVE=0``), and the records are built from its output with numpy and C-level
``map`` calls, once per distinct object.
"""
from __future__ import annotations

import ctypes
from itertools import chain, repeat
from operator import attrgetter, itemgetter
from pathlib import Path

import numpy as np

from ..native.build import NativeKernel
from ..types import DestTensorMeta, Recipe, Task, box_flat_range, itemsize
from .fast import _piece, _recipe, assignments_of, new_write, tasks_of

__all__ = ["assign", "least_loaded", "native_status"]

_RANKS = attrgetter("ranks")


def least_loaded(cands, send, pl) -> int:
    """THE sender policy: among ``cands``, the rank that sends the fewest bytes so far
    (``send[r]``), ties to the one that sends least to this receiver (``pl[r]``), then the lowest
    rank. The busiest NIC sets the time, so every write goes to the least-busy candidate.
    ``_greedy.c`` and :func:`_greedy_py` apply it; ``tests/plan/test_plan.py`` checks the kernel
    against this definition."""
    return min(cands, key=lambda r: (send[r], pl[r], r))


# --------------------------------------------------------------------------------------------
# the kernel

def _declare_greedy(lib: ctypes.CDLL) -> None:
    lib.plan_greedy.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 8 + [ctypes.c_int64] + [ctypes.c_void_p] * 5
    lib.plan_greedy.restype = ctypes.c_int64


_KERNEL = NativeKernel(Path(__file__).with_name("_greedy.c"), stem="plan_greedy", env="WT_PLAN_NATIVE",
                       flag_sets=(("-O2", "-fPIC", "-shared", "-std=c11"),), declare=_declare_greedy)
"""``_greedy.c``, built and cached by :class:`weight_transfer.native.build.NativeKernel`."""


def _native():
    """The loaded ``plan_greedy`` function, or None (reason in :func:`native_status`)."""
    lib = _KERNEL.lib()
    return None if lib is None else lib.plan_greedy


def native_status() -> str:
    """``"ok"`` when the sender choice runs in the C kernel, else why not."""
    return _KERNEL.status()


def _greedy_py(task_start, item_rec, item_dst, rec_nb, rec_cands, dst_slot, send, pair, recv):
    """``_greedy.c`` in Python (same arguments as numpy arrays, ``rec_cands`` a list of rank
    tuples, ``pair`` a 2-D array [receiver slot, training rank]): the item order (per task,
    by sender, recipe and position) and each item's sender."""
    order = np.empty(len(item_rec), np.int64)
    sender = np.empty(len(item_rec), np.int32)
    ir, idst, nb_ = item_rec.tolist(), item_dst.tolist(), rec_nb.tolist()
    ts = task_start.tolist()
    for t in range(len(ts) - 1):
        s, e = ts[t], ts[t + 1]
        items = sorted(range(s, e), key=lambda i: (-nb_[ir[i]], ir[i], idst[i]))
        got = []
        for pos, i in enumerate(items):
            slot = dst_slot[idst[i]]
            pl = pair[slot]
            r = least_loaded(rec_cands[ir[i]], send, pl)
            b = nb_[ir[i]]
            send[r] += b
            pl[r] += b
            recv[slot] += b
            sender[i] = r
            got.append((r, ir[i], pos, i))
        got.sort()
        order[s:e] = [i for _, _, _, i in got]
    return order, sender


def _choose(task_start, item_rec, item_dst, rec_nb, rec_cands, dst_slot, n_slots, n_dst):
    """Run the sender choice: (order, sender, send, recv) -- ``send`` per training rank and
    ``recv`` per receiver slot, int64 bytes."""
    send = np.zeros(n_slots, np.int64)
    pair = np.zeros((n_dst, n_slots), np.int64)
    recv = np.zeros(n_dst, np.int64)
    fn = _native()
    if fn is None or len(item_rec) >= 2**31:
        order, sender = _greedy_py(task_start, item_rec, item_dst, rec_nb, rec_cands, dst_slot, send, pair, recv)
        return order, sender, send, recv
    ids: dict[tuple, int] = {}
    flat: list[tuple] = []
    offs = []
    end = 0
    for c in rec_cands:  # candidate tuples are shared by many recipes: stored once
        o = ids.get(c)
        if o is None:
            o = ids[c] = end
            end += len(c)
            flat.append(c)
        offs.append(o)
    cands = np.fromiter(chain.from_iterable(flat), np.int32)
    rec_cand = np.array(offs, np.int64)
    rec_ncand = np.fromiter(map(len, rec_cands), np.int32, len(rec_cands))
    order = np.empty(len(item_rec), np.int64)
    sender = np.empty(len(item_rec), np.int32)
    args = [task_start, item_rec, item_dst, rec_nb, rec_cand, rec_ncand, cands, dst_slot]
    if fn(len(task_start) - 1, *(a.ctypes.data for a in args), n_slots, send.ctypes.data, pair.ctypes.data,
          recv.ctypes.data, order.ctypes.data, sender.ctypes.data):
        raise MemoryError("plan(): the sender choice ran out of memory")
    return order, sender, send, recv


# --------------------------------------------------------------------------------------------
# the records


def _rebase(rec: Recipe, offsets: dict[str, int]) -> Recipe:
    """``rec`` with every piece's source rows shifted into the sender's local shard."""
    pieces = []
    for p in rec.pieces:
        if p.source is None:
            pieces.append(p)
            continue
        o = offsets[p.source]
        (a, b), *rest = p.src_box
        pieces.append(_piece(p.source, ((a - o, b - o), *rest), p.dst_box))
    return _recipe(rec.name, rec.ranks, rec.shape, rec.assembled_dtype, tuple(pieces), rec.transform, rec.outputs)


def _spans(rec: Recipe, dst_tensors: dict[str, DestTensorMeta]) -> tuple[tuple[int, int, int], ...]:
    """(output index, byte offset in the destination rank's region, byte length) of each of
    ``rec``'s outputs on a rank whose tensors are ``dst_tensors``."""
    out = []
    for oi, o in enumerate(rec.outputs):
        d = dst_tensors[o.tensor]
        isz = itemsize(o.dtype)
        fa, fb = box_flat_range(o.box, d.shape)
        out.append((oi, d.offset + fa * isz, (fb - fa) * isz))
    return tuple(out)


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x) + 1, np.int64)
    np.cumsum(x, out=out[1:])
    return out


def _slices(seq: tuple, starts: np.ndarray, ends: np.ndarray) -> list[tuple]:
    """``[seq[a:b] for a, b in zip(starts, ends)]`` (tuples), in C."""
    return list(map(seq.__getitem__, map(slice, starts.tolist(), ends.tolist())))


def assign(task_defs: list, group_of: list[int], src_bytes: list[int], n_slots: int, train_ranks, dest_ranks,
           by_rank: dict[int, dict[str, DestTensorMeta]], layout_of: dict[int, int], offset_of,
           ) -> tuple[dict[int, tuple[Task, ...]], dict[int, int], dict[int, int]]:
    """Choose every write's sender and build the tasks: ``(per_rank, send, recv)``.

    ``task_defs``: :class:`~weight_transfer.plan.schedule._TaskDef` in execution order; ``group_of``
    and ``src_bytes``: per task definition, its mesh group and the bytes its gathered sources
    hold (0 for a local task). Each (recipe, receiving rank) write of a task, largest first
    (then recipe, then receiver), goes to :func:`least_loaded` of the task's mesh (a gathered
    task) or of the ranks holding the recipe's rows (a local task, whose recipes are then
    rebased into the sender's shard: ``offset_of(source, rank)`` is its first row). Each
    sending rank gets one :class:`Task` per task definition with its recipes in order, each
    recipe's writes in the order chosen; the ranks of a gathered task's mesh with nothing to
    send share one (the all-gather is collective). ``n_slots``: 1 + the highest training rank;
    ``by_rank`` / ``layout_of``: per receiving rank, its tensors and layout id. Returns, per
    training rank of ``train_ranks``, its tasks in order, and bytes sent per training rank and
    received per receiving rank (``dest_ranks`` first)."""
    n_tasks = len(task_defs)
    recs: list[Recipe] = []
    nbs: list[int] = []
    rec_cands: list[tuple[int, ...]] = []
    n_recs = []
    for _, mesh, rs, cands, out_bytes in task_defs:
        recs += rs
        nbs += out_bytes
        rec_cands += repeat(mesh, len(rs)) if cands is None else cands
        n_recs.append(len(rs))
    ranks = list(map(_RANKS, recs))
    per_rec = np.fromiter(map(len, ranks), np.int64, len(recs))
    n_items = int(per_rec.sum())
    item_dst = np.fromiter(chain.from_iterable(ranks), np.int32, n_items)
    item_rec = np.repeat(np.arange(len(recs), dtype=np.int32), per_rec)
    task_start = _exclusive_cumsum(per_rec)[_exclusive_cumsum(np.array(n_recs, np.int64))]
    rec_nb = np.array(nbs, np.int64)
    # receivers: one slot each, dest_ranks first
    slots = list(dest_ranks)
    seen = set(slots)
    slots += sorted(set(np.unique(item_dst).tolist()) - seen)
    dst_slot = np.full(max(slots, default=0) + 1, -1, np.int32)
    dst_slot[slots] = np.arange(len(slots), dtype=np.int32)
    order, sender, send, recv = _choose(task_start, item_rec, item_dst, rec_nb, rec_cands, dst_slot, n_slots,
                                        len(slots))
    fr, fd, fs = item_rec[order], item_dst[order], sender[order]
    # each item's writes: (output, offset, length) per (recipe, receiver layout), computed once
    lay = np.full(len(dst_slot), -1, np.int64)
    rep: dict[int, int] = {}
    for d in dest_ranks:
        lid = lay[d] = layout_of[d]
        rep.setdefault(lid, d)
    if n_items and (lay[fd] < 0).any():
        missing = sorted(set(fd[lay[fd] < 0].tolist()))
        raise KeyError(f"plan(): recipes write to inference ranks {missing[:10]} that publish no tensors")
    n_lay = max(rep, default=0) + 1
    uk, inv = np.unique(fr.astype(np.int64) * n_lay + lay[fd], return_inverse=True)
    inv = inv.reshape(-1)
    sp_list = [_spans(recs[g], by_rank[rep[lid]]) for g, lid in zip((uk // n_lay).tolist(), (uk % n_lay).tolist())]
    sp_n = np.fromiter(map(len, sp_list), np.int64, len(sp_list))
    sp_first = _exclusive_cumsum(sp_n)
    sp = np.array(list(chain.from_iterable(sp_list)), np.int64).reshape(-1, 3)
    n_w = sp_n[inv]
    w_first = _exclusive_cumsum(n_w)
    n_writes = int(w_first[-1])
    item_of_w = np.repeat(np.arange(n_items), n_w)
    cols = sp[sp_first[inv][item_of_w] + (np.arange(n_writes) - w_first[item_of_w])]
    writes = tuple(map(new_write, zip(cols[:, 0].tolist(), fd[item_of_w].tolist(), cols[:, 1].tolist(),
                                     cols[:, 2].tolist())))
    # assignments: runs of one (sender, recipe) in the final order
    brk = np.ones(n_items, bool)
    brk[1:] = (fr[1:] != fr[:-1]) | (fs[1:] != fs[:-1])
    a_first = np.flatnonzero(brk)
    a_w = w_first[a_first]
    a_rec, a_s = fr[a_first], fs[a_first]
    arecs = list(map(recs.__getitem__, a_rec.tolist()))
    local_rec = np.zeros(len(recs), bool)
    rec_task = np.repeat(np.arange(n_tasks, dtype=np.int32), n_recs)
    is_local = [td.candidates is not None for td in task_defs]
    local_rec[np.repeat(np.array(is_local, bool), n_recs)] = True
    srcs_of: dict[int, tuple[str, ...]] = {}
    rebased: dict[tuple, Recipe] = {}
    offs_of: dict[tuple, tuple[int, ...]] = {}  # (sources, sender) -> its shards' first rows
    a_rec_l, a_s_l = a_rec.tolist(), a_s.tolist()
    for k in np.flatnonzero(local_rec[a_rec]).tolist():
        g, r = a_rec_l[k], a_s_l[k]
        srcs = srcs_of.get(g)
        if srcs is None:
            srcs = srcs_of[g] = tuple([p.source for p in recs[g].pieces if p.source is not None])
        offs = offs_of.get((srcs, r))
        if offs is None:
            offs = offs_of[(srcs, r)] = tuple([offset_of(x, r) for x in srcs])
        rec = rebased.get((g, offs))
        if rec is None:
            rec = rebased[(g, offs)] = _rebase(recs[g], dict(zip(srcs, offs)))
        arecs[k] = rec
    assignments = tuple(assignments_of(arecs, _slices(writes, a_w, np.append(a_w[1:], n_writes))))
    # tasks: runs of one (task, sender) among the assignments
    a_t = rec_task[a_rec]
    n_a = len(a_first)
    brk = np.ones(n_a, bool)
    brk[1:] = (a_t[1:] != a_t[:-1]) | (a_s[1:] != a_s[:-1])
    t_first = np.flatnonzero(brk)
    t_t, t_s = a_t[t_first].tolist(), a_s[t_first].tolist()
    out_bytes = np.add.reduceat(rec_nb[a_rec], t_first).tolist() if n_a else []
    assigns = _slices(assignments, t_first, np.append(t_first[1:], n_a))
    mesh_t = [tuple(td.mesh) for td in task_defs]
    srcs_t = [() if loc else tuple(td.sources) for td, loc in zip(task_defs, is_local)]
    used: list = list(repeat((), len(t_t)))
    t_end = np.append(t_first[1:], n_a).tolist()
    t_first_l = t_first.tolist()
    uniq: dict[int, tuple[str, ...]] = {}  # band -> its distinct sources
    for k in np.flatnonzero(np.array(is_local, bool)[t_t] if t_t else np.zeros(0, bool)).tolist():
        a0, a1 = t_first_l[k], t_end[k]
        if a1 - a0 == 1:  # one band: its sources
            g = a_rec_l[a0]
            u = uniq.get(g)
            if u is None:
                u = uniq[g] = tuple(dict.fromkeys(srcs_of[g]))
            used[k] = u
        else:
            used[k] = tuple(dict.fromkeys(chain.from_iterable(map(srcs_of.__getitem__, a_rec_l[a0:a1]))))
    sb = [src_bytes[t] for t in t_t]
    tasks = tasks_of(t_t, map(group_of.__getitem__, t_t), map(srcs_t.__getitem__, t_t), map(mesh_t.__getitem__, t_t),
                     assigns, sb, map(int.__add__, sb, out_bytes), used)
    # a gathered task's ranks with nothing to send share one Task (the all-gather is collective)
    busy = np.zeros((n_tasks, n_slots), bool)
    busy[t_t, t_s] = True
    gathered = [t for t in range(n_tasks) if not is_local[t]]
    m_len = np.fromiter((len(mesh_t[t]) for t in gathered), np.int64, len(gathered))
    m_rank = np.fromiter(chain.from_iterable(map(mesh_t.__getitem__, gathered)), np.int64, int(m_len.sum()))
    m_task = np.repeat(np.array(gathered, np.int64), m_len)
    idle = ~busy[m_task, m_rank]
    i_rank, i_task = m_rank[idle], m_task[idle]
    i_t = np.unique(i_task).tolist()
    i_sb = [src_bytes[t] for t in i_t]
    tasks += tasks_of(i_t, [group_of[t] for t in i_t], [srcs_t[t] for t in i_t], [mesh_t[t] for t in i_t],
                      list(repeat((), len(i_t))), i_sb, i_sb, list(repeat((), len(i_t))))
    i_obj = len(t_t) + np.searchsorted(np.array(i_t, np.int64), i_task)
    # per training rank, its tasks in task order
    e_rank = np.concatenate([np.array(t_s, np.int64), i_rank])
    e_task = np.concatenate([np.array(t_t, np.int64), i_task])
    e_obj = np.concatenate([np.arange(len(t_t)), i_obj])
    srt = np.argsort(e_rank * max(n_tasks, 1) + e_task, kind="stable")
    objs = itemgetter(*e_obj[srt].tolist())(tasks) if len(srt) > 1 else tuple(tasks[i] for i in e_obj[srt].tolist())
    rank_sorted = e_rank[srt]
    per_rank: dict[int, tuple[Task, ...]] = {}
    for r in train_ranks:
        lo, hi = np.searchsorted(rank_sorted, (r, r + 1)).tolist()
        per_rank[r] = objs[lo:hi]
    send_d = dict(zip(train_ranks, send[list(train_ranks)].tolist())) if len(train_ranks) else {}
    recv_d = dict(zip(slots, recv.tolist()))
    return per_rank, send_d, recv_d
