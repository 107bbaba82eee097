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

:class:`CompressedTensorsFormat` is the format object (writer, reader, config, checks);
``quantization_config`` is built through the library's pydantic models. Layout details:
``docs/formats.md``.
"""

from __future__ import annotations

import copy

import torch

from ..errors import InputError
from ..quant.primitives import qrange
from .base import QuantWeight, WeightFormat, act_order, dynamic_act_order, require_leaves, symmetric_zero
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
#: the same keys in the order kvq has always written ``kv_cache_scheme``
_KV_ARGS_KEYS = ("num_bits", "type", "strategy", "dynamic", "symmetric", "group_size", "block_structure",
                 "actorder", "observer", "observer_kwargs")


def _dump(model, keys: tuple[str, ...]) -> dict:
    """``model.model_dump(mode="json")`` restricted to ``keys`` in that order; a key the
    library's serializer omitted is written with the model's own value (``None`` / ``{}``)."""
    data = model.model_dump(mode="json")
    return {k: data[k] if k in data else copy.deepcopy(getattr(model, k)) for k in keys}


def _dump_args(args, keys: tuple[str, ...] = _WEIGHT_ARGS_KEYS) -> dict | None:
    return None if args is None else _dump(args, keys)


def _weight_args(num_bits: int, group_size: int, symmetric: bool, actorder: str | None):
    """compressed-tensors ``QuantizationArgs`` of an integer weight scheme (``-1``: per channel)."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(
        num_bits=num_bits, type="int", symmetric=symmetric,
        strategy="channel" if group_size == -1 else "group",
        group_size=None if group_size == -1 else group_size,
        block_structure=None, dynamic=False, actorder=actorder, observer="minmax", observer_kwargs={},
    )


