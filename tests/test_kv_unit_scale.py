"""An fp8 KV cache at unit scales (issue #47): ``kvq verify`` reports, beside the calibrated
figures, what an engine that misses or ignores ``k_scale``/``v_scale`` runs -- the same cache
with every scale at 1.0 -- on llama and on the MLA rows (DeepSeek-V3, Kimi K2), whose latent
cache vLLM and SGLang serve at unit scales (docs/kv-cache.md)."""

import json

import pytest
import torch

from compressor.artifact import read_kv_cache
from compressor.commands.options import QuantizeOptions, VerifyOptions
from compressor.commands.quantize import run_quantize
from compressor.commands.verify import run_verify
from compressor.commands.verify_service import MLA_ENGINES
from compressor.report import markdown
from conftest import kvq_run as run
from tiny_models import make_dir, make_published

#: a KV-only fp8 artifact with absmax / 448 scales (no search: the scales stay where the cache's range puts them)
ABSMAX = (("kv_cache.scale_search", "absmax"),)
#: a short verify: one window, no long generation or chat (teacher-forced windows only)
SHORT = dict(seqlen=64, max_windows=1, kv_chunk=16, max_new_tokens=2, hidden_batches=1, long_tokens=0, turns=0)


def _kv_fp8(src, out, **kw):
    run_quantize(QuantizeOptions(model=str(src), output=out, recipe="kv-fp8", settings=ABSMAX, calib_samples=4,
                                 calib_seqlen=32, **kw))
    return out


def _scaled(factors: dict[str, float]):
    """``prepare`` for :func:`make_dir`: every parameter whose name ends with a key of ``factors`` times its value."""
    def prepare(m):
        with torch.no_grad():
            for n, p in m.named_parameters():
                for name, f in factors.items():
                    if n.endswith(name):
                        p.mul_(f)
        return m
    return prepare


#: the MLA latent ~1000x smaller, the same model: kv_a_layernorm's gains / 1000, kv_b_proj (reading the latent) x 1000
SMALL_LATENT = {"kv_a_layernorm.weight": 1e-3, "kv_b_proj.weight": 1e3}


def _unit(rep):
    us = rep["kv_cache"]["unit_scale"]
    assert us["row"] == "KV only" and set(us["calibrated"]) == set(us["unit"]) == {
        "ppl", "increase_pct", "kl_mean", "kl_p99", "top1_pct"}
    cal = rep["perplexity_breakdown"]["KV only"]
    assert us["calibrated"]["ppl"] == cal["ppl"] and us["calibrated"]["increase_pct"] == cal["increase_pct"]
    assert "KV only, unit scales" not in rep["perplexity_breakdown"]  # a figure of the KV section, not a served row
    assert [b["bucket"] for b in us["by_position"]] == [b["bucket"] for b in rep["by_position"]["buckets"]]
    return us


def test_llama_keys_beyond_448_saturate_at_unit_scales(tmp_path, tokenizer, capsys):
    """Keys and values ~1e3-1e4: absmax / 448 is several times 1, so unit scales clip them at 448 and the
    cache's KL grows several times; the console and report.md say it beside the calibrated figures."""
    src = make_dir(tmp_path / "src", tokenizer, "llama", prepare=_scaled({"k_proj.weight": 3e3, "v_proj.weight": 3e3}))
    art = _kv_fp8(src, tmp_path / "kv")
    _, scales = read_kv_cache(art)
    assert min(float(k.min()) for k, _ in scales.values()) > 1.0  # far from 1: absmax > 448
    code, out, err = run(["verify", str(art), "--seqlen", "64", "--max-windows", "1", "--kv-chunk", "16",
                          "--long-tokens", "0", "--turns", "0", "--max-new-tokens", "2",
                          "--json-out", str(tmp_path / "r.json")], capsys)
    assert code == 0, err
    rep = json.loads((tmp_path / "r.json").read_text())
    us = _unit(rep)
    assert not us["scales_all_unit"] and us["scales"]["k_min"] > 1.0 and us["engines"] is None
    assert us["unit"]["kl_mean"] > 3 * us["calibrated"]["kl_mean"]
    assert us["unit"]["top1_pct"] < us["calibrated"]["top1_pct"]
    flat = " ".join((out + err).split())
    assert "KV only at unit scales" in flat and f"{us['unit']['top1_pct']:.2f} %" in flat
    md = markdown(rep)
    assert "fp8 KV cache at unit scales" in md and f"{us['unit']['ppl']:.4f}" in md


