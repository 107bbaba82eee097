"""Already-quantized sources (issue #15, item 5): ``kvq quantize SRC --recipe kv-fp8`` on a
compressed-tensors / AWQ / GPTQ artifact (kvq's or another tool's) calibrates the KV cache
on the weights as they are and carries every source tensor byte for byte; a weight recipe
on such a source is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from compressor.commands.options import QuantizeOptions
from compressor.commands.quantize import run_quantize
from compressor.artifact import load_artifact, read_kv_cache
from compressor.formats.compressed_tensors import kv_cache_scheme
from compressor.manifest import load_manifest
from compressor.quant.kv import FP8_MAX, make_spec
from compressor.safetensors_io import file_digest, read_header
from conftest import assert_clean_error, kvq_run as run

CALIB = dict(calib_samples=8, calib_seqlen=64)
CALIB_FLAGS = ["--calib-samples", "8", "--calib-seqlen", "64"]


def tensors(folder):
    """Every tensor of ``folder``'s shards: name -> (dtype, shape, stored bytes)."""
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        data = shard.read_bytes()
        out.update({n: (e.dtype, e.shape, data[e.start:e.end]) for n, e in read_header(shard).items()})
    return out


def kv_names(n_layers: int) -> set[str]:
    return {f"model.layers.{i}.self_attn.{leaf}" for i in range(n_layers) for leaf in ("k_scale", "v_scale")}


def quantize(src, out, *recipes, **kw):
    return run_quantize(QuantizeOptions(model=str(src), output=out, recipe=recipes, **kw))


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_model_dir):
    """kvq W4 artifacts of the tiny llama in each format, and the compressed-tensors one as
    another tool would leave it (no kvq manifest)."""
    root = tmp_path_factory.mktemp("packed")
    out = {}
    for fmt in ("compressed-tensors", "awq", "gptq"):
        out[fmt] = root / fmt
        quantize(tiny_model_dir, out[fmt], "w4a16-rtn-g64", group_size=32, format=fmt)
    out["foreign"] = root / "foreign"
    shutil.copytree(out["compressed-tensors"], out["foreign"])
    (out["foreign"] / "kvq-manifest.json").unlink()
    return out


