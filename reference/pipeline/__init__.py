"""A training rank's data path on every update: the tasks of its static schedule flowing
through the stage threads (gather, prepare, write) under a memory watermark.

- :mod:`.executor`: :class:`~weight_transfer.pipeline.executor.Executor`, one rank's part of the
  schedule for one step (pipelined or stage-serialized);
- :mod:`.stages`: the stage loops and the write stage's batches in flight;
- :mod:`.tasks`: the task-level functions the stages call (gather sources, prepare outputs,
  post writes);
- :mod:`.memory`: the memory the writes read from, registered with the transport once;
- :mod:`.records`: what one update did (:class:`~weight_transfer.pipeline.records.StepStats`);
- :mod:`.hashes`: the sender's end-to-end fingerprints of its writes.

Imports: ``types``, ``options``, ``timeline``, ``convert``, ``transport``, ``delta``.
"""
