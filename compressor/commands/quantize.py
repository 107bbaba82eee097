"""``kvq quantize``: plan, load, quantize layer by layer, write the artifact.

:func:`run_quantize` reads as its steps:

1. :func:`_plan` -- every refusal before any expensive work: the output folder, signing
   inputs, the effective recipe (recipes, ``--kv-scheme``, ``--set``, flags), the format,
   the model source and its architecture, the shapes (group sizes against the widths of the
   model built on ``meta`` from its configuration), the calibration text;
2. :func:`_load` -- the model (streamed one decoder layer at a time where it can be, see
   :mod:`compressor.source.lazy`) and the calibration windows;
3. :func:`_quantize` -- the staging folder (resumable) and the sequential pipeline
   (:func:`compressor.pipeline.quantize_model`) with a :class:`~compressor.staging.LayerWriter`
   writing each finished layer;
4. :func:`_write` -- the format's config, the remaining tensors, the manifest, the
   signature, and the atomic rename into place; then the summary dict.

Nothing is written on an input error; an interruption after the first layer keeps the
finished layers for ``--resume``.

An already-quantized source (compressed-tensors / AWQ / GPTQ) takes :func:`_carry` after the
plan: the KV cache is calibrated on its weights as they are and the weights are carried
byte for byte (:mod:`compressor.commands.kv_only`); a weight recipe on it is refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from .. import console as show
from .. import interrupts
from ..arch import checkpoint_name, get_arch, mtp_layer, routers
from ..artifact import DTYPES, check_output, tool_info, write_artifact
from ..calib import is_token_file, load_text, load_token_ids, sample_windows, tokenize
from ..tokens import bos_rule, check_vocabulary
from ..source.config_check import read_config, text_config
from ..distributed import finished, gather, on_stop, watched
from ..distributed import setup as setup_distributed
from ..errors import InputError
from ..formats import get_format
from ..source.gguf_cache import stale_cache_notes, take_cache_notes
from ..source.open import load_model, meta_skeleton
from ..source.resolve import ALIASES, float32_bytes, peek_model_type, resolve_source, storage_dtype
from ..data_free import WorkerSpec, quantize_with_workers, refusal
from ..pipeline import check_group_sizes, quantize_model
from ..precision import resolve_matmul_precision
from ..quant.algorithms import get_algorithm
from ..quant.embedding import add_embedding, check_embedding, embedding_scheme
from ..quant.head import add_head, check_head, check_untie, head_schemes
from ..recipe import Recipe, effective_recipe
from ..recipe_schemes import observes_inputs
from ..signing import check_sign_options, sign_folder
from ..staging import (
    LayerWriter, input_digests, keep_checkpoint, kept_note, name_kept_checkpoint, open_staging, refuse_if_in_use,
    resume_key,
)
from ..source.open import open_lazy
from . import kv_only
from ..activations import peak_rss_mib
from .common import cpu_threads, in_background, threads_restored
from . import quantize_record as blocks
from .options import QuantizeOptions
from .quantize_memory import check_activations, for_run as memory_plan


@dataclass
class _Plan:
    """What :func:`_plan` established before loading anything."""

    out: Path
    recipe: Recipe
    source: object  # compressor.source.resolve.ModelSource
    kv: object  # the recipe's KV spec (compressor.quant.kv), None without a KV scheme
    token_file: bool  # calibration given as pre-tokenized ids
    text: object  # calibration text (compressor.calib), None when not needed or token ids
    warnings: list[str]  # grows as the run goes: the manifest's quality.warnings
    dtype: str = "float16"  # storage and declared dtype (compressor.source.resolve.storage_dtype)
    dtype_reason: str = "--dtype"
    calib_shape: Optional[tuple[int, int]] = None  # (samples, seqlen) of the calibration windows, None without
    activation_budget_gib: Optional[float] = None  # in effect (0: spill all); None until the activations are checked
    packed: object = None  # compressor.commands.kv_only.PackedSource: weights already quantized, carried
    matmul_precision: str = "float32"  # of the calibration pass, resolved (compressor.precision)
    threads: int = 1  # torch's intra-op threads in effect (--threads)
    busy: Optional[str] = None  # the busy-machine note (compressor.commands.common.cpu_threads), also in --json
    memory: object = None  # a streamed run's compressor.commands.quantize_memory.QuantizeMemory
    layer_peaks: list = field(default_factory=list)  # the process's peak RSS (MiB) as each layer ends, in order

    def provenance(self, timing: dict, device: str) -> dict:
        """The manifest's ``provenance``: how this artifact was made (not what it is; the integer codes depend on it)."""
        return {"timing": timing, "device": device, "matmul_precision": self.matmul_precision, "threads": self.threads}


