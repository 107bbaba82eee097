"""kvq verify statistics, gates and reports (issue #7)."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from compressor.commands.options import VerifyOptions
from compressor.commands.verify import run_verify
from compressor.errors import InputError
from compressor.evaluate import hidden_state_errors
from compressor.prompts import BUILTIN_PROMPTS, load_prompts
from compressor.report import VerifyReport, json_schema
from compressor.stats import first_divergence, kl_and_top1, relative_error, summarize, weight_error, weight_stats
from conftest import kvq_run as run

REPO = Path(__file__).resolve().parents[1]
FAST = ["--seqlen", "64", "--max-windows", "3", "--max-new-tokens", "6", "--hidden-batches", "1"]


# --- statistics against hand-computed values ----------------------------------------------

def test_kl_and_top1_by_hand():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]])
    q = torch.tensor([[0.25, 0.5, 0.25], [0.1, 0.2, 0.7]])
    kl, same = kl_and_top1(p.log(), q.log() + 3.0)  # logits: any additive constant
    expected0 = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5) + 0.25 * math.log(1.0)
    assert kl[0].item() == pytest.approx(expected0, abs=1e-6)  # 0.25 ln 2 = 0.1733
    assert kl[1].item() == pytest.approx(0.0, abs=1e-7)
    assert same.tolist() == [False, True]
    with pytest.raises(ValueError):
        kl_and_top1(p, q[:1])


def test_summarize_by_hand():
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["mean"] == pytest.approx(22.0) and s["median"] == 3.0 and s["max"] == 100.0 and s["min"] == 1.0
    # linear interpolation: position 0.99 * 4 = 3.96 -> 4 + 0.96 * (100 - 4)
    assert s["p99"] == pytest.approx(4 + 0.96 * 96)
    assert summarize([])["count"] == 0


def test_weight_error_and_sqnr_by_hand():
    e = weight_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 3.0]))
    assert e["rel_fro"] == pytest.approx(0.2)
    assert e["sqnr_db"] == pytest.approx(10 * math.log10(25.0))  # 13.98 dB
    assert weight_error(torch.ones(3), torch.ones(3)) == {"rel_fro": 0.0, "sqnr_db": math.inf}
    assert relative_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 3.0])) == pytest.approx(0.2)


@pytest.mark.parametrize("shape", [(37, 11), (5, 3, 4), (50,), ()])
def test_weight_statistics_by_blocks_equal_the_whole_tensor(shape, monkeypatch):
    """weight_error and weight_stats read a block of rows at a time (a large LM head never
    exists whole in float64): the figures are the whole-tensor float64 ones; a NaN still shows."""
    import compressor.stats as stats

    g = torch.Generator().manual_seed(len(shape))
    w = torch.randn(shape, generator=g) * 3 + 0.5
    w_hat = (w + 0.1 * torch.randn(shape, generator=g)).bfloat16()
    x, e = w.double().flatten(), w_hat.double().flatten() - w.double().flatten()
    mu = float(x.mean())
    var = float((x - mu).pow(2).mean())
    monkeypatch.setattr(stats, "STATS_BLOCK", 7)  # several blocks of rows (one row when a row is longer)
    got = weight_error(w, w_hat)
    assert got["rel_fro"] == pytest.approx(math.sqrt(float(e.pow(2).sum()) / float(x.pow(2).sum())), rel=1e-12)
    s = weight_stats(w)
    assert s["mean"] == pytest.approx(mu, rel=1e-12) and s["std"] == pytest.approx(math.sqrt(var), rel=1e-12)
    assert s["absmax"] == float(x.abs().max())
    if x.numel() > 1:
        assert s["kurtosis"] == pytest.approx(float((x - mu).pow(4).mean()) / var**2 - 3.0, rel=1e-9, abs=1e-12)
    w64, hat64 = w.double(), w_hat.double()  # float64 arguments (quality.py passes them): read, never changed
    keep = (w64.clone(), hat64.clone())
    assert weight_error(w64, hat64) == got and weight_stats(hat64) == weight_stats(w_hat)
    assert torch.equal(w64, keep[0]) and torch.equal(hat64, keep[1])
    if len(shape) > 1:
        w_hat = w_hat.clone()
        w_hat.view(-1)[-1] = float("nan")  # in the last block
        assert math.isnan(weight_error(w, w_hat)["rel_fro"]) and math.isnan(weight_stats(w_hat)["absmax"])


def test_weight_stats_by_hand():
    s = weight_stats(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert s["mean"] == 2.5 and s["absmax"] == 4.0
    assert s["std"] == pytest.approx(math.sqrt(1.25))
    assert s["kurtosis"] == pytest.approx(2.5625 / 1.5625 - 3.0)  # -1.36
    assert weight_stats(torch.full((5,), 2.0))["kurtosis"] is None
    g = weight_stats(torch.randn(200_000, generator=torch.Generator().manual_seed(0)))
    assert abs(g["kurtosis"]) < 0.05  # Gaussian: excess kurtosis 0


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_hidden_state_errors_by_hand(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    x = torch.randint(0, 100, (1, 16))
    assert hidden_state_errors(ref, other, x) == [0.0] * ref.config.num_hidden_layers
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.mul_(1.1)
    errs = hidden_state_errors(ref, other, x)
    assert errs[0] == 0.0 and errs[1] > 0.0
    got = []
    h = ref.model.layers[1].register_forward_hook(lambda m, i, o: got.append(o[0] if isinstance(o, tuple) else o))
    ref(x)
    h.remove()
    h = other.model.layers[1].register_forward_hook(lambda m, i, o: got.append(o[0] if isinstance(o, tuple) else o))
    other(x)
    h.remove()
    assert errs[1] == pytest.approx(float((got[1] - got[0]).detach().norm() / got[0].detach().norm()), rel=1e-4)


# --- verify end to end ------------------------------------------------------------------

@pytest.fixture(scope="module")
def awq_art(tmp_path_factory, tiny_model_dir):
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize

    out = tmp_path_factory.mktemp("v") / "awq"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, algorithm="awq", group_size=32,
                                 calib_samples=4, calib_seqlen=32))
    return out


def test_awq_scales_are_undone_for_weight_statistics(awq_art):
    """Weight errors measured by verify agree with those the quantizer recorded (AWQ-folded space)."""
    from compressor.manifest import load_manifest

    rep = run_verify(VerifyOptions(artifact=awq_art, weights_only=True))
    w = rep["weights"]
    assert w["awq_scales_undone"] and rep["mode"] == "weights-only" and "perplexity" not in rep
    recorded = {row["layer"]: row["mean_rel_error"] for row in load_manifest(awq_art).quality["layers"]}
    for row in w["layers"]:
        assert row["mean_rel_fro"] == pytest.approx(recorded[row["layer"]], rel=0.05)
    for t in w["tensors"]:
        assert t["sqnr_db"] == pytest.approx(-20 * math.log10(t["rel_fro"]))
        assert t["artifact"]["std"] == pytest.approx(t["original"]["std"], rel=0.1)


def test_full_verify_report_fields_and_schema(awq_art, capsys, tmp_path):
    code, out, err = run(["verify", awq_art, *FAST, "--json", "--report", tmp_path / "rep"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    VerifyReport.model_validate(rep)
    assert rep["schema_version"] == "kvq.verify-report/1" and rep["mode"] == "full"
    d = rep["distribution"]
    assert d["kl"]["count"] == 3 * 63 and 0 <= d["kl"]["median"] <= d["kl"]["p99"] <= d["kl"]["max"]
    assert 0 <= d["top1_agreement_pct"] <= 100
    assert len(rep["per_window"]) == 3 and rep["per_window"][0]["ppl_reference"] > 0
    assert len(rep["hidden_state_error"]["per_layer"]) == 2
    assert rep["drift"]["prompts"] == len(BUILTIN_PROMPTS) and rep["drift"]["max_new_tokens"] == 6
    names = {p.name for p in (tmp_path / "rep").iterdir()}
    assert {"report.md", "report.html", "report.json", "kl_histogram.png", "perplexity_per_window.png",
            "layer_errors.png"} <= names
    for png in (tmp_path / "rep").glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "PASSED" in md and "KL mean" in md and "top-1 agreement" in md
    assert "data:image/png;base64," in (tmp_path / "rep" / "report.html").read_text()


def test_verify_report_schema_in_docs_is_current():
    committed = json.loads((REPO / "docs" / "verify-report.schema.json").read_text())
    assert committed == json.loads(json.dumps(json_schema())), "regenerate: python -m compressor.report > docs/verify-report.schema.json"
    props = set(committed["properties"])
    # the stable top-level contract of kvq.verify-report/1
    assert {"schema_version", "artifact", "mode", "passed", "signature", "hashes", "gates", "failed_gates", "perplexity",
            "distribution", "per_window", "weights", "hidden_state_error", "drift", "kv_cache", "seconds"} <= props


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_gates_pass_and_fail_each_named(awq_art, capsys):
    code, out, err = run(["verify", awq_art, *FAST, "--json", "--max-mean-kl", "0", "--min-top1", "100.0",
                          "--min-sqnr-db", "99", "--max-hidden-error", "0", "--min-median-divergence", "6",
                          "--max-p99-kl", "10"], capsys)
    rep = json.loads(out)
    assert code == 1
    assert set(rep["failed_gates"]) >= {"max_mean_kl", "min_sqnr_db", "max_hidden_error"}
    assert {g["name"] for g in rep["gates"]} >= {"min_median_divergence", "max_p99_kl", "finite_weights"}
    assert "max_p99_kl" not in rep["failed_gates"]
    sq = next(g for g in rep["gates"] if g["name"] == "min_sqnr_db")
    assert "below" in sq["detail"] and "model.layers." in sq["detail"]
    code, out, err = run(["verify", awq_art, *FAST, "--max-mean-kl", "0"], capsys)
    assert code == 1 and "gate failed" in err and "max_mean_kl" in err
    code, out, err = run(["verify", awq_art, *FAST, "--max-mean-kl", "5", "--min-top1", "1", "--min-sqnr-db", "1"], capsys)
    assert code == 0, err


def test_recipe_gates_are_used_without_flags(awq_art, tmp_path, capsys):
    art = shutil.copytree(awq_art, tmp_path / "a")
    m = json.loads((art / "kvq-manifest.json").read_text())
    m["recipe"]["gates"]["min_sqnr_db"] = 99.0
    from compressor.artifact import build_manifest

    fields = {k: v for k, v in m.items() if k not in ("files", "tensors", "provenance", "digest_algorithm", "schema_version")}
    (art / "kvq-manifest.json").write_text(build_manifest(art, fields).to_json())
    code, out, err = run(["verify", art, "--weights-only", "--json"], capsys)
    assert code == 1 and json.loads(out)["failed_gates"] == ["min_sqnr_db"]
    code, out, err = run(["verify", art, "--weights-only", "--min-sqnr-db", "1"], capsys)  # a flag wins
    assert code == 0, err


def test_corrupted_but_hash_valid_resigned_artifact_is_caught_by_statistics(awq_art, tmp_path, capsys):
    """An insider perturbs one module's weights, rewrites the manifest and re-signs: signature and digests
    pass, the statistics gates do not."""
    from safetensors.torch import load_file, save_file

    from compressor.artifact import build_manifest
    from compressor.manifest import load_manifest
    from compressor.signing import SignOptions, sign_folder

    from conftest import keypair

    art = shutil.copytree(awq_art, tmp_path / "a")
    t = load_file(str(art / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    t[name] = t[name] * 1.6
    save_file(t, str(art / "model.safetensors"), metadata={"format": "pt"})
    old = load_manifest(art)
    fields = {k: v for k, v in old.model_dump().items()
              if k not in ("files", "tensors", "provenance", "digest_algorithm", "schema_version")}
    (art / "kvq-manifest.json").write_text(build_manifest(art, fields).to_json())
    priv, pub = keypair(tmp_path, "insider")
    sign_folder(art, SignOptions(private_key=priv))
    code, out, err = run(["verify", art, *FAST, "--public-key", pub, "--json", "--min-sqnr-db", "12",
                          "--max-mean-kl", "0.05"], capsys)
    rep = json.loads(out)
    assert rep["signature"]["ok"] and rep["hashes"]["ok"]
    assert code == 1
    assert "min_sqnr_db" in rep["failed_gates"]
    sq = next(g for g in rep["gates"] if g["name"] == "min_sqnr_db")
    assert "model.layers.1.mlp.down_proj.weight" in sq["detail"]
    clean = run_verify(VerifyOptions(artifact=awq_art, weights_only=True))
    assert clean["weights"]["min_sqnr_db"] > 12  # the untouched artifact passes the same gate


def test_kv_artifact_reports_breakdown(tiny_model_dir, tmp_path, capsys):
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize

    out = tmp_path / "kv"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, algorithm="rtn", group_size=32, kv_scheme="int4",
                                 calib_samples=4, calib_seqlen=32))
    code, stdout, err = run(["verify", out, "--seqlen", "160", "--max-windows", "1", "--max-new-tokens", "4",
                             "--hidden-batches", "1", "--json"], capsys)
    assert code == 0, err
    rep = json.loads(stdout)
    assert rep["distribution"]["measured_on"] == "weights + KV"
    assert set(rep["distribution"]["breakdown"]) == {"weights only", "weights + KV", "KV only"}
    assert rep["drift"]["measured_on"] == "weights + KV"


def test_prompts_files(tmp_path, capsys, awq_art):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "Hello"}\n\n{"prompt": "World"}\n')
    assert load_prompts(good) == ["Hello", "World"]
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\n two \n")
    assert load_prompts(txt) == ["one", " two "]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": 1}\n')
    code, _, err = run(["verify", awq_art, *FAST, "--prompts", bad], capsys)
    assert code == 2 and "bad.jsonl:2" in err and "Traceback" not in err
    empty = tmp_path / "e.txt"
    empty.write_text("\n\n")
    code, _, err = run(["verify", awq_art, *FAST, "--prompts", empty], capsys)
    assert code == 2 and "no prompts" in err
    code, _, err = run(["verify", awq_art, *FAST, "--prompts", tmp_path / "missing.txt"], capsys)
    assert code == 2 and "not found" in err
    assert_pipe_prompts(tmp_path)


def assert_pipe_prompts(tmp_path):
    """A named pipe (what a shell's ``<(...)`` hands over) is read like a file; a folder is refused."""
    import os
    import threading

    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("from a pipe\nsecond\n"))
    writer.start()
    assert load_prompts(fifo) == ["from a pipe", "second"]
    writer.join(timeout=10)
    with pytest.raises(InputError, match="is a folder"):
        load_prompts(tmp_path)


