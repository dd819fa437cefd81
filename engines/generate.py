"""A generation load for the stand-in engine: measures the **stall** a weight update causes.

An RL fleet pays for a weight update in the time its inference engines do not generate. To
measure that time, :class:`GenerationLoad` keeps an engine busy the way serving does: a thread
runs **engine steps** back to back, each one computing the next token of ``n_requests``
concurrent requests greedily from the weights the engine holds *at that moment*. Each step holds
the caller's ``lock`` (the one a go-live also takes), so a go-live always falls between two
steps; the log of step times (``time.time()``, seconds, comparable across processes of one host)
is what ``experiments/stall.py`` turns into stall seconds and tokens/s.

One step (the same math in :func:`step_tokens`, which :func:`replay` calls):

    h      = embed_tokens.weight[tokens].float()                    # [n_requests, hidden]
    h      = h * rsqrt(mean(h**2) + 1e-6) * norm.weight.float()     # RMSNorm by model.norm.weight
    logits = h @ lm_head.weight[:vocab_rows].float().T              # lm_head = embed_tokens if tied
    next   = argmax(logits, -1)                                     # tokens in [0, vocab_rows)

``vocab_rows`` bounds the cost: the default :data:`DEFAULT_VOCAB_ROWS` = 2048 rows keeps a step
at about 1-2 ms on one CPU core at the main job's sizes (hidden 2048, 75,968 local vocab rows
per TP=2 rank of the 151,936-token vocabulary); the float32 copy of the lm_head rows is made in
blocks of :data:`BLOCK_ROWS` so it stays in cache. Token ids are *local* rows of the engine's
vocabulary shard (a request's tokens never leave ``[0, vocab_rows)``).

Example::

    lock, version = threading.Lock(), [0]
    load = GenerationLoad(engine.named_parameters, lock, label=lambda: version[0])
    load.start()
    ...                                   # an update writes a shadow copy meanwhile
    with lock:                            # go-live, between two steps
        engine.arena.copy_(new_bytes)
        version[0] = 1
    ...
    load.stop()
    log = load.snapshot()                 # {"steps": [[t_start, t_end, label, n_tokens], ...], ...}

Every token is checkable: a bounded sample of steps keeps its input tokens, output tokens and
label, and :func:`replay` recomputes a sample from any version's tensors (an oracle engine's),
so a checker can tell which weights a step really used (bit-exact on one host with the same
torch build; argmax hides float differences except at exact ties).
"""
from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable, Mapping

import torch

DEFAULT_VOCAB_ROWS = 2048
"""lm_head rows scored per step by default: about 1-2 ms per step on one CPU core at hidden
size 2048 (the main job's). ``vocab_rows=None`` takes this, capped at the engine's local rows."""
BLOCK_ROWS = 1024
"""lm_head rows converted to float32 at a time (1024 x 2048 x 4 bytes = 8 MiB stays in cache;
converting 4096 rows at once is ~10x slower per row here)."""
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
NORM = "model.norm.weight"
RMS_EPS = 1e-6
SAMPLE_EVERY = 50
"""Every this many-th engine step (step 0, 50, 100, ...) is kept as a sample for :func:`replay`."""
MAX_SAMPLES = 200
"""At most this many samples are kept (the latest ones; the first step under each new label is
sampled too, besides every :data:`SAMPLE_EVERY`-th)."""


