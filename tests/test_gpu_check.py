"""bench/gpu_check.py on CPU (CI has no GPU): options, bandwidth arithmetic, JSON, skipping without
CUDA, the step runner, the quantize/serve/agreement steps run on CPU against a tiny model (their
CPU twin: the same commands with --device cpu), the Triton numerics under TRITON_INTERPRET=1."""

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_check as gc  # noqa: E402
import gpu_check_triton as gct  # noqa: E402

from compressor.runtime.triton_kernels import triton_available  # noqa: E402


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ---------------------------------------------------------------------------------------
# pure parts


def test_parse_args_defaults_and_refusals(capsys):
    a = gc.parse_args([])
    assert a.steps == gc.STEPS and a.batches == (1, 8, 64) and a.budget_s == 450
    assert a.out == REPO / "bench" / "results" / "gpu_check.json" and a.samples == 32 and a.seqlen == 512
    assert gc.parse_args(["--steps", "serve,triton"]).steps == ("triton", "serve")  # run order, not typed order
    for bad, msg in ((["--steps", "triton,gpu"], "unknown step gpu"), (["--batches", "1,x"], "--batches"),
                     (["--budget-s", "0"], "must be positive"), (["--frobnicate"], "unrecognized")):
        with pytest.raises(SystemExit) as e:
            gc.parse_args(bad)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_bytes_moved_by_hand():
    # 576 x 576, group 64, batch 1: packed 576*576/2 = 165,888; scales + zeros 2 * 576 * 9 * 2 = 20,736;
    # activations 576 * 2 = 1,152; output 576 * 2 = 1,152
    assert gct.w4a16_bytes(1, 576, 576, 64) == 165_888 + 20_736 + 1_152 + 1_152 == 188_928
    # N 4096 x K 11008, group 64 (172 groups), batch 8: 22,544,384 + 2 * 4096 * 172 * 2 = 2,818,048
    # + 8 * 11008 * 2 = 176,128 + 8 * 4096 * 2 = 65,536
    assert gct.w4a16_bytes(8, 4096, 11008, 64) == 22_544_384 + 2_818_048 + 176_128 + 65_536
    assert gct.fp16_bytes(1, 1536, 576) == 2 * (1536 * 576 + 576 + 1536)
    with pytest.raises(ValueError, match="multiple of 8"):
        gct.w4a16_bytes(1, 64, 60, 60)
    with pytest.raises(ValueError):
        gct.w4a16_bytes(1, 64, 96, 64)
    # weight copies for timing: more than 3x the L2 cache, at least 1, at most 1024
    assert gct._copies(25 * 2**20, 50 * 2**20) == 6 and gct._copies(10**9, 50 * 2**20) == 1
    assert gct._copies(1000, 50 * 2**20) == 1024


def test_sqnr_by_hand():
    ref = torch.tensor([1.0, 0.0, 0.0])
    assert gc.sqnr_db(ref, torch.tensor([1.1, 0.0, 0.0])) == pytest.approx(20.0)  # 1 / 0.01
    assert gc.sqnr_db(ref, torch.tensor([1.0, 0.1, 0.1])) == pytest.approx(10 * math.log10(1 / 0.02))
    assert gc.sqnr_db(ref, ref.clone()) is None


def test_write_json_is_strict_and_atomic(tmp_path):
    out = tmp_path / "sub" / "g.json"
    gc.write_json(out, {"a": float("nan"), "b": [float("inf"), 1.5], "c": (1, 2), "p": tmp_path, "d": {3: None}})
    assert json.loads(out.read_text()) == {"a": None, "b": [None, 1.5], "c": [1, 2], "p": str(tmp_path), "d": {"3": None}}
    assert [p.name for p in out.parent.iterdir()] == ["g.json"]


def test_resolve_calib_and_same_inputs_on_both_devices(tmp_path):
    a = gc.parse_args(["--shared", str(tmp_path)])
    assert gc.resolve_calib(a) == "embedded"
    (tmp_path / "wikitext-2").mkdir()
    (tmp_path / "wikitext-2" / "valid.txt").write_text("text\n")
    assert gc.resolve_calib(a) == str((tmp_path / "wikitext-2" / "valid.txt").resolve())
    assert gc.resolve_calib(gc.parse_args(["--calib", "c.jsonl"])) == "c.jsonl"
    cpu, cuda = (gc.quantize_argv(a, "gptq", d, tmp_path / d) for d in ("cpu", "cuda"))
    diff = [(x, y) for x, y in zip(cpu, cuda) if x != y]
    assert diff == [("cpu", "cuda"), (tmp_path / "cpu", tmp_path / "cuda")]
    assert cpu[cpu.index("--recipe") + 1] == "w4a16-gptq" and cpu[cpu.index("--calib-samples") + 1] == 32


