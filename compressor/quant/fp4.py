"""NVFP4 weights (FP4 e2m1 values, FP8 e4m3 scales per 16 inputs, a float32 global scale per tensor).

The numerics follow compressed-tensors 0.20 (``quantization/utils/helpers.py`` ``generate_gparam`` and
``calculate_qparams``, ``quantization/lifecycle/forward_helpers.py`` ``_quantize`` / ``_dequantize``,
``quantization/utils/fp4_utils.py`` ``cast_to_fp4``), which llm-compressor's ``NVFP4A16`` preset runs and
whose ``nvfp4-pack-quantized`` compressor writes (``docs/formats.md``):

* e2m1 grid: ``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}``; a code is 4 bits, ``sign << 3 | magnitude index``
  (index 0..7 into :data:`E2M1_VALUES`).
* global scale ``g = 448 * 6 / absmax`` over the whole tensor (float32 ``[1]``; an all-zero or
  non-finite tensor gets 1). Linears vLLM fuses into one GEMM (q/k/v, gate/up, DeepSeek's
  q_a/kv_a) share one ``g``, from the largest absmax of the set (llm-compressor's
  ``update_fused_layer_weight_global_scales``: the minimum of their global scales), since vLLM keeps a
  single global scale per fused layer.
* group scale ``s = e4m3(clamp(g * absmax_16 / 6, ±448))`` per output row and 16 consecutive input
  columns (an exact 0 becomes 0.125, the smallest scale compressed-tensors writes).
* code ``q = e2m1(clamp(w / (s / g), -6, 6))``: round to nearest, ties to the even code
  (``0.25 -> 0``, ``0.75 -> 1``, ``1.25 -> 1``, ``1.75 -> 2``, ``2.5 -> 2``, ``3.5 -> 4``, ``5 -> 4``);
  the sign bit is set for a negative ``w`` even when the magnitude rounds to 0 (compressed-tensors' CPU path
  writes such a ``-0`` as code 8), not for an exact ``-0.0`` (code 0: ``cast_to_fp4`` multiplies by
  ``sign(w)``, 0 there). ``w_hat = q * (s / g)`` in float32: the global scale divides.
* storage: two codes per uint8, the even column in the low nibble (``byte = q[2j] | q[2j+1] << 4``).

Algorithms: round-to-nearest (kvq's ``rtn``), GPTQ/GPTAQ, which round each column onto the same steps
(:func:`group_steps`, from the weights before any column is rounded) with GPTQ's error feedback, and AWQ, whose
searches round each candidate with :func:`steps_of` and :func:`round_to_steps` (the global scale of a fused
set from the set's scaled weights: :func:`compressor.quant.awq.candidate_weights`).
``in_features`` must be a multiple of 16 (vLLM's kernels and the group layout need it); shapes:
weights ``[N, K]``. Every function is side-effect free.
"""

from __future__ import annotations

import torch

from ..errors import InputError

#: the non-negative e2m1 values, indexed by a code's magnitude bits
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0
FP8_MAX = 448.0
GROUP = 16
#: the scale compressed-tensors writes for an all-zero group (``_get_dtype_eps`` of e4m3)
ZERO_GROUP_SCALE = 0.125
#: midpoints between neighbouring magnitudes, and whether a tie rounds up (to the even code)
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def check_shape(w: torch.Tensor) -> None:
    """Raises InputError unless ``w`` is 2-D with a width that is a multiple of 16."""
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise InputError(f"NVFP4 weights are 2-D with in_features a multiple of {GROUP}, got shape {tuple(w.shape)}")


