"""Library entry points behind the CLI: one options object in, one summary dict out."""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from .artifact import DTYPES, check_output, foreign_manifest, load_artifact, read_kv_cache, state_tensors, tool_info, write_artifact
from .integrity import check_artifact_folder, foreign_integrity, verify_integrity
from .calib import is_token_file, load_text, load_token_ids, sample_windows, tokenize
from .errors import CheckFailed, InputError, KvqError
from .evaluate import windows
from .formats import check_format, check_shapes, format_config, gptq_checkpoint_format, pack_modules
from .manifest import SIGNATURE_NAME, load_manifest
from .models import ALIASES, load_model, peek_model_type, resolve_source
from .pipeline import LayerHooks, quantize_model
from .streaming import open_lazy, open_staging, resume_key
from .distributed import setup as setup_distributed
from .arch import checkpoint_name, get_arch, get_module, routers
from .formats.compressed_tensors import kv_scale_tensors
from .quant.kv import kv_budget, layout_bytes_per_token, make_spec, quantized_cache
from .recipe import KVCacheOptions, load_recipes, with_overrides
from .safetensors_io import HASH_ALGORITHMS
from .signing import SignOptions, VerifyKeys, check_sign_options, sign_folder


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return round(sum(vals) / len(vals), 6) if vals else None


def _peak_rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


@dataclass
class QuantizeOptions:
    """Options of ``kvq quantize`` (see its ``--help``); ``None`` overrides keep the recipe's value."""

    model: str
    output: Path
    recipe: Union[str, tuple] = "w4a16-awq"  # one name/path or several (later ones override earlier ones)
    kv_scheme: Optional[str] = None  # shortcut: adds kv_cache {scheme: ...} with its defaults
    algorithm: Optional[str] = None
    bits: Optional[int] = None
    group_size: Optional[Union[int, str]] = None
    symmetric: Optional[bool] = None
    calib: str = "embedded"
    calib_field: str = "text"
    calib_samples: int = 128
    calib_seqlen: int = 512
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float16"
    overwrite: bool = False
    format: str = "compressed-tensors"
    act_order: Optional[bool] = None
    settings: tuple = ()  # (dotted recipe key, value) pairs from --set
    digest_algorithm: str = "sha256"  # manifest digests: sha256 | blake3
    sign: Optional[SignOptions] = None  # sign the artifact (model_signing) as the last step
    stream: bool = True  # read a safetensors source one decoder layer at a time (compressor.streaming)
    resume: bool = False  # continue an interrupted run from its staging folder
    shard_bytes: int = 5 * 10**9  # maximum data bytes per output shard
    activation_budget_gib: float = 8.0  # calibration activations above this move to memory-mapped files


@dataclass
class VerifyOptions:
    """Options of ``kvq verify`` (see its ``--help``)."""

    artifact: Path
    reference: Optional[str] = None
    eval_text: str = "embedded"
    seqlen: int = 2048
    max_windows: Optional[int] = None
    max_ppl_increase: Optional[float] = None
    hashes_only: bool = False
    device: str = "cpu"
    kv_scheme: Optional[str] = None  # evaluate with this KV scheme instead of the artifact's
    kv_budget_gib: float = 16.0
    kv_chunk: int = 128
    kv_calib: str = "embedded"
    kv_calib_samples: int = 16
    keys: Optional[VerifyKeys] = None  # check model.sig with these first
    weights_only: bool = False  # weight statistics only: no eval text, no perplexity
    max_mean_kl: Optional[float] = None
    max_p99_kl: Optional[float] = None
    min_top1: Optional[float] = None
    min_sqnr_db: Optional[float] = None
    max_hidden_error: Optional[float] = None
    min_median_divergence: Optional[int] = None
    prompts: Optional[str] = None  # greedy-drift prompt file (default: built-in set)
    max_new_tokens: int = 32
    hidden_batches: int = 2
    no_manifest: bool = False  # a foreign artifact (another tool's): no digests to check; --reference required


def _progress(console, total_label: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(total_label),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        console=console, disable=console is None or not console.is_terminal, transient=False,
    )


def _layer_done(console, progress, task, i, n, fig) -> None:
    """Advance the bar; where there is no terminal (CI logs) print one plain line per layer."""
    progress.update(task, completed=i + 1)
    if console is not None and not console.is_terminal:
        err = fig.get("output_rel_error")
        console.print(f"layer {i + 1}/{n} done in {fig['seconds']:.1f} s"
                      + ("" if err is None else f", relative output error {err:.4f}"), highlight=False)


def _ignored_flag_warnings(opts: QuantizeOptions, recipe) -> list[str]:
    """Flags that the effective recipe makes meaningless (said aloud rather than silently dropped)."""
    out = []
    if recipe.algorithm == "none" and any(v is not None for v in (opts.bits, opts.group_size, opts.symmetric)):
        out.append("--bits/--group-size/--symmetric have no effect: the recipe keeps weights in float (algorithm none)")
    if opts.act_order is not None and recipe.algorithm != "gptq":
        out.append(f"--act-order/--no-act-order has no effect with algorithm {recipe.algorithm} (GPTQ only)")
    if recipe.algorithm != "none":
        bits = {recipe.weights.num_bits} | {o.weights.num_bits for o in recipe.overrides if o.weights.num_bits}
        odd = sorted(b for b in bits if b not in (4, 8))
        if odd and opts.format == "compressed-tensors":
            out.append(f"{'/'.join(map(str, odd))}-bit weights: vLLM's compressed-tensors WNA16 kernels serve 4 and 8 bits only; "
                       "kvq verify and transformers read this artifact")
    return out


