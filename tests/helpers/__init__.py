"""Helpers shared by the tests (no test module imports another; they import these).

- :data:`ROOT`: the checkout; :data:`DATA`: ``tests/data`` (recorded fixtures);
- :mod:`.loopback`: one process holding whole tensors that writes into stand-in engines;
- :mod:`.receiver`: a spawned receiver process with a request/answer pipe;
- :mod:`.transports`: the transport-contract receiver every transport suite starts;
- :mod:`.planning`: FSDP metadata computed with ``shard_box``, exact-cover checks;
- :mod:`.faults`: fault-injecting methods (``method="tests.helpers.faults:"``);
- :mod:`.stale_draft`: a method whose draft goes stale after its first update (C33);
- :mod:`.processes`: a command's processes found by their session;
- :mod:`.slurm`: driving sweeps on the local SLURM cluster (scripts/slurm_local.sh);
- :mod:`.api_world`: worlds driven through the public API with faults injected by role, stage and kind (C28);
- :mod:`.trl_job`: one TRL async GRPO job per training rank, a script (tests/engines/vllm/trl/test_trainer.py);
- :mod:`.mtp_vllm`: vLLM's own MTP draft loaded on the CPU against the stand-in's, a script
  (tests/engines/vllm/test_draft.py).
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root (``tests/helpers/__init__.py`` -> two levels up)."""
DATA = ROOT / "tests" / "data"
"""Recorded fixtures (``vllm_cpu_layouts.json``: scripts/record_vllm_cpu_layouts.py)."""
