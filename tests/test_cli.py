"""CLI contract: one-line errors, exit codes 0/1/2, nothing written on error."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_clean_error, kvq_run as run


QUICK = ["--calib-samples", "4", "--calib-seqlen", "32", "--group-size", "32"]


@pytest.mark.parametrize("argv, pattern", [
    (["quantize"], "Missing argument 'MODEL'. (see 'kvq quantize --help')"),
    (["quantize", "m", "--shard-size", "12"], "below the 1 MB minimum (see 'kvq quantize --help')"),
    (["quantize", "m", "--bits", "x"], "'--bits'"),
    (["verify", "a", "--frobnicate"], "No such option '--frobnicate'. (see 'kvq verify --help')"),
    (["frob"], "No such command 'frob'. (see 'kvq --help')"),
    (["quantize", "m", "--calib-samples", "99999999999999999999"], "'--calib-samples'"),
    (["quantize", "m", "-o", "x", "--sign-password", "p"], "needs --sign-key"),
    (["sign", "a", "--identity-token", "t"], "only with --sigstore"),
    (["sign", "a", "--password", "p"], "needs --private-key"),
])
def test_usage_errors_are_one_line_exit_2(argv, pattern, capsys):
    code, out, err = run(argv, capsys)
    assert code == 2 and not out
    assert err.count("\n") == 1 and err.startswith("kvq: error:") and pattern in err, err


def test_help_mentions_every_command(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for cmd in ("quantize", "verify", "recipes"):
        assert cmd in out
    code, out, _ = run(["recipes"], capsys)
    assert code == 0 and "w4a16-awq" in out
    kinds = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.strip()}
    assert kinds["kv-fp8"] == kinds["kv-int8"] == "kv" and kinds["w4a16-rtn-g64"] == "rtn"  # Algorithm.quantizes_weights


def test_quantize_help_names_every_bundled_recipe(capsys):
    """``kvq quantize --help`` lists the recipes from the bundled folder (generated: it cannot drift), each whole
    (not broken at a hyphen by the wrapping), the FP4 AWQ and W4A4 ones included."""
    import re

    from compressor.recipe import RECIPE_DIR, bundled_recipes

    code, out, _ = run(["quantize", "--help"], capsys)
    names = sorted(p.name[:-len(".yaml")] for p in RECIPE_DIR.iterdir() if p.name.endswith(".yaml"))
    assert code == 0 and names == list(bundled_recipes())
    assert {"w4a16-nvfp4-awq", "w4a16-mxfp4-awq", "w4a4-nvfp4", "w4a4-nvfp4-gptq"} <= set(names)
    missing = [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", out)]
    assert not missing, out


def test_missing_model(tmp_path, capsys):
    code, _, err = run(["quantize", tmp_path / "nope", "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "not found", tmp_path)
    assert not (tmp_path / "out").exists()


def test_unreadable_gguf(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    code, _, err = run(["quantize", bad, "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "cannot read GGUF", tmp_path)
    bad.write_bytes(b"GGUF" + b"\x00" * 12)  # right magic, truncated body
    code, _, err = run(["quantize", bad, "-o", tmp_path / "out", "--algorithm", "rtn"], capsys)
    assert_clean_error(code, err, 2, "cannot load model", tmp_path)
    assert not (tmp_path / "out").exists()


def test_bad_safetensors_header(tmp_path, tiny_model_dir, capsys):
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    code, _, err = run(["quantize", model, "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "bad safetensors header", tmp_path)


def test_pickle_only_folder_refused(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04")
    code, _, err = run(["quantize", model, "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "pickle", tmp_path)


def test_empty_and_short_calibration(tmp_path, tiny_model_dir, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    code, _, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "out", "--calib", empty, *QUICK], capsys)
    assert_clean_error(code, err, 2, "is empty", tmp_path)
    short = tmp_path / "short.txt"
    short.write_text("just a few words")
    code, _, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "out", "--calib", short, *QUICK], capsys)
    assert_clean_error(code, err, 2, "shorter than one sample", tmp_path)
    code, _, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "out", "--calib", tmp_path / "x.csv", *QUICK], capsys)
    assert_clean_error(code, err, 2, "not found", tmp_path)
    assert not (tmp_path / "out").exists()


def test_jsonl_calibration_and_field(tmp_path, tiny_model_dir, capsys):
    from compressor.calib import load_text

    text = load_text("embedded").text
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps({"body": text[i : i + 500]}) for i in range(0, 20000, 500)))
    code, _, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "out", "--calib", f, *QUICK], capsys)
    assert_clean_error(code, err, 2, "no column 'text'", tmp_path)
    code, out, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "out", "--calib", f, "--calib-field", "body", "--json", *QUICK], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["calibration"]["source"] == str(f) and summary["calibration"]["samples"] == 4


def test_group_size_that_does_not_divide(tmp_path, tiny_model_dir, capsys):
    code, _, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "out", "--group-size", "48", "--algorithm", "rtn"], capsys)
    assert_clean_error(code, err, 2, "group_size 48 does not divide", tmp_path)
    assert "use --group-size" in err
    # a calibrated algorithm is refused before its calibration text is read (the README's promise)
    code, out, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "out", "--group-size", "48", "--algorithm", "awq",
                          "--calib-samples", "4", "--calib-seqlen", "32"], capsys)
    assert_clean_error(code, err, 2, "group_size 48 does not divide", tmp_path)
    assert "tokens from" not in out + err, out + err
    code, _, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "out", "--group-size", "big"], capsys)
    assert code == 2 and "Traceback" not in err


def test_output_exists_needs_overwrite(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    code, _, err = run(["quantize", tiny_model_dir, "-o", out, "--algorithm", "rtn", "--group-size", "32"], capsys)
    assert_clean_error(code, err, 2, "exists", tmp_path)
    assert (out / "keep.txt").exists()
    # --overwrite replaces only an earlier artifact (or an empty folder), never a folder of other files
    code, _, err = run(["quantize", tiny_model_dir, "-o", out, "--algorithm", "rtn", "--group-size", "32", "--overwrite"], capsys)
    assert_clean_error(code, err, 2, "is not a kvq artifact; refusing to overwrite it", tmp_path)
    assert (out / "keep.txt").exists()
    (out / "keep.txt").unlink()
    code, _, err = run(["quantize", tiny_model_dir, "-o", out, "--algorithm", "rtn", "--group-size", "32", "--overwrite"], capsys)
    assert code == 0, err
    code, _, err = run(["quantize", tiny_model_dir, "-o", out, "--algorithm", "rtn", "--group-size", "64", "--overwrite"], capsys)
    assert code == 0, err
    assert (out / "kvq-manifest.json").exists() and json.loads((out / "kvq-manifest.json").read_text())["quantization"]["group_size"] == 64


def test_bad_recipe(tmp_path, tiny_model_dir, capsys):
    r = tmp_path / "r.yaml"
    r.write_text("algorithm: awq\nweights:\n  num_bitz: 4\n")
    code, _, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "out", "--recipe", r], capsys)
    assert_clean_error(code, err, 2, "weights.num_bitz: unknown key", tmp_path)
    code, _, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "out", "--recipe", "no-such-recipe"], capsys)
    assert_clean_error(code, err, 2, "neither a file nor a bundled recipe", tmp_path)


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_verify_exit_codes(tmp_path, tiny_model_dir, capsys):
    code, _, err = run(["verify", tmp_path], capsys)
    assert_clean_error(code, err, 2, "no kvq-manifest.json")
    out = tmp_path / "a"
    code, _, err = run(["quantize", tiny_model_dir, "-o", out, *QUICK], capsys)
    assert code == 0, err
    code, out_json, err = run(["verify", out, "--seqlen", "64", "--max-windows", "2", "--json"], capsys)
    assert code == 0, err
    rep = json.loads(out_json)
    assert rep["passed"] and rep["perplexity"]["reference"] > 0
    code, _, err = run(["verify", out, "--seqlen", "64", "--max-windows", "2"], capsys)
    assert code == 0 and "window 2/2 evaluated" in err, err  # no terminal: one plain line per window
    code, _, err = run(["verify", out, "--seqlen", "64", "--max-windows", "2", "--max-ppl-increase", "-1"], capsys)
    assert code == 2  # click range check: usage error
    # a failed gate under --json: the JSON on stdout, and one stderr line naming the gate (a CI log's reason)
    code, out_json, err = run(["verify", out, "--seqlen", "64", "--max-windows", "2", "--max-mean-kl", "0", "--json"], capsys)
    failed = json.loads(out_json)["failed_gates"]
    assert code == 1 and failed and all(g in err for g in failed)
    assert err.strip().splitlines()[-1] == f"kvq: check failed: {', '.join(failed)} (details in the JSON)"
    code, _, err = run(["verify", out, "--hashes-only", "--device", "cuda"], capsys)  # no model runs: a note, not a refusal
    assert code == 0 and "--device cuda is not used" in err
    with open(out / "model.safetensors", "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")
    code, out_json, err = run(["verify", out, "--hashes-only", "--json"], capsys)
    assert code == 1
    assert json.loads(out_json)["hashes"]["modified_tensors"]
    assert err.strip() == "kvq: check failed: hashes (details in the JSON)"
    # a backend the device cannot run is refused before anything about the artifact is said
    monkey_env = os.environ.pop("TRITON_INTERPRET", None)
    try:
        code, _, err = run(["serve-smoke", out, "--backend", "triton", "--device", "cpu"], capsys)
    finally:
        if monkey_env is not None:
            os.environ["TRITON_INTERPRET"] = monkey_env
    if code != 2 or "triton" not in err:  # without the triton package the refusal names the package instead
        raise AssertionError(err)
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, err


def test_console_script_one_line_error(tmp_path):
    """The installed `kvq` entry point: exit 2, a single stderr line, no traceback."""
    exe = Path(sys.executable).with_name("kvq")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "compressor"]
    p = subprocess.run([*cmd, "quantize", str(tmp_path / "missing"), "-o", str(tmp_path / "o")], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("kvq: error:")


def test_set_and_flags_combine(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "a"
    code, o, err = run(["quantize", tiny_model_dir, "-o", out, "--set", "algorithm=gptq", "--set", "weights.num_bits=8",
                        "--bits", "3", "--json", *QUICK], capsys)
    assert code == 0, err
    q = json.loads(o)["quantization"]
    assert q["algorithm"] == "gptq" and q["num_bits"] == 3  # the explicit flag wins over --set of the same key
    code, o, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "b", "--kv-scheme", "int4", "--set", "kv_cache.residual_length=64",
                        "--algorithm", "rtn", "--act-order", "--json", *QUICK], capsys)
    assert code == 0, err
    s = json.loads(o)
    assert any("--act-order" in w for w in s["warnings"])
    assert json.loads((tmp_path / "b" / "kvq-manifest.json").read_text())["kv_cache"]["residual_length"] == 64


@pytest.mark.parametrize("argv,pattern", [
    (["verify", "ART", "--kv-budget-gib", "nan"], "finite"),
    (["verify", "ART", "--max-ppl-increase", "inf"], "finite"),
])
def test_non_finite_options(tmp_path, capsys, argv, pattern):
    code, _, err = run([a if a != "ART" else tmp_path for a in argv], capsys)
    assert code == 2 and pattern in err and "Traceback" not in err


def test_output_checks_before_work(tmp_path, tiny_model_dir, capsys):
    code, _, err = run(["quantize", tiny_model_dir, "-o", "/proc/kvq-out", "--algorithm", "rtn", "--group-size", "32"], capsys)
    assert_clean_error(code, err, 2, "cannot write into /proc")
    code, _, err = run(["quantize", tiny_model_dir, "-o", tiny_model_dir, "--overwrite", "--algorithm", "rtn"], capsys)
    assert_clean_error(code, err, 2, "is (or contains) the source model")
    assert (tiny_model_dir / "config.json").exists()
    code, _, err = run(["quantize", tiny_model_dir, "-o", tiny_model_dir / "w4", "--algorithm", "rtn"], capsys)
    assert_clean_error(code, err, 2, "is inside the source model folder")
    assert not (tiny_model_dir / "w4").exists() and not list(tiny_model_dir.glob(".w4*"))


def test_pattern_matching_nothing_is_refused(tmp_path, tiny_model_dir, capsys):
    """The pattern is printed as the recipe has it: no quotes, no doubled backslashes (not its Python repr)."""
    r = tmp_path / "typo.yaml"
    r.write_text("algorithm: rtn\nweights: {num_bits: 4, group_size: 32}\n"
                 "overrides:\n  - targets: ['re:.*\\.downproj']\n    weights: {num_bits: 8}\n")
    code, _, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "out", "--recipe", r], capsys)
    assert_clean_error(code, err, 2, "recipe overrides[0].targets: re:.*\\.downproj matches no decoder linear",
                       tmp_path)


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_verify_detects_a_changed_source(tmp_path, tokenizer, capsys):
    from conftest import make_model_dir

    src = make_model_dir(tmp_path / "src", tokenizer)
    out = tmp_path / "a"
    code, _, err = run(["quantize", src, "-o", out, "--algorithm", "rtn", "--group-size", "32"], capsys)
    assert code == 0, err
    other = make_model_dir(tmp_path / "other", tokenizer, seed=5)
    code, o, err = run(["verify", out, "--seqlen", "64", "--max-windows", "1", "--reference", other,
                        "--max-ppl-increase", "1000", "--json"], capsys)
    rep = json.loads(o)
    assert rep["reference_matches_source"] is False and "not the model that was quantized" in rep["warnings"][0]
    shutil.rmtree(src)
    make_model_dir(src, tokenizer, seed=5)  # the recorded source is replaced by another model
    code, _, err = run(["verify", out, "--seqlen", "64", "--max-windows", "1"], capsys)
    assert code == 1 and "source changed since quantization" in err


def _kvq_popen(*args):
    exe = Path(sys.executable).with_name("kvq")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "compressor"]
    return subprocess.Popen([*cmd, *map(str, args)], stderr=subprocess.PIPE, text=True)


SIGTERM_ARGS = ("--calib-samples", "512", "--calib-seqlen", "64", "--group-size", "32")


@pytest.mark.slow  # spawns kvq processes (make test-fast leaves it out)
def test_sigterm_before_any_layer_exits_143_and_leaves_nothing(tmp_path, tiny_model_dir):
    """SIGTERM while the model loads: exit 143, no artifact and no staging folder left."""
    import signal

    p = _kvq_popen("quantize", tiny_model_dir, "-o", tmp_path / "o", *SIGTERM_ARGS)
    first = p.stderr.readline()  # printed before the model loads; the handler is installed by then
    assert first, "kvq printed nothing"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    err = first + err
    assert p.returncode == 143, err
    assert "terminated; no artifact was written" in err and not list(tmp_path.iterdir()), err


@pytest.mark.slow  # spawns kvq processes (make test-fast leaves it out)
def test_sigterm_after_a_layer_keeps_the_checkpoint_and_resume_finishes(tmp_path, tiny_model_dir, capsys):
    """SIGTERM (a preempted CI job) once a layer is checkpointed: exit 143, no artifact, the
    staging folder kept and named; the same command with --resume then completes and verifies."""
    import json
    import signal
    import time

    out = tmp_path / "o"
    staging = tmp_path / ".o.kvq-partial"
    p = _kvq_popen("quantize", tiny_model_dir, "-o", out, *SIGTERM_ARGS)
    deadline = time.monotonic() + 300
    while p.poll() is None and time.monotonic() < deadline:
        try:
            if json.loads((staging / "resume.json").read_text())["layers_done"] >= 1:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    assert p.poll() is None, "kvq finished before a checkpoint was seen"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    assert [q.name for q in tmp_path.iterdir()] == [staging.name], err
    last = err.strip().splitlines()[-1]  # one line says it all: where the layers are kept, what to run
    assert last.startswith("kvq: terminated after ") and f"kept in {staging}" in last, err
    assert "no artifact was written: rerun the same command with --resume to continue" in last, err
    assert "kvq: stopped" not in err, err
    code, _, err = run(["quantize", tiny_model_dir, "-o", out, *SIGTERM_ARGS, "--resume"], capsys)
    assert code == 0, err
    assert "resuming:" in err and not staging.exists()
    code, _, err = run(["verify", out, "--hashes-only"], capsys)
    assert code == 0, err


def test_a_recipe_that_is_not_utf8_is_an_input_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe\x00")
    code, _, err = run(["quantize", "m", "-o", tmp_path / "x", "--recipe", bad], capsys)
    assert_clean_error(code, err, 2, "cannot read recipe")


def test_options_take_flat_keywords_and_refuse_in_one_place():
    """Library callers get the command line's refusals (OptionError, exit 2), named by option."""
    from compressor.commands.options import OptionError, QuantizeOptions, VerifyOptions

    q = QuantizeOptions(model="m", output="o", calib_samples=8, group_size="64", recipe="w4a16-gptq")
    assert (q.calibration.samples, q.scheme.group_size, q.scheme.recipes) == (8, 64, ("w4a16-gptq",))
    for kw, words in ((dict(calib_samples=0), "calib_samples"), (dict(group_size="big"), "--group-size"),
                      (dict(activation_budget_gib=float("nan")), "finite"), (dict(digest_algorithm="md5"), "md5")):
        with pytest.raises(OptionError, match=words) as e:
            QuantizeOptions(model="m", output="o", **kw)
        assert e.value.exit_code == 2
    with pytest.raises(OptionError, match="--no-manifest needs --reference"):
        VerifyOptions(artifact="a", no_manifest=True)
    with pytest.raises(OptionError, match="--min-top1 cannot be evaluated with --hashes-only"):
        VerifyOptions(artifact="a", hashes_only=True, min_top1=50)


