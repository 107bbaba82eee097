"""On-disk formats written and read by kvq.

* ``compressed-tensors`` (default): what vLLM and transformers load natively.
* ``awq``: AutoAWQ GEMM (``quant_method: awq``, ``version: gemm``), 4-bit only.
* ``gptq``: AutoGPTQ / GPTQModel (``quant_method: gptq``); symmetric schemes are written
  as ``checkpoint_format: gptq`` (v1, zero points stored minus one, what every GPTQ loader
  reads), asymmetric ones as ``gptq_v2`` (real zero points), because v1 cannot represent
  an unsigned zero point of 0 (FORMATS.md 2c).

The pipeline produces format-neutral records (``q``, ``scale``, ``zero_point``,
``g_idx`` in the compressed-tensors signed convention); this module checks, before any
work, that the recipe fits the chosen format, then packs the records.
"""

from __future__ import annotations

import torch

from ..errors import InputError

FORMATS = ("compressed-tensors", "awq", "gptq")
GPTQ_BITS = (2, 3, 4, 8)


def _recipe_schemes(recipe) -> list:
    """The base weight scheme and the base updated by each override."""
    return [recipe.weights] + [
        recipe.weights.model_copy(update={k: v for k, v in o.weights.model_dump().items() if v is not None})
        for o in recipe.overrides
    ]


def dynamic_act_order(recipe) -> bool:
    """True when the recipe's GPTQ act-order needs a stored ``g_idx`` (no static groups)."""
    grouped = any(s.group_size != -1 for s in _recipe_schemes(recipe))  # per channel: one group, no g_idx
    return recipe.algorithm == "gptq" and recipe.gptq.act_order and not recipe.gptq.static_groups and grouped


def check_format(fmt: str, recipe, dtype_name: str) -> None:
    """Refuse, before any work, a recipe the format cannot represent.

    Raises:
        InputError: unknown format; compressed-tensors with dynamic act-order (its 0.20
            release removed ``actorder: group``); AWQ with bits other than 4, per-channel
            groups, a ``g_idx`` or mixed precision; GPTQ with bits outside 2/3/4/8 or mixed
            precision; AWQ/GPTQ with a storage dtype other than float16 (their kernels read
            fp16 scales).
    """
    if fmt not in FORMATS:
        raise InputError(f"unknown format '{fmt}'; choose one of {', '.join(FORMATS)}")
    schemes = _recipe_schemes(recipe)
    if fmt != "compressed-tensors" and recipe.algorithm == "none":
        raise InputError(f"--format {fmt} stores quantized weights; a KV-only recipe (algorithm none) needs --format compressed-tensors")
    if fmt != "compressed-tensors" and recipe.kv_cache is not None and recipe.kv_cache.spec().static:
        raise InputError(
            f"--format {fmt} has no field for static KV-cache scales ({recipe.kv_cache.spec().describe()}); "
            "use --format compressed-tensors (kv_cache_scheme + k_scale/v_scale, read by vLLM)"
        )
    if fmt == "compressed-tensors":
        if dynamic_act_order(recipe):
            raise InputError(
                "compressed-tensors 0.20 stores act-order only with static groups (actorder: weight); "
                "set gptq.static_groups: true or use --format gptq (which stores g_idx)"
            )
        return
    if dtype_name != "float16":
        raise InputError(f"--format {fmt} stores float16 scales; use --dtype float16 (got {dtype_name})")
    if fmt == "awq":
        from .awq import check_awq_compatible

        for s in schemes:
            check_awq_compatible(s.num_bits, s.group_size if s.group_size != "auto" else 128, [8],
                                 dynamic_act_order(recipe), recipe.is_mixed)
    else:
        from .gptq import check_gptq_compatible

        for s in schemes:
            check_gptq_compatible(s.num_bits, recipe.is_mixed)


def check_shapes(fmt: str, out_features: dict[str, int]) -> None:
    """Shape limits known once the model is loaded (AWQ packs 8 output channels per word).

    Raises:
        InputError: names the first module whose ``out_features`` is not a multiple of 8.
    """
    if fmt == "awq":
        bad = [n for n, o in out_features.items() if o % 8]
        if bad:
            raise InputError(f"--format awq needs out_features divisible by 8; {bad[0]} has {out_features[bad[0]]}")


def gptq_checkpoint_format(symmetric: bool) -> str:
    """``gptq`` (v1) for symmetric schemes, ``gptq_v2`` for asymmetric ones (see the module docstring)."""
    return "gptq" if symmetric else "gptq_v2"


def pack_modules(modules: dict, fmt: str, dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
    """Pack pipeline records (``QuantizedLinear``) into the stored tensors of ``fmt``.

    Returns module name -> {tensor suffix -> tensor} (e.g. ``weight_packed`` or ``qweight``).
    """
    out = {}
    for name, r in modules.items():
        if fmt == "compressed-tensors":
            from .compressed_tensors import module_tensors

            out[name] = module_tensors(r.q, r.scale, r.zero_point, r.num_bits, dtype)
        elif fmt == "awq":
            from .awq import awq_module_tensors

            out[name] = awq_module_tensors(r.q, r.scale, r.zero_point, r.group_size, torch.float16)
        else:
            from .gptq import gptq_module_tensors

            out[name] = gptq_module_tensors(r.q, r.scale, r.zero_point, r.g_idx, r.num_bits, r.group_size,
                                            torch.float16, gptq_checkpoint_format(r.symmetric))
    return out


def format_config(fmt: str, recipe, schemes: dict[str, tuple[int, int, bool]], ignored: list[str], versions: dict) -> dict | None:
    """``config.json["quantization_config"]`` for ``fmt`` (``None``: the artifact needs none).

    Args:
        schemes: quantized module name -> ``(num_bits, group_size, symmetric)``.
        ignored: decoder linears left in float (``lm_head`` is added where the format needs it).
        versions: ``{"compressed-tensors": ..., "kvq": ...}``.
    """
    if fmt == "compressed-tensors":
        from .compressed_tensors import kv_cache_scheme, quantization_config

        kv = recipe.kv_cache.spec() if recipe.kv_cache is not None else None
        kv_cfg = kv_cache_scheme(kv) if kv is not None else None
        if not schemes and kv_cfg is None:
            return None  # nothing compressed-tensors can describe (KV scheme lives in the manifest)
        actorder = "weight" if recipe.algorithm == "gptq" and recipe.gptq.act_order else None
        return quantization_config(schemes, ["lm_head"] + ignored, versions["compressed-tensors"], actorder, kv_cfg)
    bits, gs, sym = next(iter(schemes.values()))
    if fmt == "awq":
        from .awq import awq_quantization_config

        return awq_quantization_config(gs, ignored or None)
    from .gptq import gptq_quantization_config

    g = recipe.gptq
    cfg = gptq_quantization_config(
        bits, gs, dynamic_act_order(recipe), sym, g.static_groups, g.true_sequential, g.damp,
        gptq_checkpoint_format(sym), versions["kvq"],
    )
    if ignored:  # GPTQModel's per-module negative overrides: these modules stay in float
        import re

        cfg["dynamic"] = {f"-:^{re.escape(n)}$": {} for n in ignored}
    return cfg
