"""Every bundled recipe's artifact through transformers' own loader, plain ``from_pretrained``
(issue #45): the versions that load it are stated in docs/formats.md and checked here.

Two transformers are used. The one installed beside kvq (the newest release when this was
written, 5.25.0, with compressed-tensors 0.20.1) loads symmetric and float-weight artifacts,
and refuses asymmetric ``pack-quantized`` ones: from 5.23.0 on it builds the compressed
modules on ``meta`` through compressed-tensors' ``compress``, whose meta branch leaves
``weight_zero_point`` at its unpacked shape ``[out, groups]`` while the packed tensor written by
compressed-tensors itself (and by kvq) is ``[out * bits / 32, groups]``. The second,
transformers 5.22.2 (the newest that loads them), is installed by ``make install`` into
``.venv/consumers/`` and runs in a subprocess; every recipe's artifact must load there and give
kvq's own logits. When a release fixes the meta branch, the refusal test below fails and the
documented range is to be widened.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compressor.arch import get_arch
from compressor.artifact import load_artifact, read_kv_cache
from compressor.commands.options import DEFAULT_RECIPE, QuantizeOptions
from compressor.commands.quantize import run_quantize
from compressor.quant.kv import quantized_cache
from compressor.recipe import bundled_recipes, load_recipe

from conftest import make_model_dir

#: the newest transformers release that loads asymmetric pack-quantized artifacts (Makefile: CONSUMER_TRANSFORMERS)
LOADING_RELEASE = "5.22.2"
CONSUMER = Path(sys.prefix) / "consumers" / f"transformers-{LOADING_RELEASE}"
#: bundled recipes whose overrides name routed experts: refused on the tiny Llama (an override matching no
#: linear), loaded on a tiny DeepSeek-V3 by compressed-tensors' decompressors in tests/test_mixed_formats.py
MOE_ONLY = {"w4a8-experts-fp8-attn"}
RECIPES = sorted(set(bundled_recipes()) - MOE_ONLY)

_PROBE = """
import sys, torch, transformers
from transformers import AutoModelForCausalLM
assert transformers.__version__ == sys.argv[2], transformers.__version__
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[5])).eval()
ids = torch.load(sys.argv[3])
with torch.no_grad():
    torch.save(model(ids).logits, sys.argv[4])
"""


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


def _asymmetric_packed(folder: Path) -> bool:
    """Whether the artifact's ``config.json`` declares an asymmetric weight scheme (packed zero points)."""
    qc = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    groups = (qc.get("config_groups") or {}).values()
    return any(g.get("weights") and not g["weights"].get("symmetric", True) for g in groups)


def _load_dtype(folder: Path) -> torch.dtype:
    """The dtype transformers loads the artifact in: bfloat16 for NVFP4 and MXFP4 (compressed-tensors 0.20.1's
    ``nvfp4-pack-quantized`` and ``mxfp4-pack-quantized`` decompressors return bfloat16 weights whatever the
    model's dtype, so a float32 model fails its first forward), float32 for the others."""
    qc = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    return torch.bfloat16 if qc.get("format") in ("nvfp4-pack-quantized", "mxfp4-pack-quantized") else torch.float32


def _nvfp4_inputs(folder: Path) -> bool:
    """Whether the artifact quantizes its linears' inputs to NVFP4 (W4A4: 4-bit ``input_activations``)."""
    qc = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    groups = (qc.get("config_groups") or {}).values()
    return any(((g or {}).get("input_activations") or {}).get("num_bits") == 4 for g in groups)


def _compare(theirs: torch.Tensor, folder: Path, kv_cache: bool = False) -> None:
    """transformers' logits against kvq's, in the dtype it loaded (:func:`_load_dtype`; bfloat16's tolerance).
    NVFP4 W4A4 gets twice bfloat16's: compressed-tensors' forward takes each group's ``absmax / 6`` in the
    model's bfloat16 before the e4m3 cast, vLLM's kernel and kvq in float32, so a few group scales of the inputs
    land one e4m3 step apart (docs/formats.md)."""
    dtype = _load_dtype(folder)
    tol = 2e-3 if dtype == torch.float32 else 6e-2 if _nvfp4_inputs(folder) else 3e-2
    torch.testing.assert_close(theirs, _ours(folder, kv_cache, dtype), atol=tol, rtol=tol)


