"""What a served draft model adds to an update at scale (``layout.draft="mtp"``: DeepSeek-V3 /
Kimi-K2 multi-token prediction, issue 57 (3)), and what the FP8 scales add.

A config whose layout serves a draft is predicted twice on the same cluster: as configured (the
draft's tensors planned and written in the same update, under the same version) and with
``draft=None`` (the same config without it). :func:`draft_rows` gives, per method, both
predicted times and their difference, beside the bytes: every receiver's bytes of the draft's
tensors (``draft.*``), of the FP8 ``weight_scale_inv`` tensors (target's and draft's), and the
busiest receiver's share of each with the seconds it takes at the NIC's line rate (the floor
share, :attr:`~weight_transfer.experiments.sim.hardware.Hardware.nic_line_Bps`: the scales are
never planned without their weights, so their cost is stated as bytes at line rate, not as a
second prediction). Columns: :func:`draft_columns` (results/simulated.csv), the table:
:func:`format_draft`.
"""
from __future__ import annotations

from dataclasses import replace

DRAFT_PREFIX = "draft."
"""Destination names of the draft's tensors start with this (docs/LAYOUTS.md)."""
SCALE_SUFFIX = "_scale_inv"
"""Destination names of FP8 block scales end with this (``weight_scale_inv``, ``w13_weight_scale_inv``)."""


def draft_split(dm: dict) -> dict:
    """Bytes of the destination tensors ``dm`` (inference rank -> its
    :class:`~weight_transfer.types.DestTensorMeta` list): ``total``, ``draft`` (``draft.*``),
    ``scales`` (every ``*_scale_inv``), ``draft_scales``, summed over all receivers (B), and the
    same of the busiest receiver (the one receiving the most bytes): ``max_<key>`` (B)."""
    per = {}
    for r, metas in dm.items():
        d = {"total": 0, "draft": 0, "scales": 0, "draft_scales": 0}
        for m in metas:
            dr, sc = m.name.startswith(DRAFT_PREFIX), m.name.endswith(SCALE_SUFFIX)
            d["total"] += m.nbytes
            d["draft"] += m.nbytes if dr else 0
            d["scales"] += m.nbytes if sc else 0
            d["draft_scales"] += m.nbytes if dr and sc else 0
        per[r] = d
    out = {k: sum(d[k] for d in per.values()) for k in ("total", "draft", "scales", "draft_scales")}
    busiest = max(per.values(), key=lambda d: d["total"]) if per else dict.fromkeys(out, 0)
    out.update({f"max_{k}": v for k, v in busiest.items()})
    return out


def draft_rows(cfg, split: dict, results: list, *, rerun, log=print) -> list[dict]:
    """One row per predicted method of ``results`` (the run of ``cfg``, whose layout serves a
    draft): its seconds and bytes, and those of ``rerun(cfg without the draft)`` (``rerun``:
    :func:`weight_transfer.experiments.sim.run.run`), their differences, and ``split``'s bytes
    (:func:`draft_split`) with their line-rate seconds on the busiest receiver."""
    base_cfg = replace(cfg, name=f"{cfg.name}[no draft]", layout=replace(cfg.layout, draft=None))
    log(f"# the same config without the draft ({base_cfg.layout.describe()}) ...")
    base = {r.method: r for r in rerun(base_cfg, log=log).results}
    line = cfg.hardware.nic_line_Bps
    rows = []
    for r in results:
        b = base.get(r.method)
        rows.append({
            "config": cfg.name, "method": r.method, "layout": cfg.layout.describe(),
            "seconds": r.seconds, "base_seconds": b.seconds if b else None,
            "draft_added_seconds": r.seconds - b.seconds if b else None,
            "bytes": r.bytes, "base_bytes": b.bytes if b else None,
            "draft_bytes": split["draft"], "scale_bytes": split["scales"], "draft_scale_bytes": split["draft_scales"],
            "max_recv_bytes": split["max_total"], "max_recv_draft_bytes": split["max_draft"],
            "max_recv_scale_bytes": split["max_scales"],
            "draft_line_seconds": split["max_draft"] / line, "scale_line_seconds": split["max_scales"] / line,
        })
    return rows


def draft_columns(rows: list[dict] | None, method: str) -> dict:
    """The draft's columns of ``method``'s row in results/simulated.csv (empty without a draft)."""
    row = next((r for r in rows or () if r["method"] == method), None)
    keep = ("base_seconds", "draft_added_seconds", "base_bytes", "draft_bytes", "scale_bytes", "draft_scale_bytes",
            "max_recv_draft_bytes", "max_recv_scale_bytes", "draft_line_seconds", "scale_line_seconds")
    return {k: row[k] for k in keep} if row else {}


def format_draft(rows: list[dict]) -> str:
    """The table ``simulate`` prints for a config serving a draft (GB = 1e9 B)."""
    if not rows:
        return ""
    r0 = rows[0]
    L = [f"# draft model ({r0['layout']}): what the draft and the FP8 scales add (same cluster, predicted without the "
         "draft too)",
         f"#   bytes, all receivers: draft {r0['draft_bytes'] / 1e9:.2f} GB of {r0['bytes'] / 1e9:.1f} GB "
         f"({100 * r0['draft_bytes'] / max(1, r0['bytes']):.2f}%; of it scales {r0['draft_scale_bytes'] / 1e9:.3f} GB); "
         f"FP8 scales (target + draft) {r0['scale_bytes'] / 1e9:.2f} GB ({100 * r0['scale_bytes'] / max(1, r0['bytes']):.2f}%)",
         f"#   busiest receiver: {r0['max_recv_bytes'] / 1e9:.2f} GB, of it draft {r0['max_recv_draft_bytes'] / 1e9:.3f} GB "
         f"= {r0['draft_line_seconds']:.4f} s at line rate, scales {r0['max_recv_scale_bytes'] / 1e9:.3f} GB "
         f"= {r0['scale_line_seconds']:.4f} s at line rate",
         f"#   {'method':>22} {'with draft (s)':>15} {'without (s)':>12} {'added (s)':>10} {'added':>8}"]
    for r in rows:
        if r["base_seconds"] is None:
            continue
        L.append(f"#   {r['method']:>22} {r['seconds']:>15.3f} {r['base_seconds']:>12.3f} {r['draft_added_seconds']:>+10.3f} "
                 f"{r['draft_added_seconds'] / r['base_seconds']:>+8.1%}")
    return "\n".join(L)
