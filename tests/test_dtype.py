"""The artifact's dtype follows the source (issue #21): bf16 in, bf16 out; float16 is refused
when a layer's calibration activations exceed 65,504 unless the user insists; verify evaluates
in the declared dtype; transformers loads each artifact with its defaults and agrees."""

from __future__ import annotations

import json

import pytest
import torch

from compressor.commands.options import QuantizeOptions, VerifyOptions
from compressor.commands.quantize import run_quantize
from compressor.commands.verify import run_verify
from compressor.artifact import load_artifact
from compressor.errors import InputError
from compressor.manifest import load_manifest
from compressor.safetensors_io import read_header

from conftest import assert_clean_error, kvq_run as run, tiny_config


def _source(path, tokenizer, dtype=torch.float32, overflow=False, seed=0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(tiny_config(vocab_size=len(tokenizer)))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
        if overflow:  # layer 1's MLP writes ~2e5 into the residual stream (weights stay below 250)
            mlp = m.model.layers[1].mlp
            mlp.gate_proj.weight.mul_(60)
            mlp.up_proj.weight.mul_(60)
            mlp.down_proj.weight.mul_(3000)
    m.to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _quantize(src, out, **kw):
    return run_quantize(QuantizeOptions(model=str(src), output=out, recipe="w4a16-gptq", group_size=32,
                                        calib_samples=4, calib_seqlen=32, **kw))


@pytest.mark.parametrize("src_dtype,want", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"),
                                            (torch.float32, "bfloat16")])
