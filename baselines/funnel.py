"""Baseline 1: the rank-0 funnel (what open RL frameworks ship as "update weights from
distributed": OpenRLHF's ``broadcast_to_vllm``, verl / slime / SGLang's
``update_weights_from_distributed``).

Setup, once: training rank 0 and every inference rank join one *update group*, a process
group of ``1 + n_infer`` ranks that spans the two jobs (training rank 0 is group rank 0,
inference rank ``i`` is group rank ``1 + i``). Like the frameworks (who build it with a copy
of ``init_process_group`` or a stateless group), it is created from the controller's store
under its own prefix, independent of the training world's default group: a
``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` when the parameters live on a GPU.

Per update, on "go":

1. every training rank walks the same ordered parameter list and calls ``full_tensor()``
   (a collective over the parameter's DeviceMesh); only training rank 0 keeps the result
   (:func:`weight_transfer.baselines.common.gather_to_rank0`);
2. rank 0 packs the gathered tensors, in order, into flat buckets of at most
   :data:`~weight_transfer.baselines.common.DEFAULT_BUCKET_BYTES` (512 MiB, like the frameworks; a larger
   tensor travels alone), after broadcasting the step's manifest (name, shape, dtype, offset
   per tensor of each bucket -- what the frameworks send as the ``names, dtypes, shapes`` of
   their update call), as data: msgpack (``msgspec``), decoded strictly into
   :class:`Manifest` on the inference ranks (nothing received is unpickled);
3. each bucket is broadcast from group rank 0 (training rank 0) to every inference rank. All
   bytes leave through training rank 0's one link: Gloo/NCCL route the broadcast through the
   inference ranks (inference rank 0 first), which is the "funnel";
4. every inference rank unpacks the bucket into views and calls the engine's own
   ``load_weights`` on them (fused projections, TP/EP slicing and FP8 staging happen on the
   inference side), then ``process_weights_after_loading`` after the last bucket (FP8
   re-quantization), and reports done. Only then does the controller publish the version.

A failing ``load_weights`` on an inference rank does not leave the collective: the rank keeps
receiving the remaining buckets (so training rank 0 is not left hanging in a broadcast), then
raises, so the controller reports the rank and does not publish the version.
"""
from __future__ import annotations

import time
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from weight_transfer.method import ControllerSide, InferenceSide, TrainerSide

from .common import (
    BaselineStats,
    BucketItem,
    as_bytes,
    bucket_bytes,
    bucket_size,
    endpoint_descriptor,
    from_bytes,
    gather_to_rank0,
    plan_buckets,
    publish_common,
    read_common,
)

GROUP_PREFIX = "baselines/funnel/update_group"


