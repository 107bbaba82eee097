"""FP8 (float8 e4m3) weights and activations: the numerics of FP8 W8A8 (and W4A8's inputs) as vLLM serves it.

Weights (compressed-tensors ``float-quantized``, vLLM's ``CompressedTensorsW8A8Fp8``):

* one float32 scale per output row (``strategy: channel``, ``scale [N, 1]``) or per
  ``rows x cols`` block (``strategy: block``, ``block_structure [128, 128]``: DeepSeek-V3,
  GLM-4.5 and later publish this, ``scale [ceil(N/rows), ceil(K/cols)]``);
* ``scale = absmax / 448`` over the row or block (an all-zero one gets scale 1: its codes are 0);
* ``q = float8_e4m3fn(clamp(w / scale, -448, 448))``: round to nearest, ties to even (torch's
  cast, the one compressed-tensors' ``quantize`` uses), saturated at the largest finite e4m3
  value; ``w_hat = q * scale``.
* A block at the right or bottom edge of a matrix whose width or height is not a multiple of
  the block is the partial block, as compressed-tensors' ``maybe_pad_tensor_for_block_quant``
  gives (zero padding changes no absmax); the stored weight keeps its own shape.

Activations (dynamic, quantized by the serving kernel on every call; vLLM ``csrc`` and
``fp8_utils.py``), each token row ``x [..., K]`` of a linear's input:

* ``token``: one scale per token, ``max(absmax / 448, 1 / (448 * 512))``
  (``dynamic_per_token_scaled_fp8_quant``'s floor);
* ``group``: one scale per token and group of ``group_size`` columns, ``max(absmax, 1e-10) / 448``
  (``per_token_group_quant_fp8``); a last group narrower than ``group_size`` (a width that is
  not a multiple: vLLM refuses such a layer, kvq simulates the zero-padded group);
* ``q = float8_e4m3fn(clamp(x / scale, -448, 448))``, the product then ``(q * scale) @ w_hat.T``
  accumulated in float32, as the FP8 GEMMs do.

W4A8 (integer weights, fp8 inputs: compressed-tensors ``pack-quantized`` whose config group carries
``input_activations`` fp8 per token; vLLM's ``CompressedTensorsW4A8Fp8`` and its CUTLASS kernel, whose
``QuantFP8`` per-token path is the ``token`` quantization above): the inputs are quantized as above,
the weights are kvq's integer grid (:mod:`compressor.quant.primitives`); :func:`int_fp8_misfits`
names the linears that kernel refuses.

Shapes: weights ``[N, K]`` (``N`` out, ``K`` in); every function is ``@torch.no_grad()`` and
side-effect free.
"""

from __future__ import annotations

import re

import torch

from ..errors import InputError
from ..kv_schemes import FP8_MAX

FP8 = torch.float8_e4m3fn
#: vLLM's floor of a per-token activation scale (``min_scaling_factor<fp8_e4m3>``)
TOKEN_SCALE_FLOOR = 1.0 / (FP8_MAX * 512.0)
#: vLLM's floor of a per-group activation absmax (``per_token_group_quant_fp8``'s ``eps``)
GROUP_ABSMAX_FLOOR = 1e-10
#: activation schemes (``Scheme.act``): dynamic fp8 per token, or per token and group of the weight's group size
ACT_SCHEMES = ("fp8-token", "fp8-group")


