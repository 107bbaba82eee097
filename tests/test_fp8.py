"""FP8 W8A8 (issue #49): e4m3 weights per channel or in 128 x 128 blocks, dynamic fp8 activations
per token or per group, in compressed-tensors' ``float-quantized`` layout.

The numerics against hand-computed values (round to nearest even, saturation at 448, tiny
scales, partial edge blocks and groups), the layout against compressed-tensors' own quantizer
and decompressor (tiny Llama, and DeepSeek-V3's MLA + MoE row), the recipes' refusals, and
quantize -> verify -> serve-smoke through the CLI with the activation quantization simulated
in both readers (``kvq verify``'s transformers model and the bundled runtime)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compressor.artifact import load_artifact, read_kv_cache
from compressor.errors import InputError
from compressor.formats import read_quant_weight
from compressor.quant.fp8 import (TOKEN_SCALE_FLOOR, dequantize_weight, fake_quantize_activation,
                                  quantize_weight)
from compressor.recipe import load_recipe, parse_recipe

from conftest import (PARITY_TOL, assert_clean_error, assert_inputs_quantized_by_hand, e4m3_by_hand,
                      fp8_inputs_by_hand, fp8_probe_inputs, kvq_run, make_model_dir, packed_tensors, quantize_cli)
from tiny_models import make_dir


def _codes(q: torch.Tensor) -> list:
    return q.float().tolist()


# ---------------------------------------------------------------------------------------
# packing against hand-computed values


def test_channel_scales_and_round_to_nearest_even():
    w = torch.tensor([[896.0, 34.0, 38.0, -2.0, 18.0],   # absmax 896: scale 2; 17 -> 16, 19 -> 20 (ties to even)
                      [0.0, 0.0, 0.0, 0.0, 0.0],         # all zero: scale 1, codes 0
                      [1.0, -0.5, 0.25, 0.0, 0.125]])    # absmax 1: scale 1/448
    q, s = quantize_weight(w, -1)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (3, 1)
    assert s[:2].flatten().tolist() == [2.0, 1.0] and s[2, 0] == torch.tensor(1.0) / 448
    assert _codes(q[:2]) == [[448.0, 16.0, 20.0, -1.0, 9.0], [0.0] * 5]
    assert _codes(q[2]) == [448.0, -224.0, 112.0, 0.0, 56.0]
    assert dequantize_weight(q, s, -1)[0].tolist() == [896.0, 32.0, 40.0, -2.0, 18.0]


def test_saturation_at_448():
    """A value beyond 448 x scale is stored as ±448 (e4m3fn has no infinity), never NaN."""
    w = torch.tensor([[100.0, -100.0, 1.0, 56.0]])
    q, s = quantize_weight(w, -1, clip=torch.tensor([[0.125]]))
    assert _codes(q) == [[448.0, -448.0, 8.0, 448.0]] and s.item() == 0.125


def test_tiny_scales():
    """A row whose scale is a float32 subnormal (2^-140) still gets exact codes; one whose absmax / 448
    underflows to 0 gets scale 1 and zero codes (its weights are below any e4m3 step anyway)."""
    w = torch.tensor([[448.0, 3.0, -0.5, 0.0]]) * 2.0 ** -140
    q, s = quantize_weight(w, -1)
    assert s.item() == 2.0 ** -140 and _codes(q) == [[448.0, 3.0, -0.5, 0.0]]
    assert torch.equal(dequantize_weight(q, s, -1), w)
    q, s = quantize_weight(torch.tensor([[1e-45, 0.0]]), -1)
    assert s.item() == 1.0 and _codes(q) == [[0.0, 0.0]]


def test_edge_blocks_are_partial_as_compressed_tensors_pads():
    """[130, 200] in 128 x 128 blocks: scales [2, 2], the edge blocks' from their own (partial) values;
    the codes are compressed-tensors' own ``quantize`` of the weight with those scales, byte for byte."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize

    w = torch.randn(130, 200, generator=torch.Generator().manual_seed(0)) * 0.1
    for (r, c), v in {(0, 0): 448.0, (5, 150): 896.0, (129, 3): 1792.0, (128, 199): -3584.0}.items():
        w[r, c] = v
    q, s = quantize_weight(w, 128, 128)
    assert s.tolist() == [[1.0, 2.0], [4.0, 8.0]]
    assert q[128, 199].float().item() == -448.0 and q[129, 3].float().item() == 448.0
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128])
    theirs = ct_quantize(w, s, None, args, dtype=torch.float8_e4m3fn)
    assert theirs.shape == w.shape and torch.equal(theirs.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(dequantize_weight(q, s, 128, 128), q.float() * s.repeat_interleave(128, 0)[:130]
                       .repeat_interleave(128, 1)[:, :200])


@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_scales_and_codes_are_compressed_tensors_own(strategy):
    """On a float32 weight, kvq's scales are compressed-tensors' own ``calculate_qparams`` of the row's or
    block's min and max (``absmax / 448``) and its codes that library's ``quantize``, bit for bit: what
    llm-compressor's FP8_DYNAMIC / FP8_BLOCK store for a float32 model (it computes them in the model's dtype)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(5)) * 0.02
    block = strategy == "block"
    q, s = quantize_weight(w, 128, 128) if block else quantize_weight(w, -1)
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy,
                            block_structure=[128, 128] if block else None)
    padded = torch.nn.functional.pad(w, (0, -300 % 128, 0, -200 % 128)) if block else w
    parts = padded.reshape(2, 128, 3, 128).transpose(1, 2).reshape(2, 3, -1) if block else padded
    theirs, _ = calculate_qparams(parts.amin(dim=-1), parts.amax(dim=-1), args)
    assert torch.equal(theirs.reshape(s.shape), s)
    assert torch.equal(ct_quantize(w, s, None, args, dtype=torch.float8_e4m3fn).view(torch.uint8), q.view(torch.uint8))


def test_activations_per_token():
    x = torch.tensor([[1344.0, 51.0, -57.0, 0.0],   # absmax 1344: scale 3; 17 -> 16, -19 -> -20
                      [0.0, 0.0, 0.0, 0.0],          # scale floored: stays 0
                      [1e-9, -1e-9, 0.0, 0.0]])      # scale floored at 1/(448*512): 2.3e-4 rounds to 0
    y = fake_quantize_activation(x, "fp8-token")
    assert y.tolist() == [[1344.0, 48.0, -60.0, 0.0], [0.0] * 4, [0.0] * 4]
    assert TOKEN_SCALE_FLOOR == 1.0 / (448 * 512)
    xb = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    assert fake_quantize_activation(xb, "fp8-token").shape == (2, 3, 8)
    assert fake_quantize_activation(xb, "fp8-token").dtype == torch.bfloat16


def test_activations_per_group_with_a_partial_last_group():
    """200 columns in groups of 128: the last group is the 72 columns left (a zero-padded group)."""
    x = torch.zeros(1, 200)
    x[0, 0], x[0, 5], x[0, 128], x[0, 130], x[0, 199] = 448.0, 17.0, 896.0, 38.0, -2.0
    y = fake_quantize_activation(x, "fp8-group", 128)
    expect = torch.zeros(1, 200)
    expect[0, 0], expect[0, 5], expect[0, 128], expect[0, 130], expect[0, 199] = 448.0, 16.0, 896.0, 40.0, -2.0
    assert torch.equal(y, expect)
    with pytest.raises(InputError, match="unknown activation scheme"):
        fake_quantize_activation(x, "int8-token")


def test_readers_refuse_input_quantization_they_do_not_simulate():
    """Only dynamic fp8 per token or per group is simulated; static scales and integer inputs are refused."""
    from compressor.formats.compressed_tensors import activation_scheme

    token = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    assert activation_scheme(token) == ("fp8-token", 0) and activation_scheme(None) == ("", 0)
    assert activation_scheme({**token, "strategy": "group", "group_size": 128}) == ("fp8-group", 128)
    for bad in ({**token, "dynamic": False}, {**token, "type": "int"}, {**token, "strategy": "tensor"},
                {**token, "num_bits": 4}, {**token, "strategy": "group"}):
        with pytest.raises(InputError, match="are not simulated by kvq"):
            activation_scheme(bad)


# ---------------------------------------------------------------------------------------
# recipes


def test_bundled_recipes():
    channel, block = load_recipe("w8a8-fp8"), load_recipe("w8a8-fp8-block")
    assert (channel.weights.type, channel.weights.group_size, channel.activations.strategy) == ("float", -1, "token")
    assert (block.weights.block_structure, block.activations.strategy, block.activations.group_size) == \
        ([128, 128], "group", 128)


@pytest.mark.parametrize("change, message", [
    ({"algorithm": "gptq"}, "algorithm gptq is not implemented on the FP8 grid; FP8 weights are quantized with rtn"),
    ({"algorithm": "awq"}, "algorithm awq is not implemented on the FP8 grid"),
    ({"activations": None}, "needs an activations section"),
    ({"weights": {"group_size": 128}}, "vLLM serves no FP8 groups"),
    ({"weights": {"num_bits": 6}}, "is FP8 e4m3 \\(num_bits 8\\) or NVFP4/MXFP4 \\(num_bits 4\\), symmetric true"),
    ({"weights": {"num_bits": 4}}, "FP4 weights \\(type float, num_bits 4\\) are symmetric in groups of 16"),
    ({"activations": {"strategy": "group", "group_size": 128}}, "per-channel FP8 weights are served with per-token"),
    ({"overrides": [{"targets": ["re:.*down_proj"], "weights": {"num_bits": 4}}]}, "overrides\\[0\\]: FP4 weights"),
])
def test_recipes_refuse_what_vllm_does_not_serve(change, message):
    data = load_recipe("w8a8-fp8").model_dump(mode="json")
    for k, v in change.items():
        data[k] = {**data[k], **v} if isinstance(v, dict) and isinstance(data.get(k), dict) else v
    with pytest.raises(InputError, match=message):
        parse_recipe(data)


def test_only_rtn_quantizes_on_the_fp8_grid():
    """docs/formats.md and docs/recipes.md: FP8 weights are RTN (absmax / 448) only; every other
    algorithm that quantizes weights (GPTQ, AWQ, AWQ+GPTQ) is refused with FP8 weights, in one line
    naming the one that applies."""
    from compressor.registry import ALGORITHMS

    fp8 = load_recipe("w8a8-fp8").model_dump(mode="json")
    weighted = [n for n in ALGORITHMS.names() if ALGORITHMS.find(n).quantizes_weights]
    assert [n for n in weighted if ALGORITHMS.find(n).fp8_grid] == ["rtn"]
    for name in weighted:
        if name == "rtn":
            assert parse_recipe({**fp8, "algorithm": name}).algorithm == "rtn"
            continue
        with pytest.raises(InputError, match=f"algorithm {name} is not implemented on the FP8 grid; FP8 weights "
                                             "are quantized with rtn"):
            parse_recipe({**fp8, "algorithm": name})


def test_block_recipe_needs_group_activations_of_its_columns():
    data = load_recipe("w8a8-fp8-block").model_dump(mode="json")
    with pytest.raises(InputError, match="per-group activations of the block's columns"):
        parse_recipe({**data, "activations": {"strategy": "group", "group_size": 64}})
    with pytest.raises(InputError, match="block_structure applies to type float"):
        parse_recipe({**load_recipe("w8a16-rtn").model_dump(mode="json"), "weights": {
            "num_bits": 8, "group_size": 128, "symmetric": True, "block_structure": [128, 128]}})


# ---------------------------------------------------------------------------------------
# artifacts


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, tokenizer) -> Path:
    """A tiny DeepSeek-V3 (MLA attention, routed and shared experts, hidden 64: partial blocks)."""
    return make_dir(tmp_path_factory.mktemp("fp8") / "deepseek", tokenizer, "deepseek_v3")


def _quantize(model: Path, out: Path, capsys, *recipes: str) -> str:
    return quantize_cli(model, out, capsys, *(a for r in recipes for a in ("--recipe", r)))


@pytest.mark.parametrize("row, recipe", [("llama", "w8a8-fp8"), ("llama", "w8a8-fp8-block"),
                                         ("deepseek_v3", "w8a8-fp8"), ("deepseek_v3", "w8a8-fp8-block")])
def test_compressed_tensors_decompressor_gives_kvqs_weights(row, recipe, wide_llama, deepseek, tmp_path, capsys):
    """Every FP8 module through compressed-tensors' own ``float-quantized`` decompressor equals the
    weight kvq's reader gives, bit for bit; routed experts included (DeepSeek-V3 row)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    out = tmp_path / "art"
    _quantize(wide_llama if row == "llama" else deepseek, out, capsys, recipe)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == group["format"] == "float-quantized" and len(qc["config_groups"]) == 1
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    modules = packed_tensors(out)
    assert any(".experts." in m for m in modules) == (row == "deepseek_v3")
    for m, t in modules.items():
        assert t["weight"].dtype == torch.float8_e4m3fn and t["weight_scale"].dtype == torch.float32
        theirs = compressor.decompress(dict(t), scheme)["weight"]
        ours = read_quant_weight("compressed-tensors", qc, m, t)
        assert torch.equal(theirs.float(), ours.dequantize(torch.float32)), m
        assert ours.act == ("fp8-token" if recipe == "w8a8-fp8" else "fp8-group")


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory, tokenizer) -> Path:
    """A tiny Qwen3-MoE (GQA with q/k norms, routed experts without shared ones, hidden 64)."""
    return make_dir(tmp_path_factory.mktemp("fp8") / "qwen3_moe", tokenizer, "qwen3_moe")


