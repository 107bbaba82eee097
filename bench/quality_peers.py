"""Issue #18's quality table: kvq's algorithms and the peers at W4 g64 and W3 g64 on SmolLM2-135M.

Every method gets the same float32 folder, the same calibration token ids and the same
evaluation windows as ``bench/peer_bench.py`` (its ``prepare`` step writes them), and every
artifact is scored by one script, ``bench/eval_ids.py --reference FLOAT`` (kvq's loader):
perplexity, mean KL divergence to the float model (nats per predicted token) and top-1
agreement. Rows (``METHODS``, comma separated, default all):

* ``rtn``, ``awq``, ``gptq``, ``awq-gptq`` -- kvq (``kvq quantize`` with the bundled
  recipes ``w4a16-rtn-g64`` / ``w4a16-awq`` / ``w4a16-gptq`` / ``w4a16-awq-gptq`` and
  ``--bits``); ``awq-gptq-g20`` is ``w4a16-gptq`` with ``--algorithm awq-gptq`` (AWQ's
  default 20-point scale grid); ``gptq-clip`` is ``w4a16-gptq`` with GPTQ's range search
  (``--set gptq.clip=true``); ``gptq-gptaq`` is ``w4a16-gptaq``
  (the range search and GPTQ's float target, ``gptq.gptaq_alpha: 0.25``);
* ``llmc-gptq``, ``llmc-awq`` -- llm-compressor in ``bench/.peers/llmcompressor``
  (``bench/peer_llmcompressor.py --bits``);
* ``fp8``, ``fp8-block`` -- kvq's FP8 W8A8 recipes ``w8a8-fp8`` / ``w8a8-fp8-block`` (run with
  ``BITS=8``; ``fp8-f32``, ``fp8-block-f32``: with ``--dtype float32``, the unquantized tensors kept
  float32 as llm-compressor keeps them), and ``llmc-fp8``, ``llmc-fp8-block`` -- llm-compressor's
  same schemes (its presets ``FP8_DYNAMIC`` / ``FP8_BLOCK``, ``--scheme``); kvq's loader quantizes
  every linear's input as the serving kernel does for all of them. A run of FP8 rows only writes
  ``bench/results/quality_peers-<tag>-w8a8-fp8.json``;
* issue #49's formats (run with ``BITS=4``), kvq's recipe beside llm-compressor's preset of the same
  scheme (``peer_llmcompressor.py --scheme``): ``w4a8`` / ``llmc-w4a8`` (``w4a8-gptq`` / ``W4AFP8``, both
  GPTQ, int4 symmetric in groups of 64 -- the presets' 128 does not divide SmolLM2's 576 -- with fp8
  inputs per token), ``nvfp4a16`` / ``llmc-nvfp4a16`` and ``mxfp4a16`` / ``llmc-mxfp4a16`` (RTN), the same
  with ``-gptq`` (GPTQ on the FP4 grid), and ``nvfp4`` / ``llmc-nvfp4`` (W4A4: FP4 inputs with a static
  global scale; ``nvfp4-gptq`` / ``llmc-nvfp4-gptq`` its weights by GPTQ). A run of these rows only writes
  ``bench/results/quality_peers-<tag>-formats.json``;
* ``autoround`` -- AutoRound in ``bench/.peers/autoround`` (``bench/peer_autoround.py``;
  ``AR_ITERS``, default 200, AutoRound's default; ``AR_LR``, default AutoRound's own:
  its "light" recipe is ``AR_ITERS=50 AR_LR=5e-3``).

Each step is cached under ``bench/work/quality/<tag>/`` (delete it to rerun). Writes
``bench/results/quality_peers-<tag>.json`` and prints the Markdown table. Env: ``BITS``
(default ``4,3``), ``SAMPLES`` (calibration sequences of 512, default 16), ``WINDOWS``
(evaluation windows of 2048, default 8), ``METHODS``, ``AR_ITERS``, ``AR_LR``; ``SEED`` (an
earlier results file measured on the same input files: its rows are kept, not rerun).

Usage: python bench/quality_peers.py
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("SAMPLES", "16")
import peer_bench as pb  # noqa: E402  (same inputs: float folder, calibration and evaluation ids)

BITS = [int(b) for b in os.environ.get("BITS", "4,3").split(",")]
WINDOWS = int(os.environ.get("WINDOWS", "8"))
AR_ITERS = int(os.environ.get("AR_ITERS", "200"))
#: AutoRound's learning rate; its "light" recipe is iters 50 with lr 5e-3 (auto-round CLI --recipe light)
AR_LR = os.environ.get("AR_LR")
ALL = ("rtn", "awq", "gptq", "gptq-clip", "gptq-gptaq", "awq-gptq", "awq-gptq-g20", "llmc-gptq", "llmc-awq", "autoround")
#: FP8 W8A8 rows (run with BITS=8): kvq's recipes and llm-compressor's presets
FP8 = {"fp8": "w8a8-fp8", "fp8-block": "w8a8-fp8-block", "fp8-f32": "w8a8-fp8", "fp8-block-f32": "w8a8-fp8-block",
       "llmc-fp8": "FP8_DYNAMIC", "llmc-fp8-block": "FP8_BLOCK"}
#: issue #49's formats: kvq's (recipe, flags), and llm-compressor's (preset, algorithm, weight group size)
FORMATS = {"w4a8": ("w4a8-gptq", ["--set", "weights.group_size=64"]), "nvfp4a16": ("w4a16-nvfp4", []),
           "nvfp4a16-gptq": ("w4a16-nvfp4-gptq", []), "mxfp4a16": ("w4a16-mxfp4", []),
           "mxfp4a16-gptq": ("w4a16-mxfp4-gptq", []), "nvfp4": ("w4a4-nvfp4", []),
           "nvfp4-gptq": ("w4a4-nvfp4-gptq", [])}
LLMC_FORMATS = {"llmc-w4a8": ("W4AFP8", "gptq", 64), "llmc-nvfp4a16": ("NVFP4A16", "rtn", None),
                "llmc-nvfp4a16-gptq": ("NVFP4A16", "gptq", None), "llmc-mxfp4a16": ("MXFP4A16", "rtn", None),
                "llmc-mxfp4a16-gptq": ("MXFP4A16", "gptq", None), "llmc-nvfp4": ("NVFP4", "rtn", None),
                "llmc-nvfp4-gptq": ("NVFP4", "gptq", None)}
SCHEME_LABEL = {"w4a8": "W4A8 (int4 g64, fp8 inputs)", "nvfp4a16": "NVFP4 W4A16", "mxfp4a16": "MXFP4 W4A16",
                "nvfp4": "NVFP4 W4A4"}
METHODS = [m for m in os.environ.get("METHODS", ",".join(ALL)).split(",") if m]
TAG = f"{pb.SAMPLES}x{pb.SEQLEN}-w{WINDOWS}"
WORK = ROOT / "bench" / "work" / "quality" / TAG
KVQ_RECIPE = {"rtn": "w4a16-rtn-g64", "awq": "w4a16-awq", "gptq": "w4a16-gptq", "gptq-clip": "w4a16-gptq",
              "awq-gptq": "w4a16-awq-gptq", "awq-gptq-g20": "w4a16-gptq", "gptq-gptaq": "w4a16-gptaq",
              **{m: r for m, r in FP8.items() if not m.startswith("llmc-")}, **{m: r for m, (r, _) in FORMATS.items()}}
#: extra kvq flags of a row
KVQ_FLAGS = {"awq-gptq-g20": ["--algorithm", "awq-gptq"], "gptq-clip": ["--set", "gptq.clip=true"],
             # the float tensors (embedding, norms) stored float32, as llm-compressor saves a float32 model
             "fp8-f32": ["--dtype", "float32"], "fp8-block-f32": ["--dtype", "float32"],
             **{m: f for m, (_, f) in FORMATS.items()}}
AR_PY = ROOT / "bench" / ".peers" / "autoround" / "bin" / "python"


def quantize(method: str, bits: int) -> dict:
    out = WORK / f"{method}-w{bits}"
    log = WORK / "logs" / f"{out.name}.log"
    js = WORK / "logs" / f"{out.name}.json"
    if out.exists():
        shutil.rmtree(out)
    if method in KVQ_RECIPE:
        cmd = [pb.KVQ, "quantize", pb.FLOAT, "--recipe", KVQ_RECIPE[method], "--bits", bits, "--calib", pb.CALIB,
               "-o", out, "--json", *KVQ_FLAGS.get(method, [])]
        wall = pb.run(cmd, log)
        text = log.read_text()
        s = json.loads(text[text.index("{\n"):])
        inner, rss = s["quantize_seconds"], s["peak_rss_mib"]
        art = out
    else:
        if method in FP8 or method in LLMC_FORMATS:
            scheme, algo, gs = LLMC_FORMATS.get(method, (FP8.get(method), "rtn", None))
            cmd = [pb.PEER_PY, ROOT / "bench" / "peer_llmcompressor.py", "quantize", "--algo", algo, "--scheme",
                   scheme, *(["--group-size", gs] if gs else []), "--model", pb.FLOAT, "--calib", pb.CALIB,
                   "--out", out, "--json", js]
        elif method.startswith("llmc-"):
            cmd = [pb.PEER_PY, ROOT / "bench" / "peer_llmcompressor.py", "quantize", "--algo", method[5:], "--bits", bits,
                   "--model", pb.FLOAT, "--calib", pb.CALIB, "--out", out, "--json", js]
        else:
            cmd = [AR_PY, ROOT / "bench" / "peer_autoround.py", "quantize", "--bits", bits, "--group-size", 64,
                   "--iters", AR_ITERS, *(["--lr", AR_LR] if AR_LR else []), "--model", pb.FLOAT, "--calib", pb.CALIB, "--out", out, "--json", js]
        wall = pb.run(cmd, log)
        s = json.loads(js.read_text())
        inner, rss = s["quantize_seconds"], s["peak_rss_mib"]
        # AutoRound writes its checkpoint into a subfolder of --out
        art = next((p.parent for p in sorted(out.rglob("config.json"))), out)
    return {"method": method, "bits": bits, "command": " ".join(map(str, cmd)), "wall_seconds": round(wall, 1),
            "quantize_seconds": inner, "peak_rss_mib": rss, "artifact": str(art),
            "artifact_bytes": sum(f.stat().st_size for f in Path(art).glob("*.safetensors"))}


def evaluate(model: Path, name: str) -> dict:
    js = WORK / "logs" / f"eval-{name}.json"
    pb.run([pb.KVQ_PY, ROOT / "bench" / "eval_ids.py", model, "--ids", pb.EVAL, "--max-windows", WINDOWS,
            "--reference", pb.FLOAT, "--out", js], WORK / "logs" / f"eval-{name}.log")
    return json.loads(js.read_text())


def step(name: str, fn) -> dict:
    out = WORK / "steps" / f"{name}.json"
    if out.exists():
        return json.loads(out.read_text())
    print(f"quality-peers: {name} ...", flush=True)
    res = fn()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    return res


def seed(results: Path) -> None:
    """Cache the rows of an earlier results file as finished steps (``SEED=file``), so a run
    adds rows to it instead of recomputing them: only when its inputs are these inputs
    (same calibration and evaluation id files, by SHA-256), else exit."""
    old = json.loads(results.read_text())
    now = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (pb.CALIB, pb.EVAL)}
    if old.get("inputs_sha256") != now:
        sys.exit(f"quality-peers: {results} was measured on other inputs ({old.get('inputs_sha256')} vs {now})")
    for r in old["rows"]:
        tag = f"{r['method']}-w{r['bits']}"
        for name, body in ((f"quantize-{tag}", {k: r[k] for k in r if k not in ("ppl", "mean_kl", "top1_agreement")}),
                           (f"eval-{tag}", {"ppl": r["ppl"], "mean_kl": r["mean_kl"], "top1_agreement": r["top1_agreement"]})):
            out = WORK / "steps" / f"{name}.json"
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(body, indent=2) + "\n")


def main() -> None:
    pb.prepare()
    if os.environ.get("SEED"):
        seed(Path(os.environ["SEED"]))
    def to_run(m):  # a peer's venv is needed only for rows not cached (or seeded) yet
        return any(not (WORK / "steps" / f"quantize-{m}-w{b}.json").exists() for b in BITS)

    if any(m.startswith("llmc-") and to_run(m) for m in METHODS):
        pb.peer_venv()
    if "autoround" in METHODS and to_run("autoround") and not AR_PY.exists():
        sys.exit(f"quality-peers: {AR_PY} missing: python -m venv bench/.peers/autoround, then pip install "
                 "torch==2.13.0, then auto-round==0.16.1 and compressed-tensors with torch held (-c)")
    fl = step("eval-float", lambda: evaluate(pb.FLOAT, "float"))
    rows = []
    for bits in BITS:
        for m in METHODS:
            q = step(f"quantize-{m}-w{bits}", lambda m=m, b=bits: quantize(m, b))
            e = step(f"eval-{m}-w{bits}", lambda q=q, m=m, b=bits: evaluate(Path(q["artifact"]), f"{m}-w{b}"))
            rows.append({**q, "ppl": e["ppl"], "mean_kl": e["mean_kl"], "top1_agreement": e["top1_agreement"]})
    res = {"date": time.strftime("%Y-%m-%d"), "machine": pb.machine(), "calibration": f"{pb.SAMPLES} x {pb.SEQLEN}",
           "inputs_sha256": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (pb.CALIB, pb.EVAL)},
           "eval_windows": WINDOWS, "eval_tokens": fl["tokens"], "float_ppl": fl["ppl"], "autoround_iters": AR_ITERS, "autoround_lr": AR_LR,
           "rows": rows, "driver_max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    # the FP8 W8A8 rows and the other formats' rows have files of their own
    suffix = ("-w8a8-fp8" if all(m in FP8 for m in METHODS) else
              "-formats" if all(m in FORMATS or m in LLMC_FORMATS for m in METHODS) else "")
    out = ROOT / "bench" / "results" / f"quality_peers-{TAG}{suffix}.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))


def table(r: dict) -> str:
    lines = [f"calibration {r['calibration']} token ids (every method), eval {r['eval_windows']} x 2048 windows of "
             f"wiki.test.raw ({r['eval_tokens']} predicted tokens), float32 perplexity {r['float_ppl']:.3f}", "",
             "| bits | method | perplexity | vs float | mean KL (nats) | top-1 agreement | quantize wall (s) | peak RSS (MiB) "
             "| artifact (MiB) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in r["rows"]:
        base = x["method"].removeprefix("llmc-").removesuffix("-gptq")
        scheme = ("W8A8 FP8 block" if "fp8-block" in x["method"] else "W8A8 FP8") if x["method"] in FP8 \
            else SCHEME_LABEL.get(base, f"W{x['bits']} g64")
        size = f"{x['artifact_bytes'] / 2**20:,.1f}" if "artifact_bytes" in x else "-"
        lines.append(f"| {scheme} | {x['method']} | {x['ppl']:.3f} | {(x['ppl'] / r['float_ppl'] - 1) * 100:+.2f} % "
                     f"| {x['mean_kl']:.4f} | {x['top1_agreement'] * 100:.2f} % | {x['wall_seconds']:.0f} "
                     f"| {x['peak_rss_mib']:,.0f} | {size} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
