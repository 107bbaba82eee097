"""One weight scheme for all routed experts of a MoE layer, checked when the recipe's schemes are resolved.

vLLM builds a MoE layer's routed experts as one ``FusedMoE`` layer and picks its quantization method once per
layer from the config group that matches expert 0's ``gate_proj``, ``up_proj`` and ``down_proj``, which must agree
(vllm-project/vllm ``vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe.py``,
``CompressedTensorsMoEMethod.get_moe_method``, 003a1930801d92fec3a2e519d3400a220681b19a): every expert of the layer
is served with that one scheme (a linear left in float is a scheme of its own: no group matches it). A recipe whose
overrides or ``ignore`` list give one layer's routed experts several schemes (an override catching only the experts'
``down_proj``, or only some experts) would be written and read by kvq but not served by vLLM, so it is refused
before the weights are loaded (``kvq quantize`` runs the check on the model built from its configuration).
"""

from __future__ import annotations

from .arch import ArchSpec, get_module, is_expert, layer_linears
from .errors import InputError


def scheme_label(scheme) -> str:
    """A :class:`~compressor.quant.primitives.Scheme` in words (``int4 g128 symmetric, fp8-token inputs``,
    ``FP8 per channel, fp8-token inputs``, ``NVFP4, 16-bit inputs``); ``None`` (a linear left in float) is
    ``float (not quantized)``."""
    if scheme is None:
        return "float (not quantized)"
    if scheme.type == "float":
        grid = ("MXFP4" if scheme.group_size == 32 else "NVFP4") if scheme.num_bits == 4 else "FP8"
        cells = "" if scheme.num_bits == 4 else " per channel" if scheme.group_size == -1 else \
            f" {scheme.rows} x {scheme.group_size} blocks" if scheme.rows > 1 else f" g{scheme.group_size}"
        weights = grid + cells
    else:
        cells = "per channel" if scheme.group_size == -1 else f"g{scheme.group_size}"
        weights = f"int{scheme.num_bits} {cells} {'symmetric' if scheme.symmetric else 'asymmetric'}"
    return f"{weights}, {scheme.act or '16-bit'} inputs"


def check_expert_schemes(model, arch: ArchSpec, schemes: dict) -> dict:
    """Returns ``schemes`` (module name -> :class:`~compressor.quant.primitives.Scheme` of every quantized linear)
    once each MoE layer of ``model`` (meta tensors suffice; routed experts fused or not) gives all its routed
    experts' linears one scheme, a linear missing from ``schemes`` (left in float) counting as one (module
    docstring). ``model`` ``None``: not checked.

    Raises:
        InputError: one line naming the first layer whose routed experts get several schemes, each scheme with how
            many of its linears have it and one of them.
    """
    if model is None or arch.moe is None:
        return schemes
    for i, layer in enumerate(get_module(model, arch.layers)):
        found: dict = {}
        for rel in layer_linears(arch, layer):
            if is_expert(arch, rel):
                found.setdefault(schemes.get(f"{arch.layers}.{i}.{rel}"), []).append(rel)
        if len(found) > 1:
            parts = "; ".join(f"{scheme_label(s)}: {len(rels)} linears (e.g. {rels[0]})" for s, rels in found.items())
            raise InputError(f"{arch.layers}.{i}: the recipe gives this MoE layer's routed experts {len(found)} "
                             f"schemes ({parts}); vLLM serves one scheme for all routed experts of a layer (its "
                             "fused MoE kernel): give every expert's gate_proj, up_proj and down_proj the same "
                             "scheme in the recipe's overrides and ignore list")
    return schemes
