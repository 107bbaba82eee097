"""Each registry is the only home of its names (issue #42): an algorithm, an on-disk format and a
KV-cache scheme defined here, and registered, are choices of ``kvq quantize`` and round-trip through
quantize -> load on a tiny model, without another module of kvq changed."""

from __future__ import annotations

import json

import pytest

from compressor.artifact import load_artifact
from compressor.formats.compressed_tensors import CompressedTensorsFormat
from compressor.kv_schemes import KV_SCHEMES, Int8TokenScheme, register
from compressor.manifest import load_manifest
from compressor.quant.algorithms import RTN, register_algorithm
from compressor.recipe import Recipe
from compressor.registry import ALGORITHMS, FORMATS

from conftest import kvq_run


@pytest.fixture
def plugins():
    """One trivial entry in each registry (copies of RTN, compressed-tensors and int8-per-token
    under new names), removed again after the test."""

    @register_algorithm
    class RTNCopy(RTN):
        name = "rtn-copy"

    class CTCopy(CompressedTensorsFormat):
        name = "ct-copy"

    @register("int8x", "token")
    class Int8X(Int8TokenScheme):
        pass

    yield RTNCopy, CTCopy, Int8X
    ALGORITHMS.remove("rtn-copy")
    FORMATS.remove("ct-copy")
    KV_SCHEMES.pop(("int8x", "token"), None)


def test_new_entries_are_choices_and_recipe_values(plugins, capsys):
    code, out, _ = kvq_run(["quantize", "--help"], capsys)
    assert code == 0
    flat = " ".join(out.split())
    assert "rtn-copy" in flat and "ct-copy" in flat and "int8x" in flat
    r = Recipe(algorithm="rtn-copy", kv_cache={"scheme": "int8x"})
    assert r.kv_cache.spec().codec.__class__ is plugins[2]


def test_unknown_names_are_refused_with_the_registered_ones():
    with pytest.raises(ValueError, match="Input should be 'awq', 'awq-gptq', 'gptq', 'none' or 'rtn'"):
        Recipe(algorithm="smoothquant")
    with pytest.raises(ValueError, match="Input should be 'fp8', 'int8', 'int4' or 'int2'"):
        Recipe(kv_cache={"scheme": "int3"})


def test_new_entries_round_trip(plugins, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "art"
    code, _, err = kvq_run(["quantize", tiny_model_dir, "-o", out, "--algorithm", "rtn-copy", "--format", "ct-copy",
                            "--kv-scheme", "int8x", "--group-size", "32", "--calib-samples", "4",
                            "--calib-seqlen", "32"], capsys)
    assert code == 0, err
    m = load_manifest(out)
    assert m.recipe["algorithm"] == "rtn-copy" and m.kv_cache["scheme"] == "int8x"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    model, _tok = load_artifact(out)[:2]
    assert sum(p.numel() for p in model.parameters()) > 0
