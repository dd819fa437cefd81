"""Serving while updates land, in the harness (C27): the stand-in engine's generation load,
its go-lives (shadow targets) or pauses (the pause-based update), and each update's stall.

Inference side (:class:`StandInServing`, one per inference rank, in ``inference_main``):

- a :class:`weight_transfer.engines.generate.GenerationLoad` steps the engine (``--gen-load``
  concurrent requests), each step holding the engine's step lock and carrying the engine's
  version label;
- with shadow targets the receiver's :class:`weight_transfer.api.shadow.GoLiveServer` runs each
  go-live holding the same lock and changes the label inside it (no step computes with new
  weights under the old label, or the reverse);
- without them and with a load, the pause-based update: the controller asks for a pause
  (``step/{s}/pause``) before the first byte moves, the engine stops stepping and acknowledges
  (``step/{s}/paused/{i}``, a flag), and resumes with the new label when the controller says
  (``step/{s}/resume``, after the update completed or failed).

Controller side (:func:`before_update`, :func:`after_update`, :func:`serve_columns`): the update
window's start (``step/{s}/t_begin``, wall clock), the pause handshake, and the row's columns
from the inference ranks' reports (the slowest rank's stall).

Times are ``time.time()`` wall-clock seconds (one host's processes share the clock).
"""
from __future__ import annotations

import threading
import time

from weight_transfer.control import protocol as control
from weight_transfer.control import wire

KEY_T_BEGIN = "step/{v}/t_begin"
"""The controller's wall-clock start of update ``v``'s window (a float, :mod:`weight_transfer.control.wire`)."""
wire.register(KEY_T_BEGIN, float, "the harness: wall-clock start of an update's window (generation load, C27)")

__all__ = ["StandInServing", "before_update", "after_update", "serve_columns", "serve_lines", "SERVE_COLUMNS"]

SERVE_COLUMNS = ("shadow", "gen_load", "stall_s", "golive_s", "golive_gap_s", "max_gap_during_s",
                 "max_gap_between_s", "tok_s_during", "tok_s_between", "shadow_extra_bytes", "label_errors",
                 "replayed", "replay_errors")
"""The row columns this module adds (seconds, tokens/s, bytes; ``label_errors``: steps whose
version label contradicts the go-live times; ``replayed`` / ``replay_errors``: sampled steps
recomputed from their label's oracle weights, and those that came out different)."""