#: the largest finite float16 value: activations past it overflow in a float16 deployment
FLOAT16_MAX = 65504.0


@dataclass
class _Source:
    """The loaded model and calibration data."""

    model: torch.nn.Module
    tokenizer: object
    ckpt: object  # compressor.source.lazy.LazyCheckpoint of a streamed source, else None
    loading: str  # how the source weights were read (for the summary)
    calib_ids: Optional[torch.Tensor]  # [samples, seqlen] token ids, None without calibration
    calibration: Optional[dict]  # provenance record for the manifest


def run_quantize(opts: QuantizeOptions, console=None, on_committed=None) -> dict:
    """Quantize ``opts.model`` and write the artifact; returns the JSON summary.

    All input checks (output folder, recipe, model source, calibration text, group size)
    run before the expensive work; nothing is written on error.

    ``on_committed(out)`` is called right after the artifact is renamed into place (the
    CLI records it for its interruption message).

    Raises:
        InputError: bad usage or input; QuantizationError: non-finite values produced.
    """
    with threads_restored(), watched():  # --threads is this run's; under torchrun a lost rank stops the others
        return _run(opts, console, on_committed)


def _run(opts: QuantizeOptions, console, on_committed) -> dict:
    t0 = time.perf_counter()
    plan = _plan(opts, console)
    rank, world_size, device = setup_distributed(opts.execution.device)
    if plan.packed is not None:
        return _carry(plan, opts, device, console, on_committed, t0)
    if rank != 0:
        console = None
    if plan.memory is not None:
        show.step(console, f"memory plan: {plan.memory.describe()}")
    # the source's SHA-256s, read while the model loads; the files dealt to the ranks, every rank's
    # digests sent to rank 0 (it writes the manifest and keeps the resume checkpoint)
    fingerprint = in_background(partial(plan.source.fingerprint, rank, world_size))
    with name_kept_checkpoint(plan.out, opts.execution.resume):  # interrupted while loading: say where the layers are
        src = _load(plan, opts, console, world_size)
        n_layers = src.model.config.num_hidden_layers
        arch = get_arch(src.model.config.model_type)
        source_fp, staging = _joined(gather(fingerprint())), None
        if rank == 0:
            named = {"--matmul-precision": plan.matmul_precision, "--threads": plan.threads}  # the codes depend on both
            inputs = {"source": source_fp["files"], "recipe": plan.recipe.model_dump(mode="json"),
                      "calibration": src.calibration, "format": opts.write.format, "dtype": plan.dtype,
                      "kvq": tool_info()["version"]}
            staging = open_staging(plan.out, resume_key({**inputs, **named}), opts.execution.resume, console, named,
                                   input_digests(inputs))
        if staging is not None:
            on_stop(partial(kept_note, staging, n_layers))  # torchrun: a lost rank's line says where the layers are
    with keep_checkpoint(staging, n_layers, drop_on_error=True):  # bad input or a numerical fault: nothing to resume
        interrupts.check()  # a signal whose exception was lost while loading stops the run here
        writer = LayerWriter(src.model, arch, src.ckpt, staging, opts.write.format, DTYPES[plan.dtype],
                             lambda name: checkpoint_name(arch, name), plan.activation_budget_gib,
                             opts.execution.memory_budget_gib)
        writer.restore(device)
        result = _quantize(plan, src, writer, opts, device, console)
        divided = result.samples or {"layers_divided": 0}  # batches not divided (AWQ, fewer batches than ranks)
        ranks = (gather({"rank": rank, **_reads(src), **divided})  # each rank's reads, to rank 0
                 if world_size > 1 else None)
        finished()  # torchrun: this rank's last collective is behind it
    with keep_checkpoint(staging, n_layers, drop_on_error=False):  # every layer is done: keep them whatever happens
        interrupts.check()
        src.calib_ids = None  # freed by its count; the layer loop's own garbage was collected at its end
        if rank != 0:
            return {"rank": rank, "world_size": world_size, "output": None, "quantize_seconds": round(result.seconds, 2),
                    **_reads(src)}
        signing = ", signature" if opts.write.sign else ""
        show.step(console, f"writing {plan.out}: packing, digests, manifest{signing} ...")
        written = _write(plan, src, result, writer, staging, source_fp, opts, console, on_committed)
    summary = {**_reads(src), **blocks.run_summary(plan, src, written, writer, world_size, opts, t0, result.workers)}
    if ranks is not None:
        summary["ranks"] = ranks
    summary["memory_plan"] = plan.memory.as_dict() if plan.memory is not None else None
    summary["peak_rss_mib_by_layer"] = plan.layer_peaks  # this run's layers (a resumed run's: from its first)
    show.quantize_done(console, summary, result.layers, result.moe)
    return summary


