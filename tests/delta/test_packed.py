"""Packed delta updates, the per-output cost model and the fused cast + compare (issue 40 items 3
and 5): the payload format and its checks, the landing region's fallback, loopback updates
through the real planner, executor and transports (cma, shm; bf16 and FP8) verified bit-exact
against a fresh oracle every update, and C26 after a failed scatter or a re-registered landing."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.loopback import Loopback
from weight_transfer.delta.cost import CostModel
from weight_transfer.delta.packed import (
    DIR_BYTES,
    HEADER,
    MAGIC_REC_V1,
    MIN_LANDING,
    Landing,
    PackedError,
    Packer,
    check_index,
    encode_index,
    index_size,
    record_size,
)
from weight_transfer.delta.runs import Runs, changed_runs, check_published, native_status
from weight_transfer.options import ExecutorOptions
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.testing.weights import SyntheticCheckpoint
from weight_transfer.transport import make_transport
from weight_transfer.types import InferenceLayout

TINY = dict(num_hidden_layers=1, vocab_size=500, hidden_size=256, intermediate_size=256,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32)


def _u8(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _ckpt(cfg, step, change, dtype=None):
    out = {n: t for n, t in SyntheticCheckpoint(param_specs(cfg), step=step, seed=0, change=change)}
    if dtype is not None:  # an fp32 master: bf16 values plus a sub-ulp nudge that rounding removes
        out = {n: t.to(dtype) * (1 + 2 ** -12) for n, t in out.items()}
    return out


@pytest.fixture(params=[True, False], ids=["native", "torch"])
def native(request, monkeypatch):
    from weight_transfer.delta import runs as delta

    if request.param and native_status() != "ok":
        pytest.skip(f"native delta kernel unavailable: {native_status()}")
    if not request.param:
        monkeypatch.setattr(delta.KERNEL, "lib", lambda: None)
    return request.param


def _pair(transport="cma", length=1 << 20, target=1 << 16):
    rx, tx = make_transport(transport), make_transport(transport)
    landing = Landing(length, rx)
    arena = rx.allocate(target) if rx.publishes_allocated_only else torch.empty(target, dtype=torch.uint8)
    arena.fill_(0xA5)
    tx.connect([landing.descriptor])
    return rx, tx, landing, arena


# ---- the payload --------------------------------------------------------------------------------


def test_pack_then_apply_lands_exactly_the_runs(native):
    """Records packed by a Packer, written one-sidedly (cma), scattered by the receiver's apply:
    exactly the runs' bytes change, other bytes keep their value; a version with no directory
    entry scatters nothing."""
    rx, tx, landing, arena = _pair(target=1 << 17)
    pk = Packer({0: landing.descriptor}, tx, rank=0, senders=2)
    src = _u8(1 << 16, 1)
    starts = torch.tensor([0, 100, 5000, 9000, 65000], dtype=torch.int64)
    lens = torch.tensor([8, 50, 1, 1000, 536], dtype=torch.int64)
    runs = Runs(starts, lens)
    pk.begin(7)
    op = pk.pack(0, src, runs, target_offset=0, span=1 << 16)
    # varint index, 1-byte units: gaps 0, 92, 4850, 3999, 55000 and lengths 8, 50, 1, 1000, 536
    ix = 1 + 1 + 1 + 1 + 2 + 1 + 2 + 2 + 3 + 2
    assert index_size(runs, 1 << 16, 1) == (1, ix)
    assert op is not None and op.length == record_size(ix, int(lens.sum())) == -(-(HEADER + ix + 1595) // 64) * 64
    op2 = pk.pack(0, src[:4096], Runs(torch.tensor([8]), torch.tensor([16])), target_offset=(1 << 16) + 8192, span=4096)
    tx.write([op, op2]).wait()
    tx.write(pk.finish()).wait()
    before = arena.clone()
    assert landing.apply(6, arena.data_ptr(), [(0, arena.numel())])["delta_records"] == 0  # another version
    assert torch.equal(arena, before)
    st = landing.apply(7, arena.data_ptr(), [(0, arena.numel())])
    assert st["delta_records"] == 2 and st["delta_runs"] == 6 and st["delta_bytes"] == 1595 + 16
    want = before.clone()
    for s, n in zip(starts.tolist(), lens.tolist()):
        want[s:s + n] = src[s:s + n]
    want[(1 << 16) + 8192 + 8:(1 << 16) + 8192 + 24] = src[8:24]
    assert torch.equal(arena, want)
    pk.close()
    landing.close()
    tx.close()
    rx.close()


def _packed_landing(version=3):
    """A landing buffer holding one valid record of ``version`` (plus its directory entry), built
    locally (no transport): (landing buffer, the record's offset, the source bytes)."""
    rx = make_transport("cma")
    landing = Landing(MIN_LANDING, rx)
    pk = Packer({0: landing.descriptor}, None, rank=0, senders=1)
    src = _u8(4096, 2)
    pk.begin(version)
    op = pk.pack(0, src, Runs(torch.tensor([0, 64, 1000]), torch.tensor([8, 16, 24])), target_offset=128, span=4096)
    landing.buffer[op.remote_offset:op.remote_offset + op.length] = pk.buffer[op.local_offset:op.local_offset + op.length]
    (d,) = pk.finish()
    landing.buffer[d.remote_offset:d.remote_offset + HEADER] = pk.buffer[d.local_offset:d.local_offset + HEADER]
    return landing, op.remote_offset, rx


@pytest.mark.parametrize("damage", ["magic", "format1", "version", "span", "run", "unit", "data", "outside", "dircheck",
                                    "used", "truncated", "overlong", "trailing", "empty"])
def test_malformed_payload_is_refused_before_any_byte_is_scattered(damage, native):
    landing, at, rx = _packed_landing()
    buf = landing.buffer
    hdr = buf[at:at + HEADER].view(torch.int64)
    arena = torch.full((8192,), 0x5A, dtype=torch.uint8)
    # a second, valid record is first in line: it must not be scattered either
    if damage == "magic":
        hdr[0] ^= 1
    elif damage == "version":
        hdr[6] += 1
    elif damage == "span":
        hdr[2] = 16  # runs now leave the span
    elif damage == "format1":
        hdr[0] = MAGIC_REC_V1
    elif damage == "run":  # index [0, 8, 56, 16, 920 (2 bytes), 24]: the last length 24 -> 127 units, past 4096
        hdr[7] = 32
    elif damage == "unit":
        hdr[7] = 0
    elif damage == "data":
        hdr[4] += 8
    elif damage == "truncated":  # the last length's varint cut off
        hdr[5] -= 1
    elif damage == "overlong":  # gap 0 written as 0x80 0x00
        buf[at + HEADER:at + HEADER + 2] = torch.tensor([0x80, 0x00], dtype=torch.uint8)
    elif damage == "trailing":  # one index byte more than the runs use
        hdr[5] += 1
    elif damage == "empty":  # the first run's length 8 -> 0
        buf[at + HEADER + 1] = 0
    elif damage == "outside":
        hdr[1] = 8192 - 100  # the span leaves the target region
    elif damage == "dircheck":
        buf[:DIR_BYTES].view(torch.int64)[3] += 64
    elif damage == "used":
        e = buf[:DIR_BYTES].view(torch.int64)
        e[3] = 10 ** 9
    why = {"format1": "format 1", "run": "leaves its span", "truncated": "past the end of the index",
           "overlong": "not minimal", "trailing": "left after the last run", "empty": "empty",
           "data": "header says|malformed"}.get(damage, "nothing scattered")
    with pytest.raises(PackedError, match=why) as e:
        landing.apply(3, arena.data_ptr(), [(0, arena.numel())])
    assert "nothing scattered" in str(e.value)
    assert bool((arena == 0x5A).all())
    landing.close()
    rx.close()


# ---- the varint index: C against the torch code against a plain Python reference ---------------


def _ref_encode(runs, q):
    """The format-2 index of ``[(start, length)]`` in units of ``q``: plain Python LEB128."""
    out, end = bytearray(), 0
    for st, ln in runs:
        for v in ((st - end) // q, -(-ln // q)):
            while v >= 0x80:
                out.append(v & 0x7F | 0x80)
                v >>= 7
            out.append(v)
        end = st + ln
    return bytes(out)


def _ref_check(index: bytes, m, span, q):
    """``(bad, why, runs)`` as ``wt_check_packed`` defines them, one run at a time."""
    p, end, runs = 0, 0, []

    def get():
        nonlocal p
        x = 0
        for k in range(9):
            if p + k >= len(index):
                return None, 1
            b = index[p + k]
            x |= (b & 0x7F) << (7 * k)
            if b < 0x80:
                if k and b == 0:
                    return None, 2
                p += k + 1
                return x, 0
        return None, 2

    for k in range(m):
        g, w = get()
        if not w:
            ln, w = get()
        if w:
            return k, w, None
        if ln == 0:
            return k, 3, None
        st = end + g * q
        if st >= span or st + (ln - 1) * q >= span:
            return k, 4, None
        end = min(st + ln * q, span)
        runs.append((st, end - st))
    return (m, 5, None) if p != len(index) else (-1, 0, runs)


def _c_check(index: bytes, m, span, q):
    import ctypes

    from weight_transfer.delta.runs import KERNEL

    buf = torch.frombuffer(bytearray(index) or bytearray(1), dtype=torch.uint8)
    tot, why = ctypes.c_int64(0), ctypes.c_int64(0)
    bad = KERNEL.lib().wt_check_packed(buf.data_ptr(), len(index), m, span, q, ctypes.byref(tot), ctypes.byref(why))
    return bad, why.value, tot.value


def _random_runs(rng, n, q, huge=False):
    """Up to 200 ascending runs of whole ``q``-byte units in a span of ``n`` bytes (the last
    clipped at n when it gets there)."""
    runs, at = [], 0
    while len(runs) < 200:
        gap = rng.randrange(1 << rng.randint(0, 42 if huge else 12))
        ln = rng.randrange(1, 1 << rng.randint(1, 8))
        st = at + gap * q
        if st >= n:
            return runs, n
        runs.append((st, min(ln * q, n - st)))
        at = st + ln * q
        if at >= n:
            return runs, n
    return runs, n


def test_index_round_trip_c_torch_and_python_agree():
    """Random runs at units 1, 2, 8 (odd lengths, the last run clipped at an odd span, gaps up
    to 2^40 units needing 6-byte varints): the C size, the C and torch encodings and the Python
    reference are the same bytes; C, torch and the reference decode the same runs; and a record
    of the small cases packed, written and scattered lands exactly those bytes."""
    from weight_transfer.delta.runs import KERNEL

    lib = KERNEL.lib() if native_status() == "ok" else None
    import random

    rng = random.Random(9)
    for trial in range(60):
        q = (1, 2, 8)[trial % 3]
        huge = trial % 4 == 3
        n = (1 << 50) + 3 if huge else rng.randrange(1, 50000) * 2 + 1
        runs, span = _random_runs(rng, n, q, huge)
        r = Runs(torch.tensor([a for a, _ in runs], dtype=torch.int64), torch.tensor([b for _, b in runs], dtype=torch.int64))
        want = _ref_encode(runs, q)
        assert _ref_check(want, len(runs), span, q) == (-1, 0, runs)
        assert bytes(encode_index(r.starts, r.lens, span, q).tolist()) == want
        assert index_size(r, span, q) == (q, len(want))
        bad, why, st, ln = check_index(torch.frombuffer(bytearray(want) or bytearray(1), dtype=torch.uint8)[:len(want)],
                                       len(runs), span, q)
        assert bad == -1 and list(zip(st.tolist(), ln.tolist())) == runs
        if lib is None:
            continue
        assert _c_check(want, len(runs), span, q) == (-1, 0, sum(b for _, b in runs))
        if huge:
            continue
        src, dst = _u8(span, trial), torch.zeros(span, dtype=torch.uint8)
        ix, data = torch.empty(len(want) + 1, dtype=torch.uint8), torch.empty(r.nbytes + 1, dtype=torch.uint8)
        assert lib.wt_pack_runs(src.data_ptr(), r.starts.data_ptr(), r.lens.data_ptr(), len(r), q, ix.data_ptr(),
                                data.data_ptr()) == len(want)
        assert bytes(ix[:len(want)].tolist()) == want
        assert lib.wt_unpack(dst.data_ptr(), ix.data_ptr(), len(want), data.data_ptr(), len(r), span, q) == r.nbytes
        mask = torch.zeros(span, dtype=torch.bool)
        for a, b in runs:
            mask[a:a + b] = True
        assert torch.equal(dst[mask], src[mask]) and not bool(dst[~mask].any())
    # runs that are not whole units are indexed in bytes; runs out of order or past the span are refused
    assert index_size(Runs(torch.tensor([3]), torch.tensor([2])), 100, 2) == (1, 2)
    with pytest.raises(ValueError, match="not ascending"):
        index_size(Runs(torch.tensor([8, 4]), torch.tensor([2, 2])), 100, 2)
    with pytest.raises(ValueError, match="not ascending"):
        index_size(Runs(torch.tensor([98]), torch.tensor([4])), 100, 1)


@pytest.mark.parametrize("index,m,span,q,want", [
    (b"\x00\x08\x05", 2, 100, 1, (1, 1)),           # the second run's length is cut off
    (b"\x80", 1, 100, 1, (0, 1)),                    # a varint that never ends
    (b"\x80\x00\x08", 1, 100, 1, (0, 2)),           # gap 0 written in two bytes
    (b"\x00" + b"\xff" * 9 + b"\x01", 1, 100, 1, (0, 2)),  # a 10-byte varint
    (b"\x00\x00", 1, 100, 1, (0, 3)),                # an empty run
    (b"\x00\x08\x5c\x01", 2, 100, 1, (1, 4)),       # a run starting at 100: past the span
    (b"\x00\x0e", 1, 100, 8, (0, 4)),                # 14 units of 8 = 112 bytes: a clip may cut < 8, not 12
    (b"\x00\x08\x00\x01", 2, 8, 1, (1, 4)),         # nothing left after a run that ends the span
    (b"\x00\x08\x00", 1, 100, 1, (1, 5)),           # a byte after the last run
    (b"\x00\x01", 0, 100, 1, (0, 5)),                # runs in an index of no runs
])
def test_malformed_index_is_refused_alike(index, m, span, q, want):
    got = _ref_check(index, m, span, q)
    assert got[:2] == want
    t = check_index(torch.frombuffer(bytearray(index), dtype=torch.uint8), m, span, q)
    assert t[:2] == want
    if native_status() == "ok":
        assert _c_check(index, m, span, q)[:2] == want
    assert _ref_check(b"\x00\x0d", 1, 100, 8) == (-1, 0, [(0, 100)])  # 13 units, clipped to 100: the last run


def test_a_span_across_4_gib():
    """Runs around the 4 GiB marks of a 6 GiB span (format 1 capped spans at 4 GiB - 1) packed,
    written and scattered into a sparse mapping; multi-byte varints."""
    import mmap

    try:
        ms = [mmap.mmap(-1, 6 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(2)]
    except (OSError, ValueError) as e:
        pytest.skip(f"no 6 GiB sparse mapping here: {e}")
    src, dst = (torch.frombuffer(m, dtype=torch.uint8) for m in ms)
    span = 6 << 30
    starts = torch.tensor([5, (1 << 32) - 3, (1 << 32) + 1000, span - 7], dtype=torch.int64)
    lens = torch.tensor([1, 6, 3, 7], dtype=torch.int64)
    for a, b in zip(starts.tolist(), lens.tolist()):
        src[a:a + b] = torch.arange(1, b + 1, dtype=torch.uint8)
    rx = make_transport("cma")
    landing = Landing(MIN_LANDING, rx)
    pk = Packer({0: landing.descriptor}, None, rank=0, senders=1)
    pk.begin(4)
    op = pk.pack(0, src, Runs(starts, lens), target_offset=0, span=span)
    assert op is not None and index_size(Runs(starts, lens), span, 1)[1] == 1 + 1 + 5 + 1 + 2 + 1 + 5 + 1
    landing.buffer[op.remote_offset:op.remote_offset + op.length] = pk.buffer[op.local_offset:op.local_offset + op.length]
    (d,) = pk.finish()
    landing.buffer[d.remote_offset:d.remote_offset + HEADER] = pk.buffer[d.local_offset:d.local_offset + HEADER]
    st = landing.apply(4, dst.data_ptr(), [(0, span)])
    assert st["delta_runs"] == 4 and st["delta_bytes"] == 17
    for a, b in zip(starts.tolist(), lens.tolist()):
        assert torch.equal(dst[a - 1:a + b + 1], torch.cat([torch.zeros(1, dtype=torch.uint8), src[a:a + b],
                                                              torch.zeros(1, dtype=torch.uint8)])[:b + 2 if a + b < span else b + 1])
    landing.close()
    rx.close()
    del src, dst
    for m in ms:
        m.close()


def test_a_valid_record_applies_and_the_span_must_sit_in_one_part(native):
    landing, at, rx = _packed_landing()
    arena = torch.zeros(8192, dtype=torch.uint8)
    with pytest.raises(PackedError, match="outside every part"):  # a region of two parts, the span across the gap
        landing.apply(3, arena.data_ptr(), [(0, 1024), (2048, 8192)])
    assert bool((arena == 0).all())
    st = landing.apply(3, arena.data_ptr(), [(0, 8192)])
    assert st["delta_records"] == 1 and st["delta_bytes"] == 48 and int((arena != 0).sum()) > 0
    landing.close()
    rx.close()


def test_a_record_that_does_not_fit_is_not_packed():
    rx, tx, landing, arena = _pair(length=MIN_LANDING)
    pk = Packer({0: landing.descriptor}, tx, rank=0, senders=1)
    pk.begin(1)
    big = Runs(torch.arange(0, 1 << 20, 16, dtype=torch.int64), torch.full(((1 << 20) // 16,), 8, dtype=torch.int64))
    assert pk.pack(0, torch.zeros(1 << 20, dtype=torch.uint8), big, 0, 1 << 20) is None  # ~1 MiB > 68 KiB area
    assert pk.pack(1, torch.zeros(64, dtype=torch.uint8), Runs(torch.tensor([0]), torch.tensor([8])), 0, 64) is None
    assert pk.finish() == []  # nothing packed: no directory entry
    pk.close()
    landing.close()
    tx.close()
    rx.close()


# ---- the cost model -----------------------------------------------------------------------------


def test_cost_model_picks_by_wire_and_run_cost():
    n = 1 << 20
    runs, changed = n // 160, n // 20  # lr 1e-6 bf16 at 8-byte blocks: ~1 run per 160 B, 5% of the bytes
    cma = CostModel.for_transport("cma")
    assert cma.choose(n, runs, changed, packable=True) == "packed"
    assert cma.choose(n, runs, changed, packable=False) == "full"  # 6.5k runs x 300 ns > 1 MiB at 4 GB/s
    assert CostModel.for_transport("shm").choose(n, runs, changed, packable=False) == "scattered"
    assert cma.choose(n, 1, 8, packable=True) == "scattered"  # one run: no record to pack and apply
    assert cma.choose(n, n // 16, n // 2, packable=True) == "full"  # half the bytes changed, a run per 16 B
    slow = CostModel.for_transport("nixl", wire_gbps=0.1)
    assert slow.choose(n, n // 16, n // 2, packable=True) == "packed"  # record 0.5 n + ~2 B x n/16 of index
    assert slow.choose(n, n // 4, 3 * n // 4, packable=True) == "full"  # record 0.75 n + 0.5 n of index > n
    assert slow.choose(n, n // 16, n // 2, packable=True, index_bytes=n) == "full"  # an exact index size wins
    assert 2800 < CostModel.index_estimate(n, 1000, 1000) < 3000  # gaps ~1 KiB: mostly 2 bytes; lengths 1 byte
    assert slow.choose(n, runs, changed, packable=True) == "packed"
    assert CostModel.for_transport("cma", mode="scattered").choose(n, runs, changed, packable=True) == "full"
    assert CostModel.for_transport("cma", mode="packed").choose(n, n, n, packable=True) == "packed"
    assert CostModel.for_transport("cma", op_cost_bytes=0).max_runs(n, packable=False) is None
    with pytest.raises(ValueError, match="delta_mode"):
        CostModel.for_transport("cma", mode="sparse")
    for kw in (dict(delta_mode="x"), dict(delta_wire_gbps=0.0), dict(delta_landing=-1.0)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            ExecutorOptions(**kw)


# ---- the fused cast + compare -------------------------------------------------------------------


def test_fused_cast_compare_equals_torch_cast_then_compare():
    if native_status() != "ok":
        pytest.skip(f"native delta kernel unavailable: {native_status()}")
    from weight_transfer.delta.fused import cast_bf16_delta

    g = torch.Generator().manual_seed(4)
    for trial in range(40):
        n = int(torch.randint(1, 20000, (1,), generator=g))
        a = torch.randn(n, generator=g) * 10 ** float(torch.randint(-30, 30, (1,), generator=g))
        b = a.clone()
        k = int(torch.randint(0, 50, (1,), generator=g))
        b[torch.randint(0, n, (k,), generator=g)] *= 1.01
        gran = (1, 2, 4, 8, 16, 64, 128)[trial % 7]
        out, shadow = torch.empty(2 * n, dtype=torch.uint8), a.to(torch.bfloat16).view(torch.uint8).clone()
        got = cast_bf16_delta(b, out, shadow, gran, merge_gap=(0, 16)[trial % 2])
        want_out = b.to(torch.bfloat16).view(torch.uint8)
        assert torch.equal(out, want_out) and torch.equal(shadow, want_out)
        assert got == changed_runs(want_out, a.to(torch.bfloat16).view(torch.uint8), gran, (0, 16)[trial % 2])
        out2, shadow2 = torch.empty(2 * n, dtype=torch.uint8), a.to(torch.bfloat16).view(torch.uint8).clone()
        assert cast_bf16_delta(b.to(torch.bfloat16), out2, shadow2, gran, merge_gap=(0, 16)[trial % 2]) == got  # a bf16 copy
        assert torch.equal(out2, want_out) and torch.equal(shadow2, want_out)
    x = torch.tensor([1.0, float("nan"), 2.0])  # a NaN: torch's cast, written whole
    out, shadow = torch.empty(6, dtype=torch.uint8), torch.zeros(6, dtype=torch.uint8)
    assert cast_bf16_delta(x, out, shadow) is None
    assert torch.equal(out, x.to(torch.bfloat16).view(torch.uint8)) and torch.equal(shadow, out)
    y = torch.randn(50000)  # more runs than allowed: None, cast and shadow complete
    out, shadow = torch.empty(100000, dtype=torch.uint8), y.to(torch.bfloat16).view(torch.uint8).clone()
    y[::100] *= 2
    assert cast_bf16_delta(y, out, shadow, max_runs=3) is None
    assert torch.equal(out, y.to(torch.bfloat16).view(torch.uint8)) and torch.equal(shadow, out)


def test_fused_bands_join_like_one_compare_and_pack_from_their_values():
    """A fused ``qkv_proj`` of three row bands: each band cast and compared in place, the runs
    joined with their offsets equal one comparison of the whole output; the packed index size
    the kernel counted equals :func:`index_size`; packing from the run values the comparison
    took writes the same record as packing from the output."""
    if native_status() != "ok":
        pytest.skip(f"native delta kernel unavailable: {native_status()}")
    from types import SimpleNamespace

    from weight_transfer.delta.fused import _fused_bands
    from weight_transfer.delta.runs import KERNEL, index_size

    lib = KERNEL.lib()
    g = torch.Generator().manual_seed(7)
    for trial, gran in enumerate((1, 2, 8, 1, 2, 8)):
        rows, cols = (8, 4, 4), 24 + 8 * trial
        a = [torch.randn(r, cols, generator=g) for r in rows]
        b = [x.clone() for x in a]
        for x in b:
            x.view(-1)[torch.randint(0, x.numel(), (7,), generator=g)] += 1e-3 * (trial + 1)
        if trial == 3:
            b[1] = a[1].clone()  # an unchanged band between two changed ones
        offs = [0]
        for r in rows:
            offs.append(offs[-1] + 2 * r * cols)
        n = offs[-1]
        old = torch.cat([x.reshape(-1) for x in a]).to(torch.bfloat16).view(torch.uint8)
        new = torch.cat([x.reshape(-1) for x in b]).to(torch.bfloat16).view(torch.uint8)
        out, shadow = torch.empty(n, dtype=torch.uint8), old.clone()
        d = SimpleNamespace(granularity=gran, merge_gap=0)
        got = _fused_bands([(o, x.reshape(-1)) for o, x in zip(offs, b)], out, shadow, d, None, True)
        assert torch.equal(out, new) and torch.equal(shadow, new)
        want = changed_runs(new, old, gran, 0)
        assert got == want and got.nbytes == sum(ln for _, ln in want)
        assert got.index == (gran, *index_size(got, n, gran))
        m = len(got)
        ix = torch.zeros(max(got.index[2], 1), dtype=torch.uint8)
        body = torch.zeros(max(got.nbytes, 1), dtype=torch.uint8)
        ix2, body2 = ix.clone(), body.clone()
        assert lib.wt_pack_runs_v(new.data_ptr(), got.starts.data_ptr(), got.lens.data_ptr(), got.vals.data_ptr(), m,
                                  gran, ix.data_ptr(), body.data_ptr()) == got.index[2]
        assert lib.wt_pack_runs(new.data_ptr(), got.starts.data_ptr(), got.lens.data_ptr(), m, gran, ix2.data_ptr(),
                                body2.data_ptr()) == got.index[2]
        assert torch.equal(ix, ix2) and torch.equal(body, body2)
    out, shadow = torch.empty(n, dtype=torch.uint8), old.clone()  # more runs than allowed: None, all bands cast
    assert _fused_bands([(o, x.reshape(-1)) for o, x in zip(offs, b)], out, shadow, d, 2, True) is None
    assert torch.equal(out, new) and torch.equal(shadow, new)


# ---- through the planner, executor and transports (loopback) ------------------------------------


@pytest.mark.parametrize("transport", ["cma", "shm"])
@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("mode", ["packed", "auto"])
@pytest.mark.parametrize("fmt", ["runs", "masks"])
def test_packed_updates_bit_exact_every_step(transport, quant, mode, fmt):
    """Steps of fractions 1, 0, 1, 0.01, 0.3, 0, 0.001 through the real planner, executor and
    transport, each committed (the receivers scatter their records) and checked bit-exact against
    a fresh oracle; packed records (format 2 runs or format 3 masks) carry the sparse steps."""
    cfg = load_config("qwen3-0.6b", **TINY)
    change = (1.0, 0.0, 1.0, 0.01, 0.3, 0.0, 0.001)
    lb = Loopback(cfg, InferenceLayout(tp=2, quant=quant), transport=transport,
                  options=ExecutorOptions(delta=True, delta_mode=mode, delta_wire_gbps=1.0, delta_format=fmt),
                  landing=0.5)
    seen = []
    for step in range(1, 8):
        src = _ckpt(cfg, step, change)
        st = lb.transfer(src)
        assert lb.verify(src) == [], (step, st.delta, st.delta_modes)
        seen.append((st.delta, st.bytes_sent, st.full_bytes, st.delta_modes,
                     sum(c["delta_records"] for c in lb.commits.values())))
    assert seen[0][0] == "full: first update" and seen[0][4] == 0
    assert seen[1][1] == 0 and seen[5][1] == 0  # nothing changed: nothing written, nothing packed
    for i in (3, 6):  # sparse steps: packed (auto on shm: a run costs 20 ns there, runs win), fewer bytes than full
        assert seen[i][0] == "delta" and seen[i][1] < seen[i][2] / 2
        if mode == "packed" or transport == "cma" or fmt == "masks":
            assert "packed" in seen[i][3] and seen[i][4] > 0
        else:
            assert "scattered" in seen[i][3]
    assert lb.executor.delta.format == fmt
    assert all(t[2] in ("full", "scattered", "packed", "unchanged") for t in lb.executor.delta.tensors)
    if fmt == "masks":  # format 3 has no scattered mode: packed, whole or unchanged
        assert all(t[2] != "scattered" for t in lb.executor.delta.tensors)
    lb.executor.close()


def test_landing_too_small_falls_back_and_stays_exact():
    cfg = load_config("qwen3-0.6b", **TINY)
    change = (1.0, 0.3)
    lb = Loopback(cfg, InferenceLayout(tp=2), options=ExecutorOptions(delta=True, delta_mode="packed", delta_granularity=8),
                  landing=0.001)  # MIN_LANDING: some records fit, the large ones do not (8-byte blocks: few runs)
    lb.transfer(_ckpt(cfg, 1, change))
    src = _ckpt(cfg, 2, change)
    st = lb.transfer(src)
    assert lb.verify(src) == []
    assert "packed" in st.delta_modes and ({"scattered", "full"} & set(st.delta_modes))
    lb.executor.close()


@pytest.mark.parametrize("fmt", ["runs", "masks"])
def test_fused_cast_compare_through_the_executor_is_bit_exact(fmt):
    """An fp32 master into a bf16 engine: the casts are fused with the comparison in prepare
    (delta_fused_s > 0), every update bit-exact, packed as runs or as masks; the same with
    fusing off."""
    if native_status() != "ok":
        pytest.skip(f"native delta kernel unavailable: {native_status()}")
    import weight_transfer.delta.fused as df

    cfg = load_config("qwen3-0.6b", **TINY)
    change = (1.0, 0.01, 0.0, 0.3)
    seen, bands = set(), df._bands

    def spy(rec, full, granularity):
        r = bands(rec, full, granularity)
        if r is not None:
            seen.add(rec.name)
        return r

    df._bands = spy
    try:
        _fused_through_the_executor(cfg, change, fmt)
    finally:
        df._bands = bands
    assert any("qkv_proj" in s for s in seen) and any("gate_up_proj" in s for s in seen), seen  # row bands fused too


def _fused_through_the_executor(cfg, change, fmt):
    for fused in (True, False):
        lb = Loopback(cfg, InferenceLayout(tp=1), options=ExecutorOptions(delta=True, delta_fused=fused,
                                                                          delta_format=fmt), landing=0.25)
        for step in range(1, 5):
            src = _ckpt(cfg, step, change, dtype=torch.float32)
            st = lb.transfer(src)
            assert lb.verify(src) == [], (fused, step)
            if step > 1:
                assert (st.delta_fused_s > 0) == fused
            if step == 3:
                assert st.bytes_sent == 0
            if step == 2:  # 1% changed: packed (0.3 at step 4 goes whole)
                assert "packed" in st.delta_modes, st.delta_modes
        assert lb.executor.delta.format == fmt
        lb.executor.close()


# ---- C26 ----------------------------------------------------------------------------------------


class _Store:
    def __init__(self, keys=()):
        self.keys = set(keys)

    def check(self, keys):
        return all(k in self.keys for k in keys)


def test_C26_a_failed_scatter_fails_the_version_and_the_next_update_is_full():
    """A receiver's scatter fails (a damaged record): the version is not published complete (the
    coordinator publishes complete only after every commit), so check_published makes the next
    update full, and that update is bit-exact though the failed one left the receiver mixed."""
    cfg = load_config("qwen3-0.6b", **TINY)
    change = (1.0, 0.01, 0.01)
    lb = Loopback(cfg, InferenceLayout(tp=2), options=ExecutorOptions(delta=True, delta_mode="packed"), landing=0.5)
    lb.transfer(_ckpt(cfg, 1, change))
    real = lb.commit
    lb.commit = lambda v: None  # the commit happens below, by hand
    st = lb.transfer(_ckpt(cfg, 2, change))
    lb.commit = real
    assert st.delta == "delta" and "packed" in st.delta_modes
    buf = lb.landings[1].buffer
    d = buf[:DIR_BYTES].view(torch.int64)
    buf[int(d[2]):int(d[2]) + HEADER].view(torch.int64)[0] ^= 1  # rank 1's first record: bad magic
    before = lb.engines[1].arena.clone()
    with pytest.raises(PackedError):
        lb.commit(st.step)
    assert torch.equal(lb.engines[1].arena, before)  # refused before any byte was scattered
    check_published(lb.executor, _Store({"complete/1"}))  # version 2 was never published complete
    src = _ckpt(cfg, 3, change)
    st = lb.transfer(src)
    assert st.delta == "full: version 2 was not published complete" and st.bytes_sent == st.full_bytes
    assert lb.verify(src) == []
    src = _ckpt(cfg, 3, change)
    assert lb.transfer(src).bytes_sent == 0 and lb.verify(src) == []
    lb.executor.close()


def test_C26_a_reregistered_landing_region_makes_the_next_update_full():
    cfg = load_config("qwen3-0.6b", **TINY)
    change = (1.0, 0.01)
    lb = Loopback(cfg, InferenceLayout(tp=2), options=ExecutorOptions(delta=True), landing=0.5)
    lb.transfer(_ckpt(cfg, 1, change))
    old = lb.landings[0]
    lb.landings[0] = Landing(old.buffer.numel(), lb.rx)  # the receiver registered its landing region again
    old.close()
    lb.tx.connect([lb.landings[0].descriptor])
    lb.executor.landing[0] = lb.landings[0].descriptor  # the control plane's new plan hands it over
    lb.executor.delta.packer.landing[0] = lb.landings[0].descriptor
    src = _ckpt(cfg, 2, change)
    st = lb.transfer(src)
    assert st.delta.startswith("full: receiver region(s)") and "landing" in st.delta
    assert lb.verify(src) == []
    lb.executor.close()


def test_C26_a_newcomer_executor_starts_full():
    cfg = load_config("qwen3-0.6b", **TINY)
    lb = Loopback(cfg, InferenceLayout(tp=2), options=ExecutorOptions(delta=True), landing=0.5)
    src = _ckpt(cfg, 1, (1.0,))
    assert lb.transfer(src).delta == "full: first update" and lb.verify(src) == []
    lb.executor.close()


def _many_records(n_rec=8, version=5):
    """A landing buffer with ``n_rec`` valid records of ``version`` (disjoint 4 KiB spans of an
    arena of n_rec x 4 KiB, 40 runs of 3 bytes each), built locally: (landing, record offsets,
    the arena's bytes after the scatter starting from 0x5A everywhere)."""
    rx = make_transport("cma")
    landing = Landing(MIN_LANDING, rx)
    pk = Packer({0: landing.descriptor}, None, rank=0, senders=1)
    src = _u8(4096 * n_rec, 9)
    want = torch.full((4096 * n_rec,), 0x5A, dtype=torch.uint8)
    pk.begin(version)
    ats = []
    for k in range(n_rec):
        g = torch.Generator().manual_seed(k)
        starts = torch.sort(torch.randperm(4096 // 8, generator=g)[:40]).values * 8
        op = pk.pack(0, src[4096 * k:4096 * (k + 1)], Runs(starts, torch.full_like(starts, 3)),
                     target_offset=4096 * k, span=4096)
        landing.buffer[op.remote_offset:op.remote_offset + op.length] = pk.buffer[op.local_offset:op.local_offset + op.length]
        ats.append(op.remote_offset)
        for s in (starts + 4096 * k).tolist():
            want[s:s + 3] = src[s:s + 3]
    (d,) = pk.finish()
    landing.buffer[d.remote_offset:d.remote_offset + HEADER] = pk.buffer[d.local_offset:d.local_offset + HEADER]
    return landing, ats, want, rx


@pytest.mark.parametrize("threads", [1, 2])
def test_records_checked_and_scattered_on_threads_alike(threads, native, monkeypatch):
    """The commit's check and scatter run on APPLY_THREADS threads: the bytes are the same as in
    the calling thread, and one malformed record among eight (the last: checked after the others
    on another thread) still leaves every byte unscattered."""
    import weight_transfer.delta.packed as dp

    monkeypatch.setattr(dp, "APPLY_THREADS", threads)
    landing, ats, want, rx = _many_records()
    arena = torch.full((4096 * 8,), 0x5A, dtype=torch.uint8)
    buf = landing.buffer
    last = buf[ats[-1]:ats[-1] + HEADER].view(torch.int64)
    last[2] = 16  # the last record's runs now leave its span
    with pytest.raises(PackedError, match="nothing scattered"):
        landing.apply(5, arena.data_ptr(), [(0, arena.numel())])
    assert bool((arena == 0x5A).all())
    last[2] = 4096
    st = landing.apply(5, arena.data_ptr(), [(0, arena.numel())])
    assert st["delta_records"] == 8 and st["delta_runs"] == 8 * 40
    assert torch.equal(arena, want)
    landing.close()
    rx.close()
