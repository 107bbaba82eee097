"""Streamed verify (issue #43): both models advancing one decoder layer at a time give the
whole-model figures (perplexity, KL, top-1 per window, per-layer hidden-state error, weight
statistics), with and without a quantized KV cache fed in chunks."""

from __future__ import annotations

import pytest
import torch

from compressor.artifact import load_artifact, read_kv_cache
from compressor.arch import get_arch
from compressor.calib import load_text, tokenize
from compressor.commands.kv_only import PackedCheckpoint, find_packed
from compressor.errors import InputError
from compressor.evaluate import compare, hidden_state_errors, windows
from compressor.source.open import load_model
from compressor.source.resolve import ModelSource, resolve_source
from compressor.quant.kv import quantized_cache
from compressor.quality import weight_report, weight_summary
from compressor.streamed_eval import memory_plan, open_model, streamed_compare
from conftest import assert_same_eval, assert_same_report, close_figures, make_model_dir, quantize_tiny



@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, tokenizer):
    """A 3-layer tiny llama with an fp8 KV cache artifact of it (RTN W4, group 32)."""
    root = tmp_path_factory.mktemp("streamed")
    src = make_model_dir(root / "model", tokenizer, num_hidden_layers=3, tie_word_embeddings=False)
    return src, quantize_tiny(root / "art", src, kv_scheme="fp8")


def _streamed(src, art, dtype=torch.float32):
    ref, _ = open_model(resolve_source(str(src)), torch.float32, "reference")
    a, tok = open_model(ModelSource(str(art), "hf", art), dtype, "artifact", ckpt=PackedCheckpoint(find_packed(str(art))))
    return ref, a, tok


@pytest.mark.parametrize("kv", [False, True], ids=["float-kv", "fp8-kv"])
@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_streamed_figures_equal_the_whole_model(tiny_pair, kv):
    src, art = tiny_pair
    ref_whole = load_model(resolve_source(str(src)))[0]
    art_whole, tok = load_artifact(art)
    wins = windows(tokenize(tok, load_text("embedded", part="eval").text), 64, 3)
    kv_info = read_kv_cache(art)
    layout = get_arch("llama").kv_layout(ref_whole.config)
    make_cache = (lambda: quantized_cache(kv_info[0], 3, kv_info[1], layout)) if kv else None
    whole = {"weights only": (art_whole, None)}
    if kv:
        whole.update({"weights + KV": (art_whole, make_cache), "KV only": (ref_whole, make_cache)})
    want = compare(ref_whole, whole, wins, kv_chunk=16)
    want_hidden = hidden_state_errors(ref_whole, art_whole, wins[:2, :32])

    ref, a, _ = _streamed(src, art)
    cands = {label: ("reference" if m is ref_whole else "artifact", mc) for label, (m, mc) in whole.items()}
    seen = []
    got = streamed_compare(ref, a, cands, wins, kv_chunk=16, hidden_of="weights only", hidden_rows=(2, 32),
                           on_layer=lambda i, lr, la: seen.append((i, lr.self_attn.q_proj.weight.is_meta)))
    assert_same_eval(got["results"], want)
    assert got["hidden_state_error"] == pytest.approx(want_hidden, rel=1e-4)
    assert seen == [(0, False), (1, False), (2, False)]  # each layer read when its turn came
    assert got["nonfinite_tensors"] == []
    assert all(p.is_meta for p in a.layers.parameters()) and all(p.is_meta for p in ref.layers.parameters())


def test_streamed_weight_statistics_equal_the_whole_model(tiny_pair):
    src, art = tiny_pair
    want = weight_report(load_model(resolve_source(str(src)))[0], load_artifact(art)[0], "rtn")
    ref, a, tok = _streamed(src, art)
    tensors = []
    wins = windows(tokenize(tok, load_text("embedded", part="eval").text), 16, 1)
    streamed_compare(ref, a, {"weights only": ("artifact", None)}, wins, on_layer=lambda i, lr, la: tensors.extend(
        weight_report(ref.model, a.model, "rtn", layers=[(i, lr, la)])["tensors"]))
    got = weight_summary(tensors, False, False)
    assert [t["name"] for t in got["tensors"]] == [t["name"] for t in want["tensors"]]
    assert [t["sqnr_db"] for t in got["tensors"]] == pytest.approx([t["sqnr_db"] for t in want["tensors"]], rel=1e-6)
    assert got["min_sqnr_db"] == pytest.approx(want["min_sqnr_db"], rel=1e-6)
    assert got["layers"] == want["layers"]


def test_memory_plan_counts_one_layer_of_each_model(tiny_pair):
    src, art = tiny_pair
    ref, a, _ = _streamed(src, art)
    plan = memory_plan(ref, a, 2, 64, ["reference", "artifact"])
    layer = sum(p.numel() for p in ref.layers[0].parameters()) * 4
    assert plan.layers == 2 * layer  # both read in float32
    assert plan.hidden == 2 * 2 * 2 * 64 * 64 * 4
    assert plan.peak < plan.whole + plan.hidden
    assert "at peak" in plan.describe()
    assert plan.weight_stats == 0
    q_proj = ref.model.model.layers[0].self_attn.q_proj.weight.numel()
    # gate_proj's AWQ-undone float32 copy, or three float64 copies of q_proj (the RoPE-pair fit), + float64 row blocks
    assert memory_plan(ref, a, 2, 64, ["reference"], weight_stats=True).weight_stats == (
        max(4 * 128 * 64, 3 * 8 * q_proj) + 3 * 8 * 128 * 64)