def run_quantize(opts: QuantizeOptions, console=None) -> dict:
    """Quantize ``opts.model`` and write the artifact; returns the JSON summary.

    All input checks (output folder, recipe, model source, calibration text, group size)
    run before the expensive work; nothing is written on error.

    Raises:
        InputError: bad usage or input; QuantizationError: non-finite values produced.
    """
    t0 = time.perf_counter()
    out = Path(opts.output)
    if Path(opts.model).exists():  # before check_output: name the real problem when -o is the source
        src = Path(opts.model).resolve()
        if src == out.resolve() or out.resolve() in src.parents:
            raise InputError(f"output folder {out} is (or contains) the source model {opts.model}; choose another -o")
    check_output(out, opts.overwrite)
    if opts.digest_algorithm not in HASH_ALGORITHMS:
        raise InputError(f"unknown digest algorithm {opts.digest_algorithm!r} (choose from {', '.join(HASH_ALGORITHMS)})")
    if opts.sign is not None:
        check_sign_options(opts.sign)
    # order: the --kv-scheme section first (so --set kv_cache.* can refine it), then --set,
    # then the dedicated flags (an explicit flag wins over --set of the same key)
    recipe = load_recipes((opts.recipe,) if isinstance(opts.recipe, str) else tuple(opts.recipe))
    if opts.kv_scheme is not None:
        recipe = with_overrides(recipe, kv_cache=KVCacheOptions(scheme=opts.kv_scheme).model_dump())
    if opts.settings:
        recipe = with_overrides(recipe, **dict(opts.settings))
    recipe = with_overrides(recipe, **{
        "algorithm": opts.algorithm, "weights.num_bits": opts.bits, "weights.group_size": opts.group_size,
        "weights.symmetric": opts.symmetric, "gptq.act_order": opts.act_order,
    })
    warnings = _ignored_flag_warnings(opts, recipe)
    check_format(opts.format, recipe, opts.dtype)
    source = resolve_source(opts.model)
    if peek_model_type(source) is not None:  # an unsupported architecture fails before the model is loaded
        get_arch(peek_model_type(source))
    src = source.path.resolve()
    if src == out.resolve() or out.resolve() in src.parents:
        raise InputError(f"output folder {out} is (or contains) the source model {opts.model}; choose another -o")
    kv = recipe.kv_cache.spec() if recipe.kv_cache is not None else None
    needs_calib = recipe.algorithm in ("awq", "gptq") or (kv is not None and kv.static)
    token_file = needs_calib and is_token_file(opts.calib)
    if token_file:  # structure checked before the model loads; the id range after (it needs the vocabulary)
        load_token_ids(opts.calib)
    text = load_text(opts.calib, opts.calib_field, part="calib") if needs_calib and not token_file else None
    if console and text is not None and text.note:
        console.print(f"[yellow]calibration:[/] {text.note}")
    if opts.resume and os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1"):
        raise InputError("--resume is not available under torchrun (several ranks); resume with one process")
    rank, world_size, device = setup_distributed(opts.device)
    if rank != 0:
        console = None
    if console:
        console.print(f"loading {source.spec} ({source.kind}) ..." + (f" (rank 0 of {world_size})" if world_size > 1 else ""))
    model, ckpt, loading = None, None, "whole model (--no-stream)"
    if opts.stream:
        lazy = open_lazy(source)
        if lazy[0] is not None:
            model, tokenizer, ckpt = lazy
            loading = "streamed: one decoder layer at a time"
        else:
            loading = f"whole model ({lazy[1]})"
    if model is None:
        model, tokenizer = load_model(source)
    if console:
        console.print(f"source weights: {loading}", highlight=False)
    check_shapes(opts.format, {n: m.out_features for n, m in model.named_modules()
                               if isinstance(m, torch.nn.Linear) and not recipe.is_ignored(n) and n != "lm_head"})
    calib_ids, calibration = None, None
    if token_file:
        calib_ids, calibration = load_token_ids(opts.calib, model.config.vocab_size)
        if console:
            console.print(f"calibration: {calib_ids.shape[0]} x {calib_ids.shape[1]} pre-tokenized ids from {opts.calib} "
                          "(--calib-samples/--calib-seqlen/--seed do not apply)")
    elif text is not None:
        calib_ids = sample_windows(tokenize(tokenizer, text.text), opts.calib_samples, opts.calib_seqlen, opts.seed)
        calibration = {**text.provenance(), "samples": opts.calib_samples, "seqlen": opts.calib_seqlen, "seed": opts.seed}
        if console:
            console.print(f"calibration: {opts.calib_samples} x {opts.calib_seqlen} tokens from {text.name} (seed {opts.seed})")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if calib_ids is not None and max_pos and calib_ids.shape[1] > max_pos:
        warnings.append(f"calibration sequences of {calib_ids.shape[1]} tokens exceed the model's "
                        f"max_position_embeddings {max_pos}")
    n_layers = model.config.num_hidden_layers
    arch = get_arch(model.config.model_type)
    ckpt_name = lambda name: checkpoint_name(arch, name)  # noqa: E731
    source_fp = source.fingerprint()
    key = resume_key({"source": source_fp["files"], "recipe": recipe.model_dump(mode="json"), "calibration": calibration,
                      "format": opts.format, "dtype": opts.dtype, "kvq": tool_info()["version"]})
    staging = open_staging(out, key, opts.resume, console) if rank == 0 else None  # other ranks write nothing
    schemes: dict[str, tuple] = {}
    with _keep_checkpoint(staging, n_layers, drop_on_error=True):  # bad input or a numerical fault: nothing to resume
        hooks = _layer_hooks(model, arch, ckpt, staging, schemes, opts, ckpt_name, device)
        with _progress(console, "layers") as progress:
            label = "float weights" if recipe.algorithm == "none" else f"{recipe.algorithm.upper()} W{recipe.weights.num_bits}"
            task = progress.add_task(label + (f" + KV {kv.scheme}" if kv else ""), total=n_layers, completed=hooks.start)
            result = quantize_model(
                model, recipe, calib_ids, device=device, dtype=DTYPES[opts.dtype],
                on_layer=lambda i, n, fig: _layer_done(console, progress, task, i, n, fig), hooks=hooks,
            )
    with _keep_checkpoint(staging, n_layers, drop_on_error=False):  # every layer is done: keep them whatever happens
        del calib_ids
        gc.collect()
        if rank != 0:
            return {"rank": rank, "world_size": world_size, "output": None, "quantize_seconds": round(result.seconds, 2)}
        warnings += result.warnings
        if console:
            for w in warnings:
                console.print(f"[yellow]warning:[/] {w}", highlight=False)
        schemes.update({n: r.scheme for n, r in result.modules.items()})
        quant = {
            "algorithm": recipe.algorithm,
            "format": opts.format,
            "num_bits": recipe.weights.num_bits,
            "group_size": result.group_size,
            "symmetric": recipe.weights.symmetric,
            "modules": len(schemes),
            "storage_dtype": opts.dtype,
        }
        if recipe.algorithm == "none":
            quant.update({"num_bits": None, "group_size": None, "symmetric": None})
        if recipe.is_mixed:
            quant["schemes"] = [{"num_bits": b, "group_size": g, "symmetric": y, "modules": sorted(n for n, v in schemes.items() if v == (b, g, y))}
                                for b, g, y in sorted(set(schemes.values()))]
        if recipe.algorithm == "gptq":
            quant["act_order"] = recipe.gptq.act_order
            quant["static_groups"] = recipe.gptq.static_groups
            if opts.format == "gptq":
                quant["gptq_checkpoint_format"] = gptq_checkpoint_format(recipe.weights.symmetric)
        import compressed_tensors

        # names as the checkpoint (and vLLM) spells them; MoE routers stay float and are listed as ignored
        ckpt = ckpt_name
        ignored = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in schemes)
        ignored += routers(arch, model)
        qcfg = format_config(opts.format, recipe, {ckpt(n): v for n, v in schemes.items()},
                             [ckpt(n) for n in ignored if n != "lm_head"],
                             {"compressed-tensors": compressed_tensors.__version__, "kvq": tool_info()["version"]})
        packed = {ckpt(n): t for n, t in pack_modules(result.modules, opts.format, DTYPES[opts.dtype]).items()}
        result.modules.clear()
        kv_record = None
        if kv is not None:
            kv_record = {"scheme": kv.scheme, "strategy": kv.strategy, "bits": kv.bits, "static_scales": kv.static}
            if kv.strategy == "kivi":
                kv_record.update({"group_size": kv.group_size, "residual_length": kv.residual_length,
                                  "keys": "per channel, groups of group_size tokens", "values": "per token, groups of group_size channels"})
            if kv.static:
                scale_tensors = kv_scale_tensors(result.kv_scales, arch.layers, arch.attention, kv.strategy)
                for name, t in scale_tensors.items():
                    module, _, leaf = name.rpartition(".")
                    packed.setdefault(module, {})[leaf] = t
                kv_record["scale_tensors"] = f"{arch.layers}.<i>.{arch.attention}.k_scale / v_scale, shape " + (
                    "[1]" if kv.strategy == "tensor" else "[num_kv_heads, 1, 1]")
                kv_record["absmax"] = {str(i): {"k": [round(float(x), 4) for x in k], "v": [round(float(x), 4) for x in v]}
                                       for i, (k, v) in result.kv_absmax.items()}
            layout = arch.kv_layout(model.config)
            kv_record["layout"] = layout.as_dict()
            kv_record["bytes_per_token"] = layout_bytes_per_token(kv, layout)
            kv_record["fp16_bytes_per_token"] = layout_bytes_per_token(None, layout)
        float_bytes = sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values())
        # timings vary run to run: they go to the provenance block, outside the content digest
        quality = {
            "layers": [{k: v for k, v in f.items() if k not in ("seconds", "phase_seconds")} for f in result.layers],
            "mean_rel_error": _mean([f["mean_rel_error"] for f in result.layers]),
            "warnings": warnings,
        }
        if result.moe:  # routed calibration tokens per expert; experts quantized with the RTN fallback
            quality["moe"] = {"min_tokens": max(recipe.moe.min_tokens, 1), "layers": result.moe, "fallback": result.moe_fallback}
        timing = {"quantize_seconds": round(result.seconds, 2), "layer_seconds": [f["seconds"] for f in result.layers]}
        if result.layers and "phase_seconds" in result.layers[0]:
            timing["phase_seconds"] = {k: round(sum(f["phase_seconds"][k] for f in result.layers), 2)
                                       for k in result.layers[0]["phase_seconds"]}
        if opts.model not in ALIASES:  # record paths absolutely so verify finds the reference from anywhere
            source_fp["spec"] = str(Path(opts.model).resolve()) if Path(opts.model).exists() else opts.model
        manifest = write_artifact(
            out, model, tokenizer, packed, qcfg,
            {"tool": tool_info(), "source": source_fp, "recipe": recipe.model_dump(mode="json"),
             "calibration": calibration, "quantization": quant, "quality": quality, "kv_cache": kv_record,
             "format": opts.format},
            provenance={"timing": timing, "device": opts.device},
            dtype_name=opts.dtype, overwrite=opts.overwrite, digest_algorithm=opts.digest_algorithm, rename=ckpt,
            finalize=(lambda tmp: sign_folder(tmp, opts.sign)) if opts.sign is not None else None,
            staging=staging, skip_prefix=arch.layers + ".", shard_bytes=opts.shard_bytes,
        )
    size = sum(f.size for f in manifest.files.values())
    summary = {
        "output": str(out),
        "recipe": recipe.name,
        "quantization": quant,
        "calibration": calibration,
        "artifact_bytes": size,
        "float32_bytes": float_bytes,
        "quantize_seconds": timing["quantize_seconds"],
        "phase_seconds": timing.get("phase_seconds"),
        "wall_seconds": round(time.perf_counter() - t0, 2),
        "peak_rss_mib": _peak_rss_mib(),
        "source_loading": loading,
        "shards": sum(1 for n in manifest.files if n.endswith(".safetensors")),
        "resumed_from_layer": hooks.start or None,
        "world_size": world_size,
        "mean_rel_error": quality["mean_rel_error"],
        "moe": quality.get("moe"),
        "warnings": warnings,
        "content_digest": manifest.content_digest(),
        "digest_algorithm": opts.digest_algorithm,
        "signed": None if opts.sign is None else opts.sign.method(),
    }
    if console:
        _print_layers(console, result.layers)
        for m in result.moe:
            toks = m["expert_tokens"]
            console.print(f"MoE layer {m['layer']}: {m['experts']} experts, routed calibration tokens "
                          + ("not counted (no calibration pass)" if toks is None else
                             f"min {min(toks)} / median {sorted(toks)[len(toks) // 2]} / max {max(toks)}"
                             + (f", {len(m['below_min_tokens'])} below {quality['moe']['min_tokens']}" if m["below_min_tokens"] else "")),
                          highlight=False)
        console.print(
            f"[green]wrote[/] {out} ({size / 2**20:.1f} MiB; float32 model {float_bytes / 2**20:.1f} MiB) "
            f"in {summary['wall_seconds']:.0f} s, peak RSS {summary['peak_rss_mib']:.0f} MiB"
            + (f", signed ({summary['signed']}) into {SIGNATURE_NAME}" if opts.sign is not None else "")
        )
    return summary