def head_of(params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The output projection a step scores with: ``lm_head.weight``, or the embedding when the
    model ties them (vLLM registers no ``lm_head.weight`` then)."""
    return params[LM_HEAD] if LM_HEAD in params else params[EMBED]


def default_vocab_rows(params: Mapping[str, torch.Tensor]) -> int:
    """:data:`DEFAULT_VOCAB_ROWS`, capped at the local rows of the embedding and the head."""
    return min(DEFAULT_VOCAB_ROWS, params[EMBED].shape[0], head_of(params).shape[0])


def step_tokens(params: Mapping[str, torch.Tensor], tokens: torch.Tensor, vocab_rows: int) -> torch.Tensor:
    """One engine step: the greedy next token of each request from ``params`` (the module
    docstring's math). ``tokens``: int64 ``[n_requests]`` local vocabulary rows; returns int64
    ``[n_requests]`` in ``[0, vocab_rows)``. Pure: reads ``params``, writes nothing of them."""
    emb, head = params[EMBED], head_of(params)
    if not 0 < vocab_rows <= min(emb.shape[0], head.shape[0]):
        raise ValueError(f"vocab_rows={vocab_rows} outside 1..{min(emb.shape[0], head.shape[0])} (local vocab rows)")
    h = emb[tokens].float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    if NORM in params:
        h = h * params[NORM].float()
    logits = torch.empty(h.shape[0], vocab_rows, dtype=torch.float32)
    for a in range(0, vocab_rows, BLOCK_ROWS):
        b = min(a + BLOCK_ROWS, vocab_rows)
        torch.mm(h, head[a:b].float().T, out=logits[:, a:b])
    return logits.argmax(-1)


def replay(params: Mapping[str, torch.Tensor], sample: Mapping) -> list[int]:
    """Recompute a sampled step (an entry of ``snapshot()["samples"]``) from ``params`` (e.g.
    an oracle engine's tensors of one version): the output tokens that version's weights give
    for the sample's input tokens. Equal to ``sample["tokens_out"]`` iff the step used them
    (up to argmax ties)."""
    tokens = torch.tensor(sample["tokens_in"], dtype=torch.int64)
    return step_tokens(params, tokens, int(sample["vocab_rows"])).tolist()


class _Request:
    """One request in flight: its id, prompt token and ``[label, n_tokens]`` spans."""

    __slots__ = ("id", "prompt", "first_step", "spans", "produced")

    def __init__(self, rid: int, prompt: int, first_step: int):
        self.id, self.prompt, self.first_step = rid, prompt, first_step
        self.spans: list[list] = []
        self.produced = 0

    def add(self, label) -> None:
        if self.spans and self.spans[-1][0] == label:
            self.spans[-1][1] += 1
        else:
            self.spans.append([label, 1])
        self.produced += 1

    def record(self, done: bool) -> dict:
        return {"id": self.id, "prompt": self.prompt, "first_step": self.first_step,
                "spans": [list(s) for s in self.spans], "n_tokens": self.produced, "done": done}


class GenerationLoad:
    """A thread of engine steps over the weights ``get_params()`` returns at each step.

    ``get_params``: returns ``{vLLM name: tensor}`` the engine computes with *now* (e.g.
    ``engine.named_parameters``; may be re-pointed between steps). ``lock``: held for every
    step; a go-live that takes it falls between two steps. ``n_requests`` concurrent requests of
    ``max_tokens`` tokens each; a finished request is replaced by a new one whose prompt token
    comes from ``random.Random(seed)``. ``label()``: the version the engine serves, read while
    holding ``lock`` at each step (default: ``None``). ``vocab_rows``: lm_head rows scored (see
    :data:`DEFAULT_VOCAB_ROWS`). Samples: every ``sample_every``-th step, at most
    ``max_samples``.

    Records per step ``(t_start, t_end, label, n_tokens)``: ``t_start`` once ``lock`` is held,
    ``t_end`` before it is released (``time.time()``, seconds), ``n_tokens`` = ``n_requests``.
    """

    def __init__(self, get_params: Callable[[], Mapping[str, torch.Tensor]], lock, *, n_requests: int = 4,
                 max_tokens: int = 64, label: Callable[[], object] | None = None, seed: int = 0,
                 vocab_rows: int | None = None, sample_every: int = SAMPLE_EVERY, max_samples: int = MAX_SAMPLES):
        if n_requests < 1 or max_tokens < 1 or sample_every < 1:
            raise ValueError(f"n_requests={n_requests}, max_tokens={max_tokens}, sample_every={sample_every}: need >= 1")
        self._get_params, self._lock = get_params, lock
        self.n_requests, self.max_tokens = n_requests, max_tokens
        self._label = label or (lambda: None)
        self._rng = random.Random(seed)
        self.vocab_rows = vocab_rows
        self.sample_every, self.max_samples = sample_every, max_samples
        self._steps: list[tuple[float, float, object, int]] = []
        self._samples: collections.deque = collections.deque(maxlen=max_samples)  # the latest ones
        self._done: list[dict] = []
        self._requests: list[_Request] = []
        self._tokens: torch.Tensor | None = None
        self._next_id = 0
        self._pauses: list[list[float]] = []
        self._record = threading.Lock()     # guards the records against snapshot()
        self._cv = threading.Condition()    # pause / in-step / stop
        self._paused = self._in_step = self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        """The exception that ended the step loop, if one did."""

    # ---- requests ---------------------------------------------------------------------------
    def _new_request(self, step: int) -> _Request:
        r = _Request(self._next_id, self._rng.randrange(self.vocab_rows), step)
        self._next_id += 1
        return r

    def _ensure_requests(self, params: Mapping[str, torch.Tensor]) -> None:
        if self._tokens is not None:
            return
        if self.vocab_rows is None:
            self.vocab_rows = default_vocab_rows(params)
        self._requests = [self._new_request(0) for _ in range(self.n_requests)]
        self._tokens = torch.tensor([r.prompt for r in self._requests], dtype=torch.int64)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> tuple[float, float, object, int]:
        """Run one engine step now (holding ``lock``) and record it; returns the step's record
        ``(t_start, t_end, label, n_tokens)``. The thread calls this in a loop; a caller may
        drive steps itself instead of :meth:`start`."""
        with self._lock:
            t0 = time.time()
            label = self._label()
            params = self._get_params()
            self._ensure_requests(params)
            tokens_in = self._tokens
            out = step_tokens(params, tokens_in, self.vocab_rows)
            t1 = time.time()
        self._account(t0, t1, label, tokens_in, out)
        return t0, t1, label, len(out)

    def _account(self, t0: float, t1: float, label, tokens_in: torch.Tensor, out: torch.Tensor) -> None:
        """Book-keeping after a step (outside ``lock``): step log, spans, sample, replaced
        requests, the next step's input tokens."""
        with self._record:
            i = len(self._steps)
            self._steps.append((t0, t1, label, len(out)))
            first_of_label = bool(self._steps[-2:-1]) and self._steps[-2][2] != label if i else False
            if i % self.sample_every == 0 or first_of_label:  # every n-th step and the first under a new label
                self._samples.append({"step": i, "label": label, "t_start": t0, "t_end": t1,
                                      "tokens_in": tokens_in.tolist(), "tokens_out": out.tolist(),
                                      "vocab_rows": self.vocab_rows})
            nxt = out.clone()
            for j, r in enumerate(self._requests):
                r.add(label)
                if r.produced >= self.max_tokens:
                    self._done.append(r.record(True))
                    self._requests[j] = self._new_request(i + 1)
                    nxt[j] = self._requests[j].prompt
            self._tokens = nxt

    # ---- the thread -------------------------------------------------------------------------
    def start(self) -> GenerationLoad:
        """Start the step loop in a daemon thread; returns self."""
        if self._thread is not None:
            raise RuntimeError("GenerationLoad already started")
        self._thread = threading.Thread(target=self._loop, name="generation-load", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while self._paused and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        return
                    self._in_step = True
                try:
                    self.step()
                finally:
                    with self._cv:
                        self._in_step = False
                        self._cv.notify_all()
                time.sleep(0)  # let a thread waiting for ``lock`` (a go-live) take it
        except BaseException as e:  # recorded; stop() re-raises
            self.error = e

    def stop(self, timeout: float = 5.0, *, check: bool = True) -> bool:
        """Stop the loop and join the thread for at most ``timeout`` seconds; True once it has
        ended. ``check``: re-raise (RuntimeError) an exception that ended the loop."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        ended = True
        if self._thread is not None:
            self._thread.join(timeout)
            ended = not self._thread.is_alive()
        if check and self.error is not None:
            raise RuntimeError(f"generation load failed: {self.error!r}") from self.error
        return ended

    @property
    def running(self) -> bool:
        """The thread is alive (paused counts as running)."""
        return self._thread is not None and self._thread.is_alive()

    def pause(self, timeout: float = 10.0) -> float:
        """Stop stepping (the pause-based comparison): returns once no step is running (it waits
        for the current one), the ``time.time()`` of that moment. Raises TimeoutError after
        ``timeout`` seconds (e.g. when called while holding ``lock`` during a step)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            self._paused = True
            while self._in_step:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"a step is still running after {timeout} s (is lock held by the caller?)")
                self._cv.wait(left)
            t = time.time()
        with self._record:
            self._pauses.append([t, float("nan")])
        return t

    def resume(self) -> float:
        """Start stepping again after :meth:`pause`; returns the ``time.time()`` of the resume."""
        with self._cv:
            self._paused = False
            t = time.time()
            self._cv.notify_all()
        with self._record:
            if self._pauses and self._pauses[-1][1] != self._pauses[-1][1]:  # NaN: open pause
                self._pauses[-1][1] = t
        return t

    # ---- results ----------------------------------------------------------------------------
    @property
    def n_steps(self) -> int:
        """Steps run so far."""
        return len(self._steps)

    def snapshot(self) -> dict:
        """The records so far as plain, picklable data (safe while the loop runs):

        - ``steps``: ``[[t_start, t_end, label, n_tokens], ...]`` (seconds, ``time.time()``);
        - ``requests``: per request ``{id, prompt, first_step, spans: [[label, n_tokens], ...],
          n_tokens, done}``, finished ones first, then those in flight (``done`` False);
        - ``samples``: ``{step, label, t_start, t_end, tokens_in, tokens_out, vocab_rows}``
          (for :func:`replay`);
        - ``pauses``: ``[[t_pause, t_resume], ...]`` (``t_resume`` NaN while paused);
        - ``n_requests``, ``max_tokens``, ``vocab_rows``, ``error`` (repr or None).
        """
        with self._record:
            return {"steps": [list(s) for s in self._steps],
                    "requests": [dict(r, spans=[list(s) for s in r["spans"]]) for r in self._done]
                    + [r.record(False) for r in self._requests],
                    "samples": [dict(s, tokens_in=list(s["tokens_in"]), tokens_out=list(s["tokens_out"]))
                                for s in self._samples],
                    "pauses": [list(p) for p in self._pauses],
                    "n_requests": self.n_requests, "max_tokens": self.max_tokens, "vocab_rows": self.vocab_rows,
                    "error": None if self.error is None else repr(self.error)}
