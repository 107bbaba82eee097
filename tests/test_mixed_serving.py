"""What the consumers read of a mixed-format artifact (issue #49; docs/formats.md, "Mixed formats per module"):
transformers' own ``from_pretrained`` (compressed-tensors 0.20.1 installed beside kvq) loads a Llama whose
attention is FP8 W8A8 and whose MLP is int4 or NVFP4 W4A16 with every linear in its own group's scheme and kvq's
logits; the routed experts' config group names its modules with one ``re:`` target per linear kind, which match
exactly the modules the explicit list named and give each module the scheme compressed-tensors gave it before;
and a recipe giving one MoE layer's routed experts several schemes (vLLM serves one per layer) is refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from compressor.artifact import load_artifact
from compressor.formats.compressed_tensors import module_group

from conftest import assert_clean_error, kvq_run, packed_tensors, unwrap

FP8 = {"type": "float", "num_bits": 8, "group_size": -1, "symmetric": True}
TOKEN = {"type": "float", "num_bits": 8, "strategy": "token"}
#: the MLP's weight-only scheme per case: symmetric int4 (the installed transformers refuses asymmetric packed
#: zero points: tests/test_consumer_load.py) and NVFP4
MLP = {"int4": {"type": "int", "num_bits": 4, "group_size": 128, "symmetric": True},
       "nvfp4": {"type": "float", "num_bits": 4, "group_size": 16, "symmetric": True}}
#: (format, weight type, bits, fp8 inputs) each linear's config group must give it
WANT = {"attn": ("float-quantized", "float", 8, True), "int4": ("pack-quantized", "int", 4, False),
        "nvfp4": ("nvfp4-pack-quantized", "float", 4, False)}


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def mixed_llama(wide_llama, tmp_path_factory) -> dict[str, Path]:
    """The wide Llama (hidden 128, MLP 256) quantized with RTN per case of :data:`MLP`: attention FP8 W8A8 per
    channel with fp8 inputs per token (the recipe's scheme), the MLP's override weight-only."""
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize

    root = tmp_path_factory.mktemp("mixed-load")
    out = {}
    for case, weights in MLP.items():
        recipe = root / f"{case}.yaml"
        recipe.write_text(yaml.safe_dump({"algorithm": "rtn", "weights": FP8, "activations": TOKEN, "overrides": [
            {"targets": ["re:.*mlp\\..*"], "weights": weights, "activations": None}]}))
        out[case] = root / case
        run_quantize(QuantizeOptions(model=str(wide_llama), output=out[case], recipe=str(recipe), calib_samples=4,
                                     calib_seqlen=32))
    return out


#: transformers' logits against kvq's reader's (absolute and relative): float32 (int4 case; measured: equal) within
#: 2e-3; bfloat16 (NVFP4 case: its decompressor returns bfloat16 weights, tests/test_consumer_load.py) within 6e-2,
#: twice bfloat16's usual 3e-2: the fp8 inputs are quantized from bfloat16 activations, where one rounding moves a
#: value across an e4m3 step (kvq's own model differs by 0.035 between bfloat16 and float32, measured on this row)
TOLERANCE = {"int4": (torch.float32, 2e-3), "nvfp4": (torch.bfloat16, 6e-2)}


@pytest.mark.parametrize("case", sorted(MLP))
def test_transformers_loads_a_mixed_artifact(case, mixed_llama):
    """``AutoModelForCausalLM.from_pretrained`` of the mixed artifact: every decoder linear carries the scheme of
    its config group (attention FP8 with fp8 inputs, MLP weight-only int4 or NVFP4) and the compressed tensors of
    that group's format, none is left in float or given another group's scheme, ``lm_head`` stays float, and the
    logits are kvq's loader's (:data:`TOLERANCE`)."""
    from transformers import AutoModelForCausalLM

    folder = mixed_llama[case]
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and len(qc["config_groups"]) == 2
    dtype, tol = TOLERANCE[case]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    stored = packed_tensors(folder)
    linears = {n: m for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(linears) == set(stored) | {"lm_head"} and len(stored) == 14
    assert getattr(linears.pop("lm_head"), "quantization_scheme", None) is None
    for name, module in linears.items():
        scheme = getattr(module, "quantization_scheme", None)
        assert scheme is not None, f"{name} left unquantized"
        fmt, kind, bits, inputs = WANT["attn" if ".self_attn." in name else case]
        got = (getattr(scheme.format, "value", scheme.format), getattr(scheme.weights.type, "value", scheme.weights.type),
               scheme.weights.num_bits,
               scheme.input_activations is not None)
        assert got == (fmt, kind, bits, inputs) == (module_group(qc, name)["format"], kind, bits, inputs), name
        assert {k for k, _ in module.named_parameters()} == set(stored[name]), name
    ours, _ = load_artifact(folder)
    with torch.no_grad():
        theirs, mine = hf(_ids()).logits, ours.to(dtype)(_ids()).logits
    torch.testing.assert_close(theirs, mine, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------
# the routed experts' targets

#: tests/test_mixed_formats.py's tiny DeepSeek-V3 widths (int4 groups of 128), here with 4 decoder layers: dense
#: layer 0, MoE layers 1-3 (4 routed experts each), and the release's MTP layer 4 (its linears ignored)
WIDE_MLA = dict(hidden_size=128, q_lora_rank=128, kv_lora_rank=128, v_head_dim=32, moe_intermediate_size=128,
                intermediate_size=128, num_hidden_layers=4)


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory, tokenizer) -> Path:
    """The published-layout tiny DeepSeek-V3 of :data:`WIDE_MLA`."""
    from tiny_models import make_published

    return make_published(tmp_path_factory.mktemp("moe-targets") / "src", tokenizer, "deepseek_v3", **WIDE_MLA)


@pytest.fixture(scope="module")
def moe_artifact(moe_source) -> Path:
    """``w4a8-experts-fp8-attn`` (GPTQ, 4 x 32 calibration tokens) of :func:`moe_source`."""
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize

    out = moe_source.parent / "art"
    run_quantize(QuantizeOptions(model=str(moe_source), output=out, recipe="w4a8-experts-fp8-attn", calib_samples=4,
                                 calib_seqlen=32))
    return out


def _unfused_model(folder: Path):
    """The artifact's architecture in float (random init), routed experts as one ``Linear`` each (kvq's
    :func:`~compressor.moe.unfuse_experts`, the checkpoint's and vLLM's names)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from compressor.arch import get_arch
    from compressor.moe import unfuse_experts

    cfg = AutoConfig.from_pretrained(folder)
    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg)
    unfuse_experts(model, get_arch(cfg.model_type))
    return model


