"""The bundled runtime (compressor/runtime): logits against transformers for float and
quantized weights and every KV scheme, batched vs one-by-one generation, backend choice,
the aten int4/int8 ops, and the Triton W4A16 kernels under Triton's CPU interpreter."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from compressor.commands.options import QuantizeOptions
from compressor.commands.quantize import run_quantize
from compressor.artifact import load_artifact
from compressor.errors import InputError
from compressor.quant.kv import cache_kwarg, kv_observer, make_spec, observed_absmax, quantized_cache, static_scales
from compressor.quant.primitives import compute_qparams, dequantize, quantize
from compressor.runtime import Runtime
from compressor.runtime.kv_cache import KIVICache, _pack_codes, _unpack_codes
from compressor.runtime.linear import AtenInt8Linear, DequantLinear, check_backend, make_linear
from compressor.runtime.triton_kernels import (
    GEMV_MAX_M, check_launch, choose_config, pack_w4, triton_available, unpack_w4, w4a16_reference,
)
from compressor.formats.base import QuantWeight

from conftest import copy_folder

REPO = Path(__file__).resolve().parents[1]
IDS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))


def _hf_logits(model, ids, spec=None, scales=None, chunk=None):
    """transformers logits, through kvq's quantized cache (fed in chunks) when ``spec`` is set."""
    with torch.no_grad():
        if spec is None:
            return model(ids).logits
        cache = quantized_cache(spec, model.config.num_hidden_layers, scales)
        kw = cache_kwarg(model)
        c = chunk or ids.shape[1]
        return torch.cat([model(ids[:, a:a + c], use_cache=True, **{kw: cache}).logits
                          for a in range(0, ids.shape[1], c)], dim=1)


def _max_err(a, b):
    return float((a.float() - b.float()).abs().max())


@pytest.fixture(scope="module")
def float_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("runtime")
    quick = dict(calib_samples=4, calib_seqlen=32)
    specs = {
        "w4-asym-ct-fp8kv": dict(recipe=("w4a16-rtn-g64", "kv-fp8"), group_size=32),
        "w4-sym-awq": dict(recipe="w4a16-awq", group_size=32, symmetric=True, format="awq"),
        "w8-channel-gptq": dict(recipe="w8a16-rtn", format="gptq"),
        "w4-actorder-gptq": dict(recipe="w4a16-gptq", group_size=32, format="gptq",
                                 settings=(("gptq.static_groups", False),)),
        "w4-g16-ct": dict(recipe="w4a16-rtn-g64", group_size=16),
    }
    out = {}
    for name, kw in specs.items():
        out[name] = root / name
        run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out[name], **quick, **kw))
    return out


# ---------------------------------------------------------------------------------------
# float weights


def test_float_model_matches_transformers(tiny_model_dir, float_model):
    rt = Runtime.from_artifact(tiny_model_dir, kv=None)
    assert set(rt.info.kernels.values()) == {"float"} and rt.kv_spec is None
    assert _max_err(rt.logits(IDS), _hf_logits(float_model, IDS)) < 1e-5
    assert _max_err(rt.logits(IDS, chunk=7), _hf_logits(float_model, IDS)) < 1e-4
    # greedy decode: the same tokens as transformers' generate
    prompt = IDS[0, :12]
    hf = float_model.generate(prompt[None], max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    res = rt.generate([prompt.tolist()], max_new_tokens=16)
    assert res.tokens[0] == hf[0, 12:].tolist()
    assert res.prompt_tokens == 12 and res.decode_tokens == 15 and res.prefill_tokens_per_s > 0
    assert res.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K+V, layers, kv heads, head_dim, float32


_BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
_ARCH_VARIANTS = {
    "qwen2-qkv-bias": ("Qwen2Config", {}),
    "qwen3-qk-norm": ("Qwen3Config", {"head_dim": 16}),
    "mistral-sliding-window": ("MistralConfig", {"sliding_window": 16}),
    "llama3-rope": ("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                                        "rope_theta": 10000.0}}),
    "yarn-rope": ("LlamaConfig", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 64, "rope_theta": 10000.0}}),
}


