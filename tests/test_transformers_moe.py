"""A tiny DeepSeek-V3 (MLA attention, a dense layer 0, one MoE layer with 4 routed experts and a shared expert, the
release's MTP layer) through transformers' own ``from_pretrained`` (5.25.0 with compressed-tensors 0.20.1, installed
beside kvq; docs/formats.md, "MoE and MLA models in transformers").

transformers loads every weight of kvq's artifact: the per-expert tensors (``mlp.experts.<e>.gate_proj.weight`` /
``weight_packed`` ... , the names vLLM reads) are merged into its fused experts and dequantized at load, and equal
kvq's. A weight-only artifact gives kvq's logits. With quantized inputs (``w8a8-fp8``, the mixed W4A8/FP8 recipe)
it does not, for two reasons the docs state and the quantize run warns about: the routed experts' inputs stay float
(fused 3-D parameters, which compressed-tensors does not wrap), and ``kv_b_proj`` receives a ``[batch, 1, tokens,
rank]`` tensor, for which compressed-tensors' per-token strategy takes one scale per sequence. With these two
undone on each side the logits are kvq's again, so nothing else differs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from compressor.artifact import load_artifact

ROOT = Path(__file__).resolve().parents[1]
#: tiny DeepSeek-V3 widths that int4 groups of 128 and W4A8 divide: layer 0 dense, layer 1 MoE, layer 2 the MTP layer
WIDE_MLA = dict(hidden_size=128, q_lora_rank=128, kv_lora_rank=128, v_head_dim=32, moe_intermediate_size=128,
                intermediate_size=128, num_hidden_layers=2)
#: case -> (recipe, symmetric): FP8 W8A8 per channel with per-token inputs, the mixed recipe under RTN (routed
#: experts W4A8, the rest FP8 W8A8), int4 weight-only (symmetric: transformers 5.25 refuses asymmetric zero points)
CASES = {"w8a8-fp8": ("w8a8-fp8", None), "w4a8-experts": (None, None), "w4a16": ("w4a16-rtn-g64", True)}
#: max |logit difference| to kvq's loader (the logits' standard deviation is 0.23). Measured on this model: 0.005
#: for the weight-only case as loaded and for the mixed case with the two differences undone, 0 for w8a8-fp8 (its
#: experts' fp8 weights dequantize exactly; int experts are dequantized in the stored scales' bfloat16). As loaded,
#: the input cases differ by 1.08 (w8a8-fp8) and 1.12 (mixed); with only kv_b_proj's per-token scales restored, by
#: 0.046 and 0.040 (the experts' float inputs): the routing of the random model flips on the first difference.
TOL = 2e-2


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tokenizer) -> dict[str, tuple[Path, dict]]:
    """case -> (artifact folder, ``run_quantize``'s summary) of :data:`CASES`, RTN on 4 x 32 calibration tokens."""
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize
    from compressor.recipe import load_recipe
    from tiny_models import make_published

    root = tmp_path_factory.mktemp("tf-moe")
    src = make_published(root / "src", tokenizer, "deepseek_v3", **WIDE_MLA)
    mixed = root / "mixed.yaml"
    mixed.write_text(yaml.safe_dump({**load_recipe("w4a8-experts-fp8-attn").model_dump(mode="json"),
                                     "algorithm": "rtn"}))
    out = {}
    for case, (recipe, symmetric) in CASES.items():
        extra = {"symmetric": symmetric} if symmetric else {}
        summary = run_quantize(QuantizeOptions(model=str(src), output=root / case, recipe=recipe or str(mixed),
                                               calib_samples=4, calib_seqlen=32, **extra))
        out[case] = (root / case, summary)
    return out


def _per_token_kv_b(module, args):
    """A ``forward_pre_hook`` handing ``kv_b_proj`` its input as ``[batch, tokens, rank]``: the per-token scales
    vLLM and kvq take."""
    x = args[0]
    return (x.reshape(-1, *x.shape[-2:]) if x.ndim == 4 else x, *args[1:])


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_loads_every_weight(case, artifacts):
    """No tensor is missing, only the MTP layer's (no module of transformers' model) are unexpected, and the fused
    experts transformers builds from the per-expert tensors equal kvq's loader's (bfloat16 rounding of the int
    experts' dequantization); the logits are kvq's (:data:`TOL`) as loaded for the weight-only case, and for the
    input cases once the routed experts' inputs stay float in kvq's model and ``kv_b_proj`` takes per-token scales
    in transformers'."""
    from transformers import AutoModelForCausalLM

    folder, _ = artifacts[case]
    hf, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    hf.eval()
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(k.startswith("model.layers.2.") for k in info["unexpected_keys"])
    ours, _ = load_artifact(folder)
    theirs, mine = hf.model.layers[1].mlp.experts, ours.model.layers[1].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        # int experts: dequantized into the stored scales' dtype, bfloat16 here, which the fused parameter keeps
        torch.testing.assert_close(getattr(theirs, name).float(), getattr(mine, name), rtol=2 ** -8, atol=1e-6)
    if case != "w4a16":
        assert "forward" in vars(mine)  # kvq's loader quantizes each expert's inputs (a forward of its own)
        del mine.forward
        for layer in hf.model.layers:
            layer.self_attn.kv_b_proj.register_forward_pre_hook(_per_token_kv_b)
    with torch.no_grad():
        torch.testing.assert_close(hf(_ids()).logits, ours(_ids()).logits, atol=TOL, rtol=TOL)


def test_the_quantize_run_warns(artifacts):
    """The input cases' summaries carry the transformers warning with both reasons and the docs' section; the
    weight-only one does not."""
    for case, (_, summary) in artifacts.items():
        lines = [w for w in summary["warnings"] if w.startswith("transformers 5.25")]
        if case == "w4a16":
            assert not lines
            continue
        assert len(lines) == 1, case
        assert "12 routed-expert linears run with float inputs; 2 kv_b_proj take one input scale per sequence" \
            in lines[0], lines[0]
        assert lines[0].endswith('(docs/formats.md, "MoE and MLA models in transformers")')


def test_the_docs_exclude_moe_and_mla_inputs():
    """docs/formats.md's loader section limits the FP8 W8A8 claim to dense models and has the section the warning
    names (versions, both reasons, the weight-only case); the README points there."""
    text = (ROOT / "docs" / "formats.md").read_text()
    head = text[:text.index("The rest of this page is for kvq maintainers")]
    assert "**MoE and MLA models in transformers.**" in head
    section = " ".join(head.split("**MoE and MLA models in transformers.**")[1].split("\n\n")[0].split())
    for words in ("transformers 5.25.0 with compressed-tensors 0.20.1", "without an error, every weight included",
                  "routed experts", "kv_b_proj", "one scale per sequence", "weight-only",
                  "tests/test_transformers_moe.py"):
        assert words in section, words
    assert re.search(r"on a dense model[^.]*give kvq's logits", " ".join(head.split()))
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "not with quantized inputs on a MoE or MLA model" in readme