def test_hashes_only_and_weights_only_are_exclusive(awq_art, capsys):
    code, _, err = run(["verify", awq_art, "--hashes-only", "--weights-only"], capsys)
    assert code == 2 and "Traceback" not in err


@pytest.mark.parametrize("argv,msg", [
    (["--hashes-only", "--min-sqnr-db", "10"], "--min-sqnr-db cannot be evaluated with --hashes-only"),
    (["--weights-only", "--max-mean-kl", "0.1"], "--max-mean-kl cannot be evaluated"),
    (["--weights-only", "--max-ppl-increase", "5"], "--max-ppl-increase cannot be evaluated"),
    (["--weights-only", "--kv-scheme", "int8"], "--kv-scheme applies to the evaluation, which --weights-only does not"),
    (["--hashes-only", "--kv-scheme", "fp8"], "--kv-scheme applies to the evaluation, which --hashes-only does not"),
    ([*FAST, "--min-median-divergence", "7"], "could never pass"),
])
def test_gate_flags_that_cannot_be_evaluated_are_refused(awq_art, capsys, argv, msg):
    code, out, err = run(["verify", awq_art, *argv], capsys)
    assert code == 2 and msg in err and "Traceback" not in err


def test_kv_only_artifact_refuses_weight_gates(tiny_model_dir, tmp_path, capsys):
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize

    out = tmp_path / "kvonly"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, recipe="kv-int8"))
    code, _, err = run(["verify", out, "--weights-only", "--min-sqnr-db", "20"], capsys)
    assert code == 2 and "no quantized weights" in err


