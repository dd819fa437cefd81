"""Command-line options generated from config dataclasses: one ``--flag`` per leaf field, its
help the field's docstring with its unit and default, its type from the annotation.

Config dataclasses in this project document each field with a string literal right after it
(torchtitan style). Python does not keep those at run time, so :func:`field_docs` reads them
from the class's source with :mod:`ast`. A config may *compose* others (``TrialConfig.transfer``
is a ``TransferOptions``, whose ``executor`` is an ``ExecutorOptions``): the options of a
composed config are its leaf fields, each under one flat name (the field's name, or its
``metadata["flat"]``), which is also its sweep-CSV column and its command-line destination.

Field metadata (``dataclasses.field(metadata={...})``) shapes a field's option:

- ``flat``: the flat name (default: the field name); ``flag``: the option (default
  ``--<flat name>``); ``aliases``: more option strings for the same thing;
- ``unit`` and ``scale``: the option is given in ``unit`` and multiplied by ``scale`` (an
  integer number of bytes from ``--watermark-mb 64``: unit ``MiB``, scale ``1 << 20``);
  ``unit`` alone only documents (``s``, ``bytes``);
- ``negate``: for a bool, one more option that sets it False (``--gather-all`` for
  ``local_writes``, ``--serial`` for ``pipeline``);
- ``parse``: a function from the option's text to the value (``2x2`` -> ``(2, 2)``);
  ``append``: the option repeats and its ``KEY=VALUE`` items build a dict;
- ``choices``, ``metavar``; ``cli: False`` leaves the field off the command line.

Hand-written rather than taken from ``tyro`` or ``simple_parsing`` (which do the same) to
avoid a dependency for ~200 lines, and because the flat names must stay the sweep CSVs'
columns. Supported leaf types: ``int``, ``float``, ``str``, ``bool`` (``--x`` / ``--no-x``),
``Literal[...]`` (choices), their ``| None`` forms, ``tuple[int, ...]`` / ``tuple[str, ...]``
(comma-separated) and ``dict`` with ``append``.

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
import re
import textwrap
import typing
from dataclasses import dataclass
from pathlib import Path


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


@dataclass(frozen=True, slots=True)
class Leaf:
    """One leaf field of a (possibly composed) config dataclass."""

    flat: str
    """Its flat name: option destination, sweep-CSV column, trial-key entry."""
    path: tuple[str, ...]
    """Attribute path from the root config (``("transfer", "executor", "watermark")``)."""
    field: dataclasses.Field
    """The dataclass field."""
    owner: type
    """The dataclass that declares it."""
    type: object
    """Its resolved annotation."""


def _is_config(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.cache
def leaves(cls) -> tuple[Leaf, ...]:
    """The leaf fields of dataclass ``cls`` in declaration order, descending into fields whose
    type is itself a dataclass. Raises TypeError when two leaves share a flat name."""
    out: list[Leaf] = []

    def walk(klass, path):
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            if not f.init:
                continue
            tp = hints[f.name]
            if _is_config(tp) and not f.metadata.get("leaf"):
                walk(tp, (*path, f.name))
            else:
                out.append(Leaf(f.metadata.get("flat", f.name), (*path, f.name), f, klass, tp))

    walk(cls, ())
    seen: dict[str, Leaf] = {}
    for lf in out:
        if lf.flat in seen:
            raise TypeError(f"{cls.__name__}: flat name {lf.flat!r} of {'.'.join(lf.path)} is also "
                            f"{'.'.join(seen[lf.flat].path)}'s")
        seen[lf.flat] = lf
    return tuple(out)


def flatten(obj) -> dict:
    """``{flat name: value}`` of every leaf of config ``obj`` (a dataclass instance)."""
    out = {}
    for lf in leaves(type(obj)):
        v = obj
        for part in lf.path:
            v = getattr(v, part)
        out[lf.flat] = v
    return out


def replace_flat(obj, **flat):
    """A copy of config ``obj`` with the leaves named by their flat names replaced (composed
    parts are rebuilt with :func:`dataclasses.replace`, so their ``__post_init__`` checks run);
    a top-level composed part may also be given whole by its field name (``baseline=...``).
    Raises TypeError for a name that is no leaf of ``obj``, ValueError from the checks."""
    by_flat = {lf.flat: lf for lf in leaves(type(obj))}
    parts = {f.name for f in dataclasses.fields(obj) if f.init and f.name not in by_flat}
    unknown = [k for k in flat if k not in by_flat and k not in parts]
    if unknown:
        raise TypeError(f"{type(obj).__name__}: no option named {', '.join(map(repr, unknown))}")
    whole = {k: flat.pop(k) for k in list(flat) if k in parts}  # a composed part given whole
    if whole:
        obj = dataclasses.replace(obj, **whole)
    tree = _Sub()
    for k, v in flat.items():
        node = tree
        *head, last = by_flat[k].path
        for part in head:
            node = node.setdefault(part, _Sub())
        node[last] = v

    def apply(o, changes: _Sub):
        return dataclasses.replace(o, **{n: apply(getattr(o, n), c) if isinstance(c, _Sub) else c
                                         for n, c in changes.items()})

    return apply(obj, tree)


class _Sub(dict):
    """Changes to one composed part (a leaf's own value may be a dict: ``overrides``)."""


def build_flat(cls, **flat):
    """``cls()`` with the leaves named by ``flat`` set (:func:`replace_flat` of the defaults)."""
    return replace_flat(cls(), **flat)


# ---- the command line ------------------------------------------------------------------------


def plain(doc: str) -> str:
    """A docstring as ``--help`` text: Sphinx roles (``:func:`~a.b```) become their target's
    last name, double backticks are dropped."""
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1), doc)
    return doc.replace("``", "")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp) -> tuple[object, bool]:
    """(type without ``None``, whether ``None`` is allowed)."""
    args = typing.get_args(tp)
    if args and type(None) in args and typing.get_origin(tp) is not typing.Literal:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else str), True
    return tp, False


