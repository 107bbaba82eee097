"""The command line's help texts, one per option (``HELP["<command>.<option>"]``), kept out of
:mod:`compressor.cli` so that its declarations stay a line each."""

from importlib.resources import files


def bundled_recipe_names() -> list[str]:
    """The bundled recipes' names (``compressor/recipes/*.yaml`` stems, sorted, as
    :func:`compressor.recipe.bundled_recipes` lists them; read here without importing the recipe models, so that
    ``kvq --help`` stays quick): ``--recipe``'s help names each one the package ships. ``[]`` without the data."""
    folder = files(__package__) / "recipes"
    if not folder.is_dir():
        return []
    return sorted(p.name[:-len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _unwrapped(names: list[str], width: int = 44) -> str:
    """``names`` joined by commas in lines of at most ``width`` characters, as a paragraph click prints as it is
    (``\\b``: no rewrapping, so no name is broken at a hyphen)."""
    lines = [""]
    for name in names:
        word = name + ("," if name != names[-1] else ".")
        lines[-1:] = [f"{lines[-1]} {word}".strip()] if len(lines[-1]) + 1 + len(word) <= width else [lines[-1], word]
    return "\b\n" + "\n".join(lines)


HELP = {
    "quantize.output": "Artifact folder to create (must not exist unless --overwrite).",
    "quantize.recipe": (
        "Bundled recipe name (an unknown one gets the closest names) or path to a YAML recipe; repeatable: later "
        "ones add to or override earlier ones (--recipe w4a16-awq --recipe kv-fp8); the schemes are checked on the "
        "final recipe (the stack merged, then --set and the flags). A recipe's overrides may give "
        "modules a whole scheme of their own, weights and activations (mixed formats: --recipe "
        "w4a8-experts-fp8-attn, a MoE model's routed experts W4A8 and the rest FP8 W8A8; docs/recipes.md). The "
        f"bundled ones (`kvq recipes` says what each does):\n\n{_unwrapped(bundled_recipe_names())}\n\n"
    ),
    "quantize.kv-scheme": (
        "Shortcut for a KV-cache scheme with its defaults (fp8 per tensor with scales searched on the "
        "attention output, as the kv-fp8 recipe; int8 per token; int4/int2 KIVI group 32 residual 128). "
        "Change them with --set: kv_cache.strategy=head (per-head fp8 scales), "
        "kv_cache.scale_search=absmax|attention|auto (absmax / 448, the search, or the search where the cache"
        " has KV heads and absmax on MLA), kv_cache.scale_search_samples=N (calibration sequences the search "
        "uses, default 4), kv_cache.key_rotation=pairs (static scales searched: exact per-RoPE-pair factors "
        "in q_proj/k_proj chosen for the cache's grid, fp8 or int8 per head; angles only where q/k stay "
        "float; docs/kv-cache.md)."
    ),
    "quantize.algorithm": "Override the recipe's algorithm (none: weights stay float, e.g. a KV-only artifact).",
    "quantize.bits": "Override weights.num_bits (2-8).",
    "quantize.group-size": (
        "Override weights.group_size: any size dividing every targeted in_features (32, 64 and 128 are the "
        "usual), -1 (per channel) or auto (the largest of 128/64/32 that divides)."
    ),
    "quantize.symmetric": (
        "Override weights.symmetric (the bundled 4/3-bit recipes are asymmetric, w8a16-rtn symmetric)."
    ),
    "quantize.act-order": "Override gptq.act_order (GPTQ: visit columns by descending Hessian diagonal).",
    "quantize.set": (
        "Override any recipe field by its dotted key, e.g. --set gptq.damp=0.02, --set gptq.clip=true (GPTQ's"
        " range search), --set gptq.gptaq_alpha=0.25 (GPTQ's float target), --set "
        "kv_cache.scale_search=absmax (see --kv-scheme), --set head=null, a section whole: --set "
        "'activations={type: float, num_bits: 8, strategy: token}' (repeatable; VALUE is parsed as YAML, null "
        "included)."
    ),
    "quantize.format": (
        "On-disk layout: compressed-tensors (vLLM/transformers), awq (AutoAWQ GEMM, 4-bit only) or gptq "
        "(AutoGPTQ/GPTQModel; g_idx for act-order)."
    ),
    "quantize.calib": (
        "Calibration text: a .txt/.jsonl/.parquet file, 'embedded' (offline CPython prose), or "
        "wikitext2/c4/pileval (online); or a .safetensors file with one integer tensor input_ids [samples, "
        "seqlen] of pre-tokenized windows (used as they are; --calib-samples/--calib-seqlen/--seed do not "
        "apply). Read by AWQ, GPTQ, static KV scales and NVFP4 W4A4 (w4a4-nvfp4: each linear's input_global_scale "
        "from the absmax of its calibration inputs)."
    ),
    "quantize.calib-field": "Text column of a .jsonl/.parquet calibration file.",
    "quantize.calib-samples": "Number of calibration sequences.",
    "quantize.calib-seqlen": "Tokens per calibration sequence.",
    "quantize.seed": "Seed for drawing calibration windows.",
    "quantize.device": "Where each layer is processed.",
    "quantize.dtype": (
        "Storage and declared dtype of scales and unquantized tensors (config.json's dtype). auto: the "
        "source's (bfloat16 or float16 checkpoints keep theirs; float32, FP8 and GGUF sources get bfloat16). "
        "float16 is refused when a layer's calibration activations exceed 65,504."
    ),
    "quantize.allow-float16-overflow": (
        "Keep --dtype float16 although some layer's activations exceed float16's range (recorded in the "
        "manifest's warnings)."
    ),
    "quantize.overwrite": (
        "Replace an earlier artifact (a folder holding kvq-manifest.json) or an empty folder, atomically at "
        "the end; any other folder is refused."
    ),
    "quantize.digest": "Digest of files and tensors in kvq-manifest.json.",
    "quantize.sign-key": (
        "Sign the artifact as the last step with this EC private key (PEM), through model_signing; writes "
        "OUT/model.sig."
    ),
    "quantize.sign-password": "Password of an encrypted --sign-key (or env KVQ_SIGN_PASSWORD).",
    "quantize.sign-certificate": "With --sign-key: the key's signing certificate (PEM), for certificate-based signing.",
    "quantize.sign-chain": "With --sign-certificate: a certificate of its chain (repeatable).",
    "quantize.stream": (
        "Read a safetensors MODEL one decoder layer at a time (peak memory about one layer plus calibration "
        "activations); --no-stream loads it whole. A GGUF file is converted whole once, then streamed from "
        "kvq's cache (whole on every run when the cache folder cannot be written)."
    ),
    "quantize.shard-size": (
        "Maximum size of one output weights file (e.g. 500MB, 2GiB; at least 1MB); several files get "
        "model-0000k-of-0000N names and model.safetensors.index.json."
    ),
    "quantize.matmul-precision": (
        "CPU matmuls of the calibration pass (layer forwards, Hessians, AWQ's search, KV observers): bfloat16"
        " runs each linear as one bfloat16 matmul (inputs and weight rounded to bfloat16, float32 "
        "accumulation, output rounded to bfloat16; a SmolLM2 linear 2.5x faster on an AVX512-BF16 CPU) and "
        "the other matmuls with bfloat16 inputs where oneDNN does so (AMX); Hessians keep float32 products. "
        "GPTQ's solve, packing, verify and serve-smoke stay float32. auto: bfloat16 on a CPU with AMX-BF16 or"
        " AVX512-BF16, float32 otherwise and on CUDA. The two give different integer codes of the same "
        "quality (each deterministic; BENCHMARKS.md); the manifest's provenance records which ran."
    ),
    "quantize.threads": (
        "CPU threads of torch's operations (default: one per usable CPU). On a machine shared with other jobs"
        " --threads 1 is usually faster: each of GPTQ's thousands of short parallel steps otherwise waits for"
        " a descheduled thread (a note says so when other jobs already keep the CPUs busy: load average at "
        "least the CPU count minus 0.5; another when --threads exceeds the usable CPUs; both in --json as "
        "busy_note). A calibrated artifact's integer codes depend on the thread count (BLAS reductions): the "
        "manifest's provenance records it and --resume keeps it."
    ),
    "quantize.activation-budget-gib": (
        "Calibration activations above this size move to memory-mapped files in the staging folder; GPTQ also"
        " keeps finished sub-layers' outputs for reuse only within it (0: spill everything, keep nothing; the"
        " artifact is the same)."
    ),
    "quantize.memory-budget-gib": (
        "Weights of one decoder layer held at once (5 bytes a weight: float32 and its int8 codes) by a "
        "streamed run: a larger MoE layer's routed experts are read, quantized, written and released in groups "
        "of at most this size (with a calibration pass, each expert is calibrated on the tokens routed to it; "
        "AWQ and awq-gptq read the experts at least twice more, for the scale their norm shares, holding the "
        "grid candidates' routed outputs within this budget). GPTQ on a layer held whole accumulates and solves "
        "the routed experts' Hessians (12 bytes per input feature squared each) in chunks within this budget. "
        "A streamed run prints its memory plan (the estimated peak and what makes it) before loading, and "
        "refuses a budget below one routed expert, the smallest unit a layer is read in (exit 2)."
    ),
    "quantize.workers": (
        "Processes converting the layers at once, for data-free recipes (RTN integer weights, the FP8 W8A8 "
        "recipes, float weights with dynamic or no KV scales) on a streamed source: each opens its own reader "
        "of the source shards and reads, quantizes and writes its share of the layers (a MoE layer above "
        "--memory-budget-gib: of its expert groups), holding one layer or group at a time as one process does; "
        "--threads is divided among them. The artifact is the one a single process writes, digest for digest. "
        "Refused (exit 2) with a calibration pass (AWQ, GPTQ, GPTAQ, refine, static KV scales, NVFP4 W4A4), "
        "--no-stream, an already-quantized source, or under torchrun."
    ),
    "quantize.resume": (
        "Continue an interrupted run of the same command from its last finished layer (kept in "
        ".OUTPUT.kvq-partial beside OUTPUT); refused if the inputs changed."
    ),
    "quantize.json": "Print a JSON summary on stdout (nothing else); stderr keeps a progress line per layer and step.",
    "verify.reference": "Original model to compare with (default: the source recorded in the manifest).",
    "verify.eval": "Evaluation text: a .txt/.raw/.jsonl/.parquet file or 'embedded' (held-out CPython prose).",
    "verify.seqlen": "Tokens per evaluation window.",
    "verify.max-windows": "Evaluate only the first N windows (default: all).",
    "verify.max-ppl-increase": (
        "Gate: maximum perplexity increase in percent (default: the recipe's gates.max_ppl_increase_pct)."
    ),
    "verify.hashes-only": "Only recheck file and tensor digests against the manifest.",
    "verify.kv-scheme": (
        "Evaluate with this KV-cache scheme (its defaults) instead of the artifact's; works on any artifact. "
        "Static scales (fp8) are calibrated on --kv-calib as absmax / 448, without the attention-output "
        "search that kvq quantize --kv-scheme fp8 and the kv-fp8 recipe run, so an artifact quantized with "
        "those usually does a little better."
    ),
    "verify.kv-budget-gib": "KV-cache memory budget for the accounting line (max tokens, max batch per context).",
    "verify.kv-chunk": (
        "With a quantized KV cache, tokens per prefill chunk (each chunk reads the cache after writing)."
    ),
    "verify.kv-calib": (
        "Calibration text for --kv-scheme static scales (fp8, int8 per head): 16 x 512 tokens of it, seed 0; "
        "recorded in the report."
    ),
    "verify.device": "Where perplexity is computed.",
    "verify.weights-only": (
        "Weight statistics only (per tensor error, SQNR, original vs artifact mean/std/absmax/kurtosis): no "
        "eval text, no perplexity; fast CI check."
    ),
    "verify.max-mean-kl": (
        "Gate: maximum mean KL(reference || artifact) per token, nats (default: the recipe's "
        "gates.max_mean_kl)."
    ),
    "verify.max-p99-kl": "Gate: maximum 99th-percentile token KL, nats.",
    "verify.min-top1": "Gate: minimum top-1 agreement with the reference, percent of predicted tokens.",
    "verify.min-sqnr-db": "Gate: minimum weight SQNR in dB over every quantized tensor (failing tensors are named).",
    "verify.max-hidden-error": "Gate: maximum relative hidden-state error after the last decoder layer (0.05 = 5 %).",
    "verify.min-median-divergence": (
        "Gate: minimum median position where greedy generations first differ (a prompt whose generations "
        "never differ counts as --max-new-tokens)."
    ),
    "verify.prompts": (
        'Prompts for the greedy-drift check: .txt (one per line) or .jsonl ({"prompt": ...}); default: 8 '
        "built-in prompts."
    ),
    "verify.max-new-tokens": "Tokens generated per prompt for the greedy-drift check.",
    "serve-smoke.long-tokens": (
        "Greedy tokens of a long generation of the first prompt through the runtime as served, against the "
        "reference teacher-forced on it (top-1, first divergence, KL by position, repeated 4-grams); 0: none."
    ),
    "serve-smoke.turns": (
        "User turns of a multi-turn chat through the runtime as served (the prompts in order, through the "
        "tokenizer's chat template, 48-token replies), its KV cache kept across turns, against the reference "
        "teacher-forced on the conversation (KL and top-1 per turn's prompt and reply); 0: none."
    ),
    "serve-smoke.stream": (
        "Read the reference one decoder layer at a time over the prompts plus the runtime's continuations "
        "(teacher-forced: one pass gives every logit; memory: one layer, the sequences' hidden states, the head "
        "at the end; an MoE layer above --memory-budget-gib in groups of routed experts). Same figures as the "
        "whole reference; --long-tokens takes one more pass per token where the reference's own greedy "
        "continuation leaves the runtime's. Chosen by itself when the reference does not fit whole in "
        "--memory-budget-gib. The runtime side is the packed model whole, released before the reference loads."
    ),
    "serve-smoke.memory-budget-gib": (
        "Memory serve-smoke may use besides the process itself (about 0.5 GiB), GiB (default: the memory this "
        "machine has available, less the process's): a runtime estimated above it (packed weights from the "
        "safetensors headers, KV cache, logits; the process not counted) is refused before anything loads (exit 2; "
        "kvq verify --stream checks such an artifact), a reference above it is streamed (--stream). The plan "
        "(what is held at peak) is printed first, and is memory_plan in --json."
    ),
    "verify.long-tokens": (
        "With a KV scheme: greedy tokens of the long generation (float cache vs quantized cache, after 128 tokens "
        "of the eval text); 0: none."
    ),
    "verify.turns": (
        "With a KV scheme: user turns (paragraphs of the eval text) of the multi-turn chat through the tokenizer's "
        "chat template, both caches kept across turns; 0: none."
    ),
    "verify.min-long-agreement": (
        "Gate: minimum top-1 agreement, percent, of the quantized KV cache teacher-forced on the float cache's long "
        "generation."
    ),
    "verify.eval-dtype": (
        "Evaluate the artifact in the dtype its config.json declares (auto: what transformers and vLLM load "
        "it in, so the figures describe the model users serve) or in float32. The reference is float32; the "
        "report's evaluated_in says which."
    ),
    "verify.hidden-batches": "Eval windows (first 512 tokens each) for the per-layer hidden-state error.",
    "verify.report": "Write report.md (PR comment), report.html, report.json and PNG plots into this folder.",
    "verify.threads": (
        "CPU threads of torch's operations (default: one per usable CPU; on a machine shared with other jobs "
        "--threads 1 is usually faster, and a note, also in the JSON report's busy_note, says when the CPUs "
        "are already busy or --threads exceeds them)."
    ),
    "verify.stream": (
        "Read both models one decoder layer at a time: every eval window advances through layer i of the "
        "reference and of the artifact, then the layer is released (memory: one layer of each model, the "
        "windows' hidden states, at the end both heads; an MoE layer above --memory-budget-gib is read in "
        "groups of routed experts, each released before the next). Same statistics as the whole-model path; greedy "
        "drift is skipped (the report says so). Chosen by itself when the two models do not fit whole in "
        "--memory-budget-gib (default: the memory this machine has available)."
    ),
    "verify.memory-budget-gib": (
        "Memory verify may use besides the process itself (torch and transformers, about 0.5 GiB), GiB: "
        "models that do not fit whole are streamed (--stream), an MoE layer that does not fit is read in groups "
        "of routed experts sized to it, and a streamed plan whose smallest unit (one expert and the rest of a "
        "layer of each model, the hidden states) does not fit is refused before any weight is read. The plan "
        "(what is held at peak) is printed first."
    ),
    "verify.no-manifest": (
        "ARTIFACT was written by another tool (e.g. llm-compressor) and has no kvq-manifest.json: skip the "
        "digest step (the signature is still checked when keys are given) and compare with --reference, which"
        " is then required."
    ),
    "verify.json": ("Print the report as JSON on stdout (nothing else); stderr keeps a progress line per window "
                    "and step."),
    "verify.json-out": "Also write the JSON report to this file.",
    "sign.private-key": (
        "EC private key (PEM) to sign with, e.g. from `openssl ecparam -name prime256v1 -genkey -noout -out "
        "key.pem`."
    ),
    "sign.password": "Password of an encrypted --private-key (or env KVQ_SIGN_PASSWORD).",
    "sign.signing-certificate": "Certificate of --private-key (PEM): sign with a certificate instead of a bare key.",
    "sign.certificate-chain": "With --signing-certificate: intermediate/root certificates (PEM, repeatable).",
    "sign.sigstore": "Sigstore keyless signing (needs network and an OIDC identity; in CI, ambient credentials).",
    "sign.identity-token": "With --sigstore: an OIDC identity token (or env KVQ_SIGSTORE_TOKEN).",
    "sign.json": "Print the result as JSON on stdout.",
    "serve-smoke.prompts": 'Prompts: .txt (one per line) or .jsonl ({"prompt": ...}); default: 8 built-in prompts.',
    "serve-smoke.max-new-tokens": "Tokens generated per prompt (greedy).",
    "serve-smoke.reference": "Original model to compare with (default: the source recorded in the manifest).",
    "serve-smoke.backend": (
        "Weight kernels: auto (CPU: PyTorch int4/int8 weight-only ops, else dequantize; CUDA: Triton W4A16), "
        "or one of them."
    ),
    "serve-smoke.dtype": (
        "Compute dtype. auto: bfloat16 for an artifact that declares it (kvq's default; what transformers, "
        "vLLM and verify --eval-dtype auto use), else float32 on CPU, float16 on CUDA. float32: "
        "full-precision activations (slower)."
    ),
    "serve-smoke.device": "Where the runtime and the reference run.",
    "serve-smoke.http": (
        "Also start the OpenAI-compatible server on a free 127.0.0.1 port, send --http-requests concurrent "
        "requests (completions and chat), check the answers, stop it."
    ),
    "serve-smoke.http-requests": "Concurrent requests for --http.",
    "serve.threads": (
        "CPU threads of torch's operations in the server (default: one per usable CPU; a note says when other jobs "
        "already keep the CPUs busy or --threads exceeds them)."
    ),
    "serve-smoke.threads": (
        "CPU threads of torch's operations, runtime and reference (default: one per usable CPU; the decode "
        "tokens/s depend on it; a note, also in --json's busy_note, says when other jobs already keep the "
        "CPUs busy or --threads exceeds them)."
    ),
    "serve-smoke.min-top1": (
        "Gate: minimum top-1 agreement with the reference over generated positions, percent (default: recipe "
        "gates.serve_min_top1_pct, else 70)."
    ),
    "serve-smoke.max-kl": (
        "Gate: maximum mean KL(reference || runtime) over prompt positions, nats (default: recipe "
        "gates.serve_max_prompt_kl, else 0.5)."
    ),
    "serve-smoke.min-first-divergence": (
        "Gate: minimum median first generated position where the reference would pick another token (a prompt "
        "where it never would counts as --max-new-tokens)."
    ),
    "serve-smoke.json": "Print the report as JSON on stdout (nothing else); stderr keeps a progress line per step.",
    "serve.host": "Address to listen on (loopback unless --allow-remote).",
    "serve.port": "TCP port (0: any free port).",
    "serve.allow-remote": "Allow a non-loopback --host (the server has no authentication).",
    "serve.backend": "Weight kernels (see serve-smoke).",
    "serve.dtype": "Compute dtype (see serve-smoke).",
    "serve.device": "Where the runtime runs.",
    "serve.max-batch": "Concurrent requests batched into one generation.",
    "serve.max-queue": "Sequences (prompts) allowed to wait; a request that does not fit gets 429.",
    "signature.public-key": "Check model.sig with this EC public key (PEM) before anything else.",
    "signature.certificate-chain": "Check model.sig against this certificate chain (PEM, repeatable).",
    "signature.identity": (
        "Sigstore keyless: the expected signer identity (e.g. an e-mail or workflow URL); needs --issuer and "
        "network."
    ),
    "signature.issuer": "Sigstore keyless: the expected OIDC issuer, e.g. https://token.actions.githubusercontent.com.",
    "serve-smoke.no-manifest": (
        "ARTIFACT was written by another tool and has no kvq-manifest.json: serve it unchecked (one line says"
        " so; model.sig is still checked when key material is given). --reference is then required."
    ),
    "serve.no-manifest": (
        "ARTIFACT was written by another tool and has no kvq-manifest.json: serve it unchecked (one line says"
        " so; model.sig is still checked when key material is given)."
    ),
}