def _reads(src: _Source) -> dict:
    """Bytes this process read of a streamed source (all; routed experts') and its VmHWM (MiB), per rank."""
    return {"source_bytes_read": getattr(src.ckpt, "bytes_read", None),
            "routed_expert_bytes_read": getattr(src.ckpt, "expert_bytes_read", None), "peak_rss_mib": peak_rss_mib()}


# ---------------------------------------------------------------------------------------
# 1. plan

def _joined(parts: list[dict] | None) -> dict | None:
    """Rank 0: the source fingerprint of every rank's files (:meth:`ModelSource.fingerprint`), in
    name order; the other ranks: None."""
    if parts is None:
        return None
    files = {n: d for p in parts for n, d in p["files"].items()}
    return {**parts[0], "files": {n: files[n] for n in sorted(files)}}


def _plan(opts: QuantizeOptions, console) -> _Plan:
    """Every refusal before the model loads: output folder, signing inputs, recipe, format,
    model source and architecture, the recipe's group sizes against the widths the model's
    configuration gives (:func:`_check_shapes`), calibration input; the warnings the flags earn."""
    out = Path(opts.output)
    if Path(opts.model).exists():  # before check_output: name the real problem when -o is the source
        _refuse_output_in_source(Path(opts.model), out, opts.model)
    check_output(out, opts.write.overwrite)
    refuse_if_in_use(out)  # a second run of the same output: one line, before any work
    if opts.write.sign is not None:
        check_sign_options(opts.write.sign)
    recipe = effective_recipe(opts.scheme)
    algorithm = get_algorithm(recipe.algorithm)
    flags = {"bits": opts.scheme.bits, "group_size": opts.scheme.group_size, "symmetric": opts.scheme.symmetric,
             "act_order": opts.scheme.act_order}
    warnings = algorithm.flag_warnings(flags, recipe, opts.write.format)
    fmt = opts.write.format
    packed = kv_only.find_packed(opts.model)  # already-quantized weights: never quantized again
    if packed is not None:
        recipe = kv_only.check_carry(packed, recipe, opts)
    else:  # before the source is read: --format awq/gptq with auto is float16 whatever the source
        get_format(fmt).check(recipe, opts.write.dtype if opts.write.dtype != "auto" else
                              (get_format(fmt).scale_dtype or "bfloat16"))
        check_head(recipe, fmt)
        check_embedding(recipe, fmt)
    source = resolve_source(opts.model)
    dtype, dtype_reason = ((packed.declared_dtype(), "the source's float tensors, carried as they are") if packed
                           else storage_dtype(source, opts.write.dtype, fmt))
    model_type = peek_model_type(source)
    if model_type is not None:  # an unsupported architecture (or KV scheme) fails before the model is loaded
        arch = get_arch(model_type)
        if recipe.kv_cache is not None:
            arch.check_kv_support(model_type)
    _refuse_output_in_source(source.path, out, opts.model)
    if packed is None:
        _refuse_tied_head(recipe, source, dtype)
    kv = recipe.kv_cache.spec() if recipe.kv_cache is not None else None
    needs_calib = algorithm.needs_calibration or (kv is not None and kv.static) or observes_inputs(recipe)
    why = (f"--workers {opts.execution.workers}: NVFP4 activations (W4A4) are observed on a calibration pass; use "
           "--workers 1" if observes_inputs(recipe) and opts.execution.workers > 1 else
           refusal(algorithm, kv, opts.execution.workers, opts.execution.stream, packed is not None))
    if why:
        raise InputError(why)  # --workers N: data-free recipes only
    calib = opts.calibration
    if not needs_calib and calib.source != "embedded":
        show.note(console, f"[yellow]note:[/] --calib {calib.source} is not read: {recipe.algorithm} without static KV "
                           "scales needs no calibration", highlight=False)
    token_file = needs_calib and is_token_file(calib.source)
    calib_shape = (calib.samples, calib.seqlen) if needs_calib else None
    if token_file:  # structure checked before the model loads; the id range after (it needs the vocabulary)
        calib_shape = tuple(load_token_ids(calib.source)[0].shape)
    text = load_text(calib.source, calib.field, part="calib") if needs_calib and not token_file else None
    if text is not None and text.note:
        show.note(console, f"[yellow]calibration:[/] {text.note}")
    if packed is not None:
        kv_only.check_source_integrity(packed)
    threads, busy = cpu_threads(opts.execution.threads, console)
    plan = _Plan(out, recipe, source, kv, token_file, text, warnings, dtype, dtype_reason, calib_shape, packed=packed,
                 matmul_precision=resolve_matmul_precision(opts.execution.matmul_precision, opts.execution.device),
                 threads=threads, busy=busy)
    skeleton = meta_skeleton(source) if packed is None else None
    if skeleton is not None:
        _check_shapes(plan, fmt, skeleton)  # the widths from the configuration: refused before the model loads
    if source.kind == "hf":  # config.json was checked against the weights: its hidden size is the model's
        from ..source.config_check import hidden_size

        check_activations(plan, opts, hidden_size(read_config(source.path / "config.json")), console)
    if skeleton is not None and opts.execution.stream:  # a budget below its smallest unit: refused here
        plan.memory = memory_plan(skeleton, plan, opts.execution)
    return plan


