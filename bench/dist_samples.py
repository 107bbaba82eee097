"""Calibration batches divided across ranks (issue #44, compressor/sample_ranks.py): one process
against two ``torchrun`` ranks on a dense model, GPTQ W4.

Each run is ``kvq quantize MODEL --recipe R --calib wikitext-2 valid --calib-samples N --calib-seqlen T
--threads 1 --json`` (bench/dist_experts.py's launcher: alone for one process, ``torchrun
--nproc-per-node 2`` for two ranks, or two ``--nnodes 2`` launches); the figures are the summary's
(per rank: peak RSS as VmHWM, ``calibration_batches`` of ``of_batches``, ``layers_divided``,
``hessian_pass_forwards``) and the artifacts are compared tensor digest by tensor digest. The wall
times printed are whole launches; quote them only from runs on an otherwise idle machine, paired
in alternating order.

Usage: python bench/dist_samples.py [--model smollm2-135m] [--launches 1,2] [--recipe w4a16-gptq]
          [--calib-samples 32] [--calib-seqlen 512] [--extra FLAGS] [--alone]
Writes bench/results/dist_samples.json.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import dist_experts  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "dist_samples.json"


def main() -> None:
    ap = dist_experts.run_arguments(__doc__.splitlines()[0], "1,2", 32, 512, 8.0, "dist-samples")
    ap.add_argument("--model", default="smollm2-135m")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rows, digests = [], {}
    from compressor.manifest import load_manifest

    for j, launch in enumerate(a.launches.split(",")):
        out = work / f"out-{launch}"
        rows.append(dist_experts.run(Path(a.model), out, launch, a))
        digests[f"{j}:{launch}"] = {k: t.digest for k, t in load_manifest(out).tensors.items()}
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    first = next(iter(digests.values()))
    same = {r: sum(first[k] == d.get(k) for k in first) for r, d in digests.items()}
    res = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
           "model": a.model, "recipe": a.recipe, "calibration": f"{a.calib_samples} x {a.calib_seqlen}",
           "tensors": len(first), "tensors_equal_to_first_run": same, "rows": rows}
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    print("| launch | rank | batches held | layers divided | Hessian-pass forwards | peak RSS (MiB) | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        wall = r.get("wall_seconds", r.get("wall_seconds_not_a_figure"))
        for p in r["per_rank"]:
            print(f"| {r['launch']} | {p['rank']} | {p.get('calibration_batches', '-')} of {p.get('of_batches', '-')} "
                  f"| {p.get('layers_divided', '-')} | {p.get('hessian_pass_forwards', '-')} "
                  f"| {p['peak_rss_mib']:,.0f} | {wall} |")
    print(f"tensors equal to the first run's: {same} of {len(first)}")


if __name__ == "__main__":
    main()
