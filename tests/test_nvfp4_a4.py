"""NVFP4 W4A4 (issue #49): NVFP4 weights and each quantized linear's input quantized to FP4 e2m1 with e4m3 scales
per 16 values computed per call under a static per-linear ``input_global_scale`` from the calibration inputs, as
compressed-tensors' preset ``NVFP4`` describes it and vLLM's ``CompressedTensorsW4A4Fp4`` serves it.

The recipe and its refusals; the input quantization against a hand computation (ordinary groups, a saturating
group, an all-zero group, ties); the observer and the fused sets' shared scale; the artifact's config group
against the preset, its ``input_global_scale`` tensors and compressed-tensors' decompressor; both readers
(verify's transformers model and the runtime's ``nvfp4-a4-emulated`` layer) handing the weight the hand-computed
input; W4A4 against W4A16 (the same RTN weights, other logits); quantize -> verify -> serve-smoke on the tiny
Llama and DeepSeek-V3 rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compressor.artifact import load_artifact
from compressor.errors import InputError
from compressor.formats import read_quant_weight
from compressor.quant import fp4
from compressor.quant.fp4_inputs import InputObserver, fake_quantize_input, shared_input_scales
from compressor.recipe import load_recipe, parse_recipe

from conftest import (PARITY_TOL, assert_clean_error, assert_inputs_quantized_by_hand, close_figures, e4m3_by_hand,
                      kvq_run, packed_tensors, quantize_cli, quantize_recipe, verify_and_serve)
from tiny_models import make_dir

#: a tiny DeepSeek-V3 whose every linear input width is a multiple of 16
MLA_16 = dict(hidden_size=128, q_lora_rank=64, kv_lora_rank=64, v_head_dim=32, moe_intermediate_size=64,
              intermediate_size=128)
E2M1 = torch.tensor(fp4.E2M1_VALUES, dtype=torch.float64)


# ---------------------------------------------------------------------------------------
# the recipe


@pytest.mark.parametrize("name, algorithm", [("w4a4-nvfp4", "rtn"), ("w4a4-nvfp4-gptq", "gptq")])
def test_bundled_recipes(name, algorithm):
    r = load_recipe(name)
    assert r.algorithm == algorithm
    assert (r.weights.type, r.weights.num_bits, r.weights.group_size, r.weights.symmetric) == ("float", 4, 16, True)
    a = r.activations
    assert (a.type, a.num_bits, a.strategy, a.group_size, a.dynamic) == ("float", 4, "tensor_group", 16, "local")


@pytest.mark.parametrize("change, message", [
    ({"activations": {"strategy": "token", "group_size": None}}, "4-bit activations are NVFP4's"),
    ({"activations": {"dynamic": True}}, "4-bit activations are NVFP4's"),
    ({"activations": {"group_size": 32}}, "4-bit activations are NVFP4's"),
    ({"weights": {"group_size": 32}}, "MXFP4 weights with NVFP4 activations \\(W4A4\\) are not implemented: NVFP4 "
                                      "W4A4 takes NVFP4 weights"),
    ({"weights": {"type": "int", "num_bits": 4, "group_size": 128}}, "go with NVFP4 weights"),
    ({"activations": {"num_bits": 8, "strategy": "token", "group_size": None, "dynamic": True}},
     "NVFP4 with fp8 activations is not implemented"),
    ({"activations": {"num_bits": 8}}, "fp8 activations \\(num_bits 8\\) are dynamic"),
])
def test_recipe_refuses_what_is_not_implemented(change, message):
    data = load_recipe("w4a4-nvfp4").model_dump(mode="json")
    for k, v in change.items():
        data[k] = {**data[k], **v}
    with pytest.raises(InputError, match=message):
        parse_recipe(data)


@pytest.mark.parametrize("flags", [["--group-size", "32"], ["--set", "weights.group_size=32"]])
def test_mxfp4_group_size_on_w4a4_says_what_is_wrong(flags, tmp_path, capsys, wide_llama):
    """Groups of 32 would make the W4A4 recipe's weights MXFP4, which has no W4A4: the line says so, names the
    flag and the NVFP4 grid's 16 (exit 2, nothing written), not MXFP4 W4A4's refusal."""
    code, _, err = kvq_run(["quantize", wide_llama, "-o", tmp_path / "o", "--recipe", "w4a4-nvfp4", *flags], capsys)
    given = flags[0] if flags[0] == "--group-size" else "--set weights.group_size"
    assert_clean_error(code, err, 2, f"{given} 32 turns the recipe's NVFP4 W4A4 weights into MXFP4, which has no W4A4",
                       tmp_path)
    assert "in groups of 16" in " ".join(err.split()) and not (tmp_path / "o").exists()


def test_workers_are_refused(tmp_path, capsys, wide_llama):
    code, _, err = kvq_run(["quantize", wide_llama, "-o", tmp_path / "o", "--recipe", "w4a4-nvfp4", "--workers", "2"],
                           capsys)
    assert_clean_error(code, err, 2, "NVFP4 activations (W4A4) are observed on a calibration pass", tmp_path)


# ---------------------------------------------------------------------------------------
# the arithmetic by hand


def _e2m1_by_hand(v: float) -> float:
    """``v`` saturated to ±6 and rounded to the nearest e2m1 value, a tie to the value of even index."""
    a = min(abs(v), 6.0)
    d = (E2M1 - a).abs()
    best = [j for j in range(8) if d[j] == d.min()]
    pick = best[0] if len(best) == 1 else next(j for j in best if j % 2 == 0)
    return float(E2M1[pick]) * (-1.0 if v < 0 else 1.0)


def _nvfp4_input_by_hand(x: torch.Tensor, g: float) -> torch.Tensor:
    """vLLM's per-call NVFP4 input quantization written out per group of 16: ``s = e4m3(g * amax / 6)``
    (saturated at 448), codes ``e2m1(x * (1 / (s * (1 / g))))`` (0 where ``s`` is 0), values ``code * (s / g)``;
    float32 steps in the kernel's order."""
    out = torch.empty_like(x)
    g32 = torch.tensor(g, dtype=torch.float32)
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], 16):
            part = x[r, c:c + 16]
            amax = part.abs().max()
            s = e4m3_by_hand((g32 * (amax * torch.tensor(1 / 6.0, dtype=torch.float32))).clamp(max=448.0).reshape(1))
            one = torch.tensor(1.0, dtype=torch.float32)
            inv = 0.0 if float(s) == 0 else float(one / (s * (one / g32)))
            codes = [_e2m1_by_hand(float(torch.tensor(float(v), dtype=torch.float32) * inv)) for v in part]
            out[r, c:c + 16] = torch.tensor(codes, dtype=torch.float32) * (s / g32)
    return out