def test_rows_the_streamed_path_does_not_run_are_refused():
    from transformers import CONFIG_MAPPING

    from compressor.streamed_eval import check_streamable

    class M:
        config = CONFIG_MAPPING["glm_moe_dsa"](num_hidden_layers=3, index_topk_freq=2)

    assert M.config.indexer_types == ["full", "full", "shared"]
    with pytest.raises(InputError, match="glm_moe_dsa with decoder layer 2 reusing"):
        check_streamable(M)
    M.config = CONFIG_MAPPING["glm_moe_dsa"](num_hidden_layers=3)  # every layer its own indexer: streamed
    check_streamable(M)


# --- kvq verify --stream ----------------------------------------------------------------

def _verify_json(capsys, art, *extra):
    import json

    from conftest import kvq_run

    code, out, err = kvq_run(["verify", art, "--seqlen", "96", "--max-windows", "3", "--max-new-tokens", "4",
                              "--hidden-batches", "2", "--kv-chunk", "32", "--json", *extra], capsys)
    assert code == 0, err
    return json.loads(out), err


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_verify_stream_reports_the_whole_model_figures(tiny_pair, capsys):
    _, art = tiny_pair
    want, _ = _verify_json(capsys, art)
    got, err = _verify_json(capsys, art, "--stream")
    assert_same_report(got, want)
    assert want["drift"] is not None and got["drift"] is None
    s = got["evaluated_in"]["streamed"]
    assert s["why"] == "--stream" and s["greedy_drift"].startswith("skipped")
    assert s["memory_plan"]["peak_gib"] > 0
    assert any("greedy drift not measured" in w for w in got["warnings"])
    weights_only, _ = _verify_json(capsys, art, "--stream", "--weights-only")
    assert weights_only["weights"]["tensors"] == got["weights"]["tensors"]


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_verify_streams_by_itself_when_the_models_do_not_fit(tiny_pair, capsys, monkeypatch):
    import compressor.commands.verify_streamed as vs

    _, art = tiny_pair
    monkeypatch.setattr(vs, "_available_bytes", lambda: 2**20)  # a machine with 1 MiB free
    got, err = _verify_json(capsys, art)
    assert "more than the 0.0 GiB this machine has available" in got["evaluated_in"]["streamed"]["why"]
    from conftest import kvq_run

    code, _, err = kvq_run(["verify", art, "--seqlen", "96", "--max-windows", "1", "--weights-only"], capsys)
    assert code == 0, err
    assert "streamed verify (the two models need about" in err and "GiB at peak: one decoder layer of each model" in err


def test_verify_refuses_a_budget_below_the_smallest_unit(tiny_pair, capsys):
    from conftest import assert_clean_error, kvq_run

    _, art = tiny_pair
    code, _, err = kvq_run(["verify", art, "--stream", "--memory-budget-gib", "0.0123456789", "--max-windows", "1"],
                           capsys)
    # the budget is echoed as typed (``:g`` would print 0.0123457)
    assert_clean_error(code, err, 2, "--memory-budget-gib 0.0123456789 cannot hold streamed verify's smallest unit: ")
    # the figure quoted is the one compared with the budget: the peak less the process's own baseline
    import re

    from compressor.streamed_eval import BASELINE_BYTES, GIB

    line = " ".join(err.split())
    found = re.search(r"smallest unit: (\S+) GiB at peak besides the process's own (\S+) GiB, which the budget does "
                      r"not count: .*; give --memory-budget-gib (\S+) or more", line)
    assert found, line
    assert 0.0123456789 < float(found[1]) < BASELINE_BYTES / GIB and found[3] == found[1]
    assert float(found[2]) == BASELINE_BYTES / GIB
    code, _, err = kvq_run(["verify", art, "--stream", "--min-median-divergence", "2", "--max-windows", "1"], capsys)
    assert_clean_error(code, err, 2, "--min-median-divergence cannot be evaluated by streamed verify")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "glm4", "glm4_moe",
                                        "deepseek_v3", "mixtral", "qwen3_moe", "glm_moe_dsa", "deepseek_v32"])
@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_every_tiny_row_streams_to_the_whole_model_report(model_type, tmp_path, tokenizer):
    """Each architecture row with its tiny model (tests/tiny_models.py), RTN W4 with an fp8 KV cache:
    the streamed report's statistics are the whole-model report's."""
    from compressor.commands.options import QuantizeOptions, VerifyOptions
    from compressor.commands.quantize import run_quantize
    from compressor.commands.verify import run_verify
    from tiny_models import make_dir

    src = make_dir(tmp_path / "src", tokenizer, model_type)
    art = tmp_path / "art"
    run_quantize(QuantizeOptions(model=str(src), output=art, algorithm="rtn", group_size=32, kv_scheme="fp8",
                                 calib_samples=4, calib_seqlen=48))
    # float32: the streamed path runs routed experts unfused (per-expert linears), transformers' whole model fused;
    # in bfloat16 the two summation orders differ by about 1e-4 of the perplexity on the MoE rows
    opts = dict(artifact=art, seqlen=64, max_windows=2, max_new_tokens=4, hidden_batches=2, kv_chunk=16,
                eval_dtype="float32")
    want = run_verify(VerifyOptions(**opts))
    got = run_verify(VerifyOptions(**opts, stream=True))
    assert_same_report(got, want)
    assert got["passed"] == want["passed"]
