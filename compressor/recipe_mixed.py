"""Per-module schemes of a recipe: the ``(weights, activations)`` pair each quantized linear gets, the algorithm
that quantizes it and the check of every pair (mixed formats, e.g. a MoE model's routed experts W4A8 beside FP8
W8A8 attention, as compressed-tensors' ``mixed-precision`` format and vLLM's per-layer scheme selection read them).

An override (``compressor.recipe.Override``) whose ``weights`` set ``type`` is a whole weight scheme: its fields
not given take :class:`~compressor.recipe_schemes.WeightScheme`'s defaults. Without ``type`` it changes the fields
it gives of what the module has so far (the older integer overrides). ``activations`` given (a scheme, or
``null``: 16-bit inputs) replace the module's; left out, the module keeps what it has so far. Matching overrides
apply in order, later ones win.

Algorithms per format in a recipe with overrides: each module is quantized by the recipe's algorithm, except FP8
modules under an algorithm with :attr:`~compressor.quant.algorithms.Algorithm.fp8_fallback` (GPTQ, GPTAQ), which
RTN quantizes (absmax / 448: what FP8 W8A8 recipes do; GPTQ on the e4m3 grid is not implemented). AWQ and
AWQ+GPTQ with FP8 modules are refused (their scale search spans a layer's scaling groups, FP8 members included).
Every module's pair, the stack of the overrides matching it applied in order, is checked by
:func:`compressor.recipe_schemes.check_float_scheme` as a recipe-wide scheme would be (with its module's algorithm):
when the recipe is read, the recipe's own pair and each override's, an override refused alone passing when a stack
with the others makes it valid (:func:`check_schemes`); once the model's names are known, every module's stack
(:func:`by_pair`).
"""

from __future__ import annotations

from itertools import combinations
from typing import TYPE_CHECKING, Iterable, Optional

from .errors import InputError
from .recipe_schemes import FULL_DUMP, ActivationScheme, WeightScheme, check_float_scheme
from .registry import ALGORITHMS

if TYPE_CHECKING:
    from .recipe import Override, Recipe

Pair = tuple[WeightScheme, Optional[ActivationScheme]]


def resolve(weights: WeightScheme, activations: Optional[ActivationScheme], overrides: Iterable["Override"]) -> Pair:
    """``(weights, activations)`` after ``overrides`` (those matching one module, in order) are applied to the
    recipe's ``weights`` and ``activations`` (module docstring: a ``type`` makes an override's weights whole)."""
    data = weights.model_dump(context=FULL_DUMP)
    for ov in overrides:
        given = {k: v for k, v in ov.weights.model_dump(context=FULL_DUMP).items() if v is not None}
        base = WeightScheme().model_dump(context=FULL_DUMP) if "type" in given else data
        data = {**base, **given}
        if "activations" in ov.model_fields_set:
            activations = ov.activations
    return WeightScheme.model_validate(data), activations


def is_fp8(w: WeightScheme) -> bool:
    """FP8 e4m3 weights (``type: float``, ``num_bits: 8``; NVFP4 and MXFP4 are ``num_bits: 4``)."""
    return w.type == "float" and w.num_bits == 8


def module_algorithm(recipe: "Recipe", w: WeightScheme) -> str:
    """The algorithm that quantizes the modules with weights ``w``: the recipe's, or ``rtn`` for FP8 modules of a
    recipe with overrides whose algorithm has :attr:`~compressor.quant.algorithms.Algorithm.fp8_fallback`."""
    algorithm = ALGORITHMS.find(recipe.algorithm)
    if recipe.overrides and is_fp8(w) and algorithm is not None and not algorithm.fp8_grid \
            and getattr(algorithm, "fp8_fallback", False):
        return "rtn"
    return recipe.algorithm


def module_recipe(recipe: "Recipe", w: WeightScheme, a: Optional[ActivationScheme]) -> "Recipe":
    """``recipe`` as one module's: ``w`` and ``a`` recipe-wide, no overrides, the module's algorithm
    (:func:`module_algorithm`); not validated again (:func:`check_pair` checks it)."""
    return recipe.model_copy(update={"weights": w, "activations": a, "overrides": [],
                                     "algorithm": module_algorithm(recipe, w)})


def pairs(recipe: "Recipe") -> list[tuple[str, WeightScheme, Optional[ActivationScheme]]]:
    """``(where, weights, activations)``: the recipe's own scheme (``weights``) and, for each override, the recipe's
    scheme with that override alone applied (``overrides[k]``). A module several overrides match has the pair of
    their stack (:func:`by_pair` checks those once the model's names are known)."""
    out = [("weights", recipe.weights, recipe.activations)]
    out += [(f"overrides[{k}]", *resolve(recipe.weights, recipe.activations, [ov]))
            for k, ov in enumerate(recipe.overrides)]
    return out


def check_pair(recipe: "Recipe", w: WeightScheme, a: Optional[ActivationScheme]) -> str | None:
    """What is wrong with one module's pair in a recipe with overrides (``None``: nothing): the recipe-wide rules
    (:func:`~compressor.recipe_schemes.check_float_scheme` with the module's algorithm), then what a mixed recipe
    does not implement: AWQ and AWQ+GPTQ on FP8 modules, GPTQ's ``refine`` with FP8 modules, NVFP4 activations."""
    if a is not None and a.num_bits == 4:
        return "NVFP4 activations (W4A4) in a recipe with overrides are not implemented"
    algorithm = module_algorithm(recipe, w)
    found = ALGORITHMS.find(algorithm)
    if is_fp8(w) and found is not None and found.quantizes_weights and not found.fp8_grid:
        fits = ", ".join(n for n in ALGORITHMS.names() if getattr(ALGORITHMS.find(n), "fp8_fallback", False))
        return (f"algorithm {algorithm} is not implemented on FP8 modules (its scale search spans a layer's "
                f"linears); in a mixed recipe FP8 modules are quantized with RTN under rtn or {fits}")
    if algorithm != recipe.algorithm and recipe.refine is not None:
        return "the refine section with FP8 modules (quantized with RTN) is not implemented; remove it"
    return check_float_scheme(module_recipe(recipe, w, a))