@pytest.mark.parametrize("variant", sorted(_ARCH_VARIANTS))
def test_llama_family_variants_match_transformers(tmp_path, variant):
    import transformers
    from transformers import AutoModelForCausalLM

    cls, extra = _ARCH_VARIANTS[variant]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(getattr(transformers, cls)(**_BASE, **extra)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.uniform_(0.5, 1.5)  # biases and norm gains that matter
    model.save_pretrained(tmp_path / variant)
    rt = Runtime.from_artifact(tmp_path / variant, kv=None)
    ref = _hf_logits(model, IDS)
    assert _max_err(rt.logits(IDS), ref) < 1e-5 and _max_err(rt.logits(IDS, chunk=5), ref) < 1e-4
    assert rt.info.kernels["lm_head"] == "float" and not rt.decoder.spec.tie_word_embeddings
    if "sliding" in variant:
        assert rt.decoder.spec.sliding_windows == (16, 16)
        model.config.sliding_window = None  # the window does change positions past it
        assert _max_err(rt.logits(IDS)[:, 20:], _hf_logits(model, IDS)[:, 20:]) > 1e-3


# ---------------------------------------------------------------------------------------
# quantized weights vs load_artifact's dequantized model


@pytest.mark.parametrize("name,aten_kernel", [
    ("w4-asym-ct-fp8kv", "aten-int4"), ("w4-sym-awq", "aten-int4"), ("w8-channel-gptq", "aten-int8"),
    ("w4-actorder-gptq", "aten-int4"), ("w4-g16-ct", "dequant"),
])
def test_quantized_weights_match_dequantized_reference(artifacts, name, aten_kernel, monkeypatch):
    ref_model, _ = load_artifact(artifacts[name])
    ref = _hf_logits(ref_model, IDS)
    import compressor.artifact

    monkeypatch.setattr(compressor.artifact, "load_artifact", lambda *a, **k: pytest.fail("runtime dequantized the model"))
    # float32 compute against load_artifact's float32 model (the default follows the artifact's bfloat16)
    deq = Runtime.from_artifact(artifacts[name], backend="dequant", kv=None, dtype=torch.float32)
    assert set(deq.info.kernels.values()) == {"dequant", "float"}  # lm_head stays float
    assert _max_err(deq.logits(IDS), ref) < 1e-5
    exact = Runtime.from_artifact(artifacts[name], backend="aten", kv=None, act_dtype=torch.float32, dtype=torch.float32)
    assert exact.describe()["kernels"][aten_kernel] == 14
    # two layers x (q/k/v, gate/up) share one int4 decode call each, unless an act-order
    # permutation reorders their inputs; int8 and dequant layers are not fused
    permuted = any(lin.in_perm is not None for lin in exact.decoder.linears().values() if lin.kernel != "float")
    assert exact.describe()["fused_decode_sets"] == (4 if aten_kernel == "aten-int4" and not permuted else 0)
    assert deq.describe()["fused_decode_sets"] == 0
    # chunks of 8 tokens x 2 rows run the aten ops (below DEQUANT_MIN_M rows); one pass dequantizes
    assert _max_err(exact.logits(IDS, chunk=8), ref) < 1e-4  # layout, zero-point offset and permutation exact
    assert _max_err(exact.logits(IDS), ref) < 1e-5
    fast = Runtime.from_artifact(artifacts[name], kv=None)  # auto: bfloat16 activations inside the aten ops
    assert fast.info.kernels == exact.info.kernels
    assert _max_err(fast.logits(IDS, chunk=8), ref) < 0.02 * float(ref.abs().max())
    if aten_kernel == "dequant":
        assert "group size 16" in next(iter(fast.info.fallbacks.values()))
    if name == "w4-actorder-gptq":  # act-order groups become contiguous by permuting the input columns
        assert all(lin.in_perm is not None for n, lin in fast.decoder.linears().items() if n != "lm_head")
    # codes, not a float copy: the packed layers hold far fewer bytes than float32 weights
    float_bytes = sum(lin.in_features * lin.out_features * 4 for n, lin in fast.decoder.linears().items() if n != "lm_head")
    quant_bytes = sum(lin.weight_bytes for n, lin in fast.decoder.linears().items() if n != "lm_head")
    assert quant_bytes < float_bytes / 2


def test_aten_int4_op_and_prefill_path_agree():
    from compressor.runtime.linear import DEQUANT_MIN_M, AtenInt4Linear

    torch.manual_seed(2)
    for k, gs, op_group in ((128, 32, 32), (96, 96, 32), (128, 128, 128)):  # per channel: sub-groups of the op
        w = torch.randn(64, k)
        scale, zp = compute_qparams(w, 4, gs, symmetric=False)
        qw = QuantWeight(quantize(w, scale, zp, 4, gs), scale.half(), zp, 4, gs)
        lin = make_linear(qw, torch.randn(64), "auto", torch.device("cpu"), torch.float32, act_dtype=torch.float32)
        assert isinstance(lin, AtenInt4Linear) and lin.fallback_reason is None and lin.op_group == op_group
        assert torch.equal(lin.dequantized(torch.float32), qw.dequantize())
        x = torch.randn(DEQUANT_MIN_M + 3, k)
        ref = x @ qw.dequantize().t() + lin.bias
        assert _max_err(lin(x), ref) < 1e-4 and _max_err(lin(x[:3]), ref[:3]) < 1e-4  # dequant path, op path


def test_fused_decode_is_each_parts_own_op_bit_for_bit():
    """q/k/v (and gate/up) share one int4 decode call: every part's columns equal its own
    call's, the prefill path is untouched, bytes are not duplicated, act-order parts stay apart."""
    from compressor.runtime.linear import DEQUANT_MIN_M, AtenInt4Linear, FusedDecode

    torch.manual_seed(3)

    def lin(n, k=128, bias=False):
        w = torch.randn(n, k)
        scale, zp = compute_qparams(w, 4, 64, symmetric=False)
        qw = QuantWeight(quantize(w, scale, zp, 4, 64), scale.half(), zp, 4, 64)
        return make_linear(qw, torch.randn(n) if bias else None, "auto", torch.device("cpu"), torch.float32)

    parts = [lin(64), lin(32, bias=True), lin(32)]
    x = torch.randn(2, 3, 128)
    alone = [p(x) for p in parts]
    xp = torch.randn(DEQUANT_MIN_M, 128)
    prefill = [p(xp) for p in parts]
    bytes_before = sum(p.weight_bytes for p in parts)
    fused = FusedDecode.of(parts)
    assert fused is not None and all(p.packed is None and p.fused[0] is fused for p in parts)
    for got, want in zip(fused.outputs(x), alone):
        assert got.shape == want.shape and torch.equal(got, want)
    assert all(torch.equal(p(x), want) for p, want in zip(parts, alone))  # a part called alone: same columns
    assert sum(p.weight_bytes for p in parts) == bytes_before
    torch.manual_seed(3)
    assert FusedDecode.of(parts) is None  # already fused
    assert FusedDecode.of([lin(64), lin(64, k=64)]) is None  # another input width
    assert all(torch.equal(p(xp), want) for p, want in zip(parts, prefill))  # prefill: each part's own path
    assert all(torch.equal(got, want) for got, want in zip(fused.outputs(xp), prefill))
    assert isinstance(parts[0], AtenInt4Linear)


def test_fp8_cache_lookup_decode_is_the_codec_bit_for_bit():
    """The runtime's fp8 cache encodes and decodes (scaled lookup table) exactly as the scheme's codec."""
    from compressor.runtime.kv_cache import make_cache

    torch.manual_seed(4)
    for strategy, n in (("tensor", 1), ("head", 3)):
        spec = make_spec("fp8", strategy)
        scales = {i: (torch.rand(n) * 0.05 + 1e-3, torch.rand(n) * 0.05 + 1e-3) for i in range(2)}
        cache = make_cache(spec, scales, 2, 2, 3, 16, 8, torch.float32, torch.device("cpu"))
        k, v = torch.randn(2, 3, 5, 8) * 4, torch.randn(2, 3, 5, 8)
        keys, values = cache.update(1, k, v, torch.zeros(2, dtype=torch.long), torch.tensor([5, 3]))
        for got, x, s, kind in ((keys, k, scales[1][0], "k"), (values, v, scales[1][1], "v")):
            want = spec.codec.decode(spec.codec.encode(x, s, kind), s, kind, torch.float32)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1, :, :3], want[1, :, :3]), strategy


