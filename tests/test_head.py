"""LM-head quantization (recipe ``head:``, issue #18): layout, untying, loaders, refusals; the
untying of a tied head refused without ``head.untie`` and the quantized embedding (``embedding:``,
issue #41)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_clean_error, make_model_dir
from conftest import kvq_run as run
from safetensors import safe_open

from compressor.commands.options import QuantizeOptions
from compressor.commands.quantize import run_quantize
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
    run_quantize(QuantizeOptions(model=str(src), output=out, recipe=_recipe(tmp_path, "{num_bits: 8, untie: true}", True), **{
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
    recipe = _recipe(tmp_path, "{num_bits: 4, group_size: 32, symmetric: false, untie: true}")
    code, _, err = run(["quantize", src, "--recipe", recipe, "-o", out, "--calib-samples", 4, "--calib-seqlen", 32], capsys)
    assert code == 0, err
    # the opt-in is said with the bytes it adds: 4-bit codes, bfloat16 scales and zero points of the head
    from compressor.quant.head import megabytes, packed_bytes

    assert "head.untie: the tied head is stored on its own" in err
    assert f"(+{megabytes(packed_bytes(len(tokenizer), 64, 4, 32, False, 2))})" in err
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
    from compressor.commands.options import VerifyOptions
    from compressor.commands.verify import run_verify

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
    code, _, err = run(["quantize", tiny_model_dir, "--recipe", _recipe(tmp_path, "{num_bits: 4, group_size: 48, untie: true}"),
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
    # head.untie and embedding: left out of dumps at their defaults (earlier digests unchanged), set by --set
    assert "embedding" not in r.model_dump(mode="json") and "untie" not in r.model_dump(mode="json")["head"]
    u = with_overrides(base, **{"head.untie": True, "embedding.num_bits": 4})
    assert u.model_dump(mode="json")["head"]["untie"] is True and u.head.num_bits == 8
    assert u.model_dump(mode="json")["embedding"] == {"num_bits": 4, "group_size": -1}



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


# ---------------------------------------------------------------------------------------
# issue #41: untying refused without head.untie; the embedding quantized instead


def test_tied_head_refused_before_load_without_untie(tmp_path, tokenizer, capsys, monkeypatch):
    """A tied Hugging Face folder's config says so: the refusal comes before the model loads,
    naming the head's extra bytes and the opt-in."""
    import compressor.commands.quantize as q

    monkeypatch.setattr(q, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
    src = make_model_dir(tmp_path / "src", tokenizer, tie_word_embeddings=True, hidden_size=1024, intermediate_size=256)
    code, _, err = run(["quantize", src, "--recipe", "w4a16-rtn-g64", "--set", "head.num_bits=8", "-o", tmp_path / "out"],
                       capsys)
    vocab = len(tokenizer)  # rows of 1,024 int8 codes, a bfloat16 scale each, the int64 weight_shape
    assert_clean_error(code, err, 2, f"stores a second, 8-bit copy of the {vocab:,} x 1,024 table beside the embedding "
                                     f"(+{(vocab * 1026 + 16) / 1e6:.2f} MB); accept that with --set head.untie=true", tmp_path)
    assert not (tmp_path / "out").exists()


def test_tied_head_refused_once_loaded(tokenizer):
    """A GGUF file, or a config that leaves ``tie_word_embeddings`` to the model class, is known
    tied once loaded: :func:`check_head` refuses there, or returns the opt-in's warning."""
    from transformers import LlamaForCausalLM

    from compressor.arch import get_arch
    from compressor.errors import InputError
    from compressor.quant.head import check_head
    from compressor.recipe import load_recipe, with_overrides
    from conftest import tiny_config

    model = LlamaForCausalLM(tiny_config(vocab_size=len(tokenizer), tie_word_embeddings=True))
    recipe = with_overrides(load_recipe("w4a16-rtn-g64"), **{"head.num_bits": 8})
    with pytest.raises(InputError, match="accept that with --set head.untie=true"):
        check_head(recipe, "compressed-tensors", model, get_arch("llama"))
    warning = check_head(with_overrides(recipe, **{"head.untie": True}), "compressed-tensors", model, get_arch("llama"))
    assert warning.startswith("recipe head.untie: the tied head is stored on its own: a second, 8-bit copy")
    model.config.tie_word_embeddings = False
    assert check_head(recipe, "compressed-tensors", model, get_arch("llama")) is None


def test_packed_bytes_is_what_the_format_stores():
    from compressor.formats.compressed_tensors import module_tensors
    from compressor.quant.head import packed_bytes

    for bits, gs, sym in ((8, -1, True), (4, 32, False), (3, 32, True)):
        q = torch.zeros(100, 96, dtype=torch.int8)
        g = 1 if gs == -1 else 96 // gs
        t = module_tensors(q, torch.ones(100, g), None if sym else torch.zeros(100, g, dtype=torch.int8), bits, torch.bfloat16)
        assert packed_bytes(100, 96, bits, gs, sym, 2) == sum(v.numel() * v.element_size() for v in t.values())


@pytest.mark.parametrize("tied", [True, False])
def test_embedding_8bit_smaller_and_read_by_kvq(tmp_path, tokenizer, capsys, tied):
    """``embedding: {num_bits: 8}``: the table stored packed per row (a tied model stays tied:
    its head reads the same table), smaller by about half, and kvq's readers (load_artifact,
    the runtime, verify) give logits close to the float embedding's."""
    from compressor.runtime.generate import Runtime

    src = make_model_dir(tmp_path / "src", tokenizer, tie_word_embeddings=tied)
    base, small = tmp_path / "base", tmp_path / "small"
    opts = dict(model=str(src), algorithm="rtn", group_size=32, settings=(("weights.symmetric", True),))
    run_quantize(QuantizeOptions(output=base, **opts))
    summary = run_quantize(QuantizeOptions(output=small, **{**opts, "settings": opts["settings"] + (("embedding.num_bits", 8),)}))
    cfg = json.loads((small / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is tied
    groups = [g for g in cfg["quantization_config"]["config_groups"].values() if g["targets"] == ["model.embed_tokens"]]
    assert len(groups) == 1 and groups[0]["format"] == "pack-quantized"
    w = groups[0]["weights"]
    assert (w["num_bits"], w["strategy"], w["symmetric"], w["type"]) == (8, "channel", True, "int")
    vocab, hidden = len(tokenizer), 64
    assert _tensor(small, "model.embed_tokens.weight") is None
    assert _tensor(small, "model.embed_tokens.weight_packed").shape == (vocab, hidden // 4)
    assert _tensor(small, "model.embed_tokens.weight_scale").shape == (vocab, 1)
    assert (_tensor(small, "lm_head.weight") is None) is tied  # a tied head is the table; an untied one stays float
    saved = (small / "model.safetensors").stat().st_size - (base / "model.safetensors").stat().st_size
    assert saved == pytest.approx(-(vocab * hidden * 2 - (vocab * hidden + vocab * 2 + 16)), abs=2048)  # header bytes
    e = load_manifest(small).quality["embedding"]
    assert e["tied"] is tied and 0 < e["relative_error"] < 0.01 and e["bytes"] == vocab * hidden + vocab * 2 + 16
    assert summary["embedding"]["num_bits"] == 8
    warning = next(x for x in summary["warnings"] if x.startswith("recipe embedding:"))
    assert "kvq verify, serve-smoke and serve read it" in warning and "transformers 5.25" in warning
    assert ("also the tied LM head" in warning) is tied

    ref, _ = load_artifact(base)
    ours, _ = load_artifact(small)
    if tied:
        assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, vocab, (2, 24))
    want = ref(ids).logits
    got = ours(ids).logits
    assert 0 < _rel(got, want) < 0.02  # 8-bit rows: the logits move by about the table's own error
    rt = Runtime.from_artifact(small, backend="dequant", kv=None, dtype=torch.float32)
    torch.testing.assert_close(rt.logits(ids), got, atol=1e-4, rtol=1e-4)
    code, out, err = run(["verify", small, "--weights-only", "--json"], capsys)
    assert code == 0, err
    rows = {t["name"]: t for t in json.loads(out)["weights"]["tensors"]}  # the packed table is gated like any tensor
    assert 0 < rows["model.embed_tokens.weight"]["rel_fro"] < 0.01


def test_embedding_with_untied_head_keeps_both_packed(tmp_path, tokenizer):
    """Tied source, ``embedding:`` plus ``head.untie``: the packed table and a packed head of its own."""
    src = make_model_dir(tmp_path / "src", tokenizer, tie_word_embeddings=True)
    out = tmp_path / "out"
    summary = run_quantize(QuantizeOptions(model=str(src), output=out, algorithm="rtn", group_size=32, settings=(
        ("weights.symmetric", True), ("embedding.num_bits", 8), ("head.num_bits", 8), ("head.untie", True))))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert _tensor(out, "lm_head.weight_packed") is not None and _tensor(out, "model.embed_tokens.weight_packed") is not None
    assert summary["embedding"]["tied"] is True and summary["head"]["untied"] is True
    ours, _ = load_artifact(out)
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()
    assert torch.isfinite(ours(torch.randint(0, 300, (1, 8))).logits).all()


@pytest.mark.parametrize("tied", [True, False])
def test_quantized_embedding_is_not_loaded_by_transformers(tmp_path, tokenizer, tied):
    """The README and the quantize warning say transformers does not load a packed embedding
    (transformers 5.25 + compressed-tensors 0.20.1: the weight initialisation reads the
    Embedding's missing ``weight``). When this starts to pass, update ``READERS`` and the README."""
    from transformers import AutoModelForCausalLM

    src = make_model_dir(tmp_path / "src", tokenizer, tie_word_embeddings=tied)
    out = tmp_path / "out"
    run_quantize(QuantizeOptions(model=str(src), output=out, algorithm="rtn", group_size=32,
                                 settings=(("weights.symmetric", True), ("embedding.num_bits", 8))))
    with pytest.raises(AttributeError, match="'Embedding' object has no attribute 'weight'"):
        AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)


@pytest.mark.parametrize("argv,embedding,pattern", [
    (["--format", "awq"], "{num_bits: 8}", "recipe embedding: awq artifacts keep the embedding in float"),
    ([], "{num_bits: 9}", "embedding.num_bits"),
    ([], "{num_bits: 8, symmetric: false}", "embedding.symmetric: unknown key"),
])
def test_embedding_refused_before_any_work(tmp_path, capsys, argv, embedding, pattern):
    p = tmp_path / "e.yaml"
    p.write_text(f"algorithm: rtn\nweights: {{num_bits: 4, group_size: 32}}\nembedding: {embedding}\n")
    code, _, err = run(["quantize", tmp_path / "missing-model", "--recipe", str(p), "-o", tmp_path / "out", *argv], capsys)
    assert_clean_error(code, err, 2, pattern, tmp_path)


def test_embedding_group_size_must_divide_hidden(tmp_path, capsys, tiny_model_dir):
    code, _, err = run(["quantize", tiny_model_dir, "--recipe", "w4a16-rtn-g64", "--set", "embedding.group_size=48",
                        "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "recipe embedding.group_size 48 does not divide the hidden size 64", tmp_path)