@pytest.mark.slow  # two MLA quantize -> verify runs (make test-fast leaves it out)
@pytest.mark.parametrize("row", ["deepseek_v3", "kimi_k2"])
def test_mla_latent_underflows_at_unit_scales(tmp_path, tokenizer, row):
    """A latent ~1000x smaller (kv_a_layernorm's gains / 1000, kv_b_proj x 1000: the same model): unit
    scales put it among e4m3's subnormals and zeros, the calibrated scale does not; the report names what
    vLLM and SGLang do with an MLA cache's scale."""
    if row == "deepseek_v3":
        src = make_dir(tmp_path / "src", tokenizer, row, prepare=_scaled(SMALL_LATENT))
    else:  # the published folder (model_type kimi_k2, custom code): scale the stored tensors
        from safetensors.torch import load_file, save_file

        src = make_published(tmp_path / "src", tokenizer, row)
        state = load_file(str(src / "model.safetensors"))
        state = {n: next((t * f for k, f in SMALL_LATENT.items() if n.endswith(k)), t) for n, t in state.items()}
        save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    art = _kv_fp8(src, tmp_path / "kv")
    _, scales = read_kv_cache(art)
    for k, v in scales.values():  # one scale for [latent | rope key]; the rope key keeps its range
        assert k.shape == (1,) and torch.equal(k, v)
    rep = run_verify(VerifyOptions(artifact=art, **SHORT))
    us = _unit(rep)
    assert us["engines"] == MLA_ENGINES and not us["scales_all_unit"]
    assert us["unit"]["kl_mean"] > 2 * us["calibrated"]["kl_mean"]


def test_stored_unit_scales_are_reported_and_give_the_same_figures(tmp_path, tokenizer, monkeypatch):
    """An artifact whose stored scales are exactly 1.0 (a unit-scale artifact): the unit-scale figures are
    the calibrated ones, bit for bit, and a warning says what the artifact is."""
    import compressor.pipeline as pipeline

    real = pipeline.layer_scales
    monkeypatch.setattr(pipeline, "layer_scales", lambda *a, **kw: tuple(torch.ones_like(s) for s in real(*a, **kw)))
    src = make_dir(tmp_path / "src", tokenizer, "llama")
    art = _kv_fp8(src, tmp_path / "kv")
    monkeypatch.undo()
    one = torch.ones(1)
    assert all(torch.equal(k, one) and torch.equal(v, one) for k, v in read_kv_cache(art)[1].values())
    rep = run_verify(VerifyOptions(artifact=art, **SHORT))
    us = _unit(rep)
    assert us["scales_all_unit"] and us["unit"] == us["calibrated"]
    assert all(b["unit"] == b["calibrated"] for b in us["by_position"])
    assert any("a unit-scale artifact" in w for w in rep["warnings"])


def test_no_unit_scale_figure_without_static_fp8_scales(tmp_path, tokenizer):
    """KIVI int4 has no scales an engine could miss: no unit-scale row is run."""
    src = make_dir(tmp_path / "src", tokenizer, "llama")
    run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "kv", recipe="kv-int4"))
    rep = run_verify(VerifyOptions(artifact=tmp_path / "kv", **SHORT))
    assert rep["kv_cache"]["unit_scale"] is None and set(rep["perplexity_breakdown"]) == {"reference", "KV only"}
