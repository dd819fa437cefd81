"""What the inference engines do while updates land, as a run's options: serve a generation
load through the updates (:class:`ServeOptions`, C27) and come and go (:class:`FleetOptions`,
C24: ``--kill-engine``, ``--restart-engine``, ``--engines-at``), with the parsers and checks of
the fleet's options (no process exists yet). Parts of :class:`weight_transfer.experiments.config.TrialConfig`
(importable from there too); what happens during the run is experiments/serving.py and
experiments/fleet.py.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

WHENS = ("during", "before")
"""When ``--kill-engine`` kills: while the update writes (default) or before its go."""


# --------------------------------------------------------------------------------------------
# parsing and checking (no process exists yet)


def _int(text: str, flag: str, item: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} {item!r}: {text!r} is not an integer") from None


def parse_kills(s: str) -> tuple[tuple[int, int, str], ...]:
    """``--kill-engine`` text -> ``((step, engine, when), ...)``: ``STEP:E`` (when ``during``)
    or ``STEP:E:before``, comma-separated. ArgumentTypeError naming the option and the item."""
    out = []
    for item in (x.strip() for x in s.split(",") if x.strip()):
        parts = item.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in WHENS):
            raise argparse.ArgumentTypeError(f"--kill-engine {item!r}: wants STEP:E or STEP:E:before "
                                             "(e.g. 3:1, 2:0:before)")
        out.append((_int(parts[0], "--kill-engine", item), _int(parts[1], "--kill-engine", item),
                    parts[2] if len(parts) == 3 else "during"))
    return tuple(out)


def parse_pairs(s: str, flag: str, what: str) -> tuple[tuple[int, int], ...]:
    """``STEP:X[,STEP:X...]`` -> ``((STEP, X), ...)`` for ``flag`` (``what`` names X in the
    message). ArgumentTypeError naming the option and the item."""
    out = []
    for item in (x.strip() for x in s.split(",") if x.strip()):
        parts = item.split(":")
        if len(parts) != 2:
            raise argparse.ArgumentTypeError(f"{flag} {item!r}: wants STEP:{what} (e.g. 5:1)")
        out.append((_int(parts[0], flag, item), _int(parts[1], flag, item)))
    return tuple(out)


def normalize_options(opts) -> None:
    """:class:`FleetOptions`'s own checks: tuples of tuples (a config built from lists, a CSV),
    ``:during`` filled in, steps >= 1, engines >= 0, counts >= 1. ValueError naming the option."""
    kills = []
    for k in opts.kill_engine:
        k = tuple(k)
        if len(k) == 2:
            k = (*k, "during")
        if len(k) != 3 or k[2] not in WHENS:
            raise ValueError(f"--kill-engine {k!r}: wants (step, engine[, 'during'|'before'])")
        kills.append((int(k[0]), int(k[1]), str(k[2])))
    opts.kill_engine = tuple(kills)
    opts.restart_engine = tuple((int(a), int(b)) for a, b in opts.restart_engine)
    opts.engines_at = tuple((int(a), int(b)) for a, b in opts.engines_at)
    for flag, items in (("--kill-engine", [(s, e) for s, e, _ in opts.kill_engine]),
                        ("--restart-engine", opts.restart_engine)):
        for s, e in items:
            if s < 1 or e < 0:
                raise ValueError(f"{flag} {s}:{e}: updates are numbered from 1, engines from 0")
    for s, n in opts.engines_at:
        if s < 1 or n < 1:
            raise ValueError(f"--engines-at {s}:{n}: updates are numbered from 1 and at least 1 engine serves")
    steps = [s for s, _ in opts.engines_at]
    if len(set(steps)) != len(steps):
        raise ValueError(f"--engines-at {text_of(opts.engines_at)}: one count per update")
    seen = set()
    for s, e, _ in opts.kill_engine:
        if (s, e) in seen:
            raise ValueError(f"--kill-engine {s}:{e} given twice")
        seen.add((s, e))


def text_of(items) -> str:
    """``((3, 1, "during"), (5, 0, "before"))`` -> ``3:1,5:0:before`` (the options' own text;
    a row's column)."""
    return ",".join(":".join(str(x) for x in (it[:2] if len(it) == 3 and it[2] == "during" else it)) for it in items)


def _kills(s: str) -> tuple[tuple[int, int, str], ...]:
    """``3:1`` -> ``((3, 1, "during"),)``; ``2:0:before,4:1`` -> ``((2, 0, "before"), (4, 1,
    "during"))`` (the ``--kill-engine`` option, :class:`FleetOptions`)."""
    return parse_kills(s)


def _step_pairs(flag: str, what: str):
    """A parser of ``STEP:X[,STEP:X...]`` -> ``((STEP, X), ...)`` for option ``flag``."""
    def parse(s: str) -> tuple[tuple[int, int], ...]:
        return parse_pairs(s, flag, what)
    return parse


@dataclass(kw_only=True, slots=True)
class ServeOptions:
    """Serving while updates land (C27): shadow targets and a generation load.

    With a generation load the inference engines generate through every update (the stand-in:
    engines/generate.py; its steps timestamped in the engine), and each update's row carries
    the engine's stall (experiments/stall.py): without shadow targets generation pauses for
    the whole update (the pause-based update), with them only for the go-live."""

    shadow: str = field(default="off", metadata={"choices": ("off", "flip", "copy")})
    """Shadow targets (:mod:`weight_transfer.api.shadow`): each inference rank registers one shadow of
    its weights once; every update writes it while the engine serves the live weights, and the
    commit makes it live between two engine steps: ``flip`` swaps the halves of a double buffer
    (the engine reads its weights at call time), ``copy`` copies shadow -> live (addresses
    captured). ``off``: the writes land in the live weights."""
    gen_load: int = 0
    """Concurrent requests of a generation load running through the updates (0: none)."""
    gen_tokens: int = 64
    """Tokens per request of the generation load (a finished request is replaced)."""

    def __post_init__(self):
        from weight_transfer.api.shadow import check_mode

        check_mode(self.shadow, where="--shadow")
        for name in ("gen_load", "gen_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "gen_load" else 1):
                raise ValueError(f"--{name.replace('_', '-')} {v!r}: an int >= {0 if name == 'gen_load' else 1}")

    @property
    def active(self) -> bool:
        """True with shadow targets or a generation load."""
        return self.shadow != "off" or self.gen_load > 0


@dataclass(kw_only=True, slots=True)
class FleetOptions:
    """Inference engines killed, restarted and scaled during one run (C24).

    The trainers keep training; the plan is recomputed for each new membership
    (experiments/fleet.py)."""

    kill_engine: tuple[tuple[int, int, str], ...] = field(
        default=(), metadata={"parse": _kills, "metavar": "STEP:E[:before],..."})
    """SIGKILL every process of inference engine ``E`` (instance ``E`` of the layout: ranks
    ``E*tp .. E*tp+tp-1``) while update ``STEP`` writes (half-way through training rank 0's
    write tasks: that update fails, named, ``incomplete``; the next completes on the
    survivors), or with ``:before`` between updates, before update ``STEP``'s go (found gone,
    planned without it: update ``STEP`` completes on the survivors). Comma-separated."""
    restart_engine: tuple[tuple[int, int], ...] = field(
        default=(), metadata={"parse": _step_pairs("--restart-engine", "E"), "metavar": "STEP:E,..."})
    """Start a fresh process (fresh memory, poisoned) for engine ``E``, killed by
    ``--kill-engine`` at an earlier update, before update ``STEP``: it registers, the plan is
    recomputed with it, and update ``STEP`` is its first (complete, verified bit-exact)."""
    engines_at: tuple[tuple[int, int], ...] = field(
        default=(), metadata={"parse": _step_pairs("--engines-at", "N"), "metavar": "STEP:N,..."})
    """Scale the fleet to ``N`` engines before update ``STEP`` (``1:N`` sets the first
    update's; without it the run starts with all ``dp`` engines): engines ``0..N-1`` of the
    layout, which has room for ``dp``. Scaling down asks the highest-numbered running engines
    to leave (they deregister and exit); scaling up starts the lowest-numbered stopped ones
    fresh. E.g. ``--dp 3 --engines-at 1:1,3:3,5:1``."""

    def __post_init__(self):
        normalize_options(self)

    @property
    def active(self) -> bool:
        """True when any engine is killed, restarted or scaled in this run."""
        return bool(self.kill_engine or self.restart_engine or self.engines_at)