def test_aten_int8_asymmetric_correction_and_dequant_fallback():
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    scale, zp = compute_qparams(w, 8, -1, symmetric=False)
    qw = QuantWeight(quantize(w, scale, zp, 8, -1), scale, zp, 8, 64)
    x = torch.randn(5, 64)
    ref = x @ qw.dequantize().t()
    lin = make_linear(qw, None, "aten", torch.device("cpu"), torch.float32, act_dtype=torch.float32)
    assert isinstance(lin, AtenInt8Linear) and lin.fallback_reason == "aten-int4: 8-bit weights (aten int4 serves 4 bits)"
    assert _max_err(lin(x), ref) < 1e-4 and torch.equal(lin.dequantized(torch.float32), qw.dequantize())
    # 3-bit: no aten op serves it; the dequantize kernel does, and says why
    scale, zp = compute_qparams(w, 3, 32, symmetric=False)
    qw3 = QuantWeight(quantize(w, scale, zp, 3, 32), scale, zp, 3, 32)
    lin = make_linear(qw3, None, "auto", torch.device("cpu"), torch.float32)
    assert isinstance(lin, DequantLinear) and "3-bit" in lin.fallback_reason
    assert _max_err(lin(x), x @ dequantize(qw3.q, scale, zp, 32).t()) < 1e-5


