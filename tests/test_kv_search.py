"""Static KV scales chosen by the attention output's error (``kv_cache.scale_search: attention``, issue #18)."""

import pytest
import torch

from compressor.quant.kv import FP8_MAX, make_spec
from compressor.quant.kv_search import GRID, AttentionRecorder, _errors, search_kv_ranges


def _attention(impl: str, seed: int = 0):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg._attn_implementation = impl
    attn = LlamaAttention(cfg, 0).eval()
    with torch.no_grad():
        attn.k_proj.weight[:3] *= 8.0  # a few large key channels, as real models have
    rope = LlamaRotaryEmbedding(cfg)
    x = torch.randn(3, 40, 64)
    return attn, x, rope(x[:1], torch.arange(40)[None])


def _observed(attn, x, pe):
    """Post-RoPE keys and values the way the cache sees them, and their absmax per KV head."""
    seen = {}

    class Cache:
        def update(self, k, v, layer_idx, **kw):
            seen["k"], seen["v"] = k, v
            return k, v

    with torch.no_grad():
        attn(hidden_states=x, position_embeddings=pe, attention_mask=None, cache=Cache())
    return seen["k"].abs().amax((0, 2, 3)), seen["v"].abs().amax((0, 2, 3))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_recorder_records_the_attention_inputs_and_restores_the_config(impl):
    attn, x, pe = _attention(impl)
    with torch.no_grad():
        ref = attn(hidden_states=x, position_embeddings=pe, attention_mask=None)[0]
    rec = AttentionRecorder(attn, max_sequences=2)
    with torch.no_grad(), rec.active():
        out = attn(hidden_states=x, position_embeddings=pe, attention_mask=None)[0]
    assert torch.equal(out, ref)  # the model's own attention ran
    assert attn.config._attn_implementation == impl
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert "kvq_kv_record" not in ALL_ATTENTION_FUNCTIONS
    (q, k, v, _mask, kw), = rec.records
    assert q.shape == (2, 4, 40, 16) and k.shape == v.shape == (2, 2, 40, 16) and rec.seen == 2
    # rerunning the recorded call gives the module's attention output (before o_proj)
    o, _ = rec.delegate(attn, q, k, v, None, **kw)
    torch.testing.assert_close(attn.o_proj(o.reshape(2, 40, -1)), ref[:2])


@pytest.mark.parametrize("strategy", ["tensor", "head"])
def test_search_never_does_worse_than_absmax_on_its_sequences(strategy):
    attn, x, pe = _attention("sdpa", seed=1)
    k_abs, v_abs = _observed(attn, x, pe)
    rec = AttentionRecorder(attn, max_sequences=3)
    with torch.no_grad(), rec.active():
        attn(hidden_states=x, position_embeddings=pe, attention_mask=None)
    spec = make_spec("fp8", strategy)
    k_range, v_range, mk, mv = search_kv_ranges(rec, spec, k_abs, v_abs, torch.float16)
    assert mk.shape == mv.shape == (2,) and all(min(abs(m - g) for g in GRID) < 1e-6 for m in mk.tolist() + mv.tolist())
    if strategy == "tensor":
        assert mk[0] == mk[1] and mv[0] == mv[1]
    torch.testing.assert_close(k_range, k_abs * mk)

    def scale(a):
        return spec.codec.scale_from_absmax(a).half().float()

    with torch.no_grad():
        searched, plain = _errors(rec, spec, [scale(k_range), scale(k_abs)], [scale(v_range), scale(v_abs)], 2)
    assert searched.sum() <= plain.sum()
    assert plain.sum() > 0


def test_search_with_nothing_recorded_keeps_absmax():
    attn, _, _ = _attention("sdpa")
    k_abs, v_abs = torch.tensor([2.0, 3.0]), torch.tensor([1.0, 4.0])
    k_range, v_range, mk, mv = search_kv_ranges(AttentionRecorder(attn, 2), make_spec("fp8", "tensor"), k_abs, v_abs,
                                                torch.float16)
    assert torch.equal(k_range, k_abs) and torch.equal(v_range, v_abs) and mk.tolist() == mv.tolist() == [1.0, 1.0]


def test_quantize_with_the_search_stores_the_searched_scales(tiny_model_dir, tmp_path):
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize
    from compressor.artifact import read_kv_cache
    from compressor.manifest import load_manifest

    out = tmp_path / "searched"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, recipe=("w4a16-rtn-g64", "kv-fp8"), group_size=32,
                                 calib_samples=4, calib_seqlen=32,
                                 settings=(("kv_cache.scale_search", "attention"), ("kv_cache.scale_search_samples", 2))))
    man = load_manifest(out)
    mults = [f["kv_scale_multipliers"] for f in man.quality["layers"]]
    assert len(mults) == 2 and all(set(m) == {"k", "v", "sequences"} and m["sequences"] == 2 and len(m["k"]) == 1
                                   and all(x in [round(g, 4) for g in GRID] for x in m["k"] + m["v"]) for m in mults)
    assert not any("scale_search_samples" in w for w in man.quality["warnings"])
    assert man.recipe["kv_cache"]["scale_search"] == "attention" and man.kv_cache["scale_search"] == "attention"
    _, scales = read_kv_cache(out)
    for i in range(2):  # each stored scale is the recorded range / 448 (the range: absmax x the chosen multiplier)
        rng = man.kv_cache["absmax"][str(i)]["k"]
        torch.testing.assert_close(scales[i][0], (torch.tensor(rng).max() / FP8_MAX).reshape(1), rtol=1e-2, atol=1e-6)


