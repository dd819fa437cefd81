"""Baseline 2: per-tensor RPC ``update_weight()`` (vLLM's ``collective_rpc("update_weight",
args=(name, dtype, shape))`` driven by OpenRLHF / TRL / verl's simple path; SGLang's
``update_weights_from_tensor``), with the data carried in the RPC itself.

Setup, once: each inference worker binds a ZeroMQ ``REP`` socket on ``127.0.0.1`` (a random
port) and publishes its endpoint in its setup payload; the controller hands training rank 0
the endpoints, which connects one ``DEALER`` socket per worker.

Messages are data, never pickles: a request is ``[header, data]``, the header msgpack
(``msgspec``) decoded strictly into :class:`Request` (unknown fields, wrong types refused), the
data the tensor's raw bytes (dtype and shape in the header); a reply is msgpack decoded into
:class:`Reply`. Encoding a header costs about what pickling it did (a few microseconds); the
tensor's bytes are never copied into the message.

Per update, on "go", for every parameter in order:

1. every training rank calls ``full_tensor()``; only training rank 0 keeps the result
   (:func:`weight_transfer.baselines.common.gather_to_rank0`);
2. training rank 0 calls ``update_weight`` on *every* worker: one request per worker,
   ``[header, data]`` with header ``{op: "load", name, dtype, shape, id}`` and the tensor's
   bytes (sent zero-copy), then waits for every reply with a deadline (``zmq.Poller``);
3. the worker rebuilds the tensor from the message, calls its engine's ``load_weights`` and
   replies ``{ok, id}`` -- or ``{ok: False, error}`` naming itself and the tensor.

After the last tensor an explicit ``finish`` RPC makes every worker run
``process_weights_after_loading`` (FP8 re-quantization); the worker then reports done and the
controller publishes the version.

Errors. A worker-side exception comes back as an error reply; a worker that does not answer
within the RPC timeout (dead or hung) is reported by index and endpoint. Either way training
rank 0 stops sending, tells every worker to ``abort`` the update (best effort), keeps taking
part in the remaining ``full_tensor()`` collectives so the other training ranks are not left
hanging, and raises :class:`RpcError`; the controller then refuses to publish the version.
"""
from __future__ import annotations

import itertools
import time
import warnings
from typing import Literal

import msgspec
import torch
import zmq

from weight_transfer.control import protocol as control
from weight_transfer.control import wire
from weight_transfer.method import ControllerSide, InferenceSide, TrainerSide
from weight_transfer.types import torch_dtype

from .common import (
    BaselineStats,
    as_bytes,
    endpoint_descriptor,
    endpoint_fields,
    gather_to_rank0,
    publish_common,
    read_common,
    rpc_timeout,
)

KEY_ENDPOINTS = "baselines/rpc/endpoints"
wire.register(KEY_ENDPOINTS, dict[int, str], "the RPC baseline's worker endpoints (inference rank -> ZeroMQ endpoint)")


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """An RPC's header: ``load`` (``name``, ``dtype``, ``shape``: the tensor whose raw bytes are
    the request's second frame), ``finish`` (``step``) or ``abort`` (``reason``); ``id`` numbers
    the call (a reply to an earlier, timed-out call is dropped)."""

    op: Literal["load", "finish", "abort"]
    id: int = 0
    name: str = ""
    dtype: str = ""
    shape: tuple[int, ...] = ()
    step: int = 0
    reason: str = ""


class Reply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A worker's answer to the request ``id``: ``ok``, or the ``error`` naming the worker and the tensor."""

    ok: bool
    id: int = 0
    error: str = ""


_ENCODER = msgspec.msgpack.Encoder()
_REQUEST = msgspec.msgpack.Decoder(Request)
_REPLY = msgspec.msgpack.Decoder(Reply)


def _decode(decoder, raw, what: str):
    try:
        return decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise RpcError(f"refused an RPC {what} that is not one: {e}") from None


class RpcError(RuntimeError):
    """An ``update_weight`` RPC failed: an error reply, or no reply in time. The message names
    the worker (index and endpoint) and the tensor."""


class RpcServer:
    """An inference worker's end: a ``REP`` socket bound on ``host`` (random port)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"

    def recv(self, timeout: float, should_stop=None, slice_s: float = 0.5):
        """Next request as ``(header, data frame or None)``, the header a :class:`Request`.
        Raises TimeoutError after ``timeout`` seconds, or RuntimeError when ``should_stop()``
        returns a reason. A header that is not a :class:`Request` is answered with an error
        reply (naming why) and not returned."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no update_weight request within {timeout:.0f} s")
            if self.sock.poll(min(left, slice_s) * 1000, zmq.POLLIN):
                frames = self.sock.recv_multipart(copy=False)
                try:
                    header = _decode(_REQUEST, frames[0].buffer, "request")
                except RpcError as e:
                    self.reply({"ok": False, "error": str(e)})
                    continue
                return header, (frames[1] if len(frames) > 1 else None)
            if should_stop is not None and (why := should_stop()):
                raise RuntimeError(why)

    def reply(self, obj: dict) -> None:
        """Answer the last request: ``obj`` has :class:`Reply`'s fields."""
        self.sock.send(_ENCODER.encode(Reply(**obj)))

    def close(self) -> None:
        self.sock.close(linger=0)


