"""Decode speed and memory of the bundled runtime vs transformers on the float model (issue #6).

Same run, same prompts (kvq's 8 built-in prompts; batch 1 uses the first), greedy,
MAX_NEW tokens after a short warm-up; every engine x batch in its own process so peak RSS
(ru_maxrss) is that engine's alone. Decode tokens/s counts the tokens produced after the
first one (the first comes out of prefill), summed over the batch.

Engines:
* kvq runtime on ARTIFACT (default the `make demo` artifact: AWQ W4 g64 + fp8 KV), backend auto
  (CPU: aten int4 op for 4-bit layers), compute dtype auto (what `kvq serve` uses: bfloat16 for
  a bfloat16 artifact), KV cache in the artifact's scheme;
* the same in float32 compute (``kvq serve --dtype float32``);
* kvq runtime, backend dequant (dequantize-then-matmul fallback), same artifact;
* transformers `generate` on the float32 reference model (the manifest's source).

Also: KV bytes per token of the runtime's cache for each scheme. Results:
bench/results/serve_bench.json (env RESULT: another name). Usage: python bench/serve_bench.py
[--one ENGINE BATCH] (env ARTIFACT, MAX_NEW (at least 2), RESULT, THREADS (torch's threads; default
one per usable CPU), ENGINES: a comma-separated subset of kvq-auto, kvq-float32, kvq-dequant,
transformers-fp32). ``--one ENGINE BATCH`` (BATCH 1-8) measures one engine in this process. Decode figures
taken while other jobs keep the CPUs busy are not figures: the script says so when the 1-minute
load average is at least the CPU count minus one half.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from compressor.tokens import bos_token_id, encode  # noqa: E402 - after the repository is on sys.path
ART = Path(os.environ.get("ARTIFACT", ROOT / ".kvq-demo" / "smollm2-w4a16-awq"))
RESULT = os.environ.get("RESULT", "serve_bench.json")  # file name under bench/results
ALL_ENGINES = ("kvq-auto", "kvq-float32", "kvq-dequant", "transformers-fp32")
ENGINES = os.environ.get("ENGINES", ",".join(ALL_ENGINES)).split(",")


def _int_env(name: str, default: int, least: int) -> int:
    raw = os.environ.get(name, str(default))
    if not raw.strip().isdigit() or int(raw) < least:
        raise SystemExit(f"serve_bench: {name} must be an integer of at least {least}, got {raw!r}")
    return int(raw)


MAX_NEW = _int_env("MAX_NEW", 64, 2)  # decode speed counts the tokens after the first: at least one
THREADS = _int_env("THREADS", 0, 0)  # 0: torch's default


def _rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(engine: str, batch: int) -> dict:
    import torch

    if THREADS:
        torch.set_num_threads(THREADS)
    from compressor.prompts import BUILTIN_PROMPTS

    prompts = list(BUILTIN_PROMPTS[:batch])
    if engine.startswith("kvq"):
        from transformers import AutoTokenizer

        from compressor.runtime import Runtime

        backend = "dequant" if engine == "kvq-dequant" else "auto"
        dtype = torch.float32 if engine == "kvq-float32" else None  # None: the commands' default (auto)
        rt = Runtime.from_artifact(ART, backend=backend, kv="artifact", dtype=dtype)
        tok = AutoTokenizer.from_pretrained(str(ART))
        ids = [encode(tok, p) for p in prompts]  # the tokenizer's BOS rule, as kvq serve encodes
        rt.generate(ids, max_new_tokens=4)  # warm-up
        res = rt.generate(ids, max_new_tokens=MAX_NEW)
        d = rt.describe()
        return {"engine": engine, "batch": batch, "prefill_tokens_per_s": res.prefill_tokens_per_s,
                "decode_tokens_per_s": res.decode_tokens_per_s, "peak_rss_mib": _rss(),
                "kernels": d["kernels"], "kv_scheme": d["kv_scheme"], "kv_bytes_per_token": d["kv_bytes_per_token"],
                "weight_bytes": d["weight_bytes"], "threads": torch.get_num_threads(), "dtype": d["dtype"]}
    from transformers import AutoTokenizer

    from compressor.manifest import load_manifest
    from compressor.source.open import load_model
    from compressor.source.resolve import resolve_source

    model, _ = load_model(resolve_source(load_manifest(ART).source["spec"]))
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(ART))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=bos_token_id(tok) is not None)

    def gen(n):
        with torch.inference_mode():
            t = time.perf_counter()
            model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1,
                           pad_token_id=tok.pad_token_id)
            return time.perf_counter() - t

    gen(4)  # warm-up
    t1 = min(gen(1) for _ in range(2))  # prefill + first token
    tn = gen(MAX_NEW)
    prompt_tokens = int(enc.attention_mask.sum())
    return {"engine": engine, "batch": batch, "prefill_tokens_per_s": prompt_tokens / t1,
            "decode_tokens_per_s": (MAX_NEW - 1) * batch / (tn - t1), "peak_rss_mib": _rss(),
            "kv_scheme": "none (fp32 DynamicCache)", "threads": torch.get_num_threads()}


def kv_bytes() -> list[dict]:
    from compressor.runtime import Runtime

    out = []
    for kv in ("none", "artifact", "int8", "int4", "int2"):
        try:
            d = Runtime.from_artifact(ART, kv=kv).describe()
        except Exception as e:  # noqa: BLE001 - reported
            out.append({"kv": kv, "error": str(e)})
            continue
        out.append({"kv": kv, "scheme": d["kv_scheme"], "bytes_per_token": d["kv_bytes_per_token"],
                    "fixed_bytes_per_sequence": d["kv_fixed_bytes_per_sequence"]})
    return out


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return
    bad = [e for e in ENGINES if e not in ALL_ENGINES] + ([args[1]] if len(args) == 3 and args[1] not in ALL_ENGINES else [])
    if bad:
        raise SystemExit(f"serve_bench: unknown engine {bad[0]!r} (known: {', '.join(ALL_ENGINES)})")
    if args and not (len(args) == 3 and args[0] == "--one" and args[2].isdigit() and 1 <= int(args[2]) <= 8):
        raise SystemExit(f"serve_bench: usage: python bench/serve_bench.py [--one ENGINE BATCH] (BATCH 1-8; --help); "
                         f"got {' '.join(args)!r}")
    if not (ART / "kvq-manifest.json").exists():
        raise SystemExit(f"serve_bench: {ART} is not a kvq artifact: run `make demo` first or set ARTIFACT")
    if args:
        print(json.dumps(one(args[1], int(args[2]))))
        return
    from compressor.commands.common import cpu_threads

    busy = cpu_threads(THREADS or None)[1]
    if busy:
        print(f"serve_bench: note: {busy}; the decode figures of this run are not figures", file=sys.stderr)
    rows = []
    for engine in ENGINES:
        for batch in (1, 8):
            p = subprocess.run([sys.executable, __file__, "--one", engine, str(batch)], capture_output=True, text=True,
                               env={**os.environ, "TQDM_DISABLE": "1"})
            if p.returncode != 0:
                raise SystemExit(f"{engine} batch {batch} failed: {p.stderr[-2000:]}")
            rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    res = {"artifact": str(ART), "max_new_tokens": MAX_NEW, "rows": rows, "kv_bytes": kv_bytes(), "busy_note": busy}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / RESULT).write_text(json.dumps(res, indent=2) + "\n")
    print("| engine | batch | prefill tokens/s | decode tokens/s | peak RSS (MiB) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['batch']} | {r['prefill_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} "
              f"| {r['peak_rss_mib']:.0f} |")
    for k in res["kv_bytes"]:
        print(k)


if __name__ == "__main__":
    main()
