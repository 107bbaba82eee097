"""The manifest blocks ``kvq quantize`` writes from a finished run: ``quantization``,
``kv_cache`` (static scales added as tensors), ``quality`` and the provenance's timings."""

from __future__ import annotations

from typing import Optional

from ..arch import checkpoint_name
from ..quant.algorithms import get_algorithm
from ..formats.compressed_tensors import kv_scale_tensors
from ..quant.kv import layout_bytes_per_token
from ..quant.primitives import Scheme
from ..recipe import Recipe

def quantization_summary(recipe: Recipe, fmt: str, dtype: str, group_size, schemes: dict) -> dict:
    """The manifest's ``quantization`` block: algorithm, format, weight scheme, module
    count, storage dtype; the schemes of a mixed recipe; the algorithm's own fields."""
    quant = {"algorithm": recipe.algorithm, "format": fmt, "num_bits": recipe.weights.num_bits, "group_size": group_size,
             "symmetric": recipe.weights.symmetric, "modules": len(schemes), "storage_dtype": dtype}
    if recipe.weights.type == "float" and recipe.weights.num_bits == 4 and recipe.weights.group_size == 32:  # MXFP4
        quant.update(type="float", strategy="group", scale_dtype="uint8 (E8M0 exponent)")
    elif recipe.weights.type == "float" and recipe.weights.num_bits == 4:  # NVFP4: e4m3 group scales, global scale
        quant.update(type="float", strategy="tensor_group", scale_dtype="float8_e4m3fn", global_scale="float32")
        if recipe.activations is not None:  # W4A4: the inputs' NVFP4 quantization
            quant.update(activations=recipe.activations.model_dump(mode="json"))
    elif recipe.weights.type == "float":  # FP8 W8A8: the grid, the scale blocks and the inputs' quantization
        quant.update(type="float", block_structure=recipe.weights.block_structure, scale_dtype="float32",
                     activations=recipe.activations.model_dump(mode="json") if recipe.activations else None)
    elif recipe.activations is not None and schemes:  # W4A8: integer weights, the inputs' quantization
        quant.update(activations=recipe.activations.model_dump(mode="json"))
    if recipe.is_mixed:
        quant["schemes"] = [{"num_bits": s.num_bits, "group_size": s.group_size, "symmetric": s.symmetric,
                             **({"type": s.type} if s.type != "int" else {}),
                             **({"rows": s.rows} if s.rows > 1 else {}),
                             **({"activations": s.act} if s.act else {}),  # a mixed recipe's FP8, FP4, W4A8 modules
                             "modules": sorted(n for n, v in schemes.items() if tuple(v) == tuple(s))}
                            for s in sorted({Scheme(*v) for v in schemes.values()})]
    quant.update(get_algorithm(recipe.algorithm).summary_fields(recipe, fmt))  # keys already present keep their place
    return quant


def kv_record(kv, result, arch, model, packed: dict) -> Optional[dict]:
    """The manifest's ``kv_cache`` block; static scales are added to ``packed`` as
    ``<layers>.<i>.<attention>.k_scale`` / ``v_scale`` tensors."""
    if kv is None:
        return None
    record = {"scheme": kv.scheme, "strategy": kv.strategy, "bits": kv.bits, "static_scales": kv.static}
    record.update(kv.codec.record_fields())
    if kv.static:
        layers = checkpoint_name(arch, arch.layers)  # the checkpoint's (a wrapper's text model: under its prefix)
        for name, t in kv_scale_tensors(result.kv_scales, layers, arch.attention, kv.strategy).items():
            module, _, leaf = name.rpartition(".")
            packed.setdefault(module, {})[leaf] = t
        record["scale_tensors"] = f"{layers}.<i>.{arch.attention}.k_scale / v_scale, shape " + (
            "[1]" if kv.strategy == "tensor" else "[num_kv_heads, 1, 1]")
        record["scale_search"], record["absmax"] = result.kv_scale_search, {  # absmax: the scales' ranges
            str(i): {"k": [round(float(x), 4) for x in k], "v": [round(float(x), 4) for x in v]} for i, (k, v) in result.kv_absmax.items()}
    record.update({"key_rotation": result.kv_key_rotation} if result.kv_key_rotation != "none" else {})  # q/k rows changed per RoPE pair
    layout = arch.kv_layout(model.config)
    record.update(layout=layout.as_dict(), bytes_per_token=layout_bytes_per_token(kv, layout),
                  fp16_bytes_per_token=layout_bytes_per_token(None, layout))
    return record


