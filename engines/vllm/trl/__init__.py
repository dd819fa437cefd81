"""Hugging Face TRL's asynchronous GRPO trainer driving the ``one_sided`` backend
(docs/VLLM.md).

- :mod:`.trainer`: the integration (TRL's weight sync through the backend, shadow targets);
- :mod:`.cpu`: opt-in pieces for running TRL 1.16's async GRPO on a CPU-only host with the
  project's tiny checkpoints (nothing applied on import).
"""
