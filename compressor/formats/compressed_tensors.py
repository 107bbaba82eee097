"""compressed-tensors ``pack-quantized`` layout (what vLLM and transformers load).

Matches vllm-project/compressed-tensors 0.20 (``compressors/pack_quantized/base.py`` and
``helpers.py`` after PR #732 (0.18), dense packing):

* ``<module>.weight_packed`` int32 ``[out, ceil(in * b / 32)]``: the signed values
  ``q in [-2^(b-1), 2^(b-1)-1]`` are offset by ``2^(b-1)`` to unsigned and written as a
  dense little-endian bit stream per row (element ``i`` occupies bits ``i*b .. i*b+b-1``,
  crossing int32 words when ``b`` does not divide 32; for 2/4/8 bits this equals the
  older ``32 // b`` values-per-word layout).
* ``<module>.weight_scale`` ``[out, G]`` in the model dtype.
* ``<module>.weight_zero_point`` (asymmetric only) int32 ``[ceil(out * b / 32), G]``:
  the signed zero points packed the same way **along dim 0**.
* ``<module>.weight_shape`` int64 ``[2]`` = ``[out, in]``.

FP8 W8A8 modules are written in the ``float-quantized`` layout (``FloatQuantizationCompressor``):
``<module>.weight`` float8_e4m3fn ``[out, in]`` and ``<module>.weight_scale`` float32 ``[out, 1]``
(channel) or ``[ceil(out/128), ceil(in/128)]`` (128 x 128 blocks), their config group with
``input_activations`` (dynamic fp8 per token or per group; :mod:`compressor.quant.fp8`).

NVFP4 weight-only modules are written in the ``nvfp4-pack-quantized`` layout (``NVFP4PackedCompressor``,
:mod:`compressor.quant.fp4`): ``<module>.weight_packed`` uint8 ``[out, in/2]`` (two e2m1 codes a byte,
the even column in the low nibble), ``<module>.weight_scale`` float8_e4m3fn ``[out, in/16]`` and
``<module>.weight_global_scale`` float32 ``[1]`` (the weight is ``code * weight_scale / global_scale``);
their config group's weights are ``type float, num_bits 4, strategy tensor_group, group_size 16``.

MXFP4 weight-only modules are written in the ``mxfp4-pack-quantized`` layout (``MXFP4PackedCompressor``,
:mod:`compressor.quant.mxfp4`): ``<module>.weight_packed`` as NVFP4's and ``<module>.weight_scale`` uint8
``[out, in/32]``, biased E8M0 exponents (the weight is ``code * 2^(weight_scale - 127)``), no global scale;
their config group's weights are ``type float, num_bits 4, strategy group, group_size 32, scale_dtype uint8``.

:class:`CompressedTensorsFormat` is the format object (writer, reader, config, checks);
``quantization_config`` is built through the library's pydantic models. Layout details:
``docs/formats.md``.
"""

from __future__ import annotations

import copy

import torch

from ..errors import InputError, QuantizationError
from ..quant import fp4, mxfp4
from ..quant.fp4_inputs import ACT as NVFP4_ACT
from ..quant.fp8 import ACT_SCHEMES
from ..quant.primitives import Scheme, qrange
from .base import (QuantWeight, WeightFormat, act_order, dynamic_act_order, require_leaves, require_zero_point,
                   symmetric_zero)
from .ct_groups import compact_targets, module_group, order_groups
from .ct_int import int_values
from .packing import n_words, pack_rows, unpack_signed