def make_update_group(store, rank: int, size: int, *, timeout: float, device: str = "cpu"):
    """The cross-job update group: ``size = 1 + n_infer`` ranks rendezvousing on ``store``
    under :data:`GROUP_PREFIX`. Blocks until every member constructed it."""
    prefix = dist.PrefixStore(GROUP_PREFIX, store)
    if device.startswith("cuda"):  # pragma: no cover - GPU clusters
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(prefix, rank, size, opts)
    return dist.ProcessGroupGloo(prefix, rank, size, timedelta(seconds=timeout))


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What training rank 0 broadcasts before an update's buckets: the step and, per bucket, the
    tensors in it (:class:`~weight_transfer.baselines.common.BucketItem`)."""

    step: int
    buckets: list[list[BucketItem]]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Manifest)


class ManifestError(RuntimeError):
    """A broadcast manifest that is not a :class:`Manifest` (refused, naming why)."""


def encode_manifest(manifest: Manifest) -> bytes:
    return _ENCODER.encode(manifest)


def decode_manifest(raw) -> Manifest:
    """``raw`` (msgpack) decoded strictly into a :class:`Manifest`: unknown fields, wrong types
    or arity are a :class:`ManifestError`."""
    try:
        return _DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ManifestError(f"funnel: refused a manifest that is not one: {e}") from None


def _broadcast_manifest(pg, manifest: Manifest | None, *, root: int = 0, device="cpu") -> Manifest:
    """Broadcast ``manifest`` from ``root`` (``None`` on the other ranks): its length first,
    then its msgpack bytes. Returns the manifest on every rank."""
    if manifest is not None:
        data = torch.frombuffer(bytearray(encode_manifest(manifest)), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    n = n.to(device)
    pg.broadcast(n, root).wait()
    if manifest is None:
        data = torch.empty(int(n.item()), dtype=torch.uint8)
    data = data.to(device)
    pg.broadcast(data, root).wait()
    if manifest is not None:
        return manifest
    return decode_manifest(data.cpu().numpy().tobytes())


class FunnelController(ControllerSide):
    """Publishes the ordered parameter list and the landed byte count once."""

    def setup(self, ctx) -> str:
        entries, landed = publish_common(ctx)
        limit = bucket_bytes(ctx.method_options)
        buckets = plan_buckets(entries, limit)
        payload = sum(bucket_size(b) for b in buckets)
        n_infer = len(ctx.infer_payloads)
        return (f"rank-0 funnel: {len(entries)} tensors in {len(buckets)} bucket(s) of <= {limit / (1 << 20):.0f} MiB, "
                f"broadcast over a {1 + n_infer}-rank update group; {landed / 1e9:.3f} GB lands, "
                f"{payload * n_infer / 1e9:.3f} GB on the wire")


class FunnelTrainer(TrainerSide):
    """Every rank gathers; rank 0 buckets and broadcasts."""

    def setup(self, ctx) -> None:
        self.ctx = ctx
        self.rank = ctx.rank
        self.device = next((p.device.type for p in ctx.params.values()), "cpu")
        self.pg = None
        if self.rank == 0:
            self.pg = make_update_group(ctx.store, 0, 1 + ctx.n_infer, timeout=ctx.transfer.control.timeout, device=self.device)
            ctx.log(f"funnel: joined the update group as rank 0 of {1 + ctx.n_infer}")
        self.entries = None
        self.buf = None

    def _lazy_init(self):
        if self.entries is None:
            self.entries, self.landed = read_common(self.ctx.store, timeout=self.ctx.transfer.control.timeout)
            self.buckets = plan_buckets(self.entries, bucket_bytes(self.ctx.method_options))

    def transfer(self, step: int) -> BaselineStats:
        t0 = time.perf_counter()
        self._lazy_init()
        st = BaselineStats(rank=self.rank)
        gen = gather_to_rank0(self.ctx.params, self.entries, self.rank)
        if self.rank != 0:
            for e, _ in gen:
                st.peak_temp_bytes = max(st.peak_temp_bytes, e.nbytes)
            st.seconds = time.perf_counter() - t0
            return st

        _broadcast_manifest(self.pg, Manifest(step, self.buckets), device=self.device)
        packed = [b for b in self.buckets if len(b) > 1]
        if self.buf is None and packed:
            self.buf = torch.zeros(max(bucket_size(b) for b in packed), dtype=torch.uint8, device=self.device)
        buf_bytes = self.buf.numel() if self.buf is not None else 0
        n_infer = self.ctx.n_infer
        for bucket in self.buckets:
            size = bucket_size(bucket)
            if len(bucket) == 1:  # a tensor alone in its bucket travels without a copy
                e, full = next(gen)
                _check(e.name, bucket[0].name)
                payload = as_bytes(full)
                st.peak_temp_bytes = max(st.peak_temp_bytes, buf_bytes + e.nbytes)
            else:
                for it in bucket:
                    e, full = next(gen)
                    _check(e.name, it.name)
                    self.buf[it.offset:it.offset + it.nbytes].copy_(as_bytes(full))
                    st.peak_temp_bytes = max(st.peak_temp_bytes, buf_bytes + e.nbytes)
                    del full
                payload = self.buf[:size]
            self.pg.broadcast(payload, 0).wait()
            st.n_writes += 1
            st.wire_bytes += size * n_infer
        for _ in gen:  # exhausted by construction; keeps the collective order explicit
            raise RuntimeError("funnel: parameters left over after the last bucket")
        st.wire_bytes += sum(e.nbytes for e in self.entries if e.lead != 0)
        st.bytes_sent = self.landed
        st.seconds = time.perf_counter() - t0
        return st


def _check(got: str, want: str) -> None:
    if got != want:
        raise RuntimeError(f"funnel: gathered {got!r} where the bucket expects {want!r}")


class FunnelInference(InferenceSide):
    """Joins the update group; per update receives every bucket and runs ``load_weights``."""

    active = True

    def setup(self, ctx):
        self.ctx = ctx
        self.engine = ctx.engine
        self.device = str(ctx.engine.arena.device)
        self.pg = make_update_group(ctx.store, 1 + ctx.rank, 1 + ctx.n_infer, timeout=ctx.transfer.control.timeout,
                                    device=self.device)
        ctx.log(f"funnel: joined the update group as rank {1 + ctx.rank} of {1 + ctx.n_infer}")
        self.buf = None
        return (endpoint_descriptor("rank0_funnel", group_rank=1 + ctx.rank), ctx.engine.tensor_metas())

    def receive(self, step: int) -> dict:
        manifest = _broadcast_manifest(self.pg, None, device=self.device)
        if manifest.step != step:
            raise RuntimeError(f"infer {self.ctx.rank}: funnel manifest is for step {manifest.step}, expected {step}")
        buckets = manifest.buckets
        need = max((bucket_size(b) for b in buckets), default=0)
        if self.buf is None or self.buf.numel() < need:
            self.buf = torch.empty(need, dtype=torch.uint8, device=self.device)
        received, error = 0, None
        for k, bucket in enumerate(buckets):
            size = bucket_size(bucket)
            self.pg.broadcast(self.buf[:size], 0).wait()
            received += size
            if error is not None:
                continue  # stay in the collective until the last bucket
            try:
                self.engine.load_weights((it.name, from_bytes(self.buf[it.offset:it.offset + it.nbytes], it.dtype, it.shape))
                                         for it in bucket)
            except Exception as e:
                error = f"infer {self.ctx.rank}: load_weights failed in bucket {k} ({bucket[0].name} ..): {type(e).__name__}: {e}"
        if error is not None:
            raise RuntimeError(error)
        self.engine.process_weights_after_loading()
        return {"bytes_received": received, "buckets": len(buckets)}
