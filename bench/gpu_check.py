"""One GPU check of kvq's CUDA paths (issue #19): Triton W4A16, `kvq quantize --device cuda`, serve-smoke.

Steps (``--steps``, default all, in this order), one JSON at ``--out``
(default bench/results/gpu_check.json):

* ``triton`` -- Triton W4A16 GEMV/GEMM vs torch on the same inputs, time, achieved bandwidth
  as a fraction of the copy bandwidth (``bench/gpu_check_triton.py``): SmolLM2's Linear
  shapes and a 4096x11008 / 11008x4096 pair, group 64, batches 1 and 8 (decode; the GEMV
  kernel serves M <= 8) and 64 (prefill; the GEMM kernel); and the grouped MoE kernel on
  GLM-4.5-Air's routed projections (128 experts, top-8; 1 and 8 tokens) against its torch
  reference, with the routed experts' bytes as the bandwidth.
* ``quantize`` -- ``kvq quantize MODEL --device cuda`` with ``w4a16-awq`` and
  ``w4a16-gptq``, calibration ``--calib`` (default SHARED/wikitext-2/valid.txt when present,
  else ``embedded``), ``--samples`` x ``--seqlen`` (32 x 512), seed 0: wall time and the
  command's JSON summary.
* ``serve`` -- ``kvq serve-smoke ARTIFACT --device cuda --json`` on the CUDA AWQ artifact
  (or ``--artifact``): decode and prefill tokens/s at batch 1 and 8, kernels, agreement
  with the reference; exit 1 (a gate failed) is recorded, not an error.
* ``sweep`` (run last, on what is left of the budget) -- decode launch configurations
  (BLOCK_N, BLOCK_K, split-K) of the Triton W4A16 kernel on five shapes, timed, against the
  one ``choose_config`` picks: the data to tune it on this GPU.
* ``agreement`` -- each CUDA artifact against a CPU artifact of the same inputs (the same
  command with ``--device cpu``): equal tensor digests of kvq-manifest.json and, where
  they differ, the weight SQNR of every quantized Linear between the two dequantized
  artifacts (:func:`compressor.artifact.load_artifact`), min / median. The CPU artifacts
  take minutes (2 cores: AWQ ~5, GPTQ ~3.5 min at 32 x 512); with 8+ cores they are made
  in the background from the start, on cores the GPU steps do not use (``--no-overlap``:
  in this step). ``--cpu-artifacts DIR`` brings them made earlier (DIR/awq, DIR/gptq; a
  folder with only its kvq-manifest.json allows the digest count alone); ``--skip-cpu``
  skips making them. The commands run are recorded in the JSON.

Each step runs in try/except (its error goes into the JSON, the next step runs); the JSON
is rewritten after every step. ``--budget-s`` (default 450) bounds the whole run: commands
are killed at the deadline and the steps left are skipped with a note. Without a CUDA
device every step is recorded as skipped "no CUDA device", exit 0 (``--require-cuda``:
exit 2, one line). Exit 1 when a step failed. A short table is printed at the end.

    make install TORCH=torch && make gpu-check          # on a CUDA machine
    python bench/gpu_check.py --steps triton,serve --out /tmp/g.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "bench"):  # compressor (this checkout), gpu_check_triton, triton_bench
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from gpu_check_triton import log, step_sweep, step_triton  # noqa: E402

STEPS = ("triton", "quantize", "serve", "agreement", "sweep")
ALGOS = {"awq": "w4a16-awq", "gptq": "w4a16-gptq"}
NO_CUDA = "no CUDA device"


# ---------------------------------------------------------------------------------------
# arguments, JSON, pure arithmetic


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring); ``--steps`` is returned as a tuple in run order.

    Raises:
        SystemExit(2): unknown option, unknown step, bad number list (argparse's one-line error).
    """
    p = argparse.ArgumentParser(
        description="kvq's CUDA paths on one GPU: the Triton kernels against torch, quantize and serve-smoke "
                    "with --device cuda, their agreement with the CPU, a kernel configuration sweep; one JSON "
                    "(see BENCHMARKS.md, 'GPU check')", allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_check.json",
                   help="the JSON report, rewritten after every step")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    p.add_argument("--budget-s", type=float, default=450.0, help="whole-run time budget in seconds")
    p.add_argument("--require-cuda", action="store_true", help="exit 2 when no CUDA device is present")
    p.add_argument("--work", type=Path, default=ROOT / "bench" / "work" / "gpu_check",
                   help="artifacts and logs of the commands it runs")
    p.add_argument("--model", default="smollm2-135m",
                   help="model to quantize; a folder with a config and no weights gets seeded random ones "
                        "(bench/synthetic_model.py)")
    p.add_argument("--calib", default="auto", help="calibration text; auto: SHARED/wikitext-2/valid.txt, else embedded")
    p.add_argument("--shared", type=Path, default=ROOT.parent / "shared" / "data",
                   help="the shared data folder (--calib auto reads wikitext-2/valid.txt there)")
    p.add_argument("--samples", type=int, default=32, help="calibration samples of the quantize step")
    p.add_argument("--seqlen", type=int, default=512, help="calibration tokens per sample")
    p.add_argument("--group-size", type=int, default=64, help="group size of the Triton cases")
    p.add_argument("--batches", default="1,8,64", help="activation rows M of the Triton cases")
    p.add_argument("--reps", type=int, default=50, help="timed replays per Triton case (median)")
    p.add_argument("--artifact", type=Path, default=None, help="serve-smoke this artifact instead of the CUDA AWQ one")
    p.add_argument("--cpu-artifacts", type=Path, default=None, help="CPU artifacts made earlier: DIR/awq, DIR/gptq")
    p.add_argument("--skip-cpu", action="store_true", help="do not make CPU artifacts (agreement needs --cpu-artifacts)")
    p.add_argument("--no-overlap", action="store_true", help="make the CPU artifacts in the agreement step, not in the background")
    a = p.parse_args(argv)
    steps = [s.strip() for s in a.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad or not steps:
        p.error(f"--steps: unknown step {bad[0] if bad else '(none given)'}; choose from {', '.join(STEPS)}")
    a.steps = tuple(s for s in STEPS if s in steps)
    try:
        a.batches = tuple(int(b) for b in a.batches.split(","))
    except ValueError:
        p.error(f"--batches: expected comma-separated integers, got {a.batches!r}")
    if min(a.batches) < 1 or a.reps < 1 or a.samples < 1 or a.seqlen < 2 or a.budget_s <= 0:
        p.error("--batches, --reps, --samples, --budget-s must be positive and --seqlen at least 2")
    why = _unwritable(a.out)
    if why:  # before any step: a typo must not cost a GPU run its first result
        p.error(f"--out {a.out}: {why}")
    return a


def _unwritable(out: Path) -> str | None:
    """Why the report cannot be written at ``out`` (None when it can: its folder is made, a probe written)."""
    if out.is_dir():
        return "is a folder; give a file name"
    blocking = next((a for a in out.parents if a.exists() and not a.is_dir()), None)
    if blocking is not None:
        return f"{blocking} is a file, not a folder"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.with_name(out.name + ".tmp")
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def sqnr_db(ref, test) -> float | None:
    """Signal-to-quantization-noise ratio ``10 log10(sum ref^2 / sum (ref - test)^2)`` in dB.

    Returns None when the tensors are equal (infinite SQNR). Tensors of the same shape.
    """
    r, t = ref.double(), test.double()
    noise = float((r - t).pow(2).sum())
    if noise == 0.0:
        return None
    return 10.0 * math.log10(max(float(r.pow(2).sum()), 1e-300) / noise)


def _json_safe(v):
    """Floats that JSON cannot hold (nan, inf) become None; tuples become lists; Paths strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    return v


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as indented JSON atomically (temp file + rename); nan/inf become null."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_json_safe(data), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


def resolve_calib(args) -> str:
    """The calibration argument: ``--calib`` unless ``auto``; then SHARED/wikitext-2/valid.txt if present, else embedded."""
    if args.calib != "auto":
        return args.calib
    p = Path(args.shared) / "wikitext-2" / "valid.txt"
    return str(p.resolve()) if p.is_file() else "embedded"


# ---------------------------------------------------------------------------------------
# the run context, the step runner, commands


class Context:
    """Deadline, options and what steps hand to each other (artifact folders, CPU jobs)."""

    def __init__(self, args, start: float | None = None):
        self.args = args
        self.start = time.perf_counter() if start is None else start
        self.deadline = self.start + args.budget_s
        self.device = "cuda"  # the device of the quantize/serve commands (tests run the steps on cpu)
        self.cuda_artifacts: dict[str, Path] = {}
        self.cpu_jobs: CpuJobs | None = None

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def run_steps(ctx: Context, funcs: dict, report: dict, out: Path | None = None) -> dict:
    """Run each of ``ctx.args.steps`` through ``funcs[name](ctx)`` in try/except.

    A step returns a dict (status ``ok`` unless it says otherwise); an exception becomes
    ``{"status": "error", "error": one line, "traceback": last lines}``; once the budget is
    spent the steps left are ``skipped`` with a note. ``report["steps"]`` is filled in and
    written to ``out`` after every step.
    """
    steps = report.setdefault("steps", {})
    for name in ctx.args.steps:
        if ctx.remaining() <= 0:
            steps[name] = skipped(f"time budget of {ctx.args.budget_s:.0f} s spent before this step")
        else:
            log(f"step {name} ({ctx.remaining():.0f} s of budget left)")
            t0 = time.perf_counter()
            try:
                res = dict(funcs[name](ctx))
                res.setdefault("status", "ok")
            except Exception as e:  # one failing step must not lose the others
                res = {"status": "error", "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                       "traceback": traceback.format_exc().splitlines()[-6:]}
            res["seconds"] = round(time.perf_counter() - t0, 2)
            steps[name] = res
        report["elapsed_s"] = round(time.perf_counter() - ctx.start, 2)
        if out is not None:
            write_json(out, report)
    return report


def run_kvq(argv: list, log_file: Path, timeout: float, env: dict | None = None, cores: set | None = None) -> dict:
    """Run ``python -m compressor ARGV`` from the repository root (this checkout's package).

    Returns ``{"command", "rc", "wall_s", "json"}`` (``json``: stdout parsed, or None);
    stdout and stderr go to ``log_file``. ``cores`` pins the process to those CPUs (Linux).

    Raises:
        TimeoutError: still running at ``timeout`` seconds (the process is killed).
    """
    cmd = [sys.executable, "-m", "compressor", *map(str, argv)]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {}),
                "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    log_file.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(p.pid, cores)  # before the child imports torch (it sizes its thread pool then)
        try:
            stdout, stderr = p.communicate(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            log_file.write_text(f"$ {' '.join(cmd)}\n(timed out)\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
            raise TimeoutError(f"`kvq {argv[0]}` ran past the time budget ({timeout:.0f} s left); log {log_file}") from None
    wall = time.perf_counter() - t0
    log_file.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    try:
        parsed = json.loads(stdout[stdout.index("{"):]) if "{" in stdout else None
    except json.JSONDecodeError:
        parsed = None
    tail = stderr.strip().splitlines()[-1:] if p.returncode else []
    return {"command": " ".join(["kvq", *map(str, argv)]), "rc": p.returncode, "wall_s": round(wall, 2),
            "json": parsed, "stderr_tail": tail[0] if tail else None, "log": str(log_file)}


def quantize_argv(args, algo: str, device: str, out: Path) -> list:
    """``kvq quantize`` arguments for one algorithm on one device (same inputs on every device);
    creates ``out``'s parent folder."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)  # kvq creates OUTPUT, not its parents
    return ["quantize", args.model, "--recipe", ALGOS[algo], "--calib", resolve_calib(args),
            "--calib-samples", args.samples, "--calib-seqlen", args.seqlen, "--seed", 0,
            "--device", device, "-o", out, "--overwrite", "--json"]


def _quantize_record(r: dict) -> dict:
    js = r.pop("json") or {}
    keys = ("wall_seconds", "quantize_seconds", "phase_seconds", "peak_rss_mib", "mean_rel_error",
            "content_digest", "source_loading", "calibration", "warnings")
    return {**r, "summary": {k: js.get(k) for k in keys if k in js}}


class CpuJobs:
    """The CPU artifacts (AWQ then GPTQ), made in a background thread, optionally pinned to ``cores``."""

    def __init__(self, ctx: Context, cores: set | None):
        self.ctx, self.cores = ctx, cores
        self.folder = ctx.args.work / "cpu"
        self.results: dict[str, dict] = {}
        self.thread = threading.Thread(target=self.run, name="kvq-cpu-artifacts", daemon=True)

    def run(self) -> None:
        args = self.ctx.args
        env = {"OMP_NUM_THREADS": str(len(self.cores))} if self.cores else None
        for algo in ALGOS:
            try:
                r = run_kvq(quantize_argv(args, algo, "cpu", self.folder / algo), args.work / "logs" / f"cpu-{algo}.log",
                            self.ctx.remaining(), env=env, cores=self.cores)
                self.results[algo] = _quantize_record(r)
            except Exception as e:
                self.results[algo] = {"error": f"{type(e).__name__}: {e}"}


def split_cores() -> tuple[set | None, set | None]:
    """(cores for the GPU steps, cores for the background CPU artifacts), or (None, None) below 8 cores."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 8:
        return None, None
    return set(cores[:4]), set(cores[4:])


# ---------------------------------------------------------------------------------------
# steps: quantize, serve, agreement


def step_quantize(ctx: Context) -> dict:
    """The ``quantize`` step: ``kvq quantize --device cuda`` per algorithm into WORK/cuda/ALGO
    (a failed one does not stop the other)."""
    args, res = ctx.args, {"calib": resolve_calib(ctx.args), "samples": ctx.args.samples, "seqlen": ctx.args.seqlen}
    for algo in ALGOS:
        out = args.work / "cuda" / algo
        try:
            r = _quantize_record(run_kvq(quantize_argv(args, algo, ctx.device, out),
                                         args.work / "logs" / f"cuda-{algo}.log", ctx.remaining()))
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}"}
        if r.get("rc") == 0:
            ctx.cuda_artifacts[algo] = out
        res[algo] = r
    if any(res[a].get("rc") != 0 for a in ALGOS):
        res["status"] = "error"
        res["error"] = "; ".join(f"{a}: {res[a].get('error') or res[a].get('stderr_tail')}" for a in ALGOS
                                 if res[a].get("rc") != 0)
    return res


def step_serve(ctx: Context) -> dict:
    """The ``serve`` step: ``kvq serve-smoke ARTIFACT --device cuda --json`` (exit 1 = a gate failed: still measured)."""
    args = ctx.args
    art = args.artifact or ctx.cuda_artifacts.get("awq") or args.work / "cuda" / "awq"
    if not (Path(art) / "kvq-manifest.json").is_file():
        return skipped(f"no artifact at {art}: run the quantize step or pass --artifact")
    r = run_kvq(["serve-smoke", art, "--device", ctx.device, "--json"], args.work / "logs" / "serve-smoke.log",
                ctx.remaining())
    js = r.pop("json")
    if r["rc"] not in (0, 1) or not js:
        return {"status": "error", "error": f"serve-smoke exit {r['rc']}: {r['stderr_tail']}", **r}
    rt = js.get("runtime", {})
    batches = {b: {k: rt[b].get(k) for k in ("decode_tokens_per_s", "prefill_tokens_per_s")}
               for b in rt if b.startswith("batch_") and isinstance(rt[b], dict)}
    return {**r, "artifact": str(art), "gates_passed": r["rc"] == 0, **batches,
            "kernels": rt.get("kernels"), "kv_scheme": rt.get("kv_scheme"), "comparison": js.get("comparison")}


def _quantized_modules(manifest) -> list[str]:
    leaves = (".weight_packed", ".qweight")
    return sorted(n[: -len(leaf)] for n in manifest.tensors for leaf in leaves if n.endswith(leaf))


def compare_artifacts(cpu: Path, cuda: Path, seconds_left=None) -> dict:
    """Agreement of two artifacts of the same model and recipe.

    Counts equal tensor digests of their manifests; when some differ and both hold their
    tensors, dequantizes both (:func:`compressor.artifact.load_artifact`, float32) and gives
    the weight SQNR (CPU as reference) of every quantized Linear: min, median, worst module.
    ``seconds_left`` (a callable): the SQNR is skipped, with a note, once it returns <= 0
    (the digest count is instant; loading two artifacts is not).
    """
    from compressor.manifest import load_manifest

    ma, mb = load_manifest(cpu), load_manifest(cuda)
    names = sorted(set(ma.tensors) | set(mb.tensors))
    same = [n for n in names if n in ma.tensors and n in mb.tensors and ma.tensors[n].digest == mb.tensors[n].digest]
    res = {"tensors": len(names), "digests_equal": len(same),
           "only_cpu": sorted(set(ma.tensors) - set(mb.tensors))[:5], "only_cuda": sorted(set(mb.tensors) - set(ma.tensors))[:5],
           "differing": [n for n in names if n not in set(same)][:5]}
    if ma.digest_algorithm != mb.digest_algorithm:
        res["note"] = f"digest algorithms differ ({ma.digest_algorithm} vs {mb.digest_algorithm})"
    if len(same) == len(names):
        res["weight_sqnr_db"] = {"note": "every tensor digest equal: identical weights"}
        return res
    if not any(Path(cpu).glob("*.safetensors")) or not any(Path(cuda).glob("*.safetensors")):
        res["weight_sqnr_db"] = {"note": "not computed: an artifact holds no tensors (manifest only)"}
        return res
    if seconds_left is not None and seconds_left() <= 0:
        res["weight_sqnr_db"] = {"note": "not computed: the time budget was spent"}
        return res
    res["weight_sqnr_db"] = weight_sqnr(cpu, cuda, _quantized_modules(ma))
    return res


def weight_sqnr(cpu: Path, cuda: Path, modules: list[str]) -> dict:
    """Per-module weight SQNR (dB) between two dequantized artifacts: min/median over modules that differ."""
    import torch

    from compressor.artifact import load_artifact

    with torch.no_grad():
        sa = load_artifact(cpu)[0].state_dict()
        sb = load_artifact(cuda)[0].state_dict()
    vals, identical, missing = {}, 0, 0
    for mod in modules:
        a, b = sa.get(mod + ".weight"), sb.get(mod + ".weight")
        if a is None or b is None or a.shape != b.shape:
            missing += 1
            continue
        v = sqnr_db(a, b)
        if v is None:
            identical += 1
        else:
            vals[mod] = v
    out = {"modules": len(modules), "identical": identical, "not_compared": missing}
    if vals:
        worst = min(vals, key=vals.get)
        out.update(min=vals[worst], median=statistics.median(vals.values()), worst_module=worst)
    return out


def step_agreement(ctx: Context) -> dict:
    """The ``agreement`` step: CUDA artifacts vs CPU artifacts of the same inputs (see module docstring)."""
    args, res = ctx.args, {}
    if args.cpu_artifacts is not None:
        cpu_dir, res["cpu_artifacts"] = args.cpu_artifacts, "given (--cpu-artifacts)"
    elif args.skip_cpu:
        return skipped("--skip-cpu and no --cpu-artifacts")
    else:
        if ctx.cpu_jobs is None:  # not started in the background: make them now
            ctx.cpu_jobs = CpuJobs(ctx, None)
            ctx.cpu_jobs.run()
        else:
            ctx.cpu_jobs.thread.join(timeout=max(ctx.remaining(), 0))
            if ctx.cpu_jobs.thread.is_alive():
                raise TimeoutError("the CPU artifacts were not done within the time budget")
        cpu_dir, res["cpu_artifacts"] = ctx.cpu_jobs.folder, ctx.cpu_jobs.results
    errors = []
    for algo in ALGOS:
        cuda = ctx.cuda_artifacts.get(algo) or args.work / "cuda" / algo
        try:
            res[algo] = compare_artifacts(cpu_dir / algo, cuda, ctx.remaining)
        except Exception as e:
            res[algo] = {"error": f"{type(e).__name__}: {e}"}
            errors.append(f"{algo}: {res[algo]['error']}")
    if errors:
        res.update(status="error", error="; ".join(errors))
    return res


STEP_FUNCS = {"triton": step_triton, "quantize": step_quantize, "serve": step_serve, "agreement": step_agreement,
              "sweep": step_sweep}


# ---------------------------------------------------------------------------------------
# summary and main


def summary_lines(report: dict) -> list[str]:
    """A short table: one line per step (status, seconds, headline figures), then the Triton rows."""
    st = report.get("steps", {})
    lines = [f"gpu check on {report.get('device') or 'no GPU'} -> {report.get('out')}",
             f"{'step':<10} {'status':<8} {'seconds':>8}  result"]
    for name in STEPS:
        if name not in st:
            continue
        r = st[name]
        lines.append(f"{name:<10} {r['status']:<8} {r.get('seconds', 0):>8.1f}  {_headline(name, r)}")
    rows = st.get("triton", {}).get("rows", [])
    if rows:
        lines.append(f"{'N x K':<12} {'M':>3} {'kernel':<6} {'triton us':>10} {'% copy BW':>9} {'torch us':>9} "
                     f"{'fp16 us':>8} {'err':>9}")
        for r in rows:
            kern = r["kernel"] + (f"/{r['split_k']}" if r.get("split_k", 1) > 1 else "")
            lines.append(f"{str(r['n']) + 'x' + str(r['k']):<12} {r['m']:>3} {kern:<6} {r['triton_us']:>10.1f} "
                         f"{100 * r['fraction_of_copy_bw']:>9.0f} {r['torch_dequant_us']:>9.1f} "
                         f"{r['fp16_linear_us']:>8.1f} {r['max_abs_err_vs_torch']:>9.2e}")
    moe = st.get("triton", {}).get("moe", {}).get("rows", [])
    if moe:
        lines.append(f"{'MoE case':<18} {'tokens':>6} {'experts':>7} {'triton us':>10} {'% copy BW':>9} "
                     f"{'torch us':>9} {'err':>9}")
        for r in moe:
            lines.append(f"{r['name']:<18} {r['tokens']:>6} {r['experts_routed']:>7} {r['triton_us']:>10.1f} "
                         f"{100 * r['fraction_of_copy_bw']:>9.0f} {r['torch_reference_us']:>9.1f} "
                         f"{r['max_abs_err_vs_reference']:>9.2e}")
    return lines


def _headline(name: str, r: dict) -> str:
    if r["status"] == "skipped":
        return r.get("reason", "")
    if r["status"] == "error" and not any(a in r for a in ALGOS):
        return r.get("error", "")
    if name == "triton":
        return (f"copy BW {r['copy_bandwidth_gb_s']:.0f} GB/s; {len(r['rows'])} cases; MoE kernel {r['moe']['status']}"
                f" ({len(r['moe'].get('rows', []))} cases)")
    if name == "quantize":
        return "; ".join(f"{a} {r[a]['wall_s']:.0f} s" if r[a].get("rc") == 0 else f"{a} FAILED"
                         for a in ALGOS if a in r)
    if name == "sweep":
        return "; ".join(f"{c['n']}x{c['k']} m={c['m']}: chosen {c.get('chosen_us') or 0:.0f} us, best "
                         f"{c['best']['us']:.0f} us ({c['best']['block_n']}/{c['best']['block_k']}/split {c['best']['split_k']})"
                         for c in r.get("cases", []) if "best" in c)
    if name == "serve":
        b1, b8 = r.get("batch_1", {}), r.get("batch_8", {})
        return (f"decode {b1.get('decode_tokens_per_s') or 0:.1f} tok/s (batch 1), "
                f"{b8.get('decode_tokens_per_s') or 0:.1f} (batch 8); gates {'passed' if r['gates_passed'] else 'FAILED'}")
    parts = []
    for a in ALGOS:
        c = r.get(a, {})
        if "error" in c:
            parts.append(f"{a} FAILED")
            continue
        q = c.get("weight_sqnr_db", {})
        sq = f", SQNR min {q['min']:.1f} / median {q['median']:.1f} dB" if "min" in q else ""
        parts.append(f"{a}: {c.get('digests_equal')}/{c.get('tensors')} digests equal{sq}")
    return "; ".join(parts)


def environment() -> dict:
    """Versions and the device (None without CUDA)."""
    import torch

    from compressor.runtime.triton_kernels import triton_available

    tv = None
    if triton_available():
        import triton

        tv = triton.__version__
    cuda = torch.cuda.is_available()
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "triton": tv, "cpu_count": os.cpu_count(),
            "device": torch.cuda.get_device_name(0) if cuda else None}


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit status (0 ok or no CUDA, 1 a step failed, 2 --require-cuda without CUDA)."""
    args = parse_args(argv)
    ctx = Context(args)
    report = {"schema": "kvq.gpu_check/1", **environment(), "out": str(args.out), "budget_s": args.budget_s,
              "args": {k: v for k, v in vars(args).items()}}
    if report["device"] is None:
        if args.require_cuda:
            print("gpu_check: no CUDA device (torch.cuda.is_available() is False); run on a CUDA machine "
                  "after `make install TORCH=torch`", file=sys.stderr)
            return 2
        report["steps"] = {s: skipped(NO_CUDA) for s in args.steps}
    else:
        from synthetic_model import filled_copy, needs_weights

        if needs_weights(Path(args.model)):  # a weightless folder (bench/synthetic_model.py prepare): fill a copy
            src, args.model = args.model, str(filled_copy(Path(args.model), args.work))
            report["synthetic_model"] = {"prepared": str(src), "filled": args.model,
                                         "note": "random weights: times and agreement only, quality figures mean nothing"}
        if "agreement" in args.steps and args.cpu_artifacts is None and not args.skip_cpu and not args.no_overlap:
            fg, bg = split_cores()
            if bg:
                os.sched_setaffinity(0, fg)  # this process and the GPU steps' commands; CPU artifacts on the rest
                ctx.cpu_jobs = CpuJobs(ctx, bg)
                ctx.cpu_jobs.thread.start()
                report["cpu_artifacts_overlap"] = {"gpu_steps_cores": sorted(fg), "cpu_artifact_cores": sorted(bg)}
        run_steps(ctx, STEP_FUNCS, report, args.out)
    report["elapsed_s"] = round(time.perf_counter() - ctx.start, 2)
    write_json(args.out, report)
    print("\n".join(summary_lines(report)))
    return 1 if any(r["status"] == "error" for r in report["steps"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
