"""A wire-bound link on one machine: the rate of a ``tc`` token bucket on the training-side veth
of ``scripts/netns_trial.py``, the memory:wire ratio it sets, the checks that the link really is
the limit, and the full-against-delta table of a trial run over it (docs/DELTA.md, "On a
wire-bound link").

Pure functions (no root, no namespaces): the launcher runs the commands they return.

Units: rates in bits per second (``tc``'s ``bit``), bytes in bytes, seconds in seconds, memory
bandwidth in GB/s (1e9 B/s, :func:`weight_transfer.experiments.env.measure_memcpy_gbps`).

The token bucket (``tc qdisc add dev <veth> root tbf rate R burst B limit L``):

- ``rate``: the link's rate, from ``--link-rate`` (``400mbit``, ``1.2gbit``, ``50mbps`` =
  megabytes per second as in ``tc``) or ``--memory-wire-ratio X`` (the same run's single-thread
  memcpy bandwidth divided by ``X``; a cluster's HBM 4.8 TB/s against a 50 GB/s NIC is ~100:1).
- ``burst`` (:data:`BURST_BYTES`, 128 KiB): the bucket's depth. veth hands TCP's GSO packets of
  up to 64 KiB to the qdisc as one packet; a bucket smaller than a packet would make ``tbf``
  segment it (or drop it on old kernels), so the burst holds two. Tokens saved while the link is
  idle let one burst pass at veth speed: 128 KiB is <1 ms at the rates used here and a few
  percent of the smallest delta measured, stated with every table.
- ``limit`` (:func:`queue_limit`): bytes that may wait for tokens, ``max(4 MiB, 20 ms at the
  rate)``; more would only add queueing delay (TCP's small-queue limit keeps the backlog far
  below it), less would drop packets and measure TCP's recovery instead of the rate.
- no delay: this kernel has no ``netem``; the veth adds ~10 us.
"""
from __future__ import annotations

import re
import statistics

__all__ = ["BURST_BYTES", "parse_rate", "format_rate", "wire_rate_bits", "queue_limit", "tbf_command",
           "parse_tc_stats", "wire_check", "pair_table", "memory_wire_ratio"]

BURST_BYTES = 128 << 10
"""The token bucket's depth, bytes: two of veth's largest GSO packets (64 KiB each)."""
MIN_LIMIT_BYTES = 4 << 20
"""The smallest queue the bucket gets, bytes (:func:`queue_limit`)."""
WIRE_BOUND_SHARE = 0.7
"""A full update is called wire-bound when ``bytes x 8 / rate`` is at least this share of its seconds."""

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
"""``tc``'s rate units (tc-tbf(8)): ``*bit`` bits per second, ``*bps`` BYTES per second."""
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]+)\s*$")


def parse_rate(text: str) -> int:
    """``"400mbit"`` -> 400_000_000 (bits per second). Units as ``tc``: ``bit``, ``kbit``, ``mbit``,
    ``gbit``, ``tbit`` (bits per second) and ``bps``, ``kbps``, ``mbps``, ``gbps``, ``tbps``
    (bytes per second), case-insensitive, decimal prefixes. Raises ValueError for a missing or
    unknown unit, or a rate below 8 kbit/s (tbf's accounting gets coarse) or above 10 Tbit/s."""
    m = _RATE_RE.match(str(text))
    if not m:
        raise ValueError(f"--link-rate {text!r}: a number and a tc unit, e.g. 400mbit, 2gbit, 50mbps (bytes/s)")
    unit = m.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"--link-rate {text!r}: unknown unit {m.group(2)!r} (one of {', '.join(_UNITS)})")
    bits = float(m.group(1)) * _UNITS[unit]
    if not 8e3 <= bits <= 1e13:
        raise ValueError(f"--link-rate {text!r}: {bits:.3g} bit/s is outside 8kbit .. 10tbit")
    return int(round(bits))