@contextlib.contextmanager
def _keep_checkpoint(staging, n_layers: int, drop_on_error: bool):
    """On the way out of a failed or interrupted block: keep the staging folder (and say so
    on stderr) when at least one layer is checkpointed, else remove it; with
    ``drop_on_error`` a kvq error (bad input, numerical fault) removes it anyway."""
    try:
        yield
    except BaseException as e:
        if staging is None or not staging.path.exists():
            raise
        done = staging.state.get("layers_done") or 0
        if (drop_on_error and isinstance(e, KvqError)) or not done:
            shutil.rmtree(staging.path, ignore_errors=True)
        else:
            print(f"kvq: stopped after {done} of {n_layers} layers; the finished layers are kept in {staging.path}: "
                  "rerun the same command with --resume to continue", file=sys.stderr)
        raise


def _layer_hooks(model, arch, ckpt, staging, schemes: dict, opts: QuantizeOptions, ckpt_name, device: str) -> LayerHooks:
    """Load (streamed sources), write, checkpoint and release one decoder layer at a time.

    After layer ``i``: its packed modules (popped from the result, their schemes kept in
    ``schemes``) and float tensors go to the part ``layer-<i>``, its weights back to
    ``meta``, and the resume state (figures, MoE records, KV statistics, next inputs) to
    the staging folder. A resumed run restores all of that.
    """
    from .streaming import layer_names, load_into, to_meta

    dtype = DTYPES[opts.dtype]

    def load(i, layer):
        if ckpt is not None:
            load_into(model, ckpt, arch, layer_names(model, arch, i))

    def done(i, layer, result, hidden):
        prefix = f"{arch.layers}.{i}."
        recs = {n: result.modules.pop(n) for n in [n for n in result.modules if n.startswith(prefix)]}
        schemes.update({n: r.scheme for n, r in recs.items()})
        if staging is None:  # not rank 0: nothing to write
            to_meta(layer)
            return
        packed = {ckpt_name(n): t for n, t in pack_modules(recs, opts.format, dtype).items()}
        staging.save_part(f"layer-{i:05d}", state_tensors(model, packed, dtype, rename=ckpt_name, prefix=prefix))
        to_meta(layer)
        staging.checkpoint(i + 1, {
            "layers": result.layers, "moe": result.moe, "moe_fallback": result.moe_fallback,
            "schemes": {n: list(v) for n, v in schemes.items()},
            "kv_absmax": {str(j): [k.tolist(), v.tolist()] for j, (k, v) in result.kv_absmax.items()},
        }, hidden)

    spill_dir = staging.path if staging is not None else Path(tempfile.gettempdir())
    hooks = LayerHooks(load, done, activation_budget=int(opts.activation_budget_gib * 2**30), spill_dir=spill_dir)
    st = staging.state if staging is not None else {}
    if st.get("layers_done"):
        hooks.start = int(st["layers_done"])
        hooks.layers, hooks.moe, hooks.moe_fallback = st["layers"], st["moe"], st["moe_fallback"]
        schemes.update({n: tuple(v) for n, v in st["schemes"].items()})
        hooks.kv_absmax = {int(j): (torch.tensor(k), torch.tensor(v)) for j, (k, v) in st["kv_absmax"].items()}
        hooks.hidden = staging.load_hidden(device)
        for i in range(hooks.start):  # finished layers are never loaded again
            to_meta(get_module(model, arch.layers)[i])
    return hooks