#: overrides up to which :func:`check_schemes` tries every stack an override can be part of before refusing it
#: (2 ** (n - 1) stacks an override at most); beyond, each module's stack is checked once the model's names are
#: known (:func:`by_pair`)
STACK_LIMIT = 8


def _stack_problem(recipe: "Recipe", stack: tuple[int, ...]) -> str | None:
    """What is wrong with the pair the overrides ``stack`` (indices, in order) give a module they all match: the
    problem of :func:`check_pair`, and when the last override inherits the module's activations (the recipe's, or
    an earlier override's) and the weights alone are fine, the hint to give it 16-bit inputs."""
    overrides = [recipe.overrides[j] for j in stack]
    w, a = resolve(recipe.weights, recipe.activations, overrides)
    problem = check_pair(recipe, w, a)
    givers = [j for j, ov in zip(stack, overrides) if "activations" in ov.model_fields_set]
    inherited = a is not None and overrides and "activations" not in overrides[-1].model_fields_set
    if problem and inherited and check_pair(recipe, w, None) is None:
        who = "the override inherits" if len(stack) == 1 else "the overrides inherit"
        if givers:
            problem += f"; overrides[{stack[-1]}] inherits overrides[{givers[-1]}]'s activations: give it " \
                       "`activations: null` (16-bit inputs)"
        else:
            problem += f"; {who} the recipe's activations: give {'it' if len(stack) == 1 else 'the last'} " \
                       "`activations: null` (16-bit inputs)"
    return problem


def _rescued(recipe: "Recipe", k: int) -> bool:
    """Whether override ``k``, refused alone, gives a pair :func:`check_pair` accepts stacked with some of the other
    overrides (in the recipe's order): then only the modules' stacks are checked (:func:`by_pair`). More than
    :data:`STACK_LIMIT` overrides: assumed so."""
    n = len(recipe.overrides)
    if n > STACK_LIMIT:
        return True
    others = [j for j in range(n) if j != k]
    return any(_stack_problem(recipe, tuple(sorted((*chosen, k)))) is None
               for r in range(1, n) for chosen in combinations(others, r))


def check_schemes(recipe: "Recipe") -> str | None:
    """What is wrong with a recipe's schemes (``None``: nothing): :func:`check_float_scheme` for a recipe without
    overrides; with overrides, :func:`check_pair` for its own scheme and each override's (prefixed with where it
    is: ``weights:``, ``overrides[1]:``), and an algorithm that would quantize none of its modules. An override
    refused alone is refused only when no stack with the other overrides rescues it (:func:`_rescued`: a module
    all of them match has the pair of the stack, e.g. one override making the weights symmetric and a later one
    adding fp8 inputs): which stacks occur is known with the model's names (:func:`by_pair`)."""
    if not recipe.overrides:
        return check_float_scheme(recipe)
    if problem := check_pair(recipe, recipe.weights, recipe.activations):
        return f"weights: {problem}"
    for k in range(len(recipe.overrides)):
        if (problem := _stack_problem(recipe, (k,))) and not _rescued(recipe, k):
            return f"overrides[{k}]: {problem}"
    algorithm = ALGORITHMS.find(recipe.algorithm)
    if algorithm is not None and algorithm.quantizes_weights and \
            all(module_algorithm(recipe, w) != recipe.algorithm for _, w, _ in pairs(recipe)):
        return (f"algorithm {recipe.algorithm} quantizes none of the recipe's schemes (FP8 modules are quantized "
                "with RTN): set algorithm rtn")
    return None


def pair_key(w: WeightScheme, a: Optional[ActivationScheme]) -> str:
    """A hashable key of a pair (pydantic models are not hashable): its full JSON."""
    return w.model_dump_json(context=FULL_DUMP) + "|" + ("null" if a is None else a.model_dump_json())


def by_pair(recipe: "Recipe", in_features: dict[str, int]) -> list[tuple]:
    """The targeted modules (name -> ``in_features``) grouped by their pair: ``[(weights, activations,
    {name: in_features})]`` in first-seen order. With overrides each module's pair, the stack of the overrides
    matching it applied in order, is checked (:func:`check_pair`): pairs the recipe's own check never saw.

    Raises:
        InputError: a pair the rules refuse, naming the overrides that make it and up to three of its modules.
    """
    groups: dict[str, tuple] = {}
    resolved: dict[tuple, tuple] = {}  # by the overrides matching a module: one resolve each (a MoE's 10^5 experts)
    stacks: dict[tuple, list[str]] = {}  # the modules of each stack
    for name, k in in_features.items():
        hits = tuple(j for j, ov in enumerate(recipe.overrides) if ov.applies_to(name))
        if hits not in resolved:
            w, a = resolve(recipe.weights, recipe.activations, [recipe.overrides[j] for j in hits])
            resolved[hits] = (w, a, pair_key(w, a))
        w, a, key = resolved[hits]
        groups.setdefault(key, (w, a, {}))[2][name] = k
        stacks.setdefault(hits, []).append(name)
    for hits, members in stacks.items() if recipe.overrides else ():
        if problem := _stack_problem(recipe, hits):
            names = sorted(members)
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            made = " then ".join(f"overrides[{j}]" for j in hits) or "weights"
            raise InputError(f"recipe {made} give{'s' if len(hits) < 2 else ''} {shown} a scheme that is refused: "
                             f"{problem}")
    return list(groups.values())
