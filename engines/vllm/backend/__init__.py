"""``one_sided``: the reference as a backend of vLLM's own weight-transfer API
(``vllm/distributed/weight_transfer``), registered by the ``vllm.general_plugins`` entry point in
every vLLM process (docs/VLLM.md).

- :mod:`.plugin`: :func:`~weight_transfer.engines.vllm.backend.plugin.register`, the backend in
  both of vLLM's registries;
- :mod:`.config`: its names and init/update infos;
- :mod:`.trainer`: the trainer engine, one per training rank (``trainer_init``, ``send_weights``);
- :mod:`.worker`: the worker engine, one per vLLM worker (report, stage, register, commit);
- :mod:`.clients`: the ``VLLMWeightSyncClient`` adapters over engines in this process;
- :mod:`.recover`: the engine-core calls that make a shadow update live and return the backend
  to a fresh server's state.

What runs inside a worker is :mod:`weight_transfer.engines.vllm.worker`; the loader traces are
:mod:`weight_transfer.engines.vllm.trace`.
"""
