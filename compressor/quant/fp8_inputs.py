"""FP8 W8A8 and W4A8 inputs in a loaded model: each quantized linear's input quantized as the serving
kernel does (dynamic fp8 per token or per group, :func:`compressor.quant.fp8.fake_quantize_activation`),
for ``kvq verify``'s transformers model (:func:`compressor.artifact.load_artifact`, and the streamed
verify's model a layer at a time).

A plain ``nn.Linear`` gets a ``forward_pre_hook``; the routed experts of transformers' fused experts
module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), which no hook can reach per expert,
get a forward of their own with the arithmetic of :class:`compressor.moe.UnfusedExperts` and the
inputs quantized. Parameters are never changed, so weights loaded later (streamed) are used as they come.
"""

from __future__ import annotations

import torch

from ..arch import find_module, get_module, is_expert
from ..errors import InputError
from .fp8 import fake_quantize_activation


def activation_hook(act: str, group_size: int):
    """A ``forward_pre_hook`` quantizing a Linear's input with :func:`fake_quantize_activation`."""

    def hook(_module, args):
        return (fake_quantize_activation(args[0], act, group_size), *args[1:])

    return hook


def _experts_forward(module, acts: dict[int, tuple[tuple[str, int], tuple[str, int]]]):
    """The forward of transformers' fused experts module (``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``; the arithmetic of :class:`compressor.moe.UnfusedExperts`) with each
    expert's inputs quantized: ``acts[e] = ((act, group) of gate/up's input, (act, group) of down's)``."""
    linear = torch.nn.functional.linear

    def quant(x, spec):
        return fake_quantize_activation(x, spec[0], spec[1]) if spec[0] else x

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        n = module.gate_up_proj.shape[0]
        flat = top_k_index.reshape(-1)
        for e in torch.unique(flat[(flat >= 0) & (flat < n)]).tolist():
            token_idx, slot = torch.where(top_k_index == e)
            a_in, a_mid = acts.get(e, (("", 0), ("", 0)))
            gate, up = linear(quant(hidden_states[token_idx], a_in), module.gate_up_proj[e]).chunk(2, dim=-1)
            y = linear(quant(module.act_fn(gate) * up, a_mid), module.down_proj[e])
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, slot, None]).to(out.dtype))
        return out

    return forward


def install_activation_quant(model, arch, acts: dict[str, tuple[str, int]]) -> int:
    """Make ``model`` (a transformers model read by :func:`compressor.artifact.load_artifact`)
    quantize each listed linear's input as the serving kernel does (:func:`fake_quantize_activation`).

    Args:
        acts: in-memory module name -> ``(act, group size)`` (``fp8-token`` / ``fp8-group``);
            routed experts by their per-expert names (``<layers>.<i>.<experts>.<e>.gate_proj``),
            which a fused experts module (transformers 5) serves through a forward of its own
            (:func:`_experts_forward`), parameters unchanged.

    Returns:
        The number of linears whose input is quantized; ``model.kvq_input_quantization`` lists the
        schemes (``fp8-token``, ``fp8-group 128``) when there is one.
    """
    experts: dict[int, dict[int, list]] = {}
    prefix = arch.layers + "."
    for name, spec in acts.items():
        rel = name[len(prefix):].split(".", 1)[1] if name.startswith(prefix) else None
        module = find_module(model, name)
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(activation_hook(*spec))
        elif rel is not None and is_expert(arch, rel):
            i = int(name[len(prefix):].split(".", 1)[0])
            e, _, proj = rel[len(arch.moe.experts) + 1:].partition(".")
            pair = experts.setdefault(i, {}).setdefault(int(e), [("", 0), ("", 0)])
            pair[1 if proj == "down_proj" else 0] = spec
        else:
            raise InputError(f"{name}: no linear of the model takes its quantized input")
    for i, by_expert in experts.items():
        fused = get_module(get_module(model, arch.layers)[i], arch.moe.experts)
        fused.forward = _experts_forward(fused, {e: tuple(p) for e, p in by_expert.items()})
    if acts:  # what the report says the artifact's rows ran with
        model.kvq_input_quantization = sorted({f"{a} {g}" if a == "fp8-group" else a for a, g in acts.values()})
    return len(acts)
