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

The module-level functions below (``check_format``, ``pack_modules``, ...) are the
historical entry points, kept as thin wrappers over the format objects.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..registry import FORMATS as _FORMATS
from .base import QuantWeight, WeightFormat, dynamic_act_order, recipe_schemes
from .compressed_tensors import CompressedTensorsFormat  # noqa: F401  (registered first: the default)
from .awq import AwqFormat  # noqa: F401,I001
from .gptq import GptqFormat, gptq_checkpoint_format  # noqa: F401

__all__ = [
    "FORMATS", "GPTQ_BITS", "MARKER", "PACKED_LEAVES", "QuantWeight", "WeightFormat", "check_format", "check_shapes",
    "dynamic_act_order", "format_config", "get_format", "gptq_checkpoint_format", "pack_modules",
    "read_quant_weight", "reader_for",
]

#: the built-in formats' names, the default first (the registry, :data:`compressor.registry.FORMATS`, has every one)
FORMATS = tuple(f.name for f in _FORMATS.entries())
GPTQ_BITS = (2, 3, 4, 8)
#: tensor leaves of a packed Linear, per ``quantization_config.quant_method``
PACKED_LEAVES = {f.quant_method: f.leaves for f in _FORMATS.entries()}
#: the leaf whose presence marks a module as packed
MARKER = {f.quant_method: f.marker for f in _FORMATS.entries()}

_recipe_schemes = recipe_schemes  # the historical private name


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


def check_format(fmt: str, recipe, dtype_name: str) -> None:
    """Refuse, before any work, a recipe the format cannot represent.

    Raises:
        InputError: unknown format; compressed-tensors with dynamic act-order (its 0.20
            release removed ``actorder: group``); AWQ with bits other than 4, per-channel
            groups, a ``g_idx`` or mixed precision; GPTQ with bits outside 2/3/4/8 or mixed
            precision; AWQ/GPTQ with a KV-only recipe, a static KV scheme, or a storage
            dtype other than float16 (their kernels read fp16 scales); a recipe ``head:``
            or ``embedding:`` outside compressed-tensors.
    """
    get_format(fmt).check(recipe, dtype_name)
    from ..quant.embedding import check_embedding
    from ..quant.head import check_head

    check_head(recipe, fmt)
    check_embedding(recipe, fmt)


def check_shapes(fmt: str, out_features: dict[str, int]) -> None:
    """Shape limits known once the model is loaded (AWQ packs 8 output channels per word).

    Raises:
        InputError: names the first module whose ``out_features`` is not a multiple of 8.
    """
    get_format(fmt).check_shapes(out_features)


def pack_modules(modules: dict, fmt: str, dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
    """Pack pipeline records (``QuantizedLinear``) into the stored tensors of ``fmt``.

    Returns module name -> {tensor suffix -> tensor} (e.g. ``weight_packed`` or ``qweight``).
    ``dtype`` is the storage dtype of compressed-tensors scales (AWQ/GPTQ store float16).
    """
    f = get_format(fmt)
    return {name: f.pack(r, dtype) for name, r in modules.items()}


def format_config(fmt: str, recipe, schemes: dict[str, tuple[int, int, bool]], ignored: list[str], versions: dict,
                  embeddings: dict[str, tuple[int, int, bool]] | None = None) -> dict | None:
    """``config.json["quantization_config"]`` for ``fmt`` (``None``: the artifact needs none).

    Args:
        schemes: quantized module name -> ``(num_bits, group_size, symmetric)``.
        ignored: decoder linears left in float (``lm_head`` is added where the format needs it).
        versions: ``{"compressed-tensors": ..., "kvq": ...}``.
        embeddings: quantized embedding tables -> scheme (recipe ``embedding:``, compressed-tensors only).
    """
    return get_format(fmt).config(recipe, schemes, ignored, versions, embeddings)