class RpcClient:
    """Training rank 0's end: one ``DEALER`` per worker, ``call`` = the same request to every
    worker, wait for all replies (``collective_rpc``)."""

    def __init__(self, endpoints: dict[int, str], timeout: float):
        self.ctx = zmq.Context.instance()
        self.endpoints = dict(sorted(endpoints.items()))
        self.timeout = timeout
        self.socks = {}
        self.poller = zmq.Poller()
        for i, ep in self.endpoints.items():
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            self.socks[i] = s
            self.poller.register(s, zmq.POLLIN)
        self._ids = itertools.count(1)

    def _what(self, header: Request) -> str:
        return f"update_weight({header.name!r})" if header.op == "load" else f"{header.op} RPC"

    def call(self, header: dict, data=None, *, timeout: float | None = None) -> dict[int, dict]:
        """Send ``[header, data]`` to every worker (``header``: :class:`Request`'s fields but
        ``id``), wait for every reply. Returns ``{worker: reply}`` (:class:`Reply`'s fields as a
        dict); raises :class:`RpcError` naming the workers that replied with an error or did not
        reply within ``timeout`` seconds."""
        timeout = self.timeout if timeout is None else timeout
        rid = next(self._ids)
        header = Request(**header, id=rid)
        hb = _ENCODER.encode(header)
        what = self._what(header)
        frames = [b"", hb] + ([data] if data is not None else [])
        for i, s in self.socks.items():
            try:
                s.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                raise RpcError(f"{what}: cannot queue the request for inference worker {i} at {self.endpoints[i]} "
                               f"(send buffer full: worker not consuming)") from None
        pending, replies = set(self.socks), {}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RpcError(f"{what}: no reply from inference worker(s) "
                               + ", ".join(f"{i} at {self.endpoints[i]}" for i in sorted(pending))
                               + f" within {timeout:.1f} s (worker dead or hung)")
            ready = dict(self.poller.poll(left * 1000))
            for i in sorted(pending):
                if self.socks[i] not in ready:
                    continue
                while True:
                    try:
                        fr = self.socks[i].recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        rep = _decode(_REPLY, fr[-1], f"reply from inference worker {i} at {self.endpoints[i]}")
                    except RpcError as e:
                        raise RpcError(f"{what}: {e}") from None
                    if rep.id == rid:  # replies to earlier, timed-out calls are dropped
                        replies[i] = msgspec.structs.asdict(rep)
                        pending.discard(i)
                        break
        bad = {i: r for i, r in replies.items() if not r["ok"]}
        if bad:
            raise RpcError(f"{what}: " + "; ".join(f"inference worker {i} at {self.endpoints[i]} replied with an error: "
                                                   f"{r.get('error')}" for i, r in sorted(bad.items())))
        return replies

    def abort(self, reason: str, timeout: float = 2.0) -> None:
        """Best effort: tell every worker to drop this update (ignores workers that are gone)."""
        try:
            self.call({"op": "abort", "reason": reason}, timeout=timeout)
        except RpcError:
            pass

    def close(self) -> None:
        for s in self.socks.values():
            s.close(linger=0)


class RpcController(ControllerSide):
    """Publishes the ordered parameter list, the landed byte count and the workers' endpoints."""

    def setup(self, ctx) -> str:
        entries, landed = publish_common(ctx)
        endpoints = {i: endpoint_fields(desc)["endpoint"] for i, (desc, _) in ctx.infer_payloads.items()}
        control.put(ctx.store, KEY_ENDPOINTS, endpoints)
        n = len(endpoints)
        wire = sum(e.nbytes for e in entries) * n
        return (f"rpc update_weight: {len(entries)} tensors x {n} worker(s) = {len(entries) * n} RPCs + finish over "
                f"ZeroMQ; {landed / 1e9:.3f} GB lands, {wire / 1e9:.3f} GB on the wire; "
                f"timeout {rpc_timeout(ctx.method_options, ctx.transfer.control.timeout):.0f} s per RPC")