# ---------------------------------------------------------------------------------------
# KV schemes: the same numerics as kvq verify's quantized transformers cache


def _observed_scales(model, spec):
    obs = kv_observer(model.config.num_hidden_layers)
    with torch.no_grad():
        model(IDS, use_cache=True, **{cache_kwarg(model): obs})
    return {i: (static_scales(k, spec), static_scales(v, spec)) for i, (k, v) in observed_absmax(obs).items()}


@pytest.mark.parametrize("scheme,strategy", [("fp8", "head"), ("int8", "token"), ("int8", "head"),
                                             ("int4", "kivi"), ("int2", "kivi")])
def test_kv_schemes_match_quantized_cache(tiny_model_dir, float_model, scheme, strategy):
    spec = make_spec(scheme, strategy, group_size=8, residual_length=16)
    scales = _observed_scales(float_model, spec) if spec.static else None
    rt = Runtime.from_artifact(tiny_model_dir, kv=spec, kv_scales=scales)
    for chunk in (None, 7, 1):  # one pass, chunked prefill, token by token (the decode path)
        ref = _hf_logits(float_model, IDS, spec, scales, chunk)
        assert _max_err(rt.logits(IDS, chunk=chunk), ref) < 1e-4, chunk
    assert _max_err(rt.logits(IDS), _hf_logits(float_model, IDS)) > 1e-4  # the scheme does change the numbers
    if strategy == "kivi":
        cache = rt.new_cache(1, 40)
        rt.decoder.forward(IDS[:1, :29], cache)
        assert isinstance(cache, KIVICache) and int(cache.quantized_length(cache.lengths)) == 16  # 29 - 13 in the window


def test_artifact_kv_scheme_and_decode_match_transformers_generate(artifacts):
    folder = artifacts["w4-asym-ct-fp8kv"]
    model, _ = load_artifact(folder)
    rt = Runtime.from_artifact(folder, backend="dequant", dtype=torch.float32)  # kv="artifact": fp8 with the stored scales
    assert rt.kv_spec.scheme == "fp8" and rt.kv_scales is not None
    from compressor.artifact import read_kv_cache

    spec, scales = read_kv_cache(folder)
    assert _max_err(rt.logits(IDS), _hf_logits(model, IDS, spec, scales)) < 1e-4
    prompt = IDS[1, :9]
    cache = quantized_cache(spec, 2, scales)
    hf = model.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                        **{cache_kwarg(model): cache})
    assert rt.generate([prompt.tolist()], max_new_tokens=12).tokens[0] == hf[0, 9:].tolist()
    fp8 = rt.new_cache(1, 8).bytes_per_token()
    assert fp8 == 2 * 2 * 2 * 16  # one byte per element
    assert Runtime.from_artifact(folder, kv=None).kv_spec is None


