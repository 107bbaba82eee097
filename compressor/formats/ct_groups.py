"""The order of a compressed-tensors artifact's config groups and which one targets the class ``Linear``.

One scheme: its group targets ``Linear``. Several (a recipe's overrides, a quantized head): the group with the
most modules outside the routed experts targets ``Linear`` and the others list their modules by name, unless a
module of another group is one of the linears vLLM serves fused with others (``q_proj``/``k_proj``/``v_proj``,
``gate_proj``/``up_proj``, DeepSeek's ``q_a_proj``/``kv_a_proj_with_mqa``): then no group targets the class and
every group lists its modules.

Why (vllm-project/vllm ``vllm/model_executor/layers/quantization/compressed_tensors/utils.py``,
``find_matched_target``, 008014e8503b206a8ae3eb9d17fd46b48b8d2606): vLLM matches a layer's name (exact or ``re:``)
against the targets, then its class name by substring (every vLLM linear's class name contains ``Linear``), and
only then a fused layer's (``qkv_proj``) components by name, so a fused layer whose components a named group lists
would take the class target's scheme. Routed experts are looked up by the names of expert 0's projections
(``compressed_tensors_moe.py``, ``CompressedTensorsMoEMethod.get_moe_method``,
003a1930801d92fec3a2e519d3400a220681b19a), which a named group answers. compressed-tensors and kvq's reader
(:func:`compressor.formats.compressed_tensors.module_group`) match exact names before the class.
"""

from __future__ import annotations

import re

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
