"""NVFP4 activations (W4A4): each quantized linear's input quantized to FP4 e2m1 with e4m3 scales per 16 values
computed on every call ("dynamic local"), under a static per-linear ``input_global_scale`` that calibration observes.

The numerics follow compressed-tensors 0.20's preset ``NVFP4`` (``quantization/quant_scheme.py``: the inputs'
args are ``tensor_group``, group 16, ``dynamic: local``, observer ``static_minmax``; ``utils/helpers.py``
``generate_gparam``: ``g = 448 * 6 / absmax``) and the way vLLM serves it (``CompressedTensorsW4A4Fp4``: it reads
``<module>.input_global_scale`` float32 ``[1]`` per partition and keeps the ``max()`` over a fused layer's
partitions; its ``scaled_fp4_quant`` kernel and the reference ``ref_nvfp4_quant`` quantize the input per call),
as ``docs/formats.md`` ("NVFP4 W4A4") cites:

* calibration: the largest ``|x|`` of each targeted linear's input over every calibration token, seen on the
  pass that recomputes a layer's outputs with its quantized weights (:class:`InputObserver`); ``g`` from that
  absmax (:func:`compressor.quant.fp4.global_scale`); the linears vLLM fuses (q/k/v, gate/up, DeepSeek's
  q_a/kv_a) read one input and share the ``g`` of their largest absmax (:func:`shared_input_scales`); a routed
  expert no calibration token reached takes the largest absmax of the same projection of the layer's other
  experts (an input they all read: the hidden state, or the width of their ``down_proj``), else ``g = 1``.
* per call (:func:`fake_quantize_input`): scale ``s = e4m3(clamp(g * (absmax_16 / 6), ±448))``, code
  ``q = e2m1(clamp(x / (s / g), -6, 6))`` (the kernel multiplies by reciprocals; a scale that rounds to 0
  gives codes 0), value ``q * s / g`` in float32.

Shapes: inputs ``[..., K]`` with ``K`` a multiple of 16. Every function is side-effect free, except the
observer's recording and :func:`record_input_scales`, which sets the records' ``input_global_scale``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..arch import expert_index, find_module, layer_fused_sets
from ..errors import InputError, QuantizationError
from .fp4 import FP4_MAX, FP8_MAX, GROUP, e2m1_codes, e2m1_values, global_scale

#: ``act`` of NVFP4 activations (:class:`~compressor.quant.primitives.Scheme`,
#: :class:`~compressor.formats.base.QuantWeight`)
ACT = "nvfp4"


def _reciprocal(t: torch.Tensor) -> torch.Tensor:
    """``1 / t`` in float32, 0 where ``t`` is 0 (the kernel's reciprocal of a zero scale)."""
    return torch.where(t == 0, torch.zeros_like(t), 1.0 / t)


@torch.no_grad()
def fake_quantize_input(x: torch.Tensor, input_global_scale: torch.Tensor,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., K]`` quantized to NVFP4 and back as vLLM's W4A4 kernel quantizes a linear's input (module
    docstring), in float32: per row and 16 consecutive columns ``s = e4m3(clamp(g * (absmax_16 * (1/6)),
    ±448))`` (nearest, ties to even, saturated), ``q = e2m1(x * (1 / (s * (1 / g))))`` (nearest, ties to the
    even code, saturated at ±6; every code 0 where ``s`` is 0) and the value ``q * (s / g)``, returned in
    ``dtype`` (default ``x``'s). ``g``: the linear's ``input_global_scale`` (float32 ``[1]``). An empty ``x``
    is returned as it is.

    Raises:
        InputError: ``K`` is not a multiple of 16.
    """
    dtype = dtype or x.dtype
    if x.numel() == 0:
        return x.to(dtype)
    k = x.shape[-1]
    if k % GROUP:
        raise InputError(f"NVFP4 activations come in groups of {GROUP}: input width {k}")
    g = input_global_scale.float().reshape(()).to(x.device)
    xg = x.float().reshape(*x.shape[:-1], k // GROUP, GROUP)
    amax = xg.abs().amax(dim=-1, keepdim=True)
    sixth = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32, device=x.device)  # the kernel multiplies by 1/6
    s = (g * (amax * sixth)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    codes = e2m1_codes(xg * _reciprocal(s * _reciprocal(g)))
    return (e2m1_values(codes) * (s / g)).reshape(x.shape).to(dtype)


def shared_input_scales(absmax: dict[str, float], fused: list[tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """Each linear's ``input_global_scale`` (float32 ``[1]``, ``448 * 6 / absmax``, 1 for an absmax of 0) from
    the absmax of its calibration inputs, the members of each ``fused`` set sharing the one of their largest
    absmax (vLLM keeps one input global scale per fused GEMM).

    Args:
        absmax: module name -> largest ``|x|`` of its input over the calibration tokens.
        fused: sets of module names; names missing from ``absmax`` are ignored.
    """
    shared = dict(absmax)
    for names in fused:
        present = [n for n in names if n in absmax]
        top = max((absmax[n] for n in present), default=0.0)
        shared.update({n: top for n in present})
    return {n: global_scale(a) for n, a in shared.items()}


class InputObserver:
    """The largest ``|x|`` each watched linear's input reaches (``absmax``: full module name -> float)."""

    def __init__(self):
        self.absmax: dict[str, float] = {}

    def _hook(self, name: str):
        def see(_module, args):
            x = args[0]
            if isinstance(x, torch.Tensor) and x.numel():
                a = float(x.detach().abs().amax())
                self.absmax[name] = max(self.absmax.get(name, 0.0), a) if a == a else a  # NaN kept: refused later
        return see

    @contextmanager
    def watching(self, layer, names: dict[str, str]):
        """Record, while the block runs, the inputs of ``layer``'s linears ``names`` (relative -> full name);
        those that are not ``nn.Linear`` modules (a routed expert answered by another module) are not seen."""
        handles = []
        for rel, full in names.items():
            mod = find_module(layer, rel)
            if isinstance(mod, torch.nn.Linear):
                handles.append(mod.register_forward_pre_hook(self._hook(full)))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()


def _watched(i: int, ctx) -> dict[str, str]:
    """Decoder layer ``i``'s targeted linears with NVFP4 activations: relative name -> full name."""
    prefix = f"{ctx.arch.layers}.{i}."
    return {n[len(prefix):]: n for n, s in ctx.quantizer.schemes.items()
            if n.startswith(prefix) and s.act == ACT and n in ctx.targets}


def _unseen_expert_absmax(arch, rels: list[str], absmax: dict[str, float], prefix: str) -> dict[str, float]:
    """The absmax of each routed expert linear of ``rels`` no calibration token reached: the largest of the same
    projection among the layer's experts that were reached (0 when none was)."""
    out = {}
    by_proj: dict[str, float] = {}
    for rel in rels:
        if expert_index(arch, rel) is not None and prefix + rel in absmax:
            proj = rel.rsplit(".", 1)[-1]
            by_proj[proj] = max(by_proj.get(proj, 0.0), absmax[prefix + rel])
    for rel in rels:
        if prefix + rel not in absmax and expert_index(arch, rel) is not None:
            out[prefix + rel] = by_proj.get(rel.rsplit(".", 1)[-1], 0.0)
    return out


def record_input_scales(i: int, layer, ctx, absmax: dict[str, float]) -> None:
    """Set ``input_global_scale`` on the records (``ctx.modules``) of decoder layer ``i``'s NVFP4-activation
    linears from ``absmax`` (:class:`InputObserver`'s, this layer's), fused sets sharing (module docstring).
    Under several ranks dividing the calibration batches (``ctx.samples``) the absmax is first the maximum over
    every rank's.

    Raises:
        QuantizationError: a non-finite absmax (names the module).
    """
    prefix = f"{ctx.arch.layers}.{i}."
    rels = list(_watched(i, ctx))
    if not rels:
        return
    seen = {prefix + r: absmax[prefix + r] for r in rels if prefix + r in absmax}
    if ctx.samples is not None:  # the maxima over every rank's share of the batches
        names = [prefix + r for r in rels]
        t = ctx.samples.amax(torch.tensor([seen.get(n, 0.0) for n in names], dtype=torch.float64))
        seen = {n: float(v) for n, v in zip(names, t.tolist()) if n in seen or v > 0}
    for name, a in seen.items():
        if a != a or a in (float("inf"), float("-inf")):
            raise QuantizationError(f"{name}: the absmax of its calibration inputs is not finite; nothing was written")
    seen.update(_unseen_expert_absmax(ctx.arch, rels, seen, prefix))
    fused = [tuple(prefix + r for r in fs) for fs in layer_fused_sets(ctx.arch, layer)]
    for name, g in shared_input_scales({prefix + r: seen.get(prefix + r, 0.0) for r in rels}, fused).items():
        rec = ctx.modules.get(name)
        if rec is not None:
            rec.input_global_scale = g


@contextmanager
def observed_inputs(i: int, layer, ctx):
    """While the block runs (the recompute of decoder layer ``i`` with its quantized weights), the inputs of its
    NVFP4-activation linears are observed (``ctx.input_observer``); afterwards their records get their
    ``input_global_scale`` (:func:`record_input_scales`). Nothing is observed without an observer."""
    obs = ctx.input_observer
    if obs is None:
        yield
        return
    obs.absmax = {}
    with obs.watching(layer, _watched(i, ctx)):
        yield
    record_input_scales(i, layer, ctx, obs.absmax)
