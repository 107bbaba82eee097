"""What every on-disk format shares: the read-side weight record and the format interface.

:class:`QuantWeight` holds a Linear's codes in kvq's signed convention
(:mod:`compressor.quant.primitives`): ``w ≈ (q - zero_point) * scale`` per input group.

==============  ====================  =========================================
field           shape                 dtype
==============  ====================  =========================================
``q``           ``[N, K]``            int8, ``[-2^(b-1), 2^(b-1) - 1]``
``scale``       ``[N, G]``            as stored (float16 / bfloat16 / float32)
``zero_point``  ``[N, G]`` or None    int8 (None: symmetric, zero point 0)
``g_idx``       ``[K]`` or None       int32 group of each input column (GPTQ
                                      act-order); None: ``k // group_size``
==============  ====================  =========================================

``N = out_features``, ``K = in_features``, ``G = K // group_size`` (``group_size = K``
for per-channel schemes).

An FP8 weight (compressed-tensors ``float-quantized``, :mod:`compressor.quant.fp8`) has ``q``
float8_e4m3fn ``[N, K]``, ``scale`` ``[ceil(N / rows), ceil(K / group_size)]`` (``rows`` 1 per
channel, 128 for 128 x 128 blocks), no zero point, and ``act`` the dynamic quantization of the
module's input the serving kernel applies (``fp8-token`` / ``fp8-group``; ``""``: none). An integer
weight may carry ``act`` too (W4A8: ``fp8-token``). An NVFP4 weight (compressed-tensors
``nvfp4-pack-quantized``, :mod:`compressor.quant.fp4`) has ``q`` uint8 e2m1 codes ``[N, K]`` (unpacked),
``scale`` float8_e4m3fn ``[N, K / 16]``, ``global_scale`` float32 ``[1]`` and ``group_size`` 16 (with NVFP4
activations, W4A4: ``act`` ``nvfp4``, ``act_group`` 16 and ``input_global_scale`` float32 ``[1]``). An MXFP4
weight (``mxfp4-pack-quantized``, :mod:`compressor.quant.mxfp4`) has ``q`` uint8 e2m1 codes ``[N, K]``,
``scale`` uint8 biased E8M0 exponents ``[N, K / 32]``, no global scale and ``group_size`` 32.

:class:`WeightFormat` is one on-disk layout: its writer (:meth:`~WeightFormat.pack`, a
pipeline record to stored tensors), its reader (:meth:`~WeightFormat.read`, stored tensors
to a :class:`QuantWeight`), its ``config.json["quantization_config"]``
(:meth:`~WeightFormat.config`) and its refusals (:meth:`~WeightFormat.check`,
:meth:`~WeightFormat.check_shapes`). The three formats live beside their packing code
(:mod:`.compressed_tensors`, :mod:`.awq`, :mod:`.gptq`); the registry is
:func:`compressor.formats.get_format`. The layouts are described in ``docs/formats.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import InputError
from ..quant.fp4 import dequantize_weight as dequantize_fp4_weight
from ..quant.fp8 import dequantize_weight as dequantize_fp8_weight
from ..quant.mxfp4 import dequantize_weight as dequantize_mxfp4_weight
from ..quant.primitives import dequantize
from ..recipe_mixed import pairs
from ..registry import ALGORITHMS, FORMATS


@dataclass
class QuantWeight:
    """Codes and quantization parameters of one Linear (see the module table)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    num_bits: int
    group_size: int
    g_idx: torch.Tensor | None = None
    rows: int = 1
    act: str = ""
    act_group: int = 0  #: columns per activation scale with ``act`` ``fp8-group``
    global_scale: torch.Tensor | None = None  #: NVFP4's float32 ``[1]`` (``None`` for the others)
    #: NVFP4 activations (W4A4, ``act`` ``nvfp4``): the static float32 ``[1]`` input global scale
    input_global_scale: torch.Tensor | None = None

    @property
    def is_float(self) -> bool:
        """FP8 e4m3 codes (``q`` float8_e4m3fn) rather than integers."""
        return self.q.dtype == torch.float8_e4m3fn

    @property
    def is_fp4(self) -> bool:
        """NVFP4 e2m1 codes (``q`` uint8, with a ``global_scale``)."""
        return self.global_scale is not None

    @property
    def is_mxfp4(self) -> bool:
        """MXFP4 e2m1 codes (``q`` uint8 with uint8 E8M0 exponents as ``scale``, no ``global_scale``)."""
        return self.global_scale is None and self.q.dtype == torch.uint8 and self.scale.dtype == torch.uint8

    @property
    def out_features(self) -> int:
        return int(self.q.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.q.shape[1])

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.in_features

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Float ``[N, K]`` weight, bit-identical to what :func:`compressor.artifact.load_artifact` builds."""
        if self.is_fp4:
            return dequantize_fp4_weight(self.q, self.scale, self.global_scale, dtype)
        if self.is_mxfp4:
            return dequantize_mxfp4_weight(self.q, self.scale, dtype)
        if self.is_float:
            return dequantize_fp8_weight(self.q, self.scale, self.group_size, self.rows, dtype)
        return dequantize(self.q, self.scale, self.zero_point, self.group_size, dtype=dtype, g_idx=self.g_idx)

    def sorted_by_group(self) -> tuple["QuantWeight", torch.Tensor | None]:
        """Remove an act-order ``g_idx`` by permuting input columns.

        Returns ``(weight, perm)``: ``weight`` has contiguous groups (``g_idx`` None) and
        ``y = x[..., perm] @ weight.dequantize().T`` equals ``x @ self.dequantize().T``.
        ``perm`` is None when nothing needed permuting; the original weight and None are
        returned when groups do not have exactly ``group_size`` columns each (the caller
        then keeps ``g_idx`` and dequantizes).
        """
        if self.g_idx is None:
            return self, None
        gi = self.g_idx.long()
        trivial = torch.arange(self.in_features) // self.group_size
        if torch.equal(gi, trivial) and self.in_features % self.group_size == 0:
            return replace(self, g_idx=None), None
        counts = torch.bincount(gi, minlength=self.scale.shape[1])
        if self.in_features % self.group_size or not bool((counts == self.group_size).all()):
            return self, None
        perm = torch.sort(gi, stable=True).indices
        return replace(self, q=self.q[:, perm].contiguous(), g_idx=None), perm


def symmetric_zero(zp: torch.Tensor | None) -> torch.Tensor | None:
    """An all-zero zero point (GPTQ/AWQ symmetric checkpoints store one) is the symmetric case: None."""
    return None if zp is None or not bool(zp.any()) else zp


def require_zero_point(weights: dict, t: dict[str, torch.Tensor]) -> None:
    """Raises InputError when a config group's ``weights`` are asymmetric (``symmetric: false``) and the
    module's tensors ``t`` lack ``weight_zero_point`` (read as 0, it would shift every value of the module)."""
    if weights.get("symmetric") is False and "weight_zero_point" not in t:
        raise InputError("asymmetric weights (symmetric: false) but no weight_zero_point")


