"""Weight-quantization benchmark on SmolLM2-135M: FP / RTN / AWQ / GPTQ (W4, W3, mixed).

Runs each step as its own process (so peak RSS is per step), one at a time:
  1. perplexity of the float model (GGUF dequantized to float32)
  2. kvq quantize with RTN and with AWQ (calibration 128 x 512 from wikitext-2 valid)
  3. perplexity of each artifact (kvq's loader, dequantized, float32 compute)
Writes bench/results/<step>.json and prints a Markdown table for BENCHMARKS.md.
Existing result files are reused (delete them to rerun). QUICK=1: 16 x 512 calibration, 8 windows.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "bench" / "work"
DATA = ROOT.parent / "shared" / "data"
QUICK = os.environ.get("QUICK") == "1"
SAMPLES = 16 if QUICK else 128
# the float model is evaluated on all 147 windows (the cross-check); artifacts on the first
# BENCH_WINDOWS windows (default all; on 2 cores each full pass takes about 25 minutes)
FP_WINDOWS = ["--max-windows", "8"] if QUICK else []
WINDOWS = ["--max-windows", "8"] if QUICK else (["--max-windows", os.environ["BENCH_WINDOWS"]] if os.environ.get("BENCH_WINDOWS") else [])
TAG = "quick-" if QUICK else ""
KVQ = [str(Path(sys.executable).with_name("kvq"))]


def timed(cmd: list[str], log: Path) -> dict:
    """Run cmd; return wall seconds and the child's peak RSS (MiB)."""
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "TQDM_DISABLE": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if p.returncode != 0:
        sys.exit(f"step failed ({p.returncode}): {' '.join(cmd)}; see {log}")
    return {"wall_seconds": round(time.perf_counter() - t0, 1), "peak_rss_mib": round(max(after, before) / 1024, 1)}


def step(name: str, fn):
    out = RESULTS / f"{TAG}{name}.json"
    if out.exists():
        return json.loads(out.read_text())
    print(f"bench: {name} ...", flush=True)
    res = fn()
    out.write_text(json.dumps(res, indent=2) + "\n")
    return res


def ppl(model: str, name: str, windows=None) -> dict:
    out = WORK / f"{TAG}{name}-ppl.json"
    t = timed([sys.executable, str(ROOT / "bench" / "eval_ppl.py"), model, "--eval", str(DATA / "wikitext-2-raw" / "wiki.test.raw"),
               *(WINDOWS if windows is None else windows), "--out", str(out)], WORK / f"{TAG}{name}-ppl.log")
    return {**json.loads(out.read_text()), **{"eval_" + k: v for k, v in t.items()}}


def quantize(recipe: str, name: str, extra: tuple = ()) -> dict:
    art = WORK / f"{TAG}{name}"
    cmd = [*KVQ, "quantize", "smollm2-135m", "--recipe", recipe, *extra, "--calib", str(DATA / "wikitext-2" / "valid.txt"),
           "--calib-samples", str(SAMPLES), "--calib-seqlen", "512", "-o", str(art), "--overwrite", "--json"]
    log = WORK / f"{TAG}{name}-quantize.log"
    t = timed(cmd, log)
    text = log.read_text()
    summary = json.loads(text[text.index("{"):])
    return {"command": " ".join(cmd[1:]), **t, "summary": summary, "artifact": str(art)}


# (recipe, result name, extra kvq quantize flags); BENCH_RUNS=name1,name2 selects some
RUNS = [
    ("w4a16-rtn-g64", "rtn-w4g64", ()),
    ("w4a16-awq", "awq-w4g64", ()),
    ("w4a16-gptq", "gptq-w4g64", ()),
    ("w4a16-gptq", "gptq-w4g64-noact", ("--no-act-order",)),
    ("w3a16-gptq-g64", "gptq-w3g64", ()),
    ("w4a16-mixed", "gptq-mixed", ()),
]


def main():
    RESULTS.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    fp = step("ppl-fp32", lambda: ppl("smollm2-135m", "fp32", FP_WINDOWS))
    rows = [("FP32 (GGUF dequantized)", fp, None)]
    runs = [(recipe, name, extra) for recipe, name, extra in RUNS
            if not os.environ.get("BENCH_RUNS") or name in os.environ["BENCH_RUNS"].split(",")]
    # all quantize runs first (their wall time and RSS are the figures that matter), then evaluations
    qs = {name: step(f"quantize-{name}", lambda r=recipe, n=name, e=extra: quantize(r, n, e)) for recipe, name, extra in runs}
    for recipe, name, extra in runs:
        p = step(f"ppl-{name}", lambda n=name: ppl(qs[n]["artifact"], n))
        rows.append((" ".join([recipe, *extra]), p, qs[name]))
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    print(f"\nmachine: {machine}; eval: wiki.test.raw, seqlen 2048; calibration {SAMPLES} x 512\n")
    print("| model | windows | perplexity | FP32 on the same windows | vs FP | quantize wall (s) | quantize peak RSS (MiB) | artifact (MiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, p, q in rows:
        n = p["windows"]
        fp_same = math.exp(sum(math.log(x) for x in fp["per_window_ppl"][:n]) / n)
        d = "" if q is None else f"{(p['ppl'] / fp_same - 1) * 100:+.2f} %"
        size = f"{q['summary']['artifact_bytes'] / 2**20:.1f}" if q else f"{q_float(rows):.1f} (float32)"
        print(f"| {label} | {n} | {p['ppl']:.3f} | {fp_same:.3f} | {d} | {q['wall_seconds'] if q else ''} | "
              f"{q['summary']['peak_rss_mib'] if q else ''} | {size} |")


def q_float(rows) -> float:
    for _, _, q in rows:
        if q:
            return q["summary"]["float32_bytes"] / 2**20
    return 0.0


if __name__ == "__main__":
    main()