# ---------------------------------------------------------------------------------------
# without CUDA; the step runner


def test_no_cuda_every_step_skipped_exit_0(no_cuda, tmp_path, capsys):
    out = tmp_path / "g.json"
    assert gc.main(["--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["device"] is None and rep["schema"] == "kvq.gpu_check/1"
    assert rep["steps"] == {s: {"status": "skipped", "reason": "no CUDA device"} for s in gc.STEPS}
    printed = capsys.readouterr().out
    assert "no GPU" in printed and all(s in printed for s in gc.STEPS)
    assert gc.main(["--out", str(out), "--steps", "serve"]) == 0
    assert list(json.loads(out.read_text())["steps"]) == ["serve"]


def test_no_cuda_require_cuda_exit_2_one_line(no_cuda, tmp_path, capsys):
    out = tmp_path / "g.json"
    assert gc.main(["--out", str(out), "--require-cuda"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no CUDA device" in err and not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")
def test_script_exit_codes_as_a_process(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--require-cuda", "--out",
                           str(tmp_path / "g.json")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_run_steps_records_errors_and_spends_the_budget(tmp_path):
    args = gc.parse_args(["--steps", "triton,quantize,serve", "--budget-s", "100"])
    calls = []

    def boom(ctx):
        calls.append("triton")
        raise ValueError("boom\nsecond line")

    def fine(ctx):
        calls.append("quantize")
        ctx.deadline = time.perf_counter() - 1  # this step spends the rest of the budget
        return {"x": 1}

    out = tmp_path / "g.json"
    rep = gc.run_steps(gc.Context(args), {"triton": boom, "quantize": fine, "serve": None}, {}, out)
    st = rep["steps"]
    assert calls == ["triton", "quantize"]
    assert st["triton"]["status"] == "error" and st["triton"]["error"] == "ValueError: boom"
    assert st["quantize"]["status"] == "ok" and st["quantize"]["x"] == 1 and st["quantize"]["seconds"] >= 0
    assert st["serve"] == {"status": "skipped", "reason": "time budget of 100 s spent before this step"}
    assert json.loads(out.read_text())["steps"]["serve"]["status"] == "skipped"
    lines = gc.summary_lines({**rep, "device": None, "out": str(out)})
    assert any(line.startswith("triton") and "ValueError: boom" in line for line in lines)


def test_split_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert gc.split_cores() == (set(range(4)), set(range(4, 16)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6}, raising=False)
    assert gc.split_cores() == (None, None)


def test_main_with_a_device_overlaps_the_cpu_artifacts_and_exits_1_on_an_error(monkeypatch, tmp_path):
    """main()'s CUDA branch with the steps and the device faked: the CPU artifacts are made in the
    background on their own cores while the steps run; a failed step makes the exit status 1."""
    here = os.sched_getaffinity(0)
    cmds = []

    def fake_kvq(argv, log_file, timeout, env=None, cores=None):
        cmds.append((argv, cores, env))
        return {"command": "kvq", "rc": 0, "wall_s": 1.0, "json": {"wall_seconds": 1.0}, "stderr_tail": None,
                "log": str(log_file)}

    monkeypatch.setattr(gc, "environment", lambda: {"device": "Fake GPU"})
    monkeypatch.setattr(gc, "split_cores", lambda: (here, here))
    monkeypatch.setattr(gc, "run_kvq", fake_kvq)
    monkeypatch.setitem(gc.STEP_FUNCS, "triton", lambda ctx: {"rows": [], "copy_bandwidth_gb_s": 1.0,
                                                              "moe": {"status": "not present"}})
    out = tmp_path / "g.json"
    code = gc.main(["--out", str(out), "--steps", "triton,agreement", "--work", str(tmp_path / "w")])
    rep = json.loads(out.read_text())
    assert rep["cpu_artifacts_overlap"] == {"gpu_steps_cores": sorted(here), "cpu_artifact_cores": sorted(here)}
    assert [(c[0][0], c[0][c[0].index("--device") + 1]) for c in cmds] == [("quantize", "cpu")] * 2
    assert all(c[1] == here and c[2] == {"OMP_NUM_THREADS": str(len(here))} for c in cmds)
    ag = rep["steps"]["agreement"]
    assert rep["steps"]["triton"]["status"] == "ok" and ag["status"] == "error"  # no CUDA artifacts to compare
    assert set(ag["cpu_artifacts"]) == set(gc.ALGOS) and "kvq-manifest.json" in ag["error"] and code == 1
    monkeypatch.setitem(gc.STEP_FUNCS, "agreement", lambda ctx: {})
    assert gc.main(["--out", str(out), "--steps", "triton,agreement", "--skip-cpu"]) == 0


def test_summary_table_of_a_full_gpu_report():
    """The table's formatting on figures shaped like a GPU run's (which CI cannot produce)."""
    row = {"n": 4096, "k": 11008, "m": 1, "group_size": 64, "kernel": "gemv", "max_abs_err_vs_torch": 1e-3,
           "max_abs_err_vs_reference": 5e-4, "max_abs_output": 3.0, "timing": "cuda-graph", "weight_copies": 8,
           "bytes_moved": 25_000_000, "triton_us": 9.5, "triton_gb_s": 2600.0, "fraction_of_copy_bw": 0.62,
           "torch_dequant_us": 80.0, "speedup_vs_torch_dequant": 8.4, "fp16_linear_us": 24.0,
           "fp16_fraction_of_copy_bw": 0.88, "speedup_vs_fp16_linear": 2.5}
    q = {"rc": 0, "wall_s": 41.2}
    rep = {"device": "NVIDIA H200", "out": "g.json", "steps": {
        "triton": {"status": "ok", "seconds": 30.0, "copy_bandwidth_gb_s": 4200.0, "rows": [row],
                   "moe": {"status": "not present"}},
        "quantize": {"status": "error", "seconds": 80.0, "awq": q, "gptq": {"error": "TimeoutError: x"}},
        "serve": {"status": "ok", "seconds": 40.0, "gates_passed": True, "batch_1": {"decode_tokens_per_s": 210.0},
                  "batch_8": {"decode_tokens_per_s": 1500.0}},
        "agreement": {"status": "ok", "seconds": 3.0,
                      "awq": {"tensors": 273, "digests_equal": 63, "weight_sqnr_db": {"min": 25.0, "median": 38.0}},
                      "gptq": {"tensors": 273, "digests_equal": 273, "weight_sqnr_db": {"note": "identical"}}}}}
    text = "\n".join(gc.summary_lines(rep))
    for part in ("NVIDIA H200", "copy BW 4200 GB/s", "MoE kernel not present", "awq 41 s", "gptq FAILED",
                 "decode 210.0 tok/s (batch 1), 1500.0 (batch 8)", "63/273 digests equal, SQNR min 25.0 / median 38.0",
                 "gptq: 273/273", "4096x11008", "gemv", "62"):
        assert part in text, part


# ---------------------------------------------------------------------------------------
# the quantize / serve / agreement steps on CPU (tiny model, kvq's CLI in this process)


def _kvq_in_process(argv, log_file, timeout, env=None, cores=None):
    from compressor.cli import main

    out, err, t0 = io.StringIO(), io.StringIO(), time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in argv])
            rc = 0
        except SystemExit as e:
            rc = e.code or 0
    js = json.loads(out.getvalue()) if out.getvalue().strip() else None
    tail = err.getvalue().strip().splitlines()[-1:] if rc else []
    return {"command": " ".join(["kvq", *map(str, argv)]), "rc": rc, "wall_s": time.perf_counter() - t0,
            "json": js, "stderr_tail": tail[0] if tail else None, "log": str(log_file)}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("gpucheck")
    args = gc.parse_args(["--model", str(tiny_model_dir), "--calib", "embedded", "--samples", "4", "--seqlen", "32",
                          "--work", str(work), "--steps", "quantize,serve,agreement", "--no-overlap"])
    ctx = gc.Context(args)
    ctx.device = "cpu"
    mp = pytest.MonkeyPatch()
    mp.setattr(gc, "run_kvq", _kvq_in_process)
    try:
        rep = gc.run_steps(ctx, gc.STEP_FUNCS, {"device": "cpu (test)", "out": str(work / "g.json")}, work / "g.json")
    finally:
        mp.undo()
    return rep, work


@pytest.mark.slow  # the GPU check's CPU twin or a Triton step in a subprocess (make test-fast leaves it out)
def test_cpu_twin_quantize_and_serve(cpu_run):
    rep, work = cpu_run
    q, s = rep["steps"]["quantize"], rep["steps"]["serve"]
    assert q["status"] == "ok", q
    for algo, recipe in gc.ALGOS.items():
        assert q[algo]["rc"] == 0 and f"--recipe {recipe}" in q[algo]["command"] and "--device cpu" in q[algo]["command"]
        assert q[algo]["summary"]["wall_seconds"] > 0 and (work / "cuda" / algo / "kvq-manifest.json").is_file()
    assert s["status"] == "ok", s
    assert s["artifact"] == str(work / "cuda" / "awq") and s["rc"] in (0, 1)
    assert s["batch_1"]["decode_tokens_per_s"] > 0 and s["batch_8"]["decode_tokens_per_s"] > 0 and s["kernels"]


@pytest.mark.slow  # the GPU check's CPU twin or a Triton step in a subprocess (make test-fast leaves it out)
def test_cpu_twin_agreement(cpu_run):
    rep, work = cpu_run
    a = rep["steps"]["agreement"]
    assert a["status"] == "ok", a
    assert set(a["cpu_artifacts"]) == set(gc.ALGOS) and all(r["rc"] == 0 for r in a["cpu_artifacts"].values())
    for algo in gc.ALGOS:  # the same inputs on the same device: byte-identical (kvq's determinism)
        assert a[algo]["digests_equal"] == a[algo]["tensors"] > 0, a[algo]
        assert "identical" in a[algo]["weight_sqnr_db"]["note"]
    assert "digests equal" in "\n".join(gc.summary_lines(rep))


@pytest.mark.slow  # the GPU check's CPU twin or a Triton step in a subprocess (make test-fast leaves it out)
def test_compare_artifacts_sqnr_and_manifest_only(cpu_run, tmp_path):
    _, work = cpu_run
    # AWQ vs GPTQ artifacts of the same model: same tensor names, other weights -> finite SQNR per Linear
    c = gc.compare_artifacts(work / "cpu" / "awq", work / "cpu" / "gptq")
    assert 0 <= c["digests_equal"] < c["tensors"] and c["differing"]
    sq = c["weight_sqnr_db"]
    assert sq["modules"] == 14 and sq["not_compared"] == 0 and sq["identical"] == 0  # 7 Linears x 2 layers
    assert math.isfinite(sq["min"]) and sq["min"] <= sq["median"] and sq["worst_module"].startswith("model.layers.")
    only = tmp_path / "manifest-only"
    only.mkdir()
    shutil.copy(work / "cpu" / "gptq" / "kvq-manifest.json", only)
    c2 = gc.compare_artifacts(only, work / "cpu" / "awq")
    assert c2["digests_equal"] == c["digests_equal"] and "manifest only" in c2["weight_sqnr_db"]["note"]
    # past the deadline the digests are still counted, the artifacts not loaded (the first GPU run
    # was killed loading them after its budget)
    c3 = gc.compare_artifacts(work / "cpu" / "awq", work / "cpu" / "gptq", seconds_left=lambda: 0.0)
    assert c3["digests_equal"] == c["digests_equal"] and "time budget" in c3["weight_sqnr_db"]["note"]


@pytest.mark.slow  # the GPU check's CPU twin or a Triton step in a subprocess (make test-fast leaves it out)
def test_agreement_skips_and_uses_given_cpu_artifacts(cpu_run):
    _, work = cpu_run
    args = gc.parse_args(["--work", str(work), "--skip-cpu"])
    assert gc.step_agreement(gc.Context(args)) == {"status": "skipped", "reason": "--skip-cpu and no --cpu-artifacts"}
    args = gc.parse_args(["--work", str(work), "--cpu-artifacts", str(work / "cpu")])
    res = gc.step_agreement(gc.Context(args))
    assert res["cpu_artifacts"] == "given (--cpu-artifacts)" and res["awq"]["digests_equal"] == res["awq"]["tensors"]
    args = gc.parse_args(["--work", str(work / "nothing")])
    assert gc.step_serve(gc.Context(args))["status"] == "skipped"


# ---------------------------------------------------------------------------------------
# the Triton step's numerics under the interpreter (as tests/test_runtime.py runs the kernels)


_INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, sys, types, torch
    sys.path.insert(0, "bench")
    import gpu_check_triton as gct
    import triton_bench
    rows = []
    for n, k, g, m in ((48, 64, 32, 1), (40, 96, 32, 8), (64, 128, 64, 20)):
        w = gct.random_weight(n, k, g, "cpu", torch.Generator().manual_seed(n))
        row, parts = gct.case_numerics(w, m)
        assert parts["tri"].kernel == "triton-w4a16" and parts["deq"].kernel == "dequant"
        rows.append(row)
    # the step's loop on CPU: CUDA-only parts stubbed (time: each call once, 1 us; L2 of 1 KiB -> 1-2 copies)
    calls = []
    def fake_time(fns, reps, graph=True):
        calls.append(len(fns))
        for f in fns:
            assert f().shape[1] in (40, 48)
        return 1e-6, "stub"
    gct.time_calls, gct.l2_cache_bytes, gct.SHAPES = fake_time, lambda: 1024, ((40, 64), (48, 96))
    gct.MOE_SHAPES, gct.MOE_TOKENS = (("tiny-gate_up", 6, 48, 64, 2),), (1, 3)
    triton_bench.copy_bandwidth = lambda: 1e12
    args = types.SimpleNamespace(batches=(1, 3), group_size=32, reps=2)
    ctx = types.SimpleNamespace(args=args, device="cpu", remaining=lambda: 100.0)
    step = gct.step_triton(ctx)
    print(json.dumps({"rows": rows, "step": step, "calls": calls}))
""")


@pytest.mark.skipif(not triton_available(), reason="triton is an optional extra")
@pytest.mark.slow  # the GPU check's CPU twin or a Triton step in a subprocess (make test-fast leaves it out)
def test_triton_step_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = out["rows"]
    assert [(r["m"], r["kernel"]) for r in rows] == [(1, "gemv"), (8, "gemv"), (20, "gemm")]
    for r in rows:
        # float32 accumulation in both; a layout or indexing error would be of the order of the output
        tol = 2 ** -9 * r["max_abs_output"] + 1e-3
        assert r["max_abs_err_vs_reference"] <= tol and r["max_abs_err_vs_torch"] <= 2 * tol, r
        assert r["max_abs_output"] > 0.1
    step = out["step"]
    assert step["moe"]["status"] == "present" and "moe_w4a16" in step["moe"]["names"]
    moe = step["moe"]["rows"]
    assert [(r["name"], r["tokens"], r["experts_routed"] <= min(6, 2 * r["tokens"])) for r in moe] == [
        ("tiny-gate_up", 1, True), ("tiny-gate_up", 3, True)]
    for r in moe:  # the grouped kernel against its torch reference, both timed by the stub (1 us)
        assert r["max_abs_err_vs_reference"] <= 2 ** -9 * r["max_abs_output"] + 1e-3 and r["max_abs_output"] > 0.1
        assert r["bytes_moved"] == gct.moe_bytes(r) and r["speedup_vs_torch_reference"] == pytest.approx(1.0)
    assert step["copy_bandwidth_gb_s"] == 1000 and "note" not in step
    assert [(r["n"], r["k"], r["m"]) for r in step["rows"]] == [(40, 64, 1), (40, 64, 3), (48, 96, 1), (48, 96, 3)]
    r = step["rows"][0]
    # 40 x 64 g32, m=1: 1,280 packed + 320 scales/zeros + 128 + 80 bytes, each path 1 us; copies: 3 x 1 KiB / layer bytes
    assert r["bytes_moved"] == 1280 + 320 + 128 + 80 and r["triton_us"] == pytest.approx(1.0)
    assert r["fraction_of_copy_bw"] == pytest.approx(1808 / 1e-6 / 1e12) and r["weight_copies"] == 2
    assert r["timing"] == "stub" and r["speedup_vs_fp16_linear"] == pytest.approx(1.0)
    # triton layer 1,600 bytes, dequant layer 2,800 (int8 codes, fp16 scales, int8 zeros), fp16 weight 5,120
    assert out["calls"][:3] == [2, 2, 1] and len(out["calls"]) == 3 * 4 + 2 * 2 and out["calls"][-4:] == [1] * 4


def test_synthetic_model_prepare_fill(tiny_model_dir, tmp_path):
    """A weightless copy of a model (config + tokenizer) gets seeded random weights of the same
    shape, the same each time (the GPU check's stand-in where the real weights cannot go)."""
    import synthetic_model as sm
    from transformers import AutoModelForCausalLM

    prep = sm.prepare(str(tiny_model_dir), tmp_path / "prep")
    assert sm.needs_weights(prep) and (prep / "tokenizer.json").is_file()
    a = sm.filled_copy(prep, tmp_path / "w1")
    b = sm.filled_copy(prep, tmp_path / "w2")
    assert not sm.needs_weights(a) and sm.needs_weights(prep)  # the prepared folder stays weightless
    ma, mb = (AutoModelForCausalLM.from_pretrained(f) for f in (a, b))
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert ma.config.hidden_size == ref.config.hidden_size and ma.dtype == torch.bfloat16
    sa, sb = ma.state_dict(), mb.state_dict()
    assert sa.keys() == ref.state_dict().keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert "torch.manual_seed(0)" in (a / sm.MARKER).read_text()


_SWEEP_SCRIPT = textwrap.dedent("""
    import json, sys, types, torch
    sys.path.insert(0, "bench")
    import gpu_check_triton as gct
    times = iter(range(100, 0, -1))  # stub timings: each later configuration 1 us faster
    def fake_time(fns, reps, graph=True):
        for f in fns:
            f()
        return next(times) * 1e-6, "stub"
    gct.time_calls, gct.SWEEP_CASES = fake_time, ((48, 64, 1), (40, 96, 3))
    gct.SWEEP_GRID = ((16, 16, 1, 4), (16, 32, 2, 4), (32, 16, 4, 4))
    args = types.SimpleNamespace(group_size=32, reps=5)
    ctx = types.SimpleNamespace(args=args, device="cpu", remaining=lambda: 100.0)
    print(json.dumps(gct.step_sweep(ctx)))
""")


@pytest.mark.skipif(not triton_available(), reason="triton is an optional extra")
@pytest.mark.slow  # the GPU check's CPU twin or a Triton step in a subprocess (make test-fast leaves it out)
def test_sweep_step_under_interpreter():
    """The config sweep runs every candidate (and the chosen one first) through the kernel, checks
    each against the reference and names the fastest."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _SWEEP_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])["cases"]
    assert [(c["n"], c["k"], c["m"]) for c in cases] == [(48, 64, 1), (40, 96, 3)]
    for c in cases:
        rows = c["configs"]
        assert len(rows) == 4 and all("us" in r for r in rows), rows  # the chosen config + 3 candidates
        assert (rows[0]["block_n"], rows[0]["block_k"], rows[0]["split_k"]) == (
            c["chosen"]["block_n"], c["chosen"]["block_k"], c["chosen"]["split_k"])
        assert c["best"] == rows[-1] and c["chosen_us"] == rows[0]["us"]
        assert max(r["max_abs_err_vs_reference"] for r in rows) < 0.05


def test_out_is_checked_before_any_step(tmp_path, capsys):
    """A report path that cannot be written fails in argparse's one line (exit 2) before any step:
    on a GPU machine a typo would otherwise cost the first step's result and the rest of the run."""
    (tmp_path / "file").write_text("")
    for out, why in ((tmp_path, "is a folder"), (tmp_path / "file" / "g.json", "is a file, not a folder")):
        with pytest.raises(SystemExit) as e:
            gc.parse_args(["--out", str(out)])
        assert e.value.code == 2 and why in capsys.readouterr().err
    assert not list(tmp_path.parent.glob(tmp_path.name + ".tmp"))  # no probe left beside the folder
    a = gc.parse_args(["--out", str(tmp_path / "new" / "g.json")])  # a missing folder is made
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())
