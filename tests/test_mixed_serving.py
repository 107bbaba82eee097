"""What the consumers read of a mixed-format artifact (issue #49; docs/formats.md, "Mixed formats per module"):
transformers' own ``from_pretrained`` (compressed-tensors 0.20.1 installed beside kvq) loads a Llama whose
attention is FP8 W8A8 and whose MLP is int4 or NVFP4 W4A16 with every linear in its own group's scheme and kvq's
logits; the routed experts' config group names its modules with one ``re:`` target per linear kind, which match
exactly the modules the explicit list named and give each module the scheme compressed-tensors gave it before;
and a recipe giving one MoE layer's routed experts several schemes (vLLM serves one per layer) is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from compressor.artifact import load_artifact
from compressor.formats.compressed_tensors import module_group

from conftest import packed_tensors

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
