"""KV-cache quantization: schemes, the quantized cache, storage, accounting, verify's report."""

import json

import pytest
import torch

from compressor.commands.options import QuantizeOptions, VerifyOptions
from compressor.commands.quantize import run_quantize
from compressor.commands.verify import run_verify
from compressor.artifact import load_artifact, read_kv_cache
from compressor.errors import InputError
from compressor.evaluate import perplexity
from compressor.manifest import load_manifest
from compressor.quant.kv import (
    FP8_MAX, cache_kwarg, dequantize_asym, fake_quantize_kv, kv_budget, kv_bytes_per_token, kv_observer, make_spec,
    observed_absmax, quantize_asym, quantized_cache, static_scales,
)
from compressor.recipe import load_recipes
from compressor.safetensors_io import read_header

from conftest import assert_clean_error, kvq_run as run
from tiny_models import tiny_llama


def _kv(seed=0, shape=(2, 3, 64, 16)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[:, :, :, 3] *= 10  # an outlier channel, as post-RoPE keys have
    return x


def test_fp8_error_bound():
    x = _kv()
    spec = make_spec("fp8", "head")
    scale = static_scales(x.abs().amax(dim=(0, 2, 3)), spec)
    assert torch.allclose(scale * FP8_MAX, x.abs().amax(dim=(0, 2, 3)))
    y = fake_quantize_kv(x, spec, "k", scale)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normal numbers; tiny values: absolute
    s = scale.view(1, -1, 1, 1)
    assert torch.all((y - x).abs() <= torch.maximum(x.abs() / 16, s * 2.0**-9) + 1e-7)
    per_tensor = fake_quantize_kv(x, make_spec("fp8"), "k", static_scales(x.abs().amax(dim=(0, 2, 3)), make_spec("fp8")))
    assert float((per_tensor - x).abs().max()) <= float(x.abs().max()) / 16 + 1e-6


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_asymmetric_groups_error_bound(bits):
    x = _kv(1)
    for dim, gs in ((-1, None), (-1, 8), (-2, 16)):
        codes, scale, zero = quantize_asym(x, bits, dim=dim, group_size=gs)
        assert codes.dtype == torch.uint8 and int(codes.max()) <= (1 << bits) - 1
        y = dequantize_asym(codes, scale, zero, dim=dim)
        n = x.shape[dim]
        step = scale.repeat_interleave(n // scale.shape[dim], dim=dim)
        assert torch.all((y - x).abs() <= step * 0.5 + step * 1e-3 + 1e-6)


def test_int8_schemes_and_kivi_fake_quant():
    x = _kv(2)
    y = fake_quantize_kv(x, make_spec("int8"), "k")
    rng = x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)
    assert torch.all((y - x).abs() <= rng / 255 * 0.51 + 1e-6)
    spec = make_spec("int8", "head")
    scale = static_scales(x.abs().amax(dim=(0, 2, 3)), spec)
    y = fake_quantize_kv(x, spec, "v", scale)
    assert torch.all((y - x).abs() <= scale.view(1, -1, 1, 1) / 2 + 1e-6)
    with pytest.raises(InputError, match="needs calibrated scales"):
        fake_quantize_kv(x, spec, "v")
    # KIVI keys: per channel over groups of tokens; the incomplete tail group stays exact
    x = _kv(3, (1, 2, 40, 16))
    y = fake_quantize_kv(x, make_spec("int4", group_size=16, residual_length=32), "k")
    assert torch.equal(y[..., 32:, :], x[..., 32:, :]) and not torch.equal(y[..., :32, :], x[..., :32, :])
    err4 = (fake_quantize_kv(x, make_spec("int4", group_size=8, residual_length=8), "v") - x).abs().mean()
    err2 = (fake_quantize_kv(x, make_spec("int2", group_size=8, residual_length=8), "v") - x).abs().mean()
    assert err2 > err4 > 0


ALL_SCHEMES = [("fp8", "tensor"), ("fp8", "head"), ("int8", "token"), ("int8", "head"), ("int4", "kivi"), ("int2", "kivi")]


def test_scheme_registry_covers_every_spec():
    from compressor.formats.compressed_tensors import kv_cache_scheme
    from compressor.quant.kv import KV_SCHEMES, KVScheme

    assert list(KV_SCHEMES) == ALL_SCHEMES
    for scheme, strategy in ALL_SCHEMES:
        codec = make_spec(scheme, strategy).codec
        assert isinstance(codec, KVScheme) and codec is make_spec(scheme, strategy).codec
        assert codec.config_field() == kv_cache_scheme(make_spec(scheme, strategy))
        assert codec.static == (scheme == "fp8" or strategy == "head")


@pytest.mark.parametrize("scheme,strategy", ALL_SCHEMES)
def test_runtime_cache_equals_evaluation_cache_bitwise(scheme, strategy):
    """The runtime cache and verify's transformers cache return the same dequantized K/V, bit for
    bit, step after step: prefill, a chunk that crosses KIVI's residual boundary, then decode."""
    from compressor.runtime.kv_cache import make_cache

    B, H, D, steps = 2, 2, 8, (6, 5, 3) + (1,) * 20  # 34 tokens; KIVI g=4, R=8: groups flushed every 4 decodes
    spec = make_spec(scheme, strategy, group_size=4, residual_length=8)
    x = _kv(7, (2, B, H, sum(steps), D))
    scales = None
    if spec.static:
        scales = {0: (static_scales(x[0].abs().amax(dim=(0, 2, 3)), spec), static_scales(x[1].abs().amax(dim=(0, 2, 3)), spec))}
    ref = quantized_cache(spec, 1, scales).layers[0]
    rt = make_cache(spec, scales, 1, B, H, sum(steps), D, torch.float32, "cpu")
    t = 0
    for n in steps:
        k, v = x[0][:, :, t:t + n], x[1][:, :, t:t + n]
        rk, rv = ref.update(k, v)
        n_new = torch.full((B,), n)
        ok, ov = rt.update(0, k, v, rt.lengths.clone(), n_new)
        rt.commit(n_new)
        t += n
        assert ok.shape == rk.shape == (B, H, t, D)
        assert torch.equal(ok, rk) and torch.equal(ov, rv), (scheme, strategy, t)
        if t > 8:  # every scheme changes the numbers (KIVI: the quantized part)
            assert not torch.equal(rk[:, :, :4], x[0][:, :, :4])
    if strategy == "kivi":  # 34 tokens: 28 quantized, 6 in the window (between R - g + 1 and R)
        assert ref.n_quantized == 28 and int(rt.quantized_length(rt.lengths)[0]) == 28


@pytest.mark.parametrize("args,pattern", [
    (("fp4",), "unknown KV-cache scheme"),
    (("fp8", "kivi"), "strategies tensor, head"),
    (("int4", "kivi", 32, 48), "multiple"),
])
def test_spec_validation(args, pattern):
    with pytest.raises(InputError, match=pattern):
        make_spec(*args)


def _static_scales(model, ids, spec):
    obs = kv_observer(model.config.num_hidden_layers)
    model(ids, use_cache=True, **{cache_kwarg(model): obs})
    return {i: (static_scales(k, spec), static_scales(v, spec)) for i, (k, v) in observed_absmax(obs).items()}


def test_chunked_prefill_with_float_cache_equals_one_pass():
    from transformers import DynamicCache

    m = tiny_llama()
    wins = torch.randint(0, 320, (2, 96), generator=torch.Generator().manual_seed(0))
    one = perplexity(m, wins)
    chunked = perplexity(m, wins, make_cache=DynamicCache, kv_chunk=32)
    assert abs(one["ppl"] - chunked["ppl"]) < 1e-3 * one["ppl"]


@pytest.mark.parametrize("scheme,strategy", [("fp8", "tensor"), ("fp8", "head"), ("int8", "token"), ("int8", "head"),
                                             ("int4", "kivi"), ("int2", "kivi")])
def test_cache_in_forward_and_generate(scheme, strategy):
    m = tiny_llama()
    ids = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(1))
    spec = make_spec(scheme, strategy, group_size=8, residual_length=16)
    scales = _static_scales(m, ids, spec) if spec.static else None
    kw = cache_kwarg(m)
    ref = m(ids).logits
    cache = quantized_cache(spec, 2, scales)
    out = m(ids, use_cache=True, **{kw: cache}).logits
    assert cache.get_seq_length() == 48
    err = float((out - ref).abs().max())
    assert 0 < err < (0.5 if spec.bits == 2 else 0.2)
    # generate: decode step by step through the quantized cache
    cache = quantized_cache(spec, 2, scales)
    gen = m.generate(ids[:1, :10], max_new_tokens=20, do_sample=False, **{kw: cache})
    assert gen.shape == (1, 30) and cache.get_seq_length() == 29
    layer = cache.layers[0]
    if strategy == "kivi":
        full = layer.keys.shape[-2]
        assert spec.residual_length - spec.group_size < full <= spec.residual_length
        assert layer.n_quantized % spec.group_size == 0 and layer.n_quantized + full == 29
    else:
        assert layer.n_quantized == 29


