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

Usage: python bench/dist_experts.py [--launches 1,2,2n] [--recipe w4a16-gptq] [--calib-samples 8]
          [--calib-seqlen 128] [--memory-budget-gib 2] [--work DIR] [--src DIR] [--keep] [--alone] [--extra FLAGS]
``--launches``: the runs in order, each ``1`` (one process), ``2`` (``torchrun --nproc-per-node 2``) or ``2n``
(two ``torchrun --nnodes 2 --nproc-per-node 1`` launches on this machine, node ranks 0 and 1, as two machines
would run it); repeat entries (``1,2,2,1``) for alternating pairs. ``--src`` reuses a generated source (kept).
``--alone``: the machine ran nothing else, so the wall times are figures (``wall_seconds``; otherwise they are
recorded as ``wall_seconds_not_a_figure``).
Writes bench/results/dist_experts[-RECIPE].json and prints the table for BENCHMARKS.md; removes the
artifacts (and, without ``--keep`` or ``--src``, the generated source) at the end.
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


def _parameters(src: Path) -> int:
    """Elements stored in ``src``'s safetensors shards (from their headers; block scales included)."""
    import math
    import struct

    n = 0
    for f in src.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        n += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return n


def _torchrun(nproc: int, extra: list[str]) -> list[str]:
    return [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(nproc), *extra, "--no-python",
            sys.executable]


def run(src: Path, out: Path, launch: str, a) -> dict:
    """One quantize launched as ``launch`` (``1``, ``2`` or ``2n``); returns its figures."""
    kvq = ["-m", "compressor", "quantize", str(src), "--recipe", a.recipe,
           "--calib", str(scale_bench.DATA / "wikitext-2" / "valid.txt"), "--calib-samples", str(a.calib_samples),
           "--calib-seqlen", str(a.calib_seqlen), "--memory-budget-gib", str(a.memory_budget_gib), "--threads", "1",
           "-o", str(out), "--overwrite", "--json", *a.extra.split()]
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    port = str(_port())
    if launch == "1":
        cmds = [[sys.executable] + kvq]
    elif launch == "2":
        cmds = [_torchrun(2, ["--master-port", port]) + kvq]
    else:  # two "nodes": node rank 0 and node rank 1, one rank each, meeting at 127.0.0.1
        cmds = [_torchrun(1, ["--nnodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1",
                              "--master-port", port]) + kvq for r in (0, 1)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for c in cmds]
    outs = [p.communicate() for p in procs]
    wall = time.perf_counter() - t0
    failed = [(k, p.returncode, err) for k, (p, (_, err)) in enumerate(zip(procs, outs)) if p.returncode != 0]
    if failed:
        sys.exit("\n".join(f"dist-experts: launch {launch}, launcher {k} failed ({rc}): {err.strip()[-3000:]}"
                           for k, rc, err in failed))
    stdout = outs[0][0]
    s = json.loads(stdout[stdout.index("{"):])
    per_rank = s.get("ranks") or [{"rank": 0, **{k: s[k] for k in ("source_bytes_read", "routed_expert_bytes_read",
                                                                    "peak_rss_mib")}}]
    shown = [" ".join(c[c.index("-m") - 1 if launch == "1" else 0:]).replace(str(ROOT) + "/", "") for c in cmds]
    return {"launch": launch, "ranks": 1 if launch == "1" else 2, "commands": shown, "per_rank": per_rank,
            "rank0_final": {k: s[k] for k in ("source_bytes_read", "routed_expert_bytes_read", "peak_rss_mib")},
            ("wall_seconds" if a.alone else "wall_seconds_not_a_figure"): round(wall, 1),
            "content_digest": s["content_digest"]}


def run_arguments(description: str, launches: str, calib_samples: int, calib_seqlen: int, budget_gib: float,
                  work: str) -> argparse.ArgumentParser:
    """The options :func:`run` reads (launches, recipe, calibration, budget, extra flags), with these defaults."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--launches", default=launches)
    ap.add_argument("--recipe", default="w4a16-gptq")
    ap.add_argument("--extra", default="", help="more kvq quantize flags (space separated)")
    ap.add_argument("--alone", action="store_true", help="nothing else ran: the wall times are figures")
    ap.add_argument("--calib-samples", type=int, default=calib_samples)
    ap.add_argument("--calib-seqlen", type=int, default=calib_seqlen)
    ap.add_argument("--memory-budget-gib", type=float, default=budget_gib)
    ap.add_argument("--work", default=str(ROOT / "bench" / "work" / work))
    return ap


def main() -> None:
    ap = run_arguments(__doc__.splitlines()[0], "1,2,2n", 8, 128, 2.0, "dist")
    ap.add_argument("--src", default="", help="an already generated kimi-fp8-64e source (kept)")
    ap.add_argument("--keep", action="store_true", help="keep the generated source")
    a = ap.parse_args()
    if not (scale_bench.TOKENIZER / "tokenizer.json").exists():
        scale_bench.write_tokenizer()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    src = Path(a.src) if a.src else work / f"synthetic-{SIZE}"
    if a.src:
        a.keep = True
        n = _parameters(src)
    else:
        model_type, kw = scale_bench.SIZES[SIZE]
        n = scale_bench.generate(src, model_type, kw)
    source_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"dist-experts: {n / 1e9:.2f} B parameters, {source_bytes / 2**30:.2f} GiB in {src}", flush=True)
    rows, digests = [], {}
    try:
        for j, launch in enumerate(a.launches.split(",")):
            out = work / f"out-{launch}"
            rows.append(run(src, out, launch, a))
            sys.path.insert(0, str(ROOT))
            from compressor.manifest import load_manifest

            digests[f"{j}:{launch}"] = {k: t.digest for k, t in load_manifest(out).tensors.items()}
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
    results = RESULTS if a.recipe == "w4a16-gptq" else RESULTS.with_name(f"dist_experts-{a.recipe}.json")
    res["recipe"] = a.recipe
    results.write_text(json.dumps(res, indent=2) + "\n")
    print("| launch | rank | source bytes read (GiB) | routed experts' bytes read (GiB) | peak RSS (MiB) |")
    print("|---|---|---|---|---|")
    for r in rows:
        for p in r["per_rank"]:
            print(f"| {r['launch']} | {p['rank']} | {p['source_bytes_read'] / 2**30:.2f} "
                  f"| {p['routed_expert_bytes_read'] / 2**30:.2f} | {p['peak_rss_mib']:,.0f} |")
    print(f"tensors equal to the first run's: {same} of {len(first)}")


if __name__ == "__main__":
    main()
