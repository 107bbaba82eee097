"""Architectures of issue #9: each row of compressor/arch.py on a tiny random-init model built
from its transformers config class (no downloads) through quantize -> verify (and serve-smoke
where the bundled runtime serves it); exact AWQ folding; MoE expert handling (per-expert
checkpoint layout, routed-token counts, cold-expert RTN fallback, float routers); MLA KV-cache
accounting and evaluation; unsupported architectures."""

from __future__ import annotations

import json

import pytest
import torch

from compressor.commands.options import QuantizeOptions, VerifyOptions
from compressor.commands.quantize import run_quantize
from compressor.commands.verify import run_verify
from compressor.arch import ARCHITECTURES, get_arch, get_module, layer_groups, layer_linears
from compressor.artifact import load_artifact, read_kv_cache
from compressor.errors import InputError
from compressor.manifest import load_manifest
from compressor.moe import unfuse_experts
from compressor.layer_inputs import capture_layer_inputs
from compressor.pipeline import quantize_model
from compressor.quant.awq_layer import fold_scales as _fold
from compressor.quant.layer import layer_forward as _layer_forward
from compressor.quant.kv import (
    gqa_layout, kv_budget, kv_bytes_per_token, layout_bytes_per_token, make_spec, mla_layout, quantized_cache,
)
from compressor.quant.rtn import rtn_quantize
from compressor.recipe import load_recipe, with_overrides
from compressor.safetensors_io import read_header

from conftest import assert_clean_error, kvq_run as run
from tiny_models import ARCH_ROWS, CONFIGS, NEW, WRAPPED, make_dir, tiny

MOE = ("glm4_moe", "deepseek_v3", "mixtral", "qwen3_moe")
SERVED = ("llama", "mistral", "qwen2", "qwen3")  # serve-smoke here; every row: tests/test_runtime_rows.py


def test_every_row_has_a_tiny_model():
    """Every row of the table has a tiny model (tests/tiny_models.py): here, as published (the
    Kimi/GLM/DeepSeek-V3.2 layouts of issue #15, tests/test_frontier.py), or wrapped (Kimi K2.5)."""
    assert set(ARCH_ROWS) | set(NEW) == set(CONFIGS) and set(CONFIGS) | set(WRAPPED) == set(ARCHITECTURES)
    assert {k for k, a in ARCHITECTURES.items() if a.runtime} >= set(SERVED) | {"gemma3_text", "glm4", *MOE}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("arch")
    return {mt: make_dir(root / mt, tokenizer, mt) for mt in ARCH_ROWS}


IDS = torch.randint(1, 300, (8, 48), generator=torch.Generator().manual_seed(1))


def _recipe(alg, **kw):
    return with_overrides(load_recipe("w4a16-awq"), **{"algorithm": alg, "weights.group_size": 32, "awq.loss_samples": 4, **kw})


def test_help_lists_the_architecture_table(capsys):
    code, out, _ = run(["quantize", "--help"], capsys)
    text = " ".join(out.split())
    assert code == 0 and all(mt in text for mt in ARCHITECTURES)
    code, out, _ = run(["serve-smoke", "--help"], capsys)
    text = " ".join(out.split())
    assert code == 0 and all(mt in text for mt in ARCHITECTURES)
    assert "exact while a sequence holds at most index_topk tokens" in text


