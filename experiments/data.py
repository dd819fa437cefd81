"""The harness's data-only encodings: what its processes hand each other, as data (``msgspec``:
msgpack or JSON, decoded strictly into the type the reader expects), never pickles.

- files a launcher hands the processes it starts and reads back (scripts/netns_trial.py):
  :func:`config_to_json` / :func:`config_from_json` (a :class:`~.config.TrialConfig` as JSON) and
  :func:`result_to_bytes` / :func:`result_from_bytes` (a :class:`~.trial.TrialResult` as msgpack:
  floats exact, NaN kept), checked by :func:`decode_data` (a field no part has, a missing one or
  one of the wrong type: ValueError naming it -- msgspec alone ignores unknown fields of a
  dataclass);
- the RL loop's training ranks over their gloo group: :mod:`weight_transfer.experiments.collectives`.

The control plane's own values go through :mod:`weight_transfer.control.wire` (a schema per store key);
the baselines' messages through their modules (:mod:`weight_transfer.baselines.rpc`,
:mod:`weight_transfer.baselines.funnel`).
"""
from __future__ import annotations

import dataclasses

import msgspec

__all__ = ["decode_data", "unknown_field", "config_to_json", "config_from_json", "result_to_bytes",
           "result_from_bytes"]


def unknown_field(obj, cls, path: str = "$") -> str | None:
    """The path of the first key of ``obj`` (decoded JSON / msgpack) that dataclass ``cls`` or
    a dataclass nested in it has no field for, or None."""
    import typing

    if not (dataclasses.is_dataclass(cls) and isinstance(obj, dict)):
        return None
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k, v in obj.items():
        if k not in names:
            return f"{path}.{k}"
        t = hints.get(k)
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            bad = unknown_field(v, t, f"{path}.{k}")
            if bad:
                return bad
    return None


def decode_data(obj, cls, what: str):
    """``obj`` (decoded JSON / msgpack builtins) as dataclass ``cls``, strictly: ValueError
    naming ``what`` and the field for an unknown field, a missing one or a wrong type (the
    dataclasses' own checks run)."""
    bad = unknown_field(obj, cls)
    if bad:
        raise ValueError(f"{what}: field {bad} is not in {cls.__name__}")
    try:
        return msgspec.convert(obj, cls, strict=True)
    except msgspec.ValidationError as e:
        raise ValueError(f"{what}: {e}") from None


def config_to_json(cfg) -> bytes:
    """A :class:`~.config.TrialConfig` as JSON, its parts by field name."""
    return msgspec.json.encode(cfg)


def config_from_json(raw: bytes | str):
    """The config :func:`config_to_json` wrote (:func:`decode_data`; the config's checks re-run)."""
    from .config import TrialConfig

    try:
        return decode_data(msgspec.json.decode(raw), TrialConfig, "trial config")
    except msgspec.DecodeError as e:
        raise ValueError(f"trial config: not JSON: {e}") from None


def _data_hook(obj):
    """numpy scalars as Python numbers, str subclasses (torch's version) as str; TypeError otherwise."""
    import numpy as np

    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, str):
        return str(obj)
    raise TypeError(f"data only, not {type(obj).__name__}")


def result_to_bytes(result) -> bytes:
    """A :class:`~.trial.TrialResult` as msgpack (row values: numbers, strings, None, lists)."""
    return msgspec.msgpack.encode(result, enc_hook=_data_hook)


def result_from_bytes(raw: bytes):
    """The result :func:`result_to_bytes` wrote (:func:`decode_data`)."""
    from .trial import TrialResult

    try:
        obj = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError as e:
        raise ValueError(f"trial result: not msgpack: {e}") from None
    return decode_data(obj, TrialResult, "trial result")
