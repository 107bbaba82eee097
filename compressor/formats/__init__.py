"""On-disk formats written and read by kvq: one :class:`~.base.WeightFormat` object per format.

* ``compressed-tensors`` (default): what vLLM and transformers load natively.
* ``awq``: AutoAWQ GEMM (``quant_method: awq``, ``version: gemm``), 4-bit only.
* ``gptq``: AutoGPTQ / GPTQModel (``quant_method: gptq``); symmetric schemes are written
  as ``checkpoint_format: gptq`` (v1, zero points stored minus one, what every GPTQ loader
  reads), asymmetric ones as ``gptq_v2`` (real zero points), because v1 cannot represent
  an unsigned zero point of 0 (``docs/formats.md``, GPTQ).

Each object holds the format's writer (``pack``: a pipeline ``QuantizedLinear`` in the
compressed-tensors signed convention -> stored tensors), reader (``read``: stored tensors
-> :class:`~.base.QuantWeight`), ``config`` (``config.json["quantization_config"]``) and
checks (``check`` before any work, ``check_shapes`` once the model is loaded). The
artifact writer and reader (:mod:`compressor.artifact`) and the runtime
(:mod:`compressor.runtime`) both go through :func:`get_format`; nothing here imports
either of them.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..registry import FORMATS as _FORMATS
from .base import QuantWeight, WeightFormat
from .compressed_tensors import CompressedTensorsFormat  # noqa: F401  (registered first: the default)
from .awq import AwqFormat  # noqa: F401,I001
from .gptq import GptqFormat  # noqa: F401

__all__ = ["READ_CT_FORMATS", "QuantWeight", "WeightFormat", "get_format", "read_quant_weight", "reader_for"]

#: compressed-tensors top-level ``format`` values kvq's readers load (``mixed-precision``: groups of
#: the quantized ones; ``dense``: no quantized weight, KV-cache scales only)
READ_CT_FORMATS = ("pack-quantized", "float-quantized", "mixed-precision", "dense", "nvfp4-pack-quantized",
                   "mxfp4-pack-quantized", "int-quantized")


def get_format(name: str) -> WeightFormat:
    """The format object for a ``--format`` value.

    Raises:
        InputError: unknown format (the message lists the known ones).
    """
    fmt = _FORMATS.find(name)
    if fmt is None:
        raise InputError(f"unknown format '{name}'; choose one of {', '.join(f.name for f in _FORMATS.entries())}")
    return fmt


def reader_for(method: str | None) -> WeightFormat | None:
    """The format object that reads ``quantization_config.quant_method == method``, or None."""
    return next((f for f in _FORMATS.entries() if f.quant_method == method), None) if method is not None else None


def read_quant_weight(method: str, qc: dict, module: str, t: dict[str, torch.Tensor]) -> QuantWeight:
    """Read one packed Linear of an artifact (used by the artifact loader and the runtime).

    Args:
        method: ``quantization_config.quant_method`` (``compressed-tensors``, ``awq``, ``gptq``).
        qc: the ``quantization_config`` dict.
        module: full module name (selects the compressed-tensors config group).
        t: the module's stored tensors, keyed by leaf (``weight_packed``, ``qweight``, ...).

    Raises:
        InputError: ``module <name>: ...``: tensors missing or inconsistent with the
            config, unknown method.
    """
    try:
        fmt = reader_for(method)
        if fmt is None:
            methods = ", ".join(f.quant_method for f in _FORMATS.entries())
            raise InputError(f"quant_method {method!r} is not one the runtime reads ({methods})")
        return fmt.read(qc, module, t)
    except InputError as e:
        raise InputError(f"module {module}: {e}") from None
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise InputError(f"module {module}: cannot read its {method} tensors ({type(e).__name__}: {e})") from None