def quantization_config(
    schemes: dict[str, tuple[int, int, bool]],
    ignore: list[str],
    ct_version: str,
    actorder: str | None = None,
    kv_cache: dict | None = None,
    embeddings: dict[str, tuple[int, int, bool]] | None = None,
) -> dict:
    """``config.json["quantization_config"]`` for integer weight-only schemes.

    Built as compressed-tensors' own pydantic ``QuantizationConfig`` /
    ``QuantizationScheme`` / ``QuantizationArgs`` (so the library's validators run) and
    dumped with the keys llm-compressor's saved checkpoints carry (``docs/formats.md``):
    the weight args keep ``block_structure``/``actorder``/``observer_kwargs`` even when
    empty, and ``sparsity_config``/``transform_config``/``version`` are added.

    Args:
        schemes: quantized module name -> ``(num_bits, group_size, symmetric)``.
        ignore: module names left in float (``lm_head`` and ignored linears).
        actorder: ``"weight"`` when GPTQ act-order with static groups was used (the
            only act-order compressed-tensors 0.20 stores; ``"group"`` was removed).
        kv_cache: ``kv_cache_scheme`` (see :func:`kv_cache_scheme`) or None.
        embeddings: quantized embedding tables (recipe ``embedding:``) -> scheme, as ``schemes``;
            each scheme gets a group listing their exact names after the Linears' groups
            (never the class ``Linear`` target, and no act-order).

    ``group_size=-1`` is written as ``strategy: channel``. The most common scheme targets
    the class ``Linear``; every other scheme gets its own group listing exact module
    names, which take precedence over class targets in compressed-tensors'
    ``match_targets`` (exact name, then regex, then class) and in vLLM's target matching.

    Raises:
        pydantic.ValidationError: a scheme compressed-tensors refuses (kvq's recipes never
            produce one: the check is the library's).
    """
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    counts: dict[tuple, list[str]] = {}
    for name, sch in schemes.items():
        counts.setdefault(tuple(sch), []).append(name)
    ordered = sorted(counts.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    groups = {
        f"group_{k}": QuantizationScheme(
            targets=["Linear"] if k == 0 else sorted(names), weights=_weight_args(*sch, actorder),
            input_activations=None, output_activations=None, format="pack-quantized",
        )
        for k, (sch, names) in enumerate(ordered)
    }
    tables: dict[tuple, list[str]] = {}
    for name, sch in (embeddings or {}).items():
        tables.setdefault(tuple(sch), []).append(name)
    for sch, names in sorted(tables.items()):
        groups[f"group_{len(groups)}"] = QuantizationScheme(
            targets=sorted(names), weights=_weight_args(*sch, None), input_activations=None, output_activations=None,
            format="pack-quantized")
    cfg = QuantizationConfig(
        config_groups=groups, quant_method="compressed-tensors",
        kv_cache_scheme=None if kv_cache is None else QuantizationArgs(**kv_cache),
        format="pack-quantized" if groups else "dense", quantization_status="compressed",
        global_compression_ratio=None, ignore=sorted(ignore),
    )
    return {
        "config_groups": {
            name: {**_dump(g, ("targets",)), "weights": _dump_args(g.weights),
                   "input_activations": _dump_args(g.input_activations),
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
    """The ``weights`` args of the config group that applies to ``module`` (exact name before class target).

    Raises:
        InputError: no group applies.
    """
    groups = list((qc.get("config_groups") or {}).values())
    for g in groups:
        if module in (g.get("targets") or []):
            return g["weights"]
    for g in groups:
        for t in g.get("targets") or []:
            if t.startswith("re:"):
                import re

                if re.match(t[3:], module):  # as compressed-tensors match_name does
                    return g["weights"]
    for g in groups:
        if "Linear" in (g.get("targets") or []):
            return g["weights"]
    raise InputError(f"no quantization config group applies to {module}")


class CompressedTensorsFormat(WeightFormat):
    """``--format compressed-tensors`` (the default): ``pack-quantized``, read by vLLM and transformers.

    Also the only format with static KV-cache scales (``kv_cache_scheme`` plus
    ``k_scale``/``v_scale`` tensors, see :func:`kv_scale_tensors`).
    """

    name = "compressed-tensors"
    quant_method = "compressed-tensors"
    carries_head = True
    leaves = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
    marker = "weight_packed"

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
        """:func:`module_tensors` of the record, scales in ``dtype``."""
        return module_tensors(rec.q, rec.scale, rec.zero_point, rec.num_bits, dtype)

    def read(self, qc: dict, module: str, t: dict[str, torch.Tensor]) -> QuantWeight:
        """Read ``weight_packed``/``weight_scale``/``weight_shape`` (+ ``weight_zero_point``,
        ``weight_g_idx``) with the config group that applies to ``module``.

        Raises:
            InputError: a tensor missing, no config group, shapes inconsistent with the group.
        """
        require_leaves(t, ("weight_packed", "weight_scale", "weight_shape"))
        wargs = module_scheme(qc, module)
        bits = int(wargs["num_bits"])
        q, scale, zp = read_module(t, bits)
        k = q.shape[1]
        gs = k if wargs.get("strategy") == "channel" else int(wargs["group_size"])
        if k % gs or tuple(scale.shape) != (q.shape[0], k // gs):
            raise InputError(f"weight_scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)}")
        g_idx = t.get("weight_g_idx")
        return QuantWeight(q, scale, symmetric_zero(zp), bits, gs, None if g_idx is None else g_idx.to(torch.int32))

    def config(self, recipe, schemes: dict[str, tuple[int, int, bool]], ignored: list[str], versions: dict,
               embeddings: dict[str, tuple[int, int, bool]] | None = None) -> dict | None:
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
                out.append({"num_bits": w.get("num_bits"), "group_size": gs, "symmetric": w.get("symmetric")})
        return out

    def with_kv(self, qc: dict, spec) -> dict:
        """``kv_cache_scheme`` set to :func:`kv_cache_scheme` of ``spec`` (``None`` for a
        dynamic scheme, which the manifest records)."""
        return {**qc, "kv_cache_scheme": kv_cache_scheme(spec)}
