"""Kimi K2.5 as published (issue #15): transformers' vision-language wrapper (``kimi_k25``)
whose ``text_config`` is Kimi K2 (DeepSeek-V3). A tiny checkpoint laid out like the release
(``language_model.model.*``, ``language_model.lm_head.weight``, ``vision_tower.*``,
``mm_projector.*``, the wrapper's config.json with auto_map) goes through quantize -> verify
-> serve-smoke, streamed, with tensor digests equal to the whole-model run; the vision tower
and projector come out byte for byte as they went in."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from compressor.commands.options import QuantizeOptions, VerifyOptions
from compressor.commands.quantize import run_quantize
from compressor.commands.verify import run_verify
from compressor.arch import ARCHITECTURES, REFUSED, checkpoint_name, get_arch, memory_name, mtp_layer
from compressor.manifest import load_manifest
from compressor.source.open import load_model
from compressor.source.resolve import resolve_source
from compressor.safetensors_io import read_header

from conftest import assert_clean_error, digests, kvq_run as run
from tiny_models import K25_AUTO_MAP, ROW_FAST as FAST, make_k25, to_block_fp8_k25

CARRIED = ("vision_tower.", "mm_projector.")


def stored(folder) -> dict[str, tuple[str, bytes]]:
    """Every tensor of a folder's shards: name -> (safetensors dtype, raw bytes)."""
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        data = shard.read_bytes()
        out.update({n: (e.dtype, data[e.start:e.end]) for n, e in read_header(shard).items()})  # file offsets
    return out


@pytest.fixture(scope="module")
def k25(tmp_path_factory, tokenizer):
    return make_k25(tmp_path_factory.mktemp("k25") / "src", tokenizer)


@pytest.fixture(scope="module")
def runs(k25, tmp_path_factory):
    """GPTQ W4 + fp8 KV, streamed and whole-model."""
    root = tmp_path_factory.mktemp("k25-out")
    return {stream: (root / ("s" if stream else "w"), run_quantize(QuantizeOptions(
        model=str(k25), output=root / ("s" if stream else "w"), algorithm="gptq", kv_scheme="fp8", stream=stream, **FAST)))
        for stream in (True, False)}


def test_kimi_k25_is_a_row():
    arch = get_arch("kimi_k25")
    assert "kimi_k25" not in REFUSED and arch.wrapper.prefix == "language_model." and arch.wrapper.carried == CARRIED
    assert arch.linears == ARCHITECTURES["kimi_k2"].linears and arch.kv == "mla" and arch.runtime
    assert checkpoint_name(arch, "model.layers.1.mlp.experts.3.up_proj") == "language_model.model.layers.1.mlp.experts.3.up_proj"
    assert checkpoint_name(arch, "lm_head.weight") == "language_model.lm_head.weight"
    assert memory_name(arch, "language_model.model.norm.weight") == "model.norm.weight"
    # a text model's multi-token-prediction layer is found under the prefix, a vision block is not one
    assert mtp_layer(arch, 2, "language_model.model.layers.2.eh_proj.weight") == 2
    assert mtp_layer(arch, 2, "vision_tower.encoder.blocks.2.wo.weight") is None


def test_tiny_layout_is_what_transformers_reads_as_kimi_k25(k25):
    """transformers' own Kimi_K25ForConditionalGeneration (its checkpoint conversion for the
    release's names) loads the tiny release with nothing missing or left over, and its text
    path computes exactly the logits of the text model kvq builds (DeepSeek-V3's classes,
    no wrapper, no repository code)."""
    from transformers import Kimi_K25ForConditionalGeneration

    ref, info = Kimi_K25ForConditionalGeneration.from_pretrained(str(k25), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours, _ = load_model(resolve_source(str(k25)))
    assert type(ours).__mro__[1].__name__ == "DeepseekV3ForCausalLM" and ours.config.model_type == "kimi_k25"
    ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ref.eval()(input_ids=ids).logits, ours(ids).logits)


