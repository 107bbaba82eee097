"""Per-RoPE-pair changes of the key basis for a static fp8 KV cache (``kv_cache.key_rotation: pairs``, issue #18)."""

import json
import math

import pytest
import torch

from compressor.quant.kv import make_spec
from compressor.quant.kv_rotation import (FACTORS, choose_angles, choose_factors, resolve_key_rotation, turn_rows,
                                          undo_pairs)


def _tiny(model_type: str, **kw):
    """The row's tiny model: as transformers saves it, or with a release's router bias (the published-only rows)."""
    from tiny_models import ARCH_ROWS, tiny, tiny_published

    return (tiny if model_type in ARCH_ROWS else tiny_published)(model_type, **kw)


def _change_pairs(model, z_k: list[torch.Tensor]):
    """Multiply every layer's key pairs by ``z_k[i]`` (complex ``[kv_heads, d/2]``) and the query
    pairs reading them by ``1 / conj(z)``."""
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        d = attn.head_dim
        g = attn.q_proj.out_features // attn.k_proj.out_features
        z = z_k[i]
        turn_rows(attn.k_proj, z.real, z.imag, d)
        zq = (1 / z.conj()).repeat_interleave(g, 0)
        turn_rows(attn.q_proj, zq.real, zq.imag, d)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_complex_factors_per_pair_leave_every_logit_unchanged(model_type):
    """The exactness the feature rests on: any complex factor per KV pair (angle and scale), with
    its inverse conjugate on the query pairs, commutes with RoPE (GQA; qwen2 with q/k biases)."""
    model = _tiny(model_type, num_attention_heads=4, num_key_value_heads=2).double()
    ids = torch.randint(0, 320, (2, 24))
    ref = model(ids).logits
    kv_heads = model.config.num_key_value_heads
    d = model.model.layers[0].self_attn.head_dim
    torch.manual_seed(3)
    z = [torch.polar(torch.rand(kv_heads, d // 2, dtype=torch.float64) + 0.5,
                     torch.rand(kv_heads, d // 2, dtype=torch.float64) * 2 * math.pi) for _ in model.model.layers]
    k_before = model.model.layers[0].self_attn.k_proj.weight.clone()
    _change_pairs(model, z)
    assert (model.model.layers[0].self_attn.k_proj.weight - k_before).abs().max() > 1e-2  # the keys did change
    torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=1e-10)


def test_undo_pairs_recovers_the_reference_rows():
    torch.manual_seed(0)
    d, heads = 16, 3
    w = torch.randn(heads * d, 40, dtype=torch.float64)
    z = torch.polar(torch.rand(heads, d // 2, dtype=torch.float64) + 0.5, torch.rand(heads, d // 2, dtype=torch.float64) * 6)

    class Lin:
        weight = torch.nn.Parameter(w.clone())
        bias = None

    turn_rows(Lin, z.real, z.imag, d)
    assert (Lin.weight - w).abs().max() > 0.1
    torch.testing.assert_close(undo_pairs(w, Lin.weight.detach(), d), w, rtol=0, atol=1e-12)
    noisy = Lin.weight.detach() + 1e-3 * torch.randn_like(w)  # quantization error: stays as error
    back = undo_pairs(w, noisy, d)
    assert 0.5e-3 < (back - w).pow(2).mean().sqrt() < 2e-3


def test_angles_spread_a_pair_whose_queries_and_keys_share_one_channel():
    """Query and key energy on channel a of pair 0 only: 45 degrees halves the moments' product;
    a pair with the query on a and the key on b is left alone (0 degrees)."""
    torch.manual_seed(0)
    q = torch.zeros(2, 2, 50, 4)
    k = torch.zeros(2, 1, 50, 4)
    q[..., 0], k[..., 0] = torch.randn(2, 2, 50), torch.randn(2, 1, 50)  # pair 0: (channel 0, channel 2)
    q[..., 1], k[..., 3] = torch.randn(2, 2, 50), torch.randn(2, 1, 50)  # pair 1: query on 1, key on 3
    phi = choose_angles(q, k)
    assert phi.shape == (1, 2)
    assert abs(math.degrees(float(phi[0, 0])) - 45) < 1e-4 and float(phi[0, 1]) == 0.0


def test_factors_find_the_one_that_puts_the_keys_on_the_fp8_grid():
    """Keys that are e4m3 values divided by 2^(-5/16) round exactly once multiplied by that factor:
    the search picks it (every other factor leaves a rounding error)."""
    spec = make_spec("fp8", "tensor")
    torch.manual_seed(0)
    scale = torch.tensor([0.01])
    grid = (torch.randn(2, 1, 64, 8) * 100).clamp(-440, 440).to(torch.float8_e4m3fn).float() * scale
    target = FACTORS[5]
    k = grid / target
    q = torch.randn(2, 2, 64, 8)
    f = choose_factors(q, k, spec.codec, scale, 8 ** -0.5)
    assert f.shape == (1, 4) and torch.allclose(f, torch.full((1, 4), target))


def test_resolution_and_refusals():
    from compressor.errors import InputError
    from compressor.recipe import Recipe, load_recipes

    r = load_recipes(["kv-fp8"]).model_dump()
    fp8 = Recipe.model_validate({**r, "kv_cache": {**r["kv_cache"], "key_rotation": "auto"}}).kv_cache
    pairs = Recipe.model_validate({**r, "kv_cache": {**r["kv_cache"], "key_rotation": "pairs"}}).kv_cache
    llama, mla = _tiny("llama").config, _tiny("deepseek_v3").config
    assert resolve_key_rotation(fp8, llama, "attention") == "pairs"
    assert resolve_key_rotation(fp8, llama, "absmax") == "none"
    assert resolve_key_rotation(fp8, mla, "absmax") == "none"
    assert resolve_key_rotation(None, llama, "absmax") == "none"
    with pytest.raises(InputError, match="needs the static scales searched"):
        resolve_key_rotation(pairs, llama, "absmax")
    with pytest.raises(InputError, match="deepseek_v3"):
        resolve_key_rotation(pairs, mla, "attention")
    int8 = load_recipes(["kv-int8"]).model_dump()
    with pytest.raises(ValueError, match="key_rotation pairs applies to static scales"):
        Recipe.model_validate({**int8, "kv_cache": {**int8["kv_cache"], "key_rotation": "pairs"}})
    fp8 = load_recipes(["kv-fp8"]).model_dump()  # refused with the recipe, before any model is loaded
    with pytest.raises(ValueError, match="key_rotation pairs needs the scales searched"):
        Recipe.model_validate({**fp8, "kv_cache": {**fp8["kv_cache"], "key_rotation": "pairs", "scale_search": "absmax"}})
    assert "key_rotation" not in load_recipes(["kv-fp8"]).model_dump()["kv_cache"]  # the default serializes as before


def _quantize(model_dir, out, *extra, algorithm="none", dtype="float32"):
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize

    return run_quantize(QuantizeOptions(model=str(model_dir), output=out, recipe=("kv-fp8",), algorithm=algorithm,
                                        group_size=32, dtype=dtype, calib_samples=4, calib_seqlen=32,
                                        settings=(("kv_cache.scale_search_samples", 2), *extra)))


def test_a_kv_only_artifact_with_changed_pairs_computes_the_source_function(tiny_model_dir, tmp_path, capsys):
    """float32 KV-only artifact: q_proj/k_proj rows differ from the source, the logits (float KV)
    do not; the manifest records the change and each layer's figures."""
    from transformers import AutoModelForCausalLM

    from compressor.artifact import load_artifact
    from compressor.manifest import load_manifest

    out = tmp_path / "pairs"
    _quantize(tiny_model_dir, out, ("kv_cache.key_rotation", "pairs"))
    man = load_manifest(out)
    assert man.kv_cache["key_rotation"] == "pairs" and man.recipe["kv_cache"]["key_rotation"] == "pairs"
    figs = [f["kv_scale_multipliers"]["key_pairs"] for f in man.quality["layers"]]
    assert len(figs) == 2 and all(0 <= f["mean_angle_deg"] < 90 and 0.5 < f["mean_factor"] <= 1 for f in figs)
    art, _ = load_artifact(out, dtype=torch.float32)
    src = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    a, s = art.model.layers[0].self_attn, src.model.layers[0].self_attn
    assert (a.k_proj.weight - s.k_proj.weight).abs().max() > 1e-3 and (a.q_proj.weight - s.q_proj.weight).abs().max() > 1e-3
    assert torch.equal(a.v_proj.weight, s.v_proj.weight)
    ids = torch.randint(0, src.config.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(art(ids).logits, src(ids).logits, rtol=0, atol=2e-4)
    # verify's check that the KV-only figures (reference in the artifact's key basis) describe it
    from compressor.quality import KEY_PAIRS_TOLERANCE, key_pairs_residual

    worst, _ = key_pairs_residual(src, art)
    assert worst < 1e-6
    with torch.no_grad():
        a.k_proj.weight[3, :5] += 0.5  # one row no longer a turned pair of the source's
    worst, name = key_pairs_residual(src, art)
    assert worst > KEY_PAIRS_TOLERANCE and name == "model.layers.0.self_attn.k_proj.weight"
    from conftest import kvq_run

    code, _, err = kvq_run(["verify", out, "--weights-only"], capsys)  # the artifact as written passes the check
    assert code == 0 and "key pairs: q_proj/k_proj are the reference's rows changed per RoPE pair" in " ".join(err.split()), err


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_weight_statistics_undo_the_pairs_of_a_quantized_artifact(tiny_model_dir, tmp_path):
    """RTN W4 + fp8 KV with the pairs changed: verify's weight statistics (factors divided out)
    give q_proj/k_proj errors of the size the unchanged run has; without the undo they are wrong."""
    from transformers import AutoModelForCausalLM

    from compressor.commands.options import QuantizeOptions, VerifyOptions
    from compressor.commands.quantize import run_quantize
    from compressor.commands.verify import run_verify
    from compressor.artifact import load_artifact
    from compressor.manifest import load_manifest
    from compressor.quality import weight_report

    src = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    errs = {}
    for mode in ("none", "pairs"):
        out = tmp_path / mode
        _quantize(tiny_model_dir, out, ("kv_cache.key_rotation", mode), algorithm="rtn", dtype="bfloat16")
        art, _ = load_artifact(out, dtype=torch.float32)
        if mode == "pairs":  # q/k rows quantized: no angles (they would mix rows before rounding), factors only
            figs = [f["kv_scale_multipliers"]["key_pairs"] for f in load_manifest(out).quality["layers"]]
            assert all(f["angles"].startswith("none") and 0.5 < f["mean_factor"] <= 1 for f in figs)
        for undo in (True, False):
            rep = weight_report(src, art, "rtn", key_pairs=undo and mode == "pairs")
            errs[mode, undo] = {t["name"]: t["rel_fro"] for t in rep["tensors"]}
            assert rep["key_pairs_undone"] == (undo and mode == "pairs")
    qk = [n for n in errs["none", True] if n.endswith(("q_proj.weight", "k_proj.weight"))]
    assert len(qk) == 4
    for n in qk:
        assert errs["pairs", True][n] < 1.5 * errs["none", True][n]
        assert errs["pairs", False][n] > 3 * errs["none", True][n]
    v = [n for n in errs["none", True] if n.endswith("v_proj.weight")]
    assert all(errs["pairs", True][n] == errs["none", True][n] for n in v)  # other linears untouched
    # the pairs artifact calibrated again (another KV scheme): its q/k rows are carried, so
    # the new manifest keeps key_rotation and verify still divides the factors out
    carried = tmp_path / "carried-int8"
    run_quantize(QuantizeOptions(model=str(tmp_path / "pairs"), output=carried, recipe=("kv-int8",)))
    assert load_manifest(carried).kv_cache["key_rotation"] == "pairs"
    rep = run_verify(VerifyOptions(artifact=carried, reference=str(tiny_model_dir), weights_only=True))["weights"]
    assert rep["key_pairs_undone"] is True
    assert all(rep_t["rel_fro"] < 1.5 * errs["none", True][rep_t["name"]] for rep_t in rep["tensors"]
               if rep_t["name"] in qk)
    own = run_verify(VerifyOptions(artifact=carried, weights_only=True))["weights"]  # against its carried source
    assert own["tensors"] == []  # every tensor byte for byte: nothing to list, no fit noise on q/k


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_verify_measures_the_kv_only_row_in_the_artifacts_key_basis(tmp_path):
    """A KV-only artifact's row runs the artifact as served, its keys in the basis its scales were
    chosen in: verify's row equals the artifact's own model with its cache; the reference with the
    plain cache (the keys in another basis) differs."""
    from transformers import AutoModelForCausalLM

    from compressor.commands.options import VerifyOptions
    from compressor.commands.verify import run_verify
    from compressor.artifact import load_artifact, read_kv_cache
    from compressor.arch import get_arch
    from compressor.calib import load_text, tokenize
    from compressor.evaluate import compare, windows
    from compressor.quant.kv import quantized_cache

    from conftest import make_model_dir, tiny_tokenizer

    # weights 10x transformers' init: peaked attention and logits (at 0.02 the KV cache's rounding costs nothing)
    model_dir = make_model_dir(tmp_path / "sharp", tiny_tokenizer(), seed=1, initializer_range=0.2)
    src = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = tmp_path / "pairs"
    _quantize(model_dir, out, ("kv_cache.key_rotation", "pairs"))
    rep = run_verify(VerifyOptions(artifact=out, seqlen=64, max_windows=2, max_new_tokens=4, hidden_batches=1))
    assert rep["perplexity"]["measured_on"] == "KV only"
    kl = rep["distribution"]["kl"]["mean"]
    art, tok = load_artifact(out, dtype=torch.float32)
    spec, scales = read_kv_cache(out)
    layout = get_arch("llama").kv_layout(src.config)
    cache = lambda: quantized_cache(spec, 2, scales, layout)  # noqa: E731
    wins = windows(tokenize(tok, load_text("embedded", part="eval").text), 64, 2)
    res = compare(src, {"artifact": (art, cache), "plain": (src, cache)}, wins)
    # the same to float rounding (1e-6 relative when written); the plain row is 3 % off on this model
    assert kl > 0 and abs(res["artifact"]["kl"]["mean"] - kl) <= 1e-4 * kl
    assert abs(res["plain"]["kl"]["mean"] - kl) > 0.01 * kl


def test_the_cache_turns_keys_into_a_basis_and_back():
    """Keys written through a cache with a key basis come back in the model's own basis, rounded
    in the other one (equal to rounding the turned keys and turning them back)."""
    from compressor.quant.kv import quantized_cache
    from compressor.kv_layout import turn_keys

    spec = make_spec("fp8", "tensor")
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    z = torch.polar(torch.rand(2, 4, dtype=torch.float64) + 0.5, torch.rand(2, 4, dtype=torch.float64) * 6)
    s = torch.tensor([0.01])
    cache = quantized_cache(spec, 1, {0: (s, s)}, key_basis={0: z})
    k_out, v_out = cache.layers[0].update(k, v)
    expect = turn_keys(spec.codec.fake_quantize(turn_keys(k, z), "k", s), 1 / z)
    torch.testing.assert_close(k_out, expect)
    torch.testing.assert_close(v_out, spec.codec.fake_quantize(v, "v", s))
    assert (k_out - spec.codec.fake_quantize(k, "k", s)).abs().max() > 1e-3  # not the plain rounding
    with pytest.raises(Exception, match="key basis applies to static"):
        quantized_cache(make_spec("int8", "token"), 1, key_basis={0: z})


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_quantize_says_what_it_did_to_the_cache(tiny_model_dir, tmp_path, capsys):
    """The console and the JSON summary name the KV scheme, the scale search and the key pairs."""
    from conftest import kvq_run

    argv = ["quantize", tiny_model_dir, "--kv-scheme", "fp8", "--set", "kv_cache.key_rotation=pairs", "--set",
            "kv_cache.scale_search_samples=2", "--calib-samples", "4", "--calib-seqlen", "32", "--dtype", "float32"]
    code, out, err = kvq_run([*argv, "-o", tmp_path / "kv", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["kv_cache"] == {"scheme": "fp8", "strategy": "tensor", "scale_search": "attention",
                                           "key_rotation": "pairs"}
    code, _, err = kvq_run([*argv, "-o", tmp_path / "kv2"], capsys)
    assert code == 0, err
    assert "KV cache: fp8 per tensor, static scales searched on the attention output, key pairs changed" in " ".join(err.split())