def _refuse_tied_head(recipe: Recipe, source, dtype: str) -> None:
    """A recipe ``head:`` that would untie a tied head without ``head.untie: true``, refused from
    ``config.json`` before the model loads (:func:`compressor.quant.head.check_untie`); a GGUF
    file, or a config that leaves ``tie_word_embeddings`` to the model class's default, is
    checked once loaded (:func:`compressor.quant.head.check_head`)."""
    if recipe.head is None or source.kind != "hf":
        return
    cfg = text_config(read_config(source.path / "config.json"))
    vocab, hidden = cfg.get("vocab_size"), cfg.get("hidden_size")
    if cfg.get("tie_word_embeddings") is True and isinstance(vocab, int) and isinstance(hidden, int):
        check_untie(recipe, True, vocab, hidden, DTYPES[dtype].itemsize)


def _refuse_output_in_source(source: Path, out: Path, spec: str) -> None:
    src = source.resolve()
    if src == out.resolve() or out.resolve() in src.parents:
        raise InputError(f"output folder {out} is (or contains) the source model {spec}; choose another -o")
    if src.is_dir() and src in out.resolve().parents:  # its shards would join the source's (and change its digest)
        raise InputError(f"output folder {out} is inside the source model folder {spec}; choose another -o")


# ---------------------------------------------------------------------------------------
# 2. load