def mean_or_none(values) -> float | None:
    vals = [v for v in values if v is not None]
    return round(sum(vals) / len(vals), 6) if vals else None


def quality(result, recipe: Recipe, warnings: list[str]) -> dict:
    """The manifest's ``quality`` block (per-layer figures without timings, warnings, MoE routing)."""
    quality = {
        "layers": [{k: v for k, v in f.items() if k not in ("seconds", "phase_seconds")} for f in result.layers],
        "mean_rel_error": mean_or_none([f["mean_rel_error"] for f in result.layers]),
        "warnings": warnings,
    }
    if result.moe:  # routed calibration tokens per expert; experts quantized with the RTN fallback
        quality["moe"] = {"min_tokens": max(recipe.moe.min_tokens, 1), "layers": result.moe, "fallback": result.moe_fallback}
    return quality


def timing(result) -> dict:
    """Timings: they vary run to run, so they go to the provenance block, outside the content digest."""
    timing = {"quantize_seconds": round(result.seconds, 2), "layer_seconds": [f["seconds"] for f in result.layers]}
    if result.layers and "phase_seconds" in result.layers[0]:
        timing["phase_seconds"] = {k: round(sum(f["phase_seconds"][k] for f in result.layers), 2)
                                   for k in result.layers[0]["phase_seconds"]}
    return timing


def run_summary(plan, src, written, writer, world_size: int, opts, t0: float, workers: Optional[list] = None) -> dict:
    """The JSON summary of ``kvq quantize --json`` (``plan``, ``src``, ``written``: the command's
    records of :mod:`compressor.commands.quantize`; ``t0``: the run's start, ``time.perf_counter``).
    ``source_bytes_read`` (bytes read from a streamed source's shards, every worker's included;
    ``None`` otherwise; of a GGUF source, its float32 cache's) over ``wall_seconds`` is ``source_gb_per_s``
    (10^9 bytes a second); ``source_kind``: ``hf`` or ``gguf``;
    ``worker_reads``: each ``--workers`` process's reads and peak RSS (MiB)."""
    import time

    from ..activations import peak_rss_mib

    manifest, quality = written.manifest, written.quality
    wall = time.perf_counter() - t0
    read = getattr(src.ckpt, "bytes_read", None)
    kv = manifest.kv_cache and {k: manifest.kv_cache.get(k, "none") for k in ("scheme", "strategy", "scale_search",
                                                                                "key_rotation")}
    return {
        "output": str(plan.out),
        "recipe": plan.recipe.name,
        "quantization": written.quant,
        "calibration": src.calibration,
        "artifact_bytes": sum(f.size for f in manifest.files.values()),
        "float32_bytes": written.float_bytes,
        "quantize_seconds": written.timing["quantize_seconds"],
        "phase_seconds": written.timing.get("phase_seconds"),
        "wall_seconds": round(wall, 2),
        "peak_rss_mib": peak_rss_mib(),
        "source_loading": src.loading,
        "source_bytes_read": read, "source_gb_per_s": None if read is None else float(f"{read / 1e9 / wall:.4g}"),
        "source_kind": plan.source.kind,
        "matmul_precision": plan.matmul_precision, "threads": plan.threads, "busy_note": plan.busy,
        "workers": opts.execution.workers, "worker_reads": workers or None,
        "shards": sum(1 for n in manifest.files if n.endswith(".safetensors")),
        "resumed_from_layer": writer.start or None,
        "world_size": world_size,
        "mean_rel_error": quality["mean_rel_error"],
        "moe": quality.get("moe"), "head": quality.get("head"), "embedding": quality.get("embedding"), "kv_cache": kv,
        "warnings": plan.warnings,
        "content_digest": manifest.content_digest(),
        "digest_algorithm": opts.write.digest_algorithm,
        "signed": None if opts.write.sign is None else opts.write.sign.method(),
    }
