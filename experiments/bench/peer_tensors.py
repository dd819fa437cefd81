"""bench-peers' tensor set and the bytes every update carries (``experiments/bench/peers.py``).

The engine tensors of the benchmark's world as global (pre-TP) BF16 tensors, each held by the
training ranks as even ``dim 0`` shards and by the inference ranks as TP shards, and a pattern
of (tensor, global index, step) that any rank computes on its own for any part: the senders
write it, the receivers recompute and compare it bit for bit. Needs torch only (the engine's
tensor list is imported when asked for), so torchstore's own interpreter loads this file by
path (``experiments/bench/torchstore_peer.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_P = (7919, 104729, 1299709, 15485863)  # per-dimension pattern multipliers (primes)


@dataclass(frozen=True, slots=True)
class PeerTensor:
    """One engine tensor as a global (pre-TP) BF16 tensor: ``tp_dim`` None = replicated on
    every inference rank (each gets the whole tensor), else each TP rank gets an even slice
    of ``global_shape`` along ``tp_dim``."""

    tid: int
    name: str
    global_shape: tuple[int, ...]
    tp_dim: int | None

    def infer_box(self, rank: int, tp: int) -> tuple[tuple[int, int], ...]:
        """(start, end) per dim of the part inference rank ``rank`` holds."""
        box = [(0, n) for n in self.global_shape]
        if self.tp_dim is not None:
            n = self.global_shape[self.tp_dim] // tp
            box[self.tp_dim] = (rank * n, (rank + 1) * n)
        return tuple(box)

    def train_box(self, rank: int, n_train: int) -> tuple[tuple[int, int], ...]:
        """(start, end) per dim of training rank ``rank``'s even dim-0 shard."""
        n0 = self.global_shape[0]
        per = -(-n0 // n_train)
        a, b = min(n0, rank * per), min(n0, (rank + 1) * per)
        return ((a, b),) + tuple((0, n) for n in self.global_shape[1:])


def _tp_dim(name: str, ndim: int) -> int:
    if any(k in name for k in ("o_proj", "down_proj", "w2_weight")):
        return ndim - 1
    if "w13_weight" in name:
        return 1
    return 0


def tensor_set(cfg) -> list[PeerTensor]:
    """The engine tensors of ``cfg`` (a TrialConfig, BF16, tp ranks of one instance) as
    :class:`PeerTensor` s, in the engine's order. Replicated = the recipes that write it send
    every inference rank the same bytes."""
    from weight_transfer.engines.engine import engine_tensor_metas
    from weight_transfer.plan import build_recipes

    mcfg, layout = cfg.model_config(), cfg.inference
    rs = build_recipes(mcfg, layout)
    n = layout.world_size
    replicated = {o.tensor for r in rs.recipes if len(r.ranks) == n for o in r.outputs}
    out = []
    for i, m in enumerate(engine_tensor_metas(mcfg, layout, 0)):
        if m.name in replicated:
            out.append(PeerTensor(i, m.name, tuple(m.shape), None))
        else:
            d = _tp_dim(m.name, len(m.shape))
            g = list(m.shape)
            g[d] *= layout.tp
            out.append(PeerTensor(i, m.name, tuple(g), d))
    return out


def pattern(box: tuple[tuple[int, int], ...], tid: int, step: int) -> torch.Tensor:
    """The BF16 bytes of ``box`` of tensor ``tid`` at ``step``: element value bits =
    (sum over dims of global index * prime + tid * 31 + step * 977) mod 2^16. Any rank can
    compute any part on its own (the receivers' independent check)."""
    shape = tuple(b - a for a, b in box)
    out = torch.empty(shape, dtype=torch.int16)
    if out.numel() == 0:
        return out.view(torch.bfloat16)
    nd = len(box)
    rows = max(1, (1 << 22) // max(1, out[0].numel() if nd > 1 else 1))
    tail = torch.zeros((), dtype=torch.int32)
    for d in range(1, nd):
        a, b = box[d]
        ix = (torch.arange(a, b, dtype=torch.int32) * _P[d % 4]) % 65536
        tail = tail.unsqueeze(-1) + ix if tail.dim() else ix
    c = (tid * 31 + step * 977) % 65536
    for r0 in range(0, shape[0], rows):
        r1 = min(shape[0], r0 + rows)
        ix0 = (torch.arange(box[0][0] + r0, box[0][0] + r1, dtype=torch.int32) * _P[0]) % 65536 + c
        v = ix0.view((-1,) + (1,) * (nd - 1)) + tail if nd > 1 else ix0
        out[r0:r1] = (v & 0xFFFF).to(torch.int16)
    return out.view(torch.bfloat16)


def check(t: torch.Tensor, box, tid: int, step: int) -> bool:
    """Whether ``t`` holds exactly :func:`pattern`'s bytes of ``box`` (compared as int16)."""
    return torch.equal(t.contiguous().view(torch.int16), pattern(box, tid, step).view(torch.int16))