def format_rate(bits: float) -> str:
    """``1.33e9`` -> ``"1.330 Gbit/s (166.3 MB/s)"``."""
    for div, name in ((1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bits >= div:
            return f"{bits / div:.3f} {name} ({bits / 8e6:.1f} MB/s)"
    return f"{bits:.0f} bit/s ({bits / 8e6:.4f} MB/s)"


def wire_rate_bits(*, link_rate: str | None = None, ratio: float | None = None,
                   memcpy_gbps: float | None = None) -> tuple[int, str]:
    """The link's rate (bits per second) and how it was set: ``link_rate`` (a tc rate string,
    :func:`parse_rate`) or ``ratio`` (local memory bandwidth over wire bandwidth) with the same
    run's ``memcpy_gbps`` (GB/s): ``memcpy_gbps x 1e9 x 8 / ratio``. Exactly one of ``link_rate``
    and ``ratio``; ValueError otherwise, for a ratio <= 1, or a ratio without a measured memcpy."""
    if (link_rate is None) == (ratio is None):
        raise ValueError("give one of --link-rate RATE and --memory-wire-ratio X")
    if link_rate is not None:
        b = parse_rate(link_rate)
        return b, f"--link-rate {link_rate}"
    if not ratio > 1:
        raise ValueError(f"--memory-wire-ratio {ratio}: > 1 (local memory faster than the wire; a cluster's is ~100)")
    if not memcpy_gbps or memcpy_gbps <= 0:
        raise ValueError("--memory-wire-ratio needs the run's memcpy bandwidth (measured before the trial)")
    bits = int(round(memcpy_gbps * 1e9 * 8 / ratio))
    if bits < 8e3:
        raise ValueError(f"--memory-wire-ratio {ratio}: {bits} bit/s is below 8 kbit/s")
    return bits, f"--memory-wire-ratio {ratio:g} x memcpy {memcpy_gbps:.2f} GB/s"


def memory_wire_ratio(memcpy_gbps: float, rate_bits: float) -> float:
    """Local memory bandwidth over the link's: ``memcpy_gbps x 1e9 / (rate_bits / 8)``."""
    return memcpy_gbps * 1e9 * 8 / rate_bits


def queue_limit(rate_bits: int) -> int:
    """Bytes the token bucket queues: ``max(MIN_LIMIT_BYTES, 20 ms at rate)``."""
    return max(MIN_LIMIT_BYTES, int(rate_bits / 8 * 0.020))


def tbf_command(dev: str, rate_bits: int, *, burst: int = BURST_BYTES, limit: int | None = None) -> list[str]:
    """The ``tc`` command that rate-limits ``dev``'s egress (run inside its namespace)."""
    limit = queue_limit(rate_bits) if limit is None else limit
    if burst < 65536 + 128:
        raise ValueError(f"burst {burst} B: at least one 64 KiB GSO packet plus headers")
    return ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_bits}bit", "burst", str(burst),
            "limit", str(limit)]


_TC_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+) requeues (\d+)\)")


def parse_tc_stats(text: str) -> dict:
    """``tc -s qdisc show dev X``'s first ``Sent`` line -> ``{"bytes", "packets", "dropped",
    "overlimits", "requeues"}`` (ints); ``{}`` when there is none. ``overlimits`` counts packets
    the bucket held back for lack of tokens: nonzero when the rate was the limit."""
    m = _TC_SENT.search(text or "")
    if not m:
        return {}
    return dict(zip(("bytes", "packets", "dropped", "overlimits", "requeues"), map(int, m.groups())))


def _mode(r: dict) -> str:
    """``full`` or ``delta`` for a measured row: its ``pair_mode`` (``--delta-pairs``), else what the
    executor did (``delta`` column: ``delta``, ``full: <why>`` or empty)."""
    pm = r.get("pair_mode")
    if pm:
        return pm
    return "delta" if r.get("delta") == "delta" else "full"


def wire_check(rows: list[dict], rate_bits: int) -> dict:
    """Whether the full updates of ``rows`` (measured, not warm-up) were bound by the link:
    ``{"full_p50_s", "full_bytes", "wire_s" (bytes x 8 / rate), "share" (wire_s / full_p50_s),
    "wire_bound" (share >= WIRE_BOUND_SHARE), "n"}``; ``{}`` without a full row."""
    full = [r for r in rows if not r.get("warmup") and _mode(r) == "full"]
    if not full:
        return {}
    p50 = statistics.median(float(r["seconds"]) for r in full)
    nbytes = statistics.median(float(r.get("delta_bytes", r["bytes"])) for r in full)
    wire = nbytes * 8 / rate_bits
    share = wire / p50 if p50 > 0 else float("inf")
    return {"full_p50_s": p50, "full_bytes": nbytes, "wire_s": wire, "share": share,
            "wire_bound": share >= WIRE_BOUND_SHARE, "n": len(full)}


PHASES = ("compare", "pack", "wire", "apply")
"""The delta phases of the table: ``delta_<phase>_s`` where the executor reports it; ``wire``
otherwise the write stage's busy seconds (``phase_write_s``), or without them the bytes written
over the link's rate (marked ``~``)."""


