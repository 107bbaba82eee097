"""Calibrated runs on streamed MoE layers above the memory budget: the routed experts are read,
quantized and written in groups while the rest of the layer is held (compressor.moe_stream)."""

from __future__ import annotations

import pytest

from compressor.commands.options import QuantizeOptions
from compressor.commands.quantize import run_quantize
from compressor.manifest import load_manifest
from compressor.staging import LayerWriter

from conftest import digests
from tiny_models import ROW_FAST as FAST, make_published

#: one routed expert held: float32 + int8 codes (hidden 64, moe_intermediate 32)
EXPERT_BYTES = 3 * 64 * 32 * 5
#: the tiny rows' 4 experts are about 123 kB: a budget of 1.5 experts reads them one at a time, 4.5 all at once
ONE, ALL = 1.5 * EXPERT_BYTES / 2**30, 4.5 * EXPERT_BYTES / 2**30

AWQ_GRID = 4
CASES = {
    "gptq": dict(algorithm="gptq"),
    "gptq-no-true-sequential": dict(algorithm="gptq", settings=(("gptq.true_sequential", False),)),
    "gptaq": dict(algorithm="gptq", settings=(("gptq.gptaq_alpha", 0.25),)),
    "gptq-spilled": dict(algorithm="gptq", activation_budget_gib=0),  # expert inputs, routed outputs memory-mapped
    "rtn+fp8-static": dict(algorithm="rtn", kv_scheme="fp8"),
    "float+fp8-static": dict(algorithm="none", kv_scheme="fp8"),  # a KV-only artifact: experts written float
    "cold-experts": dict(algorithm="gptq", settings=(("moe.min_tokens", 60),)),
    # AWQ's block scale spans every expert: two more reads of the experts (compressor.moe_stream_awq); a grid of
    # AWQ_GRID ratios, not 20: each candidate is one more read of every expert group
    "awq": dict(algorithm="awq", settings=(("awq.n_grid", AWQ_GRID),)),
    "awq-gptq": dict(algorithm="awq-gptq", settings=(("awq.n_grid", AWQ_GRID),)),
    "awq-cold-fp8": dict(algorithm="awq", kv_scheme="fp8", settings=(("moe.min_tokens", 80), ("awq.n_grid", AWQ_GRID))),
}