def cast_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float) saturated to ±448 and rounded to float8 e4m3 (nearest, ties to even)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _block_absmax(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``max |w|`` over each ``rows x cols`` block of ``w [N, K]`` (partial edge blocks):
    ``[ceil(N/rows), ceil(K/cols)]``."""
    n, k = w.shape
    pr, pc = -n % rows, -k % cols
    a = torch.nn.functional.pad(w.abs(), (0, pc, 0, pr)) if pr or pc else w.abs()
    return a.reshape((n + pr) // rows, rows, (k + pc) // cols, cols).amax(dim=(1, 3))


def expand_blocks(t: torch.Tensor, rows: int, cols: int, shape: tuple[int, int]) -> torch.Tensor:
    """A per-block tensor ``[ceil(N/rows), ceil(K/cols)]`` repeated to ``shape = (N, K)``."""
    n, k = shape
    return t.repeat_interleave(rows, dim=0)[:n].repeat_interleave(cols, dim=1)[:, :k]


def _per_block(x: torch.Tensor, t: torch.Tensor, rows: int, cols: int, op) -> torch.Tensor:
    """``op(x, t repeated to x's rows x cols blocks)`` for ``x [N, K]`` and ``t`` per block: by broadcasting where
    the blocks tile ``x`` (no ``[N, K]`` copy of ``t``; the same values, element by element), else through
    :func:`expand_blocks`."""
    n, k = x.shape
    if n % rows == 0 and k % cols == 0:
        return op(x.view(n // rows, rows, k // cols, cols), t.view(n // rows, 1, k // cols, 1)).view(n, k)
    return op(x, expand_blocks(t, rows, cols, (n, k)))


def block_shape(rows: int, group_size: int, shape: tuple[int, int]) -> tuple[int, int]:
    """``(rows, cols)`` of one scale block of a ``[N, K]`` weight: ``group_size -1`` is the whole row."""
    return rows, shape[1] if group_size in (-1, 0, None) else group_size


@torch.no_grad()
def quantize_weight(w: torch.Tensor, group_size: int, rows: int = 1,
                    clip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes and scales of ``w [N, K]``: per output channel (``group_size -1``, ``rows 1``)
    or per ``rows x group_size`` block.

    Args:
        clip: optional float32 scales to use instead of ``absmax / 448`` (same shape as returned).

    Returns:
        ``(q float8_e4m3fn [N, K], scale float32 [ceil(N/rows), ceil(K/cols)])``.

    Raises:
        InputError: ``w`` is not 2-D, or ``rows``/``group_size`` not positive (``-1``: per channel).
    """
    if w.ndim != 2:
        raise InputError(f"FP8 weights are 2-D, got shape {tuple(w.shape)}")
    r, c = block_shape(rows, group_size, tuple(w.shape))
    if r < 1 or c < 1:
        raise InputError(f"FP8 scale block {r} x {c}: both sides must be positive")
    wf = w.float()
    if clip is None:
        scale = _block_absmax(wf, r, c) / FP8_MAX
        scale = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
    else:
        scale = clip.float()
    q = _per_block(wf, scale, r, c, torch.div).clamp_(-FP8_MAX, FP8_MAX).to(FP8)  # cast_fp8, in place
    return q, scale


@torch.no_grad()
def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, group_size: int, rows: int = 1,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` per block (inverse of :func:`quantize_weight`), float ``[N, K]`` in ``dtype``
    (computed in float32: an exact product of an e4m3 value and a float32 scale)."""
    r, c = block_shape(rows, group_size, tuple(q.shape))
    return _per_block(q.float(), scale.float(), r, c, torch.mul).to(dtype)


@torch.no_grad()
def fake_quantize_activation(x: torch.Tensor, act: str, group_size: int = 128,
                             dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., K]`` quantized to FP8 and back as the serving kernel quantizes a linear's input
    (module docstring): ``act`` ``fp8-token`` (one scale per row) or ``fp8-group`` (per row and
    ``group_size`` columns). The codes and scales are computed in float32 from ``x``'s values;
    the dequantized ``q * scale`` (exact in float32) is returned in ``dtype`` (default ``x``'s).
    An empty ``x`` is returned as it is.

    Raises:
        InputError: an unknown ``act``.
    """
    dtype = dtype or x.dtype
    if x.numel() == 0:
        return x.to(dtype)
    xf = x.float()
    if act == "fp8-token":
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=TOKEN_SCALE_FLOOR)
        return (cast_fp8(xf / scale).float() * scale).to(dtype)
    if act != "fp8-group":
        raise InputError(f"unknown activation scheme {act!r} (known: {', '.join(ACT_SCHEMES)})")
    k = xf.shape[-1]
    pad = -k % group_size
    xg = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
    xg = xg.reshape(*xf.shape[:-1], (k + pad) // group_size, group_size)
    scale = xg.abs().amax(dim=-1, keepdim=True).clamp_(min=GROUP_ABSMAX_FLOOR) / FP8_MAX
    out = (cast_fp8(xg / scale).float() * scale).reshape(*xf.shape[:-1], k + pad)
    return (out[..., :k] if pad else out).to(dtype)


def block_misfits(schemes: dict, in_features: dict[str, int], fused_outs: list[list[tuple[str, int]]]) -> list[str]:
    """The FP8 block linears vLLM's block kernels refuse (``validate_fp8_block_shape``,
    ``per_token_group_quant_fp8``): an input width that is not a multiple of the activation group,
    or, in a set of linears one GEMM serves (q/k/v, gate/up), an output width other than the last
    that is not a multiple of the block's rows.

    Args:
        schemes: module name -> :class:`~compressor.quant.primitives.Scheme`.
        in_features: module name -> input width.
        fused_outs: per fused set, ``[(module name, output width), ...]`` in the GEMM's order.

    Returns:
        The names, sorted (empty when every block linear fits or there is none).
    """
    bad = {n for n, s in schemes.items() if s.is_float and s.act == "fp8-group" and in_features[n] % s.group_size}
    for parts in fused_outs:
        for name, out in parts[:-1]:
            s = schemes.get(name)
            if s is not None and s.is_float and s.rows > 1 and out % s.rows:
                bad.add(name)
    return sorted(bad)


#: what vLLM's W4A8 kernel serves (``CompressedTensorsW4A8Fp8``, ``CutlassW4A8LinearKernel.can_implement``):
#: 4-bit symmetric integer weights in groups of 128, GEMM input and output widths multiples of 128
W4A8_BITS, W4A8_GROUP = 4, 128


def int_fp8_misfits(schemes: dict, widths: dict[str, tuple[int, int]],
                    fused_outs: list[list[tuple[str, int]]]) -> list[str]:
    """The integer linears with fp8 inputs (W4A8) vLLM's W4A8 kernel refuses: weights other than
    :data:`W4A8_BITS`-bit symmetric in groups of :data:`W4A8_GROUP` (``CompressedTensorsW4A8Fp8``), an
    input width that is not a multiple of 128, or an output width that is not one (``CutlassW4A8LinearKernel``:
    ``K`` and ``N`` of the GEMM; a set of linears one GEMM serves, q/k/v or gate/up, counts its outputs
    together).

    Args:
        schemes: module name -> :class:`~compressor.quant.primitives.Scheme`.
        widths: module name -> ``(out_features, in_features)``.
        fused_outs: per fused set, ``[(module name, output width), ...]``.

    Returns:
        The names, sorted (empty when every such linear fits or there is none).
    """
    mine = {n for n, s in schemes.items() if not s.is_float and s.act}
    bad = {n for n in mine if (schemes[n].num_bits, schemes[n].symmetric, schemes[n].group_size) !=
           (W4A8_BITS, True, W4A8_GROUP) or widths[n][1] % W4A8_GROUP}
    grouped = set()
    for parts in fused_outs:
        names = [n for n, _ in parts if n in mine]
        grouped.update(names)
        if sum(out for n, out in parts if n in mine) % W4A8_GROUP:
            bad.update(names)
    return sorted(bad | {n for n in mine - grouped if widths[n][0] % W4A8_GROUP})


def kernel_warnings(schemes: dict, widths: dict[str, tuple[int, int]],
                    fused_outs: list[list[tuple[str, int]]]) -> list[str]:
    """``kvq quantize``'s warnings naming the linears vLLM's kernels refuse: FP8 blocks
    (:func:`block_misfits`) and W4A8 (:func:`int_fp8_misfits`); arguments as :func:`int_fp8_misfits`; and the
    quantized inputs transformers runs otherwise (:func:`transformers_input_warning`).

    Returns:
        One line per kind that has such linears (empty: none).
    """
    out = [line for line in (transformers_input_warning(schemes),) if line]
    bad = block_misfits(schemes, {n: w[1] for n, w in widths.items()}, fused_outs)
    if bad:
        out.append(f"FP8 blocks: {len(bad)} of {len(schemes)} linears (e.g. {bad[0]}) have an input width that is not "
                   "a multiple of the activation group, or an output inside a fused q/k/v or gate/up GEMM that is not "
                   "a multiple of the block's rows; vLLM's block kernels (and transformers' loader) refuse them: kvq "
                   "verify and serve-smoke simulate zero-padded groups. Per-channel FP8 (--recipe w8a8-fp8) has no "
                   "such limit")
    bad = int_fp8_misfits(schemes, widths, fused_outs)
    if bad:
        out.append(f"W4A8: {len(bad)} of {len(schemes)} linears (e.g. {bad[0]}) are not what vLLM's W4A8 kernel "
                   "serves (4-bit symmetric weights in groups of 128, input and output widths multiples of 128; a "
                   "fused q/k/v or gate/up GEMM counts its outputs together): vLLM refuses them; kvq verify and "
                   "serve-smoke simulate them as written")
    return out


def transformers_input_warning(schemes: dict) -> str:
    """The warning for an artifact whose quantized inputs transformers' ``from_pretrained`` (5.25.0 with
    compressed-tensors 0.20.1) loads without error but runs otherwise than vLLM and ``kvq verify``
    (docs/formats.md, "MoE and MLA models in transformers"): routed experts with quantized inputs
    (``<...>.experts.<e>.<proj>``; transformers fuses them into 3-D parameters, dequantized at load, whose inputs
    stay float) and a latent-attention ``kv_b_proj`` with per-token fp8 inputs (transformers hands it a
    ``[batch, 1, tokens, rank]`` tensor, for which compressed-tensors' token strategy takes one scale per sequence).

    Args:
        schemes: module name (kvq's per-expert names) -> :class:`~compressor.quant.primitives.Scheme`.

    Returns:
        One line, or ``""`` when no such linear has quantized inputs.
    """
    experts = sum(1 for n, s in schemes.items() if s.act and re.search(r"\.experts\.\d+\.", n))
    latent = sum(1 for n, s in schemes.items() if s.act == "fp8-token" and n.endswith(".kv_b_proj"))
    what = ([f"{experts} routed-expert linears run with float inputs"] if experts else []) + \
        ([f"{latent} kv_b_proj take one input scale per sequence, not per token"] if latent else [])
    if not what:
        return ""
    return ("transformers 5.25 (compressed-tensors 0.20.1) loads this artifact without error but does not quantize "
            f"its inputs as vLLM and kvq verify do ({'; '.join(what)}): its logits are not kvq's "
            "(docs/formats.md, \"MoE and MLA models in transformers\")")