@pytest.mark.parametrize("model_type", ["gemma3_text", "mistral", "glm4", "deepseek_v3"])
def test_captured_layer_inputs_reproduce_the_model(model_type):
    """The pipeline runs each layer on inputs and keyword arguments captured from the model's
    own forward: Gemma's scaled embedding, sliding-window masks (16 and 32 tokens < 48),
    per-layer-type RoPE, GLM's partial rotary and MLA's decoupled RoPE give the model's
    layer outputs exactly."""
    m = tiny(model_type)
    arch = get_arch(model_type)
    layers = get_module(m, arch.layers)
    real = []
    hooks = [layer.register_forward_hook(lambda _m, _i, o: real.append(o[0] if isinstance(o, tuple) else o)) for layer in layers]
    with torch.no_grad():
        m(IDS[:4])
    for h in hooks:
        h.remove()
    hidden, kwargs = capture_layer_inputs(m, arch, IDS[:4], 2, "cpu")
    assert len(hidden) == 2 and hidden[0].shape == (2, 48, 64) and len(kwargs) == 2
    h = torch.cat(hidden)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            h = _layer_forward(layer, h, kwargs[i])
            torch.testing.assert_close(h, real[i], atol=1e-5, rtol=0)
        if model_type in ("gemma3_text", "mistral"):  # the control: without the sliding mask layer 0 differs
            no_mask = {**kwargs[0], "attention_mask": None}
            assert float((_layer_forward(layers[0], torch.cat(hidden), no_mask) - real[0]).abs().max()) > 1e-4


# ---------------------------------------------------------------------------------------
# AWQ scaling groups fold exactly


@pytest.mark.parametrize("model_type", sorted(ARCH_ROWS))
def test_awq_groups_fold_exactly(model_type):
    """Every scaling group of every layer, folded with random scales (norm /= s, Gemma's
    (1 + w) norms included; the up half of GLM's gate_up_proj; routers absorbing s), leaves
    the float model's logits unchanged."""
    m = tiny(model_type)
    arch = get_arch(model_type)
    ref = m(IDS[:2]).logits.double()
    unfuse_experts(m, arch)
    torch.testing.assert_close(m(IDS[:2]).logits.double(), ref, atol=1e-5, rtol=0)  # unfused experts: same function
    from compressor.quant.awq import tie_kv_heads
    from compressor.quant.awq_layer import kv_repeat

    g = torch.Generator().manual_seed(0)
    folded = 0
    for layer in get_module(m, arch.layers):
        for grp in layer_groups(arch, layer):
            prev, lins = get_module(layer, grp.prev_op), [get_module(layer, r) for r in grp.linears]
            kv = kv_repeat(layer, grp) if grp.requires_square else None
            if grp.requires_square and kv is None and lins[0].weight.shape != prev.weight.shape:
                continue
            s = torch.rand(lins[0].in_features, generator=g) * 2 + 0.25
            prev_s = s
            if kv is not None:  # GQA v -> o: one scale per KV-head channel, repeated for its query heads
                s = tie_kv_heads(s, *kv)
                prev_s = s.view(*kv)[:, 0].reshape(-1)
            _fold(prev, prev_s, grp.prev_rows, arch.norm_offset)
            for lin in lins:
                lin.weight.data.mul_(s)
            for a in grp.also_scale:
                get_module(layer, a).weight.data.mul_(s)
            folded += 1
    assert folded >= 2 * 2
    out = m(IDS[:2]).logits.double()
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-5


def test_deepseek_without_q_lora_uses_q_proj():
    """DeepSeek-V2-Lite style MLA (q_lora_rank None: a plain q_proj) through the same row."""
    m = tiny("deepseek_v3", q_lora_rank=None)
    ref = m(IDS).logits
    res = quantize_model(m, _recipe("gptq"), IDS, batch_size=4)
    assert "model.layers.0.self_attn.q_proj" in res.modules and not any("q_a_proj" in n for n in res.modules)
    assert float(torch.nn.functional.kl_div(torch.log_softmax(m(IDS).logits, -1), torch.log_softmax(ref, -1),
                                            log_target=True, reduction="batchmean")) < 0.05


def test_fold_into_a_post_norm_would_not_be_exact():
    """The control for the test above: Gemma's post_attention_layernorm normalizes the
    attention output, so scaling into it (as a naive table would) changes the function."""
    m = tiny("gemma3_text")
    ref = m(IDS[:2]).logits
    layer = m.model.layers[0]
    s = torch.rand(64, generator=torch.Generator().manual_seed(0)) + 0.5
    _fold(layer.post_attention_layernorm, s, None, 1.0)
    layer.mlp.gate_proj.weight.data.mul_(s)
    layer.mlp.up_proj.weight.data.mul_(s)
    assert float((m(IDS[:2]).logits - ref).abs().max()) > 1e-3


