"""KV-cache quantization benchmark on SmolLM2-135M (issue #4).

For FP weights and for the AWQ W4 g64 artifact of ``bench/run_bench.py``
(``bench/work/awq-w4g64``), perplexity on the first ``BENCH_WINDOWS`` (default 20)
windows of 2048 tokens of ``wiki.test.raw`` with each KV scheme, evaluated exactly as
``kvq verify`` does (chunked prefill of 128 tokens through ``quantized_cache``). Static
scales (fp8) are calibrated like ``kvq quantize --recipe kv-fp8``: absmax of the
post-RoPE K/V of the model being evaluated over 128 x 512 tokens of
``wikitext-2/valid.txt`` (seed 0).

Writes ``bench/results/kv-<weights>-<scheme>.json`` (reused when present) and prints the
Markdown table for BENCHMARKS.md. ``QUICK=1``: 2 windows, 8 calibration samples.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
DATA = ROOT.parent / "shared" / "data"
QUICK = os.environ.get("QUICK") == "1"
WINDOWS = 2 if QUICK else int(os.environ.get("BENCH_WINDOWS", "20"))
CALIB = 8 if QUICK else 128
TAG = "quick-" if QUICK else ""

SCHEMES = [  # (label, scheme, strategy, group_size, residual_length)
    ("fp8 per tensor", "fp8", "tensor", 32, 128),
    ("fp8 per head", "fp8", "head", 32, 128),
    ("int8 per token", "int8", "token", 32, 128),
    ("int4 KIVI g32 r128", "int4", "kivi", 32, 128),
    ("int2 KIVI g32 r32", "int2", "kivi", 32, 32),
]
if os.environ.get("KV_BENCH_EXTRA") == "1":  # int2 with the longer residual window (not run for BENCHMARKS.md yet)
    SCHEMES.append(("int2 KIVI g32 r128", "int2", "kivi", 32, 128))


def table_only():
    """TABLE_ONLY=1: print the table from the result files present (no model is loaded)."""
    from compressor.quant.kv import kv_bytes_per_token, make_spec

    shape = (30, 3, 64)  # SmolLM2-135M: layers, kv heads, head_dim
    fp = json.loads((RESULTS / f"{TAG}kv-fp32-none.json").read_text())["ppl"]
    print("| weights | KV cache | perplexity | vs same weights, float KV | vs FP32 model | KV bytes/token |")
    print("| --- | --- | --- | --- | --- | --- |")
    for w in ("fp32", "awq-w4g64"):
        base_f = RESULTS / f"{TAG}kv-{w}-none.json"
        if not base_f.exists():
            continue
        base = json.loads(base_f.read_text())["ppl"]
        print(f"| {w} | float KV | {base:.3f} | | {(base / fp - 1) * 100:+.2f} % | {kv_bytes_per_token(None, *shape):,.0f} |")
        for label, scheme, strategy, gs, res in SCHEMES:
            f = RESULTS / f"{TAG}kv-{w}-{scheme}-{strategy}-g{gs}-r{res}.json"
            if f.exists():
                ppl = json.loads(f.read_text())["ppl"]
                bpt = kv_bytes_per_token(make_spec(scheme, strategy, gs, res), *shape)
                print(f"| {w} | {label} | {ppl:.3f} | {(ppl / base - 1) * 100:+.2f} % | {(ppl / fp - 1) * 100:+.2f} % | {bpt:,.0f} |")


def main():
    if os.environ.get("TABLE_ONLY") == "1":
        return table_only()
    from compressor.artifact import load_artifact
    from compressor.calib import load_text, sample_windows, tokenize
    from compressor.evaluate import perplexity, windows
    from compressor.source.open import load_model
    from compressor.source.resolve import resolve_source
    from compressor.quant.kv import (cache_kwarg, kv_bytes_per_token, kv_observer, make_spec, observed_absmax,
                                     quantized_cache, static_scales)

    torch.set_grad_enabled(False)
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    fp_model, tok = load_model(resolve_source("smollm2-135m"))
    eval_ids = tokenize(tok, load_text(str(DATA / "wikitext-2-raw" / "wiki.test.raw"), part="eval").text)
    wins = windows(eval_ids, 2048, WINDOWS)
    calib_ids = sample_windows(tokenize(tok, load_text(str(DATA / "wikitext-2" / "valid.txt"), part="calib").text), CALIB, 512, 0)
    cfg = fp_model.config
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    def evaluate(model, weights_label):
        absmax = None
        base_out = RESULTS / f"{TAG}kv-{weights_label}-none.json"
        if base_out.exists():
            base = json.loads(base_out.read_text())
        else:
            print(f"kv bench: {weights_label} / float KV ...", flush=True)
            base = perplexity(model, wins)
            base_out.write_text(json.dumps(base, indent=2) + "\n")
        for label, scheme, strategy, gs, res in SCHEMES:
            out = RESULTS / f"{TAG}kv-{weights_label}-{scheme}-{strategy}-g{gs}-r{res}.json"
            spec = make_spec(scheme, strategy, gs, res)
            if out.exists():
                r = json.loads(out.read_text())
            else:
                print(f"kv bench: {weights_label} / {label} ...", flush=True)
                scales = None
                if spec.static:
                    if absmax is None:
                        obs = kv_observer(shape[0])
                        for b in calib_ids.split(8):
                            model(b, use_cache=True, **{cache_kwarg(model): obs})
                        absmax = observed_absmax(obs)
                    scales = {i: (static_scales(k, spec).half().float(), static_scales(v, spec).half().float())
                              for i, (k, v) in absmax.items()}
                t0 = time.perf_counter()
                r = perplexity(model, wins, make_cache=lambda: quantized_cache(spec, shape[0], scales), kv_chunk=128)
                r["eval_seconds"] = round(time.perf_counter() - t0, 1)
                out.write_text(json.dumps(r, indent=2) + "\n")
            rows.append((weights_label, label, r["ppl"], base["ppl"], kv_bytes_per_token(spec, *shape)))
        rows.append((weights_label, "float KV (fp16 accounting)", base["ppl"], base["ppl"], kv_bytes_per_token(None, *shape)))
        return base

    fp_base = evaluate(fp_model, "fp32")
    del fp_model
    awq_dir = ROOT / "bench" / "work" / "awq-w4g64"
    if awq_dir.is_dir():
        awq_model, _ = load_artifact(awq_dir)
        evaluate(awq_model, "awq-w4g64")
    else:
        print(f"kv bench: {awq_dir} missing (run bench/run_bench.py first); AWQ rows skipped")

    print(f"\neval: wiki.test.raw, first {WINDOWS} windows of 2048, KV chunked prefill of 128 tokens; "
          f"calibration for static scales {CALIB} x 512 (wikitext-2 valid)\n")
    print("| weights | KV cache | perplexity | vs same weights, float KV | vs FP32 model | KV bytes/token |")
    print("| --- | --- | --- | --- | --- | --- |")
    for w, label, ppl, base, bpt in rows:
        print(f"| {w} | {label} | {ppl:.3f} | {(ppl / base - 1) * 100:+.2f} % | {(ppl / fp_base['ppl'] - 1) * 100:+.2f} % | {bpt:,.0f} |")


if __name__ == "__main__":
    main()
