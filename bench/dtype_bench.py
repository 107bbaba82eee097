"""Storage dtype and verify memory on SmolLM2-135M (issues #21 and #22).

Steps, each its own process, one at a time (peak RSS from ``os.wait4`` of that child):
  1. ``kvq quantize smollm2-135m --recipe w4a16-awq --dtype D`` for D in float16, bfloat16,
     float32 (calibration SAMPLES x 512 of wikitext-2 valid, seed 0);
  2. ``kvq verify`` of each artifact on the first WINDOWS windows of wiki.test.raw, in the
     dtype the artifact declares, and the bfloat16 artifact once more with ``--eval-dtype
     float32`` (the difference is the cost of serving in bf16);
  3. with ``BEFORE=<git dir>`` (a checkout of the commit before chunked statistics, e.g.
     92a67f0, via ``git worktree add``): the same verify of the float32 artifact with that
     checkout's code (``PYTHONPATH``) beside today's, for verify's peak RSS and wall time.

Writes bench/results/dtype_bench.json and prints the tables for BENCHMARKS.md. Existing
step results are reused (delete the JSON to rerun). ``WINDOWS`` (default 4), ``SAMPLES``
(default 8).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
WORK = ROOT / "bench" / "work" / "dtype"
RESULTS = ROOT / "bench" / "results" / "dtype_bench.json"
WINDOWS = os.environ.get("WINDOWS", "4")
SAMPLES = os.environ.get("SAMPLES", "8")
#: verify's extras kept short: greedy drift over 8 new tokens, hidden-state error on one window
VERIFY_EXTRA = ["--max-new-tokens", "8", "--hidden-batches", "1"]
KVQ = [sys.executable, "-m", "compressor"]


def run(cmd: list[str], log: Path, env: dict | None = None, cwd: Path = ROOT) -> dict:
    """Run ``cmd`` as a child in ``cwd``; wall seconds and that child's own peak RSS (MiB).
    (``python -m`` puts ``cwd`` first on ``sys.path``: the checkout whose code runs.)"""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                             env={**os.environ, "TQDM_DISABLE": "1", **(env or {})})
        _, status, usage = os.wait4(p.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"step failed ({code}): {' '.join(cmd)}; see {log}")
    return {"wall_seconds": round(time.perf_counter() - t0, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    res = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    calib = DATA / "wikitext-2" / "valid.txt"
    text = DATA / "wikitext-2-raw" / "wiki.test.raw"
    for d in ("float16", "bfloat16", "float32"):
        out = WORK / f"awq-{d}"
        if f"quantize-{d}" not in res:
            print(f"dtype_bench: quantize {d} ...", flush=True)
            t = run(KVQ + ["quantize", "smollm2-135m", "--recipe", "w4a16-awq", "--dtype", d, "--calib", str(calib),
                           "--calib-samples", SAMPLES, "--calib-seqlen", "512", "-o", str(out), "--overwrite"],
                    WORK / f"quantize-{d}.log")
            man = json.loads((out / "kvq-manifest.json").read_text())
            q = man["quality"]
            errs = [f["output_rel_error"] for f in q["layers"] if f.get("output_rel_error") is not None]
            t["mean_weight_rel_error"] = q["mean_rel_error"]
            t["mean_output_rel_error"] = round(sum(errs) / len(errs), 6) if errs else None
            res[f"quantize-{d}"] = t
            RESULTS.write_text(json.dumps(res, indent=2) + "\n")
        variants = [("auto", [])] + ([("float32", ["--eval-dtype", "float32"])] if d == "bfloat16" else [])
        for tag, extra in variants:
            key = f"verify-{d}-eval-{tag}"
            if key in res:
                continue
            print(f"dtype_bench: {key} ...", flush=True)
            rep = WORK / f"{key}.json"
            t = run(KVQ + ["verify", str(out), "--eval", str(text), "--max-windows", WINDOWS, "--json-out", str(rep),
                           *VERIFY_EXTRA, *extra], WORK / f"{key}.log")
            r = json.loads(rep.read_text())
            t.update(perplexity=r["perplexity"], distribution=r["distribution"], evaluated_in=r["evaluated_in"])
            res[key] = t
            RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    before = os.environ.get("BEFORE")
    if before:
        for tag, path in (("before", before), ("after", str(ROOT))):
            key = f"verify-memory-{tag}"
            if key in res:
                continue
            print(f"dtype_bench: {key} ...", flush=True)
            rep = WORK / f"{key}.json"
            t = run(KVQ + ["verify", str(WORK / "awq-float32"), "--eval", str(text), "--max-windows", WINDOWS,
                           "--json-out", str(rep), *VERIFY_EXTRA], WORK / f"{key}.log", env={"PYTHONPATH": path},
                    cwd=Path(path))
            t["perplexity"] = json.loads(rep.read_text())["perplexity"]
            res[key] = t
            RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
