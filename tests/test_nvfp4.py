"""NVFP4 weight-only (W4A16, issue #49): FP4 e2m1 codes, float8 e4m3 scales per 16 inputs and a float32
global scale per tensor, in compressed-tensors' ``nvfp4-pack-quantized`` layout with the config group of
llm-compressor's ``NVFP4A16`` preset, read by vLLM's ``CompressedTensorsW4A16Fp4``.

The grid, rounding and packing against hand-computed values; the scales against compressed-tensors' own
``generate_gparam`` / ``calculate_qparams`` and its compressor's bytes; the artifact read back by kvq's
reader, compressed-tensors' decompressor and transformers' loader; quantize -> verify -> serve-smoke on a
tiny Llama and a tiny DeepSeek-V3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compressor.artifact import load_artifact
from compressor.errors import InputError
from compressor.formats import read_quant_weight
from compressor.quant import fp4

from conftest import assert_clean_error, kvq_run, packed_tensors, quantize_cli, quantize_recipe, verify_and_serve
from tiny_models import make_dir

#: a tiny DeepSeek-V3 whose linear inputs are multiples of 16
MLA16 = dict(hidden_size=128, q_lora_rank=64, kv_lora_rank=64, v_head_dim=32, moe_intermediate_size=64,
             intermediate_size=128)


# ---------------------------------------------------------------------------------------
# the grid and the packing by hand


def test_rounding_ties_to_even_and_saturation():
    """Each e2m1 magnitude, the midpoints (ties to the even code), saturation at 6 and the sign bit."""
    x = torch.tensor([0.0, 0.24, 0.25, 0.26, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0,
                      5.01, 6.0, 7.0, 1e9])
    want = [0, 0, 0, 1, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 7, 7, 7]
    assert fp4.e2m1_codes(x).tolist() == want
    assert fp4.e2m1_codes(-x[1:]).tolist() == [8 | c for c in want[1:]]  # -0.24 rounds to a negative zero
    assert fp4.e2m1_values(torch.arange(16, dtype=torch.uint8)).tolist() == \
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_pack_nibble_order():
    """Column 2j is the low nibble of byte j, 2j+1 the high one; unpack inverts it; odd widths and 5-bit codes
    are refused."""
    q = torch.tensor([[1, 2, 15, 8], [7, 0, 9, 12]], dtype=torch.uint8)
    assert fp4.pack_codes(q).tolist() == [[0x21, 0x8F], [0x07, 0xC9]]
    assert torch.equal(fp4.unpack_codes(fp4.pack_codes(q)), q)
    with pytest.raises(InputError):
        fp4.pack_codes(q[:, :3])
    with pytest.raises(InputError):
        fp4.pack_codes(q + 16)


def test_scales_by_hand():
    """One 1 x 32 row: absmax 6 gives g = 448 * 6 / 6 = 448; group 0 (absmax 3) scale e4m3(448 * 3 / 6) = 224,
    its step 224 / 448 = 0.5; group 1 (absmax 6) scale 448, step 1; an all-zero tensor: g = 1, scales 0.125,
    codes 0."""
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([3.0, -1.5, 0.6, -0.1])
    w[0, 20] = 6.0
    w[0, 16:20] = 0.0
    q, s, g = fp4.quantize_weight(w[:, :16])
    assert g.tolist() == [448.0 * 6 / 3.0]
    q, s, g = fp4.quantize_weight(w)
    assert g.tolist() == [448.0] and s.dtype == torch.float8_e4m3fn and g.dtype == torch.float32
    assert s.float().tolist() == [[224.0, 448.0]]
    # group 0: w / 0.5 = [6, -3, 1.2, -0.2] -> codes 7, 8|5, 2, 8|0
    assert q[0, :4].tolist() == [7, 13, 2, 8] and q[0, 4:16].tolist() == [0] * 12
    assert fp4.dequantize_weight(q, s, g)[0, :4].tolist() == [3.0, -1.5, 0.5, -0.0]
    z, zs, zg = fp4.quantize_weight(torch.zeros(2, 16))
    assert zg.tolist() == [1.0] and zs.float().flatten().tolist() == [0.125, 0.125] and not z.any()


def test_a_width_not_a_multiple_of_16_is_refused(tmp_path, capsys, tokenizer):
    with pytest.raises(InputError, match="multiple of 16"):
        fp4.quantize_weight(torch.ones(2, 24))
    model = make_dir(tmp_path / "m", tokenizer, "llama", hidden_size=72, intermediate_size=144,
                     num_attention_heads=2, num_key_value_heads=1)
    code, _, err = kvq_run(["quantize", model, "-o", tmp_path / "o", "--recipe", "w4a16-nvfp4"], capsys)
    assert_clean_error(code, err, 2, "group_size 16 does not divide", tmp_path)


def test_matches_compressed_tensors_scales_and_bytes():
    """Global and group scales equal compressed-tensors' ``generate_gparam`` / ``calculate_qparams`` with the
    NVFP4A16 args, and the packed bytes equal its ``NVFP4PackedCompressor.compress``."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    w = torch.randn(12, 64, generator=torch.Generator().manual_seed(0))
    w[3, 16:32] = 0
    q, s, g = fp4.quantize_weight(w)
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    gs = generate_gparam(w.min(), w.max())
    grouped = w.reshape(12, 4, 16)
    scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), scheme.weights, global_scale=gs)
    assert torch.equal(gs, g) and torch.equal(scale.float(), s.float())
    sd = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)
    assert torch.equal(sd["weight_packed"], fp4.pack_codes(q))


# ---------------------------------------------------------------------------------------
# the recipe


