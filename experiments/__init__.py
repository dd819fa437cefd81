"""The harness around the transfer methods, by role:

- running trials: :mod:`.config` (``TrialConfig``, ``Sweep``, ``trial_key``), :mod:`.trial`
  (controller, local launch, job tasks), :mod:`.worker` (training and inference rank
  processes), :mod:`.verify`, :mod:`.report`, :mod:`.compare`, :mod:`.methods` (registry),
  :mod:`.env` (host, versions, git commit, memcpy rate);
- launching sweeps: :mod:`.configs` (named configs and sweeps) and :mod:`.sweep` (submitit);
  neither imports the other;
- benchmarks: :mod:`.bench` (``weight-transfer bench-quant|bench-pipeline|bench-transports``);
- the at-scale simulation: :mod:`.sim`;
- the one command line: ``weight-transfer`` (:mod:`.__main__`), options generated from
  the config dataclasses by :mod:`.cli`.
"""
