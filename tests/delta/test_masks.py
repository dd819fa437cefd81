"""Packed format 3 (chunk masks, issue 40): the native kernel ``wt_masks`` against a torch
reference on both of its code paths (AVX-512 VBMI2 where this host has it, and the portable one
built without ``-march=native``), its check and scatter, the record through a Packer and a
Landing (malformed ones refused before any byte is scattered), and the cost model's choice of
format."""
from __future__ import annotations

import ctypes

import pytest
import torch

from weight_transfer.delta.cost import CostModel
from weight_transfer.delta.packed import (
    HEADER,
    MIN_LANDING,
    Landing,
    PackedError,
    Packer,
    check_masks,
    masks_index_bytes,
    record_size,
)
from weight_transfer.delta.runs import KERNEL, Masks, changed_masks, native_status
from weight_transfer.native.build import NativeKernel
from weight_transfer.native.delta import _declare
from weight_transfer.transport import make_transport

pytestmark = pytest.mark.skipif(native_status() != "ok", reason=f"native delta kernel unavailable: {native_status()}")


def _portable():
    """The same source built without -march=native: the portable code path."""
    flags = tuple(f for f in ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11") if f != "-march=native")
    k = NativeKernel(KERNEL.src, stem="delta-portable", env="WT_DELTA_NATIVE", flag_sets=(flags,), declare=_declare)
    lib = k.lib()
    assert lib is not None, k.error
    assert lib.wt_masks_isa() == b"portable"
    return lib


LIBS = {"native": lambda: KERNEL.lib(), "portable": _portable}


def _reference(new: torch.Tensor, old: torch.Tensor):
    """(chunks, masks, vals, runs) of the bytes of ``new`` that differ from ``old`` (torch)."""
    n = new.numel()
    diff = new != old
    pad = torch.zeros(-(-n // 64) * 64, dtype=torch.bool)
    pad[:n] = diff
    bits = pad.view(-1, 64)
    chunks = bits.any(1).nonzero().flatten()
    w = (bits[chunks].to(torch.int64) << torch.arange(64, dtype=torch.int64)).sum(1)
    # masks as int64 bit patterns (bit 63 may be set: sum of int64 wraps exactly like the uint64)
    starts = pad & ~torch.cat([torch.zeros(1, dtype=torch.bool), pad[:-1]])
    starts[::64] = pad[::64]  # runs are counted within chunks
    return chunks.to(torch.int32), w, new[diff], int(starts.sum())


def _call(lib, src, n, kind, out, old, cap):
    masks = torch.empty(cap + 1, dtype=torch.int64)
    chunks = torch.empty(cap + 1, dtype=torch.int32)
    vals = torch.empty(64 * (cap + 2), dtype=torch.uint8)
    nv, nr = ctypes.c_int64(0), ctypes.c_int64(0)
    k = lib.wt_masks(src.data_ptr(), n, kind, None if out is None else out.data_ptr(), old.data_ptr(), masks.data_ptr(),
                     chunks.data_ptr(), cap, vals.data_ptr(), ctypes.byref(nv), ctypes.byref(nr))
    return k, chunks[:max(k, 0)], masks[:max(k, 0)], vals[:nv.value], nr.value


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("n", [2, 62, 64, 66, 4096 + 18, 100_002])
@pytest.mark.parametrize("p", [0.0, 0.003, 0.3, 1.0])
def test_masks_equal_the_torch_reference(path, n, p):
    """Both kinds (the output's bytes; a float32 source cast to bf16): the output, the shadow,
    every chunk index, mask and value and the run count equal torch's; the shadow takes exactly
    the new bytes."""
    lib = LIBS[path]()
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n // 2, generator=g) * 0.02
    old = x.to(torch.bfloat16).view(torch.uint8).clone()
    y = x + (torch.rand(n // 2, generator=g) < p) * 0.001
    new = y.to(torch.bfloat16).view(torch.uint8)
    want = _reference(new, old)
    cap = n // 64 + 1
    for kind, src in ((0, new.clone()), (1, y)):
        out, sh = torch.empty(n, dtype=torch.uint8), old.clone()
        k, chunks, masks, vals, runs = _call(lib, src, n, kind, out, sh, cap)
        assert k == want[0].numel()
        assert torch.equal(out, new) and torch.equal(sh, new)
        assert torch.equal(chunks, want[0]) and torch.equal(masks, want[1]) and torch.equal(vals, want[2])
        assert runs == want[3]
    sh = old.clone()  # kind 0 without an output: compare in place
    k, *_ = _call(lib, new, n, 0, None, sh, cap)
    assert k == want[0].numel() and torch.equal(sh, new)


@pytest.mark.parametrize("path", ["native", "portable"])
def test_over_the_cap_and_a_nan(path):
    """More changed chunks than the cap: -1, the cast and the shadow still complete. A NaN in a
    cast: -2 (the caller casts with torch)."""
    lib = LIBS[path]()
    n = 64 * 100
    y = torch.randn(n // 2)
    old = torch.zeros(n, dtype=torch.uint8)
    out = torch.empty(n, dtype=torch.uint8)
    k, *_ = _call(lib, y, n, 1, out, old, 10)
    assert k == -1 and torch.equal(out, y.to(torch.bfloat16).view(torch.uint8)) and torch.equal(old, out)
    y[1234] = float("nan")
    k, *_ = _call(lib, y, n, 1, out, torch.zeros(n, dtype=torch.uint8), 200)
    assert k == -2
    sh = torch.zeros(n, dtype=torch.uint8)
    assert changed_masks(y, sh, out=out) is None  # the wrapper: torch's cast, shadow refreshed whole
    assert torch.equal(out, y.to(torch.bfloat16).view(torch.uint8)) and torch.equal(sh, out)


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("changed", [0, 1, 6, 7, 8, 40])
def test_the_cap_is_kept_exactly_and_nothing_is_written_past_the_slots(path, changed):
    """cap + 1 index slots and 64 x (cap + 2) value bytes (the documented sizes) are all the
    kernel writes, whatever it writes for chunks that did not change (the vector path writes
    its slots unconditionally): at most cap changed chunks are returned whole, one more is -1;
    canary bytes after the slots stay untouched."""
    lib = LIBS[path]()
    n, cap = 64 * 64, 7
    g = torch.Generator().manual_seed(changed)
    x = torch.randn(n // 2, generator=g) * 0.02
    old = x.to(torch.bfloat16).view(torch.uint8).clone()
    y = x.clone()
    which = torch.randperm(n // 64, generator=g)[:changed]
    y.view(-1, 32)[which, 5] += 0.5                              # one element in each of `changed` chunks
    new = y.to(torch.bfloat16).view(torch.uint8)
    canary = 0x5A
    masks = torch.full((cap + 1 + 8,), canary * 0x0101010101010101, dtype=torch.int64)
    chunks = torch.full((cap + 1 + 16,), canary * 0x01010101, dtype=torch.int32)
    vals = torch.full((64 * (cap + 2) + 256,), canary, dtype=torch.uint8)
    nv, nr = ctypes.c_int64(0), ctypes.c_int64(0)
    sh = old.clone()
    k = lib.wt_masks(y.data_ptr(), n, 1, None, sh.data_ptr(), masks.data_ptr(), chunks.data_ptr(), cap,
                     vals.data_ptr(), ctypes.byref(nv), ctypes.byref(nr))
    assert torch.equal(sh, new)                                  # the shadow is refreshed either way
    assert (masks[cap + 1:] == canary * 0x0101010101010101).all()
    assert (chunks[cap + 1:] == canary * 0x01010101).all() and (vals[64 * (cap + 2):] == canary).all()
    if changed > cap:
        assert k == -1
    else:
        want = _reference(new, old)
        assert k == changed == want[0].numel() and nv.value == want[2].numel()
        assert torch.equal(chunks[:k], want[0]) and torch.equal(masks[:k], want[1])
        assert torch.equal(vals[:nv.value], want[2])


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("span", [64 * 40, 64 * 40 - 3, 5])
def test_unpack_writes_exactly_the_selected_bytes_inside_the_span(path, span):
    lib = LIBS[path]()
    g = torch.Generator().manual_seed(span)
    old = torch.randint(0, 256, (span,), dtype=torch.uint8, generator=g)
    new = old.clone()
    sel = torch.rand(span, generator=g) < 0.2
    sel[-1] = True  # the last (maybe partial) chunk changes
    new[sel] ^= 0xFF
    chunks, masks, vals, _ = _reference(new, old)
    arena = torch.full((span + 256,), 0x5A, dtype=torch.uint8)
    arena[64:64 + span] = old
    tot, why = ctypes.c_int64(0), ctypes.c_int64(0)
    assert lib.wt_check_masks(masks.data_ptr(), chunks.data_ptr(), chunks.numel(), span, ctypes.byref(tot),
                              ctypes.byref(why)) == -1 and tot.value == vals.numel()
    assert check_masks(masks, chunks, span) == (-1, 0, vals.numel())
    vbuf = vals.clone()  # exactly nvals bytes: the scatter must not read past them
    got = lib.wt_unpack_masks(arena.data_ptr() + 64, masks.data_ptr(), chunks.data_ptr(), chunks.numel(),
                              vbuf.data_ptr(), vbuf.numel(), span)
    assert got == vals.numel()
    assert torch.equal(arena[64:64 + span], new)
    assert (arena[:64] == 0x5A).all() and (arena[64 + span:] == 0x5A).all()


@pytest.mark.parametrize("case,want", [
    ("ok", (-1, 0)), ("descending", (1, 6)), ("repeat", (1, 6)), ("outside", (2, 7)), ("tail_bit", (2, 7)),
    ("empty", (1, 8)), ("high_index", (2, 7)),
])
def test_malformed_masks_are_refused_alike_in_c_and_torch(case, want):
    span = 64 * 2 + 10  # three chunks, the last one 10 bytes
    chunks = torch.tensor([0, 1, 2], dtype=torch.int32)
    masks = torch.tensor([1, 3, (1 << 10) - 1], dtype=torch.int64)
    if case == "descending":
        chunks[1] = 0
    elif case == "repeat":
        chunks[1] = 0
        chunks[0] = 0
    elif case == "outside":
        chunks[2] = 3
    elif case == "tail_bit":
        masks[2] = 1 << 10
    elif case == "empty":
        masks[1] = 0
    elif case == "high_index":
        chunks[2] = -1  # uint32 0xFFFFFFFF on the wire
    lib = KERNEL.lib()
    tot, why = ctypes.c_int64(0), ctypes.c_int64(0)
    bad = lib.wt_check_masks(masks.data_ptr(), chunks.data_ptr(), 3, span, ctypes.byref(tot), ctypes.byref(why))
    if case == "repeat":
        want = (1, 6)
    assert (bad, why.value if bad >= 0 else 0) == want
    assert check_masks(masks, chunks, span)[:2] == want


def _masks_of(new, old):
    sh = old.clone()
    r = changed_masks(new, sh)
    assert torch.equal(sh, new) and isinstance(r, Masks)
    return r


@pytest.fixture(params=[True, False], ids=["native", "torch"])
def native(request, monkeypatch):
    from weight_transfer.delta import runs as delta

    if not request.param:
        monkeypatch.setattr(delta.KERNEL, "lib", lambda: None)
    return request.param


def _cma_landing():
    """A cma receiver with a 1 MiB landing region, a connected sender with a packer for it, and a
    64 KiB target region of 0xA5 bytes: ``(rx, tx, landing, packer, region)``."""
    rx, tx = make_transport("cma"), make_transport("cma")
    landing = Landing(1 << 20, rx)
    tx.connect([landing.descriptor])
    return rx, tx, landing, Packer({0: landing.descriptor}, tx, rank=0, senders=1), torch.full(
        (1 << 16,), 0xA5, dtype=torch.uint8)


def test_a_masks_record_through_packer_and_landing(native):
    """Format-3 records packed, written one-sidedly (cma) and scattered by the receiver's apply
    (native or torch): exactly the changed bytes land; a record with a damaged index is refused
    with nothing scattered, not even a valid record before it."""
    rx, tx, landing, pk, arena = _cma_landing()
    g = torch.Generator().manual_seed(1)
    new = arena.clone()
    sel = torch.rand(new.numel(), generator=g) < 0.02
    new[sel] = torch.randint(0, 256, (int(sel.sum()),), dtype=torch.uint8, generator=g)
    new[sel & (new == 0xA5)] = 0
    with torch.no_grad():
        from weight_transfer.delta import runs as delta
        lib = delta.KERNEL.lib
        delta.KERNEL.lib = KERNEL.__class__.lib.__get__(KERNEL)  # the sender side always native
        try:
            a, b = _masks_of(new[:40000], arena[:40000]), _masks_of(new[40000:], arena[40000:])
        finally:
            delta.KERNEL.lib = lib
    pk.begin(5)
    ops = [pk.pack_masks(0, a, 0, 40000), pk.pack_masks(0, b, 40000, new.numel() - 40000)]
    assert ops[0].length == record_size(masks_index_bytes(len(a)), a.nbytes)
    tx.write(ops).wait()
    tx.write(pk.finish()).wait()
    before = arena.clone()
    st = landing.apply(5, arena.data_ptr(), [(0, arena.numel())])
    assert st["delta_records"] == 2 and st["delta_bytes"] == int(sel.sum())
    assert torch.equal(arena, new)
    # damage the second record's first chunk index: both refused, nothing scattered
    at = ops[1].remote_offset
    m = int(landing.buffer[at:at + HEADER].view(torch.int64)[3])
    landing.buffer[at + HEADER + 8 * m:at + HEADER + 8 * m + 4].view(torch.int32)[0] = 1 << 20
    arena.copy_(before)
    with pytest.raises(PackedError, match="chunk 0 of .*leaves its span"):
        landing.apply(5, arena.data_ptr(), [(0, arena.numel())])
    assert torch.equal(arena, before)
    landing.buffer[at:at + 8].view(torch.int64)[0] ^= 1  # a bad magic
    with pytest.raises(PackedError, match="malformed"):
        landing.apply(5, arena.data_ptr(), [(0, arena.numel())])
    assert torch.equal(arena, before)
    pk.close()
    landing.close()
    tx.close()
    rx.close()


def test_a_masks_record_that_does_not_fit_is_not_packed():
    landing = Landing(MIN_LANDING, make_transport("cma"))
    pk = Packer({0: landing.descriptor}, None, rank=0, senders=1)
    pk.begin(1)
    old = torch.zeros(1 << 20, dtype=torch.uint8)
    r = _masks_of(torch.ones(1 << 20, dtype=torch.uint8), old)
    assert pk.pack_masks(0, r, 0, 1 << 20) is None and pk.room(0) > 0


def test_cost_model_chooses_the_format_by_the_wire():
    """Masks on every transport's default wire (memory, a NIC); runs on a link slower than
    ~0.25 GB/s (the rate-limited veth); forced either way; masks packed or whole by cost."""
    for t in ("cma", "shm", "nixl", "verbs"):
        assert CostModel.for_transport(t).pack_format() == "masks", t
    assert CostModel.for_transport("nixl", wire_gbps=0.2).pack_format() == "runs"
    assert CostModel.for_transport("nixl", wire_gbps=0.2, fmt="masks").pack_format() == "masks"
    assert CostModel.for_transport("cma", fmt="runs").pack_format() == "runs"
    with pytest.raises(ValueError, match="delta_format"):
        CostModel.for_transport("cma", fmt="bitmap")
    c = CostModel.for_transport("cma")
    assert c.choose_masks(1 << 20, 100, 200, True) == "packed"
    assert c.choose_masks(1 << 20, (1 << 20) // 64, 1 << 20, True) == "full"
    assert c.choose_masks(1 << 20, 100, 200, False) == "full"
    fast = CostModel.for_transport("cuda_ipc")  # 100 GB/s: past ~700 changed chunks of 1 MiB, whole is cheaper
    k = fast.max_chunks(1 << 20)
    assert k < (1 << 20) // 64 and fast.packed_masks(k, 0) >= fast.full(1 << 20)
    assert fast.choose_masks(1 << 20, 2 * k, 2 * k, True) == "full"


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("span", [64 * 40, 64 * 40 - 3, 5, 64 * 40 + 70])
def test_copy_with_the_record_applied_equals_scatter_then_copy(path, span):
    """``wt_copy_unpack_masks``: dst gets the patched bytes, src (the staging) gets the record's
    bytes and nothing else, nothing outside the span is touched, vals not read past nvals."""
    lib = LIBS[path]()
    g = torch.Generator().manual_seed(span + 1)
    old = torch.randint(0, 256, (span,), dtype=torch.uint8, generator=g)
    new = old.clone()
    sel = torch.rand(span, generator=g) < 0.1
    sel[-1] = True
    new[sel] ^= 0x3C
    chunks, masks, vals, _ = _reference(new, old)
    src = torch.full((span + 128,), 0x11, dtype=torch.uint8)
    dst = torch.full((span + 128,), 0x22, dtype=torch.uint8)
    src[64:64 + span] = old
    vbuf = vals.clone()
    got = lib.wt_copy_unpack_masks(dst.data_ptr() + 64, src.data_ptr() + 64, masks.data_ptr(), chunks.data_ptr(),
                                   chunks.numel(), vbuf.data_ptr(), vbuf.numel(), span)
    assert got == vals.numel()
    assert torch.equal(src[64:64 + span], new) and torch.equal(dst[64:64 + span], new)
    assert (src[:64] == 0x11).all() and (src[64 + span:] == 0x11).all()
    assert (dst[:64] == 0x22).all() and (dst[64 + span:] == 0x22).all()


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("shift", [0, 1])
def test_copy_with_the_record_applied_into_pages_resident_or_not(path, shift):
    """A staging span over several of the copy's 256 KiB blocks into a destination whose pages
    are resident in some blocks and not yet touched in others (streaming stores where resident,
    regular ones where a page would fault), 64-byte aligned or not (``shift``): the same bytes as
    scatter-then-copy, nothing outside the span written."""
    import mmap

    lib = LIBS[path]()
    span = (3 << 18) + 64 * 7 + 5  # three blocks and a tail
    g = torch.Generator().manual_seed(11 + shift)
    old = torch.randint(0, 256, (span,), dtype=torch.uint8, generator=g)
    new = old.clone()
    new[torch.rand(span, generator=g) < 0.02] ^= 0x3C
    chunks, masks, vals, _ = _reference(new, old)
    src = old.clone()
    size = span + 8192
    mm = mmap.mmap(-1, size)
    try:
        dst = torch.frombuffer(mm, dtype=torch.uint8)
        dst[:4096 + shift] = 0x22  # the page before the span, and the span's first bytes
        dst[4096 + shift + (1 << 18):4096 + shift + (2 << 18)] = 0  # the second block resident, the third not
        got = lib.wt_copy_unpack_masks(dst.data_ptr() + 4096 + shift, src.data_ptr(), masks.data_ptr(),
                                       chunks.data_ptr(), chunks.numel(), vals.data_ptr(), vals.numel(), span)
        assert got == vals.numel()
        assert torch.equal(src, new) and torch.equal(dst[4096 + shift:4096 + shift + span], new)
        assert (dst[:4096 + shift] == 0x22).all() and (dst[4096 + shift + span:] == 0).all()
        del dst
    finally:
        mm.close()


def test_deferred_records_applied_in_the_commits_copy_and_flushed(native):
    """Landing.apply(defer=...) checks every record, scatters those outside the deferred range
    and keeps the rest; copy_in fuses the records inside a tensor into its copy (a record that
    only overlaps it is scattered first), falls back for a destination it cannot byte-copy into;
    flush scatters what is left. The region ends equal to a plain apply's."""
    rx, tx, landing, pk, region = _cma_landing()
    g = torch.Generator().manual_seed(3)
    new = region.clone()
    sel = torch.rand(new.numel(), generator=g) < 0.05
    new[sel] ^= 0x5A
    cuts = [0, 8192, 20000, 36864, 50000, 1 << 16]  # five records; the arena is [8192, 50000)
    from weight_transfer.delta import runs as delta
    lib = delta.KERNEL.lib
    delta.KERNEL.lib = KERNEL.__class__.lib.__get__(KERNEL)
    try:
        recs = [_masks_of(new[a:b], region[a:b]) for a, b in zip(cuts, cuts[1:])]
    finally:
        delta.KERNEL.lib = lib
    pk.begin(9)
    tx.write([pk.pack_masks(0, r, a, b - a) for r, a, b in zip(recs, cuts, cuts[1:])]).wait()
    tx.write(pk.finish()).wait()
    base = region.data_ptr()
    st = landing.apply(9, base, [(0, region.numel())], defer=((8192, 50000),))
    assert st["delta_records"] == 5 and st["delta_deferred"] == 3 and len(landing.deferred) == 3
    assert torch.equal(region[:8192], new[:8192]) and torch.equal(region[8192:50000], torch.full((41808,), 0xA5, dtype=torch.uint8))
    # a "staging tensor" [8192, 36864): two records inside it are fused into its copy
    t = region[8192:36864]
    dst = torch.zeros(t.numel(), dtype=torch.uint8)
    assert landing.copy_in(dst, t, base) is native
    assert torch.equal(dst, new[8192:36864]) or not native
    assert torch.equal(region[8192:36864], new[8192:36864])
    assert len(landing.deferred) == 1
    # a destination it cannot byte-copy into: the record is scattered, False
    t2 = region[36864:50000]
    assert landing.copy_in(torch.zeros(t2.numel() // 2, dtype=torch.int16)[::2], t2, base) is False
    assert torch.equal(region[36864:50000], new[36864:50000]) and not landing.deferred
    assert landing.flush(base) == 0
    assert torch.equal(region, new)
    region[8192:50000] = 0xA5  # again, nothing taken by a copy: flush scatters all three
    landing.apply(9, base, [(0, region.numel())], defer=((8192, 50000),))
    assert not torch.equal(region, new) and landing.flush(base) == 3 and torch.equal(region, new)
    pk.close()
    landing.close()
    tx.close()
    rx.close()


def test_overlapping_records_are_refused_before_any_byte_is_scattered():
    """Two records whose spans overlap (their scatters would race; a format-3 scatter rewrites
    whole lines): refused, nothing scattered."""
    rx, tx, landing, pk, region = _cma_landing()
    new = region.clone()
    new[::97] ^= 0xFF
    a = _masks_of(new[:8192], region[:8192])
    b = _masks_of(new[4096:12288], region[4096:12288])
    pk.begin(2)
    tx.write([pk.pack_masks(0, a, 0, 8192), pk.pack_masks(0, b, 4096, 8192)]).wait()
    tx.write(pk.finish()).wait()
    before = region.clone()
    with pytest.raises(PackedError, match="overlap at target bytes"):
        landing.apply(2, region.data_ptr(), [(0, region.numel())])
    assert torch.equal(region, before)
    for x in (pk, landing, tx, rx):
        x.close()


def test_a_deferred_record_left_after_the_commit_fails_it():
    """engines/vllm/worker/delta_apply.finish: a deferred record the commit's copies did not take is
    scattered into the staging, and the rank's commit is reported failed (the layer vLLM
    computes with lacks those bytes): RuntimeError, ``ok`` False in the store."""
    from types import SimpleNamespace

    from weight_transfer.control import protocol as control
    from weight_transfer.engines.vllm.worker import delta_apply

    rx, tx, landing, pk, region = _cma_landing()
    new = region.clone()
    new[::101] ^= 0xFF
    pk.begin(4)
    tx.write([pk.pack_masks(0, _masks_of(new, region), 0, region.numel())]).wait()
    tx.write(pk.finish()).wait()
    store = torch.distributed.HashStore()
    eng = SimpleNamespace(delta_landing=landing, receiver=SimpleNamespace(descriptor=SimpleNamespace(addr=region.data_ptr())),
                          store=store, rank=0, _who=lambda: "worker 0")
    landing.apply(4, region.data_ptr(), [(0, region.numel())], defer=((0, region.numel()),))
    assert len(landing.deferred) == 1
    with pytest.raises(RuntimeError, match="not applied by the commit's staging copies"):
        delta_apply.finish(eng, 4, {"seconds": 0.0})
    assert torch.equal(region, new)  # scattered into the staging all the same
    assert control.get(store, "step/4/committed/0")["ok"] is False
    landing.apply(4, region.data_ptr(), [(0, region.numel())])  # nothing deferred: finish passes
    assert delta_apply.finish(eng, 4, {"seconds": 0.0})["delta_patch_s"] == 0.0
    for x in (pk, landing, tx, rx):
        x.close()


def test_free_runs_keep_format_2():
    """``delta_op_cost`` 0 (scattered runs free: the fewest bytes) keeps format 2 under auto, which
    has the scattered mode format 3 lacks; forcing masks still gives masks."""
    assert CostModel.for_transport("cma", op_cost_bytes=0).pack_format() == "runs"
    assert CostModel.for_transport("cma", op_cost_bytes=0, fmt="masks").pack_format() == "masks"
    assert CostModel.for_transport("cma", op_cost_bytes=1024).pack_format() == "masks"