# (the bundled recipe and its refusals: tests/test_mxfp4.py, for both e2m1 recipes)


# ---------------------------------------------------------------------------------------
# the artifact


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, tokenizer) -> Path:
    return make_dir(tmp_path_factory.mktemp("nvfp4") / "deepseek", tokenizer, "deepseek_v3", **MLA16)


@pytest.fixture(scope="module")
def llama_art(wide_llama, tmp_path_factory) -> Path:
    """The wide Llama (hidden 128, MLP 256) quantized with ``w4a16-nvfp4``."""
    return quantize_recipe(wide_llama, tmp_path_factory.mktemp("nvfp4") / "art", "w4a16-nvfp4")


def test_config_group_is_llm_compressors_nvfp4a16(llama_art):
    """The config group is compressed-tensors' ``NVFP4A16`` preset field for field, format
    ``nvfp4-pack-quantized``; each module stores exactly the compressor's three tensors."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    qc = json.loads((llama_art / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized" and list(qc["config_groups"]) == ["group_0"]
    group = qc["config_groups"]["group_0"]
    assert group["format"] == "nvfp4-pack-quantized" and group["input_activations"] is None
    want = PRESET_SCHEMES["NVFP4A16"]["weights"].model_dump(mode="json")
    assert {k: group["weights"][k] for k in want} == want
    modules = packed_tensors(llama_art)
    assert len(modules) == 14
    for m, t in modules.items():
        assert set(t) == {"weight_packed", "weight_scale", "weight_global_scale"}, m
        assert t["weight_packed"].dtype == torch.uint8 and t["weight_scale"].dtype == torch.float8_e4m3fn
        w = read_quant_weight("compressed-tensors", qc, m, t)
        assert w.is_fp4 and (w.num_bits, w.group_size) == (4, 16), m


def test_fused_linears_share_a_global_scale(llama_art):
    """q/k/v and gate/up carry one global scale each (vLLM keeps one per fused layer), from the set's
    largest absmax: the smallest of the members' own."""
    modules = packed_tensors(llama_art)
    for i in (0, 1):
        for parts in (("q", "k", "v"), ("gate", "up")):
            kind = "self_attn" if parts[0] == "q" else "mlp"
            gs = {float(modules[f"model.layers.{i}.{kind}.{p}_proj"]["weight_global_scale"]) for p in parts}
            assert len(gs) == 1, (i, parts, gs)


def test_transformers_and_model_compressor_read_it_as_kvq_does(llama_art):
    """transformers' loader (compressed-tensors' ``ModelCompressor`` decompressing on load) gives kvq's weights
    rounded to bfloat16: compressed-tensors 0.20's NVFP4 decompressor returns bfloat16 weights whatever the
    model's dtype (a float32 model then fails its first forward), so the model is loaded in bfloat16."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    ours, _ = load_artifact(llama_art)
    hf = AutoModelForCausalLM.from_pretrained(str(llama_art), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = hf(ids).logits.float()
    params = dict(ours.named_parameters())
    quantized = {n: m for n, m in hf.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    assert len(quantized) == 14
    for name, m in quantized.items():
        assert m.weight.dtype == torch.bfloat16, name
        assert torch.equal(m.weight, params[f"{name}.weight"].to(torch.bfloat16)), name
    with torch.no_grad():
        ref = ours.to(torch.bfloat16)(ids).logits.float()
    torch.testing.assert_close(logits, ref, atol=3e-2, rtol=3e-2)  # bfloat16 models, the same weights


def test_compressed_tensors_decompressor_on_mla_and_experts(deepseek, tmp_path, capsys):
    """Every packed module of the DeepSeek-V3 row through compressed-tensors' ``nvfp4-pack-quantized``
    decompressor (bfloat16 out) equals kvq's reader's weight rounded to bfloat16; q_a/kv_a share a global
    scale, as each expert's gate/up do."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    out = tmp_path / "art"
    quantize_cli(deepseek, out, capsys, "--recipe", "w4a16-nvfp4")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    modules = packed_tensors(out)
    assert any(".experts." in m for m in modules) and any(".shared_experts." in m for m in modules)
    for m, t in modules.items():
        theirs = compressor.decompress(dict(t), scheme)["weight"]
        ours = read_quant_weight("compressed-tensors", qc, m, t)
        assert torch.equal(theirs, ours.dequantize(theirs.dtype)), m
    a = "model.layers.0.self_attn."
    assert torch.equal(modules[a + "q_a_proj"]["weight_global_scale"], modules[a + "kv_a_proj_with_mqa"]
                       ["weight_global_scale"])
    e = "model.layers.1.mlp.experts.0."
    assert torch.equal(modules[e + "gate_proj"]["weight_global_scale"], modules[e + "up_proj"]["weight_global_scale"])


@pytest.mark.parametrize("row", ["llama", "deepseek_v3"])
def test_quantize_verify_serve_smoke(row, wide_llama, deepseek, tmp_path, capsys):
    """quantize -> verify -> serve-smoke exit 0 (an fp8 KV cache on the MLA row); the runtime serves every packed
    linear with ``nvfp4-emulated``. The random tiny DeepSeek-V3's greedy top-1 is noisy (tests/test_w4a8.py):
    its top-1 gate is 50 %."""
    out = tmp_path / "art"
    kv = ["--recipe", "kv-fp8"] if row != "llama" else []
    quantize_cli(wide_llama if row == "llama" else deepseek, out, capsys, "--recipe", "w4a16-nvfp4", *kv)
    err = verify_and_serve(out, capsys, None if row == "llama" else 50)
    assert "nvfp4-emulated" in err and "aten-int4" not in err