@pytest.fixture(scope="module")
def moe_sources(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("moe-stream")
    return {mt: make_published(root / mt, tokenizer, mt, num_hidden_layers=3) for mt in ("deepseek_v3", "glm4_moe")}


@pytest.fixture
def reads(monkeypatch):
    """(layer, routed experts materialized) each time LayerWriter.load_groups hands out a group; the
    same, with the layer negated, each time LayerWriter.read_groups does (AWQ's reads before it)."""
    seen: list[tuple[int, int]] = []
    real_load, real_read = LayerWriter.load_groups, LayerWriter.read_groups

    def held(model, i):
        layer = model.get_submodule(f"model.layers.{i}")
        return sum(1 for n, p in layer.named_parameters()
                   if ".experts." in n and not p.is_meta and n.endswith("down_proj.weight"))

    def load(self, i, result, groups):
        for modules in real_load(self, i, result, groups):
            seen.append((i, held(self.model, i)))
            yield modules

    def read(self, groups=None):
        for modules in real_read(self, groups):
            i = int(modules[0].split(".")[2])
            seen.append((-i, held(self.model, i)))
            yield modules

    monkeypatch.setattr(LayerWriter, "load_groups", load)
    monkeypatch.setattr(LayerWriter, "read_groups", read)
    return seen


def _run(src, out, budget, kw, **extra):
    return run_quantize(QuantizeOptions(model=str(src), output=out, memory_budget_gib=budget, **FAST, **kw, **extra))


#: the fast lane runs GPTQ on DeepSeek-V3's layout; the other cases are marked slow (make test-fast leaves them out)
PARAMS = [pytest.param(mt, case, marks=() if (mt, case) == ("deepseek_v3", "gptq") else pytest.mark.slow)
          for mt in ("deepseek_v3", "glm4_moe") for case in CASES]


@pytest.mark.parametrize("model_type,case", PARAMS)
def test_grouped_calibration_is_exact(model_type, case, moe_sources, reads, tmp_path):
    """Experts in groups of one and of all four give the same tensors, equal to the whole layer's
    (read at once under the default budget, and a run without streaming); at most one group's
    experts are held, and each MoE layer is read in 1 + 4 (or 1 + 1) groups."""
    src, kw = moe_sources[model_type], CASES[case]
    _run(src, tmp_path / "one", ONE, kw)
    one_reads = list(reads)
    reads.clear()
    _run(src, tmp_path / "all", ALL, kw)
    all_reads = list(reads)
    reads.clear()
    _run(src, tmp_path / "whole", 4.0, kw)
    assert reads == []  # the default budget holds the layer: read whole, the driver's usual step
    assert digests(tmp_path / "one") == digests(tmp_path / "all")
    one, whole = digests(tmp_path / "one"), digests(tmp_path / "whole")
    if case == "gptaq":  # the float stream's routed part is added after its shared part (moe_stream's docstring):
        # layers up to the first MoE layer read the same float stream; later ones may differ by a rounding
        same = {n for n in one if one[n] == whole[n]}
        assert {n for n in one if not n.startswith("model.layers.2.")} <= same
        print("gptaq: layer 2 tensors equal to the whole layer's:", sum(n.startswith("model.layers.2.") for n in same),
              "of", sum(n.startswith("model.layers.2.") for n in one))
        return
    assert one == whole
    awq = kw["algorithm"].startswith("awq")
    for i in (1, 2):  # layer 0 is dense
        assert [n for j, n in one_reads if j == i] == [0, 1, 1, 1, 1], one_reads
        assert [n for j, n in all_reads if j == i] == [0, 4], all_reads
        # AWQ reads the experts before: its weight_mean terms and float reference, then the grid's AWQ_GRID candidates,
        # as many at once as the budget holds their routed parts (4 x 192 loss tokens x 64 bytes each): 1 (one
        # expert's budget), 2 (four experts'): 1 + 4 and 1 + 2 more reads
        assert [n for j, n in one_reads if j == -i] == ([1] * 4 * (1 + AWQ_GRID) if awq else []), one_reads
        assert [n for j, n in all_reads if j == -i] == ([4] * (1 + AWQ_GRID // 2) if awq else []), all_reads
    layers = {f["layer"]: f for f in load_manifest(tmp_path / "one").quality["layers"]}
    whole = {f["layer"]: f for f in load_manifest(tmp_path / "whole").quality["layers"]}
    assert layers[1]["weight_groups"] == 5 and "weight_groups" not in whole[1]
    for i in (1, 2):
        assert layers[i]["modules"] == whole[i]["modules"]
        assert layers[i]["max_abs_activation"] == whole[i]["max_abs_activation"]
        if whole[i]["output_rel_error"] is None:  # no float reference (RTN)
            assert layers[i]["output_rel_error"] is None
        elif awq:  # AWQ's float reference is the layer's own forward with its routed part replayed: exact
            assert layers[i]["output_rel_error"] == whole[i]["output_rel_error"]
            assert layers[i]["awq_ratios"] == whole[i]["awq_ratios"] and layers[i]["awq_expert_reads"] == AWQ_GRID + 2
            assert list(layers[i]["awq_ratios"]) == list(whole[i]["awq_ratios"])  # the layer's group order
        else:  # the reference's routed part is added after its shared part (moe_stream's docstring)
            assert layers[i]["output_rel_error"] == pytest.approx(whole[i]["output_rel_error"], rel=1e-4, abs=1e-6)
        assert layers[i].get("gptq", {}).get("max_damp") == whole[i].get("gptq", {}).get("max_damp")
    moe = load_manifest(tmp_path / "one").quality["moe"]
    assert moe == load_manifest(tmp_path / "whole").quality["moe"]
    if "cold" in case:
        assert moe["fallback"], moe


@pytest.mark.parametrize("algorithm", ["awq", "awq-gptq"])
def test_awq_holds_one_experts_weights_before_folding(algorithm, moe_sources, monkeypatch, tmp_path):
    """With all four experts read in one group, each expert is folded just before it is quantized:
    when an expert is quantized, the weights before folding of no other routed expert are held
    (they were the whole group's, a second float32 copy of it: 9 bytes a weight against the budget's 5)."""
    from compressor import moe_stream_awq

    held, real = [], moe_stream_awq._Step.quantize_expert

    def spy(self, i, layer, rels, inputs, cold, ctx):
        held.append(sorted({r.split(".")[-2] for r in self.st.sl.originals if ".experts." in f".{r}"}))
        return real(self, i, layer, rels, inputs, cold, ctx)

    monkeypatch.setattr(moe_stream_awq._Step, "quantize_expert", spy)
    _run(moe_sources["deepseek_v3"], tmp_path / "all", ALL, dict(algorithm=algorithm, settings=(("awq.n_grid", 2),)))
    assert len(held) == 2 * 4  # two MoE layers of four experts
    assert held == [[str(e)] for _ in (1, 2) for e in range(4)], held