def _wide_recipe(name: str) -> bool:
    """An FP8 block recipe (activation groups of 128 columns) or W4A8 (weight groups of 128): they need
    inputs 128 wide or wider."""
    weights = load_recipe(name).weights
    return weights.block_structure is not None or weights.group_size == 128


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_model_dir, tokenizer) -> dict[str, Path]:
    """One artifact per bundled recipe, of the shared tiny Llama (4 x 32 calibration tokens); an FP8
    block recipe's of a Llama 128 / 256 wide (compressed-tensors' forward, as vLLM's kernels,
    refuses activation groups wider than a layer's input), and W4A8's (groups of 128) too."""
    root = tmp_path_factory.mktemp("consumers")
    wide = None
    out = {}
    for name in RECIPES:
        out[name] = root / name
        model = tiny_model_dir
        if _wide_recipe(name):
            wide = wide or make_model_dir(root / "wide", tokenizer, hidden_size=128, intermediate_size=256)
            model = wide
        run_quantize(QuantizeOptions(model=str(model), output=out[name], recipe=name, calib_samples=4,
                                     calib_seqlen=32))
    return out


def _static_kv(folder: Path) -> bool:
    info = read_kv_cache(folder)
    return info is not None and info[0].static


def _ours(folder: Path, kv_cache: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """kvq's logits for :func:`_ids`: the artifact read by kvq's own loader (the model in ``dtype``), with its
    quantized KV cache (verify's :func:`~compressor.quant.kv.quantized_cache`) when ``kv_cache``."""
    model, _ = load_artifact(folder)
    model = model.to(dtype)
    cache = None
    if kv_cache and (info := read_kv_cache(folder)) is not None:
        layout = get_arch(model.config.model_type).kv_layout(model.config)
        cache = quantized_cache(info[0], model.config.num_hidden_layers, info[1], layout)
    with torch.no_grad():
        return model(_ids(), past_key_values=cache, use_cache=cache is not None).logits


def test_recipes_and_schemes_are_covered(artifacts):
    assert {"w4a16-awq", "w4a16-gptq", "w8a16-rtn", "kv-fp8", "w8a8-fp8", "w8a8-fp8-block", "w4a8-gptq",
            "w4a16-nvfp4"} <= set(RECIPES)
    # both sides of the installed release's limit are exercised
    assert {_asymmetric_packed(f) for f in artifacts.values()} == {True, False}
    assert {_static_kv(f) for f in artifacts.values()} == {True, False}


#: the fast lane loads the default recipe's artifact; every other recipe's is in the slow lane (a subprocess each)
FAST_RECIPES = {DEFAULT_RECIPE}


@pytest.mark.parametrize("recipe", [r if r in FAST_RECIPES else pytest.param(r, marks=pytest.mark.slow) for r in RECIPES])
def test_loading_release_matches_kvq(recipe, artifacts, tmp_path):
    """transformers 5.22.2 + compressed-tensors 0.20.1 load every recipe's artifact and give kvq's logits."""
    assert CONSUMER.is_dir(), f"{CONSUMER} is missing: `make install` puts transformers {LOADING_RELEASE} there"
    ids, logits = tmp_path / "ids.pt", tmp_path / "logits.pt"
    torch.save(_ids(), ids)
    env = {**os.environ, "PYTHONPATH": str(CONSUMER), "HF_HUB_OFFLINE": "1"}
    dtype = str(_load_dtype(artifacts[recipe])).removeprefix("torch.")
    run = subprocess.run([sys.executable, "-c", _PROBE, str(artifacts[recipe]), LOADING_RELEASE, str(ids), str(logits),
                          dtype], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    # it runs a static (fp8) KV scheme's k_scale/v_scale as kvq's quantized cache does; dynamic ones in float
    _compare(torch.load(logits), artifacts[recipe], kv_cache=_static_kv(artifacts[recipe]))


@pytest.mark.parametrize("recipe", RECIPES)
def test_installed_release(recipe, artifacts):
    """The transformers installed beside kvq loads symmetric and float-weight artifacts (ignoring any
    KV scales: the cache stays float) and refuses
    asymmetric ones on ``weight_zero_point``'s shape, as docs/formats.md states."""
    from transformers import AutoModelForCausalLM

    if not _asymmetric_packed(artifacts[recipe]):
        hf = AutoModelForCausalLM.from_pretrained(str(artifacts[recipe]), dtype=_load_dtype(artifacts[recipe])).eval()
        with torch.no_grad():
            _compare(hf(_ids()).logits, artifacts[recipe])
    else:
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
            AutoModelForCausalLM.from_pretrained(str(artifacts[recipe]), dtype=torch.float32)


def test_makefile_installs_the_loading_release():
    make = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert f"CONSUMER_TRANSFORMERS := {LOADING_RELEASE}\n" in make
