"""Independent, bit-exact verification of an inference rank after an update.

The expected bytes come from the engine's *own* ``load_weights`` (the oracle: vLLM loader
semantics, written separately from the trainer-side recipes) fed with the full synthetic
checkpoint of that step. Every byte of every destination tensor is compared, including byte 0
and each tensor's first and last byte; bytes of the region that belong to no tensor (alignment
gaps) must be unchanged since registration (nothing wrote outside a tensor), and the guard
bytes just outside the registered region (``weight_transfer.engines.engine.GUARD`` on each side, filled with
``GUARD_BYTE``) must still hold their pattern (nothing wrote past the region's ends).

A live engine on a GPU (``--device cuda``) is compared on the host: each tensor is copied
device-to-host and compared there with the oracle, which is always built on the CPU (the
oracle's arithmetic is the CPU's, so a GPU-side quantizer that rounds differently shows up as
a mismatch instead of agreeing with itself).
"""
from __future__ import annotations

import torch

from weight_transfer.model_config import ModelConfig
from weight_transfer.testing.catalog import param_specs
from weight_transfer.testing.weights import SyntheticCheckpoint
from weight_transfer.types import InferenceLayout


def expected_engine(mcfg: ModelConfig, layout: InferenceLayout, rank: int, *, step: int, seed: int,
                    dtype_override: str | None = None, change=None, source=None, frozen: tuple[str, ...] = ()):
    """A fresh engine loaded through ``load_weights`` with the full checkpoint of ``step``
    (``change``: the run's per-step change fractions, :mod:`weight_transfer.testing.weights`;
    ``source``: a :class:`weight_transfer.testing.replay.ReplaySteps` whose step ``step`` is the
    checkpoint instead, the same bytes the training ranks loaded; ``frozen``: name prefixes of
    tensors the trainer does not train, at their step-0 weights: a frozen draft)."""
    from weight_transfer.engines import expected_from_checkpoint

    if source is not None:
        from weight_transfer.testing.replay import ReplayCheckpoint

        ckpt = ReplayCheckpoint(source, param_specs(mcfg, layout.draft), step=step, dtype_override=dtype_override)
    else:
        ckpt = SyntheticCheckpoint(param_specs(mcfg, layout.draft), step=step, seed=seed, dtype_override=dtype_override, change=change,
                                   frozen=frozen)
    return expected_from_checkpoint(mcfg, layout, rank, ckpt.__getitem__, ckpt.names())


def compare_engines(live, expected, *, max_report: int = 5) -> dict:
    """Compare every destination tensor of ``live`` with ``expected`` byte for byte, on
    ``expected``'s device (a tensor of ``live`` elsewhere, e.g. on a GPU, is copied there first).
    Returns {"ok", "bytes_checked", "mismatches": [(name, n_bad_bytes, first_bad_offset)]}."""
    lp, ep = live.named_parameters(), expected.named_parameters()
    bad = []
    checked = 0
    if set(lp) != set(ep):
        return {"ok": False, "bytes_checked": 0, "mismatches": [("<tensor set differs>", 0, 0)]}
    for name, t in lp.items():
        b = ep[name].contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        a = t.contiguous().view(-1).view(torch.uint8).to(b.device) if t.numel() else b
        checked += a.numel()
        if not torch.equal(a, b):
            diff = (a != b).nonzero()
            bad.append((name, int(diff.numel()), int(diff[0])))
    return {"ok": not bad, "bytes_checked": checked, "mismatches": bad[:max_report], "n_mismatched_tensors": len(bad)}


def verify_engine(engine, mcfg: ModelConfig, layout: InferenceLayout, rank: int, *, step: int, seed: int,
                  dtype_override: str | None = None, gaps=None, change=None, keep: dict | None = None,
                  source=None, frozen: tuple[str, ...] = ()) -> dict:
    """Verify ``engine`` (the live receiving engine) holds exactly the weights of ``step``:
    ``{"ok", "bytes_checked", "mismatches", ...}`` plus ``gaps_written`` (changed gap spans)
    and ``guards_written`` (:meth:`Engine.guard_damage`) when not empty. ``keep``: a dict that
    receives the oracle engine as ``keep["expected"]`` (e.g. to replay generation steps).
    ``source``: replayed steps (:func:`expected_engine`)."""
    exp = expected_engine(mcfg, layout, rank, step=step, seed=seed, dtype_override=dtype_override, change=change,
                          source=source, frozen=frozen)
    if keep is not None:
        keep["expected"] = exp
    res = compare_engines(engine, exp)
    damage = engine.guard_damage() if hasattr(engine, "guard_damage") else []
    if damage:
        res["ok"] = False
        res["guards_written"] = damage
    if gaps:
        raw = engine.arena.cpu()  # one device-to-host copy on a GPU; the arena itself on the CPU
        touched = [(a, b) for a, b, before in gaps if bytes(raw[a:b].tolist()) != before]
        if touched:
            res["ok"] = False
            res["gaps_written"] = touched[:5]
    return res
