"""Every value the control plane puts in the store, as data: an explicit, versioned encoding
decoded field by field into the library's own types. Nothing read from the store is unpickled.

A value is ``b"\\x01"`` (format 1) followed by msgpack (``msgspec``). Each store key the library
reads has a schema (:func:`schema_of`, registered with :func:`register` next to the code that
writes it): the type a value of that key decodes into -- the library's frozen dataclasses
(:class:`~weight_transfer.types.ParamMeta`, :class:`~weight_transfer.types.RankPlan`, ...),
``TypedDict`` messages, tuples and primitives. :func:`decode` refuses, with
:class:`WireError` naming the key:

- a value of another format, or bytes that are not msgpack;
- a field the schema does not have (``msgspec`` itself ignores unknown fields of a dataclass;
  :func:`decode` walks the value against the schema first, so an unknown field anywhere is
  refused, named by its path);
- a field of the wrong type (``msgspec.convert`` in strict mode: no ``"1"`` for an int, no
  ``True`` for an int), a missing required field, a ``Literal`` outside its values, and what
  the dataclass's own ``__post_init__`` refuses.

Values whose type varies (a training rank's stats: the reference's
:class:`~weight_transfer.pipeline.records.StepStats` or a baseline's) travel as :class:`Tagged`:
``[type name, value]``, the name one of the types registered with :func:`register_tagged`.

Why msgspec: it is the maintained, C-speed msgpack codec with typed decoding (vLLM's own
engine-core IPC uses it since it moved off pickle); the walk for unknown fields is ours because
msgspec has no strict mode for dataclasses.
"""
from __future__ import annotations

import re
import threading
from typing import Any, TypedDict

import msgspec
import msgspec.inspect as mi

from ..errors import ControlError

__all__ = ["WireError", "FORMAT", "encode", "decode", "register", "schema_of", "schemas", "Tagged", "register_tagged",
           "tag", "untag", "put", "get", "get_text", "get_int", "parse_int", "TEXT_LIMIT", "Outcome", "Decision", "Ready", "Done", "Report", "Proc", "World"]

FORMAT = b"\x01"
"""First byte of every encoded value: the encoding's version."""


class WireError(ControlError):
    """A store value that is not what its key's schema says (another format, an unknown or
    ill-typed field): refused, never acted on. The message names the key and the field."""


class Tagged(msgspec.Struct, array_like=True, frozen=True):
    """A value of one of several registered types: ``[type name, value]`` (:func:`tag`); the
    value is decoded as its registered type by :func:`untag`."""

    type: str
    value: Any


_TAGGED: dict[str, type] = {}
_TAGGED_NAME: dict[type, str] = {}


def register_tagged(cls: type, name: str | None = None) -> type:
    """Let instances of dataclass ``cls`` travel as :class:`Tagged` under ``name`` (default:
    the class name). Returns ``cls`` (usable as a decorator)."""
    n = name or cls.__name__
    _TAGGED[n], _TAGGED_NAME[cls] = cls, n
    return cls


def tag(obj) -> Tagged | None:
    """``obj`` as a :class:`Tagged` (None stays None); TypeError for an unregistered type."""
    if obj is None:
        return None
    name = _TAGGED_NAME.get(type(obj))
    if name is None:
        raise TypeError(f"wire: {type(obj).__name__} is not a registered tagged type (register_tagged)")
    return Tagged(name, obj)


def untag(t: Tagged | None, *, key: str = "?"):
    """The object a :class:`Tagged` carries, decoded strictly as its registered type."""
    if t is None:
        return None
    cls = _TAGGED.get(t.type)
    if cls is None:
        raise WireError(f"store key {key!r}: refused a value of unknown type {t.type!r}")
    return _decode_builtins(t.value, cls, key, f"$<{t.type}>")


def _enc_hook(obj):
    import numpy as np

    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"wire: cannot encode {type(obj).__name__} (data only: dataclasses, dicts, lists, tuples, "
                    "str, bytes, numbers)")


_ENC = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DEC = msgspec.msgpack.Decoder()


def encode(obj) -> bytes:
    """``obj`` as a store value (format byte + msgpack). TypeError for what is not data."""
    return FORMAT + _ENC.encode(obj)


# -- schemas


