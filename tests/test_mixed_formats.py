"""Mixed weight formats per module (issue #49): a recipe override carries a whole scheme (int, FP8, NVFP4,
MXFP4 weights and its own activations), each module's pair is checked with the recipe-wide rules, GPTQ rounds
the FP8 modules with RTN, and the artifact holds one compressed-tensors config group per scheme, each with its own
``format``, under a top-level ``mixed-precision`` (compressor/recipe_mixed.py, compressor/formats/ct_groups.py).

The override's semantics and their dumps, the refusals (one line, exit 2), the bundled ``w4a8-experts-fp8-attn``
on a tiny DeepSeek-V3 (MLA + MoE: routed experts W4A8, the rest FP8 W8A8) and a three-format recipe on a tiny
Llama (attention FP8 W8A8, MLP W4A8, o_proj NVFP4 W4A16): config groups and tensors per scheme, every module
through compressed-tensors' own decompressor, quantize -> verify -> serve-smoke, and verify's figures moving
with one group's ``input_activations``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from compressor.errors import InputError
from compressor.formats import read_quant_weight
from compressor.formats.compressed_tensors import module_group
from compressor.recipe import FULL_DUMP, apply_settings, load_recipe, parse_recipe

from conftest import assert_clean_error, kvq_run, packed_tensors, quantize_cli
from tiny_models import make_dir

#: the tiny DeepSeek-V3 of tests/test_w4a8.py: every linear input a multiple of 128 (int4 groups of 128)
WIDE_MLA = dict(hidden_size=128, q_lora_rank=128, kv_lora_rank=128, v_head_dim=32, moe_intermediate_size=128,
                intermediate_size=128)
FP8 = {"type": "float", "num_bits": 8, "group_size": -1, "symmetric": True}
INT4 = {"type": "int", "num_bits": 4, "group_size": 128, "symmetric": True}
NVFP4 = {"type": "float", "num_bits": 4, "group_size": 16, "symmetric": True}
TOKEN = {"type": "float", "num_bits": 8, "strategy": "token"}
#: attention FP8 W8A8 per channel (the recipe's own scheme), the MLP W4A8, o_proj NVFP4 weight-only
THREE_FORMATS = {
    "algorithm": "gptq", "weights": FP8, "activations": TOKEN,
    "gptq": {"act_order": True, "static_groups": True},
    "overrides": [{"targets": ["re:.*mlp\\..*"], "weights": INT4},
                  {"targets": ["re:.*o_proj"], "weights": NVFP4, "activations": None}],
}
EXPERT = "model.layers.1.mlp.experts.3.down_proj"


# ---------------------------------------------------------------------------------------
# the recipe


def test_bundled_recipe_gives_experts_w4a8_and_the_rest_fp8():
    r = load_recipe("w4a8-experts-fp8-attn")
    for name in (EXPERT, "model.layers.1.mlp.experts.0.gate_proj"):
        w, a = r.pair_for(name)
        assert (w.type, w.num_bits, w.group_size, w.symmetric, a.strategy) == ("int", 4, 128, True, "token"), name
    for name in ("model.layers.0.self_attn.q_a_proj", "model.layers.1.mlp.shared_experts.gate_proj",
                 "model.layers.0.mlp.down_proj"):
        w, a = r.pair_for(name)
        assert (w.type, w.num_bits, w.group_size, w.block_structure, a.strategy) == ("float", 8, -1, None, "token")


def test_whole_and_partial_overrides_and_activations():
    """``type`` makes an override whole (fields not given: the scheme defaults); without it the fields given change
    what the module has; ``activations`` left out keeps the module's, ``null`` makes them 16-bit; overrides stack
    in order."""
    r = parse_recipe({**THREE_FORMATS, "overrides": THREE_FORMATS["overrides"] + [
        {"targets": ["re:.*down_proj"], "weights": {"num_bits": 8}},
        {"targets": ["re:.*gate_proj"], "weights": {"type": "int", "symmetric": True}, "activations": TOKEN}]})
    w, a = r.pair_for("model.layers.0.mlp.down_proj")
    assert (w.type, w.num_bits, w.group_size, w.symmetric, a.strategy) == ("int", 8, 128, True, "token")
    w, _ = r.pair_for("model.layers.0.mlp.gate_proj")  # whole again: WeightScheme's num_bits 4, group 128
    assert (w.type, w.num_bits, w.group_size, w.symmetric) == ("int", 4, 128, True)
    w, a = r.pair_for("model.layers.0.self_attn.o_proj")
    assert (w.type, w.num_bits, w.group_size, a) == ("float", 4, 16, None)
    assert r.pair_for("model.layers.0.self_attn.q_proj")[0] == r.weights


def test_dumps_keep_left_out_activations_left_out():
    """An override's unset ``activations`` and its new weight fields at null stay out of the recipe's dump (an
    integer override serializes as before: earlier recipes' digests hold); a dump read back (``--set``) keeps
    ``null`` and left-out apart."""
    r = parse_recipe(THREE_FORMATS)
    dumped = r.model_dump(mode="json")["overrides"]
    assert "activations" not in dumped[0] and dumped[1]["activations"] is None
    assert "activations" not in r.model_dump(context=FULL_DUMP)["overrides"][0]
    old = load_recipe("w4a16-mixed").model_dump(mode="json")["overrides"][0]
    assert old == {"targets": ["re:.*mlp\\.down_proj"], "weights": {"num_bits": 8, "group_size": -1, "symmetric": True}}
    again = apply_settings(r, {"gptq.damp": 0.02})
    assert again.pair_for("model.layers.0.mlp.up_proj")[1].strategy == "token"
    assert again.pair_for("model.layers.0.self_attn.o_proj")[1] is None


@pytest.mark.parametrize("change, message", [
    ({"algorithm": "awq"}, "weights: algorithm awq is not implemented on FP8 modules"),
    ({"algorithm": "awq-gptq"}, "weights: algorithm awq-gptq is not implemented on FP8 modules .* under rtn or gptq$"),
    ({"overrides": [{"targets": ["re:.*mlp\\..*"], "weights": FP8, "activations": None}]},
     "overrides\\[0\\]: weights type float \\(FP8\\) needs an activations section"),
    ({"overrides": [{"targets": ["re:.*mlp\\..*"], "weights": {**INT4, "symmetric": False}}]},
     "overrides\\[0\\]: integer weights with fp8 activations are symmetric"),
    ({"overrides": [{"targets": ["re:.*mlp\\..*"], "weights": {**NVFP4, "group_size": 32}}]},
     "overrides\\[0\\]: MXFP4 weights with fp8 activations are not implemented: MXFP4 is weight-only.*; the "
     "override inherits the recipe's activations: give it `activations: null`"),
    ({"overrides": [{"targets": ["re:.*mlp\\..*"], "weights": NVFP4}]},
     "overrides\\[0\\]: NVFP4 .*fp8 activations.*; the override inherits the recipe's activations"),
    ({"overrides": [{"targets": ["re:.*mlp\\..*"], "weights": {**FP8, "group_size": 128}}]},
     "overrides\\[0\\]: FP8 weights are per channel"),
    ({"overrides": [{"targets": ["re:.*mlp\\..*"], "weights": INT4, "activations": {**TOKEN, "strategy": "group",
                                                                                     "group_size": 128}}]},
     "overrides\\[0\\]: integer weights are served with per-token fp8 activations"),
    ({"overrides": [{"targets": ["re:.*mlp\\..*"], "weights": {"num_bits": 8}}]},
     "algorithm gptq quantizes none of the recipe's schemes"),
    ({"refine": {"iters": 2}}, "weights: the refine section with FP8 modules"),
    ({"overrides": [{"targets": ["re:.*mlp\\..*"], "weights": NVFP4, "activations": {
        "type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16, "dynamic": "local"}}]},
     "NVFP4 activations \\(W4A4\\) in a recipe with overrides are not implemented"),
])
def test_each_pair_is_checked_as_a_recipe_wide_scheme(change, message):
    with pytest.raises(InputError, match=message):
        parse_recipe({**THREE_FORMATS, **change})


def _write(tmp_path: Path, recipe: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_stacked_overrides_are_checked_per_module(wide_llama, tmp_path, capsys):
    """Two overrides each valid alone (MLP W4A8; down_proj asymmetric weight-only) stack into asymmetric W4A8 on
    down_proj: refused in one line naming the overrides and the modules, before any work."""
    recipe = {"algorithm": "rtn", "weights": {**INT4, "type": "int"},
              "overrides": [{"targets": ["re:.*mlp\\..*"], "activations": TOKEN},
                            {"targets": ["re:.*down_proj"], "weights": {"symmetric": False}}]}
    code, _, err = kvq_run(["quantize", wide_llama, "-o", tmp_path / "o", "--recipe", _write(tmp_path, recipe)],
                           capsys)
    assert_clean_error(code, err, 2, "", tmp_path)
    line = " ".join(err.split())
    assert "recipe overrides[0] then overrides[1] give model.layers.0.mlp.down_proj" in line
    assert "integer weights with fp8 activations are symmetric" in line


#: asymmetric int4 weight-only, the recipe's own scheme (w4a16's)
ASYM = {**INT4, "symmetric": False}
SYMMETRIC = {"targets": ["re:.*mlp\\..*"], "weights": {"symmetric": True}}
FP8_INPUTS = {"targets": ["re:.*mlp\\..*"], "activations": TOKEN}


@pytest.mark.parametrize("stack", [[SYMMETRIC, FP8_INPUTS], [FP8_INPUTS, SYMMETRIC]])
def test_a_stack_valid_once_merged_is_accepted(stack):
    """One override making the MLP's weights symmetric and another giving them fp8 inputs (either order): each
    alone is asymmetric W4A8 (refused), their merge W4A8 (vLLM's kernel): the recipe is read, the modules get
    symmetric W4A8, the others stay weight-only."""
    from compressor.recipe_mixed import by_pair

    r = parse_recipe({"algorithm": "rtn", "weights": ASYM, "overrides": stack})
    w, a = r.pair_for("model.layers.0.mlp.up_proj")
    assert (w.type, w.num_bits, w.group_size, w.symmetric, a.strategy) == ("int", 4, 128, True, "token")
    assert r.pair_for("model.layers.0.self_attn.q_proj") == (r.weights, None)
    names = {f"model.layers.0.{m}": 128 for m in ("self_attn.q_proj", "mlp.up_proj", "mlp.down_proj")}
    assert len(by_pair(r, names)) == 2


def test_a_merged_scheme_still_refused_names_the_overrides():
    """An override no stack rescues is refused as the recipe is read (a whole scheme after the other keeping the
    recipe's fp8 inputs: asymmetric W4A8 whatever came before); a rescued one is refused per module where it applies alone (attention: only the
    fp8 inputs), naming it and the modules."""
    from compressor.recipe_mixed import by_pair

    whole = {"targets": ["re:.*mlp\\..*"], "weights": ASYM}
    with pytest.raises(InputError, match="overrides\\[1\\]: integer weights with fp8 activations are symmetric"):
        parse_recipe({"algorithm": "rtn", "weights": INT4, "activations": TOKEN, "overrides": [SYMMETRIC, whole]})
    r = parse_recipe({"algorithm": "rtn", "weights": ASYM,
                      "overrides": [SYMMETRIC, {**FP8_INPUTS, "targets": ["re:.*_proj"]}]})
    names = {f"model.layers.0.{m}": 128 for m in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj")}
    with pytest.raises(InputError, match="^recipe overrides\\[1\\] gives model.layers.0.self_attn.k_proj, "
                                         "model.layers.0.self_attn.q_proj a scheme that is refused: integer weights "
                                         "with fp8 activations are symmetric"):
        by_pair(r, names)


def test_integer_formats_refuse_an_fp8_override(wide_llama, tmp_path, capsys):
    recipe = {**THREE_FORMATS, "weights": INT4, "activations": None,
              "overrides": [{"targets": ["re:.*self_attn\\..*"], "weights": FP8, "activations": TOKEN}]}
    code, _, err = kvq_run(["quantize", wide_llama, "-o", tmp_path / "o", "--recipe", _write(tmp_path, recipe),
                            "--format", "gptq", "--dtype", "float16"], capsys)
    assert_clean_error(code, err, 2, "--format gptq stores integer weights", tmp_path)


def test_class_target_goes_where_vllm_reads_it():
    """vLLM matches names, then class names, then a fused layer's components: ``Linear`` targets the group with
    the most non-expert modules unless a fused linear (q/k/v, gate/up, q_a/kv_a) sits in another group."""
    from compressor.formats.ct_groups import order_groups

    layer = "model.layers.0."
    attn = [layer + f"self_attn.{p}_proj" for p in "qkvo"]
    mlp = [layer + f"mlp.{p}_proj" for p in ("gate", "up", "down")]
    experts = [f"model.layers.1.mlp.experts.{e}.{p}_proj" for e in range(8) for p in ("gate", "up", "down")]
    assert order_groups({"int4": attn + mlp[:2], "int8": mlp[2:]})[1] == 0  # w4a16-mixed: down_proj alone
    ordered, linear = order_groups({"w4a8": experts, "fp8": attn + mlp})
    assert (ordered[0][0], linear) == ("fp8", 0)  # the bundled MoE recipe: experts by name
    assert order_groups({"fp8": attn, "w4a8": mlp})[1] is None  # gate/up would take the class group's scheme


# ---------------------------------------------------------------------------------------
# the artifacts


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, tokenizer) -> Path:
    return make_dir(tmp_path_factory.mktemp("mixed") / "deepseek", tokenizer, "deepseek_v3", **WIDE_MLA)


def _decompress_each_module(folder: Path) -> dict[str, object]:
    """Every quantized module of ``folder`` through compressed-tensors' compressor of its group's ``format`` equals
    kvq's reader's weight (FP8 and NVFP4 bit for bit in the decompressor's dtype, pack-quantized to the scales'
    rounding as tests/test_w4a8.py); returns module -> kvq's ``QuantWeight``."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    out = {}
    for m, t in packed_tensors(folder).items():
        group = module_group(qc, m)
        theirs = BaseCompressor.get_value_from_registry(group["format"]).decompress(
            dict(t), QuantizationScheme.model_validate(group))["weight"]
        ours = out[m] = read_quant_weight("compressed-tensors", qc, m, t)
        if group["format"] == "pack-quantized":
            torch.testing.assert_close(theirs.float(), ours.dequantize(torch.float32), rtol=2 ** -8, atol=0)
        else:
            assert torch.equal(theirs.float(), ours.dequantize(theirs.dtype).float()), m
    return out


def _serve(out: Path, capsys, *gate: str) -> str:
    code, _, err = kvq_run(["verify", out, "--seqlen", "128", "--max-windows", "2", "--max-new-tokens", "4"], capsys)
    assert code == 0, err
    code, _, err = kvq_run(["serve-smoke", out, "--max-new-tokens", "8", *gate], capsys)
    assert code == 0, err
    return err


def test_bundled_recipe_on_deepseek(deepseek, tmp_path, capsys):
    """``w4a8-experts-fp8-attn`` on the MLA + MoE row with an fp8 KV cache: a ``float-quantized`` group targeting
    ``Linear`` (MLA, shared experts, the dense layer) and a ``pack-quantized`` W4A8 group naming the routed experts
    (one ``re:`` target per linear kind), ``mixed-precision`` on top; each module's tensors and reader are its
    scheme's, compressed-tensors' decompressors agree; the manifest lists both schemes; verify and serve-smoke (fp8-emulated and
    int-fp8-emulated kernels; the noisy MoE row's top-1 gate at 50 %, tests/test_w4a8.py) exit 0."""
    out = tmp_path / "art"
    quantize_cli(deepseek, out, capsys, "--recipe", "w4a8-experts-fp8-attn", "--recipe", "kv-fp8")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and list(qc["config_groups"]) == ["group_0", "group_1"]
    fp8, w4a8 = qc["config_groups"]["group_0"], qc["config_groups"]["group_1"]
    assert (fp8["targets"], fp8["format"], fp8["input_activations"]["strategy"]) == (["Linear"], "float-quantized",
                                                                                      "token")
    assert w4a8["format"] == "pack-quantized" and w4a8["input_activations"]["strategy"] == "token"
    assert w4a8["weights"]["actorder"] == "weight" and fp8["weights"]["actorder"] is None
    weights = _decompress_each_module(out)
    routed = sorted(m for m in weights if ".mlp.experts." in m)
    assert w4a8["targets"] == [rf"re:model\.layers\.\d+\.mlp\.experts\.\d+\.{p}_proj$" for p in ("down", "gate", "up")]
    assert routed == sorted(m for m in weights if any(re.match(t[3:], m) for t in w4a8["targets"]))
    assert routed and any(".shared_experts." in m for m in weights)
    for m, w in weights.items():
        want = (4, 128, "fp8-token", False) if m in routed else (8, w.in_features, "fp8-token", True)
        assert (w.num_bits, w.group_size, w.act, w.is_float) == want, m
    manifest = json.loads((out / "kvq-manifest.json").read_text())
    kinds = {(s.get("type", "int"), s.get("activations")) for s in manifest["quantization"]["schemes"]}
    assert kinds == {("int", "fp8-token"), ("float", "fp8-token")}
    err = _serve(out, capsys, "--min-top1", "50")
    assert "int-fp8-emulated" in err and "fp8-emulated" in err.replace("int-fp8-emulated", "")


@pytest.fixture(scope="module")
def three(wide_llama, tmp_path_factory) -> Path:
    """The wide Llama quantized with :data:`THREE_FORMATS` (GPTQ; calibrated on 4 x 32 tokens)."""
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize

    folder = tmp_path_factory.mktemp("three")
    recipe = _write(folder, THREE_FORMATS)
    out = folder / "art"
    run_quantize(QuantizeOptions(model=str(wide_llama), output=out, recipe=str(recipe), calib_samples=4,
                                 calib_seqlen=32))
    return out


def test_three_formats_on_llama(three, capsys):
    """Three groups, each listing its modules by name (a fused q/k/v or gate/up outside the class group would be
    misread by vLLM), each with its own format and input_activations; the tensors are each scheme's."""
    qc = json.loads((three / "config.json").read_text())["quantization_config"]
    groups = list(qc["config_groups"].values())
    assert qc["format"] == "mixed-precision" and not any("Linear" in g["targets"] for g in groups)
    assert {(g["format"], (g["input_activations"] or {}).get("strategy")) for g in groups} == \
        {("float-quantized", "token"), ("pack-quantized", "token"), ("nvfp4-pack-quantized", None)}
    leaves = {"float-quantized": {"weight", "weight_scale"},
              "pack-quantized": {"weight_packed", "weight_scale", "weight_shape"},
              "nvfp4-pack-quantized": {"weight_packed", "weight_scale", "weight_global_scale"}}
    weights = _decompress_each_module(three)
    for m, t in packed_tensors(three).items():
        fmt = module_group(qc, m)["format"]
        want = ("nvfp4-pack-quantized" if m.endswith("o_proj") else "pack-quantized" if ".mlp." in m
                else "float-quantized")
        assert fmt == want and set(t) == leaves[fmt], m
        assert weights[m].act == ("" if fmt.startswith("nvfp4") else "fp8-token"), m
    err = _serve(three, capsys)
    assert all(k in err for k in ("int-fp8-emulated", "nvfp4-emulated")), err


def test_gptq_rounds_the_fp8_modules_with_rtn(three, wide_llama, tmp_path, capsys):
    """The FP8 modules of the GPTQ mixed artifact are those ``w8a8-fp8`` (RTN) writes, code for code."""
    out = tmp_path / "fp8"
    quantize_cli(wide_llama, out, capsys, "--recipe", "w8a8-fp8")
    mixed, plain = packed_tensors(three), packed_tensors(out)
    attn = [m for m in mixed if any(f"self_attn.{p}_proj" in m for p in "qkv")]
    assert attn
    for m in attn:
        assert torch.equal(mixed[m]["weight"].view(torch.uint8), plain[m]["weight"].view(torch.uint8)), m
        assert torch.equal(mixed[m]["weight_scale"], plain[m]["weight_scale"]), m


def test_verify_figures_follow_one_groups_activations(three, wide_llama, tmp_path, capsys):
    """The same recipe with the MLP's inputs left 16-bit (``activations: null`` on its override) writes the same
    tensors (calibration runs on 16-bit inputs) but verify's figures differ: verify simulates each module's
    input quantization from its own config group."""
    a16 = {**THREE_FORMATS, "overrides": [{**THREE_FORMATS["overrides"][0], "activations": None},
                                          THREE_FORMATS["overrides"][1]]}
    out = tmp_path / "a16"
    quantize_cli(wide_llama, out, capsys, "--recipe", _write(tmp_path, a16))
    mixed, plain = packed_tensors(three), packed_tensors(out)
    bits = lambda t: t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.uint8) else t  # noqa: E731
    for m in mixed:
        for leaf, t in mixed[m].items():
            assert torch.equal(bits(t), bits(plain[m][leaf])), (m, leaf)
    ppl = {}
    for name, folder in (("w4a8", three), ("w4a16", out)):
        report = tmp_path / f"report-{name}"
        code, _, err = kvq_run(["verify", folder, "--seqlen", "128", "--max-windows", "2", "--max-new-tokens", "4",
                                "--report", report], capsys)
        assert code == 0, err
        ppl[name] = json.loads((report / "report.json").read_text())["perplexity"]["artifact"]
    assert ppl["w4a8"] != ppl["w4a16"], ppl