@pytest.mark.parametrize("kv", [None, make_spec("int8"), make_spec("int4", group_size=8, residual_length=16)])
def test_batched_generation_equals_one_by_one(tiny_model_dir, kv):
    rt = Runtime.from_artifact(tiny_model_dir, kv=kv)
    prompts = [IDS[0, :30].tolist(), IDS[1, :7].tolist(), IDS[1, 10:29].tolist()]
    for chunk in (None, 8):  # KIVI reads depend on the prefill chunking (as in verify): compare like with like
        one = [rt.generate([p], max_new_tokens=14, prefill_chunk=chunk, return_prompt_logits=True) for p in prompts]
        both = rt.generate(prompts, max_new_tokens=14, prefill_chunk=chunk, return_prompt_logits=True)
        assert both.tokens == [r.tokens[0] for r in one]
        for b, r in enumerate(one):
            assert both.prompt_logits[b].shape == (len(prompts[b]), rt.vocab_size)
            assert _max_err(both.prompt_logits[b], r.prompt_logits[0]) < 1e-4
    assert both.decode_tokens == 3 * 13 and both.summary()["generated_tokens"] == 42
    # an end-of-sequence token stops that sequence only
    eos = one[1].tokens[0][3]
    stopped = rt.generate(prompts, max_new_tokens=14, eos_token_id=eos)
    assert stopped.tokens[1] == one[1].tokens[0][:one[1].tokens[0].index(eos) + 1]
    # sampling is seeded
    a = rt.generate(prompts[:2], max_new_tokens=6, greedy=False, temperature=0.8, seed=3)
    assert a.tokens == rt.generate(prompts[:2], max_new_tokens=6, greedy=False, temperature=0.8, seed=3).tokens


