"""Command-line options generated from config dataclasses: one ``--flag`` per field, its help
the field's docstring, its type from the annotation.

Config dataclasses in this project document each field with a string literal right after it
(torchtitan style). Python does not keep those at run time, so :func:`field_docs` reads them
from the class's source with :mod:`ast`. This is hand-written rather than taken from ``tyro``
or ``simple_parsing`` (which do the same) to avoid a dependency for ~80 lines; it supports the
field types used here: ``int``, ``float``, ``str``, ``bool`` (``--x`` / ``--no-x``), their
``| None`` forms, and ``tuple[int, ...]`` / ``tuple[str, ...]`` (comma-separated).

    ap = argparse.ArgumentParser()
    add_dataclass_options(ap, QuantBenchConfig)
    cfg = dataclass_from_args(QuantBenchConfig, ap.parse_args())
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import typing


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """``{field name: docstring}`` of a dataclass (and its dataclass bases), read from the
    source: the string literal right after each annotated field. Fields without one are
    missing from the result; a class whose source is unavailable gives ``{}``."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for prev, node in zip(body, body[1:]):
            if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                    and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                out[prev.target.id] = " ".join(node.value.value.split())
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp) -> tuple[object, bool]:
    """(type without ``None``, whether ``None`` is allowed)."""
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else str), True
    return tp, False


def _parser_for(tp, name: str):
    origin = typing.get_origin(tp)
    if origin is tuple:
        elem = typing.get_args(tp)[0]
        conv = elem if elem in (int, float, str) else str

        def parse_tuple(s: str) -> tuple:
            try:
                return tuple(conv(x) for x in s.split(",") if x.strip())
            except ValueError:
                raise argparse.ArgumentTypeError(f"{_flag(name)} wants comma-separated {conv.__name__}s, "
                                                 f"got {s!r}") from None
        return parse_tuple
    if tp in (int, float, str):
        return tp
    raise TypeError(f"field {name!r}: type {tp!r} has no command-line form")


def add_dataclass_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls, *,
                          exclude: typing.Iterable[str] = (), dest_prefix: str = "") -> None:
    """Add one option per init field of dataclass ``cls`` to ``parser``: ``--field-name``,
    help = the field's docstring and its default. Every option's parsed default is ``None``
    ("not given"), so :func:`dataclass_from_args` keeps the dataclass's own default. Booleans
    get ``--x`` and ``--no-x``. ``exclude``: field names to leave out; ``dest_prefix``:
    prefixed to each destination (to keep two dataclasses' fields apart in one namespace).
    Raises TypeError for a field type with no command-line form."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.name in exclude:
            continue
        tp, nullable = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_ = docs.get(f.name, "")
        if isinstance(default, tuple):
            default = ",".join(map(str, default))
        if default not in (None, "") and tp is not bool:
            help_ += f" (default: {default})"
        help_ = help_.replace("%", "%%")
        dest = dest_prefix + f.name
        if tp is bool:
            parser.add_argument(_flag(f.name), dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                help=help_ + f" (default: {'on' if default else 'off'})")
        else:
            parser.add_argument(_flag(f.name), dest=dest, type=_parser_for(tp, f.name), default=None,
                                metavar=f.name.upper(), help=help_)


def dataclass_from_args(cls, args: argparse.Namespace, *, dest_prefix: str = "", **fixed):
    """Build ``cls`` from the options :func:`add_dataclass_options` added: given options
    replace the defaults; ``fixed`` keyword arguments are passed as they are. Raises whatever
    ``cls.__post_init__`` raises for a bad value (ValueError)."""
    kw = dict(fixed)
    for f in dataclasses.fields(cls):
        v = getattr(args, dest_prefix + f.name, None)
        if f.init and v is not None and f.name not in kw:
            kw[f.name] = v
    return cls(**kw)
