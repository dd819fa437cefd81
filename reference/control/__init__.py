"""The control plane: every message between the job's processes, through one authenticated
store (:mod:`weight_transfer.security`), decoded as data (no pickle).

- :mod:`.wire` and :mod:`.keys`: how every value is encoded and the schema of every key;
- :mod:`.store`: the store as the public API opens it (:func:`~weight_transfer.control.store.serve_store`,
  :func:`~weight_transfer.control.store.connect_store`);
- :mod:`.protocol`: metadata once, a plan once, then per step "go", completions and the
  published weight version (:class:`~weight_transfer.control.protocol.Controller`);
  :mod:`.clients`: the training and inference ranks' sides of it;
- :mod:`.heartbeat` (a process that stopped is named), :mod:`.membership` (engines that come
  and go between updates), :mod:`.fingerprint` (the end-to-end check before ``complete v``),
  :mod:`.collectives` (small messages between training ranks, as data).

Imports: ``types``, ``errors``, ``args``, ``options``, ``security``, ``plan``, ``pipeline``.
"""