def test_static_scheme_needs_scales():
    with pytest.raises(InputError, match="needs calibrated k_scale/v_scale"):
        quantized_cache(make_spec("fp8"), 2, None)


def test_accounting_arithmetic_smollm2_shape():
    shape = (30, 3, 64)  # SmolLM2-135M: layers, kv heads, head_dim
    assert kv_bytes_per_token(None, *shape) == 2 * 30 * 3 * 64 * 2 == 23040
    assert kv_bytes_per_token(make_spec("fp8"), *shape) == 11520
    assert kv_bytes_per_token(make_spec("int8"), *shape) == 11520 + 30 * 3 * 2 * 4
    # int4 KIVI g32: 4-bit data + per head (64/32 key channel-groups... scale+zero fp16) + (2 value groups x 4 B)
    assert kv_bytes_per_token(make_spec("int4"), *shape) == 5760 + 30 * 3 * (64 / 32 * 4 + 2 * 4)
    b = kv_budget(make_spec("fp8"), *shape, 1.0, contexts=(2048,))
    assert b["max_tokens"] == 2**30 // 11520 and b["max_batch"][2048] == 2**30 // (2048 * 11520)
    kivi = kv_budget(make_spec("int2", residual_length=128), *shape, 1.0, contexts=(64, 2048))
    per = kv_bytes_per_token(make_spec("int2"), *shape)
    assert kivi["max_batch"][64] == 2**30 // (64 * 23040)  # shorter than the residual: all fp16
    assert kivi["max_batch"][2048] == int(2**30 // (1920 * per + 128 * 23040))


def test_recipes_combine():
    r = load_recipes(["w4a16-awq", "kv-fp8"])
    assert r.algorithm == "awq" and r.kv_cache.scheme == "fp8" and r.name == "w4a16-awq+kv-fp8"
    r = load_recipes(["kv-int4"])
    assert r.algorithm == "none" and r.kv_cache.residual_length == 128
    r = load_recipes(["w4a16-gptq", "kv-int8", "kv-fp8"])
    assert r.kv_cache.scheme == "fp8" and r.kv_cache.strategy == "tensor" and r.gptq.act_order


@pytest.fixture(scope="module")
def kv_artifacts(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("kv")
    a = root / "w4-fp8head"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=a, recipe=("w4a16-rtn-g64", "kv-fp8"), group_size=32,
                                 calib_samples=8, calib_seqlen=64, settings=(("kv_cache.strategy", "head"),)))
    b = root / "kv-int4-only"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=b, recipe="kv-int4",
                                 settings=(("kv_cache.group_size", 8), ("kv_cache.residual_length", 16))))
    return a, b


