"""Routed experts owned per rank (issue #44): per-rank peak RSS and bytes read from the source,
one process against two ``torchrun`` ranks, on a synthetic Kimi-width block-FP8 source.

The source is bench/scale_bench.py's ``kimi-fp8-64e`` (DeepSeek-V3 layout at Kimi K2's widths:
hidden 7168, MLA, 64 routed experts 2048 wide + 1 shared, 8 routed per token; a dense first layer
18432 wide and two MoE layers; ``float8_e4m3fn`` weights with 128 x 128 block scales). Each run is
``kvq quantize SRC --recipe w4a16-gptq --calib wikitext-2 ... --threads 1 --json`` -- alone for one
process, under ``torchrun --nproc-per-node 2`` for two ranks -- and its figures come from the
summary: ``source_bytes_read`` / ``routed_expert_bytes_read`` / ``peak_rss_mib`` (VmHWM) of the
process, and for two ranks rank 0's ``ranks`` list (each rank's, at the end of the layer pass).
The two artifacts are compared tensor digest by tensor digest.

Usage: python bench/dist_experts.py [--ranks 1,2] [--calib-samples 8] [--calib-seqlen 128]
          [--memory-budget-gib 2] [--work DIR] [--keep]
Writes bench/results/dist_experts.json and prints the table for BENCHMARKS.md; removes the
artifacts (and, without ``--keep``, the generated source) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import scale_bench  # noqa: E402

SIZE = "kimi-fp8-64e"
RESULTS = ROOT / "bench" / "results" / "dist_experts.json"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(src: Path, out: Path, ranks: int, a) -> dict:
    """One quantize with ``ranks`` processes; returns its figures."""
    kvq = ["-m", "compressor", "quantize", str(src), "--recipe", "w4a16-gptq",
           "--calib", str(scale_bench.DATA / "wikitext-2" / "valid.txt"), "--calib-samples", str(a.calib_samples),
           "--calib-seqlen", str(a.calib_seqlen), "--memory-budget-gib", str(a.memory_budget_gib), "--threads", "1",
           "-o", str(out), "--overwrite", "--json"]
    launch = [sys.executable] if ranks == 1 else [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node",
                                                   str(ranks), "--master-port", str(_port()), "--no-python",
                                                   sys.executable]
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    p = subprocess.run(launch + kvq, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"dist-experts: {ranks} rank(s) failed ({p.returncode}): {p.stderr.strip()[-3000:]}")
    s = json.loads(p.stdout[p.stdout.index("{"):])
    per_rank = s.get("ranks") or [{"rank": 0, **{k: s[k] for k in ("source_bytes_read", "routed_expert_bytes_read",
                                                                    "peak_rss_mib")}}]
    return {"ranks": ranks, "command": " ".join(launch[1:] + kvq).replace(str(ROOT) + "/", ""), "per_rank": per_rank,
            "rank0_final": {k: s[k] for k in ("source_bytes_read", "routed_expert_bytes_read", "peak_rss_mib")},
            "wall_seconds_not_a_figure": round(wall, 1), "content_digest": s["content_digest"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument("--calib-seqlen", type=int, default=128)
    ap.add_argument("--memory-budget-gib", type=float, default=2.0)
    ap.add_argument("--work", default=str(ROOT / "bench" / "work" / "dist"))
    ap.add_argument("--keep", action="store_true", help="keep the generated source")
    a = ap.parse_args()
    if not (scale_bench.TOKENIZER / "tokenizer.json").exists():
        scale_bench.write_tokenizer()
    work = Path(a.work)
    src = work / f"synthetic-{SIZE}"
    model_type, kw = scale_bench.SIZES[SIZE]
    n = scale_bench.generate(src, model_type, kw)
    source_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"dist-experts: {n / 1e9:.2f} B parameters, {source_bytes / 2**30:.2f} GiB in {src}", flush=True)
    rows, digests = [], {}
    try:
        for ranks in [int(r) for r in a.ranks.split(",")]:
            out = work / f"out-{ranks}"
            rows.append(run(src, out, ranks, a))
            sys.path.insert(0, str(ROOT))
            from compressor.manifest import load_manifest

            digests[ranks] = {k: t.digest for k, t in load_manifest(out).tensors.items()}
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        if not a.keep:
            shutil.rmtree(src, ignore_errors=True)
    first = next(iter(digests.values()))
    same = {r: sum(first[k] == d.get(k) for k in first) for r, d in digests.items()}
    res = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
           "source": f"{SIZE}: {n / 1e9:.2f} B parameters, {source_bytes} bytes (block FP8)",
           "calibration": f"{a.calib_samples} x {a.calib_seqlen}", "memory_budget_gib": a.memory_budget_gib,
           "tensors": len(first), "tensors_equal_to_first_run": same, "rows": rows}
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    print("| ranks | rank | source bytes read (GiB) | routed experts' bytes read (GiB) | peak RSS (MiB) |")
    print("|---|---|---|---|---|")
    for r in rows:
        for p in r["per_rank"]:
            print(f"| {r['ranks']} | {p['rank']} | {p['source_bytes_read'] / 2**30:.2f} "
                  f"| {p['routed_expert_bytes_read'] / 2**30:.2f} | {p['peak_rss_mib']:,.0f} |")
    print(f"tensors equal to the first run's: {same} of {len(first)}")


if __name__ == "__main__":
    main()