def _probe(k: int = 64) -> torch.Tensor:
    """Rows with an ordinary group, a group far above the calibrated absmax (its scale saturates at 448 and
    its codes at ±6), an all-zero group, exact e2m1 ties and tiny values."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, k, generator=g)
    x[1, 16:32] *= 1e4  # saturates: g * amax / 6 above 448
    x[2, 0:16] = 0.0
    x[3, 0:16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 0.0, 1.0, 3.0, -6.0, 4.0])
    x[3, 16:32] *= 1e-30
    return x


@pytest.mark.parametrize("g", [256.0, 448.0 * 6 / 2.5])
def test_input_quantization_equals_the_hand_computation(g):
    """:func:`fake_quantize_input` against the hand computation, bit for bit; the saturated group's values are
    at most ``6 * 448 / g``, the all-zero group and the tiny one (its scale rounds to 0) are 0, and with ``g = 256``
    the tie row's scale is 256 and its step 1 exactly: every listed value rounds to its e2m1 neighbour of even code."""
    x = _probe()
    ours = fake_quantize_input(x, torch.tensor([g]))
    assert torch.equal(ours, _nvfp4_input_by_hand(x, g))
    assert float(ours[1, 16:32].abs().max()) <= 6 * 448 / g * (1 + 1e-6)
    assert torch.equal(ours[2, :16], torch.zeros(16))
    assert torch.equal(ours[3, 16:32], torch.zeros(16))
    if g == 256.0:
        assert ours[3, :16].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, -4.0, 0.0, 1.0, 3.0,
                                         -6.0, 4.0]
    with pytest.raises(InputError, match="groups of 16"):
        fake_quantize_input(torch.ones(2, 24), torch.tensor([1.0]))


def test_shared_scales_and_the_observer():
    """A fused set shares the scale of its largest absmax (``448 * 6 / absmax``); a zero absmax gives 1; the
    observer keeps the largest ``|x|`` over every call of each watched linear."""
    scales = shared_input_scales({"q": 2.0, "k": 3.0, "v": 1.0, "o": 4.0, "z": 0.0}, [("q", "k", "v")])
    for n in "qkv":
        assert torch.equal(scales[n], torch.tensor([448.0 * 6 / 3.0]))
    assert torch.equal(scales["o"], torch.tensor([448.0 * 6 / 4.0])) and float(scales["z"]) == 1.0
    block = torch.nn.ModuleDict({"up": torch.nn.Linear(16, 16), "down": torch.nn.Linear(16, 16)})
    run = lambda x: block.down(torch.relu(block.up(x)))  # noqa: E731
    obs = InputObserver()
    xs = [torch.randn(3, 16), 5 * torch.randn(2, 16)]
    with torch.no_grad(), obs.watching(block, {"up": "a", "down": "b"}):
        mids = [torch.relu(block.up(x)) for x in xs]
        for x in xs:
            run(x)
    assert obs.absmax["a"] == max(float(x.abs().max()) for x in xs)
    assert obs.absmax["b"] == max(float(m.abs().max()) for m in mids)
    with torch.no_grad():
        run(torch.full((1, 16), 100.0))  # the hooks are gone
    assert obs.absmax["a"] < 100