def test_kivi_code_packing_round_trip():
    for bits in (4, 2):
        c = torch.randint(0, 1 << bits, (2, 3, 5, 16), dtype=torch.uint8)
        p = _pack_codes(c, bits)
        assert p.shape == (2, 3, 5, 16 * bits // 8) and torch.equal(_unpack_codes(p, bits), c)


# ---------------------------------------------------------------------------------------
# Triton W4A16: layout, launch logic (CPU), kernels under the interpreter (subprocess)


def test_w4_layout_is_compressed_tensors_and_reference_is_dequantize():
    from compressor.formats.compressed_tensors import pack_int32

    torch.manual_seed(1)
    w = torch.randn(40, 96)
    scale, zp = compute_qparams(w, 4, 32, symmetric=False)
    q = quantize(w, scale, zp, 4, 32)
    qweight, s, z = pack_w4(q, scale, zp, torch.float32)
    assert torch.equal(qweight, pack_int32(q, 4, 1)) and torch.equal(unpack_w4(qweight) - 8, q.long())
    assert torch.equal(z, zp.float() + 8)
    x = torch.randn(3, 96)
    assert _max_err(w4a16_reference(x, qweight, s, z, 32), x @ dequantize(q, scale, zp, 32).t()) < 1e-5
    _, _, z_sym = pack_w4(q, scale, None, torch.float16)
    assert bool((z_sym == 8).all()) and z_sym.dtype == torch.float16
    with pytest.raises(InputError, match="divisible by 8"):
        pack_w4(q[:, :36], scale, zp, torch.float16)


def test_choose_config_launch_logic():
    for m in (1, 4, GEMV_MAX_M):  # decode: one 16-row tile for every row, K split over idle multiprocessors
        c = choose_config(m, 1536, 576, 64)
        assert c.kind == "gemv" and (c.block_m, c.block_n, c.block_k) == (16, 64, 128)
        assert c.split_k == 2 and c.grid(m, 1536) == (24, 1, 2)  # 24 tiles; 5 K steps: at least 2 per split
    c = choose_config(1, 4096, 11008, 64, sm_count=132)  # the first GPU run's shape: 64 tiles alone on 132 SMs
    assert c.grid(1, 4096) == (64, 1, 4)
    assert choose_config(1, 11008, 4096, 64, sm_count=132).split_k == 1  # 172 tiles: enough
    c = choose_config(9, 576, 1536, 64)
    assert c.kind == "gemm" and (c.block_m, c.block_n, c.block_k) == (16, 64, 64) and c.grid(9, 576) == (9, 1, 12)
    c = choose_config(512, 1536, 576, 64)
    assert (c.block_m, c.block_n, c.num_warps) == (64, 128, 8) and c.grid(512, 1536) == (12, 8, 2)
    c = choose_config(20, 24, 16, 16)  # small: powers of two, never below 16
    assert (c.block_m, c.block_n, c.block_k, c.split_k) == (32, 16, 32, 1)
    for cfg in (choose_config(m, n, 64, 32) for m in (1, 3, 17, 100) for n in (8, 40, 300)):
        for b in (cfg.block_m, cfg.block_n, cfg.block_k):
            assert b & (b - 1) == 0 and b >= 16  # tl.dot's minimum tile
    with pytest.raises(InputError, match="divisible by 8"):
        choose_config(1, 64, 60, 60)
    with pytest.raises(InputError, match="bad W4A16"):
        choose_config(0, 64, 64, 32)


def test_check_launch_and_backend_refusals(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(2, 64, dtype=torch.float16)
    qw = torch.zeros(32, 8, dtype=torch.int32)
    s = z = torch.ones(32, 2, dtype=torch.float16)
    with pytest.raises(InputError, match="need a CUDA device"):
        check_launch(x, qw, s, z, 32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_launch(x, qw, s, z, 32)
    with pytest.raises(InputError, match=r"scales must be \[N, G\]"):
        check_launch(x, qw, s[:, :1], z, 32)
    with pytest.raises(InputError, match="qweight must be int32"):
        check_launch(x, qw[:, :4], s, z, 32)
    with pytest.raises(InputError, match="float16 or bfloat16"):
        check_launch(x.double(), qw, s, z, 32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = torch.device("cpu")
    with pytest.raises(InputError, match="unknown runtime backend"):
        check_backend("fast", cpu)
    with pytest.raises(InputError, match="needs --device cpu"):
        check_backend("aten", torch.device("cuda"))
    if triton_available():
        with pytest.raises(InputError, match="needs a CUDA device"):
            check_backend("triton", cpu)


_INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from compressor.runtime.triton_kernels import KernelConfig, choose_config, pack_w4, w4a16_matmul, w4a16_reference
    from compressor.runtime import Runtime
    torch.manual_seed(0)
    errs = []
    cases = [(1, 48, 64, 32, None), (3, 40, 96, 32, None), (2, 64, 128, 128, None), (20, 64, 128, 64, None),
             (17, 24, 64, 64, None), (33, 80, 96, 32, KernelConfig("gemm", 16, 32, 32, 4, 2)),
             (5, 72, 64, 64, KernelConfig("gemv", 16, 16, 16, 4, 2, 3)), (2, 40, 640, 64, None),
             (24, 48, 320, 32, KernelConfig("gemm", 16, 16, 32, 4, 2, 4))]
    for dtype in (torch.float16, torch.bfloat16):
        for m, n, k, g, cfg in cases:
            cfg = cfg or choose_config(m, n, k, g)
            kind = f"{cfg.kind}/split{cfg.split_k}" if cfg.split_k > 1 else cfg.kind
            q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
            zp = torch.randint(-8, 8, (n, k // g), dtype=torch.int8)
            qw, s, z = pack_w4(q, torch.rand(n, k // g) * 0.1 + 0.01, zp, dtype)
            x = torch.randn(m, k).to(dtype)
            out = w4a16_matmul(x, qw, s, z, g, cfg)
            ref = w4a16_reference(x, qw, s, z, g)
            errs.append([str(dtype), m, n, k, g, kind, float((out.float() - ref.float()).abs().max()),
                         float(ref.float().abs().max())])
    folder = sys.argv[1]
    tri = Runtime.from_artifact(folder, backend="triton", kv=None, act_dtype=torch.float16)
    deq = Runtime.from_artifact(folder, backend="dequant", kv=None, dtype=torch.float32)
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(0))
    a, b = tri.logits(ids), deq.logits(ids)
    tokens = tri.generate([ids[0].tolist()], max_new_tokens=3).tokens[0]
    print(json.dumps({"cases": errs, "kernels": tri.describe()["kernels"], "model_err": float((a - b).abs().max()),
                      "model_max": float(b.abs().max()), "tokens": len(tokens)}))
""")


@pytest.mark.skipif(not triton_available(), reason="triton is an optional extra")
def test_triton_kernels_under_interpreter(artifacts):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT, str(artifacts["w4-asym-ct-fp8kv"])],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    kinds = {(c[0], c[5]) for c in rep["cases"]}
    assert {kind for _, kind in kinds} >= {"gemv", "gemm", "gemv/split3", "gemv/split2", "gemm/split4"}
    assert {d for d, _ in kinds} == {"torch.float16", "torch.bfloat16"}  # bf16 tl.dot too (float32 products)
    for dtype, m, n, k, g, kind, err, mx in rep["cases"]:
        # same numerics contract; the float32 summation order differs, then one output rounding (the
        # interpreter's bfloat16 conversions do not round like torch's: allow a few ulps there); a
        # layout or indexing error would be of the order of mx
        tol = (2 ** -6 if "bfloat16" in dtype else 2 ** -10) * mx + 1e-3
        assert err <= tol, (dtype, m, n, k, g, kind, err, mx)
    assert rep["kernels"] == {"triton-w4a16": 14, "float": 1}
    assert rep["model_err"] < 0.02 * rep["model_max"] and rep["tokens"] == 3


# ---------------------------------------------------------------------------------------
# refusals: one-line InputErrors


def test_refusals(tiny_model_dir, tmp_path):
    def refused(pattern, fn):
        with pytest.raises(InputError, match=pattern) as e:
            fn()
        assert "\n" not in str(e.value)

    refused("not found", lambda: Runtime.from_artifact(tmp_path / "nope"))
    gpt2 = copy_folder(tiny_model_dir, tmp_path / "gpt2", model_type="gpt2")
    refused("unsupported architecture 'gpt2'", lambda: Runtime.from_artifact(gpt2))
    bnb = copy_folder(tiny_model_dir, tmp_path / "bnb", quantization_config={"quant_method": "bitsandbytes"})
    refused("quant_method 'bitsandbytes'", lambda: Runtime.from_artifact(bnb))
    dyn = copy_folder(tiny_model_dir, tmp_path / "dyn", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                        "rope_theta": 10000.0})
    refused("RoPE type 'dynamic'", lambda: Runtime.from_artifact(dyn))
    refused("needs calibrated k_scale/v_scale", lambda: Runtime.from_artifact(tiny_model_dir, kv="fp8"))
    refused("unknown KV-cache scheme", lambda: Runtime.from_artifact(tiny_model_dir, kv="fp4"))
    refused("residual_length >= group_size",
            lambda: Runtime.from_artifact(tiny_model_dir, kv=make_spec("int4", group_size=8, residual_length=0)))
    refused("unknown runtime backend", lambda: Runtime.from_artifact(tiny_model_dir, backend="gpu"))
    rt = Runtime.from_artifact(tiny_model_dir, kv=None)
    refused("prompt 1 is empty", lambda: rt.generate([[1, 2], []]))
    refused("outside the vocabulary", lambda: rt.generate([[1, 99999]]))
    refused("no prompts", lambda: rt.generate([]))
    refused("max_new_tokens", lambda: rt.generate([[1]], max_new_tokens=-1))
    refused("temperature", lambda: rt.generate([[1]], greedy=False, temperature=0))
    refused("input_ids must be", lambda: rt.logits(torch.zeros(3, dtype=torch.long)))
    cache = rt.new_cache(1, 4)
    refused("KV cache full", lambda: rt.decoder.forward(torch.zeros(1, 5, dtype=torch.long), cache))
    (tmp_path / "gpt2" / "model.safetensors").unlink()
    noweights = copy_folder(tiny_model_dir, tmp_path / "noweights")
    (noweights / "model.safetensors").unlink()
    refused("no .safetensors", lambda: Runtime.from_artifact(noweights))
