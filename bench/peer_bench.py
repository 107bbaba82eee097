"""kvq vs llm-compressor on SmolLM2-135M, side by side (issue #8). `make bench` runs this.

Steps (each result is cached under bench/work/peer/steps/; delete that folder to rerun):

1. peer venv ``bench/.peers/llmcompressor`` (created if missing): torch==2.13.0 first, then
   llmcompressor (pinned, torch held by a constraints file), versions recorded;
2. inputs, written once with kvq's venv: the GGUF dequantized to a float32 safetensors
   folder (both tools read it), calibration token ids ``[SAMPLES, 512]`` from
   ``wikitext-2/valid.txt`` (seed 0; both tools get these exact ids: kvq through
   ``--calib ids.safetensors``, llm-compressor as a tokenized ``datasets.Dataset``),
   evaluation token ids (``wiki.test.raw``, windows of 2048);
3. quantize, W4A16 group 64 asymmetric, ``REPEATS`` rounds, the tool order alternating per
   round (A/B, B/A, ...; rounds after the first repeat ``REPEAT_ALGOS``, default GPTQ and
   RTN: llm-compressor's AWQ takes about 20 minutes per run on 2 CPU cores): GPTQ (act-order with static groups = llm-compressor actorder
   "weight", damp 0.01, block 128), AWQ (duo scaling, 20 grid points; kvq also searches
   clipping), RTN (the floor). Wall time of each whole process (start, load, calibrate,
   quantize, save) measured the same way by this driver, plus each tool's own quantize time;
4. perplexity of the float model and of every round-1 artifact with one shared script
   (``bench/eval_ids.py``, kvq's loader) on the first ``WINDOWS`` evaluation windows;
5. interop: kvq's artifacts through llm-compressor's loading path (transformers +
   compressed-tensors, peer venv) on ``INTEROP_WINDOWS`` windows, compared with kvq's
   figures on the same windows; llm-compressor's artifacts through
   ``kvq verify --no-manifest --weights-only`` (weight SQNR next to kvq's own);
6. hashing: ``kvq verify --hashes-only`` vs ``sha256sum`` vs ``model_signing verify`` on
   kvq's GPTQ artifact (signed with a throwaway key), median of 3.

Writes bench/results/peer/*.json (raw) and bench/results/peer_bench.json (summary) and
prints the Markdown table of BENCHMARKS.md. ``QUICK=1``: 16 x 512 calibration, 1 round,
2 evaluation windows, 1 interop window (about 20 minutes); full: 32 x 512, 2 rounds,
16 windows, 2 interop windows (a little over an hour on 2 cores). Env overrides: SAMPLES,
REPEATS, REPEAT_ALGOS, WINDOWS, INTEROP_WINDOWS.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = Path(os.environ.get("KVQ_DATA", ROOT.parent / "shared" / "data"))
QUICK = os.environ.get("QUICK") == "1"
TAG = "quick" if QUICK else "full"
SAMPLES = int(os.environ.get("SAMPLES", 16 if QUICK else 32))
SEQLEN = 512
REPEATS = int(os.environ.get("REPEATS", 1 if QUICK else 2))
# rounds after the first repeat these algorithms only: llm-compressor's AWQ grid search runs
# over every calibration token and takes about 20 minutes per run on 2 CPU cores
REPEAT_ALGOS = os.environ.get("REPEAT_ALGOS", "gptq,rtn").split(",")
WINDOWS = int(os.environ.get("WINDOWS", 2 if QUICK else 16))
INTEROP_WINDOWS = int(os.environ.get("INTEROP_WINDOWS", 1 if QUICK else 2))
WORK = ROOT / "bench" / "work" / "peer"
STEPS = WORK / "steps" / TAG
RESULTS = ROOT / "bench" / "results" / ("peer-quick" if QUICK else "peer")
PEER = ROOT / "bench" / ".peers" / "llmcompressor"
PEER_PY = PEER / "bin" / "python"
KVQ_PY = Path(sys.executable)
KVQ = KVQ_PY.with_name("kvq")
LLMC_VERSION = "0.14.0.1"
TORCH = "torch==2.13.0"
FLOAT = WORK / "smollm2-135m-f32"
CALIB = WORK / f"calib-{SAMPLES}x{SEQLEN}.safetensors"
EVAL = WORK / "eval-ids.safetensors"
ALGOS = ("gptq", "awq", "rtn")
KVQ_RECIPE = {"gptq": "w4a16-gptq", "awq": "w4a16-awq", "rtn": "w4a16-rtn-g64"}


def log(msg: str) -> None:
    print(f"peer-bench: {msg}", flush=True)


def run(cmd: list, logfile: Path, env: dict | None = None) -> float:
    """Run ``cmd`` (output to ``logfile``); return wall seconds. Exits on failure."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(logfile, "w") as f:
        p = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT,
                           env={**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", **(env or {})})
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        tail = "".join(logfile.read_text(errors="replace").splitlines(True)[-15:])
        sys.exit(f"peer-bench: step failed (exit {p.returncode}): {' '.join(map(str, cmd))}\n{tail}\n(log: {logfile})")
    return wall


def step(name: str, fn):
    """Cached step: ``STEPS/name.json``."""
    out = STEPS / f"{name}.json"
    if out.exists():
        return json.loads(out.read_text())
    log(f"{name} ...")
    res = fn()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    return res


def peer_venv() -> dict:
    if not PEER_PY.exists():
        log(f"creating {PEER} (torch 2.13.0 CPU, then llmcompressor {LLMC_VERSION}; a few minutes)")
        subprocess.run([sys.executable, "-m", "venv", str(PEER)], check=True)
        pip = [str(PEER_PY), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, TORCH], check=True)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as c:
            c.write(TORCH + "\n")  # llmcompressor may not move torch (never a CUDA build here)
        subprocess.run([*pip, f"llmcompressor=={LLMC_VERSION}", "-c", c.name], check=True)
        os.unlink(c.name)
    code = ("import json; from importlib.metadata import version as v; "
            "print(json.dumps({p: v(p) for p in ('llmcompressor', 'compressed-tensors', 'transformers', 'torch')}))")
    versions = json.loads(subprocess.run([str(PEER_PY), "-c", code], capture_output=True, text=True, check=True).stdout)
    if versions["torch"] != "2.13.0+cpu":
        sys.exit(f"peer-bench: {PEER} has torch {versions['torch']}, not 2.13.0+cpu; delete it and rerun")
    return versions


