"""LM-head quantization (recipe ``head:``, issue #18): layout, untying, loaders, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_clean_error, make_model_dir
from conftest import kvq_run as run
from safetensors import safe_open

from compressor.api import QuantizeOptions, run_quantize
from compressor.artifact import load_artifact
from compressor.manifest import load_manifest

QUICK = dict(algorithm="rtn", group_size=32, calib_samples=4, calib_seqlen=32)


def _recipe(tmp_path, head: str, symmetric: bool = False):
    # transformers 5.24 with compressed-tensors 0.20 loads symmetric pack-quantized weights only (README)
    p = tmp_path / "head.yaml"
    p.write_text(f"algorithm: rtn\nweights: {{num_bits: 4, group_size: 32, symmetric: {str(symmetric).lower()}}}\nhead: {head}\n")
    return str(p)


def _tensor(folder, name):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name) if name in f.keys() else None


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize("tied", [False, True])
def test_head_8bit_per_channel_layout_and_loaders(tmp_path, tokenizer, tied):
    from transformers import AutoModelForCausalLM

    src = make_model_dir(tmp_path / "src", tokenizer, tie_word_embeddings=tied)
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    out = tmp_path / "out"
    run_quantize(QuantizeOptions(model=str(src), output=out, recipe=_recipe(tmp_path, "{num_bits: 8}", True), **{
        k: v for k, v in QUICK.items() if k.startswith("calib")}))
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert "lm_head" not in qc["ignore"]
    head_groups = [g for g in qc["config_groups"].values() if g["targets"] == ["lm_head"]]
    assert len(head_groups) == 1 and head_groups[0]["weights"]["num_bits"] == 8
    assert head_groups[0]["weights"]["strategy"] == "channel" and head_groups[0]["weights"]["symmetric"] is True
    assert cfg["tie_word_embeddings"] is False  # a tied source is untied: the quantized head is its own tensor
    assert _tensor(out, "lm_head.weight") is None and _tensor(out, "lm_head.weight_packed") is not None
    # the embedding stays float (bfloat16 storage), bit for bit the source's in that dtype
    torch.testing.assert_close(_tensor(out, "model.embed_tokens.weight"),
                               ref.model.embed_tokens.weight.detach().to(torch.bfloat16), rtol=0, atol=0)
    man = load_manifest(out)
    assert man.quality["head"]["num_bits"] == 8 and man.quality["head"]["untied"] is tied
    assert 0 < man.quality["head"]["relative_error"] < 0.01  # 8-bit per row: well under 1 %
    ours, _ = load_artifact(out)
    assert _rel(ours.lm_head.weight, ref.lm_head.weight) < 0.01
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)  # compressed-tensors' own path
    assert hf.lm_head.quantization_scheme.weights.num_bits == 8
    ids = torch.randint(0, 300, (1, 16))
    torch.testing.assert_close(hf(ids).logits, ours(ids).logits, atol=2e-3, rtol=2e-3)


def test_head_4bit_grouped_runtime_and_verify(tmp_path, tokenizer, capsys):
    from compressor.runtime.loader import load_decoder

    src = make_model_dir(tmp_path / "src", tokenizer, tie_word_embeddings=True)
    out = tmp_path / "out"
    recipe = _recipe(tmp_path, "{num_bits: 4, group_size: 32, symmetric: false}")
    code, _, err = run(["quantize", src, "--recipe", recipe, "-o", out, "--calib-samples", 4, "--calib-seqlen", 32], capsys)
    assert code == 0, err
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert list(groups.values())[0]["targets"] == ["Linear"]  # same scheme as the body: the class target covers it
    h = load_manifest(out).quality["head"]
    assert h["group_size"] == 32 and 0.02 < h["relative_error"] < 0.3
    dec, info = load_decoder(out, torch.device("cpu"))
    assert "lm_head" in info.kernels and info.kernels["lm_head"] != "float"
    ours, _ = load_artifact(out)
    # the runtime serves the packed head with its int4 kernel; its weights are the loader's
    torch.testing.assert_close(dec.lm_head.dequantized(torch.float32), ours.lm_head.weight, atol=1e-3, rtol=1e-3)
    code, _, err = run(["verify", out, "--weights-only"], capsys)
    assert code == 0, err
    from compressor.api import VerifyOptions, run_verify

    w = run_verify(VerifyOptions(artifact=out, weights_only=True))["weights"]
    head = [t for t in w["tensors"] if t["name"] == "lm_head.weight"]
    assert len(head) == 1 and head[0]["layer"] == 2  # after the two decoder layers
    assert head[0]["rel_fro"] == pytest.approx(h["relative_error"], rel=0.02)  # verify agrees with the quantizer


@pytest.mark.parametrize("argv,head,pattern", [
    (["--format", "awq"], "{num_bits: 8}", "keep lm_head in float"),
    (["--format", "gptq"], "{num_bits: 8}", "keep lm_head in float"),
    ([], "{num_bits: 9}", "head.num_bits"),
    ([], "{num_bits: 4, group_size: 0}", "head.group_size"),
    ([], "{bits: 8}", "head.bits: unknown key"),
])
def test_head_refused_before_any_work(tmp_path, capsys, argv, head, pattern):
    code, _, err = run(["quantize", tmp_path / "missing-model", "--recipe", _recipe(tmp_path, head), "-o",
                        tmp_path / "out", *argv], capsys)
    assert_clean_error(code, err, 2, pattern, tmp_path)


def test_head_and_ignored_lm_head_refused(tmp_path, capsys):
    p = tmp_path / "both.yaml"
    p.write_text("algorithm: rtn\nweights: {num_bits: 4, group_size: 32}\nignore: [lm_head]\nhead: {num_bits: 8}\n")
    code, _, err = run(["quantize", tmp_path / "missing-model", "--recipe", str(p), "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "both quantizes the head", tmp_path)


def test_set_null_is_a_value_not_a_skipped_flag():
    from compressor.errors import InputError
    from compressor.recipe import apply_settings, load_recipe, with_overrides

    r = with_overrides(load_recipe("w4a16-awq-gptq"), head={"num_bits": 8})
    assert apply_settings(r, {"head": None}).head is None  # --set head=null keeps the head in float
    kv = with_overrides(load_recipe("kv-fp8"), algorithm="rtn")
    assert kv.kv_cache is not None and apply_settings(kv, {"kv_cache": None}).kv_cache is None
    with pytest.raises(InputError, match="weights.num_bits"):
        apply_settings(r, {"weights.num_bits": None})
    assert with_overrides(r, head=None).head is not None  # a flag not given (None) changes nothing
    # in order: the last of a repeated key wins
    assert apply_settings(r, [("head", None), ("head.num_bits", 4), ("head", None)]).head is None


def test_kv_scheme_flag_and_set_kv_cache_null_refused(tmp_path, capsys):
    code, _, err = run(["quantize", tmp_path / "missing-model", "--kv-scheme", "int8", "--set", "kv_cache=null",
                        "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "contradict", tmp_path)


def test_head_group_size_must_divide_hidden(tmp_path, capsys, tiny_model_dir):
    code, _, err = run(["quantize", tiny_model_dir, "--recipe", _recipe(tmp_path, "{num_bits: 4, group_size: 48}"),
                        "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "does not divide the hidden size 64", tmp_path)
    assert not (tmp_path / "out").exists()


def test_head_set_fills_defaults_and_float_head_is_not_dumped():
    from compressor.recipe import load_recipe, with_overrides

    base = load_recipe("w4a16-awq-gptq")
    assert base.head is None and "head" not in base.model_dump(mode="json")  # digests of head-less recipes unchanged
    r = with_overrides(base, **{"head.num_bits": 4, "head.group_size": 64})
    assert (r.head.num_bits, r.head.group_size, r.head.symmetric) == (4, 64, True)  # symmetric: HeadScheme's default
    assert r.model_dump(mode="json")["head"] == {"num_bits": 4, "group_size": 64, "symmetric": True}
    assert with_overrides(base, head={"num_bits": 8}).head.group_size == -1



def test_head_gptq_lowers_the_output_error_rtn_leaves(tokenizer):
    """With the head inputs' Hessian the head is solved with GPTQ: on correlated inputs (as hidden
    states are) its output error ``||(Ŵ - W) Xᵀ||`` is well below RTN's, at 4 bit g32."""
    from transformers import LlamaForCausalLM

    from compressor.arch import get_arch
    from compressor.quant.head import quantize_head
    from compressor.quant.primitives import dequantize
    from compressor.recipe import HeadScheme
    from conftest import tiny_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(vocab_size=len(tokenizer), tie_word_embeddings=False))
    x = torch.randn(4096, 16) @ torch.randn(16, 64) + 0.1 * torch.randn(4096, 64)  # correlated channels
    hessian = 2 * x.T @ x / x.shape[0]
    scheme = HeadScheme(num_bits=4, group_size=32, symmetric=True)
    w = model.lm_head.weight.detach().clone()
    errs = {}
    for name, h in (("rtn", None), ("gptq", hessian)):
        rec, _ = quantize_head(model, get_arch("llama"), scheme, torch.float32, h)
        w_hat = dequantize(rec.q, rec.scale, None, 32, dtype=torch.float32)
        errs[name] = float(((w_hat - w) @ x.T).norm() / (w @ x.T).norm())
    assert torch.equal(model.lm_head.weight, w)  # the model's head is left as it was
    assert errs["gptq"] < 0.8 * errs["rtn"], errs


