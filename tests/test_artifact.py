import json
import shutil
from pathlib import Path

import pytest
import torch

from compressor.commands.options import QuantizeOptions, VerifyOptions
from compressor.commands.quantize import run_quantize
from compressor.commands.verify import run_verify
from compressor.artifact import check_hashes, load_artifact
from compressor.errors import InputError
from compressor.manifest import load_manifest
from compressor.safetensors_io import read_header


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("art") / "w4"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, calib_samples=8, calib_seqlen=64, group_size=32))
    return out


def _fresh_copy(artifact, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(artifact, dst)
    return dst


def test_layout_and_config(artifact):
    files = sorted(p.name for p in artifact.iterdir())
    assert {"config.json", "model.safetensors", "kvq-manifest.json", "tokenizer.json"} <= set(files)
    assert not any(p.name.startswith(".") for p in artifact.parent.iterdir()), "temp folder left behind"
    cfg = json.loads((artifact / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"], w["strategy"]) == (4, 32, False, "group")
    assert "lm_head" in qc["ignore"]
    header = read_header(artifact / "model.safetensors")
    # tied embeddings stay tied: stored once, no lm_head tensor
    assert "lm_head.weight" not in header and "model.embed_tokens.weight" in header
    assert cfg["tie_word_embeddings"] is True
    e = header["model.layers.0.mlp.down_proj.weight_packed"]
    assert e.dtype == "I32" and e.shape == (64, 128 * 4 // 32)
    assert header["model.layers.0.mlp.down_proj.weight_zero_point"].shape == (64 * 4 // 32, 4)


def test_manifest_records_everything(artifact):
    m = load_manifest(artifact)
    header = read_header(artifact / "model.safetensors")
    assert set(m.tensors) == set(header)
    assert m.calibration["samples"] == 8 and m.calibration["seqlen"] == 64 and m.calibration["seed"] == 0
    assert len(m.calibration["sha256"]) == 64
    assert m.recipe["algorithm"] == "awq" and m.quantization["group_size"] == 32
    assert len(m.quality["layers"]) == 2 and "torch" in m.tool["libraries"]
    assert set(m.files) == {p.name for p in artifact.iterdir()} - {"kvq-manifest.json"}


def test_determinism(tmp_path, tiny_model_dir, artifact):
    out = tmp_path / "again"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, calib_samples=8, calib_seqlen=64, group_size=32))
    assert (out / "model.safetensors").read_bytes() == (artifact / "model.safetensors").read_bytes()
    assert load_manifest(out).content_digest() == load_manifest(artifact).content_digest()


def test_round_trip_equals_quantized_model(artifact, tiny_model_dir):
    """load_artifact (dequantize) reproduces the in-memory quantized model's logits."""
    from compressor.source.open import load_model
    from compressor.source.resolve import resolve_source
    from compressor.pipeline import quantize_model
    from compressor.recipe import load_recipe, with_overrides
    from compressor.calib import load_text, sample_windows, tokenize

    model, tok = load_model(resolve_source(str(tiny_model_dir)))
    ids = sample_windows(tokenize(tok, load_text("embedded").text), 8, 64, 0)
    quantize_model(model, with_overrides(load_recipe(None), **{"weights.group_size": 32}), ids)
    loaded, _ = load_artifact(artifact)
    x = ids[:2]
    # the artifact stores fp16 norms/embeddings; the in-memory model keeps float32
    torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=2e-2, rtol=2e-2)


def _ct_decompress(folder: Path, module: str) -> torch.Tensor:
    """Decompress one module with compressed-tensors' own PackedQuantizationCompressor."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    sd = load_file(str(folder / "model.safetensors"))
    local = {k[len(module) + 1 :]: v for k, v in sd.items() if k.startswith(module + ".")}
    return PackedQuantizationCompressor.decompress(local, scheme)["weight"]


def test_compressed_tensors_library_decompresses_our_asymmetric_artifact(artifact):
    """compressed-tensors' decompression of our checkpoint equals our dequantized weights."""
    ours = dict(load_artifact(artifact)[0].named_parameters())
    for module in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        theirs = _ct_decompress(artifact, module)
        # compressed-tensors dequantizes in the scale dtype (the storage dtype: bf16 for a
        # float32 source): equal up to that rounding
        assert theirs.dtype == torch.bfloat16
        torch.testing.assert_close(theirs.float(), ours[module + ".weight"].float(), atol=5e-4, rtol=2 ** -8)


def test_transformers_loads_symmetric_artifact(tmp_path, tiny_model_dir):
    """transformers' compressed-tensors loader reads a (symmetric) kvq artifact and runs it.

    Note: transformers 5.24 + compressed-tensors 0.20 allocate weight_zero_point unpacked
    ([out, G]) at load time while compressed-tensors' own compress() writes it packed
    ([out*b/32, G]); asymmetric checkpoints written by either tool hit that size check, so
    the asymmetric proof above goes through the library's decompressor directly.
    """
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sym"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, recipe="w4a16-rtn-g64", group_size=32, symmetric=True))
    ours, _ = load_artifact(out)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(0, 300, (1, 24))
    torch.testing.assert_close(hf(ids).logits, ours(ids).logits, atol=2e-3, rtol=2e-3)
    theirs = _ct_decompress(out, "model.layers.1.mlp.up_proj")
    torch.testing.assert_close(theirs.float(), dict(ours.named_parameters())["model.layers.1.mlp.up_proj.weight"], atol=1e-4, rtol=1e-3)


def test_hash_tamper_names_the_tensor(artifact, tmp_path):
    art = _fresh_copy(artifact, tmp_path)
    e = read_header(art / "model.safetensors")["model.layers.1.self_attn.o_proj.weight_scale"]
    with open(art / "model.safetensors", "r+b") as f:
        f.seek(e.start + 1)
        b = f.read(1)
        f.seek(e.start + 1)
        f.write(bytes([b[0] ^ 0x01]))
    (art / "extra.bin").write_bytes(b"x")
    rep = check_hashes(art)
    assert not rep["ok"]
    assert rep["modified_tensors"] == ["model.layers.1.self_attn.o_proj.weight_scale"]
    assert rep["modified_files"] == ["model.safetensors"] and rep["extra_files"] == ["extra.bin"]
    assert run_verify(VerifyOptions(artifact=art, hashes_only=False))["passed"] is False


def test_verify_passes_and_gates(artifact):
    rep = run_verify(VerifyOptions(artifact=artifact, seqlen=64, max_windows=3))
    assert rep["passed"] and rep["hashes"]["ok"]
    ppl = rep["perplexity"]
    assert ppl["artifact"] > 1 and ppl["reference"] > 1
    assert rep["eval"]["windows"] == 3 and rep["eval"]["predicted_tokens"] == 3 * 63
    # a gate of 0 % fails unless the quantized model is at least as good as the reference
    strict = run_verify(VerifyOptions(artifact=artifact, seqlen=64, max_windows=3, max_ppl_increase=0.0))
    assert strict["passed"] == (ppl["increase_pct"] <= 0.0)
    assert [g["name"] for g in strict["gates"]][:2] == ["finite_weights", "max_ppl_increase_pct"]


def test_bad_manifest_is_input_error(artifact, tmp_path):
    art = _fresh_copy(artifact, tmp_path)
    data = json.loads((art / "kvq-manifest.json").read_text())
    data["schema_version"] = "kvq.manifest/99"
    (art / "kvq-manifest.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match="unknown schema_version"):
        check_hashes(art)
    data["schema_version"] = "kvq.manifest/1"
    data["files"]["../evil"] = data["files"].pop("config.json")
    (art / "kvq-manifest.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match="unsafe file name"):
        check_hashes(art)


def test_truncated_or_corrupt_weights_are_a_failed_check(artifact, tmp_path):
    """Corruption of a listed file is a failed integrity check (exit 1), not an input error."""
    art = _fresh_copy(artifact, tmp_path)
    f = art / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1])
    rep = check_hashes(art)
    assert not rep["ok"] and rep["modified_files"] == ["model.safetensors"]
    assert "past the end" in rep["unreadable_files"][0]
    assert run_verify(VerifyOptions(artifact=art))["passed"] is False


def test_tokenizer_config_does_not_depend_on_how_it_was_loaded(tmp_path, tiny_model_dir):
    """transformers copies ``local_files_only`` (from HF_HUB_OFFLINE) into tokenizer_config.json;
    the artifact's bytes must be the same whichever way the source was loaded."""
    from transformers import AutoTokenizer

    from compressor.artifact import save_tokenizer

    texts = []
    for offline in (True, False):
        tok = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=offline)
        (tmp_path / str(offline)).mkdir()
        save_tokenizer(tok, tmp_path / str(offline))
        texts.append((tmp_path / str(offline) / "tokenizer_config.json").read_text())
    assert texts[0] == texts[1] and "local_files_only" not in texts[0]
    assert AutoTokenizer.from_pretrained(str(tmp_path / "True"))("hello world").input_ids


def test_on_committed_replaces_the_process_wide_record(tmp_path, tiny_model_dir):
    """write_artifact reports the placed folder to ``on_committed`` and never touches
    process-wide state itself (the CLI passes a callback that records it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compressor import interrupts
    from compressor.artifact import write_artifact

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    fields = {"tool": {"name": "kvq"}, "source": {}, "recipe": {}, "quantization": {"algorithm": "none"}}
    before, seen = list(interrupts.committed), []
    write_artifact(tmp_path / "a", model, tokenizer, {}, None, fields, on_committed=seen.append)
    assert seen == [tmp_path / "a"] and interrupts.committed == before
    write_artifact(tmp_path / "b", model, tokenizer, {}, None, fields)
    assert interrupts.committed == before
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "b" / "config.json").read_bytes()