@torch.no_grad()
def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float, already divided by its scale) rounded onto the e2m1 grid: uint8 codes of ``x``'s
    shape, saturated at ±6, nearest with ties to the even code, the sign bit set for ``x < 0`` (module
    docstring)."""
    x = x.float().clamp(-FP4_MAX, FP4_MAX)
    a = x.abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, up in _MIDPOINTS:
        mag += (a >= mid if up else a > mid).to(torch.uint8)
    return mag | ((x < 0).to(torch.uint8) << 3)  # an exact -0.0 is code 0, as compressed-tensors writes it


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 e2m1 ``codes`` (any shape; bits above the low 4 are ignored)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    v = table[(codes & 7).long()]
    return torch.where((codes & 8).bool(), -v, v)


def global_scale(absmax: float | torch.Tensor) -> torch.Tensor:
    """float32 ``[1]`` global scale ``448 * 6 / absmax`` (1 for a zero or non-finite absmax)."""
    a = torch.as_tensor(absmax, dtype=torch.float32).reshape(1)
    g = (FP8_MAX * FP4_MAX) / a.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)


@torch.no_grad()
def quantize_weight(w: torch.Tensor, absmax: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 codes and scales of ``w [N, K]`` (module docstring).

    Args:
        absmax: the absmax the global scale is taken from (a fused set's largest); default ``w``'s own.

    Returns:
        ``(q uint8 [N, K] e2m1 codes, scale float8_e4m3fn [N, K/16], global_scale float32 [1])``.

    Raises:
        InputError: ``w`` is not 2-D or its width is not a multiple of 16.
    """
    step, s, g = group_steps(w, absmax)
    n, k = w.shape
    q = e2m1_codes(w.float().reshape(n, k // GROUP, GROUP) / step.unsqueeze(-1)).reshape(n, k)
    return q, s, g


@torch.no_grad()
def group_steps(w: torch.Tensor, absmax: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The NVFP4 grid of ``w [N, K]`` (module docstring): ``(step float32 [N, K/16], scale float8_e4m3fn [N, K/16],
    global_scale float32 [1])``, a code ``q`` of group ``j`` standing for ``q * step[:, j]`` (``step = scale /
    global_scale``); ``absmax`` as :func:`quantize_weight`'s. GPTQ rounds onto these steps column by column
    (:func:`compressor.quant.gptq.gptq_quantize`'s ``e2m1_steps``).

    Raises:
        InputError: ``w`` is not 2-D or its width is not a multiple of 16.
    """
    check_shape(w)
    wf = w.float()
    g = global_scale(wf.abs().max() if absmax is None else absmax).to(wf.device)
    n, k = wf.shape
    step, s = steps_of(wf.reshape(n, k // GROUP, GROUP).abs().amax(dim=-1), g)
    return step, s, g.cpu()


@torch.no_grad()
def steps_of(amax: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The NVFP4 steps of groups whose absolute maxima are ``amax`` (float32, any shape) under the global scale
    ``g`` (float32 ``[1]`` on ``amax``'s device): ``(step float32, scale float8_e4m3fn)`` of ``amax``'s shape,
    ``scale = e4m3(clamp(g * amax / 6, ±448))`` (0 becomes 0.125) and ``step = scale / g`` (module docstring)."""
    s = (g * (amax / FP4_MAX)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    s = torch.where(s.float() == 0, torch.full_like(s.float(), ZERO_GROUP_SCALE), s.float()).to(torch.float8_e4m3fn)
    return s.float() / g, s


@torch.no_grad()
def round_to_steps(wg: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``wg [..., G, n]`` (float) rounded onto the e2m1 grid of ``step [..., G]`` (float32): float32 ``wg``'s shape,
    the values :func:`dequantize_weight` gives for the codes :func:`quantize_weight` writes (the same float32
    operations), for NVFP4 and MXFP4 steps alike."""
    st = step.unsqueeze(-1)
    return e2m1_values(e2m1_codes(wg.float() / st)) * st


@torch.no_grad()
def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, g: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * (scale / g)`` per 16-column group: float ``[N, K]`` in ``dtype`` (computed in float32, as
    compressed-tensors' decompressor computes it before its cast)."""
    n, k = q.shape
    step = (scale.float() / g.float().to(scale.device)).unsqueeze(-1)
    return (e2m1_values(q).reshape(n, k // GROUP, GROUP) * step).reshape(n, k).to(dtype)


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` -> uint8 ``[N, K/2]``, column ``2j`` in the low nibble of byte ``j``.

    Raises:
        InputError: an odd width or a code above 15.
    """
    if q.ndim != 2 or q.shape[1] % 2:
        raise InputError(f"e2m1 codes pack in pairs along 2-D rows, got shape {tuple(q.shape)}")
    if q.numel() and int(q.max()) > 15:
        raise InputError("e2m1 codes are 4 bits (0..15)")
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``[N, K/2]`` -> uint8 codes ``[N, K]``.

    Raises:
        InputError: ``packed`` is not 2-D uint8.
    """
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise InputError(f"weight_packed of e2m1 codes is 2-D uint8, got {packed.dtype} {tuple(packed.shape)}")
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
