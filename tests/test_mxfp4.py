"""MXFP4 weight-only (W4A16, issue #49): FP4 e2m1 codes and one shared E8M0 power-of-two scale per 32 inputs
(OCP Microscaling v1.0), in compressed-tensors' ``mxfp4-pack-quantized`` layout with the config group of
llm-compressor's ``MXFP4A16`` preset, read by vLLM's ``CompressedTensorsW4A16Mxfp4``.

The shared exponent, the rounding, saturation and packing against hand-computed values; the exponents and bytes
against compressed-tensors' own ``calculate_qparams`` and ``MXFP4PackedCompressor``; the artifact read back by
kvq's reader and by compressed-tensors' decompressor on the tiny Llama, MoE and MLA rows; quantize -> verify ->
serve-smoke on them; the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compressor.errors import InputError
from compressor.formats import read_quant_weight
from compressor.quant import fp4, mxfp4
from compressor.recipe import load_recipe, parse_recipe

from conftest import assert_clean_error, changed_recipe, kvq_run, packed_tensors, verify_and_serve
from tiny_models import make_dir

#: the tiny rows the artifact tests run: a dense Llama, a MoE (Qwen3-MoE) and MLA with MoE (DeepSeek-V3);
#: every in_features of tiny_models' rows is a multiple of 32
ROWS = ("llama", "qwen3_moe", "deepseek_v3")


def _group(values: list[float], fill: float = 0.0) -> torch.Tensor:
    """One 1 x 32 row: ``values`` then ``fill``."""
    return torch.tensor([values + [fill] * (32 - len(values))], dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# the shared exponent, the grid and the packing by hand


def test_shared_exponent_by_hand():
    """``e = clamp(127 + E - 2, 0, 254)``, ``E = floor(log2 absmax)`` plus 1 when the absmax's mantissa is 1.75 or
    more (compressed-tensors' rounding to one mantissa bit; the OCP spec's floor alone would give 127 for 7.0);
    0 for a zero absmax and for any under 2^-125 (the clamp); 255 (E8M0's NaN) for a non-finite one."""
    a = torch.tensor([6.0, 4.0, 6.99, 7.0, 7.9, 8.0, 1.0, 1.7499, 1.75, 0.0, 1.5 * 2.0 ** -125, 2.0 ** -124,
                      2.0 ** -149, 2.0 ** 127, torch.finfo(torch.float32).max, float("inf"), float("nan")])
    want = [127, 127, 127, 128, 128, 128, 125, 125, 126, 0, 0, 1, 0, 252, 253, 255, 255]
    e = mxfp4.shared_exponents(a)
    assert e.dtype == torch.uint8 and e.tolist() == want


def test_scale_values_are_exact_powers_of_two():
    """``2^(e - 127)``: code 0 is 2^-127 (a float32 subnormal, not 0), 127 is 1, 254 is 2^127, 255 is NaN."""
    s = mxfp4.scale_values(torch.tensor([0, 1, 125, 127, 128, 254, 255], dtype=torch.uint8))
    assert s.dtype == torch.float32
    assert s[:6].tolist() == [2.0 ** -127, 2.0 ** -126, 0.25, 1.0, 2.0, 2.0 ** 127] and torch.isnan(s[6])


def test_codes_rounding_and_saturation_at_six_times_the_scale():
    """Groups of 32 by hand: the scale, the codes (ties to the even code, the sign kept on a -0) and the
    dequantized values; a value between 6 and 7 times the scale saturates to 6 x scale."""
    w = torch.cat([
        _group([6.0, -2.5, 0.74, -0.25, 5.0, 3.5, 0.0, -6.0]),  # absmax 6: e 127, X = 1
        _group([6.9, -6.5, 1.25, 0.3]),  # absmax 6.9 (mantissa 1.725): X = 1; 6.9 and -6.5 saturate at +-6
        _group([13.5, 7.0, -1.0, 0.5]),  # absmax 13.5 (1.6875 * 8): e 128, X = 2; 13.5 / 2 = 6.75 saturates
        _group([7.0, 0.75, -1.5, 2.9]),  # absmax 7 (mantissa 1.75): e 128, X = 2; 7 / 2 = 3.5 -> 4
        _group([1.0, 0.1, -0.3]),  # absmax 1: e 125, X = 0.25
    ])
    q, e = mxfp4.quantize_weight(w)
    assert q.dtype == torch.uint8 and e.dtype == torch.uint8 and q.shape == (5, 32) and e.shape == (5, 1)
    assert e.flatten().tolist() == [127, 127, 128, 128, 125]
    assert q[0, :8].tolist() == [7, 8 | 4, 1, 8 | 0, 6, 6, 0, 8 | 7]
    assert q[1, :4].tolist() == [7, 8 | 7, 2, 1]  # 0.3 -> 0.5
    assert q[2, :4].tolist() == [7, 6, 8 | 1, 0]  # 7 / 2 = 3.5 -> 4 (up, to the even code); 0.5 / 2 -> 0
    assert q[3, :4].tolist() == [6, 1, 8 | 2, 3]  # 3.5 -> 4, 0.375 -> 0.5, -0.75 -> -1, 1.45 -> 1.5
    assert q[4, :3].tolist() == [6, 1, 8 | 2]  # 4, 0.4 -> 0.5, -1.2 -> -1
    deq = mxfp4.dequantize_weight(q, e)
    assert deq[0, :8].tolist() == [6.0, -2.0, 0.5, -0.0, 4.0, 4.0, 0.0, -6.0]
    assert deq[1, :4].tolist() == [6.0, -6.0, 1.0, 0.5]
    assert deq[2, :4].tolist() == [12.0, 8.0, -1.0, 0.0]
    assert deq[3, :4].tolist() == [8.0, 1.0, -2.0, 3.0]
    assert deq[4, :3].tolist() == [1.0, 0.125, -0.25]
    assert not deq[:, 8:].any()


def test_all_zero_group_and_the_exponent_clamp():
    """An all-zero group (a -0.0 in it too): exponent 0, codes 0, weights 0. A group whose absmax is under 2^-125
    clamps its exponent to 0 (X = 2^-127, E8M0's smallest) and keeps its values: 2^-126 is code 4 (2 x X), 2^-128
    code 1."""
    w = torch.zeros(2, 64)
    w[0, 5] = -0.0  # an exact negative zero is code 0, as compressed-tensors writes it (not 8)
    w[1, 32:35] = torch.tensor([2.0 ** -126, -(2.0 ** -128), 2.0 ** -130])
    q, e = mxfp4.quantize_weight(w)
    assert e.tolist() == [[0, 0], [0, 0]]
    assert not q[0].any() and not q[1, :32].any()
    assert q[1, 32:35].tolist() == [4, 8 | 1, 0]  # 2^-130 / 2^-127 = 0.125 -> 0
    deq = mxfp4.dequantize_weight(q, e)
    assert deq[1, 32:35].tolist() == [2.0 ** -126, -(2.0 ** -128), 0.0] and not deq[0].any()


def test_edge_group_and_packing():
    """The last group of the last row has its own exponent and codes; the packed bytes put column 2j in the low
    nibble (the last byte holds columns 94 and 95)."""
    w = torch.full((3, 96), 0.5)
    w[2, 64:] = 0.0
    w[2, 94], w[2, 95], w[2, 64] = -48.0, 12.0, 3.0  # absmax 48 = 1.5 * 32: e 127 + 5 - 2 = 130, X = 8
    q, e = mxfp4.quantize_weight(w)
    assert e.tolist() == [[124, 124, 124]] * 2 + [[124, 124, 130]]  # absmax 0.5 = 2^-1: e 124, X = 2^-3
    assert q[0].tolist() == [6] * 96  # 0.5 / 0.125 = 4: code 6
    assert q[2, 64].item() == 1 and q[2, 94:].tolist() == [8 | 7, 3]  # 3 / 8 -> 0.5; -48 / 8 = -6; 12 / 8 = 1.5
    packed = fp4.pack_codes(q)
    assert packed.shape == (3, 48) and packed[2, -1].item() == 0x3F and packed[0, 0].item() == 0x66
    assert mxfp4.dequantize_weight(q, e)[2, 94:].tolist() == [-48.0, 12.0]


def test_widths_not_a_multiple_of_32_are_refused():
    with pytest.raises(InputError, match="multiple of 32"):
        mxfp4.quantize_weight(torch.ones(2, 48))
    with pytest.raises(InputError, match="do not match codes"):
        mxfp4.dequantize_weight(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_compressed_tensors_exponents_and_bytes(dtype):
    """The exponents equal compressed-tensors' ``calculate_qparams`` with the ``MXFP4A16`` args (in the weight's
    dtype, as llm-compressor's observer runs) and ``MXFP4PackedCompressor.compress`` writes kvq's bytes."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    w = torch.randn(12, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    w[3, 32:64] = 0  # an all-zero group
    w[4, :32] = w[4, :32] / w[4, :32].abs().max() * 7.0  # mantissa 1.75: the exponent rounds up
    w[5, 64:96] = w[5, 64:96] / w[5, 64:96].abs().max() * 6.5  # saturates at 6 x scale
    w[6, 96:] *= 2.0 ** -128  # the exponent's clamp
    w = w.to(dtype)
    q, e = mxfp4.quantize_weight(w)
    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    grouped = w.reshape(12, 4, 32)
    scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), scheme.weights)
    assert torch.equal(scale.float(), mxfp4.scale_values(e)), (scale, e)
    sd = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert set(sd) == {"weight_packed", "weight_scale"}
    assert torch.equal(sd["weight_packed"], fp4.pack_codes(q)) and torch.equal(sd["weight_scale"], e)


# ---------------------------------------------------------------------------------------
# the recipe


#: the bundled e2m1 recipes, by grid, and their group sizes
FP4_RECIPES = {"NVFP4": ("w4a16-nvfp4", 16), "MXFP4": ("w4a16-mxfp4", 32)}


@pytest.mark.parametrize("grid", sorted(FP4_RECIPES))
def test_bundled_recipes(grid):
    name, group = FP4_RECIPES[grid]
    r = load_recipe(name)
    assert (r.algorithm, r.weights.type, r.weights.num_bits, r.weights.group_size, r.weights.symmetric,
            r.activations) == ("rtn", "float", 4, group, True, None)


@pytest.mark.parametrize("grid", sorted(FP4_RECIPES))
@pytest.mark.parametrize("change, message", [
    ({"weights": {"group_size": 64}}, "symmetric in groups of 16 \\(NVFP4\\) or 32 \\(MXFP4\\)"),
    ({"weights": {"symmetric": False}}, "symmetric in groups of 16 \\(NVFP4\\) or 32 \\(MXFP4\\)"),
    ({"algorithm": "awq-gptq", "gptq": {"clip": True}}, "gptq.clip on the {grid} grid is not implemented"),
    ({"algorithm": "gptq", "gptq": {"clip": True}}, "gptq.clip on the {grid} grid is not implemented"),
    ({"algorithm": "gptq", "refine": {"iters": 10}}, "the refine section on the {grid} grid is not implemented"),
    ({"activations": {"type": "float", "num_bits": 8, "strategy": "token"}},
     "{grid} (weights )?with fp8 activations (is|are) not implemented"),
    ({"overrides": [{"targets": ["re:.*down_proj"], "weights": {"num_bits": 8}}]},
     "overrides\\[0\\]: FP8 weights are per channel"),
])
def test_recipes_refuse_what_is_not_implemented(grid, change, message):
    with pytest.raises(InputError, match=message.format(grid=grid)):
        parse_recipe(changed_recipe(FP4_RECIPES[grid][0], change))


def test_a_width_not_a_multiple_of_32_is_refused_by_the_cli(tmp_path, capsys, tokenizer):
    """hidden 80 is a multiple of 16 (NVFP4 takes it) but not of 32: one line, exit 2, before any work."""
    model = make_dir(tmp_path / "m", tokenizer, "llama", hidden_size=80, intermediate_size=160,
                     num_attention_heads=2, num_key_value_heads=1)
    code, _, err = kvq_run(["quantize", model, "-o", tmp_path / "o", "--recipe", "w4a16-mxfp4"], capsys)
    assert_clean_error(code, err, 2, "group_size 32 does not divide", tmp_path)
    assert "multiple of the group (NVFP4: 16, MXFP4: 32)" in err and "--group-size" not in err  # no refused hint
    assert not (tmp_path / "o").exists()


def test_a_rule_across_keys_is_worded_without_a_key_path(tmp_path, capsys, tiny_model_dir):
    """A recipe rule spanning several keys (GPTQ's range search on the FP4 grid) names no internal ``<root>`` key."""
    code, _, err = kvq_run(["quantize", tiny_model_dir, "-o", tmp_path / "o", "--recipe", "w4a16-mxfp4",
                            "--algorithm", "gptq", "--set", "gptq.clip=true"], capsys)
    assert_clean_error(code, err, 2, "w4a16-mxfp4 with --set gptq.clip, --algorithm: gptq.clip on the MXFP4 grid "
                                     "is not implemented", tmp_path)
    assert "<root>" not in err


@pytest.mark.parametrize("recipe, flag, other", [
    ("w4a16-mxfp4", ["--group-size", "16"], "MXFP4 weights into NVFP4, another format: name --recipe w4a16-nvfp4"),
    ("w4a16-nvfp4", ["--set", "weights.group_size=32"], "NVFP4 weights into MXFP4, another format: name --recipe "
                                                         "w4a16-mxfp4"),
])
def test_a_group_size_that_changes_the_fp4_format_is_refused(recipe, flag, other, tmp_path, capsys, tiny_model_dir):
    """group_size picks the FP4 format (16 NVFP4, 32 MXFP4): a flag that swaps one for the other is refused in one
    line naming the recipe to use, never written silently as the other format."""
    code, _, err = kvq_run(["quantize", tiny_model_dir, "-o", tmp_path / "o", "--recipe", recipe, *flag], capsys)
    assert_clean_error(code, err, 2, other, tmp_path)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("recipe", ["w4a16-mxfp4", "w4a16-nvfp4"])
@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_integer_formats_refuse_fp4(fmt, recipe, tmp_path, capsys, tiny_model_dir):
    """The AWQ and GPTQ layouts store integers: MXFP4 and NVFP4 recipes are refused in one line (exit 2)."""
    code, _, err = kvq_run(["quantize", tiny_model_dir, "-o", tmp_path / "o", "--recipe", recipe, "--format",
                            fmt, "--dtype", "float16"], capsys)
    assert_clean_error(code, err, 2, f"--format {fmt} stores integer weights; FP8, NVFP4 and MXFP4", tmp_path)


# ---------------------------------------------------------------------------------------
# the artifact


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """Each of :data:`ROWS` quantized by ``kvq quantize --recipe w4a16-mxfp4`` (in process; exit 0) on 4
    calibration windows of 32 tokens, the MLA row with an fp8 KV cache too."""
    from compressor.cli import main

    root = tmp_path_factory.mktemp("mxfp4")
    out = {}
    for row in ROWS:
        model = make_dir(root / row, tokenizer, row)
        out[row] = root / f"{row}-art"
        kv = ["--recipe", "kv-fp8"] if row == "deepseek_v3" else []
        with pytest.raises(SystemExit) as done:
            main(["quantize", str(model), "-o", str(out[row]), "--calib-samples", "4", "--calib-seqlen", "32",
                  "--recipe", "w4a16-mxfp4", *kv])
        assert done.value.code == 0, row
    return out


def test_config_group_is_llm_compressors_mxfp4a16(artifacts):
    """The config group is compressed-tensors' ``MXFP4A16`` preset field for field, format
    ``mxfp4-pack-quantized``; each module stores exactly the compressor's two tensors, read back as MXFP4."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    qc = json.loads((artifacts["llama"] / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized" and list(qc["config_groups"]) == ["group_0"]
    group = qc["config_groups"]["group_0"]
    assert group["format"] == "mxfp4-pack-quantized" and group["input_activations"] is None
    want = PRESET_SCHEMES["MXFP4A16"]["weights"].model_dump(mode="json")
    assert {k: group["weights"][k] for k in want} == want
    modules = packed_tensors(artifacts["llama"])
    assert len(modules) == 14
    for m, t in modules.items():
        assert set(t) == {"weight_packed", "weight_scale"}, m
        assert t["weight_packed"].dtype == torch.uint8 and t["weight_scale"].dtype == torch.uint8, m
        assert t["weight_scale"].shape[1] * 32 == t["weight_packed"].shape[1] * 2, m
        w = read_quant_weight("compressed-tensors", qc, m, t)
        assert w.is_mxfp4 and not w.is_fp4 and (w.num_bits, w.group_size) == (4, 32), m


@pytest.mark.parametrize("row", ROWS)
def test_compressed_tensors_decompressor_gives_kvqs_weights(row, artifacts):
    """Every packed module (attention, MLP, routed and shared experts, MLA's low-rank projections) through
    compressed-tensors' own ``mxfp4-pack-quantized`` decompressor (bfloat16 out) equals kvq's reader's weight in
    bfloat16, bit for bit (e2m1 values times a power of two are exact in bfloat16)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qc = json.loads((artifacts[row] / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    modules = packed_tensors(artifacts[row])
    if row != "llama":
        assert any(".experts." in m for m in modules)
    if row == "deepseek_v3":
        assert any("kv_a_proj_with_mqa" in m for m in modules) and any(".shared_experts." in m for m in modules)
    for m, t in modules.items():
        theirs = compressor.decompress(dict(t), scheme)["weight"]
        ours = read_quant_weight("compressed-tensors", qc, m, t).dequantize(torch.float32)
        assert theirs.dtype == torch.bfloat16 and torch.equal(theirs.float(), ours), m


@pytest.mark.parametrize("row", ROWS)
def test_quantize_verify_serve_smoke(row, artifacts, capsys):
    """quantize (the fixture) -> verify -> serve-smoke exit 0 on each row; the runtime serves every packed linear with
    ``mxfp4-emulated``. The random tiny MoE rows' greedy top-1 is noisy (tests/test_w4a8.py): their gate is 50 %."""
    err = verify_and_serve(artifacts[row], capsys, None if row == "llama" else 50)
    assert "mxfp4-emulated" in err and "aten-int4" not in err and "nvfp4-emulated" not in err


def test_manifest_names_the_e8m0_scales(artifacts):
    """The manifest's quantization block names the format, the grid and the E8M0 scales."""
    quant = json.loads((artifacts["llama"] / "kvq-manifest.json").read_text())["quantization"]
    assert (quant["format"], quant["type"], quant["strategy"], quant["group_size"], quant["scale_dtype"]) == \
        ("compressed-tensors", "float", "group", 32, "uint8 (E8M0 exponent)")


def _tampered(artifacts) -> tuple[dict, str, dict]:
    qc = json.loads((artifacts["llama"] / "config.json").read_text())["quantization_config"]
    m, t = next(iter(packed_tensors(artifacts["llama"]).items()))
    return qc, m, t


def test_reader_refuses_inconsistent_tensors(artifacts):
    """A float weight_scale, a scale of the wrong width, and a config group that is not MXFP4 weight-only are one
    InputError each."""
    qc, m, t = _tampered(artifacts)
    with pytest.raises(InputError, match="does not match MXFP4 weight"):
        read_quant_weight("compressed-tensors", qc, m, {**t, "weight_scale": t["weight_scale"].float()})
    with pytest.raises(InputError, match="does not match MXFP4 weight"):
        read_quant_weight("compressed-tensors", qc, m, {**t, "weight_scale": t["weight_scale"][:, :1]})
    bad = json.loads(json.dumps(qc))
    bad["config_groups"]["group_0"]["weights"]["group_size"] = 16
    with pytest.raises(InputError, match="are not MXFP4 weight-only"):
        read_quant_weight("compressed-tensors", bad, m, t)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_stops_the_run(bad):
    """A non-finite weight gets E8M0's NaN exponent (255) and dequantizes to NaN: the quantizer raises
    QuantizationError naming the module, and nothing is written into the Linear."""
    from compressor.errors import QuantizationError
    from compressor.quant.layer import LinearQuantizer
    from compressor.quant.primitives import Scheme

    lin = torch.nn.Linear(64, 2, bias=False)
    with torch.no_grad():
        lin.weight[1, 40] = bad
    before = lin.weight.detach().clone()
    assert mxfp4.quantize_weight(lin.weight.detach())[1][1, 1].item() == 255
    quantizer = LinearQuantizer({"m.down_proj": Scheme(4, 32, True, "float")}, torch.bfloat16)
    with pytest.raises(QuantizationError, match="quantizing m.down_proj produced NaN or Inf"):
        quantizer.quantize_linear("m.down_proj", lin)
    assert torch.equal(lin.weight.detach().nan_to_num(), before.nan_to_num())  # NaN != NaN: compare them as 0