def prepare() -> None:
    """Float folder and token-id files (kvq's venv; done once)."""
    if FLOAT.joinpath("model.safetensors").exists() and CALIB.exists() and EVAL.exists():
        return
    log("writing the float32 model folder and the calibration/evaluation token ids")
    code = f"""
import torch
from safetensors.torch import save_file
from compressor.calib import load_text, sample_windows, tokenize
from compressor.source.open import load_model
from compressor.source.resolve import resolve_source
model, tok = load_model(resolve_source("smollm2-135m"))
model.save_pretrained({str(FLOAT)!r}); tok.save_pretrained({str(FLOAT)!r})
ids = sample_windows(tokenize(tok, load_text({str(DATA / 'wikitext-2' / 'valid.txt')!r}).text), {SAMPLES}, {SEQLEN}, 0)
save_file({{"input_ids": ids.contiguous()}}, {str(CALIB)!r})
ev = tokenize(tok, load_text({str(DATA / 'wikitext-2-raw' / 'wiki.test.raw')!r}).text)
n = ev.numel() // 2048
save_file({{"input_ids": ev[: n * 2048].view(n, 2048).contiguous()}}, {str(EVAL)!r})
"""
    run([KVQ_PY, "-c", code], WORK / "prepare.log")


def quantize(tool: str, algo: str, rnd: int) -> dict:
    out = WORK / f"{TAG}-{tool}-{algo}-r{rnd}"
    logfile = WORK / "logs" / f"{out.name}.log"
    if tool == "kvq":
        cmd = [KVQ, "quantize", FLOAT, "--recipe", KVQ_RECIPE[algo], "--calib", CALIB, "-o", out, "--overwrite", "--json"]
        wall = run(cmd, logfile)
        text = logfile.read_text()
        summary = json.loads(text[text.index("{\n"):])
        inner = summary["quantize_seconds"]
        rss, size = summary["peak_rss_mib"], summary["artifact_bytes"]
        extra = {"matmul_precision": summary.get("matmul_precision"), "threads": summary.get("threads")}
    else:
        extra = {}
        if out.exists():
            shutil.rmtree(out)
        js = WORK / "logs" / f"{out.name}.json"
        cmd = [PEER_PY, ROOT / "bench" / "peer_llmcompressor.py", "quantize", "--algo", algo, "--model", FLOAT,
               "--calib", CALIB, "--out", out, "--json", js]
        wall = run(cmd, logfile)
        summary = json.loads(js.read_text())
        inner, rss, size = summary["quantize_seconds"], summary["peak_rss_mib"], summary["artifact_bytes"]
    return {"tool": tool, "algo": algo, "round": rnd, "command": " ".join(map(str, cmd)), "wall_seconds": round(wall, 1),
            "quantize_seconds": inner, "peak_rss_mib": rss, "artifact_bytes": size, "artifact": str(out), **extra}