def test_moe_router_must_absorb_the_scale():
    """Without scaling the router's input columns, AWQ's fold into the norm would change routing."""
    m = tiny("qwen3_moe")
    arch = get_arch("qwen3_moe")
    ref = m(IDS[:2]).logits
    unfuse_experts(m, arch)
    layer = m.model.layers[1]
    (grp,) = [g for g in layer_groups(arch, layer) if g.also_scale]
    assert grp.also_scale == ("mlp.gate",) and len(grp.linears) == 8 and grp.inputs_at == "mlp"
    s = torch.rand(64, generator=torch.Generator().manual_seed(0)) * 4 + 0.1
    _fold(get_module(layer, grp.prev_op), s, None, 0.0)
    for r in grp.linears:
        get_module(layer, r).weight.data.mul_(s)
    assert float((m(IDS[:2]).logits - ref).abs().max()) > 1e-3


# ---------------------------------------------------------------------------------------
# quantize -> verify (-> serve-smoke) per architecture

ALGORITHM = {"llama": "gptq", "qwen2": "awq", "qwen3": "gptq", "mistral": "awq", "gemma3_text": "awq", "glm4": "awq",
             "glm4_moe": "gptq", "deepseek_v3": "awq", "mixtral": "awq", "qwen3_moe": "gptq"}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, model_dirs):
    root = tmp_path_factory.mktemp("arch-out")
    out = {}
    for mt, src in model_dirs.items():
        out[mt] = root / mt
        kw = {"kv_scheme": "fp8"} if mt in ("deepseek_v3", "qwen2") else {}
        summary = run_quantize(QuantizeOptions(model=str(src), output=out[mt], algorithm=ALGORITHM[mt], group_size=32,
                                               calib_samples=8, calib_seqlen=48, **kw))
        out[mt + ":summary"] = summary
    return out


@pytest.mark.parametrize("model_type", sorted(ARCH_ROWS))
@pytest.mark.slow  # one quantize -> verify / serve per architecture row (make test-fast leaves it out)
def test_quantize_then_verify(model_type, artifacts, model_dirs):
    art = artifacts[model_type]
    summary = artifacts[model_type + ":summary"]
    src = load_model_float(model_dirs[model_type])
    arch = get_arch(model_type)
    unfuse_experts(src, arch)
    n_linears = sum(len(layer_linears(arch, layer)) for layer in get_module(src, arch.layers))
    assert summary["quantization"]["modules"] == n_linears  # every linear, every expert
    rep = run_verify(VerifyOptions(artifact=art, seqlen=64, max_windows=2, max_new_tokens=4, hidden_batches=1))
    assert rep["passed"], rep["failed_gates"]
    assert len(rep["weights"]["tensors"]) == n_linears
    assert rep["weights"]["min_sqnr_db"] > 10  # W4 g32 on random weights: ~20 dB; a broken layout gives ~0
    assert rep["perplexity"]["increase_pct"] < 20 and rep["distribution"]["top1_agreement_pct"] > 50
    # the artifact loads back into transformers' own modules (fused experts for MoE)
    model, _ = load_artifact(art)
    assert type(model).__name__ == type(load_model_float(model_dirs[model_type])).__name__
    # vLLM picks the model class from config.json's architectures: it names a class transformers resolves
    import transformers

    names = json.loads((art / "config.json").read_text())["architectures"]
    assert names == [type(model).__name__] and hasattr(transformers, names[0])


