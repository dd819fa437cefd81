"""Packed format 2's varint index in torch (:mod:`weight_transfer.delta.packed` has the record):
the encoder and the checker a receiver or sender without the native kernel uses (``_delta.c``'s
``wt_pack_runs`` / ``wt_check_packed`` write and check the same bytes), and the reasons a
malformed index is refused."""
from __future__ import annotations

import torch

from .runs import _units, _vlen

__all__ = ["WHY", "encode_index", "check_index"]

WHY = {1: "a varint runs past the end of the index", 2: "a varint is longer than 9 bytes or not minimal",
       3: "a run is empty", 4: "a run leaves its span", 5: "index bytes are left after the last run",
       6: "chunk indices are not ascending", 7: "a chunk leaves its span", 8: "a chunk's mask is empty"}
"""Reasons of a malformed index: codes 1-5 of ``wt_check_packed`` (format 2), 6-8 of
``wt_check_masks`` (format 3)."""


def encode_index(starts: torch.Tensor, lens: torch.Tensor, span: int, unit: int) -> torch.Tensor:
    """The index of runs ``starts``/``lens`` (int64, bytes) as flat uint8, in units of ``unit``
    (vectorized torch; the native ``wt_pack_runs`` writes the same bytes). ValueError as
    :func:`index_size`."""
    v = _units(starts, lens, span, unit)
    if v is None:
        raise ValueError(f"packed record: runs not whole {unit}-byte units inside a span of {span} bytes")
    n = _vlen(v)
    at = torch.cumsum(n, 0) - n
    out = torch.empty(int(n.sum()), dtype=torch.uint8)
    for k in range(9):
        sel = n > k
        b = (v[sel] >> (7 * k)) & 0x7F
        out[at[sel] + k] = (b | ((n[sel] > k + 1).to(torch.int64) << 7)).to(torch.uint8)
    return out


def check_index(index: torch.Tensor, m: int, span: int, unit: int):
    """Decode and check a record's index (flat uint8) of ``m`` runs against a span of ``span``
    bytes in units of ``unit``, as ``wt_check_packed`` does (vectorized torch). Returns ``(bad,
    why, starts, lens)``: ``bad`` -1 when all is fine (then the runs in bytes, the last clipped
    to the span), else the first bad run (``m``: bytes left after the last) and ``why`` its
    :data:`WHY` code."""
    b = index.to(torch.int64)
    ends = (b < 0x80).nonzero().flatten()
    t0 = torch.cat([torch.zeros(1, dtype=torch.int64), ends + 1])[:-1]
    tl = ends - t0 + 1
    pos = torch.arange(int(tl.sum())) - torch.repeat_interleave(t0, tl)
    tok = torch.repeat_interleave(torch.arange(ends.numel()), tl)
    vals = torch.zeros(ends.numel(), dtype=torch.int64)
    vals.index_add_(0, tok, (b[:pos.numel()] & 0x7F) << (7 * pos.clamp(max=8)))
    err = torch.where((tl > 9) | ((tl > 1) & (b[ends] == 0)), 2, 0)
    left = b.numel() - (int(ends[-1]) + 1 if ends.numel() else 0)
    if left:  # an unterminated token at the end
        err = torch.cat([err, torch.tensor([2 if left >= 9 else 1])])
    need = 2 * m
    err = torch.cat([err, torch.ones(max(0, need - err.numel()), dtype=torch.int64)])[:need] if m else err[:0]
    vals = torch.cat([vals, torch.zeros(max(0, need - vals.numel()), dtype=torch.int64)])[:need]
    cap = span // unit + 2  # a value clamped to it still leaves the span; no overflow before the first bad run
    g, ln = vals[0::2].clamp(max=cap), vals[1::2].clamp(max=cap)
    s = (torch.cumsum(g + ln, 0) - ln) * unit
    why = torch.where(err[0::2] > 0, err[0::2], torch.where(err[1::2] > 0, err[1::2], 0))
    why = torch.where(why > 0, why, torch.where(ln == 0, 3, torch.where((s >= span) | (s + (ln - 1) * unit >= span), 4, 0)))
    badk = (why > 0).nonzero().flatten()
    if badk.numel():
        k = int(badk[0])
        return k, int(why[k]), None, None
    if ends.numel() > need or left:
        return m, 5, None, None
    return -1, 0, s, (s + ln * unit).clamp(max=span) - s


def _byte_index(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Every byte offset the runs cover (torch fallback)."""
    rep = torch.repeat_interleave(starts - torch.cumsum(lens, 0) + lens, lens)
    return rep + torch.arange(int(lens.sum()), dtype=torch.int64)
