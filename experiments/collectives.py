"""What the RL loop's training ranks send each other over their gloo group
(:mod:`weight_transfer.experiments.rl`, examples/rl_loop.py), as data: :func:`broadcast`,
:func:`all_gather` (a length, then msgpack bytes, decoded strictly into the type the receiver
expects) and :func:`broadcast_rollout` (tensors as :class:`TensorData`: dtype, shape, raw
bytes), in place of torch's ``broadcast_object_list`` / ``all_gather_object``, which unpickle
what they receive. The default process group's backend must take CPU tensors (gloo: the RL
loop's trainers). Files and other messages of the harness: :mod:`weight_transfer.experiments.data`.
"""
from __future__ import annotations

import math

import msgspec

__all__ = ["TensorData", "broadcast", "all_gather", "broadcast_rollout"]


_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
"""The dtypes a :class:`TensorData` may carry (token ids, logprobs, ...)."""


class TensorData(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A CPU tensor as data: dtype name, shape, raw bytes (:meth:`of` / :meth:`tensor`)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, t) -> TensorData:
        import torch

        t = t.detach().cpu().contiguous()
        raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return cls(str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)

    def tensor(self):
        """The tensor (a copy of the bytes); ValueError when dtype, shape and bytes disagree."""
        import torch

        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown tensor dtype {self.dtype!r}; known: {', '.join(_DTYPES)}")
        dt = getattr(torch, self.dtype)
        n = math.prod(self.shape) * dt.itemsize
        if any(d < 0 for d in self.shape) or len(self.data) != n:
            raise ValueError(f"a {self.dtype} tensor of shape {self.shape} is {n} bytes, got {len(self.data)}")
        if n == 0:
            return torch.empty(self.shape, dtype=dt)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(dt).view(self.shape)


class _Rollout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Rank 0's rollout (:func:`rollout`) as :func:`broadcast_rollout` sends it."""

    answers: TensorData
    logprobs: TensorData
    versions: set[tuple[tuple[str | None, int, int], ...]]
    seconds: float


_CheckMsg = tuple[dict[str, str], list[tuple[list[int], list[float]]], bool | None, list[str], int]
"""What each rank of :class:`OracleCheck` contributes: digests by tensor name, greedy outputs
``[(tokens, logprobs)]``, the staging check (None: none), the staging tensors that differ, bytes compared."""


def _decode(raw: bytes, type_, what: str):
    try:
        return msgspec.msgpack.decode(raw, type=type_, strict=True)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"rl: refused {what} that is not a {type_!r}: {e}") from None


def broadcast(obj, src: int = 0, *, type_=list[str] | None):
    """``obj`` of rank ``src`` on every rank of the default group, as data: msgpack (length,
    then bytes; ``obj``: numbers, strings, lists, dicts, msgspec structs), decoded strictly into
    ``type_`` on the other ranks (``src`` keeps ``obj`` as it is). ValueError for bytes that are
    not a ``type_``."""
    from weight_transfer.control.collectives import broadcast_data

    try:
        return broadcast_data(obj, src, type_=type_)
    except ValueError as e:
        raise ValueError(f"rl: {e}") from None


def all_gather(obj, *, type_) -> list:
    """Every rank's ``obj`` (in rank order) on every rank, as data: each one msgpack, decoded
    strictly into ``type_`` (this rank's too, so every rank holds the same values)."""
    import torch
    import torch.distributed as dist

    raw = msgspec.msgpack.encode(obj)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(raw)], dtype=torch.int64))
    m = max(int(x) for x in sizes)
    mine = torch.zeros(m, dtype=torch.uint8)
    mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    bufs = [torch.empty(m, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, mine)
    return [_decode(b[:int(k)].numpy().tobytes(), type_, f"rank {r}'s contribution") for r, (b, k) in
            enumerate(zip(bufs, sizes))]


def broadcast_rollout(batch: dict | None, src: int = 0) -> dict:
    """Rank ``src``'s rollout (:func:`rollout`'s dict: ``answers`` / ``logprobs`` tensors, the
    ``versions`` set, ``seconds``) on every rank, as data (the tensors as dtype, shape, bytes)."""
    import torch.distributed as dist

    msg = None
    if dist.get_rank() == src:
        msg = _Rollout(TensorData.of(batch["answers"]), TensorData.of(batch["logprobs"]), set(batch["versions"]),
                       float(batch["seconds"]))
    got = broadcast(msg, src, type_=_Rollout)
    if dist.get_rank() == src:
        return batch
    return {"answers": got.answers.tensor(), "logprobs": got.logprobs.tensor(), "versions": got.versions,
            "seconds": got.seconds}