def load_model_float(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", SERVED)
@pytest.mark.slow  # one quantize -> verify / serve per architecture row (make test-fast leaves it out)
def test_serve_smoke_where_the_runtime_serves(model_type, artifacts, capsys):
    code, out, err = run(["serve-smoke", artifacts[model_type], "--max-new-tokens", "4", "--json"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["passed"] and rep["comparison"]["top1_agreement_pct"] >= 70


def test_runtime_refuses_a_row_it_does_not_serve(tmp_path, monkeypatch):
    from dataclasses import replace

    from compressor.runtime.model import check_servable_folder

    monkeypatch.setitem(ARCHITECTURES, "glm4", replace(ARCHITECTURES["glm4"], runtime=False))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm4"}))
    with pytest.raises(InputError, match="does not serve architecture 'glm4'") as e:
        check_servable_folder(tmp_path)
    assert "llama, mistral" in str(e.value) and "kvq verify" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------
# MoE: checkpoint layout, token counts, cold experts, routers


@pytest.mark.parametrize("model_type", MOE)
@pytest.mark.slow  # one quantize -> verify / serve per architecture row (make test-fast leaves it out)
def test_moe_artifact_uses_the_checkpoint_layout(model_type, artifacts, model_dirs):
    """Per-expert tensors under the names the source checkpoint (and vLLM) uses, routers in
    float and listed as ignored, routed-token counts in the manifest."""
    src = set(read_header(model_dirs[model_type] / "model.safetensors"))
    hdr = set(read_header(artifacts[model_type] / "model.safetensors"))
    packed = {k[: -len(".weight_packed")] for k in hdr if k.endswith(".weight_packed")}
    floats = {k for k in hdr if not k.rsplit(".", 1)[-1].startswith("weight_") and k.rsplit(".", 1)[-1] not in ("k_scale", "v_scale")}
    assert {p + ".weight" for p in packed} | floats == src  # nothing renamed, nothing lost
    experts = {p for p in packed if ".experts." in p}
    assert len(experts) == 3 * 4 * (2 if model_type == "mixtral" else 1)
    router = "block_sparse_moe.gate" if model_type == "mixtral" else "mlp.gate"
    assert f"model.layers.1.{router}.weight" in floats
    if model_type == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w2" in packed
    qc = json.loads((artifacts[model_type] / "config.json").read_text())["quantization_config"]
    assert f"model.layers.1.{router}" in qc["ignore"]
    moe = load_manifest(artifacts[model_type]).quality["moe"]
    assert moe["min_tokens"] == 128
    for layer in moe["layers"]:
        assert layer["experts"] == 4 and len(layer["expert_tokens"]) == 4
        assert sum(layer["expert_tokens"]) == 8 * 48 * 2  # every calibration token, top-2


@pytest.mark.slow  # one quantize -> verify / serve per architecture row (make test-fast leaves it out)
def test_kv_only_moe_artifact_equals_transformers_save(tmp_path, model_dirs):
    """With float weights the artifact's tensor names are exactly what transformers'
    save_pretrained writes (its reverse conversion of fused experts), and it loads back."""
    out = tmp_path / "kv"
    run_quantize(QuantizeOptions(model=str(model_dirs["mixtral"]), output=out, recipe="kv-int8", dtype="float16"))
    hdr = read_header(out / "model.safetensors")
    assert set(hdr) == set(read_header(model_dirs["mixtral"] / "model.safetensors"))
    a, b = load_model_float(out), load_model_float(model_dirs["mixtral"])
    torch.testing.assert_close(a(IDS[:2]).logits, b(IDS[:2]).logits, atol=2e-3, rtol=0)  # fp16 storage


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "awq"])
@pytest.mark.slow  # one quantize -> verify / serve per architecture row (make test-fast leaves it out)
def test_moe_formats_round_trip(fmt, tmp_path, model_dirs):
    """Every format writes per-expert tensors that load_artifact stacks back into
    transformers' fused experts: the loaded weights are RTN of the source, expert by expert."""
    from compressor.quant.primitives import dequantize

    out = tmp_path / fmt
    run_quantize(QuantizeOptions(model=str(model_dirs["mixtral"]), output=out, algorithm="rtn", group_size=32,
                                 symmetric=fmt != "awq", format=fmt, dtype="float16"))
    model, _ = load_artifact(out)
    src = load_model_float(model_dirs["mixtral"])
    for i in range(2):
        a, b = model.model.layers[i].mlp.experts, src.model.layers[i].mlp.experts
        for e in range(4):
            for got, w in ((a.gate_up_proj[e, :64], b.gate_up_proj[e, :64]), (a.gate_up_proj[e, 64:], b.gate_up_proj[e, 64:]),
                           (a.down_proj[e], b.down_proj[e])):
                q, scale, zp = rtn_quantize(w, 4, 32, fmt != "awq")
                want = dequantize(q, scale.half(), None if fmt != "awq" else zp, 32, dtype=torch.float32)
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(model.model.layers[1].mlp.gate.weight, src.model.layers[1].mlp.gate.weight.half().float())


def test_targeting_a_router_is_refused():
    with pytest.raises(InputError, match=r"names the MoE router model.layers.1.mlp.gate; routers stay in float"):
        quantize_model(tiny("qwen3_moe"), _recipe("rtn", targets=["re:.*mlp\\.gate"]), None)


def _cold_deepseek(seed=0):
    """DeepSeek-V3 with expert 3 (and, through group routing, expert 2) never selected."""
    m = tiny("deepseek_v3", seed)
    m.model.layers[1].mlp.gate.e_score_correction_bias[3] = -10.0
    return m


@pytest.mark.parametrize("alg", ["gptq", "awq"])
def test_cold_expert_is_quantized_with_rtn_and_flagged(alg):
    m = _cold_deepseek()
    originals = {e: m.model.layers[1].mlp.experts.down_proj[e].clone() for e in range(4)}
    res = quantize_model(m, _recipe(alg, **{"moe.min_tokens": 16}), IDS, batch_size=4)
    (layer,) = res.moe
    assert layer["layer"] == 1 and layer["expert_tokens"][3] == 0 and sum(layer["expert_tokens"]) == 8 * 48 * 2
    cold = {f["expert"] for f in res.moe_fallback}
    assert 3 in cold and cold == set(layer["below_min_tokens"]) and cold != {0, 1, 2, 3}
    assert all(f["method"] == "rtn" and f["layer"] == 1 and len(f["modules"]) == 3 for f in res.moe_fallback)
    for e in range(4):  # every expert quantized, cold or not
        for p in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.1.mlp.experts.{e}.{p}" in res.modules
    if alg == "gptq":  # the cold expert's down_proj is plain RTN of its weights; a warm one is not
        rec = res.modules["model.layers.1.mlp.experts.3.down_proj"]
        q, scale, zp = rtn_quantize(originals[3], 4, 32, False)
        assert torch.equal(rec.q, q) and torch.equal(rec.scale, scale.half())
        warm = min(set(range(4)) - cold)
        q, _, _ = rtn_quantize(originals[warm], 4, 32, False)
        assert not torch.equal(res.modules[f"model.layers.1.mlp.experts.{warm}.down_proj"].q, q)
    assert any("quantized with RTN" in w for w in res.warnings)


@pytest.mark.slow  # one quantize -> verify / serve per architecture row (make test-fast leaves it out)
def test_min_tokens_threshold_flags_every_expert_in_the_manifest(tmp_path, model_dirs):
    out = tmp_path / "mix"
    summary = run_quantize(QuantizeOptions(model=str(model_dirs["mixtral"]), output=out, algorithm="gptq", group_size=32,
                                           calib_samples=4, calib_seqlen=32, settings=(("moe.min_tokens", 10**6),)))
    fb = load_manifest(out).quality["moe"]["fallback"]
    assert {(f["layer"], f["expert"]) for f in fb} == {(i, e) for i in range(2) for e in range(4)}
    assert fb[0]["modules"][0].startswith("model.layers.0.block_sparse_moe.experts.0.w")
    assert "min_tokens 1000000" in fb[0]["reason"] and summary["moe"]["fallback"] == fb
    assert run_verify(VerifyOptions(artifact=out, weights_only=True))["passed"]


# ---------------------------------------------------------------------------------------
# MLA KV cache


def test_mla_kv_bytes_per_token_by_hand():
    """DeepSeek-V3 / Kimi K2 shape: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64."""
    mla = mla_layout(61, 512, 64)
    assert layout_bytes_per_token(None, mla) == 61 * (512 + 64) * 2 == 70272
    assert layout_bytes_per_token(make_spec("fp8"), mla) == 61 * 576 == 35136
    assert layout_bytes_per_token(make_spec("int8"), mla) == 61 * (576 + 2 * 4)  # scale + zero (fp16) per part and token
    # KIVI int4 g32: half a byte per element, plus fp16 scale + zero per channel every 32 tokens
    assert layout_bytes_per_token(make_spec("int4"), mla) == 61 * (576 / 2 + 576 / 32 * 4) == 21960
    # what counting 128 heads x (192 key + 128 value) dims, as a GQA cache would, gives instead
    assert kv_bytes_per_token(None, 61, 128, 192) > 20 * 70272
    b = kv_budget(make_spec("fp8"), 61, 128, 192, 1.0, contexts=(4096,), layout=mla)
    assert b["bytes_per_token"] == 35136 and b["max_tokens"] == 2**30 // 35136
    assert b["max_batch"][4096] == 2**30 // (4096 * 35136)
    assert layout_bytes_per_token(None, gqa_layout(30, 3, 64)) == kv_bytes_per_token(None, 30, 3, 64) == 23040


def test_mla_cache_holds_the_latent_and_rope_key():
    m = tiny("deepseek_v3")
    layout = get_arch("deepseek_v3").kv_layout(m.config)
    assert [(c.name, c.heads, c.width) for c in layout.components] == [("latent", 1, 32), ("rope key", 1, 8)]
    cache = quantized_cache(make_spec("int4", group_size=8, residual_length=8), 2, layout=layout)
    with torch.no_grad():
        m(IDS[:2, :40], use_cache=True, cache=cache)
    layer = cache.layers[0]
    assert layer.n_quantized == 32 and layer.keys.shape == (2, 1, 8, 32) and layer.values.shape == (2, 1, 8, 8)
    codes, scale, _ = layer.qk[0]  # the latent, per channel in groups of 8 tokens
    assert codes.shape == (2, 1, 32, 32) and scale.shape == (2, 1, 4, 32)
    codes, scale, _ = layer.qv[0]  # the RoPE key, per channel too
    assert codes.shape == (2, 1, 32, 8) and scale.shape == (2, 1, 4, 8)
    with pytest.raises(InputError, match="latent attention .* per-head"):
        quantized_cache(make_spec("fp8", "head"), 2, {0: (torch.ones(1),) * 2, 1: (torch.ones(1),) * 2}, layout)


@pytest.mark.slow  # one quantize -> verify / serve per architecture row (make test-fast leaves it out)
def test_mla_fp8_artifact_shared_scale_and_accounting(artifacts):
    art = artifacts["deepseek_v3"]
    rec = load_manifest(art).kv_cache
    assert rec["layout"]["attention"] == "mla"
    assert rec["bytes_per_token"] == 2 * (32 + 8) * 1 and rec["fp16_bytes_per_token"] == 2 * (32 + 8) * 2
    spec, scales = read_kv_cache(art)
    for k, v in scales.values():  # one scale for the whole [latent | rope key] entry, as vLLM's MLA cache
        assert k.shape == (1,) and torch.equal(k, v)
    rep = run_verify(VerifyOptions(artifact=art, seqlen=64, max_windows=1, max_new_tokens=2, kv_chunk=16, hidden_batches=1))
    assert rep["passed"] and rep["kv_cache"]["bytes_per_token"] == 80 and rep["kv_cache"]["layout"]["attention"] == "mla"
    assert set(rep["perplexity_breakdown"]) == {"reference", "weights only", "weights + KV", "KV only"}
    assert rep["perplexity_breakdown"]["KV only"]["ppl"] != rep["perplexity_breakdown"]["reference"]["ppl"]


def test_mla_refuses_per_head_kv_scales(tmp_path, model_dirs, capsys):
    code, _, err = run(["quantize", model_dirs["deepseek_v3"], "-o", tmp_path / "x", "--recipe", "kv-fp8",
                        "--set", "kv_cache.strategy=head", "--calib-samples", "2", "--calib-seqlen", "16"], capsys)
    assert_clean_error(code, err, 2, "per-head scales do not apply", tmp_path)


# ---------------------------------------------------------------------------------------
# unsupported architectures


@pytest.mark.parametrize("model_type", ["gpt2", "bloom"])
def test_unsupported_architecture_is_one_line_exit_2(model_type, tmp_path, tokenizer, capsys):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    cfg = CONFIG_MAPPING[model_type](vocab_size=len(tokenizer), n_embd=32, hidden_size=32, n_layer=1, n_head=2)
    src = tmp_path / model_type
    AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    tokenizer.save_pretrained(src)
    capsys.readouterr()  # transformers' save progress
    code, _, err = run(["quantize", src, "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, f"unsupported architecture '{model_type}'; supported: ", tmp_path)
    assert ", ".join(sorted(ARCHITECTURES)) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_gqa_v_to_o_scaling_is_exact_only_when_tied():
    """Issue #18: under GQA the v_proj -> o_proj group folds exactly when each KV head's
    scale is repeated across the query heads reading it (kvq's tie); untied scales change
    the function (the control)."""
    from compressor.quant.awq import tie_kv_heads
    from compressor.quant.awq_layer import kv_repeat

    out = {}
    for tied in (True, False):
        m = tiny("llama")
        ref = m(IDS[:2]).logits.double()
        arch = get_arch("llama")
        layer = get_module(m, arch.layers)[0]
        grp = next(g for g in layer_groups(arch, layer) if g.prev_op == "self_attn.v_proj")
        kv = kv_repeat(layer, grp)
        assert kv is not None and kv[1] > 1, kv  # the tiny llama is GQA
        s = torch.rand(layer.self_attn.o_proj.in_features, generator=torch.Generator().manual_seed(2)) * 2 + 0.25
        if tied:
            s = tie_kv_heads(s, *kv)
        _fold(layer.self_attn.v_proj, s.view(*kv)[:, 0].reshape(-1), None, 0.0)
        layer.self_attn.o_proj.weight.data.mul_(s)
        out[tied] = float((m(IDS[:2]).logits.double() - ref).abs().max() / ref.abs().max())
    assert out[True] < 1e-5 and out[False] > 1e-3, out


def test_verify_recovers_the_gqa_v_to_o_scale():
    """verify's weight report undoes AWQ's folded scales; under GQA the o_proj column scale is
    the v_proj row scale repeated per query head (a real-model run showed 3 dB SQNR when it
    was not undone)."""
    import copy

    from compressor.quality import _awq_equivalent_scales
    from compressor.quant.awq import tie_kv_heads
    from compressor.quant.awq_layer import kv_repeat

    ref = tiny("llama")
    art = copy.deepcopy(ref)
    arch = get_arch("llama")
    layer = get_module(art, arch.layers)[0]
    grp = next(g for g in layer_groups(arch, layer) if g.prev_op == "self_attn.v_proj")
    kv = kv_repeat(layer, grp)
    s = tie_kv_heads(torch.rand(layer.self_attn.o_proj.in_features, generator=torch.Generator().manual_seed(4)) + 0.5, *kv)
    _fold(layer.self_attn.v_proj, s.view(*kv)[:, 0].reshape(-1), None, 0.0)
    layer.self_attn.o_proj.weight.data.mul_(s)
    scales = _awq_equivalent_scales(ref, art, arch)
    col = scales["model.layers.0.self_attn.o_proj"][1]
    torch.testing.assert_close(col.float(), s, rtol=1e-4, atol=1e-6)