def test_head_with_a_calibration_pass_is_solved_with_gptq(tmp_path, tokenizer):
    src = make_model_dir(tmp_path / "src", tokenizer, tie_word_embeddings=False)
    recipe = tmp_path / "g.yaml"
    recipe.write_text("algorithm: gptq\nweights: {num_bits: 4, group_size: 32, symmetric: true}\n"
                      "head: {num_bits: 4, group_size: 32}\n")
    out = tmp_path / "out"
    run_quantize(QuantizeOptions(model=str(src), output=out, recipe=str(recipe), calib_samples=4, calib_seqlen=32))
    h = load_manifest(out).quality["head"]
    assert h["method"] == "gptq" and h["num_bits"] == 4 and h["untied"] is False
    ours, _ = load_artifact(out)
    assert torch.isfinite(ours(torch.randint(0, 300, (1, 8))).logits).all()


def test_head_gptq_takes_the_recipes_range_search(tmp_path, tokenizer, monkeypatch):
    """``gptq.clip`` applies wherever GPTQ runs: the head's solve gets the recipe's grid (and
    none without it)."""
    import compressor.quant.gptq as gq

    seen = []
    real = gq.gptq_quantize

    def spy(*a, **kw):
        if kw.get("name") == "lm_head":
            seen.append((kw.get("clip_grid"), kw.get("clip_max_shrink")))
        return real(*a, **kw)

    monkeypatch.setattr(gq, "gptq_quantize", spy)
    src = make_model_dir(tmp_path / "src", tokenizer, tie_word_embeddings=False)
    for clip, want in (("true", (50, 0.2)), ("false", (None, 0.2))):
        recipe = tmp_path / f"g-{clip}.yaml"
        recipe.write_text("algorithm: gptq\nweights: {num_bits: 4, group_size: 32, symmetric: true}\n"
                          f"gptq: {{clip: {clip}, clip_grid: 50, clip_max_shrink: 0.2}}\nhead: {{num_bits: 4, group_size: 32}}\n")
        seen.clear()
        run_quantize(QuantizeOptions(model=str(src), output=tmp_path / f"out-{clip}", recipe=str(recipe),
                                     calib_samples=4, calib_seqlen=32))
        assert seen and all(s == want for s in seen), seen