@pytest.mark.parametrize("row, recipe, kv", [("llama", "w8a8-fp8", None), ("llama", "w8a8-fp8-block", "kv-fp8"),
                                             ("deepseek_v3", "w8a8-fp8-block", "kv-fp8"),
                                             pytest.param("qwen3_moe", "w8a8-fp8", "kv-fp8", marks=pytest.mark.slow)])
def test_quantize_verify_serve_smoke(row, recipe, kv, wide_llama, deepseek, qwen3_moe, tmp_path, capsys):
    """quantize -> verify -> serve-smoke exit 0, with and without an fp8 KV cache; verify's model
    quantizes every linear's input (its logits are not the weights-only ones) and the runtime's FP8
    kernel gives the same logits."""
    from compressor.runtime.generate import Runtime

    out = tmp_path / "art"
    source = {"llama": wide_llama, "deepseek_v3": deepseek, "qwen3_moe": qwen3_moe}[row]
    _quantize(source, out, capsys, recipe, *([kv] if kv else []))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["kv_cache_scheme"] or {}).get("type") == ("float" if kv else None)
    report = tmp_path / "report"
    code, _, err = kvq_run(["verify", out, "--seqlen", "128", "--max-windows", "2", "--max-new-tokens", "4",
                            "--report", report], capsys)
    assert code == 0, err
    rep = json.loads((report / "report.json").read_text())
    act = "fp8-token" if recipe == "w8a8-fp8" else "fp8-group 128"
    assert rep["evaluated_in"]["activations"] == [act] and act in rep["evaluated_in"]["rows"]["weights only"]
    code, _, err = kvq_run(["serve-smoke", out, "--max-new-tokens", "8"], capsys)
    assert code == 0, err
    assert "fp8-emulated" in err

    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    model, _ = load_artifact(out)
    assert model.kvq_input_quantization == [act]
    simulated = _logits(model, ids)
    rt = Runtime.from_artifact(out, kv=None, dtype=torch.float32)
    assert "fp8-emulated" in rt.info.kernels.values()
    torch.testing.assert_close(rt.logits(ids), simulated, atol=PARITY_TOL, rtol=0)
    for hooks in (m._forward_pre_hooks for m in model.modules()):
        hooks.clear()
    if row != "llama":  # the fused experts' own forward again: inputs not quantized
        for m in model.modules():
            m.__dict__.pop("forward", None)
    assert not torch.allclose(_logits(model, ids), simulated, atol=1e-6)