class StandInServing:
    """One stand-in inference rank's serving (see the module docstring). ``side``: the rank's
    :class:`weight_transfer.method.ReferenceInference` (its receiver has the shadow), ``serve``:
    the trial's :class:`weight_transfer.experiments.config.ServeOptions`."""

    def __init__(self, serve, engine, side, store, rank: int, *, seed: int = 0, log=print):
        self.serve, self.engine, self.store, self.rank, self.log = serve, engine, store, rank, log
        self.lock = threading.Lock()
        self.label = -1  # the version the engine computes with (-1: none yet)
        self.receiver = getattr(side, "receiver", None)
        self.shadow = getattr(self.receiver, "shadow", None)
        self.pauses: dict[int, tuple[float, float]] = {}
        self._oracles: dict[int, dict] = {}
        self._checked: set = set()
        self.load = None
        self._stop = threading.Event()
        self._server = None
        self._watcher = None
        if serve.gen_load:
            from weight_transfer.engines.generate import GenerationLoad

            self.load = GenerationLoad(engine.named_parameters, self.lock, n_requests=serve.gen_load,
                                       max_tokens=serve.gen_tokens, label=lambda: self.label, seed=seed + rank)
            self.load.start()
        if self.shadow is not None:
            self._server = self.receiver.serve_go_live(self.lock, on_live=self._on_live)
        elif self.load is not None:
            self._watcher = threading.Thread(target=self._pauses, name=f"wt-pause-{rank}", daemon=True)
            self._watcher.start()

    def _on_live(self, version: int, stats: dict) -> None:
        self.label = version  # inside the go-live's window: the next step computes with it

    def _pauses(self) -> None:
        """The pause-based update: pause on ``step/{s}/pause``, resume on ``step/{s}/resume``."""
        s = 1
        while not self._stop.is_set():
            try:
                if self.store.check(["shutdown"]):
                    return
                if not self.store.check([f"step/{s}/pause"]):
                    self._stop.wait(0.002)
                    continue
                t0 = time.time()
                self.load.pause()  # returns once no step runs
                self.store.set(f"step/{s}/paused/{self.rank}", b"1")
                while not self.store.check([f"step/{s}/resume"]):
                    if self._stop.wait(0.001) or self.store.check(["shutdown"]):
                        return
                st = control.read_state(self.store)
                with self.lock:
                    if st.complete:
                        self.label = st.version
                    self.load.resume()
                self.pauses[s] = (t0, time.time())
                s += 1
            except Exception:  # the store went away: the job ended
                if self._stop.wait(0.05):
                    return

    def window(self, version: int) -> tuple[float, float, float, float] | None:
        """``(t_begin, t_golive_start, t_golive_end, t_end)`` of update ``version`` (wall clock,
        seconds), None when not known here."""
        key = KEY_T_BEGIN.format(v=version)
        if not self.store.check([key]):
            return None
        t_begin = control.get(self.store, key)
        if self._server is not None:
            g = next((g for g in self._server.golives if g["version"] == version), None)
            return None if g is None else (t_begin, g["t0"], g["t1"], g["t1"])
        p = self.pauses.get(version)
        return None if p is None else (t_begin, p[1], p[1], p[1])

    def replay_check(self, version: int, oracle) -> tuple[int, int]:
        """Recompute the load's sampled steps (every n-th step and the first under each new
        label) from the oracle engine of the version each carries: ``oracle`` (an engine that
        loaded ``version``'s checkpoint) is kept with the previous version's, and every sample
        labelled with one of them not checked before is replayed. Returns (samples replayed,
        samples whose output tokens differ): a step computed with other weights than its label
        says is a replay error."""
        from weight_transfer.engines.generate import replay

        self._oracles[version] = oracle.named_parameters()
        for old in sorted(self._oracles)[:-2]:
            del self._oracles[old]
        n = bad = 0
        for smp in self.load.snapshot()["samples"]:
            key = (smp["step"], smp["label"])
            if smp["label"] not in self._oracles or key in self._checked:
                continue
            self._checked.add(key)
            n += 1
            bad += replay(self._oracles[smp["label"]], smp) != list(smp["tokens_out"])
        return n, bad

    def stats(self, version: int, oracle=None) -> dict:
        """The stall columns of update ``version`` (:data:`SERVE_COLUMNS`), from the steps the
        load recorded so far; waits up to 10 s for a paused update's window (the pause watcher
        records it once it sees the resume) and up to 2 s for the first step after the go-live. With
        ``oracle`` (the verification's engine of ``version``) also ``replayed`` /
        ``replay_errors`` (:meth:`replay_check`)."""
        out = {"shadow": self.shadow.mode if self.shadow is not None else "off", "gen_load": self.serve.gen_load,
               "shadow_extra_bytes": self.shadow.extra_bytes if self.shadow is not None else 0}
        if self._server is not None:
            g = next((g for g in self._server.golives if g["version"] == version), None)
            out["golive_s"] = g["seconds"] if g else None
        if self.load is None:
            return out
        w = self.window(version)
        deadline = time.time() + 10.0  # a paused update's window is recorded by the watcher thread once it
        while (w is None and self._server is None and time.time() < deadline  # saw the resume: on a loaded
               and self.store.check([f"step/{version}/pause"])):  # machine it may trail the update's end
            time.sleep(0.005)
            w = self.window(version)
        if w is None:
            return out
        from .stall import between_stats, label_errors, update_stall

        deadline = time.time() + 2.0
        while time.time() < deadline and not any(s[0] >= w[3] for s in self.load.snapshot()["steps"][-50:]):
            time.sleep(0.005)
        steps = self.load.snapshot()["steps"]
        win = (version, *w)
        st = update_stall(steps, win)
        out.update({k: st[k] for k in ("stall_s", "golive_gap_s", "max_gap_during_s", "tok_s_during") if k in st})
        bt = between_stats(steps, self._windows())
        out.update({k: bt[k] for k in ("max_gap_between_s", "tok_s_between") if k in bt})
        out["label_errors"] = len(label_errors(steps, [win]))
        if oracle is not None:
            out["replayed"], out["replay_errors"] = self.replay_check(version, oracle)
        return out

    def _windows(self) -> list[tuple]:
        """Every known update window, for the between-updates statistics."""
        out = []
        for v in sorted(set(self.pauses) | {g["version"] for g in (self._server.golives if self._server else [])}):
            w = self.window(v)
            if w is not None:
                out.append((v, *w))
        return out

    def stop(self) -> dict | None:
        """Stop the load and the threads; returns the load's snapshot (None without a load)."""
        self._stop.set()
        snap = None
        if self.load is not None:
            self.load.stop()
            snap = self.load.snapshot()
        if self._watcher is not None:
            self._watcher.join(2.0)
        return snap