def test_allocator_defaults_keep_the_users_value():
    """The entry point turns on torch's huge-page allocation unless the user chose otherwise."""
    from compressor.entry import ALLOCATOR_ENV, allocator_defaults

    env = {}
    assert allocator_defaults(env) == ALLOCATOR_ENV and env == {"THP_MEM_ALLOC_ENABLE": "1"}
    env = {"THP_MEM_ALLOC_ENABLE": "0"}
    assert allocator_defaults(env) == {} and env == {"THP_MEM_ALLOC_ENABLE": "0"}


def test_malloc_defaults_keep_the_users_value(monkeypatch):
    """The entry point sets glibc's mmap/trim thresholds unless the user set their variables;
    where the C library has no mallopt nothing is applied."""
    import ctypes

    from compressor.entry import MALLOC_SETTINGS, malloc_defaults

    calls = []

    class Libc:
        class mallopt:  # noqa: N801 - stands for the C function
            def __new__(cls, param, value):
                calls.append((param, value))
                return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc)
    assert malloc_defaults({}) == {k: v for k, (_, v) in MALLOC_SETTINGS.items()}
    assert calls == list(MALLOC_SETTINGS.values())
    calls.clear()
    assert malloc_defaults({"MALLOC_TRIM_THRESHOLD_": "0"}) == {
        k: v for k, (_, v) in MALLOC_SETTINGS.items() if k != "MALLOC_TRIM_THRESHOLD_"}
    assert (-1, (1 << 31) - 1) not in calls

    class NoMallopt:
        pass

    monkeypatch.setattr(ctypes, "CDLL", lambda name: NoMallopt)
    assert malloc_defaults({}) == {}


def test_frozen_gc_leaves_an_outer_freeze_to_its_owner():
    """The layer loop's freeze undoes itself when nothing was frozen before it (library use), and
    leaves the CLI's frozen libraries frozen until the CLI releases them before exit."""
    import gc

    from compressor.gc_policy import frozen_gc, release_frozen, settled_gc

    release_frozen()
    with frozen_gc():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with settled_gc():
        assert not gc.isenabled()
        keep = [object() for _ in range(10)]  # noqa: F841
    assert gc.isenabled() and gc.get_freeze_count() > 0
    with frozen_gc():
        pass
    assert gc.get_freeze_count() > 0
    release_frozen()
    assert gc.get_freeze_count() == 0