@torch.no_grad()
def pack_int32(q: torch.Tensor, num_bits: int, packed_dim: int = 1) -> torch.Tensor:
    """Pack signed ints ``q [rows, cols]`` (int8) into int32 words along ``packed_dim``.

    Returns int32 ``[rows, ceil(cols*b/32)]`` (``packed_dim=1``) or
    ``[ceil(rows*b/32), cols]`` (``packed_dim=0``): the values offset by ``2^(b-1)`` as
    the dense bit stream of :func:`~compressor.formats.packing.pack_rows` (the bytes of
    compressed-tensors' ``pack_to_int32``); transient memory is bounded by one row block.

    Raises:
        InputError: a value outside the signed ``num_bits`` range (packing must never
            bleed into neighbouring fields).
    """
    qmin, qmax = qrange(num_bits)
    if q.ndim != 2:
        raise InputError(f"pack_int32 expects a 2-D tensor, got shape {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < qmin or int(q.max()) > qmax):
        raise InputError(f"values outside the int{num_bits} range [{qmin}, {qmax}] cannot be packed")
    if packed_dim == 0:
        return pack_int32(q.t(), num_bits, 1).t().contiguous()
    return pack_rows(q, num_bits, 1 << (num_bits - 1))


@torch.no_grad()
def unpack_int32(packed: torch.Tensor, num_bits: int, shape: tuple[int, int], packed_dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int32 words -> signed int8 ``shape``.

    Raises:
        InputError: ``packed`` does not have the shape ``num_bits``-bit values of ``shape`` pack to.
    """
    rows, cols = shape
    if packed_dim == 0:
        return unpack_int32(packed.t(), num_bits, (cols, rows), 1).t().contiguous()
    words = n_words(cols, num_bits)
    if tuple(packed.shape) != (rows, words):
        raise InputError(
            f"packed tensor has shape {tuple(packed.shape)}, expected {(rows, words)} for {num_bits}-bit {shape}"
        )
    return unpack_signed(packed, num_bits, cols)


def module_tensors(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    num_bits: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The stored tensors of one quantized Linear (names without the module prefix).

    Args:
        q: int8 ``[out, in]``; scale: ``[out, G]``; zero_point: int8 ``[out, G]`` or None
        (symmetric); dtype: storage dtype of the scale.
    """
    out = {
        "weight_packed": pack_int32(q, num_bits, 1),
        "weight_scale": scale.to(dtype).contiguous(),
        "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
    }
    if zero_point is not None:
        out["weight_zero_point"] = pack_int32(zero_point, num_bits, 0)
    return out


def read_module(tensors: dict[str, torch.Tensor], num_bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`module_tensors`: ``(q int8 [out,in], scale [out,G], zero_point int8 [out,G] | None)``."""
    shape = tuple(int(v) for v in tensors["weight_shape"].tolist())
    if len(shape) != 2:
        raise InputError(f"weight_shape must have 2 entries, got {shape}")
    q = unpack_int32(tensors["weight_packed"], num_bits, shape, 1)
    scale = tensors["weight_scale"]
    zp = None
    if "weight_zero_point" in tensors:
        zp = unpack_int32(tensors["weight_zero_point"], num_bits, tuple(scale.shape), 0)
    return q, scale, zp


#: keys of a saved ``QuantizationArgs`` for weights, in the order llm-compressor's checkpoints
#: have them (the library's serializer drops ``block_structure``/``actorder``/``observer_kwargs``
#: when empty; saved checkpoints and kvq's artifacts carry them as null / {})
_WEIGHT_ARGS_KEYS = ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic",
                     "actorder", "observer", "observer_kwargs")
#: NVFP4's and MXFP4's weight args also carry the dtype of their group scales
_FP4_ARGS_KEYS = _WEIGHT_ARGS_KEYS + ("scale_dtype",)
#: the same keys in the order kvq has always written ``kv_cache_scheme``
_KV_ARGS_KEYS = ("num_bits", "type", "strategy", "dynamic", "symmetric", "group_size", "block_structure",
                 "actorder", "observer", "observer_kwargs")


#: the compressors of e2m1 weights, whose weight args carry ``scale_dtype``
_FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")


def _dump(model, keys: tuple[str, ...]) -> dict:
    """``model.model_dump(mode="json")`` restricted to ``keys`` in that order; a key the
    library's serializer omitted is written with the model's own value (``None`` / ``{}``)."""
    data = model.model_dump(mode="json")
    return {k: data[k] if k in data else copy.deepcopy(getattr(model, k)) for k in keys}


def _dump_args(args, keys: tuple[str, ...] = _WEIGHT_ARGS_KEYS) -> dict | None:
    return None if args is None else _dump(args, keys)


def _weight_args(sch: Scheme, actorder: str | None):
    """compressed-tensors ``QuantizationArgs`` of a weight scheme: integer (``-1``: per channel) or
    FP8 (``type: float``, per channel or ``block_structure [rows, cols]``)."""
    from compressed_tensors.quantization import QuantizationArgs

    if sch.is_fp4:  # llm-compressor's NVFP4A16 preset
        return QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=fp4.GROUP,
                                block_structure=None, dynamic=False, actorder=None, observer="minmax",
                                observer_kwargs={}, scale_dtype=torch.float8_e4m3fn)
    if sch.is_mxfp4:  # llm-compressor's MXFP4A16 preset
        return QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="group", group_size=mxfp4.GROUP,
                                block_structure=None, dynamic=False, actorder=None, observer="minmax",
                                observer_kwargs={}, scale_dtype=torch.uint8)
    if sch.is_float:
        block = sch.rows > 1 or sch.group_size != -1
        return QuantizationArgs(
            num_bits=sch.num_bits, type="float", symmetric=True, strategy="block" if block else "channel",
            group_size=None, block_structure=[sch.rows, sch.group_size] if block else None, dynamic=False,
            actorder=None, observer="minmax", observer_kwargs={},
        )
    return QuantizationArgs(
        num_bits=sch.num_bits, type="int", symmetric=sch.symmetric,
        strategy="channel" if sch.group_size == -1 else "group",
        group_size=None if sch.group_size == -1 else sch.group_size,
        block_structure=None, dynamic=False, actorder=actorder, observer="minmax", observer_kwargs={},
    )


def _input_args(sch: Scheme):
    """compressed-tensors ``QuantizationArgs`` of a scheme's input quantization, or ``None`` (``fp8-token``: per
    token; ``fp8-group``: per token and group of the weight's columns per block; ``nvfp4``: the preset ``NVFP4``'s
    inputs, ``tensor_group`` of 16, ``dynamic: local``)."""
    from compressed_tensors.quantization import QuantizationArgs

    if not sch.act:
        return None
    if sch.act == NVFP4_ACT:  # compressed-tensors' preset NVFP4: e4m3 scales per 16 per call, a static global scale
        return QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=fp4.GROUP,
                                block_structure=None, dynamic="local", actorder=None, observer="static_minmax",
                                observer_kwargs={}, scale_dtype=torch.float8_e4m3fn)
    group = sch.act == "fp8-group"
    return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group" if group else "token",
                            group_size=sch.group_size if group else None, block_structure=None, dynamic=True,
                            actorder=None, observer=None, observer_kwargs={})


def _scheme_format(sch: Scheme) -> str:
    """The compressed-tensors compressor of a scheme: ``nvfp4-pack-quantized`` (NVFP4), ``mxfp4-pack-quantized``
    (MXFP4), ``float-quantized`` (FP8) or ``pack-quantized``."""
    if sch.is_fp4:
        return "nvfp4-pack-quantized"
    if sch.is_mxfp4:
        return "mxfp4-pack-quantized"
    return "float-quantized" if sch.is_float else "pack-quantized"


def quantization_config(
    schemes: dict[str, tuple],
    ignore: list[str],
    ct_version: str,
    actorder: str | None = None,
    kv_cache: dict | None = None,
    embeddings: dict[str, tuple] | None = None,
) -> dict:
    """``config.json["quantization_config"]`` for integer weight-only and FP8 W8A8 schemes.

    Built as compressed-tensors' own pydantic ``QuantizationConfig`` /
    ``QuantizationScheme`` / ``QuantizationArgs`` (so the library's validators run) and
    dumped with the keys llm-compressor's saved checkpoints carry (``docs/formats.md``):
    the weight args keep ``block_structure``/``actorder``/``observer_kwargs`` even when
    empty, and ``sparsity_config``/``transform_config``/``version`` are added.

    Args:
        schemes: quantized module name -> :class:`~compressor.quant.primitives.Scheme` (or its
            first entries, ``(num_bits, group_size, symmetric)``: an integer scheme). An FP8
            scheme's group is ``float-quantized`` with its ``input_activations`` (dynamic fp8 per
            token or per group); groups of both kinds make the top-level ``format``
            ``mixed-precision``, as compressed-tensors' ``infer_model_format`` names it.
        ignore: module names left in float (``lm_head`` and ignored linears).
        actorder: ``"weight"`` when GPTQ act-order with static groups was used (the
            only act-order compressed-tensors 0.20 stores; ``"group"`` was removed).
        kv_cache: ``kv_cache_scheme`` (see :func:`kv_cache_scheme`) or None.
        embeddings: quantized embedding tables (recipe ``embedding:``) -> scheme, as ``schemes``;
            each scheme gets a group listing their exact names after the Linears' groups
            (never the class ``Linear`` target, and no act-order).

    ``group_size=-1`` is written as ``strategy: channel``. The most common scheme targets
    the class ``Linear`` (unless vLLM would then misread a fused layer:
    :func:`compressor.formats.ct_groups.order_groups`); every other scheme gets its own group listing
    exact module names (routed experts: one ``re:`` target per linear kind that matches exactly their names,
    :func:`compressor.formats.ct_groups.compact_targets`), which take precedence over class targets in
    compressed-tensors' ``match_targets`` (exact name, then regex, then class).

    Raises:
        pydantic.ValidationError: a scheme compressed-tensors refuses (kvq's recipes never
            produce one: the check is the library's).
    """
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    counts: dict[Scheme, list[str]] = {}
    for name, sch in schemes.items():
        counts.setdefault(Scheme(*sch), []).append(name)
    ordered, linear = order_groups(counts)  # which group targets the class Linear (vLLM's matching order)
    known = set(schemes) | set(ignore) | set(embeddings or ())  # what a routed experts' re: target must not match
    groups = {
        f"group_{k}": QuantizationScheme(
            targets=["Linear"] if k == linear else compact_targets(names, known), weights=_weight_args(sch, actorder),
            input_activations=_input_args(sch), output_activations=None, format=_scheme_format(sch),
        )
        for k, (sch, names) in enumerate(ordered)
    }
    tables: dict[Scheme, list[str]] = {}
    for name, sch in (embeddings or {}).items():
        tables.setdefault(Scheme(*sch), []).append(name)
    for sch, names in sorted(tables.items()):
        groups[f"group_{len(groups)}"] = QuantizationScheme(
            targets=sorted(names), weights=_weight_args(sch, None), input_activations=None, output_activations=None,
            format="pack-quantized")
    formats = {g.format for g in groups.values()}
    cfg = QuantizationConfig(
        config_groups=groups, quant_method="compressed-tensors",
        kv_cache_scheme=None if kv_cache is None else QuantizationArgs(**kv_cache),
        format=(formats.pop() if len(formats) == 1 else "mixed-precision") if groups else "dense",
        quantization_status="compressed", global_compression_ratio=None, ignore=sorted(ignore),
    )
    return {
        "config_groups": {
            name: {**_dump(g, ("targets",)),
                   "weights": _dump_args(g.weights, _FP4_ARGS_KEYS if g.format in _FP4_FORMATS else
                                         _WEIGHT_ARGS_KEYS),
                   "input_activations": _dump_args(g.input_activations, _FP4_ARGS_KEYS if g.format ==
                                                   "nvfp4-pack-quantized" else _WEIGHT_ARGS_KEYS),
                   "output_activations": _dump_args(g.output_activations), **_dump(g, ("format",))}
            for name, g in cfg.config_groups.items()
        },
        **_dump(cfg, ("format", "global_compression_ratio", "ignore")),
        "kv_cache_scheme": _dump_args(cfg.kv_cache_scheme, _KV_ARGS_KEYS),
        **_dump(cfg, ("quant_method", "quantization_status")),
        "sparsity_config": {},
        "transform_config": {},
        "version": ct_version,
    }


def kv_cache_scheme(spec) -> dict | None:
    """compressed-tensors ``kv_cache_scheme`` for a static KV spec, ``None`` for the others.

    fp8 per tensor / per head and int8 static per head map to ``strategy: tensor`` /
    ``attn_head`` (``docs/formats.md``; vLLM's validator accepts those strategies,
    symmetric only). Dynamic per-token int8 and KIVI have no field in compressed-tensors:
    the manifest records them. Built as the library's ``QuantizationArgs``.
    """
    if spec is None or not spec.static:
        return None
    from compressed_tensors.quantization import QuantizationArgs

    # the KV scheme object declares its field (compressor.kv_schemes); the library validates it
    args = QuantizationArgs(**spec.codec.config_field())
    return _dump(args, _KV_ARGS_KEYS)


def kv_scale_tensors(scales: dict[int, tuple[torch.Tensor, torch.Tensor]], layers_path: str, attention: str, strategy: str) -> dict[str, torch.Tensor]:
    """Stored ``<layers>.<i>.<attention>.k_scale`` / ``v_scale`` tensors: shape ``[1]`` per
    tensor, ``[kv_heads, 1, 1]`` per head (compressed-tensors ``initialize_attn_qparams``)."""
    out = {}
    for i, (k, v) in scales.items():
        for name, t in (("k_scale", k), ("v_scale", v)):
            t = t.reshape(1) if strategy == "tensor" else t.reshape(-1, 1, 1)
            out[f"{layers_path}.{i}.{attention}.{name}"] = t.contiguous()
    return out


def module_scheme(qc: dict, module: str) -> dict:
    """The ``weights`` args of :func:`module_group` (InputError: no group applies)."""
    return module_group(qc, module)["weights"]


def activation_scheme(args: dict | None) -> tuple[str, int]:
    """``(act, group size)`` of a group's ``input_activations``: ``("", 0)`` for none, ``("fp8-token", 0)``,
    ``("fp8-group", group_size)`` (:data:`compressor.quant.fp8.ACT_SCHEMES`), ``("nvfp4", 16)`` (NVFP4 W4A4:
    ``tensor_group`` of 16, ``dynamic: local``; :mod:`compressor.quant.fp4_inputs`).

    Raises:
        InputError: input quantization kvq does not simulate (static scales, integers, other widths).
    """
    if not args:
        return "", 0
    kind = (args.get("type"), args.get("num_bits"), args.get("strategy"), args.get("dynamic"))
    if kind == ("float", 8, "token", True):
        return ACT_SCHEMES[0], 0
    if kind == ("float", 8, "group", True) and int(args.get("group_size") or 0) > 0:
        return ACT_SCHEMES[1], int(args["group_size"])
    if kind == ("float", 4, "tensor_group", "local") and args.get("group_size") == fp4.GROUP:
        return NVFP4_ACT, fp4.GROUP
    given = ", ".join(f"{k} {v}" for k, v in args.items())
    raise InputError(f"input_activations ({given}) are not simulated by kvq (dynamic fp8 per token or group, NVFP4 "
                     "tensor_group of 16 with dynamic local only)")


def input_quantization(qc: dict) -> list[str]:
    """The dynamic input quantizations a ``quantization_config`` declares (``fp8-token``,
    ``fp8-group 128``), each once, sorted; ``[]`` for weight-only artifacts and other quant methods.

    Raises:
        InputError: input quantization kvq does not simulate (:func:`activation_scheme`).
    """
    if (qc or {}).get("quant_method") != "compressed-tensors":
        return []
    found = {activation_scheme((g or {}).get("input_activations")) for g in (qc.get("config_groups") or {}).values()}
    return sorted(f"{a} {g}" if a == ACT_SCHEMES[1] else a for a, g in found if a)


def _fp8_inputs_only(act: str) -> None:
    """Raises InputError for NVFP4 input_activations on a module whose weights are not NVFP4's."""
    if act == NVFP4_ACT:
        raise InputError("NVFP4 input_activations (W4A4) go with NVFP4 weights (nvfp4-pack-quantized)")


def read_float_module(qc: dict, module: str, t: dict[str, torch.Tensor]) -> QuantWeight:
    """An FP8 ``float-quantized`` module: ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale``
    ``[N, 1]`` (``strategy: channel``), ``[ceil(N/rows), ceil(K/cols)]`` (``block``, partial edge
    blocks) or ``[1]`` (``tensor``), any float dtype; its group's ``input_activations`` become ``act``.

    Raises:
        InputError: a weight that is not 2-D e4m3, a scheme that is not FP8, a scale of another shape.
    """
    group = module_group(qc, module)
    w = group.get("weights") or {}
    q, scale = t["weight"], t["weight_scale"]
    if (w.get("type"), w.get("num_bits")) != ("float", 8) or q.dtype != torch.float8_e4m3fn or q.ndim != 2:
        raise InputError(f"weight {q.dtype} {tuple(q.shape)} with weights {w.get('type')} {w.get('num_bits')}-bit "
                         "is not an FP8 e4m3 float-quantized weight")
    n, k = q.shape
    strategy = w.get("strategy")
    rows, cols = {"channel": (1, k), "tensor": (n, k)}.get(strategy, tuple(w.get("block_structure") or (0, 0)))
    if strategy not in ("channel", "tensor", "block") or rows < 1 or cols < 1:
        raise InputError(f"FP8 weights with strategy {strategy!r} are not read (channel, block or tensor)")
    expect = (-(-n // rows), -(-k // cols))
    if scale.numel() != expect[0] * expect[1] or (strategy != "tensor" and tuple(scale.shape) != expect):
        raise InputError(f"weight_scale shape {tuple(scale.shape)} does not match weight {(n, k)} "
                         f"in {rows} x {cols} blocks")
    act, act_group = activation_scheme(group.get("input_activations"))
    _fp8_inputs_only(act)
    return QuantWeight(q, scale.reshape(expect), None, 8, cols, rows=rows, act=act, act_group=act_group)


def _e2m1_codes(qc: dict, module: str, t: dict[str, torch.Tensor], group_size: int, grid: str) -> torch.Tensor:
    """The unpacked e2m1 codes (uint8 ``[N, K]``) of an NVFP4 or MXFP4 module, once its config group is checked to
    be ``grid`` (4-bit float weights in groups of ``group_size``) weight-only or, for NVFP4, with NVFP4
    ``input_activations`` (W4A4).

    Raises:
        InputError: another group, or a ``weight_packed`` that is not 2-D uint8.
    """
    group = module_group(qc, module)
    w = group.get("weights") or {}
    acts = group.get("input_activations")
    if (w.get("type"), w.get("num_bits"), w.get("group_size")) != ("float", 4, group_size) or \
            (acts and (grid != "NVFP4" or activation_scheme(acts)[0] != NVFP4_ACT)):
        what = f"{grid} weight-only" + (" or W4A4" if grid == "NVFP4" else "")
        raise InputError(f"weights {w.get('type')} {w.get('num_bits')}-bit in groups of {w.get('group_size')} "
                         f"(input_activations {acts}) are not {what}")
    return fp4.unpack_codes(t["weight_packed"])


def read_fp4_module(qc: dict, module: str, t: dict[str, torch.Tensor]) -> QuantWeight:
    """An NVFP4 ``nvfp4-pack-quantized`` module: ``weight_packed`` uint8 ``[N, K/2]``, ``weight_scale``
    float8_e4m3fn ``[N, K/16]``, ``weight_global_scale`` ``[1]`` (:mod:`compressor.quant.fp4`); with NVFP4
    ``input_activations`` (W4A4) its ``input_global_scale`` ``[1]`` too (:mod:`compressor.quant.fp4_inputs`).

    Raises:
        InputError: a group that is not NVFP4 weight-only, tensors of other dtypes or shapes.
    """
    q = _e2m1_codes(qc, module, t, fp4.GROUP, "NVFP4")
    scale, g = t["weight_scale"], t["weight_global_scale"]
    n, k = q.shape
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // fp4.GROUP) or k % fp4.GROUP \
            or g.numel() != 1:
        raise InputError(f"weight_scale {scale.dtype} {tuple(scale.shape)} / weight_global_scale "
                         f"{tuple(g.shape)} do not match NVFP4 weight {(n, k)}")
    if not module_group(qc, module).get("input_activations"):
        return QuantWeight(q, scale, None, 4, fp4.GROUP, global_scale=g.float().reshape(1))
    gi = t.get("input_global_scale")
    if gi is None or gi.numel() != 1 or not gi.is_floating_point() or not bool(torch.isfinite(gi).all()) \
            or float(gi.reshape(())) <= 0:
        raise InputError(f"NVFP4 activations (W4A4) need input_global_scale, one finite positive float "
                         f"(got {None if gi is None else tuple(gi.shape)})")
    return QuantWeight(q, scale, None, 4, fp4.GROUP, global_scale=g.float().reshape(1), act=NVFP4_ACT,
                       act_group=fp4.GROUP, input_global_scale=gi.float().reshape(1))


def read_mxfp4_module(qc: dict, module: str, t: dict[str, torch.Tensor]) -> QuantWeight:
    """An MXFP4 ``mxfp4-pack-quantized`` module: ``weight_packed`` uint8 ``[N, K/2]``, ``weight_scale`` uint8
    ``[N, K/32]`` biased E8M0 exponents (:mod:`compressor.quant.mxfp4`).

    Raises:
        InputError: a group that is not MXFP4 weight-only, tensors of other dtypes or shapes.
    """
    q = _e2m1_codes(qc, module, t, mxfp4.GROUP, "MXFP4")
    e = t["weight_scale"]
    n, k = q.shape
    if e.dtype != torch.uint8 or tuple(e.shape) != (n, k // mxfp4.GROUP) or k % mxfp4.GROUP:
        raise InputError(f"weight_scale {e.dtype} {tuple(e.shape)} does not match MXFP4 weight {(n, k)} "
                         f"(uint8 exponents, one per {mxfp4.GROUP} inputs)")
    return QuantWeight(q, e, None, 4, mxfp4.GROUP)


class CompressedTensorsFormat(WeightFormat):
    """``--format compressed-tensors`` (the default): ``pack-quantized`` (integers), ``float-quantized``
    (FP8 W8A8), ``nvfp4-pack-quantized`` and ``mxfp4-pack-quantized`` (e2m1 weights), read by vLLM and
    transformers.

    Also the only format with static KV-cache scales (``kv_cache_scheme`` plus
    ``k_scale``/``v_scale`` tensors, see :func:`kv_scale_tensors`).
    """

    name = "compressed-tensors"
    quant_method = "compressed-tensors"
    carries_head = True
    #: ``weight`` is a leaf of a packed module only (an FP8 ``float-quantized`` one: e4m3 codes)
    leaves = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "weight",
              "weight_global_scale", "input_global_scale")
    marker = "weight_scale"  # both compressors store it; a float module never does

    def check(self, recipe, dtype_name: str) -> None:
        """Refuse dynamic act-order (compressed-tensors 0.20 removed ``actorder: group``).

        Raises:
            InputError: GPTQ act-order with grouped schemes and no static groups.
        """
        if dynamic_act_order(recipe):
            raise InputError(
                "compressed-tensors 0.20 stores act-order only with static groups (actorder: weight); "
                "set gptq.static_groups: true or use --format gptq (which stores g_idx)"
            )

    def pack(self, rec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """:func:`module_tensors` of the record, scales in ``dtype``; an FP8 record (``type float``)
        as ``float-quantized``: ``weight`` (its e4m3 codes) and its float32 ``weight_scale``."""
        if rec.scheme.is_fp4:
            out = {"weight_packed": fp4.pack_codes(rec.q), "weight_scale": rec.scale.contiguous(),
                   "weight_global_scale": rec.global_scale.float().reshape(1).contiguous()}
            if rec.act == NVFP4_ACT:  # W4A4: the calibrated input global scale (compressor.quant.fp4_inputs)
                if rec.input_global_scale is None:
                    raise QuantizationError("an NVFP4 W4A4 linear has no input_global_scale: its input was not "
                                            "observed on the calibration pass; nothing was written")
                out["input_global_scale"] = rec.input_global_scale.float().reshape(1).contiguous()
            return out
        if rec.scheme.is_mxfp4:
            return {"weight_packed": fp4.pack_codes(rec.q), "weight_scale": rec.scale.contiguous()}
        if rec.type == "float":
            return {"weight": rec.q.contiguous(), "weight_scale": rec.scale.to(torch.float32).contiguous()}
        return module_tensors(rec.q, rec.scale, rec.zero_point, rec.num_bits, dtype)

    def read(self, qc: dict, module: str, t: dict[str, torch.Tensor]) -> QuantWeight:
        """Read ``weight_packed``/``weight_scale``/``weight_shape`` (+ ``weight_zero_point``,
        ``weight_g_idx``) with the config group that applies to ``module``; an FP8 module
        (``weight`` and ``weight_scale``) through :func:`read_float_module`. The group's
        ``input_activations`` (dynamic fp8) become the weight's ``act``.

        Raises:
            InputError: a tensor missing, no config group, shapes inconsistent with the group,
                input quantization kvq does not simulate.
        """
        if "weight_global_scale" in t:
            require_leaves(t, ("weight_packed", "weight_scale", "weight_global_scale"))
            return read_fp4_module(qc, module, t)
        if "weight_packed" in t and t["weight_packed"].dtype == torch.uint8:  # integers pack into int32
            require_leaves(t, ("weight_packed", "weight_scale"))
            return read_mxfp4_module(qc, module, t)
        int8 = "weight_packed" not in t and "weight" in t and t["weight"].dtype == torch.int8  # int-quantized
        if "weight_packed" not in t and "weight" in t and not int8:  # FP8 float-quantized
            require_leaves(t, ("weight", "weight_scale"))
            return read_float_module(qc, module, t)
        require_leaves(t, ("weight", "weight_scale") if int8 else ("weight_packed", "weight_scale", "weight_shape"))
        group = module_group(qc, module)
        wargs = group["weights"]
        require_zero_point(wargs, t)
        bits = int(wargs["num_bits"])
        q, scale, zp = int_values(wargs, t) if int8 else read_module(t, bits)
        k = q.shape[1]
        gs = k if wargs.get("strategy") == "channel" else int(wargs.get("group_size") or 0)
        if gs < 1 or k % gs or tuple(scale.shape) != (q.shape[0], k // gs):
            raise InputError(f"weight_scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)}")
        g_idx = t.get("weight_g_idx")
        act, act_group = activation_scheme(group.get("input_activations"))
        _fp8_inputs_only(act)
        return QuantWeight(q, scale, symmetric_zero(zp), bits, gs, None if g_idx is None else g_idx.to(torch.int32),
                           act=act, act_group=act_group)

    def config(self, recipe, schemes: dict[str, tuple], ignored: list[str], versions: dict,
               embeddings: dict[str, tuple] | None = None) -> dict | None:
        """:func:`quantization_config` with ``lm_head`` ignored (unless the recipe quantizes
        it: then it is one of ``schemes``), ``actorder: weight`` for GPTQ
        act-order, the recipe's static ``kv_cache_scheme`` and the quantized ``embeddings``'
        groups; ``None`` when there is nothing to describe (no quantized module and no
        static KV scheme)."""
        kv = recipe.kv_cache.spec() if recipe.kv_cache is not None else None
        kv_cfg = kv_cache_scheme(kv) if kv is not None else None
        if not schemes and not embeddings and kv_cfg is None:
            return None  # nothing compressed-tensors can describe (KV scheme lives in the manifest)
        actorder = "weight" if act_order(recipe) else None
        head = [] if any(n.rsplit(".", 1)[-1] == "lm_head" for n in schemes) else ["lm_head"]  # recipe head: quantized
        return quantization_config(schemes, head + ignored, versions["compressed-tensors"], actorder, kv_cfg, embeddings)

    def declared(self, qc: dict) -> list[dict]:
        """One scheme per config group's ``weights`` (``strategy: channel`` -> group size -1)."""
        out = []
        for g in (qc.get("config_groups") or {}).values():
            w = (g or {}).get("weights") or {}
            if w:
                gs = -1 if w.get("strategy") == "channel" else w.get("group_size")
                if w.get("strategy") == "block":
                    gs = (w.get("block_structure") or [None, None])[1]
                out.append({"num_bits": w.get("num_bits"), "group_size": gs, "symmetric": w.get("symmetric")}
                           | ({"type": w["type"], "strategy": w.get("strategy")} if w.get("type") == "float" else {}))
        return out

    def with_kv(self, qc: dict, spec) -> dict:
        """``kv_cache_scheme`` set to :func:`kv_cache_scheme` of ``spec`` (``None`` for a
        dynamic scheme, which the manifest records)."""
        return {**qc, "kv_cache_scheme": kv_cache_scheme(spec)}
