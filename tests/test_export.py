"""End to end on a tiny model: GPTQ artifacts in every format, mixed precision, refusals."""

import json

import pytest
import torch

from compressor.commands.options import QuantizeOptions, VerifyOptions
from compressor.commands.quantize import run_quantize
from compressor.commands.verify import run_verify
from compressor.artifact import load_artifact
from compressor.manifest import load_manifest
from compressor.safetensors_io import read_header

from conftest import assert_clean_error, kvq_run as run

QUICK = dict(calib_samples=8, calib_seqlen=64, group_size=32)


def _logits(folder, ids):
    model, _ = load_artifact(folder)
    return model(ids).logits


@pytest.fixture(scope="module")
def gptq_artifacts(tmp_path_factory, tiny_model_dir):
    """The same symmetric GPTQ quantization (dynamic act-order where the format can store it) in 3 formats, all stored in float16 (what the AWQ/GPTQ formats hold)."""
    root = tmp_path_factory.mktemp("export")
    out = {}
    for fmt, settings in (
        ("compressed-tensors", (("gptq.static_groups", True),)),
        ("awq", (("gptq.static_groups", True),)),
        ("gptq", (("gptq.static_groups", False),)),
    ):
        out[fmt] = root / fmt
        run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out[fmt], recipe="w4a16-gptq", symmetric=True,
                                     format=fmt, settings=settings, dtype="float16", **QUICK))
    return out


def test_formats_hold_the_same_weights(gptq_artifacts):
    ids = torch.randint(0, 300, (1, 20))
    ct = _logits(gptq_artifacts["compressed-tensors"], ids)
    # identical recipe (static groups) -> the AWQ-format artifact dequantizes to the same model
    torch.testing.assert_close(_logits(gptq_artifacts["awq"], ids), ct, atol=1e-5, rtol=1e-5)
    # dynamic act-order is a different (valid) quantization: close to, not equal to, the others
    g = _logits(gptq_artifacts["gptq"], ids)
    assert (g - ct).abs().max() > 0
    assert torch.nn.functional.cosine_similarity(g.flatten(), ct.flatten(), dim=0) > 0.9


def test_awq_layout(gptq_artifacts):
    folder = gptq_artifacts["awq"]
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "zero_point": True, "group_size": 32, "bits": 4, "version": "gemm",
                  "modules_to_not_convert": None}
    h = read_header(folder / "model.safetensors")
    m = "model.layers.0.mlp.down_proj"  # in 128, out 64
    assert (h[f"{m}.qweight"].dtype, h[f"{m}.qweight"].shape) == ("I32", (128, 8))
    assert h[f"{m}.qzeros"].shape == (4, 8) and h[f"{m}.scales"].shape == (4, 64) and h[f"{m}.scales"].dtype == "F16"
    assert f"{m}.weight" not in h and f"{m}.weight_packed" not in h


def test_gptq_layout_with_g_idx(gptq_artifacts):
    folder = gptq_artifacts["gptq"]
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == 4 and qc["group_size"] == 32
    assert qc["desc_act"] is True and qc["sym"] is True and qc["checkpoint_format"] == "gptq"
    h = read_header(folder / "model.safetensors")
    m = "model.layers.1.self_attn.q_proj"  # in 64, out 64
    assert h[f"{m}.qweight"].shape == (8, 64) and h[f"{m}.qzeros"].shape == (2, 8) and h[f"{m}.g_idx"].shape == (64,)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        g_idx = f.get_tensor(f"{m}.g_idx")
        qzeros = f.get_tensor(f"{m}.qzeros")
    assert sorted(torch.bincount(g_idx.long()).tolist()) == [32, 32]
    assert not torch.equal(g_idx.long(), torch.arange(64) // 32)  # really reordered
    assert torch.all(qzeros == 0x77777777)  # v1: symmetric zero 8 stored as 7
    man = load_manifest(folder)
    assert man.quantization["format"] == "gptq" and man.quantization["gptq_checkpoint_format"] == "gptq"
    rep = run_verify(VerifyOptions(artifact=folder, hashes_only=True))
    assert rep["passed"] and rep["hashes"]["tensors_checked"] == len(h)


def test_asymmetric_gptq_is_written_as_v2(tmp_path, tiny_model_dir):
    out = tmp_path / "asym"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, recipe="w4a16-gptq", format="gptq", **QUICK))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["checkpoint_format"] == "gptq_v2" and qc["sym"] is False and qc["desc_act"] is False
    model, _ = load_artifact(out)
    assert torch.isfinite(model(torch.randint(0, 300, (1, 8))).logits).all()


