"""Small messages between the ranks of a training world, as data (:func:`broadcast_data`), in
place of torch's ``broadcast_object_list``, which unpickles what it receives: the library never
runs what arrives over a process group either (docs/SECURITY.md). A length, then msgpack bytes
(``msgspec``), decoded strictly into the type the receiver expects."""
from __future__ import annotations

import msgspec

__all__ = ["broadcast_data"]


def broadcast_data(obj, src: int = 0, *, type_, group=None):
    """``obj`` of rank ``src`` on every rank of ``group`` (default: the default process group):
    msgpack of numbers, strings, lists, tuples, dicts, dataclasses, decoded strictly into
    ``type_`` on the other ranks (``src`` keeps ``obj`` as it is). The bytes travel as a
    ``uint8`` tensor, on the current CUDA device for an NCCL group, on the CPU otherwise. A
    collective: every rank of the group calls it. ValueError naming ``src`` for bytes that are not
    a ``type_``."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank(group) if group is not None else dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    raw = msgspec.msgpack.encode(obj) if me == src else b""
    n = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    dist.broadcast(n, src, group=group)
    if me == src:
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device) if raw else torch.empty(0, dtype=torch.uint8,
                                                                                                     device=device)
    else:
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src, group=group)
    if me == src:
        return obj
    try:
        return msgspec.msgpack.decode(buf.cpu().numpy().tobytes(), type=type_, strict=True)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"refused rank {src}'s broadcast: not a {type_!r}: {e}") from None
