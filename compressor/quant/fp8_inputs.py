"""FP8 W8A8, W4A8 and NVFP4 W4A4 inputs in a loaded model: each quantized linear's input quantized as the serving
kernel does (dynamic fp8 per token or per group, :func:`compressor.quant.fp8.fake_quantize_activation`; NVFP4 per
16 over a static global scale, :func:`compressor.quant.fp4_inputs.fake_quantize_input`),
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
from .fp4_inputs import ACT as NVFP4_ACT, fake_quantize_input
from .fp8 import fake_quantize_activation


def quantize_input(x: torch.Tensor, spec: tuple, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., K]`` quantized as the serving kernel quantizes a linear's input: ``spec`` ``(act, group size)``
    for fp8 (:func:`fake_quantize_activation`), ``("nvfp4", 16, input_global_scale)`` for NVFP4 W4A4
    (:func:`compressor.quant.fp4_inputs.fake_quantize_input`); returned in ``dtype`` (default ``x``'s).

    Raises:
        InputError: an unknown ``act``, or an NVFP4 input width that is not a multiple of 16.
    """
    if spec[0] == NVFP4_ACT:
        return fake_quantize_input(x, spec[2], dtype)
    return fake_quantize_activation(x, spec[0], spec[1], dtype=dtype)


def activation_hook(spec: tuple):
    """A ``forward_pre_hook`` quantizing a Linear's input with :func:`quantize_input` (``spec`` as there)."""

    def hook(_module, args):
        return (quantize_input(args[0], spec), *args[1:])

    return hook


def _experts_forward(module, acts: dict[int, tuple[tuple, tuple]]):
    """The forward of transformers' fused experts module (``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``; the arithmetic of :class:`compressor.moe.UnfusedExperts`) with each
    expert's inputs quantized: ``acts[e] = (spec of gate/up's input, spec of down's)`` (:func:`quantize_input`)."""
    linear = torch.nn.functional.linear

    def quant(x, spec):
        return quantize_input(x, spec) if spec[0] else x

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


def install_activation_quant(model, arch, acts: dict[str, tuple]) -> int:
    """Make ``model`` (a transformers model read by :func:`compressor.artifact.load_artifact`)
    quantize each listed linear's input as the serving kernel does (:func:`quantize_input`).

    Args:
        acts: in-memory module name -> ``(act, group size)`` (``fp8-token`` / ``fp8-group``) or ``("nvfp4", 16,
            input_global_scale)`` (NVFP4 W4A4; :func:`quantize_input`);
            routed experts by their per-expert names (``<layers>.<i>.<experts>.<e>.gate_proj``),
            which a fused experts module (transformers 5) serves through a forward of its own
            (:func:`_experts_forward`), parameters unchanged.

    Returns:
        The number of linears whose input is quantized; ``model.kvq_input_quantization`` lists the
        schemes (``fp8-token``, ``fp8-group 128``, ``nvfp4``) when there is one.
    """
    experts: dict[int, dict[int, list]] = {}
    prefix = arch.layers + "."
    for name, spec in acts.items():
        rel = name[len(prefix):].split(".", 1)[1] if name.startswith(prefix) else None
        module = find_module(model, name)
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(activation_hook(spec))
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
        model.kvq_input_quantization = sorted({f"{s[0]} {s[1]}" if s[0] == "fp8-group" else s[0]
                                               for s in acts.values()})
    return len(acts)
