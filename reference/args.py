"""Arguments checked at the door: the validators the public API (:mod:`weight_transfer.api`,
:mod:`weight_transfer.api.receiver`, :mod:`weight_transfer.control.store`) runs before it connects to the
store or publishes anything.

The library lives in someone else's trainer, so a wrong argument is refused at once, with the
class or function that refused it, the argument's name and value, and what is required::

    >>> check_int("1", "rank", where="Sender")
    Traceback (most recent call last):
    TypeError: Sender: rank='1' is a str; an int is required (from os.environ? convert it with int())

Rules: a wrong *type* is a ``TypeError``, a value of the right type out of its range a
``ValueError`` naming the range. ``bool`` is never an int or a number of seconds here (``True``
is almost always a mistake for a rank); a ``str`` -- what ``os.environ`` gives -- gets a hint to
convert it. Integer types other than ``int`` that are exact integers (``numpy.int64``, any
``numbers.Integral``) are accepted and returned as ``int``; floats are refused even when whole
(``2.0``): a rank or a world size computed in floating point is a bug upstream.
"""
from __future__ import annotations

import math
import numbers
from datetime import timedelta

__all__ = ["check_int", "check_seconds", "check_type", "check_callable", "check_bool"]


def _a(name: str) -> str:
    return ("an " if name[0] in "AEIOUaeiou" else "a ") + name


def _kind(value) -> str:
    """``a str``, ``an int``, ``None``: what ``value`` is, for a message."""
    return "None" if value is None else _a(type(value).__name__)


def _hint(value, convert: str) -> str:
    return f" (from os.environ? convert it with {convert}())" if isinstance(value, str) else ""


def check_int(value, name: str, *, where: str, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an ``int`` when it is an exact integer with ``lo <= value <= hi`` (either
    bound may be None). TypeError for anything else (``bool``, ``str``, ``float`` included),
    ValueError naming the range when out of it. Messages start with ``where``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name}={value!r} is {_kind(value)}; an int is required{_hint(value, 'int')}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = (f"{lo} <= {name} <= {hi}" if lo is not None and hi is not None
               else f"{name} >= {lo}" if lo is not None else f"{name} <= {hi}")
        raise ValueError(f"{where}: {name}={value} is out of range; need {rng}")
    return value


def check_seconds(value, name: str, *, where: str, allow_none: bool = False) -> float | None:
    """``value`` as seconds (``float``): a positive, finite ``int``/``float`` (or a
    ``datetime.timedelta``); ``None`` passes through when ``allow_none``. TypeError for another
    type (``bool``, ``str``), ValueError for zero, negative, NaN or infinite."""
    if value is None and allow_none:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        need = "a number of seconds" + (" (or None)" if allow_none else "")
        raise TypeError(f"{where}: {name}={value!r} is {_kind(value)}; {need} is required{_hint(value, 'float')}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}: {name}={value!r}: need a finite number of seconds > 0")
    return value


def check_type(value, name: str, types: type | tuple[type, ...], *, where: str, allow_none: bool = False,
               what: str | None = None):
    """``value`` itself when it is an instance of ``types`` (or None with ``allow_none``);
    TypeError naming ``what`` is required (default: the types' names) otherwise."""
    if (value is None and allow_none) or isinstance(value, types):
        return value
    if what is None:
        ts = types if isinstance(types, tuple) else (types,)
        what = " or ".join(_a(t.__name__) for t in ts)
    raise TypeError(f"{where}: {name} is {_kind(value)}; {what}{' (or None)' if allow_none else ''} is required")


def check_callable(value, name: str, *, where: str, allow_none: bool = True):
    """``value`` itself when it is callable (or None with ``allow_none``); TypeError otherwise."""
    if (value is None and allow_none) or callable(value):
        return value
    raise TypeError(f"{where}: {name}={value!r} is {_kind(value)}; a callable"
                    f"{' (or None)' if allow_none else ''} is required")


def check_bool(value, name: str, *, where: str, allow_none: bool = False) -> bool | None:
    """``value`` when it is a ``bool`` (or None with ``allow_none``); TypeError otherwise
    (``"false"`` from a config is true)."""
    if isinstance(value, bool) or (allow_none and value is None):
        return value
    raise TypeError(f"{where}: {name}={value!r} is {_kind(value)}; True or False is required")