@pytest.mark.slow  # Kimi K2.5 quantized, verified or served end to end (make test-fast leaves it out)
def test_streamed_equals_whole_model(runs):
    (s_dir, s), (w_dir, w) = runs[True], runs[False]
    assert s["source_loading"] == "streamed: one decoder layer at a time", s["source_loading"]
    assert w["source_loading"].startswith("whole model")
    assert digests(s_dir) == digests(w_dir)
    assert s["quantization"]["modules"] == 5 + 3 + 5 + 3 * 4 + 3  # as kimi_k2: MLA + dense, MLA + 4 experts + shared


@pytest.mark.slow  # Kimi K2.5 quantized, verified or served end to end (make test-fast leaves it out)
def test_artifact_names_are_the_source_names(runs, k25):
    """Every source tensor is in the artifact under its own name (packed ones as
    ``<module>.weight_packed``), and the KV scales sit under the text model's prefix."""
    art = stored(runs[True][0])
    src = stored(k25)
    for name in src:
        packed = name.endswith(".weight") and name[: -len("weight")] + "weight_packed" in art
        assert name in art or packed, name
    extra = {n for n in art if n not in src}
    assert extra and all(n.rsplit(".", 1)[1] in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                                                  "k_scale", "v_scale") for n in extra)
    assert "language_model.model.layers.1.self_attn.k_scale" in art
    assert "language_model.model.layers.1.mlp.experts.3.down_proj.weight_packed" in art
    assert not any(n.startswith(("model.", "lm_head")) for n in art)


@pytest.mark.slow  # Kimi K2.5 quantized, verified or served end to end (make test-fast leaves it out)
def test_vision_tower_and_projector_are_carried_untouched(runs, k25):
    art, src = stored(runs[True][0]), stored(k25)
    carried = sorted(n for n in src if n.startswith(CARRIED))
    assert len(carried) == 5 + 2 * 12 + 6
    for n in carried:
        assert art[n] == src[n], n  # same dtype, same bytes
    assert {art[n][0] for n in carried} == {"BF16", "F32"}  # the text model is stored in bfloat16, these as they were
    assert art["language_model.model.embed_tokens.weight"][0] == "BF16"
    summary = runs[True][1]
    assert any("35 vision tower and projector tensors" in w and "not quantized" in w for w in summary["warnings"])
    rec = load_manifest(runs[True][0]).quality["carried"]
    assert rec["tensors"] == 35 and rec["prefixes"] == list(CARRIED) and rec["dequantized_fp8"] == []