class RpcTrainer(TrainerSide):
    """Every rank gathers; rank 0 issues one ``update_weight`` RPC per tensor to every worker."""

    def setup(self, ctx) -> None:
        self.ctx, self.rank = ctx, ctx.rank
        self.client = None
        self.entries = None
        if self.rank == 0:
            control.wait_keys(ctx.store, {0: KEY_ENDPOINTS}, timeout=max(ctx.transfer.control.timeout, 600.0), what="rpc endpoints")
            eps = control.get(ctx.store, KEY_ENDPOINTS)
            self.client = RpcClient(eps, timeout=rpc_timeout(ctx.method_options, ctx.transfer.control.timeout))
            ctx.log(f"rpc: connected to {len(eps)} worker(s): {', '.join(eps.values())}")

    def transfer(self, step: int) -> BaselineStats:
        t0 = time.perf_counter()
        if self.entries is None:
            self.entries, self.landed = read_common(self.ctx.store, timeout=self.ctx.transfer.control.timeout)
        st = BaselineStats(rank=self.rank)
        error = None
        for e, full in gather_to_rank0(self.ctx.params, self.entries, self.rank):
            st.peak_temp_bytes = max(st.peak_temp_bytes, e.nbytes)
            if self.rank != 0 or error is not None:
                continue  # still take part in every full_tensor() collective
            data = as_bytes(full)
            try:
                self.client.call({"op": "load", "name": e.name, "dtype": e.dtype, "shape": tuple(full.shape)},
                                 memoryview(data.numpy()) if data.numel() else b"")
            except RpcError as x:
                error = x
                continue
            st.n_writes += len(self.client.socks)
            st.wire_bytes += e.nbytes * len(self.client.socks)
        if self.rank == 0:
            if error is None:
                try:
                    self.client.call({"op": "finish", "step": step})
                    st.n_writes += len(self.client.socks)
                except RpcError as x:
                    error = x
            if error is not None:
                self.client.abort(str(error))
                raise error
            st.wire_bytes += sum(e.nbytes for e in self.entries if e.lead != 0)
            st.bytes_sent = self.landed
        st.seconds = time.perf_counter() - t0
        return st

    def teardown(self) -> None:
        if self.client is not None:
            self.client.close()


def tensor_from_frame(frame, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor an ``update_weight`` request carries (a view of the message, no copy)."""
    dt = torch_dtype(dtype)
    if frame is None or len(frame.buffer) == 0:
        return torch.empty(shape, dtype=dt)
    with warnings.catch_warnings():  # the message buffer is read-only; load_weights only reads it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(frame.buffer, dtype=torch.uint8)
    return flat.view(dt).view(shape)


class RpcInference(InferenceSide):
    """Serves ``update_weight`` / ``finish`` / ``abort`` requests during each update."""

    active = True

    def setup(self, ctx):
        self.ctx, self.engine = ctx, ctx.engine
        self.server = RpcServer()
        self.wait_timeout = max(float(ctx.transfer.control.timeout), 60.0)
        ctx.log(f"rpc: serving update_weight at {self.server.endpoint}")
        return (endpoint_descriptor("rpc", endpoint=self.server.endpoint, worker=f"infer {ctx.rank}"),
                ctx.engine.tensor_metas())

    def _stop_reason(self):
        store = self.ctx.store
        if store.check(["abort"]):
            return f"infer {self.ctx.rank}: trial aborted: {control.get_text(store, 'abort')}"
        if store.check(["shutdown"]):
            return f"infer {self.ctx.rank}: trial shut down during an update"
        return None

    def receive(self, step: int) -> dict:
        me = f"infer {self.ctx.rank}"
        n_tensors, nbytes, first_error = 0, 0, None
        while True:
            header, frame = self.server.recv(self.wait_timeout, should_stop=self._stop_reason)
            op, rid = header.op, header.id
            if op == "load":
                name = header.name
                try:
                    t = tensor_from_frame(frame, header.dtype, header.shape)
                    self.engine.load_weights([(name, t)])
                    n_tensors += 1
                    nbytes += t.nbytes
                    self.server.reply({"ok": True, "id": rid})
                except Exception as e:
                    msg = f"{me}: load_weights({name!r}) failed: {type(e).__name__}: {e}"
                    first_error = first_error or msg
                    self.server.reply({"ok": False, "id": rid, "error": msg})
            elif op == "finish":
                try:
                    if header.step != step:
                        raise RuntimeError(f"finish for step {header.step}, this update is step {step}")
                    if first_error:
                        raise RuntimeError(f"earlier error: {first_error}")
                    self.engine.process_weights_after_loading()
                except Exception as e:
                    msg = f"{me}: finish failed: {type(e).__name__}: {e}"
                    self.server.reply({"ok": False, "id": rid, "error": msg})
                    raise RuntimeError(msg) from e
                self.server.reply({"ok": True, "id": rid})
                return {"tensors": n_tensors, "bytes_received": nbytes}
            elif op == "abort":
                self.server.reply({"ok": True, "id": rid})
                raise RuntimeError(f"{me}: update {step} aborted by training rank 0: {header.reason}")
            else:
                self.server.reply({"ok": False, "id": rid, "error": f"{me}: unknown op {op!r}"})

    def teardown(self) -> None:
        self.server.close()
