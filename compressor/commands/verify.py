"""``kvq verify``: integrity, then statistics against the reference model, then the gates.

:func:`run_verify` reads as its steps:

1. :func:`_integrity` -- the signature (when keys are given) and every digest; nothing in
   the manifest is trusted before this passes (``--hashes-only`` stops here);
2. :func:`_plan` -- every refusal before a model loads: gate thresholds (recipe ``gates``
   overridden by flags, see :mod:`compressor.gates`), the reference model and whether it is
   the recorded source, the eval text, the KV scheme to evaluate;
3. :func:`_load` -- the artifact (dequantized) and the reference, checked to be the same
   architecture and finite; weight statistics (``--weights-only`` stops here); models that do
   not fit whole (or ``--stream``) go through :mod:`compressor.commands.verify_streamed`
   instead, one decoder layer at a time (steps 3 and 4, greedy drift skipped);
4. :func:`_evaluate` -- perplexity, KL divergence, top-1 agreement per window, hidden-state
   error per layer, greedy drift, the KV cache's effect and memory accounting;
5. :func:`_gates` -- every gate whose threshold is set and whose statistic was computed;
   the report is validated against its schema (:mod:`compressor.report`).
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .. import console as show
from .. import gates
from ..arch import get_arch
from ..artifact import foreign_manifest, load_artifact, read_kv_cache
from ..calib import load_text, sample_windows, tokenize
from ..tokens import bos_rule, bos_token_id
from ..errors import CheckFailed, InputError
from ..evaluate import windows
from ..integrity import check_artifact_folder, foreign_integrity, verify_integrity
from ..manifest import load_manifest
from ..source.resolve import resolve_source
from ..quant.kv import make_spec
from . import verify_service, verify_streamed
from .common import cpu_threads, load_reference, threads_restored
from .verify_common import (
    Models, cache_factory, candidate_rows, check_same_architecture, distribution_sections, eval_dtype, head_is_packed,
    kv_report, measured_rows,
)
from .options import EvalOptions, VerifyOptions

#: gates appear in the report in the order of the sections their statistics come from
_SECTIONS = ("nonfinite_tensors", "perplexity", "distribution", "drift", "long_generation", "hidden_state_error",
             "weights")


@dataclass
class _Plan:
    """What :func:`_plan` established before loading a model."""

    folder: Path
    manifest: object  # compressor.manifest.Manifest or ForeignManifest
    weights_quantized: bool
    thresholds: dict[str, float]
    ref_spec: str
    ref_source: object  # compressor.source.resolve.ModelSource
    text: object  # eval text (compressor.calib), None unless full mode
    kv_info: Optional[tuple]  # (KV spec, static scales or None), None: no KV scheme
    kv_source: Optional[str]  # "artifact" or "--kv-scheme"


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
    from ..distributed import watched

    with watched():  # under torchrun a lost rank stops the others in one line
        return _run(opts, console)


def _run(opts: VerifyOptions, console) -> dict:
    """:func:`run_verify` inside the watch over the other ranks (if any): each step that one rank
    does alone is rank 0's, its outcome shared (:func:`compressor.verify_ranks.agree`); the
    windows are dealt to the ranks (:mod:`compressor.verify_ranks`)."""
    from ..source.gguf_cache import take_cache_notes
    from ..prompts import load_prompts
    from ..report import validate
    from ..verify_ranks import agree, join

    t0 = time.perf_counter()
    share, device = join(opts.device)
    if device != opts.device:
        opts = opts.model_copy(update={"device": device})
    if share is not None and share.rank != 0:
        console = None  # rank 0 reports for the group
    folder, manifest, report = agree(share, lambda: _integrity(opts, console), send=lambda v: v[2]["passed"],
                                     elsewhere=lambda passed: _integrity(opts, None, passed))
    prompts = load_prompts(opts.evaluation.prompts) if opts.mode == "full" else None
    if not report["passed"] or opts.hashes_only:
        report["seconds"] = round(time.perf_counter() - t0, 2)
        return _outcome(share, report, lambda: validate(report))
    with threads_restored():  # --threads is this run's
        _, report["busy_note"] = cpu_threads(opts.threads, console)
        plan = agree(share, lambda: _plan(opts, folder, manifest, report, console),
                     elsewhere=lambda _: _plan(opts, folder, manifest, report, None, check_source=False))
        # models too large whole: a layer at a time (rank 0 decides for every rank)
        streamed = agree(share, lambda: verify_streamed.choose(plan, opts, report, console),
                         send=lambda s: None if s is None else s.why,
                         elsewhere=lambda why: None if why is None else verify_streamed.Streamed(
                             plan, opts, report, None, why))
        if streamed is not None:
            streamed.share = share
        models = _load(plan, opts, report, console, share) if streamed is None else None
        report["warnings"].extend(take_cache_notes())  # a cached GGUF reference converted again
        served, results = "weights only", {}
        if streamed is not None:
            served, results = streamed.run()
        elif opts.mode == "full":
            served, results = _evaluate(plan, models, prompts, opts, report, console, share)
        del models
        gc.collect()
    if share is not None:
        _ranks(share, report)

    def finish() -> dict:
        report["gates"] = _gates(report, plan.thresholds, served)
        report["failed_gates"] = [x["name"] for x in report["gates"] if not x["passed"]]
        report["passed"] = report["passed"] and not report["failed_gates"]
        report["seconds"] = round(time.perf_counter() - t0, 2)
        if console:
            show.verify_table(console, report, results)
        return validate({k: v for k, v in report.items() if not k.startswith("_")}) and report

    return _outcome(share, report, finish)


def _ranks(share, report: dict) -> None:
    """Rank 0's report lists each rank's windows and peak RSS: ``evaluated_in.ranks``, ``[{rank,
    windows: [first, end), peak_rss_mib (VmHWM)}, ...]`` (the windows: none without an evaluation)."""
    from ..moe_ranks import bounds
    from ..activations import peak_rss_mib

    got = share.gather([{"rank": share.rank, "peak_rss_mib": peak_rss_mib()}])
    if got is None or report.get("evaluated_in") is None:
        return
    n = (report.get("eval") or {}).get("windows", 0)
    report["evaluated_in"]["ranks"] = [{**r, "windows": list(bounds(n, r["rank"], share.world))} for r in got]


def _outcome(share, report: dict, finish) -> dict:
    """``finish()`` (the report, validated) on rank 0; on the other ranks ``{"rank", "passed"}``
    with rank 0's verdict, so every rank exits with the same code (the CLI prints rank 0's alone)."""
    from ..distributed import finished
    from ..verify_ranks import agree

    out = agree(share, finish, send=lambda r: bool(r["passed"]),
                elsewhere=lambda passed: {"rank": share.rank, "world_size": share.world, "passed": passed})
    finished()  # torchrun: this rank's last collective is behind it
    return out


# ---------------------------------------------------------------------------------------
# 1. integrity

def _integrity(opts: VerifyOptions, console, passed: bool | None = None) -> tuple[Path, object, dict]:
    """``(folder, manifest, report)``: the report so far holds the signature and digest
    checks (``--no-manifest``: the signature only, from another tool's artifact). ``passed``
    (a rank other than 0): rank 0's verdict on them; nothing is hashed here."""
    folder = check_artifact_folder(opts.artifact)
    if passed is not None:
        manifest = foreign_manifest(folder) if opts.no_manifest else load_manifest(folder)
        return folder, manifest, {"passed": passed, "mode": opts.mode, "warnings": []}
    if opts.no_manifest:
        manifest = foreign_manifest(folder)
        report = {**foreign_integrity(folder, opts.keys, console), "mode": opts.mode}
    else:
        manifest = load_manifest(folder)
        report = {**verify_integrity(folder, opts.keys, console), "mode": opts.mode}  # signature, then digests
    return folder, manifest, report


# ---------------------------------------------------------------------------------------
# 2. plan

def _plan(opts: VerifyOptions, folder: Path, manifest, report: dict, console, check_source: bool = True) -> _Plan:
    """Thresholds, reference, eval text and KV scheme, checked before a model loads
    (``check_source``: hash the reference's files against the manifest's record; ranks other
    than 0 leave it to rank 0).

    Raises:
        InputError: a gate this mode cannot evaluate, no reference, eval text not found.
        CheckFailed: the recorded source changed since quantization (no ``--reference``).
    """
    weights_quantized = manifest.quantization.get("algorithm") != "none"
    thresholds, gate_warnings = _thresholds(manifest, opts, opts.mode, weights_quantized)
    report["warnings"].extend(gate_warnings)
    ref_spec = opts.reference or manifest.source.get("spec")
    if not ref_spec:
        raise InputError("the manifest records no source model; pass --reference")
    ref_source = resolve_source(ref_spec)
    if check_source:
        _check_reference_is_source(opts, manifest, ref_spec, ref_source, report)
    if manifest.quantization.get("carried_from") and report.get("reference_matches_source"):
        report["warnings"].append("the artifact's weights were carried unchanged from the reference (an already-quantized "
                                  "source): the comparison measures the KV cache's cost only; pass --reference with the "
                                  "original float model to measure weights + KV")
    text = None
    if opts.mode == "full":
        _check_seqlen(folder, opts.evaluation, report)
        text = load_text(opts.evaluation.text, part="eval")
        if text.note:
            show.note(console, f"[yellow]eval text:[/] {text.note}")
    kv_info = read_kv_cache(folder, manifest)
    kv_source = "artifact" if kv_info else None
    if opts.kv.scheme:
        kv_info, kv_source = (make_spec(opts.kv.scheme), None), "--kv-scheme"
    verify_service.check_gate(thresholds, opts, kv_info if opts.mode == "full" else None, report)
    return _Plan(folder, manifest, weights_quantized, thresholds, ref_spec, ref_source, text, kv_info, kv_source)


def _check_seqlen(folder: Path, ev, report: dict) -> None:
    """Refuse evaluation windows, or a long generation (``--long-tokens`` after its 128-token
    prompt), longer than the artifact's context (``max_position_embeddings`` of its
    ``config.json``, or of the text model's config in a wrapped one) before any model loads;
    the defaults on a model with a shorter context are evaluated with a warning.

    Raises:
        InputError: a ``seqlen`` or ``long_tokens`` other than the default exceeds that context.
    """
    from ..service_eval import LONG_PROMPT_TOKENS

    seqlen, long_tokens = ev.seqlen, ev.long_tokens
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return  # the artifact's own checks name a missing or broken config.json
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    max_pos = cfg.get("max_position_embeddings") or text_cfg.get("max_position_embeddings")
    if not isinstance(max_pos, int) or max_pos <= 0:
        return
    if long_tokens != EvalOptions.model_fields["long_tokens"].default and LONG_PROMPT_TOKENS + long_tokens > max_pos:
        raise InputError(f"--long-tokens {long_tokens} after the long generation's {LONG_PROMPT_TOKENS}-token prompt "
                         f"exceeds the model's context (max_position_embeddings {max_pos}); use --long-tokens "
                         f"{max(max_pos - LONG_PROMPT_TOKENS, 0)} or less")
    if seqlen <= max_pos:
        return
    if seqlen != EvalOptions.model_fields["seqlen"].default:
        raise InputError(f"--seqlen {seqlen} exceeds the model's context (max_position_embeddings {max_pos}); "
                         f"use --seqlen {max_pos} or less")
    report["warnings"].append(f"--seqlen {seqlen} (the default) exceeds the model's max_position_embeddings {max_pos}")


def _check_reference_is_source(opts: VerifyOptions, manifest, ref_spec: str, ref_source, report: dict) -> None:
    """Record whether the reference's weight files are the quantized source's (a warning
    when ``--reference`` names another model; an error when the recorded source changed)."""
    recorded = manifest.source.get("files") or {}
    same = bool(recorded) and ref_source.fingerprint()["files"] == recorded
    report["reference"] = ref_spec
    report["reference_matches_source"] = None if opts.no_manifest else same
    if not same and not opts.no_manifest:
        msg = (f"reference {ref_spec} is not the model that was quantized (its weight-file digests differ from the "
               "manifest's source record)")
        if opts.reference is None:  # the recorded source itself changed: the comparison would prove nothing
            raise CheckFailed(msg + "; the source changed since quantization -- pass --reference to compare with another model")
        report["warnings"].append(msg)


def _thresholds(manifest, opts: VerifyOptions, mode: str, weights_quantized: bool) -> tuple[dict[str, float], list[str]]:
    """Gate thresholds: the recipe's ``gates`` (stored in the manifest), overridden by flags.

    Returns ``(thresholds, warnings)``: recipe gates this mode cannot evaluate become
    warnings; flags it cannot evaluate are refused.

    Raises:
        InputError: the manifest's ``recipe.gates`` is invalid; a gate flag whose statistic
            this mode or artifact does not compute (it would pass silently).
    """
    from pydantic import ValidationError

    from ..recipe import Gates

    try:
        stored = Gates.model_validate(manifest.recipe.get("gates") or {}).model_dump()
    except ValidationError as e:
        first = e.errors()[0]
        raise InputError(f"manifest recipe.gates.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    out, warnings = {}, []
    for spec in gates.gates_of(gates.VERIFY, configurable=True):
        flag = getattr(opts.gates, spec.option)
        value = flag if flag is not None else stored.get(spec.name)
        if value is None and flag is None and mode == "full":
            value = spec.default
        if value is None:
            continue
        why = spec.unavailable(mode, weights_quantized)
        if why is not None:
            if flag is not None:
                raise InputError(f"{spec.flag} cannot be evaluated: {why}")
            warnings.append(f"recipe gate {spec.name} not evaluated: {why}")
            continue
        out[spec.name] = float(value)
    if "min_median_divergence" in out and out["min_median_divergence"] > opts.evaluation.max_new_tokens:
        raise InputError(f"--min-median-divergence {out['min_median_divergence']:g} exceeds --max-new-tokens "
                         f"{opts.evaluation.max_new_tokens}: the gate could never pass")
    return out, warnings


# ---------------------------------------------------------------------------------------
# 3. load

def _load(plan: _Plan, opts: VerifyOptions, report: dict, console, share=None) -> Models:
    """Both models on ``opts.device``, checked comparable and finite; the weight statistics (under
    several ranks, ``share``: on rank 0 alone, but for a key-pairs artifact, whose statistics fit
    the key basis every rank's ``KV only`` row needs).

    Raises:
        InputError: the reference is another architecture or holds NaN/Inf.
        CheckFailed: a KV-only artifact with ``kv_cache.key_rotation: pairs`` whose q_proj/k_proj
            are not the reference's rows changed per RoPE pair (:func:`compressor.quality.key_pairs_residual`).
    """
    from ..quality import KEY_PAIRS_TOLERANCE, key_basis, key_pairs_residual, weight_report

    dtype, report["evaluated_in"] = eval_dtype(plan.folder, opts.evaluation.dtype)
    named = str(dtype).removeprefix("torch.")
    show.step(console, f"loading the artifact and the reference ({plan.ref_spec}) in {named} ...")
    model, tokenizer = load_artifact(plan.folder, dtype=dtype)
    ref_model = load_reference(plan.ref_spec, plan.ref_source, dtype)
    check_same_architecture(model, ref_model, plan.ref_spec)
    bad_ref = _nonfinite_parameters(ref_model)
    if bad_ref:
        raise InputError(f"reference model tensor {bad_ref[0]} contains NaN or Inf; it cannot serve as the reference")
    bad = _nonfinite_parameters(model)
    report["nonfinite_tensors"] = bad
    if bad:
        show.note(console, f"[red]NaN or Inf[/] in {len(bad)} artifact tensor(s): {', '.join(bad[:5])}", highlight=False)
    model.to(opts.device)
    ref_model.to(opts.device)
    key_pairs = (plan.manifest.kv_cache or {}).get("key_rotation") == "pairs"
    basis: dict = {}  # the k_proj pair factors, fitted once (weight statistics, then the KV-only row)
    algorithm = "none"
    if plan.weights_quantized and (share is None or share.rank == 0 or key_pairs):
        # weights carried from an already-quantized source: the algorithm that made them, if known
        algorithm = plan.manifest.quantization.get("source_algorithm") or plan.manifest.recipe.get("algorithm", "")
        if opts.no_manifest:  # the producer's algorithm is unknown: AWQ shows as rescaled norm weights
            algorithm = "awq" if _norms_rescaled(ref_model, model) else "unknown"
            report["warnings"].append(f"foreign artifact: weight statistics assume {'AWQ-folded' if algorithm == 'awq' else 'unscaled'} "
                                      "weights (inferred from the norm weights)")
        show.step(console, "weight statistics: each tensor against the reference's ...")
        report["weights"] = weight_report(ref_model, model, algorithm, quantized_head=head_is_packed(plan.folder, model),
                                          key_pairs=key_pairs, basis=basis,
                                          quantized_embedding=head_is_packed(plan.folder, model, "embed_tokens"))
    elif key_pairs:  # KV-only: its figures run the reference in the artifact's key basis; the q/k rows must be exactly that
        worst, name = key_pairs_residual(ref_model, model)
        if not worst <= KEY_PAIRS_TOLERANCE:
            raise CheckFailed(f"{name} is not the reference's rows changed per RoPE pair (relative residual {worst:.3g} > "
                              f"{KEY_PAIRS_TOLERANCE:g}): the artifact is not its source with kv_cache.key_rotation pairs")
        show.note(console, f"key pairs: q_proj/k_proj are the reference's rows changed per RoPE pair (largest relative "
                           f"residual {worst:.2g}, {name})", highlight=False)
    # the key basis serves the reference's KV-only row of a weight artifact; a KV-only artifact's row runs the artifact
    if plan.weights_quantized and share is not None and share.rank != 0:
        report.pop("weights", None)  # rank 0's report lists them
    return Models(model, tokenizer, ref_model,
                   (basis or key_basis(ref_model, model, algorithm)) if key_pairs and plan.weights_quantized else None)


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


# ---------------------------------------------------------------------------------------
# 4. evaluate

def _evaluate(plan: _Plan, models: Models, prompts: list[str], opts: VerifyOptions, report: dict,
              console, share=None) -> tuple[str, dict]:
    """Full mode: the statistics on the eval text and the prompts, into ``report``.

    Returns ``(served, results)``: the configuration the gates judge (``weights only``,
    ``KV only`` or ``weights + KV``) and the per-configuration results of
    :func:`compressor.evaluate.compare`. Under several ranks (``share``) each rank evaluates its
    block of windows and of hidden-state batches, rank 0 adds them up and alone measures the drift,
    the long generation and the chat; the other ranks return ``(served, {})``.
    """
    from ..evaluate import compare

    ev = opts.evaluation
    model, ref_model = models.artifact, models.reference
    rule = bos_rule(models.tokenizer)  # the tokenizer's own rule: windows start with its BOS, if any
    bos = rule["bos_token_id"]
    wins = windows(tokenize(models.tokenizer, plan.text.text), ev.seqlen, ev.max_windows, bos_id=bos)
    kv_info = plan.kv_info
    if kv_info is not None and kv_info[0].static and kv_info[1] is None:
        # --kv-scheme with static scales on a model that has none: calibrate them now
        kv_info = (kv_info[0], _calibrate_kv(model, models.tokenizer, kv_info[0], opts, console))
    make_cache = cache_factory(model, kv_info, ev.seqlen, report)
    ref_cache = make_cache  # the KV-only figures: the reference's keys in the artifact's key basis, if it has one
    if make_cache is not None and models.key_basis is not None and kv_info[0].static:
        ref_cache = lambda: make_cache(models.key_basis)  # noqa: E731
    candidates, served = candidate_rows(models, plan.weights_quantized, make_cache, ref_cache)
    report["evaluated_in"]["rows"] = measured_rows(models, candidates, kv_info)
    verify_service.add_unit_scale_row(candidates, kv_info, ev.seqlen,
                                      models.key_basis if plan.weights_quantized and ref_cache is not make_cache
                                      else None, report)
    with show.progress(console, "windows") as bar:
        task = bar.add_task(f"reference + {len(candidates)} configuration(s)", total=len(wins))
        t_eval = time.perf_counter()
        results = compare(ref_model, candidates, wins, opts.device, opts.kv.chunk,
                          lambda i, n: show.window_done(console, bar, task, i, n, time.perf_counter() - t_eval),
                          share=share)
    if results is None:  # a rank other than 0: its windows are with rank 0; then its hidden-state batches
        _hidden(report, models, plan.weights_quantized, wins, opts, None, share)
        return served, {}
    unit = verify_service.unit_scale_section(results, kv_info, get_arch(model.config.model_type).kv, report)
    distribution_sections(report, results, served, wins, plan.text, ev.seqlen)
    report["eval"]["bos_token_id"] = bos
    report["eval"]["bos_rule"] = rule["rule"] + ("; evaluation windows, drift prompts and KV calibration follow it"
                                                 " (llama.cpp's perplexity convention)")
    _hidden(report, models, plan.weights_quantized, wins, opts, console, share)
    _drift(report, models, prompts, make_cache, served, opts, console)
    verify_service.sections(report, results, served, candidates, models.tokenizer, wins, plan.text, opts, console)
    if kv_info is not None:
        report["kv_cache"] = {**kv_report(kv_info[0], plan.kv_source, plan.ref_source, opts), "unit_scale": unit}
    return served, results


def _hidden(report: dict, models: Models, weights_quantized: bool, wins, opts: VerifyOptions, console=None,
            share=None) -> None:
    """The report's ``hidden_state_error`` section (quantized weights only), a progress line as it
    starts; ``share``: each rank runs its block of the batches, rank 0 adds them up."""
    from ..evaluate import hidden_state_errors

    ev = opts.evaluation
    if weights_quantized:
        hb = wins[: ev.hidden_batches, : min(ev.seqlen, 512)]
        show.step(console, f"hidden-state error per layer: {hb.shape[0]} x {hb.shape[1]} tokens, both models ...")
        per_layer = hidden_state_errors(models.reference, models.artifact, hb, opts.device, share=share)
        if per_layer is not None:
            report["hidden_state_error"] = {"batches": int(hb.shape[0]), "seqlen": int(hb.shape[1]),
                                            "per_layer": per_layer, "last": per_layer[-1]}


def _drift(report: dict, models: Models, prompts, make_cache, served: str, opts: VerifyOptions, console=None) -> None:
    """The report's ``drift`` section, a progress line as it starts and per prompt (minutes on a
    large model's CPU run); rank 0 alone under several ranks."""
    from ..quality import greedy_drift

    ev = opts.evaluation
    drift_cache = make_cache if served != "weights only" else None  # the artifact as served
    t0 = time.perf_counter()
    show.step(console, f"greedy drift: {len(prompts)} prompts x {ev.max_new_tokens} tokens, reference and {served} ...")
    report["drift"] = {**greedy_drift(models.reference, models.artifact, models.tokenizer, prompts, ev.max_new_tokens,
                                      drift_cache, opts.device, on_prompt=lambda i, n: show.step(
                                          console, f"drift prompt {i}/{n} done ({time.perf_counter() - t0:.0f} s)")),
                       "measured_on": served}


def _calibrate_kv(model, tokenizer, spec, opts: VerifyOptions, console) -> dict:
    """Static KV scales for ``--kv-scheme`` on a model without stored ones (calibration text ``opts.kv.calib``)."""
    from ..quant.kv import cache_kwarg, kv_observer, layer_scales, observed_absmax

    kv = opts.kv
    text = load_text(kv.calib, part="calib")
    ids = sample_windows(tokenize(tokenizer, text.text), kv.calib_samples, 512, 0, bos_id=bos_token_id(tokenizer))
    obs = kv_observer(model.config.num_hidden_layers)
    with torch.no_grad():
        for b in ids.split(4):
            model(b.to(opts.device), use_cache=True, **{cache_kwarg(model): obs})
    show.note(console, f"KV scales for {spec.describe()} calibrated on {kv.calib_samples} x 512 tokens of {text.name}")
    layout = get_arch(model.config.model_type).kv_layout(model.config)
    return {i: tuple(x.half().float() for x in layer_scales(k, v, spec, layout))
            for i, (k, v) in observed_absmax(obs).items()}


# ---------------------------------------------------------------------------------------
# 5. gates

def _gates(report: dict, thresholds: dict[str, float], served: str) -> list[dict]:
    """``finite_weights``, then every gate whose threshold is set and whose statistic this
    run computed (:mod:`compressor.gates`), in the order of the report's sections."""
    bad = report["nonfinite_tensors"]
    out = [gates.result("finite_weights", 0.0, float(len(bad)), measured_on="artifact tensors",
                        detail=("NaN or Inf in: " + ", ".join(bad[:5])) if bad else None)]
    order = sorted(gates.gates_of(gates.VERIFY, configurable=True),
                   key=lambda g: _SECTIONS.index(g.statistic.split(".")[0]))
    for spec in order:
        if spec.name not in thresholds or not report.get(spec.statistic.split(".")[0]):
            continue
        value = gates.statistic(report, spec)
        detail = _below_sqnr(report["weights"], thresholds[spec.name]) if spec.name == "min_sqnr_db" else None
        out.append(gates.result(spec.name, thresholds[spec.name], None if value is None else float(value),
                                measured_on=spec.measured_on or served, detail=detail))
    return out


def _below_sqnr(weights: dict, threshold: float) -> Optional[str]:
    """The tensors below the SQNR threshold, named (the first five)."""
    below = [t["name"] for t in weights["tensors"] if not t["sqnr_db"] >= threshold]
    if not below:
        return None
    return f"{len(below)} tensor(s) below: " + ", ".join(below[:5]) + (" ..." if len(below) > 5 else "")
