"""What both ``kvq verify`` paths share (:mod:`.verify`, whole models; :mod:`.verify_streamed`, a
decoder layer at a time): the dtype the artifact is evaluated in, the same-architecture check, the
configurations compared with the reference and their quantized KV caches, and the report's
distribution and KV sections."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..arch import get_arch
from ..errors import InputError
from ..formats.compressed_tensors import input_quantization
from ..source.config_check import quantization_config
from ..quant.kv import kv_budget, quantized_cache
from .options import VerifyOptions


@dataclass
class Models:
    """The two models verify compares (both ``torch.nn.Module``; streamed: decoder layers on ``meta``) and the
    artifact's tokenizer."""

    artifact: torch.nn.Module
    tokenizer: object
    reference: torch.nn.Module
    #: the artifact's key basis per layer (``kv_cache.key_rotation: pairs``), ``None`` without one
    key_basis: dict | None = None


def head_is_packed(folder: Path, model, module: str = "lm_head") -> bool:
    """True when the artifact stores its LM head (``module="embed_tokens"``: its input
    embedding) quantized (``<name>.weight_packed`` or ``<name>.qweight``, a compressed-tensors
    or GPTQ-style layout), from the safetensors headers."""
    from ..arch import checkpoint_name
    from ..safetensors_io import read_header

    arch = get_arch(model.config.model_type)
    name = checkpoint_name(arch, getattr(arch, module))
    return any(f"{name}.{leaf}" in read_header(s) for s in sorted(folder.glob("*.safetensors"))
               for leaf in ("weight_packed", "qweight"))


def eval_dtype(folder: Path, requested: str) -> tuple[torch.dtype, dict]:
    """The dtype the artifact is evaluated in: the one its ``config.json`` declares (what
    transformers and vLLM load it in by default), or float32 with ``--eval-dtype float32``.
    The reference model is always float32. With quantized inputs (FP8 W8A8) the record lists them
    (``activations``: :func:`compressor.formats.compressed_tensors.input_quantization`), which the
    artifact's loader simulates."""
    from ..artifact import DTYPES

    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    declared = cfg.get("dtype") or cfg.get("torch_dtype")
    declared = declared if declared in DTYPES else None
    acts = input_quantization(quantization_config(cfg) or {}) if isinstance(cfg, dict) else []
    extra = {"activations": acts} if acts else {}  # FP8 W8A8: each linear's input quantized as the kernel does
    if requested == "float32" or declared is None:
        why = "--eval-dtype float32" if requested == "float32" else "config.json declares no dtype kvq evaluates"
        return torch.float32, {"dtype": "float32", "declared": declared, "why": why, **extra}
    return DTYPES[declared], {"dtype": declared, "declared": declared, "why": "the dtype config.json declares", **extra}


def check_same_architecture(artifact, reference, ref_spec: str) -> None:
    """Refuse a reference that is not the same architecture: another ``model_type``, or
    parameters that differ in name or shape (depth, width, vocabulary).

    Raises:
        InputError: names the first difference.
    """
    a, r = artifact.config, reference.config
    if a.model_type != r.model_type:
        raise InputError(f"reference {ref_spec} is a {r.model_type} model, the artifact a {a.model_type} model: "
                         "nothing comparable")
    # tied parameters listed under every name: an artifact whose quantized head was untied
    # (recipe ``head:``) still matches its tied reference
    pa = {n: tuple(p.shape) for n, p in artifact.named_parameters(remove_duplicate=False)}
    pr = {n: tuple(p.shape) for n, p in reference.named_parameters(remove_duplicate=False)}
    if pa != pr:
        only_a, only_r = sorted(set(pa) - set(pr)), sorted(set(pr) - set(pa))
        shape = next((n for n in sorted(pa) if n in pr and pa[n] != pr[n]), None)
        what = (f"{only_a[0]} is missing from the reference" if only_a
                else f"the reference has an extra {only_r[0]}" if only_r
                else f"{shape} is {list(pa[shape])} in the artifact but {list(pr[shape])} in the reference")
        raise InputError(f"reference {ref_spec} does not have the artifact's architecture: {what}")


def cache_factory(model, kv_info, seqlen: int, report: dict):
    """A function making the quantized KV cache to evaluate with, or ``None`` without a KV scheme."""
    if kv_info is None:
        return None
    spec, scales = kv_info
    if spec.codec.residual_window and seqlen <= spec.residual_length:
        report["warnings"].append(
            f"--seqlen {seqlen} <= KIVI residual_length {spec.residual_length}: no token is ever quantized, "
            "the KV figures measure nothing; use a longer --seqlen")
    layout = get_arch(model.config.model_type).kv_layout(model.config)
    n_layers = model.config.num_hidden_layers
    return lambda basis=None: quantized_cache(spec, n_layers, scales, layout, key_basis=basis)


