r"""The order of a compressed-tensors artifact's config groups, which one targets the class ``Linear`` and how the
others name their modules.

One scheme: its group targets ``Linear``. Several (a recipe's overrides, a quantized head): the group with the
most modules outside the routed experts targets ``Linear`` and the others list their modules by name, unless a
module of another group is one of the linears vLLM serves fused with others (``q_proj``/``k_proj``/``v_proj``,
``gate_proj``/``up_proj``, DeepSeek's ``q_a_proj``/``kv_a_proj_with_mqa``): then no group targets the class and
every group lists its modules.

A group listing its modules names the routed experts with one ``re:`` target per linear kind
(:func:`compact_targets`, e.g. ``re:model\.layers\.\d+\.mlp\.experts\.\d+\.down_proj$``; a large MoE's group would
otherwise name 384 experts x 61 layers x 3 linears), each checked to match exactly the names it replaces among every
name the artifact's ``quantization_config`` knows (quantized or ignored); where none is exact the names stay listed.
compressed-tensors (``match_name``), vLLM (``_is_equal_or_regex_match`` in the ``utils.py`` below) and kvq's reader
match a ``re:`` target with ``re.match``; the trailing ``$`` makes it whole.

Why (vllm-project/vllm ``vllm/model_executor/layers/quantization/compressed_tensors/utils.py``,
``find_matched_target``, 008014e8503b206a8ae3eb9d17fd46b48b8d2606): vLLM matches a layer's name (exact or ``re:``)
against the targets, then its class name by substring (every vLLM linear's class name contains ``Linear``), and
only then a fused layer's (``qkv_proj``) components by name, so a fused layer whose components a named group lists
would take the class target's scheme. Routed experts are looked up by the names of expert 0's projections
(``compressed_tensors_moe.py``, ``CompressedTensorsMoEMethod.get_moe_method``,
003a1930801d92fec3a2e519d3400a220681b19a), which a named group answers. compressed-tensors and kvq's reader
(:func:`module_group`) match exact names before the class.
"""

from __future__ import annotations

import re

from ..errors import InputError

#: checkpoint linears vLLM serves inside a fused layer (its models' ``packed_modules_mapping``)
VLLM_FUSED = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_a_proj", "kv_a_proj_with_mqa"})
#: a routed expert's linear (``mlp.experts.<e>.gate_proj``, Mixtral's ``block_sparse_moe.experts.<e>.w1``)
ROUTED = re.compile(r"\.experts\.\d+\.")


def order_groups(counts: dict) -> tuple[list, int | None]:
    """``(ordered, class_group)``: ``counts`` (scheme -> its module names) as a list of ``(scheme, names)`` with
    the most modules outside the routed experts first (then the most modules, then the scheme), and the index of
    the group that targets the class ``Linear`` (``0``), or ``None`` when every group must list its modules (module
    docstring)."""
    def outside(names):
        return [n for n in names if not ROUTED.search(n)]

    ordered = sorted(counts.items(), key=lambda kv: (-len(outside(kv[1])), -len(kv[1]), kv[0]))
    fused = any(n.rsplit(".", 1)[-1] in VLLM_FUSED for _, names in ordered[1:] for n in outside(names))
    return ordered, None if fused else 0


def _split(name: str) -> tuple[tuple, tuple]:
    """``(template, numbers)`` of a dotted module name: its parts with each all-digit part as ``None``, and those
    parts (``model.layers.3.mlp.experts.7.up_proj`` -> ``(("model", "layers", None, ...), ("3", "7"))``)."""
    parts = name.split(".")
    return tuple(None if p.isdigit() else p for p in parts), tuple(p for p in parts if p.isdigit())


def _target(template: tuple, slots: list[str]) -> str:
    """The ``re:`` target spelling ``template`` with its k-th number as the regex ``slots[k]``, ending in ``$``."""
    numbers = iter(slots)
    return "re:" + r"\.".join(next(numbers) if p is None else re.escape(p) for p in template) + "$"


def _exact_target(template: tuple, members: dict[str, tuple], known: set[str]) -> str | None:
    """One ``re:`` target matching exactly ``members`` (name -> numbers, one linear kind of routed experts) among
    ``known``: every number ``\\d+``, else the expert's ``\\d+`` and the other numbers (the layer's) as the
    alternation of the values present; ``None`` when neither is exact (an expert of a layer left out)."""
    numbered = [k for k, p in enumerate(template) if p is None]
    after = template.index("experts") + 1
    if after not in numbered:
        return None
    slot = numbered.index(after)
    values = [sorted({nums[j] for nums in members.values()}, key=int) for j in range(len(numbered))]
    narrow = [r"\d+" if j == slot else "(?:" + "|".join(v) + ")" for j, v in enumerate(values)]
    for slots in ([r"\d+"] * len(numbered), narrow):
        target = _target(template, slots)
        regex = re.compile(target[3:])
        if {n for n in known if regex.match(n)} == set(members):  # re.match: compressed-tensors' match_name
            return target
    return None


def compact_targets(names: list[str], known: set[str]) -> list[str]:
    """The ``targets`` of a group listing ``names``: the names outside the routed experts as they are and the routed
    experts' as one ``re:`` target per linear kind (module docstring) that matches exactly their names among
    ``known`` (every module name the config knows: quantized, ignored), or their names where none does; sorted."""
    plain, routed = [], {}
    for n in names:
        if ROUTED.search(n):
            template, numbers = _split(n)
            routed.setdefault(template, {})[n] = numbers
        else:
            plain.append(n)
    for template, members in routed.items():
        target = _exact_target(template, members, known | set(members))
        plain += [target] if target else list(members)
    return sorted(plain)


def module_group(qc: dict, module: str) -> dict:
    """The config group that applies to ``module`` (exact name before ``re:`` regex before class target).

    Raises:
        InputError: no group applies.
    """
    groups = list((qc.get("config_groups") or {}).values())
    for g in groups:
        if module in (g.get("targets") or []):
            return g
    for g in groups:
        for t in g.get("targets") or []:
            if t.startswith("re:"):
                if re.match(t[3:], module):  # as compressed-tensors match_name does
                    return g
    for g in groups:
        if "Linear" in (g.get("targets") or []):
            return g
    raise InputError(f"no quantization config group applies to {module}")