def test_mixed_precision_compressed_tensors_loads_in_transformers(tmp_path, tiny_model_dir):
    """A symmetric mixed recipe: two config groups; transformers' own loader agrees with kvq's."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "mixed"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, recipe="w4a16-mixed", symmetric=True, **QUICK))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = qc["config_groups"]
    assert groups["group_0"]["targets"] == ["Linear"] and groups["group_0"]["weights"]["num_bits"] == 4
    assert groups["group_0"]["weights"]["actorder"] == "weight"
    assert groups["group_1"]["targets"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert groups["group_1"]["weights"]["num_bits"] == 8 and groups["group_1"]["weights"]["strategy"] == "channel"
    h = read_header(out / "model.safetensors")
    assert h["model.layers.0.mlp.down_proj.weight_packed"].shape == (64, 32)  # 8 bit: 4 per int32
    assert h["model.layers.0.mlp.up_proj.weight_packed"].shape == (128, 8)
    man = load_manifest(out)
    assert [s["num_bits"] for s in man.quantization["schemes"]] == [4, 8]
    assert man.recipe["overrides"][0]["weights"]["num_bits"] == 8  # effective recipe stored
    ours, _ = load_artifact(out)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(0, 300, (1, 24))
    torch.testing.assert_close(hf(ids).logits, ours(ids).logits, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("argv,pattern", [
    (["--format", "awq", "--bits", "3"], "4-bit"),
    (["--format", "awq", "--group-size", "-1"], "group_size -1"),
    (["--format", "awq", "--recipe", "w4a16-mixed"], "mixed"),
    (["--format", "gptq", "--bits", "5"], "5"),
    (["--format", "gptq", "--dtype", "bfloat16"], "float16"),
    (["--recipe", "w4a16-gptq", "--set", "gptq.static_groups=false"], "static groups"),
    (["--set", "gptq.dampp=0.1"], "gptq.dampp: unknown recipe key"),
    (["--set", "gptq.damp=2"], "gptq.damp"),
    # a union's members' messages joined, without pydantic's member tags in the key
    (["--set", "weights.group_size=null"], "weights.group_size: Input should be a valid integer or 'auto'\n"),
    (["--set", "weights.group_size=x"], "weights.group_size: Input should be a valid integer or 'auto'\n"),
    (["--set", "gptq.block_size=true"], "gptq.block_size: Input should be a number, not a boolean\n"),
    (["--set", "gptq.damp=nan"], "gptq.damp: Input should be a finite number\n"),
    (["--set", "gates.max_ppl_increase_pct=nan"], "gates.max_ppl_increase_pct: Input should be a finite number\n"),
    (["--set", "gptq=1"], "gptq: Input should be a valid dictionary\n"),  # no pydantic class name
    (["--set", "novalue"], "KEY=VALUE"),
])
def test_refused_before_any_work(tmp_path, capsys, argv, pattern):
    # the model does not exist: a refusal that names the format/recipe proves nothing was loaded first
    code, _, err = run(["quantize", tmp_path / "missing-model", "-o", tmp_path / "out", *argv], capsys)
    assert_clean_error(code, err, 2, pattern, tmp_path)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("yaml_text,pattern", [
    ("algorithm: gptq\nweights: {num_bits: 4, group_size: 64, symmetric: false}\nunknown_knob: 1\n", "unknown_knob: unknown key"),
    ("algorithm: sparsegpt\n", "algorithm"),
    ("weights: {num_bits: 9}\n", "weights.num_bits"),
    ("gptq: {damp: -0.1}\n", "gptq.damp"),
    ("overrides:\n  - targets: ['re:(']\n    weights: {num_bits: 8}\n", "bad regex"),
    ("overrides:\n  - targets: ['re:.*down_proj']\n    weights: {bits: 8}\n", "overrides.0.weights.bits: unknown key"),
    ("kv_cache: {scheme: fp8, strategy: token}\n", "kv_cache: KV-cache scheme fp8 has strategies"),
    ("- just\n- a list\n", "must be a YAML mapping"),
])
def test_recipe_validation_errors_exit_2(tmp_path, capsys, yaml_text, pattern):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml_text)
    code, _, err = run(["quantize", tmp_path / "missing-model", "--recipe", recipe, "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, pattern, tmp_path)


def test_a_source_without_architectures_gets_the_class_name(tmp_path, tokenizer):
    """A GGUF source's config has no ``architectures`` (transformers' GGUF loader leaves it
    empty); the artifact names the class, which vLLM needs to pick its model."""
    import json

    from conftest import make_model_dir

    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize

    src = make_model_dir(tmp_path / "src", tokenizer)
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = None
    (src / "config.json").write_text(json.dumps(cfg))
    run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "out", recipe="w4a16-rtn-g64", group_size=32))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