def require_leaves(t: dict[str, torch.Tensor], names: tuple[str, ...]) -> None:
    """Raises InputError ``lacks a/b/c`` when one of ``names`` is not among the module's tensors."""
    if not set(names) <= set(t):
        raise InputError(f"lacks {'/'.join(names)}")


def recipe_schemes(recipe) -> list:
    """The base weight scheme and the base with each override applied (:func:`compressor.recipe_mixed.pairs`)."""
    return [w for _, w, _ in pairs(recipe)]


def dynamic_act_order(recipe) -> bool:
    """True when the recipe's GPTQ act-order needs a stored ``g_idx`` (no static groups)."""
    grouped = any(s.group_size != -1 and s.type == "int" for s in recipe_schemes(recipe))  # per channel: no g_idx
    return act_order(recipe) and not recipe.gptq.static_groups and grouped


def act_order(recipe) -> bool:
    """True when the recipe's algorithm solves GPTQ-style (:attr:`compressor.quant.algorithms.Algorithm.act_order`)
    with ``gptq.act_order`` on, on an integer grid: the FP4 grids' steps are fixed before the columns are visited,
    so their artifact records no column order."""
    algorithm = ALGORITHMS.find(recipe.algorithm)
    return (algorithm is not None and algorithm.act_order and recipe.gptq.act_order
            and any(w.type != "float" for w in recipe_schemes(recipe)))


def check_float16_weight_format(fmt: "WeightFormat", recipe, dtype_name: str) -> None:
    """The refusals shared by the older toolchains' formats (AWQ, GPTQ: ``scale_dtype`` float16), in this order.

    Raises:
        InputError: a KV-only recipe (``algorithm: none``: nothing to pack); FP8 weights
            (``weights.type: float``: integer layouts only); quantized activations (W4A8: no
            field for them); a static KV-cache scheme (no field
            for ``k_scale``/``v_scale``); a storage dtype other than float16 (their kernels read
            fp16 scales).
    """
    name = fmt.name
    if not ALGORITHMS.get(recipe.algorithm).quantizes_weights:
        raise InputError(f"--format {name} stores quantized weights; a KV-only recipe (algorithm none) needs --format compressed-tensors")
    if any(w.type != "int" for _, w, _ in pairs(recipe)):
        raise InputError(f"--format {name} stores integer weights; FP8, NVFP4 and MXFP4 (weights type float) need "
                         "--format compressed-tensors")
    if any(a is not None for _, _, a in pairs(recipe)):
        raise InputError(f"--format {name} has no field for quantized activations; W4A8 (an activations section) "
                         "needs --format compressed-tensors (input_activations)")
    if recipe.kv_cache is not None and recipe.kv_cache.spec().static:
        raise InputError(
            f"--format {name} has no field for static KV-cache scales ({recipe.kv_cache.spec().describe()}); "
            "use --format compressed-tensors (kv_cache_scheme + k_scale/v_scale, read by vLLM)"
        )
    if dtype_name != fmt.scale_dtype:
        raise InputError(f"--format {name} stores {fmt.scale_dtype} scales; use --dtype {fmt.scale_dtype} "
                         f"(got {dtype_name})")