# ---------------------------------------------------------------------------------------
# the artifact


@pytest.fixture(scope="module")
def w4a4(wide_llama, tmp_path_factory) -> Path:
    return quantize_recipe(wide_llama, tmp_path_factory.mktemp("w4a4") / "art", "w4a4-nvfp4")


@pytest.fixture(scope="module")
def w4a16(wide_llama, tmp_path_factory) -> Path:
    return quantize_recipe(wide_llama, tmp_path_factory.mktemp("w4a16") / "art", "w4a16-nvfp4")


def test_config_group_is_the_nvfp4_preset(w4a4):
    """The config group is compressed-tensors' preset ``NVFP4`` field for field (weights and inputs), its format
    ``nvfp4-pack-quantized``; the manifest records the activations; kvq's reader gives each module ``nvfp4``."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    qc = json.loads((w4a4 / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized" and list(qc["config_groups"]) == ["group_0"]
    group = qc["config_groups"]["group_0"]
    preset = PRESET_SCHEMES["NVFP4"]
    for part in ("weights", "input_activations"):
        want = preset[part].model_dump(mode="json")
        assert {k: group[part][k] for k in want if k in group[part]} == \
            {k: v for k, v in want.items() if k in group[part]}, part
    assert group["input_activations"]["dynamic"] == "local" and group["input_activations"]["group_size"] == 16
    QuantizationScheme.model_validate(group)
    manifest = json.loads((w4a4 / "kvq-manifest.json").read_text())
    assert manifest["quantization"]["activations"]["dynamic"] == "local"
    for m, t in packed_tensors(w4a4).items():
        w = read_quant_weight("compressed-tensors", qc, m, t)
        assert (w.act, w.act_group) == ("nvfp4", 16) and w.input_global_scale.dtype == torch.float32, m


def test_reader_refuses_a_missing_or_bad_input_global_scale(w4a4):
    """A W4A4 module without ``input_global_scale``, or with a non-positive one, is one InputError each; so is
    an MXFP4 group with NVFP4 ``input_activations``."""
    qc = json.loads((w4a4 / "config.json").read_text())["quantization_config"]
    m, t = next(iter(packed_tensors(w4a4).items()))
    with pytest.raises(InputError, match="need input_global_scale"):
        read_quant_weight("compressed-tensors", qc, m, {k: v for k, v in t.items() if k != "input_global_scale"})
    with pytest.raises(InputError, match="need input_global_scale"):
        read_quant_weight("compressed-tensors", qc, m, {**t, "input_global_scale": torch.tensor([-1.0])})
    bad = json.loads(json.dumps(qc))
    bad["config_groups"]["group_0"]["weights"]["group_size"] = 32
    with pytest.raises(InputError, match="are not MXFP4 weight-only"):
        mx = {k: v for k, v in t.items() if k not in ("weight_global_scale", "input_global_scale")}
        read_quant_weight("compressed-tensors", bad, m, {**mx, "weight_scale": t["weight_scale"].view(torch.uint8)})


def test_input_global_scales_are_stored_and_shared(w4a4):
    """Every packed module stores ``input_global_scale`` float32 ``[1]``, ``448 * 6 / absmax`` of a positive
    finite absmax; q/k/v and gate/up of a layer hold the same value (they read one input)."""
    modules = packed_tensors(w4a4)
    for m, t in modules.items():
        gi = t["input_global_scale"]
        assert gi.dtype == torch.float32 and tuple(gi.shape) == (1,) and 0 < float(gi) < float("inf"), m
    for i in range(2):
        p = f"model.layers.{i}."
        for fused in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            vals = {float(modules[p + r]["input_global_scale"]) for r in fused}
            assert len(vals) == 1, (i, fused, vals)


def test_decompressor_gives_kvqs_weights_and_w4a16s(w4a4, w4a16):
    """compressed-tensors' ``nvfp4-pack-quantized`` decompressor on each module (``input_global_scale`` beside
    it) gives kvq's weight; the RTN weights are the W4A16 recipe's, byte for byte."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qc = json.loads((w4a4 / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    plain = packed_tensors(w4a16)
    for m, t in packed_tensors(w4a4).items():
        theirs = compressor.decompress(dict(t), scheme)["weight"]
        ours = read_quant_weight("compressed-tensors", qc, m, t)
        assert torch.equal(theirs, ours.dequantize(theirs.dtype)), m
        for leaf in ("weight_packed", "weight_scale", "weight_global_scale"):
            assert torch.equal(t[leaf].view(torch.uint8), plain[m][leaf].view(torch.uint8)), (m, leaf)