def before_update(store, serve, step: int, n_infer: int, timeout: float, liveness=None) -> None:
    """The controller, before update ``step``'s first byte moves: record the window's start
    and, for the pause-based update with a load, pause every engine and wait for each one's
    acknowledgement (ControlError naming the ranks that did not pause within ``timeout``)."""
    control.put(store, KEY_T_BEGIN.format(v=step), time.time())
    if serve.gen_load and serve.shadow == "off":
        store.set(f"step/{step}/pause", b"1")
        control.wait_keys(store, {i: f"step/{step}/paused/{i}" for i in range(n_infer)}, timeout=timeout,
                          what=f"engines paused for step {step}", liveness=liveness)


def after_update(store, serve, step: int) -> None:
    """The controller, once update ``step`` completed or failed: resume paused engines."""
    if serve.gen_load and serve.shadow == "off":
        store.set(f"step/{step}/resume", b"1")


def serve_columns(verified: dict) -> dict:
    """The row's serving columns from the inference ranks' verification reports (each with a
    ``"serve"`` dict from :meth:`StandInServing.stats`): the largest stall and gaps over ranks,
    the smallest tokens/s, summed label errors, the largest shadow. {} when none reported."""
    reps = [v["serve"] for v in verified.values() if isinstance(v, dict) and v.get("serve")]
    if not reps:
        return {}
    out = {"shadow": reps[0]["shadow"], "gen_load": reps[0]["gen_load"]}
    for k in ("stall_s", "golive_s", "golive_gap_s", "max_gap_during_s", "max_gap_between_s", "shadow_extra_bytes"):
        vals = [r[k] for r in reps if r.get(k) is not None]
        out[k] = max(vals) if vals else None
    for k in ("tok_s_during", "tok_s_between"):
        vals = [r[k] for r in reps if r.get(k) is not None]
        out[k] = min(vals) if vals else None
    for k in ("label_errors", "replayed", "replay_errors"):
        out[k] = sum(int(r.get(k) or 0) for r in reps)
    return out


def _f(x, spec: str) -> str:
    return format("-", ">" + spec.split(".")[0]) if x is None or x != x else format(x, spec)


def serve_lines(rows: list[dict]) -> list[str]:
    """The report's serving block (rows with :func:`serve_columns`): per update the engine's
    stall, the go-live, the longest inter-step gap during the update and between updates,
    tokens/s during and between, label errors; then the p50 stall against the p50 update and the
    shadow's memory. [] when no row has them."""
    have = [r for r in rows if r.get("shadow") is not None and r.get("outcome") != "failed"]
    if not have:
        return []
    r0 = have[0]
    how = {"off": "pause-based: generation paused for the whole update", "flip": "shadow targets, flip",
           "copy": "shadow targets, copy"}[r0["shadow"]]
    load = (f"generation load {r0.get('gen_load', 0)} concurrent requests, the engine's steps timestamped in the engine"
            if r0.get("gen_load") else "no generation load: --gen-load N to measure the stall")
    out = ["#", f"# serving through the updates ({how}; {load}); stall: the longest idle gap between two engine "
                "steps overlapping the update; gap: the longest step-start to step-start interval:",
           f"# {'step':>4} {'stall':>9} {'go-live':>9} {'gap during':>11} {'gap between':>12} {'tok/s during':>13} "
           f"{'tok/s between':>14} {'label errors':>13}",
           f"# {'':>4} {'(s)':>9} {'(s)':>9} {'(s, max)':>11} {'(s, max)':>12} {'':>13} {'':>14} {'':>13}"]
    for r in have:
        out.append(f"# {r['step']:>4} {_f(r.get('stall_s'), '9.4f')} {_f(r.get('golive_s'), '9.4f')} "
                   f"{_f(r.get('max_gap_during_s'), '11.4f')} {_f(r.get('max_gap_between_s'), '12.4f')} "
                   f"{_f(r.get('tok_s_during'), '13.0f')} {_f(r.get('tok_s_between'), '14.0f')} "
                   f"{r.get('label_errors', 0):>13}" + ("  (warmup)" if r.get("warmup") else ""))
    rep = sum(int(r.get("replayed") or 0) for r in have)
    if rep:
        bad = sum(int(r.get("replay_errors") or 0) for r in have)
        out.append(f"# sampled steps recomputed from the oracle weights of the version they were labelled with: "
                   f"{rep - bad}/{rep} equal" + ("" if not bad else "  <-- a step computed with other weights"))
    meas = [r for r in have if not r.get("warmup") and r.get("stall_s") is not None]
    if meas:
        import statistics

        st, up = statistics.median(r["stall_s"] for r in meas), statistics.median(r["seconds"] for r in meas)
        out.append(f"# stall p50 {st:.4f} s over {len(meas)} measured update(s) = {100 * st / up:.1f}% of the update's "
                   f"p50 {up:.4f} s")
    if r0.get("shadow") != "off":
        out.append(f"# shadow: {r0.get('shadow_extra_bytes', 0) / 1e6:.1f} MB extra per inference rank")
    return out
