"""Fast constructors of the plan's record types, for the schedule's inner loop.

At Kimi-K2 scale the schedule holds about 1.1 million :class:`~weight_transfer.types.WriteSpec`, 500k
:class:`~weight_transfer.types.Assignment` and 500k :class:`~weight_transfer.types.Task`. A frozen
dataclass's ``__init__`` goes through ``object.__setattr__`` once per field; these constructors
allocate with ``object.__new__`` and set the slots through their descriptors directly (and a
named tuple through ``tuple.__new__``, one C call), making objects equal to the constructed
ones (``tests/plan/test_plan.py::test_fast_constructors_equal_the_dataclass_ones`` checks it).
Recipes and pieces (and outputs) come from :func:`weight_transfer.types.new_recipe` and friends,
re-exported here as ``_recipe`` / ``_piece``; nothing else in the planner builds these types by hand.
"""
from __future__ import annotations

from collections import deque
from functools import partial
from itertools import repeat

from ..types import _NEW, Assignment, Recipe, Task, WriteSpec, _slot_setters
from ..types import new_piece as _piece
from ..types import new_recipe as _recipe

__all__ = ["new_write", "_write_spec", "_assignment", "_task", "_recipe", "_piece", "tasks_of", "assignments_of"]

new_write = partial(tuple.__new__, WriteSpec)
"""``new_write((output, dst_rank, remote_offset, length))`` -> that :class:`WriteSpec`, in C."""

_A_SET, _T_SET = _slot_setters(Assignment), _slot_setters(Task)
assert Assignment.__slots__ == ("recipe", "writes")
assert Task.__slots__ == ("id", "group", "sources", "mesh", "assignments", "source_bytes", "temp_bytes",
                          "local_sources"), "weight_transfer.types.Task changed: update _task"


def _write_spec(output: int, dst_rank: int, remote_offset: int, length: int) -> WriteSpec:
    """``WriteSpec(output, dst_rank, remote_offset, length)``, in one C call."""
    return new_write((output, dst_rank, remote_offset, length))


def _assignment(recipe: Recipe, writes: tuple[WriteSpec, ...], _a0=_A_SET[0], _a1=_A_SET[1]) -> Assignment:
    """``Assignment(recipe, writes)``, fast."""
    a = _NEW(Assignment)
    _a0(a, recipe)
    _a1(a, writes)
    return a


def _task(id, group, sources, mesh, assignments, source_bytes, temp_bytes, local_sources, _set=_T_SET) -> Task:
    """``Task(id, group, sources, mesh, assignments, source_bytes, temp_bytes, local_sources)``
    with every field positional, fast."""
    t = _NEW(Task)
    a, b, c, d, e, f, g, h = _set
    a(t, id)
    b(t, group)
    c(t, sources)
    d(t, mesh)
    e(t, assignments)
    f(t, source_bytes)
    g(t, temp_bytes)
    h(t, local_sources)
    return t


def _columns(cls, setters, n: int, columns) -> list:
    """``n`` new ``cls`` objects, field ``k`` of object ``i`` set to ``columns[k][i]``: one
    C-level pass per field (``map`` over the slot descriptors' ``__set__``) instead of a Python
    call per object -- three to five times faster for the 500k tasks of a Kimi-K2 plan."""
    objs = list(map(_NEW, repeat(cls, n)))  # columns may be iterators
    for put, col in zip(setters, columns, strict=True):
        deque(map(put, objs, col), maxlen=0)
    return objs


def tasks_of(ids, groups, sources, meshes, assignments, source_bytes, temp_bytes, local_sources) -> list[Task]:
    """``[Task(*fields) for fields in zip(ids, ...)]`` (``ids`` a sequence, the other columns
    iterables of the same length), built column by column (:func:`_columns`)."""
    return _columns(Task, _T_SET, len(ids), (ids, groups, sources, meshes, assignments, source_bytes, temp_bytes,
                                             local_sources))


def assignments_of(recipes, writes) -> list[Assignment]:
    """``[Assignment(r, w) for r, w in zip(recipes, writes)]``, built column by column."""
    return _columns(Assignment, _A_SET, len(recipes), (recipes, writes))