@pytest.mark.slow  # Kimi K2.5 quantized, verified or served end to end (make test-fast leaves it out)
def test_config_keeps_the_published_wrapper(runs, k25):
    cfg = json.loads((runs[True][0] / "config.json").read_text())
    src = json.loads((k25 / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert cfg["auto_map"] == K25_AUTO_MAP and cfg["vision_config"] == src["vision_config"]
    assert cfg["text_config"]["model_type"] == "kimi_k2" and cfg["text_config"]["auto_map"] == src["text_config"]["auto_map"]
    assert {k: v for k, v in cfg["text_config"].items() if k != "dtype"} == \
        {k: v for k, v in src["text_config"].items() if k != "dtype"}
    assert cfg["dtype"] == "bfloat16" and "quantization_config" not in cfg["text_config"]
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["kv_cache_scheme"]["type"] == "float"
    ignore = set(qc["ignore"])
    assert {"language_model.lm_head", "language_model.model.layers.1.mlp.gate", "mm_projector.proj.0",
            "mm_projector.proj.2", "vision_tower.encoder.blocks.1.wqkv", "vision_tower.encoder.blocks.0.mlp.fc1"} <= ignore
    assert not any(i.startswith("model.") for i in ignore)


@pytest.mark.slow  # Kimi K2.5 quantized, verified or served end to end (make test-fast leaves it out)
def test_verify_compares_the_text_model_and_checks_the_vision_tower_by_digest(runs, tmp_path):
    art = runs[True][0]
    rep = run_verify(VerifyOptions(artifact=art, seqlen=64, max_windows=2, max_new_tokens=4, hidden_batches=1))
    assert rep["passed"], rep["failed_gates"]
    assert rep["reference_matches_source"] and rep["perplexity"]["increase_pct"] < 20
    assert rep["carried"]["checked"] == "digest only" and rep["carried"]["tensors"] == 35
    assert any("checked by digest only" in w for w in rep["warnings"])
    assert all(t["name"].startswith("language_model.model.layers.") for t in rep["weights"]["tensors"])
    # a vision tensor changed after quantization fails the digest check, named
    bad = tmp_path / "bad"
    shutil.copytree(art, bad)
    with safe_open(str(bad / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    state["vision_tower.encoder.blocks.0.wo.weight"] = state["vision_tower.encoder.blocks.0.wo.weight"] * 1.01
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    rep = run_verify(VerifyOptions(artifact=bad, hashes_only=True))
    assert not rep["passed"] and "vision_tower.encoder.blocks.0.wo.weight" in rep["hashes"]["modified_tensors"]


@pytest.mark.slow  # Kimi K2.5 quantized, verified or served end to end (make test-fast leaves it out)
def test_hashes_only_says_what_it_checked(runs, capsys):
    code, out, err = run(["verify", runs[True][0], "--hashes-only", "--json"], capsys)
    assert code == 0 and json.loads(out)["carried"]["checked"] == "digest only"
    code, _, err = run(["verify", runs[True][0], "--hashes-only"], capsys)
    assert code == 0 and "checked by digest only" in " ".join(err.split())


@pytest.mark.slow  # Kimi K2.5 quantized, verified or served end to end (make test-fast leaves it out)
def test_serve_smoke_serves_the_text_model(runs):
    from compressor.commands.options import SmokeOptions
    from compressor.commands.serve_smoke import run_serve_smoke

    rep = run_serve_smoke(SmokeOptions(artifact=runs[True][0], max_new_tokens=4))
    assert rep["passed"], rep.get("failed_gates")
    assert "not served" in rep["carried"]


@pytest.mark.slow  # Kimi K2.5 quantized, verified or served end to end (make test-fast leaves it out)
def test_runtime_logits_equal_verify_dequantized_model(k25, tmp_path):
    """The runtime's text model (packed aten and dequantize kernels, fp8 MLA cache) gives
    the logits of kvq verify's dequantized model through the same cache, in one pass and
    token by token (the contract of tests/test_runtime_rows.py, here on the wrapper's names)."""
    from compressor.artifact import load_artifact, read_kv_cache
    from compressor.runtime import Runtime

    from conftest import PARITY_IDS as IDS, PARITY_TOL, max_err, verify_logits

    art = tmp_path / "w4"
    run_quantize(QuantizeOptions(model=str(k25), output=art, algorithm="rtn", group_size=32, kv_scheme="fp8",
                                 dtype="float32", calib_samples=4, calib_seqlen=32))
    model, _ = load_artifact(art)
    spec, scales = read_kv_cache(art)
    assert spec.scheme == "fp8" and sorted(scales) == [0, 1]
    for backend in ("aten", "dequant"):
        rt = Runtime.from_artifact(art, backend=backend, act_dtype=torch.float32)
        for chunk in (None, 1):
            assert max_err(rt.logits(IDS, chunk=chunk), verify_logits(model, IDS, spec, scales, chunk)) < PARITY_TOL
    assert max_err(rt.logits(IDS), verify_logits(model, IDS, None, None)) > 10 * PARITY_TOL  # the KV scheme matters


# ---------------------------------------------------------------------------------------
# block-FP8 K2.5 sources


@pytest.mark.slow  # Kimi K2.5 quantized, verified or served end to end (make test-fast leaves it out)
def test_block_fp8_k25_source(k25, tmp_path):
    """Text projections dequantized as they stream (as for Kimi K2), streamed == whole
    model whichever level of config.json holds quantization_config; an FP8 vision weight is
    carried dequantized (exact, storage dtype), every other vision tensor byte for byte."""
    exact = to_block_fp8_k25(k25, tmp_path / "fp8")
    to_block_fp8_k25(k25, tmp_path / "fp8-text", where="text_config")
    res = {}
    for name, src, stream in (("s", "fp8", True), ("w", "fp8", False), ("t", "fp8-text", True)):
        res[name] = run_quantize(QuantizeOptions(model=str(tmp_path / src), output=tmp_path / name, algorithm="rtn",
                                                 stream=stream, **FAST))
    assert res["s"]["source_loading"].startswith("streamed") and res["w"]["source_loading"].startswith("whole")
    assert digests(tmp_path / "s") == digests(tmp_path / "w") == digests(tmp_path / "t")
    art, src = stored(tmp_path / "s"), stored(tmp_path / "fp8")
    fc0 = "vision_tower.encoder.blocks.0.mlp.fc0.weight"
    assert fc0 + "_scale_inv" not in art and art[fc0][0] == "BF16"
    assert torch.equal(load_file(str(tmp_path / "s" / "model.safetensors"))[fc0], exact[fc0].bfloat16())
    assert all(art[n] == src[n] for n in src if n.startswith(CARRIED) and not n.startswith(fc0))
    assert load_manifest(tmp_path / "s").quality["carried"]["dequantized_fp8"] == [fc0]
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors" and "quantization_config" not in cfg["text_config"]


@pytest.mark.parametrize("where", ["top", "text_config"])
@pytest.mark.slow  # Kimi K2.5 quantized, verified or served end to end (make test-fast leaves it out)
def test_int4_k25_release_gets_its_kv_cache_calibrated(where, k25, tmp_path):
    """K2.5 as Moonshot ships it: weights already packed (compressed-tensors), no kvq
    manifest, ``quantization_config`` at the top of config.json or in ``text_config``. A
    KV recipe calibrates the KV cache on the weights as they are: every source tensor (the
    vision tower's too) byte for byte, the scales under the text prefix, the wrapper kept,
    one ``quantization_config`` at the top."""
    release = tmp_path / "release"
    run_quantize(QuantizeOptions(model=str(k25), output=release, algorithm="rtn", group_size=32))
    (release / "kvq-manifest.json").unlink()
    cfg = json.loads((release / "config.json").read_text())
    if where == "text_config":
        cfg["text_config"]["quantization_config"] = cfg.pop("quantization_config")
    (release / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "kv"
    summary = run_quantize(QuantizeOptions(model=str(release), output=out, recipe="kv-fp8", calib_samples=4,
                                           calib_seqlen=48))
    assert summary["source_loading"].startswith("streamed")
    art, src = stored(out), stored(release)
    assert all(art[n] == src[n] for n in src)
    assert {n for n in art if n not in src} == {f"language_model.model.layers.{i}.self_attn.{s}" for i in (0, 1)
                                                  for s in ("k_scale", "v_scale")}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and cfg["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    assert "quantization_config" not in cfg["text_config"]
    rep = run_verify(VerifyOptions(artifact=out, reference=str(k25), seqlen=64, max_windows=2, max_new_tokens=4,
                                   hidden_batches=1))
    assert rep["passed"], rep["failed_gates"]


# ---------------------------------------------------------------------------------------
# refusals: one line, exit 2, before anything is built


@pytest.mark.parametrize("edit,msg", [
    (lambda cfg, st: st.update({"image_newline": torch.zeros(4)}),
     "tensor image_newline is neither the text model's (language_model.*) nor the vision tower and projector's"),
    (lambda cfg, st: cfg["text_config"].update(model_type="llama"),
     "text_config.model_type 'llama' is not a text model kvq builds for kimi_k25"),
    (lambda cfg, st: cfg.pop("text_config"), "model_type 'kimi_k25' needs a text_config object"),
    (lambda cfg, st: cfg["text_config"].update(vocab_size=100), "vocab_size = 100 but the embedding has"),
])
def test_bad_wrappers_are_refused_in_one_line(edit, msg, k25, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(k25, src)
    cfg, state = json.loads((src / "config.json").read_text()), load_file(str(src / "model.safetensors"))
    edit(cfg, state)
    (src / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run(["quantize", src, "-o", tmp_path / "out", "--algorithm", "rtn"], capsys)
    assert_clean_error(code, err, 2, msg, tmp_path)
    assert not (tmp_path / "out").exists()