def _print_layers(console, layers: list[dict]) -> None:
    from rich.table import Table

    t = Table(title="per-layer quantization", show_lines=False)
    for col in ("layer", "bits", "group", "modules", "mean rel. weight error", "rel. output error", "seconds"):
        t.add_column(col, justify="right")
    for f in layers:
        out_err = "-" if f["output_rel_error"] is None else f"{f['output_rel_error']:.4f}"
        w_err = "-" if f["mean_rel_error"] is None else f"{f['mean_rel_error']:.4f}"
        t.add_row(str(f["layer"]), str(f["num_bits"] or "float"), str(f["group_size"] or "-"), str(f["modules"]),
                  w_err, out_err, f"{f['seconds']:.1f}")
    console.print(t)


def _calibrate_kv(model, tokenizer, spec, opts, console) -> dict:
    """Static KV scales for ``--kv-scheme`` on a model without stored ones (calibration text ``opts.kv_calib``)."""
    from .quant.kv import cache_kwarg, kv_observer, layer_scales, observed_absmax

    text = load_text(opts.kv_calib, part="calib")
    ids = sample_windows(tokenize(tokenizer, text.text), opts.kv_calib_samples, 512, 0)
    obs = kv_observer(model.config.num_hidden_layers)
    with torch.no_grad():
        for b in ids.split(4):
            model(b.to(opts.device), use_cache=True, **{cache_kwarg(model): obs})
    if console:
        console.print(f"KV scales for {spec.describe()} calibrated on {opts.kv_calib_samples} x 512 tokens of {text.name}")
    layout = get_arch(model.config.model_type).kv_layout(model.config)
    return {i: tuple(x.half().float() for x in layer_scales(k, v, spec, layout))
            for i, (k, v) in observed_absmax(obs).items()}