@pytest.mark.parametrize("recipe", ["w8a8-fp8", "w8a8-fp8-block"])
def test_both_readers_quantize_inputs_as_the_kernel_by_hand(recipe, wide_llama, tmp_path, capsys):
    """The input each reader multiplies by the weight is, bit for bit, the hand computation of vLLM's
    activation quantization: ``kvq verify``'s transformers model (its q_proj and down_proj) and the
    runtime's ``fp8-emulated`` kernel (same modules), for rows of ordinary values, an outlier, zeros,
    values under the per-token floor and exact rounding ties."""
    from compressor.runtime.generate import Runtime

    hand = e4m3_by_hand(torch.tensor([17.0, 19.0, 0.0029296875, 500.0, -1e9]))  # ties to even; 1.5 x 2^-9
    assert hand.tolist() == [16.0, 20.0, 0.00390625, 448.0, -448.0]
    out = tmp_path / "art"
    _quantize(wide_llama, out, capsys, recipe)
    act = "fp8-token" if recipe == "w8a8-fp8" else "fp8-group"
    model, _ = load_artifact(out)
    rt = Runtime.from_artifact(out, kv=None, dtype=torch.float32)
    assert_inputs_quantized_by_hand(model, rt, ("self_attn.q_proj", "mlp.down_proj"), act, 128, "fp8-emulated")


