"""Deterministic synthetic weights: any process regenerates any slice of any parameter at any
training step, with no communication.

Element ``i`` (flat, C order) of parameter ``name`` at ``step`` with ``seed`` is::

    base = POOL[(offset(name) + i) % P]            # POOL: P random values in [-0.05, 0.05)
    w    = bits(base as dtype) XOR mask(name, step) # flips low mantissa bits only

``POOL`` is drawn once per process from ``torch.Generator().manual_seed(seed)``; ``offset``
and ``mask`` come from a hash (BLAKE2b) of the name, so tensors differ from each other, and
``mask(step)`` differs from ``mask(step+1)`` in every element's bits (C1 of shared/CASES.md:
every tensor changes at every step). Values stay finite (only mantissa bits flip).

**Steps that change a given fraction** (``change``: per-step fractions, cycled; a delta
update's input, ``weight-transfer run --change-fraction``): element ``i`` gets a phase
``u_i`` in ``[0, 2**24)`` (a second seeded pool, prime length :data:`PHASE_SIZE`) and the mask of
level ``c(i, s) = (F(s) + u_i) >> 24``, where ``F(s) = sum over t <= s of round(f_t * 2**24)``::

    w = bits(base as dtype) XOR mask(name, c(i, s))

``c`` moves by one from step ``s - 1`` to ``s`` for exactly the elements whose phase crosses a
multiple of ``2**24``: a fraction ``f_s`` of them (uniformly scattered), all of them at
``f_s = 1`` (then this is the plain rule above: ``c = s``), none at ``f_s = 0``. Any process
still computes any slice at any step with no history.

Why not ``torch.randn`` per tensor: a training rank must produce its shard (a row range, or
any box) without generating the whole tensor, and at memory speed: a slice here is a
contiguous copy out of the pool plus one XOR over 64-bit words (measured here about 1 GB/s per
core; ``torch.rand`` was 0.16 GB/s and a per-element integer hash 0.014 GB/s on this machine).

Shapes and dtypes come from :class:`weight_transfer.model_config.ParamSpec` (or any object with
``name``, ``shape``, ``dtype``); dtypes supported: bfloat16, float16, float32.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache

import torch

from ..types import Box, box_flat_range, box_shape, box_to_slices, numel, torch_dtype

POOL_SIZE = 16_777_259  # a prime, so that the pool's period never lines up with a row length
PHASE_SIZE = 4_194_301  # a prime, another period than POOL_SIZE: the phases of ``change`` steps
PHASE_ONE = 1 << 24
_CHUNK = 1 << 22  # elements per pass of the phase XOR (bounds its temporaries)
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@lru_cache(maxsize=4)
def _pool(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = (torch.rand(POOL_SIZE, generator=g, dtype=torch.float32) * 0.1 - 0.05).to(dtype)
    # doubled so that any window of up to POOL_SIZE elements is one contiguous slice
    return torch.cat([p, p])


@lru_cache(maxsize=4)
def _phase_pool(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 0x5EED)
    u = torch.randint(0, PHASE_ONE, (PHASE_SIZE,), generator=g, dtype=torch.int32)
    return torch.cat([u, u])


def change_level(step: int, change) -> int:
    """``F(step)`` of a ``change`` schedule (per-step fractions, cycled from step 1), in units
    of ``2**-24``."""
    change = tuple(change)
    return sum(round(change[(t - 1) % len(change)] * PHASE_ONE) for t in range(1, step + 1))


def _h(*parts) -> int:
    return int.from_bytes(hashlib.blake2b("\x00".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def name_offset(name: str, seed: int) -> int:
    """Start of parameter ``name`` in the pool."""
    return _h("offset", name, seed) % POOL_SIZE


def step_mask(name: str, step: int, dtype: torch.dtype) -> int:
    """Bits XOR-ed into every element of ``name`` at ``step``: nonzero, below the mantissa's
    width, and different for consecutive steps (the step term advances by 37 mod 127)."""
    m = (_h("mask", name) + 37 * step) % 127 + 1
    return m & ((1 << _MANTISSA_BITS[dtype]) - 1) or 1


def _xor_inplace(t: torch.Tensor, mask: int) -> None:
    """XOR ``mask`` into every element of contiguous float tensor ``t`` (16- or 32-bit)."""
    ibits = t.element_size() * 8
    flat = t.view(-1).view(_INT_VIEW[t.dtype])
    n = flat.numel()
    per64 = 64 // ibits
    body = (n // per64) * per64
    if body and flat.data_ptr() % 8 == 0:
        m64 = 0
        for k in range(per64):
            m64 |= mask << (k * ibits)
        if m64 >= 1 << 63:
            m64 -= 1 << 64
        flat[:body].view(torch.int64).bitwise_xor_(m64)
        flat[body:].bitwise_xor_(mask)
    else:
        flat.bitwise_xor_(mask)


def _xor_phased(out: torch.Tensor, name: str, start: int, level: int, seed: int) -> None:
    """XOR the level masks of a ``change`` step into ``out`` (elements ``start ..`` of ``name``)."""
    c0, frac = level >> 24, level & (PHASE_ONE - 1)
    m0 = step_mask(name, c0, out.dtype)
    _xor_inplace(out, m0)
    if frac == 0:
        return
    m = m0 ^ step_mask(name, c0 + 1, out.dtype)
    iv = out.view(-1).view(_INT_VIEW[out.dtype])
    pool = _phase_pool(seed)
    pos = (name_offset(name, seed + 1) + start) % PHASE_SIZE
    n, done = iv.numel(), 0
    while done < n:
        k = min(n - done, _CHUNK, PHASE_SIZE)
        u = pool[pos:pos + k]
        iv[done:done + k].bitwise_xor_((u >= PHASE_ONE - frac).to(iv.dtype) * m)
        done += k
        pos = (pos + k) % PHASE_SIZE


def flat_range(name: str, start: int, stop: int, *, step: int, seed: int, dtype: torch.dtype,
               out: torch.Tensor | None = None, change=None) -> torch.Tensor:
    """Elements ``[start, stop)`` (flat C order) of parameter ``name`` at ``step``, as a 1-D
    tensor of ``dtype``. ``out`` (contiguous, ``stop - start`` elements) avoids an allocation.
    ``change``: per-step fractions of elements that change (module docstring); None: every
    element changes every step."""
    n = stop - start
    if out is None:
        out = torch.empty(n, dtype=dtype)
    else:
        out = out.view(-1)
        if out.numel() != n or out.dtype != dtype:
            raise ValueError(f"flat_range({name!r}): out has {out.numel()} x {out.dtype}, need {n} x {dtype}")
    pool = _pool(seed, dtype)
    pos = (name_offset(name, seed) + start) % POOL_SIZE
    done = 0
    while done < n:
        k = min(n - done, POOL_SIZE)
        out[done:done + k].copy_(pool[pos:pos + k])
        done += k
        pos = (pos + k) % POOL_SIZE
    if change:
        _xor_phased(out, name, start, change_level(step, change), seed)
    else:
        _xor_inplace(out, step_mask(name, step, dtype))
    return out


def param_box(name: str, shape: tuple[int, ...], box: Box, *, step: int, seed: int, dtype: str | torch.dtype,
              out: torch.Tensor | None = None, change=None) -> torch.Tensor:
    """The sub-tensor ``box`` (``((start, stop), ...)`` per dim) of parameter ``name`` of global
    ``shape`` at ``step``. Contiguous result of shape ``box_shape(box)``. Only the elements of
    the box are generated when it is flat-contiguous (a row range: what Shard(0) holds);
    otherwise the enclosing row range is generated and sliced."""
    dt = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    shape = tuple(shape)
    bshape = box_shape(box)
    if numel(bshape) == 0:
        return torch.empty(bshape, dtype=dt) if out is None else out
    try:
        a, b = box_flat_range(box, shape)
        return flat_range(name, a, b, step=step, seed=seed, dtype=dt, out=out, change=change).view(bshape)
    except ValueError:
        pass
    # not flat-contiguous: generate the rows of dim 0 that the box touches, slice the rest
    rows = box[0]
    outer = ((rows[0], rows[1]),) + tuple((0, s) for s in shape[1:])
    a, b = box_flat_range(outer, shape)
    blk = flat_range(name, a, b, step=step, seed=seed, dtype=dt, change=change).view(box_shape(outer))
    sl = (slice(None),) + box_to_slices(box[1:])
    res = blk[sl]
    if out is not None:
        out.copy_(res)
        return out
    return res.contiguous()


def full_param(name: str, shape: tuple[int, ...], *, step: int, seed: int, dtype: str | torch.dtype,
               change=None) -> torch.Tensor:
    """The whole parameter ``name`` at ``step`` (what a full checkpoint holds)."""
    return param_box(name, shape, tuple((0, s) for s in shape), step=step, seed=seed, dtype=dtype, change=change)


def frozen_step(name: str, step: int, frozen: tuple[str, ...] = ()) -> int:
    """The step whose weights tensor ``name`` holds at ``step``: 0 (its initial weights, never
    trained) when it starts with one of the ``frozen`` prefixes, else ``step``."""
    return 0 if frozen and name.startswith(frozen) else step


class SyntheticCheckpoint:
    """The full checkpoint of a model at one training step, tensor by tensor, on demand.

    ``specs``: objects with ``name``, ``shape``, ``dtype`` (e.g. ``catalog.param_specs(cfg)``);
    ``dtype_override`` replaces every BF16 dtype (e.g. ``"float32"`` for fp32 masters, C8).
    ``checkpoint[name]`` generates one tensor; iteration yields ``(name, tensor)`` in spec
    order, one tensor alive at a time (what ``Engine.load_weights`` consumes). ``change``: per-step
    fractions of elements that change (the module docstring); None: every element, every step.
    ``frozen``: name prefixes of tensors the trainer holds but does not train (a frozen draft):
    they keep their step-0 weights at every step (:func:`frozen_step`).
    """

    def __init__(self, specs, *, step: int, seed: int, dtype_override: str | None = None, change=None,
                 frozen: tuple[str, ...] = ()):
        self.specs = {s.name: s for s in specs}
        self.step, self.seed, self.change = step, seed, (tuple(change) if change else None)
        self.dtype_override = dtype_override
        self.frozen = tuple(frozen)

    def dtype_of(self, name: str) -> str:
        d = self.specs[name].dtype
        return self.dtype_override if (self.dtype_override and d == "bfloat16") else d

    def __getitem__(self, name: str) -> torch.Tensor:
        s = self.specs[name]
        return full_param(name, s.shape, step=frozen_step(name, self.step, self.frozen), seed=self.seed, dtype=self.dtype_of(name), change=self.change)

    def __iter__(self):
        for name in self.specs:
            yield name, self[name]

    def names(self) -> list[str]:
        return list(self.specs)
