"""Delta updates: each sender writes only the bytes of its outputs that changed since it last
wrote them (``ExecutorOptions(delta=True)``, docs/DELTA.md).

- :mod:`.runs`: the per-output state and the changed byte runs (:class:`~weight_transfer.delta.runs.DeltaState`);
- :mod:`.masks` and :mod:`.index`: the packed formats' chunk masks and varint index;
- :mod:`.cost`: the per-output cost model choosing ``scattered``, ``packed`` or ``full``;
- :mod:`.fused`: the comparison fused into the prepare stage's cast or copy;
- :mod:`.packed`: packed records written into a receiver's landing region and scattered at its
  commit. The receiving engine owns that step: it registers a
  :class:`~weight_transfer.delta.packed.Landing`, puts its descriptor at ``LANDING_KEY`` and calls
  :meth:`~weight_transfer.delta.packed.Landing.apply` in its commit (the stand-in engine and the
  vLLM worker do; :class:`weight_transfer.api.Receiver` does not);
- :mod:`.changes`: what one training step changes, at every granularity (for analysis).

The comparisons run in ``_delta.c`` (:mod:`weight_transfer.native.delta`) when it builds.

Imports: ``types``, ``native``, ``convert``, ``transport``.
"""