def test_storage_dtype_follows_the_source(tmp_path, tokenizer, src_dtype, want):
    src = _source(tmp_path / "src", tokenizer, src_dtype)
    s = _quantize(src, tmp_path / "out")
    q = s["quantization"]
    assert q["storage_dtype"] == want and q["storage_dtype_reason"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == want
    hdr = read_header(tmp_path / "out" / "model.safetensors")
    st = {"bfloat16": "BF16", "float16": "F16"}[want]
    assert hdr["model.layers.0.self_attn.q_proj.weight_scale"].dtype == st
    assert hdr["model.embed_tokens.weight"].dtype == st
    assert load_manifest(tmp_path / "out").quantization["storage_dtype"] == want


def test_explicit_dtype_and_older_formats(tmp_path, tokenizer):
    src = _source(tmp_path / "src", tokenizer, torch.bfloat16)
    assert _quantize(src, tmp_path / "f32", dtype="float32")["quantization"]["storage_dtype"] == "float32"
    s = _quantize(src, tmp_path / "gptq", format="gptq")
    assert s["quantization"]["storage_dtype"] == "float16"  # the GPTQ/AWQ kernels read float16 scales
    assert "float16 scales" in s["quantization"]["storage_dtype_reason"]


def test_float16_overflow_is_refused_then_accepted_on_request(tmp_path, tokenizer, capsys):
    src = _source(tmp_path / "src", tokenizer, torch.bfloat16, overflow=True)
    code, _, err = run(["quantize", src, "--recipe", "w4a16-gptq", "--group-size", "32", "--calib-samples", "4",
                        "--calib-seqlen", "32", "--dtype", "float16", "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "decoder layer 1: activations reach", tmp_path)
    assert "--allow-float16-overflow" in err and not (tmp_path / "out").exists()
    # the default (bf16, the source's) has the range
    assert _quantize(src, tmp_path / "bf16")["quantization"]["storage_dtype"] == "bfloat16"
    s = _quantize(src, tmp_path / "fp16", dtype="float16", allow_float16_overflow=True)
    assert any(w.startswith("float16 overflow accepted") for w in s["warnings"])
    m = load_manifest(tmp_path / "fp16")
    assert any("float16 overflow accepted" in w for w in m.quality["warnings"])
    assert max(f["max_abs_activation"] for f in m.quality["layers"]) > 65504
    # verify evaluates in the declared float16: the overflow shows (non-finite figures fail the gates)
    rep = run_verify(VerifyOptions(artifact=tmp_path / "fp16", seqlen=64, max_windows=1, max_new_tokens=4,
                                   hidden_batches=1))
    assert rep["evaluated_in"]["dtype"] == "float16"
    assert not rep["passed"]
    rep32 = run_verify(VerifyOptions(artifact=tmp_path / "fp16", seqlen=64, max_windows=1, max_new_tokens=4,
                                     hidden_batches=1, eval_dtype="float32"))
    assert rep32["evaluated_in"]["dtype"] == "float32"
    assert rep32["perplexity"]["artifact"] is not None and rep32["perplexity"]["artifact"] < 1e6


@pytest.mark.parametrize("recipe", ["kv-fp8", "w4a16-gptq"])
def test_activations_beyond_float16_warn_a_bfloat16_artifact(tmp_path, tokenizer, recipe):
    """A bfloat16 artifact, KV only or weights, whose calibration activations pass 65,504 says
    it is not for float16 (its manifest records the activations), once; loaded in float16 it
    does overflow, in its own bfloat16 it does not. The source within range gets no warning."""
    src = _source(tmp_path / "src", tokenizer, torch.bfloat16, overflow=True)
    s = run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "out", recipe=recipe, group_size=32,
                                     calib_samples=4, calib_seqlen=32))
    m = load_manifest(tmp_path / "out")
    assert s["quantization"]["storage_dtype"] == "bfloat16"
    assert m.quantization["algorithm"] == {"kv-fp8": "none", "w4a16-gptq": "gptq"}[recipe]
    assert max(f["max_abs_activation"] for f in m.quality["layers"]) > 65504
    warned = [w for w in s["warnings"] if w.startswith("not for float16")]
    assert len(warned) == 1 and "decoder layer 1" in warned[0] and "in bfloat16 (as config.json declares) or float32" in warned[0]
    assert warned == [w for w in m.quality["warnings"] if w.startswith("not for float16")]
    ids = torch.randint(1, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(load_artifact(tmp_path / "out", dtype=torch.bfloat16)[0](ids).logits).all()
        assert not torch.isfinite(load_artifact(tmp_path / "out", dtype=torch.float16)[0](ids).logits).all()
    calm = _source(tmp_path / "calm", tokenizer, torch.bfloat16)
    s = run_quantize(QuantizeOptions(model=str(calm), output=tmp_path / "calm-out", recipe=recipe, group_size=32,
                                     calib_samples=4, calib_seqlen=32))
    assert not [w for w in s["warnings"] if "float16" in w]


def test_transformers_loads_each_artifact_with_its_defaults(tmp_path, tokenizer):
    """AutoModelForCausalLM.from_pretrained(artifact) with no dtype argument loads the
    declared dtype, and its logits equal kvq's loader's in that dtype. (Symmetric weights:
    transformers 5.24 with compressed-tensors 0.20 cannot load asymmetric pack-quantized
    checkpoints of any producer, llm-compressor's included -- its issue #1618; vLLM can.)"""
    from transformers import AutoModelForCausalLM

    src = _source(tmp_path / "src", tokenizer, torch.bfloat16)
    _quantize(src, tmp_path / "out", symmetric=True)
    tm = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    km, _ = load_artifact(tmp_path / "out", dtype=torch.bfloat16)
    assert tm.dtype == torch.bfloat16
    ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = tm(ids).logits.float(), km(ids).logits.float()
    assert torch.allclose(a, b, atol=2e-2, rtol=2e-2), (a - b).abs().max()
    rep = run_verify(VerifyOptions(artifact=tmp_path / "out", seqlen=64, max_windows=1, max_new_tokens=4, hidden_batches=1))
    assert rep["evaluated_in"] == {"dtype": "bfloat16", "declared": "bfloat16", "why": "the dtype config.json declares",
                                   "rows": {"reference": "the reference's weights in float32 with a float KV cache",
                                            "weights only": "the artifact's weights in bfloat16 with a float KV cache"}}


def test_library_refuses_an_unknown_dtype(tmp_path):
    with pytest.raises(InputError):
        QuantizeOptions(model="x", output=tmp_path / "o", dtype="float8")


@pytest.mark.parametrize("algorithm", ["rtn", "gptq", "awq"])
def test_float16_scales_that_overflow_are_an_input_error(tmp_path, tokenizer, capsys, algorithm):
    """Weights near 1e7 give scales past float16's 65,504: refused (exit 2) naming the
    linear and the dtypes that hold them, not "produced NaN or Inf" (a fresh-user try)."""
    from safetensors.torch import load_file, save_file

    from conftest import kvq_run, make_model_dir

    src = make_model_dir(tmp_path / "big", tokenizer)
    f = src / "model.safetensors"
    state = load_file(f)
    state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"] * 1e7
    save_file(state, f, metadata={"format": "pt"})
    code, _, err = kvq_run(["quantize", src, "-o", tmp_path / "o", "--algorithm", algorithm, "--group-size", "32",
                            "--calib-samples", "4", "--calib-seqlen", "32", "--dtype", "float16"], capsys)
    assert code == 2 and "model.layers.0.mlp.down_proj" in err and "bfloat16" in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()