def test_recipes_without_the_search_serialize_as_before():
    from compressor.recipe import FULL_DUMP, load_recipes

    r = load_recipes(["kv-int8"])
    assert "scale_search" not in r.model_dump()["kv_cache"]
    assert r.model_dump(context=FULL_DUMP)["kv_cache"]["scale_search"] == "absmax"
    assert load_recipes(["kv-fp8"]).model_dump()["kv_cache"]["scale_search"] == "auto"


def test_the_search_is_refused_where_it_cannot_apply(tiny_model_dir, tmp_path):
    from compressor.errors import InputError
    from compressor.recipe import Recipe, load_recipes

    base = load_recipes(["kv-int8"]).model_dump()
    base["kv_cache"]["scale_search"] = "attention"
    with pytest.raises(ValueError, match="applies to static scales"):
        Recipe.model_validate(base)  # int8 per token: dynamic scales, nothing to search
    base["kv_cache"]["scale_search"] = "auto"  # auto: nothing to search there, accepted
    assert Recipe.model_validate(base).kv_cache.scale_search == "auto"

    from tiny_models import tiny_published as tiny

    from compressor.pipeline import quantize_model

    r = load_recipes(["kv-fp8"]).model_dump()
    assert r["kv_cache"]["scale_search"] == "auto"  # the bundled recipe
    r["kv_cache"]["scale_search"] = "attention"
    r["algorithm"] = "none"
    with pytest.raises(InputError, match="MLA"):
        quantize_model(tiny("deepseek_v3"), Recipe.model_validate(r), torch.randint(0, 300, (2, 16)))
    r["kv_cache"]["scale_search"] = "auto"  # on MLA: absmax, recorded
    result = quantize_model(tiny("deepseek_v3"), Recipe.model_validate(r), torch.randint(0, 300, (2, 16)))
    assert result.kv_scale_search == "absmax" and all("kv_scale_multipliers" not in f for f in result.layers)


def test_the_fp8_shortcut_searches_like_the_recipe(tiny_model_dir, tmp_path):
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize
    from compressor.manifest import load_manifest

    out = tmp_path / "shortcut"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, algorithm="rtn", group_size=32, calib_samples=2,
                                 calib_seqlen=32, kv_scheme="fp8"))
    man = load_manifest(out)
    assert man.recipe["kv_cache"]["scale_search"] == "auto" and man.kv_cache["scale_search"] == "attention"
    assert all(f["kv_scale_multipliers"]["sequences"] == 2 for f in man.quality["layers"])
    # the search asked for more sequences than the calibration set holds: it uses them all and says so
    assert any("scale_search_samples is 4 but the calibration set has 2" in w for w in man.quality["warnings"])
    # what --kv-scheme's help says --set changes on top of the shortcut: per-head scales, absmax
    out = tmp_path / "set"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, algorithm="rtn", group_size=32, calib_samples=2,
                                 calib_seqlen=32, kv_scheme="fp8",
                                 settings=(("kv_cache.strategy", "head"), ("kv_cache.scale_search", "absmax"))))
    man = load_manifest(out)
    assert man.recipe["kv_cache"]["strategy"] == "head" and man.kv_cache["scale_search"] == "absmax"
    assert all("kv_scale_multipliers" not in f for f in man.quality["layers"])


def test_errors_of_a_bfloat16_model_are_taken_in_float32():
    """``kvq verify`` evaluates a bfloat16 artifact in bfloat16: the search scores its records in
    float32 (the same numbers as float32 copies of the records), not with bfloat16's own rounding."""
    attn, x, pe = _attention("sdpa", seed=2)
    attn = attn.to(torch.bfloat16)
    rec = AttentionRecorder(attn, max_sequences=2)
    with torch.no_grad(), rec.active():
        attn(hidden_states=x.bfloat16(), position_embeddings=tuple(p.bfloat16() for p in pe), attention_mask=None)
    spec = make_spec("fp8", "tensor")
    scales = [torch.tensor([s]) for s in (0.02, 0.03)]
    got = _errors(rec, spec, scales, scales, 2)
    rec.records = [(q.float(), k.float(), v.float(), m, kw) for q, k, v, m, kw in rec.records]
    torch.testing.assert_close(got, _errors(rec, spec, scales, scales, 2))
