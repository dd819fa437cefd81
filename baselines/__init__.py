"""Baselines measured side by side with the reference, through the same method interface
(:mod:`weight_transfer.method`), in the same worlds and with the same verification:

- :mod:`weight_transfer.baselines.funnel` -- the rank-0 funnel: every parameter gathered on training rank 0,
  bucketed and broadcast over a cross-job process group to the inference ranks, which run
  the engine's ``load_weights``;
- :mod:`weight_transfer.baselines.rpc` -- per-tensor ``update_weight()`` RPCs over ZeroMQ from training rank
  0 to every inference worker, data in the request, ``load_weights`` in the worker.

``weight-transfer run --method all`` runs the reference and both baselines one after
another on one model and world and prints one table (experiments/compare.py).
"""