def test_report_and_json_out_inside_the_artifact_are_refused(awq_art, capsys):
    for argv in (["--report", awq_art / "report"], ["--report", awq_art], ["--json-out", awq_art / "v.json"]):
        code, _, err = run(["verify", awq_art, "--weights-only", *argv], capsys)
        assert code == 2 and "inside the artifact" in err
    assert not (awq_art / "report").exists() and not (awq_art / "v.json").exists()


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_nan_in_artifact_fails_every_way(awq_art, tmp_path, capsys):
    """A NaN scale (manifest rewritten, so digests pass) fails verify, names the tensor, and the JSON stays valid."""
    from safetensors.torch import load_file, save_file

    from compressor.artifact import build_manifest
    from compressor.manifest import load_manifest

    art = shutil.copytree(awq_art, tmp_path / "a")
    t = load_file(str(art / "model.safetensors"))
    t["model.layers.0.mlp.up_proj.weight_scale"][0, 0] = float("nan")
    save_file(t, str(art / "model.safetensors"), metadata={"format": "pt"})
    old = load_manifest(art)
    fields = {k: v for k, v in old.model_dump().items()
              if k not in ("files", "tensors", "provenance", "digest_algorithm", "schema_version")}
    (art / "kvq-manifest.json").write_text(build_manifest(art, fields).to_json())
    code, out, err = run(["verify", art, "--weights-only", "--min-sqnr-db", "15", "--json"], capsys)
    rep = json.loads(out)  # strict JSON: no NaN literals
    assert code == 1 and ": NaN" not in out and "Infinity" not in out
    assert rep["nonfinite_tensors"] == ["model.layers.0.mlp.up_proj.weight"]
    assert set(rep["failed_gates"]) == {"finite_weights", "min_sqnr_db"}
    code, out, err = run(["verify", art, *FAST, "--json", "--report", tmp_path / "rep"], capsys)
    assert code == 1 and "Traceback" not in err and "internal error" not in err
    assert (tmp_path / "rep" / "report.md").is_file() and "FAILED" in (tmp_path / "rep" / "report.md").read_text()
    VerifyReport.model_validate(json.loads((tmp_path / "rep" / "report.json").read_text()))


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_reference_may_be_an_artifact(awq_art, capsys):
    """An artifact verified against itself: zero error everywhere."""
    code, out, err = run(["verify", awq_art, *FAST, "--reference", awq_art, "--json"], capsys)
    rep = json.loads(out)
    assert code == 0, err
    assert rep["distribution"]["kl"]["max"] < 1e-6 and rep["distribution"]["top1_agreement_pct"] == 100.0
    assert rep["weights"]["tensors"] == []  # identical weights: nothing quantized relative to it