def _listed(qc: dict, folder: Path) -> dict:
    """``qc`` as kvq wrote it before the routed experts' ``re:`` targets: the W4A8 group naming each module stored
    with int4 ``weight_packed`` (the FP8 modules store ``weight``), sorted."""
    names = sorted(m for m, t in packed_tensors(folder).items() if "weight_packed" in t)
    groups = {k: {**g, "targets": names} if any(t.startswith("re:") for t in g["targets"]) else g
              for k, g in qc["config_groups"].items()}
    return {**qc, "config_groups": groups}


def test_routed_experts_are_targeted_by_regexes(moe_artifact):
    """The W4A8 group has one ``re:`` target per expert linear kind, which match (``re.match``, as compressed-tensors'
    ``match_name`` and vLLM do) exactly the modules the explicit list named among every module of the model and
    every name of the config, no more and no fewer; the MTP layer's ignored experts keep them to layers 1-3."""
    qc = json.loads((moe_artifact / "config.json").read_text())["quantization_config"]
    targets = qc["config_groups"]["group_1"]["targets"]
    assert targets == [rf"re:model\.layers\.(?:1|2|3)\.mlp\.experts\.\d+\.{p}_proj$" for p in ("down", "gate", "up")]
    listed = _listed(qc, moe_artifact)["config_groups"]["group_1"]["targets"]
    assert len(listed) == 3 * 4 * 3
    names = {n for n, _ in _unfused_model(moe_artifact).named_modules()} | set(packed_tensors(moe_artifact)) | \
        set(qc["ignore"])
    assert "model.layers.4.mlp.experts.0.up_proj" in names and "model.layers.1.mlp.experts" in names
    assert sorted(n for n in names if any(re.match(t[3:], n) for t in targets)) == listed