def perplexity(model: Path, name: str, windows: int, loader: str = "kvq") -> dict:
    js = WORK / "logs" / f"ppl-{TAG}-{name}-{loader}.json"
    py = KVQ_PY if loader == "kvq" else PEER_PY
    run([py, ROOT / "bench" / "eval_ids.py", model, "--ids", EVAL, "--loader", loader, "--max-windows", windows, "--out", js],
        WORK / "logs" / f"ppl-{TAG}-{name}-{loader}.log")
    return json.loads(js.read_text())


def verify_weights(art: Path, name: str, foreign: bool) -> dict:
    js = WORK / "logs" / f"verify-{TAG}-{name}.json"
    cmd = [KVQ, "verify", art, "--reference", FLOAT, "--weights-only", "--json-out", js]
    wall = run([*cmd, *(["--no-manifest"] if foreign else [])], WORK / "logs" / f"verify-{TAG}-{name}.log")
    r = json.loads(js.read_text())
    w = r["weights"]
    return {"command": " ".join(map(str, cmd)) + (" --no-manifest" if foreign else ""), "wall_seconds": round(wall, 1),
            "passed": r["passed"], "tensors": len(w["tensors"]), "min_sqnr_db": w["min_sqnr_db"],
            "median_sqnr_db": statistics.median(t["sqnr_db"] for t in w["tensors"]),
            "mean_rel_error": statistics.fmean(t["rel_fro"] for t in w["tensors"]), "warnings": r["warnings"]}


def hashing(art: Path) -> dict:
    """kvq verify --hashes-only vs sha256sum vs model_signing verify on one signed copy of ``art``."""
    import bench.hash_bench as hb
    from compressor.commands.sign import run_sign
    from compressor.signing import SignOptions

    work = WORK / "hashing"
    if work.exists():
        shutil.rmtree(work)
    (work / "keys").mkdir(parents=True)
    subprocess.run([sys.executable, "-c", hb._KEYGEN, str(work / "keys")], check=True)
    copy = work / "artifact"
    shutil.copytree(art, copy)
    run_sign(copy, SignOptions(private_key=work / "keys" / "key.pem"))
    hb.REPEATS = 3
    hb.warm(copy)
    mb = hb.total_bytes(copy) / 1e6
    inner, wall = hb.kvq_hashes(copy)
    sha = hb.timed(lambda: hb.sha256sum(copy))
    ms = hb.model_signing_verify(copy, work / "keys" / "pub.pem")
    return {"artifact_mb": round(mb, 1), "repeats": hb.REPEATS, "kvq_hashes_only_wall_s": round(wall, 3),
            "kvq_hashing_s": round(inner, 3), "sha256sum_s": round(sha, 3), "model_signing_verify_s": round(ms, 3)}