def _kv_report(spec, source, ref_source, opts) -> dict:
    """Scheme plus memory accounting for the model's shape (bytes/token, what a budget holds)."""
    from transformers import AutoConfig

    cfg_folder = Path(opts.artifact)
    cfg = AutoConfig.from_pretrained(str(cfg_folder))
    layout = get_arch(cfg.model_type).kv_layout(cfg)
    shape = (layout.n_layers, layout.components[0].heads, layout.components[0].width)
    max_pos = getattr(cfg, "max_position_embeddings", None) or 32768
    contexts = tuple(sorted({c for c in (2048, 8192, 32768) if c <= max_pos} | {max_pos}))
    q = kv_budget(spec, *shape, opts.kv_budget_gib, contexts, layout=layout)
    fp = kv_budget(None, *shape, opts.kv_budget_gib, contexts, layout=layout)
    return {
        "scheme": spec.describe(), "source": source, "kv_chunk": opts.kv_chunk,
        "calibration": ({"text": opts.kv_calib, "samples": opts.kv_calib_samples, "seqlen": 512, "seed": 0}
                        if source == "--kv-scheme" and spec.static else None),
        "layers_kv_heads_head_dim": list(shape) if layout.attention == "gqa" else None, "layout": layout.as_dict(),
        "budget_gib": opts.kv_budget_gib,
        "bytes_per_token": q["bytes_per_token"], "fp16_bytes_per_token": fp["bytes_per_token"],
        "max_tokens": q["max_tokens"], "fp16_max_tokens": fp["max_tokens"],
        "max_batch": q["max_batch"], "fp16_max_batch": fp["max_batch"],
    }


GATE_FLAGS = {  # gate name -> (VerifyOptions attribute, "max"|"min")
    "max_ppl_increase_pct": ("max_ppl_increase", "max"),
    "max_mean_kl": ("max_mean_kl", "max"),
    "max_p99_kl": ("max_p99_kl", "max"),
    "min_top1_agreement_pct": ("min_top1", "min"),
    "min_sqnr_db": ("min_sqnr_db", "min"),
    "max_hidden_error": ("max_hidden_error", "max"),
    "min_median_divergence": ("min_median_divergence", "min"),
}


# the statistic behind each gate exists only in some modes / for some artifacts
GATE_NEEDS = {"max_ppl_increase_pct": "full", "max_mean_kl": "full", "max_p99_kl": "full",
              "min_top1_agreement_pct": "full", "min_median_divergence": "full",
              "max_hidden_error": "quantized weights, full", "min_sqnr_db": "quantized weights"}