def _load(plan: _Plan, opts: QuantizeOptions, console, world_size: int) -> _Source:
    """The model (streamed where the source allows) and the calibration windows.

    Raises:
        InputError: unreadable model, a linear whose shape the format cannot hold,
            calibration token ids outside the vocabulary.
    """
    source = plan.source
    ranks = f" (rank 0 of {world_size})" if world_size > 1 else ""
    show.step(console, f"loading {source.spec} ({source.kind}) ...{ranks}")
    plan.warnings += (early := stale_cache_notes(source))  # said now: the conversion's wait follows
    show.warnings(console, early, "note")  # a warning in the run's summary
    model, ckpt, loading = None, None, "whole model (--no-stream)"
    if opts.execution.stream:
        # a new GGUF: converted once, then streamed; the embedding: only the calibration tokens' rows are read
        lazy = open_lazy(source, defer_head=True, convert_gguf=True, defer_embedding=True)
        if lazy[0] is not None:
            (model, tokenizer, ckpt), loading = lazy, "streamed: one decoder layer at a time"
        else:
            loading = f"whole model ({lazy[1]})"
    if model is None:
        model, tokenizer = load_model(source)
    plan.warnings += [n for n in take_cache_notes() if n not in early]  # e.g. a cache that cannot be written
    check_vocabulary(tokenizer, model.config.vocab_size, f"{source.spec}: tokenizer")  # served later: checked here
    show.note(console, f"source weights: {loading}", highlight=False)
    if ckpt is None and plan.memory is not None:  # the plan was for a streamed run
        show.step(console, f"memory plan: not this run's: {loading}")
        plan.memory = None
    if plan.activation_budget_gib is None:  # a GGUF source: its hidden size is known now
        check_activations(plan, opts, getattr(model.config, "hidden_size", None), console)
    plan.warnings += _check_shapes(plan, opts.write.format, model)  # before the calibration text is tokenized
    calib_ids, calibration = _calibration(plan, opts, model, tokenizer, console)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if calib_ids is not None and max_pos and calib_ids.shape[1] > max_pos:
        plan.warnings.append(f"calibration sequences of {calib_ids.shape[1]} tokens exceed the model's "
                             f"max_position_embeddings {max_pos}")
    return _Source(model, tokenizer, ckpt, loading, calib_ids, calibration)


def _check_shapes(plan: _Plan, fmt: str, model) -> list[str]:
    """The refusals ``model``'s shapes decide (meta tensors suffice): the format's, each group
    size against the widths it must divide (linears, experts, head, embedding). Run on the model
    built from the configuration alone in :func:`_plan` (:func:`compressor.source.open.meta_skeleton`),
    and again on the loaded one. Returns the head's and embedding's warnings.

    Raises:
        InputError: the first shape the recipe or format cannot hold, named.
    """
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    get_format(fmt).check_shapes({n: m.out_features for n, m in linears if not plan.recipe.is_ignored(n)})
    check_group_sizes(model, plan.recipe)
    arch, scale_bytes = get_arch(model.config.model_type), DTYPES[plan.dtype].itemsize
    return [w for w in (check_head(plan.recipe, fmt, model, arch, scale_bytes),
                        check_embedding(plan.recipe, fmt, model, arch, scale_bytes)) if w]


def _calibration(plan: _Plan, opts: QuantizeOptions, model, tokenizer, console) -> tuple:
    """``(calib_ids [samples, seqlen] int64 or None, provenance dict or None)``."""
    c = opts.calibration
    if plan.token_file:
        calib_ids, calibration = load_token_ids(c.source, model.config.vocab_size)
        show.note(console, f"calibration: {calib_ids.shape[0]} x {calib_ids.shape[1]} pre-tokenized ids from {c.source} "
                           f"(--calib-samples/--calib-seqlen/--seed do not apply); matmuls in {plan.matmul_precision}")
        return calib_ids, calibration
    if plan.text is None:
        return None, None
    tokens = tokenize(tokenizer, plan.text.text)
    rule = bos_rule(tokenizer)  # windows start with the BOS the tokenizer adds, as in service
    calib_ids = sample_windows(tokens, c.samples, c.seqlen, c.seed, bos_id=rule["bos_token_id"])
    if c.samples * c.seqlen > tokens.numel():
        plan.warnings.append(
            f"calibration: {c.samples} x {c.seqlen} = {c.samples * c.seqlen:,} tokens asked of a text of "
            f"{tokens.numel():,} tokens ({plan.text.name}): the windows overlap and repeat the text (at most "
            f"{tokens.numel() // c.seqlen} windows of {c.seqlen} would not); give more text or fewer --calib-samples")
    calibration = {**plan.text.provenance(), "samples": c.samples, "seqlen": c.seqlen, "seed": c.seed,
                   "bos_token_id": rule["bos_token_id"], "bos_rule": rule["rule"]}
    show.step(console, f"calibration: {c.samples} x {c.seqlen} tokens from {plan.text.name} (seed {c.seed}); "
                       f"matmuls in {plan.matmul_precision}")
    return calib_ids, calibration


# ---------------------------------------------------------------------------------------
# 3. quantize