def _parser_for(tp, name: str, scale=None):
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
    if scale is not None and tp in (int, float):
        def parse_scaled(s: str):
            try:
                return tp(float(s) * scale)
            except ValueError:
                raise argparse.ArgumentTypeError(f"wants a number, got {s!r}") from None
        return parse_scaled
    if tp in (int, float, str):
        return tp
    if tp is Path:
        return Path
    if origin is typing.Literal:
        return str
    raise TypeError(f"field {name!r}: type {tp!r} has no command-line form")


def key_value(s: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> ``(KEY, VALUE)``, VALUE read as a Python literal when it is one
    (``2``, ``1e-6``, ``True``, ``[1, 2]``), else kept as text. ArgumentTypeError without ``=``."""
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"wants KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    try:
        val = ast.literal_eval(v)
    except (ValueError, SyntaxError):
        val = v
    return k, val


def _shown(default, md) -> str | None:
    """How a default reads in ``--help`` (in the option's unit)."""
    if default is None or default == "" or default == () or default == {}:
        return None
    if isinstance(default, tuple):
        return ",".join(map(str, default))
    if md.get("scale") and isinstance(default, (int, float)):
        return f"{default / md['scale']:g}"
    return str(default)


def add_dataclass_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls, *,
                          exclude: typing.Iterable[str] = (), dest_prefix: str = "",
                          groups: bool = True, meta: dict[str, dict] | None = None,
                          defaults: dict | None = None, namespace_defaults: bool = False) -> None:
    """Add one option per leaf field of dataclass ``cls`` (see module docstring) to ``parser``,
    destination ``dest_prefix + flat name``: help = the field's docstring, its unit and its
    default; an option not given is absent from the parsed namespace (``argparse.SUPPRESS``;
    a given value may be None, ``--quant none``), so :func:`dataclass_from_args` keeps the
    config's own default. With ``groups`` each composed
    part gets an argument group titled by its class docstring's first line. ``exclude``: flat
    names to leave out; ``meta``: per flat name, metadata that replaces the field's own (for a
    part whose class is not the command line's, e.g. the library's ``InferenceLayout``);
    ``defaults``: the defaults ``--help`` shows, by flat name (default: ``cls()``'s, or the
    fields' own when ``cls()`` cannot be built); ``namespace_defaults``: an option not given
    parses to its default instead of being absent (for code that reads ``args.<name>``).
    Raises TypeError for a leaf type with no command-line form."""
    made: dict = {}
    if defaults is None:
        try:
            defaults = flatten(cls())
        except (TypeError, ValueError):
            defaults = {}
    for lf in leaves(cls):
        md = {**lf.field.metadata, **(meta or {}).get(lf.flat, {})}
        if lf.flat in exclude or md.get("cli") is False:
            continue
        target = parser
        if groups and len(lf.path) > 1 and isinstance(parser, argparse.ArgumentParser):
            if lf.owner not in made:
                title = (inspect.getdoc(lf.owner) or lf.owner.__name__).split("\n")[0].rstrip(".")
                made[lf.owner] = parser.add_argument_group(f"{'.'.join(lf.path[:-1])}: {title}")
            target = made[lf.owner]
        f = lf.field
        tp, _nullable = _base_type(lf.type)
        default = defaults[lf.flat] if lf.flat in defaults else (
            f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None))
        help_ = plain(field_docs(lf.owner).get(f.name, ""))
        if md.get("unit"):
            help_ += f" [{md['unit']}]"
        flags = [md.get("flag", _flag(lf.flat)), *md.get("aliases", ())]
        dest = dest_prefix + lf.flat
        absent = default if namespace_defaults else argparse.SUPPRESS
        if tp is bool:
            help_ += f" (default: {'on' if default else 'off'})"
            # a field named no_<x> (--no-csv): BooleanOptionalAction reads any "--no-" flag as False
            action = "store_true" if flags[0].startswith("--no-") else argparse.BooleanOptionalAction
            target.add_argument(*flags, dest=dest, action=action, default=absent,
                                help=help_.replace("%", "%%"))
            if md.get("negate"):
                target.add_argument(md["negate"], dest=dest, action="store_false", default=absent,
                                    help=f"the same as {flags[0].replace('--', '--no-', 1)}")
            continue
        shown = _shown(default, md)
        if shown is not None:
            help_ += f" (default: {shown})"
        elif not md.get("append"):
            help_ += " (default: none)"
        help_ = help_.replace("%", "%%")
        metavar = md.get("metavar", (md.get("unit") if md.get("scale") else None) or lf.flat.upper())
        if md.get("append"):
            target.add_argument(*flags, dest=dest, action="append", type=md.get("parse", key_value),
                                default=None if namespace_defaults else argparse.SUPPRESS,
                                metavar=md.get("metavar", "KEY=VALUE"), help=help_ + " (repeatable)")
            continue
        choices = md.get("choices")
        if choices is None and "parse" not in md and typing.get_origin(tp) is typing.Literal:
            choices = [a for a in typing.get_args(tp) if a is not None]
        conv = md.get("parse") or _parser_for(tp, lf.flat, md.get("scale"))
        target.add_argument(*flags, dest=dest, type=conv, default=absent, choices=choices,
                            metavar=None if choices else metavar, help=help_)


def given(cls, args: argparse.Namespace, *, dest_prefix: str = "") -> dict:
    """``{flat name: value}`` of the options of ``cls`` given on the command line (an
    ``append`` option's ``KEY=VALUE`` items as a dict)."""
    out = {}
    for lf in leaves(cls):
        if not hasattr(args, dest_prefix + lf.flat):
            continue
        v = getattr(args, dest_prefix + lf.flat)
        if v is None and lf.field.metadata.get("append"):
            continue
        out[lf.flat] = dict(v) if lf.field.metadata.get("append") else v
    return out


def dataclass_from_args(cls, args: argparse.Namespace, *, dest_prefix: str = "", base=None, **fixed):
    """Build ``cls`` from the options :func:`add_dataclass_options` added: given options
    replace the values of ``base`` (default: ``cls()``'s); ``fixed`` flat names are set as
    they are. Raises whatever the configs' ``__post_init__`` raise for a bad value (ValueError)."""
    flat = {**given(cls, args, dest_prefix=dest_prefix), **fixed}
    return replace_flat(cls() if base is None else base, **flat)
