"""The weight-transfer state inside one vLLM worker process, shared by the backend's worker
engine and the worker extension.

- :mod:`.state`: what the model computes with, the staged targets, the registered region, the commit;
- :mod:`.runtime`: the runtime layout the worker reports (which memory holds the bytes each
  vLLM tensor computes with, which layers are staged);
- :mod:`.shadow`: shadow targets and their go-live between two engine steps;
- :mod:`.steps`: the engine's step clock;
- :mod:`.handles` and :mod:`.isa`: the CPU kernel state vLLM builds and the switches set on it;
- :mod:`.delta_apply`: the landing region and scatter of packed delta updates;
- :mod:`.draft_targets`: a speculative-decoding draft's memory beside the target's.
"""