def _quantize(plan: _Plan, src: _Source, writer: LayerWriter, opts: QuantizeOptions, device: str, console):
    """The sequential pipeline over every decoder layer, with a progress bar; returns its
    :class:`compressor.pipeline.QuantizeResult`."""
    recipe, kv = plan.recipe, plan.kv
    n_layers = src.model.config.num_hidden_layers
    with show.progress(console, "layers") as bar:
        label = ("carried weights" if plan.packed is not None else "float weights"
                 if not get_algorithm(recipe.algorithm).quantizes_weights else f"{recipe.algorithm.upper()} W{recipe.weights.num_bits}")
        task = bar.add_task(label + (f" + KV {kv.scheme}" if kv else ""), total=n_layers, completed=writer.start)
        on_layer = lambda i, n, fig: _layer_done(plan, opts, console, bar, task, i, n, fig)  # noqa: E731
        if opts.execution.workers > 1:  # data-free: N processes convert the layers (compressor.data_free)
            spec = WorkerSpec(plan.source, recipe, opts.write.format, DTYPES[plan.dtype], writer.staging.path,
                              opts.execution.memory_budget_gib, plan.threads)
            return quantize_with_workers(src.model, recipe, writer, spec, opts.execution.workers, on_layer)
        return quantize_model(
            src.model, recipe, src.calib_ids, device=device, dtype=DTYPES[plan.dtype],
            on_layer=on_layer, hooks=writer, matmul_precision=plan.matmul_precision)


def _layer_done(plan: _Plan, opts: QuantizeOptions, console, bar, task, i: int, n: int, fig: dict) -> None:
    """Progress, and the float16 range check on the layer's activations (issue #21): a
    bfloat16 or float32 artifact (weights or KV only) whose activations exceed 65,504 gets a
    warning, once, that it must not be loaded in float16.

    Raises:
        InputError: float16 storage and a layer whose activations exceed 65,504, without
            ``--allow-float16-overflow`` (raised at that layer: nothing is written).
    """
    peak = fig.get("max_abs_activation")
    if plan.dtype != "float16" and peak is not None and peak > FLOAT16_MAX:
        if not any(w.startswith("not for float16") for w in plan.warnings):
            plan.warnings.append(f"not for float16: decoder layer {i}'s activations reach {peak:,.6g}, beyond float16's "
                                 f"{FLOAT16_MAX:,.0f}; load and serve this artifact in {plan.dtype} (as config.json declares)"
                                 + ("" if plan.dtype == "float32" else " or float32") + ": in float16 its activations overflow")
    elif plan.dtype == "float16" and peak is not None and peak > FLOAT16_MAX:
        where = f"decoder layer {i}: activations reach {peak:,.6g}, beyond float16's {FLOAT16_MAX:,.0f}"
        if not opts.write.allow_float16_overflow:
            raise InputError(f"{where}; a float16 artifact would overflow (dtype {plan.dtype}: {plan.dtype_reason}): "
                             + ("" if plan.packed else "use --dtype bfloat16 or float32, or ")
                             + "--allow-float16-overflow to keep float16")
        if not any(w.startswith("float16 overflow accepted") for w in plan.warnings):
            plan.warnings.append(f"float16 overflow accepted (--allow-float16-overflow): {where}")
    plan.layer_peaks.append(peak_rss_mib())  # where the run's peak was reached (the memory plan's phases)
    show.layer_done(console, bar, task, i, n, fig)
    interrupts.check()  # the layer is checkpointed: a signal whose exception was lost stops the run here


# ---------------------------------------------------------------------------------------
# 4. write

