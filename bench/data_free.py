"""Data-free conversion against the speed of the disk (issue #44): `kvq quantize --workers N` with
a data-free recipe (default w4a16-rtn-g64) on a synthetic source of bench/scale_bench.py, beside
`cat` of the same shard files to /dev/null.

Order, the same conditions for every row: `cat` of the source's files twice (the first pass
brings them into the page cache when it can hold them; the second is the baseline), then
`kvq quantize SRC --recipe R --workers N -o OUT --json` for each N, each artifact removed before
the next run. The page cache is warm for every row when the source fits in it: the script says
whether it does (the source's bytes against MemTotal). GB/s is the source's bytes on disk over
each command's wall seconds (kvq's whole command: start, reading, quantizing, writing the artifact,
hashing it); kvq's own figure (`source_bytes_read` / `wall_seconds` of its summary: every byte
it read, the embedding twice) is printed beside it. The ratio is kvq's GB/s over cat's.

Usage:
  python bench/data_free.py --src /work/scale/synthetic-kimi-fp8-64e [--workers 1,2] [--recipe w4a16-rtn-g64]
  python bench/data_free.py --size glm45-tiny --work /tmp/df   # generates synthetic-glm45-tiny there if missing
Writes bench/results/data_free-<source folder name>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_files(src: Path) -> list[Path]:
    """The files `cat` reads: every file of the source folder (shards, index, config, tokenizer)."""
    return sorted(p for p in src.iterdir() if p.is_file())


def timed_cat(files: list[Path]) -> float:
    t = time.perf_counter()
    with open(os.devnull, "wb") as null:
        subprocess.run(["cat", *map(str, files)], stdout=null, check=True)
    return time.perf_counter() - t


def mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def kvq(src: Path, out: Path, recipe: str, workers: int, extra: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "compressor", "quantize", str(src), "--recipe", recipe, "--workers", str(workers),
           "-o", str(out), "--json", *extra]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t
    if p.returncode:
        sys.exit(f"data_free: kvq failed (exit {p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    s = json.loads(p.stdout)
    shutil.rmtree(out, ignore_errors=True)
    return {"workers": workers, "command_seconds": round(wall, 2), "wall_seconds": s["wall_seconds"],
            "source_bytes_read": s["source_bytes_read"], "kvq_gb_per_s": s["source_gb_per_s"],
            "peak_rss_mib": s["peak_rss_mib"], "worker_reads": s["worker_reads"], "threads": s["threads"],
            "content_digest": s["content_digest"]}


def per_worker(row: dict) -> str:
    """Each worker's peak RSS (MiB), or ``-`` for one process."""
    return ", ".join(f"{w['peak_rss_mib']:,.0f}" for w in row["worker_reads"] or []) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", help="a synthetic source folder (bench/scale_bench.py's synthetic-<size>)")
    ap.add_argument("--size", help="a bench/scale_bench.py size, generated into --work when missing")
    ap.add_argument("--work", default=str(ROOT / "bench" / "work" / "scale"))
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--recipe", default="w4a16-rtn-g64")
    ap.add_argument("--extra", default="", help="more kvq quantize flags (space separated), e.g. --memory-budget-gib 2")
    a = ap.parse_args()
    if bool(a.src) == bool(a.size):
        sys.exit("data_free: give --src or --size")
    if a.src:
        src = Path(a.src)
    else:
        sys.path.insert(0, str(ROOT / "bench"))
        import scale_bench

        src = Path(a.work) / f"synthetic-{a.size}"
        if not (src / "config.json").is_file():
            model_type, kw = scale_bench.SIZES[a.size]
            if not kw.get("_tiny_tokenizer") and not (scale_bench.TOKENIZER / "tokenizer.json").exists():
                scale_bench.write_tokenizer()
            scale_bench.generate(src, model_type, kw)
    files = source_files(src)
    size = sum(p.stat().st_size for p in files)
    first = timed_cat(files)
    cat = timed_cat(files)
    warm = size < mem_total() * 0.8
    rows = [{"what": "cat", "seconds": round(cat, 2), "gb_per_s": float(f"{size / 1e9 / cat:.4g}"),
             "first_pass_s": round(first, 2)}]
    print(f"data_free: {src} ({size / 1e9:.3f} GB); cat: {first:.2f} s first pass, {cat:.2f} s second "
          f"({rows[0]['gb_per_s']} GB/s); page cache " + ("warm" if warm else "NOT warm: the source exceeds 80 % of "
                                                            "MemTotal") + " for every row", flush=True)
    out = Path(a.work) / f"data-free-out-{src.name}"
    for n in [int(w) for w in a.workers.split(",")]:
        r = kvq(src, out, a.recipe, n, a.extra.split())
        r.update(what=f"kvq --workers {n}", gb_per_s=float(f"{size / 1e9 / r['command_seconds']:.4g}"))
        r["ratio_to_cat"] = float(f"{r['gb_per_s'] / rows[0]['gb_per_s']:.4g}")
        rows.append(r)
        print(json.dumps(r), flush=True)
    digests = {r["content_digest"] for r in rows[1:]}
    res = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
           "source": str(src), "source_bytes": size, "recipe": a.recipe, "extra": a.extra, "page_cache_warm": warm,
           "same_artifact": len(digests) == 1, "rows": rows}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / f"data_free-{src.name}.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nsource {src.name}: {size / 1e9:.3f} GB, recipe {a.recipe}, page cache {'warm' if warm else 'not warm'}; "
          f"one artifact for every N: {len(digests) == 1}")
    print("| command | wall (s) | GB/s of source | ratio to cat | kvq's own GB/s (bytes read) | peak RSS main (MiB) "
          "| peak RSS per worker (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["what"] == "cat":
            print(f"| cat > /dev/null | {r['seconds']:.2f} | {r['gb_per_s']:.4g} | 1 | | | |")
        else:
            print(f"| {r['what']} | {r['command_seconds']:.2f} | {r['gb_per_s']:.4g} | {r['ratio_to_cat']:.4g} "
                  f"| {r['kvq_gb_per_s']} | {r['peak_rss_mib']:,.0f} | {per_worker(r)} |")


if __name__ == "__main__":
    main()