def test_scale_storage_round_trip(kv_artifacts):
    a, _ = kv_artifacts
    qc = json.loads((a / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["type"] == "float" and qc["kv_cache_scheme"]["strategy"] == "attn_head"
    h = read_header(a / "model.safetensors")
    assert h["model.layers.1.self_attn.k_scale"].shape == (2, 1, 1)  # [num_kv_heads, 1, 1]
    assert h["model.layers.1.self_attn.v_scale"].dtype == "BF16"  # the storage dtype (bf16 for a float32 source)
    man = load_manifest(a)
    assert man.kv_cache["scheme"] == "fp8" and man.kv_cache["strategy"] == "head" and man.kv_cache["static_scales"]
    spec, scales = read_kv_cache(a)
    absmax = man.kv_cache["absmax"]["1"]["k"]
    torch.testing.assert_close(scales[1][0], (torch.tensor(absmax) / FP8_MAX).half().float(), rtol=2e-3, atol=1e-6)
    model, _ = load_artifact(a)  # the scales do not disturb the weight loader
    assert torch.isfinite(model(torch.randint(0, 300, (1, 8))).logits).all()


def test_kv_only_artifact_has_float_weights_and_manifest_scheme(kv_artifacts):
    _, b = kv_artifacts
    cfg = json.loads((b / "config.json").read_text())
    assert "quantization_config" not in cfg  # KIVI has no compressed-tensors field: manifest only
    man = load_manifest(b)
    assert man.quantization["algorithm"] == "none"
    assert man.kv_cache == {**man.kv_cache, "scheme": "int4", "strategy": "kivi", "group_size": 8, "residual_length": 16}
    assert "model.layers.0.mlp.down_proj.weight" in read_header(b / "model.safetensors")
    assert read_kv_cache(b)[1] is None


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_verify_reports_weights_kv_both(kv_artifacts):
    a, b = kv_artifacts
    rep = run_verify(VerifyOptions(artifact=a, seqlen=128, max_windows=2, kv_chunk=32))
    assert set(rep["perplexity_breakdown"]) == {"reference", "weights only", "weights + KV", "KV only"}
    ppl_gate = next(g for g in rep["gates"] if g["name"] == "max_ppl_increase_pct")
    assert ppl_gate["measured_on"] == "weights + KV" and rep["passed"]
    assert rep["kv_cache"]["source"] == "artifact" and rep["kv_cache"]["bytes_per_token"] * 2 == rep["kv_cache"]["fp16_bytes_per_token"]
    rep = run_verify(VerifyOptions(artifact=b, seqlen=128, max_windows=2, kv_chunk=32))
    ppl_gate = next(g for g in rep["gates"] if g["name"] == "max_ppl_increase_pct")
    assert set(rep["perplexity_breakdown"]) == {"reference", "KV only"} and ppl_gate["measured_on"] == "KV only"
    # --kv-scheme on an artifact without one; static fp8 scales calibrated on the fly
    rep = run_verify(VerifyOptions(artifact=a, seqlen=128, max_windows=1, kv_scheme="int2", kv_chunk=32))
    assert rep["kv_cache"]["source"] == "--kv-scheme" and "int2" in rep["kv_cache"]["scheme"]
    assert rep["perplexity_breakdown"]["KV only"]["increase_pct"] > rep["perplexity_breakdown"]["weights only"]["increase_pct"] - 100


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_verify_measures_a_kv_only_artifact_as_served(kv_artifacts):
    """A KV-only artifact's figures are the artifact's own weights, in the dtype it declares
    (bfloat16), with its quantized cache (not the float32 reference with the cache), and the
    report says what each row ran; beside a weight artifact, the KV-only row stays the reference's."""
    from transformers import AutoModelForCausalLM

    from compressor.arch import get_arch
    from compressor.calib import load_text, tokenize
    from compressor.evaluate import compare, windows

    a, b = kv_artifacts
    rep = run_verify(VerifyOptions(artifact=b, seqlen=64, max_windows=2, kv_chunk=16, max_new_tokens=4, hidden_batches=1))
    assert rep["evaluated_in"]["dtype"] == "bfloat16" and rep["perplexity"]["measured_on"] == "KV only"
    rows = rep["evaluated_in"]["rows"]
    assert rows["KV only"].startswith("the artifact's weights in bfloat16 with the int4") and rows["KV only"].endswith("KV cache")
    assert rows["reference"] == "the reference's weights in float32 with a float KV cache"
    art, tok = load_artifact(b, dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(str(rep["reference"]), dtype=torch.float32).eval()
    spec, scales = read_kv_cache(b)
    layout = get_arch("llama").kv_layout(ref.config)
    cache = lambda: quantized_cache(spec, ref.config.num_hidden_layers, scales, layout)  # noqa: E731
    wins = windows(tokenize(tok, load_text("embedded", part="eval").text), 64, 2)
    res = compare(ref, {"served": (art, cache), "reference + KV": (ref, cache)}, wins, kv_chunk=16)
    kl = rep["distribution"]["kl"]["mean"]
    assert kl == pytest.approx(res["served"]["kl"]["mean"], rel=1e-6)
    assert abs(res["reference + KV"]["kl"]["mean"] - kl) > 0.01 * kl  # the row before: another model
    streamed = run_verify(VerifyOptions(artifact=b, seqlen=64, max_windows=2, kv_chunk=16, hidden_batches=1, stream=True))
    assert streamed["evaluated_in"]["rows"] == rep["evaluated_in"]["rows"]  # --stream runs the same rows
    assert streamed["distribution"]["kl"]["mean"] == pytest.approx(kl, rel=1e-4)
    rows = run_verify(VerifyOptions(artifact=a, seqlen=64, max_windows=1, kv_chunk=16, max_new_tokens=4,
                                    hidden_batches=1))["evaluated_in"]["rows"]
    assert rows["weights + KV"].startswith("the artifact's weights in bfloat16 with the fp8")
    assert rows["KV only"].startswith("the reference's weights in float32 with the fp8")
    assert rows["weights only"] == "the artifact's weights in bfloat16 with a float KV cache"


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_verify_kv_scheme_static_calibrates(tiny_model_dir, tmp_path):
    out = tmp_path / "w8"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, recipe="w8a16-rtn"))
    rep = run_verify(VerifyOptions(artifact=out, seqlen=128, max_windows=1, kv_scheme="fp8", kv_calib_samples=2, kv_chunk=64))
    assert abs(rep["perplexity_breakdown"]["KV only"]["increase_pct"]) < 2.0


@pytest.mark.parametrize("argv,pattern", [
    (["--recipe", "kv-fp8", "--format", "gptq"], "KV-only recipe"),
    (["--recipe", "w4a16-gptq", "--recipe", "kv-fp8", "--format", "gptq"], "no field for static KV-cache scales"),
    (["--algorithm", "none"], "quantizes nothing"),
    (["--kv-scheme", "fp8", "--set", "kv_cache.strategy=kivi"], "strategies tensor, head"),
])
def test_kv_refusals(tmp_path, capsys, tiny_model_dir, argv, pattern):
    code, _, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "out", *argv], capsys)
    assert_clean_error(code, err, 2, pattern, tmp_path)
    assert not (tmp_path / "out").exists()