def _carry(plan: _Plan, opts: QuantizeOptions, device: str, console, on_committed, t0: float) -> dict:
    """An already-quantized source (:mod:`compressor.commands.kv_only`): its weights
    dequantized (streamed where it can be), the KV cache calibrated on them by the float
    path's pass (:func:`_quantize`, algorithm ``none``), the artifact written with the
    source's tensors byte for byte plus the KV scales; returns the summary."""
    w, packed = opts.write, plan.packed
    model, tokenizer, hooks, loading = kv_only.load_packed(packed, plan.source, opts.execution.stream,
                                                           plan.out.resolve().parent, plan.activation_budget_gib)
    show.note(console, f"source weights: {loading}", highlight=False)
    calib_ids, calibration = _calibration(plan, opts, model, tokenizer, console)
    src = _Source(model, tokenizer, None, loading, calib_ids, calibration)
    # a dynamic scheme has no scale to calibrate: no decoder layer is read
    result = _quantize(plan, src, hooks, opts, device, console) if plan.kv.static else kv_only.uncalibrated(model, plan.kv)
    src.calib_ids, result.kv_key_rotation = None, kv_only.carried_key_rotation(packed)  # q/k rows as the source's
    arch = get_arch(model.config.model_type)
    scales: dict = {}
    kv_record = blocks.kv_record(plan.kv, result, arch, model, scales)
    plan.warnings += result.warnings
    quant = kv_only.quantization_record(packed, plan.dtype, plan.dtype_reason)
    quality, timing = blocks.quality(result, plan.recipe, plan.warnings), blocks.timing(result)
    fields = {"tool": tool_info(), "source": kv_only.source_record(packed), "recipe": plan.recipe.model_dump(mode="json"),
              "calibration": calibration, "quantization": quant, "quality": quality, "kv_cache": kv_record,
              "format": packed.format.name}
    manifest = kv_only.write_carried(packed, plan.out, plan.kv, {f"{m}.{leaf}": t for m, ts in scales.items()
                                                                  for leaf, t in ts.items()},
                                     fields, w, tokenizer, plan.provenance(timing, opts.execution.device), on_committed)
    show.warnings(console, plan.warnings)
    written = _Written(manifest, quant, quality, timing, sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values()))
    summary = {**blocks.run_summary(plan, src, written, hooks, 1, opts, t0), "memory_plan": None,
               "peak_rss_mib_by_layer": plan.layer_peaks}
    show.quantize_done(console, summary, [], result.moe)  # no per-layer weight table: no weight was quantized
    return summary


@dataclass
class _Written:
    manifest: object  # compressor.manifest.Manifest
    quant: dict
    quality: dict
    timing: dict
    float_bytes: int


def _write(plan: _Plan, src: _Source, result, writer: LayerWriter, staging, source_fp: dict,
           opts: QuantizeOptions, console, on_committed=None) -> _Written:
    """The remaining tensors, the format's config, the manifest and signature; the artifact
    is renamed into place at the end (:func:`compressor.artifact.write_artifact`)."""
    import compressed_tensors

    recipe, model, w = plan.recipe, src.model, opts.write
    warnings = plan.warnings
    warnings += result.warnings
    if plan.dtype == "float16" and not any("max_abs_activation" in f for f in result.layers):
        warnings.append("float16 storage: activations were not measured (no calibration pass), so float16 overflow "
                        "was not checked")
    show.warnings(console, warnings)
    schemes, rename, arch = writer.schemes, writer.rename, writer.arch
    schemes.update({n: r.scheme for n, r in result.modules.items()} | head_schemes(recipe, arch))
    quant = blocks.quantization_summary(recipe, w.format, plan.dtype, result.group_size, schemes)
    quant["storage_dtype_reason"] = plan.dtype_reason
    # names as the checkpoint (and vLLM) spells them; MoE routers stay float and are listed as ignored;
    # lm_head is the format's to add, and a wrapper's is listed under its checkpoint name too
    ignored = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in schemes)
    ignored = [rename(n) for n in ignored + routers(arch, model) if n != "lm_head" or rename(n) != n]
    kept, carried = _keep_tensors(plan, src, staging, warnings, console)
    fmt = get_format(w.format)
    qcfg = fmt.config(recipe, {rename(n): v for n, v in schemes.items()}, ignored + kept,
                      {"compressed-tensors": compressed_tensors.__version__, "kvq": tool_info()["version"]},
                      {rename(n): v for n, v in embedding_scheme(recipe, arch).items()})
    packed = {rename(n): t for n, t in fmt.pack_all(result.modules, DTYPES[plan.dtype]).items()}
    result.modules.clear()
    kv_record = blocks.kv_record(plan.kv, result, arch, model, packed)
    float_bytes = float32_bytes(model)
    quality = blocks.quality(result, recipe, warnings)
    if carried is not None:
        quality["carried"] = carried
    timing = blocks.timing(result)
    if opts.model not in ALIASES:  # record paths absolutely so verify finds the reference from anywhere
        source_fp["spec"] = str(Path(opts.model).resolve()) if Path(opts.model).exists() else opts.model
    writer.load_outer()  # released after layer 0's inputs were captured (streamed sources)
    pack = partial(fmt.pack_all, dtype=DTYPES[plan.dtype])
    if (table := add_embedding(recipe, arch, model, packed, pack, rename, DTYPES[plan.dtype])) is not None:
        quality["embedding"] = table  # before add_head, which unties a tied model's config
    if (head := add_head(recipe, arch, model, packed, pack, rename,
                         DTYPES[plan.dtype], getattr(result, "head_hessian", None))) is not None:
        quality["head"] = head
    manifest = write_artifact(
        plan.out, model, src.tokenizer, packed, qcfg,
        {"tool": tool_info(), "source": source_fp, "recipe": recipe.model_dump(mode="json"),
         "calibration": src.calibration, "quantization": quant, "quality": quality, "kv_cache": kv_record,
         "format": w.format},
        provenance=plan.provenance(timing, opts.execution.device),
        dtype_name=plan.dtype, overwrite=w.overwrite, digest_algorithm=w.digest_algorithm, rename=rename,
        finalize=(lambda tmp: sign_folder(tmp, w.sign)) if w.sign is not None else None,
        staging=staging, skip_prefix=arch.layers + ".", shard_bytes=w.shard_bytes, on_committed=on_committed,
        published_config=read_config(plan.source.path / "config.json") if arch.wrapper is not None else None,
    )
    return _Written(manifest, quant, quality, timing, float_bytes)