def _thresholds(manifest, opts: VerifyOptions, mode: str, weights_quantized: bool) -> tuple[dict[str, float], list[str]]:
    """Gate thresholds: the recipe's ``gates`` (stored in the manifest), overridden by flags.

    Returns ``(thresholds, warnings)``: recipe gates this mode cannot evaluate become
    warnings; flags it cannot evaluate are refused.

    Raises:
        InputError: the manifest's ``recipe.gates`` is invalid; a gate flag whose statistic
            this mode or artifact does not compute (it would pass silently).
    """
    from pydantic import ValidationError

    from .recipe import Gates

    try:
        stored = Gates.model_validate(manifest.recipe.get("gates") or {}).model_dump()
    except ValidationError as e:
        first = e.errors()[0]
        raise InputError(f"manifest recipe.gates.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    out, warnings = {}, []
    for name, (attr, _kind) in GATE_FLAGS.items():
        flag = getattr(opts, attr)
        value = flag if flag is not None else stored.get(name)
        if name == "max_ppl_increase_pct" and value is None and flag is None:
            value = 20.0 if mode == "full" else None
        if value is None:
            continue
        needs = GATE_NEEDS[name]
        ok = (mode == "full" or "full" not in needs) and (weights_quantized or "quantized" not in needs)
        if not ok:
            why = ("the artifact has no quantized weights" if "quantized" in needs and not weights_quantized
                   else f"--{mode} does not compute it")
            if flag is not None:
                raise InputError(f"--{attr.replace('_', '-')} cannot be evaluated: {why}")
            warnings.append(f"recipe gate {name} not evaluated: {why}")
            continue
        out[name] = float(value)
    if "min_median_divergence" in out and out["min_median_divergence"] > opts.max_new_tokens:
        raise InputError(f"--min-median-divergence {out['min_median_divergence']:g} exceeds --max-new-tokens "
                         f"{opts.max_new_tokens}: the gate could never pass")
    return out, warnings


def _check_same_architecture(artifact, reference, ref_spec: str) -> None:
    """Refuse a reference that is not the same architecture: another ``model_type``, or
    parameters that differ in name or shape (depth, width, vocabulary).

    Raises:
        InputError: names the first difference.
    """
    a, r = artifact.config, reference.config
    if a.model_type != r.model_type:
        raise InputError(f"reference {ref_spec} is a {r.model_type} model, the artifact a {a.model_type} model: "
                         "nothing comparable")
    pa = {n: tuple(p.shape) for n, p in artifact.named_parameters()}
    pr = {n: tuple(p.shape) for n, p in reference.named_parameters()}
    if pa != pr:
        only_a, only_r = sorted(set(pa) - set(pr)), sorted(set(pr) - set(pa))
        shape = next((n for n in sorted(pa) if n in pr and pa[n] != pr[n]), None)
        what = (f"{only_a[0]} is missing from the reference" if only_a else f"the reference has an extra {only_r[0]}" if only_r
                else f"{shape} is {list(pa[shape])} in the artifact but {list(pr[shape])} in the reference")
        raise InputError(f"reference {ref_spec} does not have the artifact's architecture: {what}")


def _norms_rescaled(reference, artifact) -> bool:
    """True when any norm weight of ``artifact`` differs from ``reference``'s by more than
    fp16/bf16 storage rounding (AWQ folds its scales there, typically by factors of 0.5-2)."""
    ref = dict(reference.named_parameters())
    return any(("norm" in n) and n in ref and p.shape == ref[n].shape
               and not torch.allclose(p.float(), ref[n].float(), rtol=1e-2, atol=1e-6)
               for n, p in artifact.named_parameters())


def _nonfinite_parameters(model) -> list[str]:
    """Names of parameters and buffers holding NaN or Inf."""
    return [n for n, p in list(model.named_parameters()) + list(model.named_buffers())
            if p.is_floating_point() and not torch.isfinite(p).all()]


def load_reference(spec: str, source):
    """The reference model of ``verify`` / ``serve-smoke``, as a float model on the CPU.

    Args:
        spec: what the user named (``--reference`` or the manifest's source spec).
        source: ``spec`` resolved by :func:`compressor.models.resolve_source`.

    Returns:
        A ``PreTrainedModel``: a kvq artifact (a folder with a manifest) dequantized to
        float32 (to verify one artifact against another, or against itself);
        anything else loaded as the original, in float32.

    Raises:
        InputError: the source cannot be read (from the loaders).
    """
    from .manifest import MANIFEST_NAME

    if Path(spec).is_dir() and (Path(spec) / MANIFEST_NAME).is_file():
        return load_artifact(spec)[0]
    return load_model(source)[0]


def _gate(name: str, threshold: float, value, measured_on: str, detail: str | None = None) -> dict:
    kind = GATE_FLAGS[name][1]
    ok = value is not None and (value <= threshold if kind == "max" else value >= threshold)
    return {"name": name, "threshold": threshold, "value": None if value is None else float(value), "passed": bool(ok),
            "measured_on": measured_on, "detail": detail}


def run_verify(opts: VerifyOptions, console=None) -> dict:
    """Signature, digests, then statistics against the reference model, and the gates.

    Modes: ``hashes_only`` (signature + digests), ``weights_only`` (plus weight-space
    statistics: per tensor relative error, SQNR, original-vs-artifact statistics; no
    eval text), full (plus perplexity, KL divergence, top-1 agreement, per window;
    hidden-state error per layer; greedy drift on a prompt set). Every gate whose
    threshold is set (recipe ``gates`` or flags) is evaluated; ``passed`` is false if the
    signature (when checked), a digest or any gate fails. Memory holds both models and
    one window's logits per model.

    Raises:
        InputError: not an artifact, bad manifest/header, reference, eval text or prompts not found.
        CheckFailed: the recorded source model changed since quantization.
    """
    from .quality import greedy_drift, weight_report
    from .evaluate import compare, hidden_state_errors
    from .prompts import load_prompts
    from .report import validate

    t0 = time.perf_counter()
    folder = check_artifact_folder(opts.artifact)
    mode = "hashes-only" if opts.hashes_only else ("weights-only" if opts.weights_only else "full")
    if opts.no_manifest:
        if opts.hashes_only:
            raise InputError("--no-manifest has no digests to check: --hashes-only does not apply")
        if not opts.reference:
            raise InputError("--no-manifest needs --reference (a foreign artifact records no source model)")
        manifest = foreign_manifest(folder)
        report = {**foreign_integrity(folder, opts.keys, console), "mode": mode}
    else:
        manifest = load_manifest(folder)
        report = {**verify_integrity(folder, opts.keys, console), "mode": mode}  # signature, then digests
    prompts = load_prompts(opts.prompts) if mode == "full" else None
    ok = report["passed"]
    if not ok or opts.hashes_only:
        report["seconds"] = round(time.perf_counter() - t0, 2)
        return validate(report)

    weights_quantized = manifest.quantization.get("algorithm") != "none"
    thresholds, gate_warnings = _thresholds(manifest, opts, mode, weights_quantized)
    report["warnings"].extend(gate_warnings)
    ref_spec = opts.reference or manifest.source.get("spec")
    if not ref_spec:
        raise InputError("the manifest records no source model; pass --reference")
    ref_source = resolve_source(ref_spec)
    recorded = manifest.source.get("files") or {}
    ref_files = ref_source.fingerprint()["files"]
    same = bool(recorded) and ref_files == recorded
    report["reference"] = ref_spec
    report["reference_matches_source"] = None if opts.no_manifest else same
    if not same and not opts.no_manifest:
        msg = (f"reference {ref_spec} is not the model that was quantized (its weight-file digests differ from the "
               "manifest's source record)")
        if opts.reference is None:  # the recorded source itself changed: the comparison would prove nothing
            raise CheckFailed(msg + "; the source changed since quantization -- pass --reference to compare with another model")
        report["warnings"].append(msg)
    text = None
    if mode == "full":
        text = load_text(opts.eval_text, part="eval")
        if console and text.note:
            console.print(f"[yellow]eval text:[/] {text.note}")

    kv_info = read_kv_cache(folder, manifest)
    kv_source = "artifact" if kv_info else None
    if opts.kv_scheme:
        kv_info, kv_source = (make_spec(opts.kv_scheme), None), "--kv-scheme"

    model, tokenizer = load_artifact(folder)
    ref_model = load_reference(ref_spec, ref_source)
    _check_same_architecture(model, ref_model, ref_spec)
    bad_ref = _nonfinite_parameters(ref_model)
    if bad_ref:
        raise InputError(f"reference model tensor {bad_ref[0]} contains NaN or Inf; it cannot serve as the reference")
    bad = _nonfinite_parameters(model)
    report["nonfinite_tensors"] = bad
    if bad and console:
        console.print(f"[red]NaN or Inf[/] in {len(bad)} artifact tensor(s): {', '.join(bad[:5])}", highlight=False)
    model.to(opts.device)
    ref_model.to(opts.device)
    if weights_quantized:
        algorithm = manifest.recipe.get("algorithm", "")
        if opts.no_manifest:  # the producer's algorithm is unknown: AWQ shows as rescaled norm weights
            algorithm = "awq" if _norms_rescaled(ref_model, model) else "unknown"
            report["warnings"].append(f"foreign artifact: weight statistics assume {'AWQ-folded' if algorithm == 'awq' else 'unscaled'} "
                                      "weights (inferred from the norm weights)")
        report["weights"] = weight_report(ref_model, model, algorithm)
    served = "weights only"
    results: dict = {}
    if mode == "full":
        wins = windows(tokenize(tokenizer, text.text), opts.seqlen, opts.max_windows)
        n_layers = model.config.num_hidden_layers
        if kv_info is not None and kv_info[0].static and kv_info[1] is None:
            # --kv-scheme with static scales on a model that has none: calibrate them now
            kv_info = (kv_info[0], _calibrate_kv(model, tokenizer, kv_info[0], opts, console))
        max_pos = getattr(model.config, "max_position_embeddings", None)
        if max_pos and opts.seqlen > max_pos:
            report["warnings"].append(f"--seqlen {opts.seqlen} exceeds the model's max_position_embeddings {max_pos}")
        make_cache = None
        if kv_info is not None:
            spec, scales = kv_info
            if spec.strategy == "kivi" and opts.seqlen <= spec.residual_length:
                report["warnings"].append(
                    f"--seqlen {opts.seqlen} <= KIVI residual_length {spec.residual_length}: no token is ever quantized, "
                    "the KV figures measure nothing; use a longer --seqlen")
            layout = get_arch(model.config.model_type).kv_layout(model.config)
            make_cache = lambda: quantized_cache(spec, n_layers, scales, layout)  # noqa: E731
        candidates = {}
        if weights_quantized:
            candidates["weights only"] = (model, None)
            if make_cache:
                candidates["weights + KV"] = (model, make_cache)
        if make_cache:
            candidates["KV only"] = (ref_model, make_cache)
        if not candidates:
            candidates["weights only"] = (model, None)
        served = "weights + KV" if weights_quantized and make_cache else ("weights only" if weights_quantized or not make_cache else "KV only")
        with _progress(console, "windows") as progress:
            task = progress.add_task(f"reference + {len(candidates)} configuration(s)", total=len(wins))
            results = compare(ref_model, candidates, wins, opts.device, opts.kv_chunk,
                              lambda i, n: progress.update(task, completed=i))
        ref, art = results["reference"], results[served]
        increase = (art["ppl"] / ref["ppl"] - 1.0) * 100.0
        report["eval"] = {**text.provenance(), "seqlen": opts.seqlen, "windows": art["windows"],
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
        if weights_quantized:
            hb = wins[: opts.hidden_batches, : min(opts.seqlen, 512)]
            per_layer = hidden_state_errors(ref_model, model, hb, opts.device)
            report["hidden_state_error"] = {"batches": int(hb.shape[0]), "seqlen": int(hb.shape[1]),
                                            "per_layer": per_layer, "last": per_layer[-1]}
        drift_model = model if weights_quantized else ref_model
        drift_cache = make_cache if served != "weights only" else None
        report["drift"] = {**greedy_drift(ref_model, drift_model, tokenizer, prompts, opts.max_new_tokens,
                                          drift_cache, opts.device), "measured_on": served}
        if kv_info is not None:
            report["kv_cache"] = _kv_report(kv_info[0], kv_source, ref_source, opts)
    del model, ref_model
    gc.collect()

    # gates: every threshold that is set and whose statistic this mode computed
    g = [{"name": "finite_weights", "threshold": 0.0, "value": float(len(bad)), "passed": not bad,
          "measured_on": "artifact tensors", "detail": ("NaN or Inf in: " + ", ".join(bad[:5])) if bad else None}]
    if "perplexity" in report:
        g.append(_gate("max_ppl_increase_pct", thresholds["max_ppl_increase_pct"], report["perplexity"]["increase_pct"], served))
        d = report["distribution"]
        for name, value in (("max_mean_kl", d["kl"]["mean"]), ("max_p99_kl", d["kl"]["p99"]),
                            ("min_top1_agreement_pct", d["top1_agreement_pct"])):
            if name in thresholds:
                g.append(_gate(name, thresholds[name], value, served))
        if "min_median_divergence" in thresholds:
            g.append(_gate("min_median_divergence", thresholds["min_median_divergence"], report["drift"]["median"], served))
        if "max_hidden_error" in thresholds and "hidden_state_error" in report:
            g.append(_gate("max_hidden_error", thresholds["max_hidden_error"], report["hidden_state_error"]["last"],
                           "weights only"))
    if "min_sqnr_db" in thresholds and report.get("weights"):
        w = report["weights"]
        below = [t["name"] for t in w["tensors"] if not t["sqnr_db"] >= thresholds["min_sqnr_db"]]
        g.append(_gate("min_sqnr_db", thresholds["min_sqnr_db"], w["min_sqnr_db"], "weights only",
                       (f"{len(below)} tensor(s) below: " + ", ".join(below[:5]) + (" ..." if len(below) > 5 else ""))
                       if below else None))
    report["gates"] = g
    report["failed_gates"] = [x["name"] for x in g if not x["passed"]]
    report["passed"] = ok and not report["failed_gates"]
    report["seconds"] = round(time.perf_counter() - t0, 2)
    if console:
        _print_verify(console, report, results, opts)
    return validate({k: v for k, v in report.items() if not k.startswith("_")}) and report


def _print_verify(console, report: dict, results: dict, opts: VerifyOptions) -> None:
    from rich.table import Table

    for w in report["warnings"]:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)
    t = Table(title=f"kvq verify {report['artifact']} ({report['mode']})")
    for c in ("check", "value", "threshold", "result"):
        t.add_column(c)
    if report["hashes"].get("checked", True):
        t.add_row("tensor/file digests", f"{report['hashes']['tensors_checked']} tensors", "all equal", "[green]pass")
    else:
        t.add_row("tensor/file digests", "no kvq manifest", "", "[yellow]not checked")
    gates = {x["name"]: x for x in report["gates"]}

    units = {"finite_weights": (1, " tensors"), "max_ppl_increase_pct": (1, " %"), "min_top1_agreement_pct": (1, " %"), "max_hidden_error": (100, " %"),
             "min_sqnr_db": (1, " dB"), "max_mean_kl": (1, " nats"), "max_p99_kl": (1, " nats"),
             "min_median_divergence": (1, " tokens")}

    def row(label, value, gate_name=None):
        gt = gates.get(gate_name)
        if gt is None:
            t.add_row(label, value, "", "")
        else:
            op = ">=" if gate_name.startswith("min_") else "<="
            mul, unit = units.get(gate_name, (1, ""))
            t.add_row(label, value, f"{op} {gt['threshold'] * mul:g}{unit}", "[green]pass" if gt["passed"] else "[red]FAIL")

    if "perplexity" in report:
        ref = results["reference"]
        for label, r in results.items():
            if label == "seconds":
                continue
            rel = "" if label == "reference" else f"({(r['ppl'] / ref['ppl'] - 1) * 100:+.2f} %)"
            t.add_row(f"perplexity {label}", f"{r['ppl']:.4f} {rel}", "", "")
        p, d = report["perplexity"], report["distribution"]
        served = p["measured_on"]
        row(f"perplexity increase ({served})", f"{p['increase_pct']:+.2f} %", "max_ppl_increase_pct")
        k = d["kl"]
        row(f"KL mean ({served}), nats", f"{k['mean']:.4g}", "max_mean_kl")
        row("KL median / p99 / max, nats", f"{k['median']:.4g} / {k['p99']:.4g} / {k['max']:.4g}", "max_p99_kl")
        row(f"top-1 agreement ({served})", f"{d['top1_agreement_pct']:.2f} %", "min_top1_agreement_pct")
        dr = report["drift"]
        row(f"greedy drift: first differing token ({dr['prompts']} prompts)",
            f"median {dr['median']:g}, min {dr['min']:g} of {dr['max_new_tokens']} generated", "min_median_divergence")
        if report.get("hidden_state_error"):
            row("hidden-state error, last layer", f"{100 * report['hidden_state_error']['last']:.4g} %", "max_hidden_error")
    w = report.get("weights")
    if w and w["tensors"]:
        row(f"weight SQNR, min over {len(w['tensors'])} tensors", f"{w['min_sqnr_db']:.2f} dB ({w['min_sqnr_tensor']})",
            "min_sqnr_db")
    if "finite_weights" in gates:
        row("NaN/Inf in artifact tensors", f"{gates['finite_weights']['value']:g} tensors", "finite_weights")
    console.print(t)
    if "eval" in report:
        e = report["eval"]
        console.print(f"eval: {e['windows']} windows x {e['seqlen']} tokens ({e['predicted_tokens']} predicted) from {e['source']}",
                      highlight=False)
    if report.get("kv_cache"):
        k = report["kv_cache"]
        console.print(
            f"KV cache {k['scheme']} ({k['source']}): {k['bytes_per_token']:.0f} B/token vs fp16 {k['fp16_bytes_per_token']:.0f} B/token; "
            f"{opts.kv_budget_gib:g} GiB holds {k['max_tokens']:,} tokens (fp16: {k['fp16_max_tokens']:,}); "
            + ", ".join(f"context {c}: batch {b} (fp16 {k['fp16_max_batch'][c]})" for c, b in k["max_batch"].items()),
            highlight=False)
    for gt in report["gates"]:
        if not gt["passed"]:
            console.print(f"[red]gate failed[/]: {gt['name']} = "
                          f"{'n/a' if gt['value'] is None else format(gt['value'], '.4g')} (threshold {gt['threshold']:g})"
                          + (f"; {gt['detail']}" if gt.get("detail") else ""), highlight=False)
