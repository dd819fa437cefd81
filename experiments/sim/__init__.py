"""At-scale simulation: the real planner on synthesized metadata, and a stage-level cost model.

- :mod:`.metadata`: what every training / inference rank would publish, without allocating;
- :mod:`.hardware`: every hardware figure as a named, sourced parameter;
- :mod:`.model`: the discrete-event execution of a :class:`~weight_transfer.types.Schedule`, the
  physical floor, and the baselines (rank-0 funnel, per-tensor RPC, full broadcast);
- :mod:`.configs`: named configurations (``kimi_k2_256xh100_to_128xh100_fp8`` ...);
- :mod:`.run`: ``weight-transfer simulate <config>``: plan, simulate, table, CSV
  (``--sensitivity``, ``--moe-width``, ``--layers``);
- :mod:`.layout_map`: ``simulate --map``, Kimi-K2's floor over MoE mesh width x inference layout.

See docs/SIMULATION.md.
"""