@pytest.fixture(scope="module")
def fp8(sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("carried") / "w4-fp8kv"
    summary = quantize(sources["compressed-tensors"], out, "kv-fp8", **CALIB)
    return out, summary


def test_source_tensors_are_carried_byte_for_byte(sources, fp8):
    src, (out, summary) = tensors(sources["compressed-tensors"]), fp8
    got = tensors(out)
    assert any(n.endswith(".weight_packed") for n in src) and any(n.endswith(".weight_zero_point") for n in src)
    assert set(got) == set(src) | kv_names(2)
    for name, (dtype, shape, data) in src.items():
        assert got[name] == (dtype, shape, data), name  # same dtype, shape and stored bytes
    assert summary["source_loading"].startswith("streamed")


def test_kv_scales_are_calibrated_on_the_dequantized_weights(sources, fp8, tiny_model_dir):
    out, _ = fp8
    spec, scales = read_kv_cache(out)
    assert spec.scheme == "fp8" and spec.strategy == "tensor"
    h = read_header(out / "model.safetensors")
    assert h["model.layers.0.self_attn.k_scale"].shape == (1,) and h["model.layers.0.self_attn.k_scale"].dtype == "BF16"
    absmax = load_manifest(out).kv_cache["absmax"]
    for i, (k, v) in scales.items():
        assert torch.isfinite(k).all() and (k > 0).all() and (v > 0).all()
        want = torch.tensor(absmax[str(i)]["k"]).max() / FP8_MAX
        torch.testing.assert_close(k, want.to(torch.bfloat16).float().reshape(1), rtol=1e-2, atol=0)
    # the float path's pass over the source dequantized gives exactly these scales; over the float original, others
    from compressor.calib import load_text, sample_windows, tokenize
    from compressor.source.resolve import load_tokenizer
    from compressor.pipeline import quantize_model
    from compressor.recipe import load_recipes

    quantize(tiny_model_dir, out.parent / "float-fp8kv", "kv-fp8", **CALIB)
    assert load_manifest(out.parent / "float-fp8kv").kv_cache["absmax"] != absmax  # bf16 scales may round alike
    model, _ = load_artifact(sources["compressed-tensors"])
    ids = sample_windows(tokenize(load_tokenizer(sources["compressed-tensors"]), load_text("embedded", part="calib").text), 8, 64, 0)
    res = quantize_model(model, load_recipes(["kv-fp8"]), ids, dtype=torch.bfloat16)
    for i in scales:
        assert torch.equal(res.kv_scales[i][0].float().reshape(1), scales[i][0])
        assert torch.equal(res.kv_scales[i][1].float().reshape(1), scales[i][1])


def test_config_declares_the_kv_scheme_and_nothing_else_changes(sources, fp8):
    out, _ = fp8
    src = json.loads((sources["compressed-tensors"] / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"] == kv_cache_scheme(make_spec("fp8"))
    assert src["quantization_config"]["kv_cache_scheme"] is None
    cfg["quantization_config"]["kv_cache_scheme"] = None
    assert cfg == src
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (sources["compressed-tensors"] / name).read_bytes()


def test_manifest_records_the_source(sources, fp8):
    src, (out, summary) = sources["compressed-tensors"], fp8
    m = load_manifest(out)
    files = {p.name: file_digest(p) for p in src.iterdir() if p.is_file()}
    assert m.source["files"] == {"model.safetensors": files["model.safetensors"]}
    assert m.source["carried"]["files"] == files and m.source["spec"] == str(src.resolve())
    assert m.source["carried"]["kvq_manifest"]["content_digest"] == load_manifest(src).content_digest()
    q = m.quantization
    assert (q["algorithm"], q["format"], q["num_bits"], q["group_size"], q["symmetric"]) == ("carried", "compressed-tensors", 4, 32, False)
    assert q["source_algorithm"] == "rtn" and q["modules"] == 14 and "not re-quantized" in q["weights"]
    assert m.recipe["algorithm"] == "none" and m.calibration["samples"] == 8
    assert summary["quantization"] == q


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_verify_and_serve_smoke(sources, fp8, tiny_model_dir, capsys):
    out, _ = fp8
    code, stdout, err = run(["verify", out, "--seqlen", "128", "--max-windows", "2", "--json"], capsys)
    assert code == 0, err
    rep = json.loads(stdout)
    assert rep["reference_matches_source"] and rep["reference"] == str(sources["compressed-tensors"].resolve())
    assert rep["perplexity_breakdown"]["weights only"]["increase_pct"] == 0.0  # the reference is the packed source
    assert any("KV cache's cost only" in w for w in rep["warnings"])
    code, stdout, err = run(["verify", out, "--reference", tiny_model_dir, "--seqlen", "128", "--max-windows", "2", "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["perplexity_breakdown"]["weights only"]["increase_pct"] != 0.0  # weights vs the original
    code, stdout, err = run(["serve-smoke", out, "--max-new-tokens", "4", "--json"], capsys)
    assert code == 0, err
    smoke = json.loads(stdout)
    assert smoke["passed"] and any("is the quantized source" in w for w in smoke["warnings"])  # issue #45


@pytest.mark.parametrize("argv,pattern", [
    ([], "kvq does not quantize quantized weights again (recipe w4a16-awq asks for AWQ)"),
    (["--recipe", "w4a16-gptq", "--recipe", "kv-fp8"], "recipe w4a16-gptq+kv-fp8 asks for GPTQ"),
    (["--algorithm", "rtn", "--kv-scheme", "fp8"], "asks for RTN"),
    (["--algorithm", "none"], "has no KV-cache scheme: nothing to do"),
    (["--recipe", "kv-fp8", "--format", "gptq"], "keeps the source's compressed-tensors layout"),
    (["--recipe", "kv-fp8", "--dtype", "float16"], "carried as they are (bfloat16)"),
    (["--recipe", "kv-fp8", "--resume"], "keeps no layers to resume"),
    (["--recipe", "kv-fp8", "--set", "head.num_bits=8"], "the recipe's head: section cannot be applied"),
    (["--recipe", "kv-fp8", "--set", "kv_cache.key_rotation=pairs"], "key_rotation pairs cannot change them"),
])
def test_refusals(argv, pattern, sources, tmp_path, capsys):
    code, _, err = run(["quantize", sources["compressed-tensors"], "-o", tmp_path / "out", *argv], capsys)
    assert_clean_error(code, err, 2, pattern, tmp_path)
    assert len([ln for ln in err.strip().splitlines() if ln.startswith("kvq:")]) == 1
    if not argv:  # the default recipe: the message names the format, the bits and what to pass instead
        assert "compressed-tensors pack-quantized, 4-bit group 32 asymmetric" in err and "--recipe kv-fp8" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_awq_and_gptq_sources(fmt, sources, tmp_path, capsys):
    """No field for static KV scales in these formats (vLLM reads k_scale/v_scale only with
    compressed-tensors): fp8 is refused; the dynamic int8 scheme is carried in the manifest."""
    src = sources[fmt]
    code, _, err = run(["quantize", src, "--recipe", "kv-fp8", "-o", tmp_path / "fp8", *CALIB_FLAGS], capsys)
    assert_clean_error(code, err, 2, f"the {fmt} format has no field for static KV-cache scales", tmp_path)
    code, _, err = run(["quantize", src, "-o", tmp_path / "w"], capsys)
    assert_clean_error(code, err, 2, f"already quantized ({fmt}, 4-bit group 32", tmp_path)
    out = tmp_path / "int8"
    code, _, err = run(["quantize", src, "--recipe", "kv-int8", "-o", out], capsys)
    assert code == 0, err
    assert tensors(out) == tensors(src)
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    m = load_manifest(out)
    assert m.format == fmt and m.quantization["format"] == fmt and m.kv_cache["scheme"] == "int8"
    assert m.calibration is None  # dynamic scales: nothing was calibrated
    code, stdout, err = run(["verify", out, "--seqlen", "128", "--max-windows", "1", "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["kv_cache"]["scheme"].startswith("int8")


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_foreign_source_and_recalibration(sources, fp8, tmp_path, capsys):
    """Another tool's artifact (no kvq manifest) is carried and is verify's reference; a
    carried artifact given another scheme loses its old scales and declaration."""
    out = tmp_path / "foreign-fp8"
    code, _, err = run(["quantize", sources["foreign"], "--recipe", "kv-fp8", "-o", out, *CALIB_FLAGS], capsys)
    assert code == 0, err
    assert load_manifest(out).source["carried"]["kvq_manifest"] is None
    assert tensors(out) == tensors(fp8[0])  # the same packed tensors, the same calibration
    code, stdout, err = run(["verify", out, "--seqlen", "128", "--max-windows", "1", "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["reference_matches_source"] is True
    again = tmp_path / "int8"
    code, _, err = run(["quantize", fp8[0], "--recipe", "kv-int8", "-o", again], capsys)
    assert code == 0, err
    assert set(tensors(again)) == set(tensors(fp8[0])) - kv_names(2)
    assert json.loads((again / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] is None
    assert any("KV-cache scale tensors were replaced" in w for w in load_manifest(again).quality["warnings"])


def test_recalibrated_fp8_keeps_its_new_scales(fp8, tmp_path, capsys):
    """An fp8-KV artifact calibrated again with an fp8 scheme gets the new scales under the
    old names (the source's are left out, the new ones kept), so verify and serve-smoke accept it."""
    again = tmp_path / "fp8-again"
    code, _, err = run(["quantize", fp8[0], "--recipe", "kv-fp8", "-o", again, *CALIB_FLAGS], capsys)
    assert code == 0, err
    assert set(tensors(again)) == set(tensors(fp8[0]))
    assert kv_names(2) <= set(tensors(again))
    assert any("KV-cache scale tensors were replaced" in w for w in load_manifest(again).quality["warnings"])
    assert read_kv_cache(again) is not None
    code, _, err = run(["verify", again, "--weights-only"], capsys)
    assert code == 0, err


def test_streamed_equals_whole_model(sources, fp8, tmp_path):
    out = tmp_path / "whole"
    summary = quantize(sources["compressed-tensors"], out, "kv-fp8", stream=False, **CALIB)
    assert summary["source_loading"].startswith("whole model")
    assert {n: t.digest for n, t in load_manifest(out).tensors.items()} == \
           {n: t.digest for n, t in load_manifest(fp8[0]).tensors.items()}


def test_tampered_kvq_source_is_refused(sources, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(sources["compressed-tensors"], src)
    with open(src / "tokenizer.json", "a") as f:
        f.write(" ")
    code, _, err = run(["quantize", src, "--recipe", "kv-fp8", "-o", tmp_path / "out", *CALIB_FLAGS], capsys)
    assert_clean_error(code, err, 1, "does not match its kvq-manifest.json (tokenizer.json differs)", tmp_path)
    assert not (tmp_path / "out").exists()


def test_signed_carried_artifact(sources, tmp_path, capsys):
    from conftest import keypair

    priv, pub = keypair(tmp_path, "k")
    out = tmp_path / "signed"
    code, _, err = run(["quantize", sources["compressed-tensors"], "--recipe", "kv-int8", "-o", out,
                        "--sign-key", priv], capsys)
    assert code == 0, err
    code, _, err = run(["verify", out, "--hashes-only", "--public-key", pub], capsys)
    assert code == 0, err


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_kimi_k2_thinking_like_source(tmp_path, tokenizer, capsys):
    """Kimi K2 Thinking as published: DeepSeek-V3 MLA under model_type kimi_k2, INT4
    compressed-tensors weights written by another tool (no kvq manifest) and Kimi's
    tiktoken tokenizer with its custom code. The MLA latent cache gets one shared fp8
    scale per layer (equal k_scale and v_scale); the tokenizer files are carried and the
    converted tokenizer.json added, so verify (and vLLM) read it without the code."""
    from tiny_models import make_published, tiktoken_folder

    from compressor.source.resolve import KIMI_RESERVED

    ranks = tiktoken_folder(tmp_path / "tok", "the model 中文 " * 20)
    w4 = tmp_path / "k2t"  # an embedding row for every id the tiktoken tokenizer gives (its ranks, 256 reserved)
    quantize(make_published(tmp_path / "kimi", tokenizer, "kimi_k2", vocab_size=len(ranks) + KIMI_RESERVED), w4,
             "w4a16-rtn-g64", group_size=32)
    for f in ("kvq-manifest.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (w4 / f).unlink(missing_ok=True)
    for f in (tmp_path / "tok").iterdir():
        shutil.copy(f, w4 / f.name)
    out = tmp_path / "k2t-fp8kv"
    code, _, err = run(["quantize", w4, "--recipe", "kv-fp8", "-o", out, *CALIB_FLAGS], capsys)
    assert code == 0, err
    got, before = tensors(out), tensors(w4)
    assert set(got) == set(before) | kv_names(2) and all(got[n] == before[n] for n in before)
    _, scales = read_kv_cache(out)
    assert all(torch.equal(k, v) for k, v in scales.values())
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_k2"
    for f in ("tiktoken.model", "tokenization_kimi.py"):
        assert (out / f).read_bytes() == (w4 / f).read_bytes()
    assert (out / "tokenizer.json").is_file() and "auto_map" not in json.loads((out / "tokenizer_config.json").read_text())
    code, _, err = run(["verify", out, "--seqlen", "64", "--max-windows", "1", "--max-new-tokens", "4"], capsys)
    assert code == 0, err


def test_quantize_help_names_already_quantized_sources(capsys):
    code, out, _ = run(["quantize", "--help"], capsys)
    assert code == 0 and "already-quantized MODEL" in out and "weight recipe on it is refused" in " ".join(out.split())