class _Schema:
    __slots__ = ("template", "regex", "type", "doc", "post")

    def __init__(self, template: str, type_, doc: str, post=None):
        self.template, self.type, self.doc, self.post = template, type_, doc, post
        pat = re.sub(r"\\\{[a-z_]+\\\}", r"-?[0-9]+", re.escape(template))  # {x}: an integer
        self.regex = re.compile(pat + r"\Z")


_SCHEMAS: list[_Schema] = []
_LOCK = threading.Lock()
_INFO: dict = {}


def register(template: str, type_, doc: str = "", *, post=None) -> None:
    """Declare the schema of the keys matching ``template`` (``{name}`` stands for an integer:
    ``"step/{v}/done/{r}"``): values decode into ``type_``; ``post(obj)`` (optional)
    finishes the decoded value (e.g. :func:`untag` its tagged fields). Registering the same
    template again replaces it."""
    with _LOCK:
        _SCHEMAS[:] = [s for s in _SCHEMAS if s.template != template]
        _SCHEMAS.append(_Schema(template, type_, doc, post))


def schema_of(key: str) -> _Schema | None:
    """The schema of ``key`` (None when no registered template matches). The library's own
    schemas are registered by :mod:`weight_transfer.control.keys`, which :mod:`weight_transfer.control.protocol`
    and :mod:`weight_transfer.control.store` import."""
    for s in _SCHEMAS:
        if s.regex.match(key):
            return s
    return None


def schemas() -> list[tuple[str, str, str]]:
    """``(template, type, doc)`` of every registered schema (docs/SECURITY.md lists them)."""
    return [(s.template, _type_name(s.type), s.doc) for s in _SCHEMAS]


def _type_name(t) -> str:
    if isinstance(t, type):
        return t.__name__
    return re.sub(r"\b[a-z_][a-z_0-9]*\.", "", str(t))  # list[weight_transfer.types.ParamMeta] -> list[ParamMeta]


def _info(t):
    i = _INFO.get(t)
    if i is None:
        i = _INFO[t] = mi.type_info(t)
    return i


def _unknown(obj, t, path: str) -> str | None:
    """The path of the first field of ``obj`` (decoded msgpack) the type info ``t`` does not
    have, or None."""
    if isinstance(t, (mi.DataclassType, mi.TypedDictType)) or (isinstance(t, mi.StructType) and not t.array_like):
        if not isinstance(obj, dict):
            return None  # the conversion names the type error
        fields = {f.encode_name: f for f in t.fields}
        for k, v in obj.items():
            f = fields.get(k)
            if f is None:
                return f"{path}.{k}" if isinstance(k, str) else f"{path}[{k!r}]"
            bad = _unknown(v, f.type, f"{path}.{k}")
            if bad:
                return bad
        return None
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        if isinstance(obj, list):
            for i, v in enumerate(obj):
                bad = _unknown(v, t.item_type, f"{path}[{i}]")
                if bad:
                    return bad
        return None
    if isinstance(t, (mi.TupleType, mi.NamedTupleType)):
        items = t.item_types if isinstance(t, mi.TupleType) else tuple(f.type for f in t.fields)
        if isinstance(obj, list):
            for i, (v, it) in enumerate(zip(obj, items)):
                bad = _unknown(v, it, f"{path}[{i}]")
                if bad:
                    return bad
        return None
    if isinstance(t, mi.DictType):
        if isinstance(obj, dict):
            for k, v in obj.items():
                bad = _unknown(v, t.value_type, f"{path}[{k!r}]")
                if bad:
                    return bad
        return None
    if isinstance(t, mi.UnionType):
        for m in t.types:  # the member a value of this shape decodes into
            if isinstance(obj, dict) and isinstance(m, (mi.DataclassType, mi.TypedDictType, mi.StructType, mi.DictType)):
                return _unknown(obj, m, path)
            if isinstance(obj, list) and isinstance(m, (mi.ListType, mi.VarTupleType, mi.TupleType, mi.NamedTupleType,
                                                        mi.SetType, mi.FrozenSetType)):
                return _unknown(obj, m, path)
        return None
    return None


def _decode_builtins(obj, type_, key: str, path: str = "$"):
    bad = _unknown(obj, _info(type_), path)
    if bad:
        raise WireError(f"store key {key!r}: refused: field {bad} is not in the {_type_name(type_)} schema")
    try:
        return msgspec.convert(obj, type_, strict=True)
    except (msgspec.ValidationError, ValueError, TypeError) as e:
        raise WireError(f"store key {key!r}: refused: not a {_type_name(type_)}: {e}") from None