def main() -> None:
    if not (DATA / "wikitext-2" / "valid.txt").is_file():
        sys.exit(f"peer-bench: {DATA} not found (the shared data folder; set KVQ_DATA)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    versions = step("versions", peer_venv)
    prepare()
    # quantize: rounds alternate the tool order; every algorithm each round
    quant = {}
    for rnd in range(REPEATS):
        order = ("kvq", "llmcompressor") if rnd % 2 == 0 else ("llmcompressor", "kvq")
        for algo in ALGOS:
            if rnd > 0 and algo not in REPEAT_ALGOS:
                continue
            for tool in order:
                quant[(tool, algo, rnd)] = step(f"quantize-{tool}-{algo}-r{rnd}", lambda t=tool, a=algo, r=rnd: quantize(t, a, r))
    ppl = {"float": step("ppl-float", lambda: perplexity(FLOAT, "float", WINDOWS))}
    for tool in ("kvq", "llmcompressor"):
        for algo in ALGOS:
            art = Path(quant[(tool, algo, 0)]["artifact"])
            ppl[(tool, algo)] = step(f"ppl-{tool}-{algo}", lambda a=art, n=f"{tool}-{algo}": perplexity(a, n, WINDOWS))
    interop, sqnr = {}, {}
    for algo in ("gptq", "awq"):
        art = Path(quant[("kvq", algo, 0)]["artifact"])
        interop[algo] = step(f"interop-transformers-kvq-{algo}",
                             lambda a=art, n=f"kvq-{algo}": perplexity(a, n, INTEROP_WINDOWS, loader="transformers"))
    for tool in ("kvq", "llmcompressor"):
        for algo in ALGOS:
            art = Path(quant[(tool, algo, 0)]["artifact"])
            sqnr[(tool, algo)] = step(f"verify-{tool}-{algo}",
                                      lambda a=art, n=f"{tool}-{algo}", t=tool: verify_weights(a, n, t != "kvq"))
    hashes = step("hashing", lambda: hashing(Path(quant[("kvq", "gptq", 0)]["artifact"])))

    rows = []
    for algo in ALGOS:
        rounds = [r for r in range(REPEATS) if ("kvq", algo, r) in quant]
        walls = {t: [quant[(t, algo, r)]["wall_seconds"] for r in rounds] for t in ("kvq", "llmcompressor")}
        inners = {t: [quant[(t, algo, r)]["quantize_seconds"] for r in rounds] for t in ("kvq", "llmcompressor")}
        ratios = [walls["kvq"][k] / walls["llmcompressor"][k] for k in range(len(rounds))]
        rows.append({
            "algo": algo, "wall_seconds": walls, "quantize_seconds": inners,
            "wall_ratio_kvq_over_peer": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
            "ppl": {t: ppl[(t, algo)]["ppl"] for t in ("kvq", "llmcompressor")},
            "ppl_vs_float_pct": {t: (ppl[(t, algo)]["ppl"] / ppl["float"]["ppl"] - 1) * 100 for t in ("kvq", "llmcompressor")},
            "peak_rss_mib": {t: quant[(t, algo, 0)]["peak_rss_mib"] for t in ("kvq", "llmcompressor")},
            "artifact_mib": {t: quant[(t, algo, 0)]["artifact_bytes"] / 2**20 for t in ("kvq", "llmcompressor")},
            "sqnr": {t: {k: sqnr[(t, algo)][k] for k in ("min_sqnr_db", "median_sqnr_db", "mean_rel_error")}
                     for t in ("kvq", "llmcompressor")},
        })
    interop_rows = {}
    for algo, r in interop.items():
        own = ppl[("kvq", algo)]["per_window_ppl"][:INTEROP_WINDOWS]
        own_ppl = math.exp(sum(math.log(x) for x in own) / len(own))
        interop_rows[algo] = {"transformers_ppl": r["ppl"], "kvq_loader_ppl": own_ppl, "windows": r["windows"],
                              "abs_diff": abs(r["ppl"] - own_ppl)}
    summary = {
        "date": time.strftime("%Y-%m-%d"), "machine": machine(), "mode": TAG, "calibration": f"{SAMPLES} x {SEQLEN}",
        "repeats": REPEATS, "repeat_algos": REPEAT_ALGOS, "eval_windows": WINDOWS, "eval_tokens": ppl["float"]["tokens"], "float_ppl": ppl["float"]["ppl"],
        "peer_versions": versions, "kvq_versions": kvq_versions(), "rows": rows, "interop": interop_rows,
        "foreign_verify": {f"llmcompressor-{a}": sqnr[("llmcompressor", a)] for a in ALGOS}, "hashing": hashes,
    }
    for p in STEPS.glob("*.json"):
        shutil.copy(p, RESULTS / p.name)
    (RESULTS.parent / f"peer_bench{'-quick' if QUICK else ''}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(table(summary))


def table(s: dict) -> str:
    out = [f"machine: {s['machine']}; date {s['date']}; calibration {s['calibration']} token ids (both tools); "
           f"{s['repeats']} round(s) ({', '.join(a.upper() for a in s['repeat_algos'])} in every round, the others in the first), tool order alternating; eval {s['eval_windows']} x 2048 windows of wiki.test.raw "
           f"({s['eval_tokens']} predicted tokens); float32 perplexity {s['float_ppl']:.3f}", "",
           "| W4A16 g64 asym | kvq wall (s) | llm-compressor wall (s) | wall kvq/peer (median, range) | kvq quantize (s) "
           "| peer oneshot (s) | kvq ppl (vs float) | peer ppl (vs float) | kvq / peer min SQNR (dB) | peak RSS kvq / peer (MiB) "
           "| artifact kvq / peer (MiB) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        w, q, ratio = r["wall_seconds"], r["quantize_seconds"], r["wall_ratio_kvq_over_peer"]
        out.append(
            f"| {r['algo'].upper()} | {' / '.join(f'{x:.0f}' for x in w['kvq'])} | {' / '.join(f'{x:.0f}' for x in w['llmcompressor'])} "
            f"| {ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f}) | {' / '.join(f'{x:.0f}' for x in q['kvq'])} "
            f"| {' / '.join(f'{x:.0f}' for x in q['llmcompressor'])} "
            f"| {r['ppl']['kvq']:.3f} ({r['ppl_vs_float_pct']['kvq']:+.2f} %) "
            f"| {r['ppl']['llmcompressor']:.3f} ({r['ppl_vs_float_pct']['llmcompressor']:+.2f} %) "
            f"| {r['sqnr']['kvq']['min_sqnr_db']:.2f} / {r['sqnr']['llmcompressor']['min_sqnr_db']:.2f} "
            f"| {r['peak_rss_mib']['kvq']:,.0f} / {r['peak_rss_mib']['llmcompressor']:,.0f} "
            f"| {r['artifact_mib']['kvq']:.1f} / {r['artifact_mib']['llmcompressor']:.1f} |")
    out += ["", "| interop: kvq artifact through transformers + compressed-tensors (peer venv) | windows | ppl (peer loader) "
            "| ppl (kvq loader) | abs. difference |", "|---|---|---|---|---|"]
    for algo, r in s["interop"].items():
        out.append(f"| kvq {algo.upper()} | {r['windows']} | {r['transformers_ppl']:.4f} | {r['kvq_loader_ppl']:.4f} "
                   f"| {r['abs_diff']:.2e} |")
    out += ["", "| interop: llm-compressor artifact through `kvq verify --no-manifest --weights-only` | tensors | min SQNR (dB) "
            "| median SQNR (dB) | wall (s) |", "|---|---|---|---|---|"]
    for name, r in s["foreign_verify"].items():
        out.append(f"| {name} | {r['tensors']} | {r['min_sqnr_db']:.2f} | {r['median_sqnr_db']:.2f} | {r['wall_seconds']:.1f} |")
    h = s["hashing"]
    out += ["", f"| hashing, kvq GPTQ artifact ({h['artifact_mb']:.0f} MB, signed), median of {h['repeats']} | seconds |",
            "|---|---|", f"| `kvq verify --hashes-only` (whole command) | {h['kvq_hashes_only_wall_s']:.2f} |",
            f"| of which hashing | {h['kvq_hashing_s']:.2f} |", f"| `sha256sum` over the same files | {h['sha256sum_s']:.2f} |",
            f"| `model_signing verify key` (stock CLI) | {h['model_signing_verify_s']:.2f} |"]
    return "\n".join(out)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.machine()} {cpu}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}, no GPU"


def kvq_versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("kvq-compressor", "compressed-tensors", "transformers", "torch")}


if __name__ == "__main__":
    main()