def test_invalid_recipe_gates_in_manifest_are_input_errors(awq_art, tmp_path, capsys):
    from compressor.artifact import build_manifest

    art = shutil.copytree(awq_art, tmp_path / "a")
    m = json.loads((art / "kvq-manifest.json").read_text())
    m["recipe"]["gates"]["max_ppl_increase_pct"] = "abc"
    fields = {k: v for k, v in m.items() if k not in ("files", "tensors", "provenance", "digest_algorithm", "schema_version")}
    (art / "kvq-manifest.json").write_text(build_manifest(art, fields).to_json())
    code, _, err = run(["verify", art, "--weights-only"], capsys)
    assert code == 2 and "recipe.gates.max_ppl_increase_pct" in err


def test_the_gate_table_names_every_recipe_gate_and_option():
    """compressor.gates is the one list of gates: the recipe's gates block, the verify and
    serve-smoke options and their flags all follow it."""
    from compressor.commands.options import SmokeGateOptions, VerifyGateOptions
    from compressor.gates import gate, gates_of, recipe_gate_names
    from compressor.recipe import Gates

    assert recipe_gate_names() == tuple(Gates.model_fields)
    assert tuple(VerifyGateOptions.model_fields) == tuple(g.option for g in gates_of("verify", configurable=True))
    assert tuple(SmokeGateOptions.model_fields) == tuple(g.option for g in gates_of("serve-smoke", configurable=True))
    assert gate("min_sqnr_db").passes(20.0, 15.0) and not gate("min_sqnr_db").passes(None, 15.0)
    assert gate("max_mean_kl").symbol == "<=" and gate("min_top1_agreement_pct").flag == "--min-top1"


def test_verify_threads_sets_torch_threads_and_is_range_checked(awq_art, capsys, monkeypatch):
    """``kvq verify --threads N`` runs torch's operations on N threads (``--weights-only`` too);
    0 is a usage error (one line, exit 2)."""
    before = torch.get_num_threads()
    seen = []
    import compressor.commands.verify as v

    real = v._plan

    def plan(*a, **kw):
        seen.append(torch.get_num_threads())
        return real(*a, **kw)

    monkeypatch.setattr(v, "_plan", plan)
    try:
        n = 2 if before == 1 else 1  # not the caller's count, so the check can fail
        code, _, err = run(["verify", awq_art, "--weights-only", "--threads", str(n)], capsys)
        assert code == 0, err
        assert seen == [n] and torch.get_num_threads() == before  # the run's own; the caller keeps its setting
    finally:
        torch.set_num_threads(before)
    code, _, err = run(["verify", awq_art, "--weights-only", "--threads", "0"], capsys)
    assert code == 2 and "--threads" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