def _keep_tensors(plan: _Plan, src: _Source, staging, warnings: list[str], console) -> tuple[list[str], Optional[dict]]:
    """The checkpoint's tensors the pipeline never sees, copied into the artifact, never
    silently dropped: multi-token-prediction layers a DeepSeek-V3/GLM checkpoint stores after
    the decoder layers (``num_nextn_predict_layers``; transformers builds no module for
    them) in float (the storage dtype), and the tensors a multimodal wrapper carries (Kimi
    K2.5's vision tower and projector) as stored, block-FP8 ones dequantized. Each is said in
    a warning.

    Returns:
        ``(checkpoint names of the copied linears, for the ignore list; the manifest's
        ``quality.carried`` record, ``None`` without carried tensors)``.
    """
    from ..source.lazy import LazyCheckpoint, carried_tensor_names, copy_kept_tensors, kept_modules, kept_tensor_names

    ckpt = src.ckpt if src.ckpt is not None else (LazyCheckpoint(plan.source.path) if plan.source.kind == "hf" else None)
    if ckpt is None:
        return [], None
    arch, dtype = get_arch(src.model.config.model_type), DTYPES[plan.dtype]
    mtp = kept_tensor_names(ckpt, arch, src.model.config.num_hidden_layers)
    carried = carried_tensor_names(ckpt, arch)
    new = []
    if mtp:
        copy_kept_tensors(ckpt, mtp, dtype, staging.save_part)
        layers = sorted({mtp_layer(arch, src.model.config.num_hidden_layers, k) for k in mtp})
        new.append(f"{len(mtp)} multi-token-prediction tensors (layer(s) {', '.join(map(str, layers))}) copied in "
                   f"float ({plan.dtype}), "
                   "not quantized")
    record = None
    if carried:
        copy_kept_tensors(ckpt, carried, dtype, staging.save_part, tag="carried", as_stored=True)
        fp8 = [k for k in carried if ckpt.where[k][1].dtype == "F8_E4M3"]
        record = {"what": arch.wrapper.what, "prefixes": list(arch.wrapper.carried), "tensors": len(carried),
                  "stored": "as in the source (names, dtypes, bytes)", "dequantized_fp8": fp8}
        new.append(f"{len(carried)} {arch.wrapper.what} tensors ({', '.join(p + '*' for p in arch.wrapper.carried)}) "
                   "carried from the source untouched: not quantized, not evaluated (kvq verify checks them by digest "
                   "only)" + (f"; {len(fp8)} block-FP8 weight(s) dequantized to {plan.dtype}" if fp8 else ""))
    warnings += new
    show.warnings(console, new)
    return kept_modules(ckpt, mtp + carried), record