def test_readers_quantize_inputs_by_hand_and_differ_from_w4a16(w4a4, w4a16):
    """verify's transformers model and the runtime's ``nvfp4-a4-emulated`` layer hand each weight the
    hand-computed NVFP4 input (the module's stored global scale); the runtime's logits are verify's; the same
    weights without input quantization (W4A16) give other logits in both readers."""
    from compressor.runtime.generate import Runtime

    model, _ = load_artifact(w4a4)
    assert model.kvq_input_quantization == ["nvfp4"]
    rt = Runtime.from_artifact(w4a4, kv=None, dtype=torch.float32)
    assert set(rt.info.kernels.values()) == {"nvfp4-a4-emulated", "float"}
    modules = packed_tensors(w4a4)
    assert_inputs_quantized_by_hand(
        model, rt, ("self_attn.k_proj", "mlp.down_proj"), "nvfp4", 16, "nvfp4-a4-emulated", probe=_probe,
        by_hand=lambda rel, x: _nvfp4_input_by_hand(x, float(modules[f"model.layers.1.{rel}"]["input_global_scale"])))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    plain, _ = load_artifact(w4a16)
    with torch.no_grad():
        simulated, weight_only = model(ids).logits, plain(ids).logits
        assert torch.equal(plain.model.layers[1].mlp.down_proj.weight, model.model.layers[1].mlp.down_proj.weight)
    torch.testing.assert_close(rt.logits(ids), simulated, atol=PARITY_TOL, rtol=0)
    assert not torch.allclose(simulated, weight_only, atol=1e-3)


# ---------------------------------------------------------------------------------------
# end to end


@pytest.mark.parametrize("row, recipe", [("llama", "w4a4-nvfp4"), ("deepseek_v3", "w4a4-nvfp4"),
                                         ("llama", "w4a4-nvfp4-gptq"), ("deepseek_v3", "w4a4-nvfp4-gptq")])
def test_quantize_verify_serve_smoke(row, recipe, wide_llama, tmp_path, capsys, tokenizer):
    """quantize -> verify -> serve-smoke exit 0 (with an fp8 KV cache on the MLA row); verify's rows run with
    each input quantized ``nvfp4`` and serve-smoke serves every packed linear with ``nvfp4-a4-emulated``. Every
    module, routed experts included, stores an input global scale. A random tiny model's greedy top-1 is argmax
    noise (tests/test_w4a8.py): the prompt KL gate carries the check, the top-1 gate is 25 %."""
    src = wide_llama if row == "llama" else make_dir(tmp_path / "m", tokenizer, "deepseek_v3", **MLA_16)
    out = tmp_path / "art"
    quantize_cli(src, out, capsys, "--recipe", recipe, *(["--recipe", "kv-fp8"] if row != "llama" else []))
    modules = packed_tensors(out)
    assert all("input_global_scale" in t for t in modules.values())
    if row != "llama":
        assert any(".experts." in m for m in modules) and any(".shared_experts." in m for m in modules)
    assert "nvfp4-a4-emulated" in verify_and_serve(out, capsys, 25, "nvfp4")


def test_streamed_verify_simulates_the_inputs_too(w4a4, capsys):
    """``kvq verify --stream`` (a decoder layer at a time, the packed reader's ``input_global_scale``) quantizes
    the inputs as the whole-model verify does: the same figures, the same activations note."""
    def report(*extra):
        code, out, err = kvq_run(["verify", w4a4, "--seqlen", "96", "--max-windows", "3", "--max-new-tokens", "4",
                                  "--hidden-batches", "2", "--kv-chunk", "32", "--json", *extra], capsys)
        assert code == 0, err
        return json.loads(out)

    want, got = report(), report("--stream")
    assert got["evaluated_in"]["activations"] == want["evaluated_in"]["activations"] == ["nvfp4"]
    for section in ("perplexity", "per_window", "distribution", "hidden_state_error"):
        close_figures(got[section], want[section], section)
