"""From checkpoint tensors to the bytes an engine computes with: pure tensor functions, no
process, store or transport.

- :mod:`.transforms`: running a recipe (assemble its tensor from source parameters, cast,
  fuse, slice, quantize, split into the outputs each receiving rank holds);
- :mod:`.layouts`: the runtime memory layouts an engine keeps after its own post-processing;
- :mod:`.quant` (FP8 block, ``weight_scale_inv``; ``_fp8_cpu.c``), :mod:`.quant_scaled`
  (per-tensor and per-channel FP8) and :mod:`.quant_triton` (the block quantizer on a GPU).

The planner (:mod:`weight_transfer.plan`) uses the same functions to size and split what it
schedules; the executor (:mod:`weight_transfer.pipeline`) runs them on every update.

Imports: ``types``, ``native``.
"""