def test_fused_experts_quantize_each_experts_inputs_by_hand(deepseek, tmp_path, capsys):
    """A fused transformers experts module (DeepSeek-V3 row) in ``kvq verify``'s model quantizes each
    routed expert's gate/up input and down input as the kernel does: its output is the hand-written
    expert loop on the hand-quantized inputs."""
    out = tmp_path / "art"
    _quantize(deepseek, out, capsys, "w8a8-fp8")
    model, _ = load_artifact(out)
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    n, h = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[2]
    x = fp8_probe_inputs(h)
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [1, 3], [0, 2]]) % n
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(4))
    expect = torch.zeros_like(x)
    for t in range(6):
        for slot in range(2):
            e = int(index[t, slot])
            gate, up = (fp8_inputs_by_hand(x[t:t + 1], "fp8-token", 0) @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
            mid = experts.act_fn(gate) * up
            expect[t] += (fp8_inputs_by_hand(mid, "fp8-token", 0) @ experts.down_proj[e].T)[0] * weights[t, slot]
    torch.testing.assert_close(experts(x, index, weights), expect, rtol=1e-4, atol=1e-5)  # the sums' order differs


@pytest.mark.parametrize("kv", ["kv-fp8", "kv-int8", "kv-int4"])
def test_combines_with_every_kv_scheme(kv, wide_llama, tmp_path, capsys):
    out = tmp_path / "art"
    _quantize(wide_llama, out, capsys, "w8a8-fp8", kv)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "float-quantized"
    assert (qc["kv_cache_scheme"] is not None) == (kv == "kv-fp8")  # dynamic schemes live in the manifest
    spec, scales = read_kv_cache(out)
    assert spec.scheme == kv.removeprefix("kv-") and (scales is not None) == spec.static
    model, _ = load_artifact(out)
    assert model.kvq_input_quantization == ["fp8-token"]


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_integer_formats_refuse_fp8(fmt, wide_llama, tmp_path, capsys):
    code, _, err = kvq_run(["quantize", wide_llama, "-o", tmp_path / "x", "--recipe", "w8a8-fp8", "--format", fmt,
                            "--dtype", "float16"], capsys)
    assert_clean_error(code, err, 2, f"--format {fmt} stores integer weights; FP8", tmp_path)


def test_block_recipe_warns_about_widths_vllm_refuses(tmp_path, capsys, tokenizer):
    """Hidden 64: every input but down_proj's (128 wide) is a partial activation group, and q/k's outputs
    inside the fused q/k/v GEMM are not whole blocks; the quantize run says vLLM refuses those 12 of 14."""
    model = make_model_dir(tmp_path / "narrow", tokenizer)
    err = _quantize(model, tmp_path / "art", capsys, "w8a8-fp8-block")
    assert "FP8 blocks: 12 of 14 linears" in " ".join(err.split()), err
    qc = json.loads((tmp_path / "art" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["block_structure"] == [128, 128]
    # docs/formats.md: transformers loads it and compressed-tensors' forward fails on the 64-wide inputs
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "art"), dtype=torch.float32)
    with pytest.raises(RuntimeError, match="unflatten"):
        hf(torch.tensor([[1, 2, 3]]))
    model, _ = load_artifact(tmp_path / "art")  # kvq simulates the zero-padded group
    assert torch.isfinite(_logits(model, torch.tensor([[1, 2, 3]]))).all()


def test_block_misfits_follow_vllms_rules():
    """vLLM's ``validate_fp8_block_shape``: in a fused GEMM every output but the last is whole blocks; and
    ``per_token_group_quant_fp8``: every input width is whole groups. Per-channel schemes never misfit."""
    from compressor.quant.fp8 import block_misfits
    from compressor.quant.primitives import Scheme

    block, channel = Scheme(8, 128, True, "float", 128, "fp8-group"), Scheme(8, -1, True, "float", 1, "fp8-token")
    names = ["q", "k", "v", "o", "down"]
    widths = {"q": 1024, "k": 1024, "v": 1024, "o": 576, "down": 1536}
    fused = [[("q", 576), ("k", 192), ("v", 192)]]
    assert block_misfits(dict.fromkeys(names, block), widths, fused) == ["k", "o", "q"]
    assert block_misfits(dict.fromkeys(names, channel), widths, fused) == []


def test_fp8_body_with_an_integer_head_is_mixed_precision(wide_llama, tmp_path, capsys):
    """A recipe ``head:`` beside FP8 weights: an 8-bit ``pack-quantized`` head group after the
    ``float-quantized`` one, so the top-level format is ``mixed-precision``; kvq reads both."""
    out = tmp_path / "art"
    code, _, err = kvq_run(["quantize", wide_llama, "-o", out, "--recipe", "w8a8-fp8", "--set", "head.num_bits=8",
                            "--set", "head.untie=true"], capsys)
    assert code == 0, err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    assert sorted(g["format"] for g in qc["config_groups"].values()) == ["float-quantized", "pack-quantized"]
    head = next(g for g in qc["config_groups"].values() if g["targets"] == ["lm_head"])
    assert head["input_activations"] is None and head["weights"]["type"] == "int"
    model, _ = load_artifact(out)
    assert model.kvq_input_quantization == ["fp8-token"]
    assert torch.isfinite(_logits(model, torch.tensor([[1, 2, 3, 4]]))).all()


@pytest.mark.parametrize("row, recipe", [("llama", "w8a8-fp8-block"), ("deepseek_v3", "w8a8-fp8")])
def test_streamed_verify_quantizes_inputs_too(row, recipe, wide_llama, deepseek, tmp_path, capsys):
    """``kvq verify --stream`` (a layer at a time, routed experts included) quantizes each linear's input
    as the whole-model path does: the same perplexity (without it the figure would be the weights-only
    model's, which differs)."""
    out = tmp_path / "art"
    _quantize(wide_llama if row == "llama" else deepseek, out, capsys, recipe)
    act = "fp8-group 128" if recipe == "w8a8-fp8-block" else "fp8-token"
    figures = {}
    for mode in ([], ["--stream"]):
        code, text, err = kvq_run(["verify", out, "--seqlen", "128", "--max-windows", "2", "--max-new-tokens", "4",
                                   "--json", *mode], capsys)
        assert code == 0, err
        rep = json.loads(text)
        figures[bool(mode)] = (rep["perplexity"]["artifact"], rep["evaluated_in"].get("activations"))
    assert figures[True] == figures[False] and figures[True][1] == [act]


def test_streamed_moe_layers_in_expert_groups_give_the_same_artifact(tmp_path, tokenizer):
    """A published DeepSeek-V3 (streamed, layer by layer) quantized to FP8 blocks with its routed experts
    read one at a time (a memory budget of 1.5 experts) writes the tensors a run holding each layer whole
    writes; the artifact reads back through compressed-tensors' decompressor like any other."""
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize
    from compressor.manifest import load_manifest

    from conftest import digests
    from tiny_models import make_published

    src = make_published(tmp_path / "src", tokenizer, "deepseek_v3", num_hidden_layers=3)
    one_expert = 1.5 * 3 * 64 * 32 * 5 / 2**30  # float32 + codes of one expert (hidden 64, moe_intermediate 32)
    for name, budget in (("one", one_expert), ("whole", 4.0)):
        run_quantize(QuantizeOptions(model=str(src), output=tmp_path / name, recipe="w8a8-fp8-block", kv_scheme="fp8",
                                     calib_samples=4, calib_seqlen=48, memory_budget_gib=budget))
    one = digests(tmp_path / "one")
    assert one == digests(tmp_path / "whole")
    layers = {f["layer"]: f for f in load_manifest(tmp_path / "one").quality["layers"]}
    assert layers[1]["weight_groups"] == 5  # the layer's other tensors, then its 4 experts one by one
    assert any(".experts." in n and n.endswith(".weight_scale") for n in one)
    model, _ = load_artifact(tmp_path / "one")
    assert model.kvq_input_quantization == ["fp8-group 128"]


def test_reading_block_fp8_converts_every_code_as_torch_does():
    """The source reader's table lookup (compressor.source.lazy.fp8_to_float32) gives torch's own
    float8_e4m3fn -> float32 conversion for each of the 256 codes (NaN where torch gives NaN),
    in any shape; a transposed (non-contiguous) tensor too."""
    from compressor.source.lazy import fp8_to_float32

    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    want, got = q.to(torch.float32), fp8_to_float32(q)
    assert got.dtype == torch.float32 and got.shape == (16, 16)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and int(torch.isnan(want).sum()) == 2
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert torch.equal(fp8_to_float32(q.t()).nan_to_num(0.0), want.t().nan_to_num(0.0))


@pytest.mark.parametrize("shape", [(300, 257), (129, 1000), (7, 3), (1, 1), (256, 384)])
def test_block_fp8_dequantized_a_few_rows_at_a_time_as_whole(shape, monkeypatch):
    """LazyCheckpoint._dequantize converts and scales a few rows at a time (two codes a lookup where
    a slice allows, one elsewhere: odd widths, odd offsets): the float32 bits of
    ``q.to(float32) * scale_inv`` block by block, every code (NaN ones too) and ragged edge blocks included."""
    from compressor.source import lazy

    monkeypatch.setattr(lazy, "_LOOKUP_ELEMS", 600)  # many slices a block row, some of odd length
    g = torch.Generator().manual_seed(shape[0])
    q = torch.randint(0, 256, shape, generator=g).to(torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.rand(-(-shape[0] // 128), -(-shape[1] // 128), generator=g) * 0.01
    reader = lazy.LazyCheckpoint.__new__(lazy.LazyCheckpoint)
    reader.where, reader.block_fp8 = {"w": ("s", None), "w_scale_inv": ("s", None)}, (128, 128)
    monkeypatch.setattr(reader, "_read", lambda name: scale, raising=False)
    want = q.to(torch.float32)
    for r in range(scale.shape[0]):
        want[r * 128:(r + 1) * 128] *= scale[r].repeat_interleave(128)[:shape[1]]
    got = reader._dequantize("w", q)
    assert got.shape == shape and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(lazy.fp8_to_float32(q[1:]).view(torch.int32), q[1:].to(torch.float32).view(torch.int32))
