"""A decoder layer's figures in the manifest's ``quality.layers`` (:func:`compressor.pipeline.quantize_model`,
:mod:`compressor.data_free`)."""

from __future__ import annotations

import torch

__all__ = ["first_rows", "layer_figures", "out_error"]


def layer_figures(i: int, schemes: dict, prefix: str, errs: list[float], out_err: float | None, seconds: float,
                  **extra) -> dict:
    """Layer ``i``'s figures: its schemes' bits and group sizes (``schemes``: full module name ->
    :class:`~compressor.quant.primitives.Scheme`, those under ``prefix`` read), how many linears and
    their mean relative weight error (``errs``), the relative output error ``out_err`` (``None``
    without a float reference), ``extra`` and ``seconds`` (wall, rounded to ms)."""
    layer_schemes = sorted({v for k, v in schemes.items() if k.startswith(prefix)})
    bits = [s.num_bits for s in layer_schemes]
    sizes = [s.group_size for s in layer_schemes]
    return {
        "layer": i,
        "num_bits": (bits[0] if len(set(bits)) == 1 else sorted(set(bits))) if bits else None,
        "group_size": (sizes[0] if len(set(sizes)) == 1 else sorted(set(sizes))) if sizes else None,
        "modules": len(errs),
        "mean_rel_error": round(sum(errs) / len(errs), 6) if errs else None,
        "output_rel_error": None if out_err is None else round(out_err, 6),
        **extra,
        "seconds": round(seconds, 3),
    }


def first_rows(hidden: list[torch.Tensor], n: int) -> torch.Tensor:
    """The first ``n`` rows (sequences) of the batches ``hidden`` (no copy when batch 0 holds them)."""
    return hidden[0][:n] if n <= hidden[0].shape[0] else torch.cat(hidden)[:n]


def out_error(q_out: torch.Tensor, f_out: torch.Tensor) -> float:
    """``|q_out - f_out| / |f_out|`` (Frobenius norms; the denominator at least 1e-12): the relative
    output error of a quantized layer (``[b, T, H]`` float32 each)."""
    return float((q_out - f_out).norm() / f_out.norm().clamp(min=1e-12))