def candidate_rows(models: Models, weights_quantized: bool, make_cache, ref_cache=None) -> tuple[dict, str]:
    """The configurations compared with the reference, and the one the gates judge.

    ``KV only`` is the artifact as served when its weights are not quantized (its stored
    weights, in the dtype it is evaluated in, with the quantized cache); beside a weight
    artifact's rows it isolates the cache's cost on the reference model (``ref_cache``: that
    row's cache, keys in the artifact's basis when it has one)."""
    candidates = {}
    if weights_quantized:
        candidates["weights only"] = (models.artifact, None)
        if make_cache:
            candidates["weights + KV"] = (models.artifact, make_cache)
    if make_cache:
        candidates["KV only"] = ((models.reference, ref_cache or make_cache) if weights_quantized
                                 else (models.artifact, make_cache))
    if not candidates:
        candidates["weights only"] = (models.artifact, None)
    served = ("weights + KV" if weights_quantized and make_cache
              else ("weights only" if weights_quantized or not make_cache else "KV only"))
    return candidates, served


def measured_rows(models: Models, candidates: dict, kv_info) -> dict[str, str]:
    """What each row of the report ran: ``{label: "the artifact's weights in bfloat16 with the fp8
    per-tensor KV cache"}``, the reference included (the report's ``evaluated_in.rows``)."""
    def what(model, cache) -> str:
        whose = "the artifact's" if model is models.artifact else "the reference's"
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        cache_text = f"the {kv_info[0].describe()} KV cache" if cache else "a float KV cache"
        acts = getattr(model, "kvq_input_quantization", None)  # FP8 W8A8 (compressor.quant.fp8)
        inputs = f", each linear's input quantized {', '.join(acts)} (dynamic)" if acts else ""
        return f"{whose} weights in {dtype} with {cache_text}{inputs}"

    return {"reference": what(models.reference, None), **{label: what(m, c) for label, (m, c) in candidates.items()}}


def distribution_sections(report: dict, results: dict, served: str, wins, text, seqlen: int) -> None:
    """The report's ``eval``, ``perplexity``, ``perplexity_breakdown``, ``distribution`` and
    ``per_window`` sections (and the KL values for the histogram)."""
    ref, art = results["reference"], results[served]
    increase = (art["ppl"] / ref["ppl"] - 1.0) * 100.0
    report["eval"] = {**text.provenance(), "seqlen": seqlen, "windows": art["windows"],
                      "predicted_tokens": art["predicted_tokens"]}
    report["perplexity"] = {"artifact": round(art["ppl"], 4), "reference": round(ref["ppl"], 4),
                            "increase_pct": round(increase, 4), "measured_on": served,
                            "per_window_artifact": art["per_window_ppl"], "per_window_reference": ref["per_window_ppl"]}
    report["perplexity_breakdown"] = {
        label: {"ppl": round(r["ppl"], 4), "increase_pct": round((r["ppl"] / ref["ppl"] - 1) * 100, 4)}
        for label, r in results.items() if label not in ("seconds",)
    }
    report["distribution"] = {
        "measured_on": served, "kl": art["kl"], "top1_agreement_pct": 100.0 * art["top1_agreement"],
        "breakdown": {label: {"kl": r["kl"], "top1_agreement_pct": 100.0 * r["top1_agreement"]}
                      for label, r in results.items() if label not in ("reference", "seconds")},
    }
    report["per_window"] = [
        {"window": i, "ppl_artifact": art["per_window_ppl"][i], "ppl_reference": ref["per_window_ppl"][i],
         "kl_mean": art["per_window_kl_mean"][i], "top1_pct": round(100.0 * art["per_window_top1"][i], 4)}
        for i in range(len(wins))]
    report["_kl_values"] = art["kl_values"]


def kv_report(spec, source, ref_source, opts: VerifyOptions) -> dict:
    """Scheme plus memory accounting for the model's shape (bytes/token, what a budget holds)."""
    from ..source.resolve import load_config

    kv = opts.kv
    cfg = load_config(Path(opts.artifact))  # a multimodal wrapper's text model (Kimi K2.5)
    layout = get_arch(cfg.model_type).kv_layout(cfg)
    shape = (layout.n_layers, layout.components[0].heads, layout.components[0].width)
    max_pos = getattr(cfg, "max_position_embeddings", None) or 32768
    contexts = tuple(sorted({c for c in (2048, 8192, 32768) if c <= max_pos} | {max_pos}))
    q = kv_budget(spec, *shape, kv.budget_gib, contexts, layout=layout)
    fp = kv_budget(None, *shape, kv.budget_gib, contexts, layout=layout)
    return {
        "scheme": spec.describe(), "source": source, "kv_chunk": kv.chunk,
        "calibration": ({"text": kv.calib, "samples": kv.calib_samples, "seqlen": 512, "seed": 0}
                        if source == "--kv-scheme" and spec.static else None),
        "layers_kv_heads_head_dim": list(shape) if layout.attention == "gqa" else None, "layout": layout.as_dict(),
        "budget_gib": kv.budget_gib,
        "bytes_per_token": q["bytes_per_token"], "fp16_bytes_per_token": fp["bytes_per_token"],
        "max_tokens": q["max_tokens"], "fp16_max_tokens": fp["max_tokens"],
        "max_batch": q["max_batch"], "fp16_max_batch": fp["max_batch"],
    }