class WeightFormat:
    """One on-disk format of quantized Linears: writer, reader, config and checks.

    Subclasses set the class attributes and implement the methods; instances hold no
    state (the registry keeps one of each).

    Attributes:
        name: the ``--format`` value.
        quant_method: ``config.json["quantization_config"]["quant_method"]`` it writes and reads.
        leaves: tensor suffixes a packed Linear may store (``<module>.<leaf>``).
        marker: the leaf whose presence marks a module as packed.
        scale_dtype: the storage dtype its readers' kernels need (``float16`` for AWQ and GPTQ), or
            ``None`` for any; ``--dtype auto`` picks it.
        carries_head: it can hold a quantized ``lm_head`` or embedding table (recipe ``head:``,
            ``embedding:``); the others' loaders keep them in float.

    A subclass that sets ``name`` registers one instance of itself in
    :data:`compressor.registry.FORMATS` when it is defined.
    """

    name: str = ""
    quant_method: str = ""
    leaves: tuple[str, ...] = ()
    marker: str = ""
    scale_dtype: str | None = None
    carries_head: bool = False

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.__dict__.get("name"):
            FORMATS.add(cls.name, cls())

    def summary_fields(self, recipe) -> dict:
        """This format's entries in the manifest's ``quantization`` block, which a GPTQ-style algorithm
        records after its own (:meth:`compressor.quant.algorithms.Algorithm.summary_fields`); none by default."""
        return {}

    def check(self, recipe, dtype_name: str) -> None:
        """Refuse, before any work, a recipe this format cannot represent (InputError)."""
        raise NotImplementedError

    def check_shapes(self, out_features: dict[str, int]) -> None:
        """Refuse module shapes known once the model is loaded (InputError); none by default."""

    def pack(self, rec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Stored tensors (suffix -> tensor) of one pipeline record (``QuantizedLinear``)."""
        raise NotImplementedError

    def pack_all(self, modules: dict, dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
        """:meth:`pack` for each record: module name -> {tensor suffix -> tensor} (``weight_packed``,
        ``qweight``, ...); ``dtype`` is the storage dtype of compressed-tensors scales."""
        return {name: self.pack(rec, dtype) for name, rec in modules.items()}

    def read(self, qc: dict, module: str, t: dict[str, torch.Tensor]) -> QuantWeight:
        """A :class:`QuantWeight` from one module's stored tensors (InputError if inconsistent)."""
        raise NotImplementedError

    def config(self, recipe, schemes: dict[str, tuple[int, int, bool]], ignored: list[str], versions: dict,
               embeddings: dict[str, tuple[int, int, bool]] | None = None) -> dict | None:
        """``config.json["quantization_config"]`` (``None``: the artifact needs none).

        Args:
            schemes: quantized module name -> ``(num_bits, group_size, symmetric)``.
            ignored: decoder linears left in float (``lm_head`` is added where the format needs it).
            versions: ``{"compressed-tensors": ..., "kvq": ...}``.
            embeddings: quantized embedding tables -> scheme (recipe ``embedding:``; only
                compressed-tensors holds them, the others refuse the recipe before any work).
        """
        raise NotImplementedError

    def declared(self, qc: dict) -> list[dict]:
        """The weight schemes a source's ``quantization_config`` declares, as
        ``[{"num_bits", "group_size" (-1: per channel), "symmetric"}, ...]`` (one per config
        group; AWQ and GPTQ have one), for messages and the manifest of an artifact whose
        packed weights are carried unchanged (:mod:`compressor.commands.kv_only`)."""
        raise NotImplementedError

    def with_kv(self, qc: dict, spec) -> dict:
        """``qc`` with the KV-cache scheme ``spec`` declared the way this format declares it.

        AWQ and GPTQ have no such field: a dynamic scheme (int8 per token, KIVI) lives in
        the manifest only and ``qc`` is returned unchanged.

        Raises:
            InputError: a static scheme (``k_scale``/``v_scale`` tensors), which a loader of
                this format would not read.
        """
        if spec.static:
            raise InputError(f"the {self.name} format has no field for static KV-cache scales ({spec.describe()}): "
                             "vLLM reads k_scale/v_scale only from compressed-tensors checkpoints (kv_cache_scheme); "
                             "use a dynamic scheme (--recipe kv-int8: per-token scales, recorded in the manifest) "
                             "or a compressed-tensors source")
        return dict(qc)