def pair_table(rows: list[dict], rate_bits: int | None = None) -> tuple[str, dict]:
    """The full-against-delta table of a trial's measured rows (nccl-tests shape: ``#`` lines,
    a units row, fixed-width rows, a footer), and its numbers: ``{"full": {...}, "delta": {...},
    "ratio_p50" (delta p50 / full p50), "pair_ratio_p50" (median over pairs of delta / full
    seconds, when rows carry ``pair_mode``), "verified" (every row)}``.

    Per mode: pushes, p50 seconds, p50 bytes written and their share of full, p50 runs
    (``n_writes``), p50 bytes on the link (``link_tx_bytes`` when recorded), and the p50 of each
    phase with its share of the p50 seconds: compare, pack, wire, apply (``delta_<phase>_s``
    columns when present; ``wire`` otherwise ``phase_write_s``, or ``bytes x 8 / rate`` marked ``~``)."""
    meas = [r for r in rows if not r.get("warmup")]
    out: dict = {"verified": all(r.get("verified") for r in rows) and bool(rows)}
    lines = ["# full against delta, p50 over the measured pushes; phases: p50 seconds (share of the p50 push)",
             f"{'mode':>6} {'pushes':>6} {'p50':>8} {'written':>11} {'of full':>8} {'runs':>8} {'on link':>11} "
             + " ".join(f"{p:>15}" for p in PHASES) + f" {'verified':>8}",
             f"{'':>6} {'':>6} {'(s)':>8} {'(B)':>11} {'(%)':>8} {'':>8} {'(B)':>11} "
             + " ".join(f"{'(s, %)':>15}" for _ in PHASES) + f" {'':>8}"]
    full_bytes = None
    for mode in ("full", "delta"):
        rs = [r for r in meas if _mode(r) == mode]
        if not rs:
            continue
        def med(k, rs=rs):
            return statistics.median(float(r.get(k, 0.0) or 0.0) for r in rs)

        m = {"n": len(rs), "p50_s": med("seconds"), "bytes": med("delta_bytes"), "full_bytes": med("bytes"),
             "runs": med("n_writes"), "verified": all(r.get("verified") for r in rs)}
        if any("link_tx_bytes" in r for r in rs):
            m["link_bytes"] = med("link_tx_bytes")
        full_bytes = full_bytes or m["full_bytes"]
        cells = []
        for p in PHASES:
            key = f"delta_{p}_s"
            if any(key in r for r in rs) and mode == "delta":
                v, mark = med(key), ""
            elif p == "wire" and any("phase_write_s" in r for r in rs):  # the write stage's busy seconds
                v, mark = med("phase_write_s"), ""
            elif p == "wire" and rate_bits:
                v, mark = m["bytes"] * 8 / rate_bits, "~"
            else:
                v, mark = None, ""
            m[p] = v
            cells.append(f"{'-':>15}" if v is None else
                         f"{mark + f'{v:.4f}':>8} {100 * v / m['p50_s'] if m['p50_s'] else 0:5.1f}%")
        out[mode] = m
        lines.append(f"{mode:>6} {m['n']:>6} {m['p50_s']:>8.4f} {m['bytes']:>11.0f} "
                     f"{100 * m['bytes'] / (full_bytes or 1):>8.2f} {m['runs']:>8.0f} "
                     f"{m.get('link_bytes', float('nan')):>11.0f} " + " ".join(cells)
                     + f" {'all' if m['verified'] else 'NOT ALL':>8}")
    if "full" in out and "delta" in out:
        out["ratio_p50"] = out["delta"]["p50_s"] / out["full"]["p50_s"]
        pairs: dict[int, dict] = {}
        for r in meas:
            if r.get("pair_mode"):
                pairs.setdefault((int(r["step"]) + 1) // 2, {})[r["pair_mode"]] = float(r["seconds"])
        ratios = [p["delta"] / p["full"] for p in pairs.values() if len(p) == 2 and p["full"] > 0]
        if ratios:
            out["pair_ratio_p50"] = statistics.median(ratios)
            out["pairs_delta_faster"] = sum(x < 1 for x in ratios)
            out["n_pairs"] = len(ratios)
        lines.append(f"# delta/full p50: {out['ratio_p50']:.3f}x seconds, "
                     f"{out['delta']['bytes'] / out['full']['bytes']:.4f}x bytes written"
                     + (f"; per pair (same weights) p50 {out['pair_ratio_p50']:.3f}x, delta faster in "
                        f"{out['pairs_delta_faster']}/{out['n_pairs']}" if ratios else ""))
    lines.append(f"# every update verified bit-exact: {out['verified']}")
    return "\n".join(lines), out
