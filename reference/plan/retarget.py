"""Recipes aimed at the runtime tensors a live engine reports (C20 of shared/CASES.md).

:func:`weight_transfer.plan.build_recipes` writes the engine's tensors as ``load_weights`` fills
them. A running engine may compute with other memory: a packed copy of a linear weight, a
permuted expert tensor (``engines/vllm/worker/runtime.py`` classifies what vLLM reports). The engine
side publishes, per inference rank, an object with

- ``targets``: records with ``param`` (the engine tensor a recipe writes), ``name`` (the
  runtime tensor holding its bytes), ``shape`` (logical), ``dtype`` and ``layout``
  (:mod:`weight_transfer.convert.layouts`), and ``targets_of(param)``;
- ``refused``: ``(tensor, why)`` pairs for tensors whose runtime bytes cannot be written;
- ``pid``: the process, for messages.

:func:`retarget` rewrites the recipes accordingly, or refuses the plan before any byte moves.
This module imports nothing from engines/.
"""
from __future__ import annotations

from ..convert.layouts import IDENTITY

__all__ = ["retarget"]


def retarget(recipes, layouts: dict, *, names: dict[str, str] | None = None):
    """The recipes of :func:`weight_transfer.plan.build_recipes` (engine tensor names, load layout)
    aimed at the runtime tensors the live engine reports (``layouts``: inference rank -> the
    object described in the module docstring): each output to engine tensor ``T`` becomes one
    recipe per runtime target of ``T`` (the tensor itself, a packed copy, or both), with the
    target's layout and dtype (a float32 target of a BF16 weight is a planned, exact cast).
    ``names`` maps a recipe tensor name to the engine's name where they differ.

    Raises :class:`weight_transfer.plan.PlanError` before any byte moves, listing every tensor
    refused by the engine side that a recipe writes (with the reason, e.g. the post-processing
    step), every recipe tensor the engine does not have, a dtype the recipe cannot make, and
    targets that differ between the ranks of one recipe."""
    from ..types import Output, Recipe
    from . import PlanError, RecipeSet

    names = names or {}
    problems: list[str] = []
    refused = {(rk, t): why for rk, lay in layouts.items() for t, why in lay.refused}
    out: list[Recipe] = []
    for rec in recipes:
        if rec.transform != "copy":
            fp8 = [o.tensor for o in rec.outputs]
            if any(layouts[rk].targets_of(names.get(t, t)) and layouts[rk].targets_of(names.get(t, t))[0].layout != IDENTITY
                   for rk in rec.ranks for t in fp8):
                problems.append(f"{rec.name!r}: {rec.transform} output into a post-processed runtime layout")
                continue
        new_outs: list[list] = []
        bad = False
        for o in rec.outputs:
            t = names.get(o.tensor, o.tensor)
            per_rank = []
            for rk in rec.ranks:
                why = refused.get((rk, t))
                if why is not None:
                    problems.append(f"{t!r} on rank {rk}: {why}")
                    bad = True
                    break
                tg = layouts[rk].targets_of(t)
                if not tg:
                    problems.append(f"{t!r} on rank {rk}: the running engine (pid {layouts[rk].pid}) has no such tensor "
                                    f"(needed by recipe {rec.name!r})")
                    bad = True
                    break
                per_rank.append(tuple((g.name, g.layout, g.shape, g.dtype) for g in tg))
            if bad:
                break
            if len(set(per_rank)) != 1:
                problems.append(f"{t!r}: runtime targets differ between ranks {rec.ranks}: {sorted(set(per_rank))}")
                bad = True
                break
            outs = []
            for nm, lay, _, dt in per_rank[0]:
                if dt != o.dtype and not (rec.transform == "copy" and dt == "float32"):
                    problems.append(f"{nm!r}: the engine holds {dt}, recipe {rec.name!r} makes {o.dtype}")
                    bad = True
                # a float32 runtime copy of a BF16 weight (the packed router) is a planned, exact cast
                outs.append(Output(nm, o.box, dt, lay))
            new_outs.append(outs)
        if bad:
            continue
        if rec.transform != "copy":
            out.append(Recipe(rec.name, rec.ranks, rec.shape, rec.assembled_dtype, rec.pieces, rec.transform,
                              tuple(o[0] for o in new_outs)))
            continue
        (targets,) = new_outs
        for i, o in enumerate(targets):
            nm = rec.name if i == 0 else f"{rec.name}->{o.tensor}"
            out.append(Recipe(nm, rec.ranks, rec.shape, rec.assembled_dtype, rec.pieces, "copy", (o,)))
    if problems:
        seen = list(dict.fromkeys(problems))
        body = "\n".join(f"  - {p}" for p in seen[:20])
        more = f"\n  ... and {len(seen) - 20} more" if len(seen) > 20 else ""
        raise PlanError(f"weight plan refused for {recipes.model or 'recipe set'} against the running vLLM: "
                        f"{len(seen)} tensor(s) whose runtime bytes cannot be written as planned, first "
                        f"{seen[0]}\n{body}{more}")
    return RecipeSet(out, recipes.ignored, layout=recipes.layout, model=recipes.model, kept=recipes.kept)