def decode(raw: bytes, key: str, type_=None):
    """The value ``raw`` of store key ``key``, decoded into its schema's type (or ``type_``).
    :class:`WireError` naming the key and the field for anything the schema does not allow, or
    for a key without a schema."""
    s = None
    if type_ is None:
        s = schema_of(key)
        if s is None:
            raise WireError(f"store key {key!r}: no schema for this key: the library reads no such value")
        type_ = s.type
    if raw[:1] != FORMAT:
        raise WireError(f"store key {key!r}: refused a value that is not in the library's encoding (format "
                        f"{raw[:1]!r}, expected {FORMAT!r})")
    try:
        obj = _DEC.decode(raw[1:])
    except msgspec.DecodeError as e:
        raise WireError(f"store key {key!r}: refused: not msgpack ({e})") from None
    out = _decode_builtins(obj, type_, key)
    if s is not None and s.post is not None:
        out = s.post(out, key)
    return out


TEXT_LIMIT = 1 << 16
"""Longest ASCII/UTF-8 field (bytes) :func:`get_text` accepts."""


def get_text(store, key: str, *, limit: int = TEXT_LIMIT) -> str:
    """The UTF-8 text of ``key`` (a reason, a token). ControlError naming the key for more than
    ``limit`` bytes or bytes that are not UTF-8."""
    raw = store.get(key)
    if len(raw) > limit:
        raise ControlError(f"store key {key!r}: refused a text of {len(raw)} bytes (limit {limit})")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ControlError(f"store key {key!r}: refused a value that is not UTF-8 text") from None


def parse_int(raw: bytes, key: str) -> int:
    """``raw`` as a decimal integer (ASCII, optional minus, at most 20 digits); ControlError
    naming ``key`` otherwise."""
    t = raw.strip()
    body = t[1:] if t[:1] == b"-" else t
    if not body or len(body) > 20 or not body.isdigit():
        raise ControlError(f"store key {key!r}: refused a value that is not a decimal integer")
    return int(t)


def get_int(store, key: str) -> int:
    """The decimal integer of ``key`` (:func:`parse_int`)."""
    return parse_int(store.get(key), key)


def put(store, key: str, obj) -> None:
    """Encode ``obj`` and set it under ``key``."""
    store.set(key, encode(obj))


def get(store, key: str, type_=None):
    """The value of ``key``, decoded (:func:`decode`)."""
    return decode(store.get(key), key, type_)


# -- the messages of the control plane's own keys (schemas registered by their modules)

ErrorPair = tuple[str, str]
"""``(type name, message)`` of an error handed to other ranks (:func:`weight_transfer.control.protocol.encode_error`)."""


class Ready(TypedDict):
    """``push/{n}/ready/{r}``: training rank ``r`` is ready for push ``n``."""

    version: int | None
    refuse: ErrorPair | None


class Decision(TypedDict):
    """``push/{n}/decision``: the coordinator's one decision for every training rank."""

    go: bool
    version: int | None
    error: ErrorPair | None


class Outcome(TypedDict):
    """``push/{n}/outcome``: how push ``n`` ended, set once (``compare_set``)."""

    ok: bool
    error: ErrorPair | None


class Done(TypedDict):
    """``step/{v}/done/{r}``: training rank ``r``'s result of the update to ``v``."""

    ok: bool
    error: str
    stats: Tagged | None
    cancelled: bool


class Report(TypedDict):
    """``step/{v}/idone/{i}`` / ``step/{v}/committed/{i}``: an inference rank's result; ``stats``
    is free-form data (numbers, strings, lists, dicts) for the records, never acted on."""

    ok: bool
    error: str
    stats: Any


class Proc(TypedDict):
    """``meta/coordinator`` / ``meta/train_proc/{r}``: where a process runs."""

    host: str
    pid: int


class World(TypedDict):
    """``meta/world``: the training and inference world sizes the coordinator plans for."""

    n_train: int
    n_infer: int


def untag_stats(d: dict, key: str) -> dict:
    """A decoded :class:`Done` with its ``stats`` untagged."""
    d["stats"] = untag(d["stats"], key=key)
    return d