def test_compressed_tensors_assigns_the_same_schemes(moe_artifact):
    """compressed-tensors' own ``apply_quantization_config`` gives every module of the model the scheme it gave
    under the explicit list (the FP8 class group's to attention, shared experts and the dense MLP; W4A8 to each
    routed expert), and kvq's reader (:func:`module_group`) agrees."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    qc = json.loads((moe_artifact / "config.json").read_text())["quantization_config"]
    schemes = []
    for config in (qc, _listed(qc, moe_artifact)):
        model = _unfused_model(moe_artifact)
        apply_quantization_config(model, QuantizationConfig.model_validate(config), show_progress=False)
        schemes.append({n: getattr(m, "quantization_scheme", None) for n, m in model.named_modules()})
    assert schemes[0].keys() == schemes[1].keys()
    dump = lambda s: None if s is None else s.model_dump(exclude={"targets"})  # noqa: E731
    assert {n: dump(s) for n, s in schemes[0].items()} == {n: dump(s) for n, s in schemes[1].items()}
    quantized = {n: s for n, s in schemes[0].items() if s is not None}
    routed = [n for n in quantized if ".mlp.experts." in n]
    assert len(routed) == 36 and len(quantized) == 36 + 4 * 5 + 3 * 3 + 3
    for name, s in quantized.items():
        assert (s.weights.num_bits, s.format) == ((4, "pack-quantized") if name in routed else
                                                  (8, "float-quantized")), name
        assert module_group(qc, name)["format"] == s.format, name


def test_compact_targets_fall_back_to_names():
    """Where no regex is exact (an expert of a layer is not in the group) the kind's names stay listed; names
    outside the routed experts are never rewritten."""
    from compressor.formats.ct_groups import compact_targets

    experts = [f"model.layers.{i}.mlp.experts.{e}.{p}_proj" for i in (1, 2) for e in range(3) for p in ("gate", "down")]
    dense = ["model.layers.0.mlp.down_proj"]
    assert compact_targets(experts + dense, set(experts + dense)) == dense + [
        rf"re:model\.layers\.\d+\.mlp\.experts\.\d+\.{p}_proj$" for p in ("down", "gate")]
    gap = [n for n in experts if n != "model.layers.2.mlp.experts.1.gate_proj"]
    got = compact_targets(gap, set(experts))
    assert got == sorted([n for n in gap if n.endswith("gate_proj")] +
                         [r"re:model\.layers\.\d+\.mlp\.experts\.\d+\.down_proj$"])


# ---------------------------------------------------------------------------------------
# one scheme per MoE layer's routed experts

#: the bundled MoE recipe (RTN) with the routed experts' down_proj given FP8 W8A8 by a second override catching one
#: kind only, or expert 0 of every layer left in float; and the schemes the refusal names for model.layers.1
SPLIT = {
    "down_proj": ({"overrides": [{"targets": ["re:.*\\.experts\\.\\d+\\.down_proj"], "weights": FP8}]},
                  "int4 g128 symmetric, fp8-token inputs: 8 linears (e.g. mlp.experts.0.gate_proj); FP8 per "
                  "channel, fp8-token inputs: 4 linears (e.g. mlp.experts.0.down_proj)"),
    "ignored expert": ({"ignore": ["re:.*\\.experts\\.0\\..*"]},
                       "float (not quantized): 3 linears (e.g. mlp.experts.0.gate_proj); int4 g128 symmetric, "
                       "fp8-token inputs: 9 linears (e.g. mlp.experts.1.gate_proj)"),
}


def _split(case: str) -> dict:
    """``w4a8-experts-fp8-attn`` under RTN with :data:`SPLIT`'s change (overrides appended)."""
    from compressor.recipe import load_recipe

    data = {**load_recipe("w4a8-experts-fp8-attn").model_dump(mode="json"), "algorithm": "rtn"}
    change = SPLIT[case][0]
    return {**data, **change, "overrides": data["overrides"] + change.get("overrides", [])}


@pytest.mark.parametrize("case", sorted(SPLIT))
def test_split_experts_are_refused_before_loading(case, moe_source, tmp_path, capsys, monkeypatch):
    """A recipe giving one MoE layer's routed experts two schemes: exit 2 in one line naming the first such layer
    and both schemes, before the weights are loaded (loading fails this test) and with nothing written."""
    import compressor.commands.quantize as quantize

    def loaded(*_, **__):
        raise AssertionError("the source was loaded before the refusal")

    monkeypatch.setattr(quantize, "open_lazy", loaded)
    monkeypatch.setattr(quantize, "load_model", loaded)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_split(case)))
    code, _, err = kvq_run(["quantize", moe_source, "-o", tmp_path / "out", "--recipe", recipe], capsys)
    assert_clean_error(code, err, 2, "model.layers.1: the recipe gives this MoE layer's routed experts 2 schemes",
                       tmp_path)
    assert f"({SPLIT[case][1]}); vLLM serves one scheme for all routed experts of a layer" in unwrap(err)
    assert not (tmp_path / "out").exists()


def test_the_library_refuses_split_experts_too():
    """:func:`compressor.pipeline.quantize_model` (the Python API) refuses the same recipe before any layer."""
    from compressor.errors import InputError
    from compressor.pipeline import quantize_model
    from compressor.recipe import parse_recipe
    from tiny_models import tiny

    with pytest.raises(InputError, match="^model.layers.1: the recipe gives this MoE layer's routed experts 2 sch"):
        quantize_model(tiny("deepseek_v3", **WIDE_MLA), parse_recipe(_split("down_proj")), None)
