"""AWQ on the FP4 e2m1 grids (NVFP4, MXFP4; issue #49): the scale and clip searches round every candidate as the
format's writer rounds it (NVFP4: a fused set's global scale from the set's scaled weights), and the artifact
stores the rounding of the folded weights the search chose.

The searches against the unscaled and unclipped candidates, the candidates against the writer's own rounding,
and the command line: tiny Llama and DeepSeek-V3 rows quantized with the bundled ``w4a16-nvfp4-awq`` and
``w4a16-mxfp4-awq`` recipes, read back by kvq's reader and compressed-tensors' decompressor, the fused sets'
global scales shared, the streamed MoE path's tensors equal to the whole layer's."""

from __future__ import annotations

import json

import pytest
import torch

from compressor.arch import get_arch
from compressor.commands.options import QuantizeOptions
from compressor.commands.quantize import run_quantize
from compressor.formats import read_quant_weight
from compressor.manifest import load_manifest
from compressor.quant import fp4, mxfp4
from compressor.quant.algorithms import fused_peers
from compressor.quant.awq import (MXFP4, NVFP4, candidate_weights, e2m1_fake_quantize, group_grams, search_clip,
                                  search_scales)
from compressor.quant.primitives import clip_groups

from conftest import decompress_as_kvq_reads, digests, packed_tensors, quantize_cli, verify_and_serve
from tiny_models import make_published

GROUPS = {NVFP4: fp4.GROUP, MXFP4: mxfp4.GROUP}
RECIPES = {NVFP4: "w4a16-nvfp4-awq", MXFP4: "w4a16-mxfp4-awq"}


def _writer(w: torch.Tensor, grid: str, absmax: float | None = None) -> torch.Tensor:
    """What the format's writer stores for ``w``, dequantized (float32)."""
    if grid == NVFP4:
        return fp4.dequantize_weight(*fp4.quantize_weight(w, absmax))
    return mxfp4.dequantize_weight(*mxfp4.quantize_weight(w))


def _salient(seed: int, out: int = 64, cols: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w [out, cols], x [512, cols])``: a few input channels with large activations, as AWQ expects."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=g) * 0.05
    x = torch.randn(512, cols, generator=g)
    x[:, torch.randperm(cols, generator=g)[:8]] *= 20
    return w, x


@pytest.mark.parametrize("duo", [False, True])
@pytest.mark.parametrize("grid", [NVFP4, MXFP4])
def test_the_chosen_scale_is_never_worse_than_the_unscaled_candidate(grid, duo):
    """The pick's loss is the smallest of the grid's, so at most ratio 0's; without duo scaling ratio 0 is
    ``s = 1``, whose candidate is the writer's rounding of ``w`` itself, exactly."""
    for seed in range(3):
        w, x = _salient(seed)
        ref = x @ w.t()
        loss = lambda c: float((x @ c[0].t() - ref).pow(2).mean())  # noqa: E731
        s, ratio, losses = search_scales(x.abs().mean(0), [w], loss, 4, GROUPS[grid], True, n_grid=10,
                                         duo_scaling=duo, e2m1=([grid], [None]))
        chosen = loss(candidate_weights([w], s, [4], [GROUPS[grid]], [True], [grid], [None]))
        assert chosen == min(losses) <= losses[0]
        if not duo:
            assert losses[0] == loss([_writer(w, grid)])
            assert chosen <= loss([_writer(w, grid)])


def test_nvfp4_candidates_share_the_fused_sets_global_scale():
    """Two weights of one set key are rounded under the global scale of the larger ``|w * s|`` of the two (the
    artifact's shared one); a weight without a key under its own; MXFP4 as its writer, divided by ``s``."""
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randn(32, 64, generator=g) * k for k in (0.1, 1.0, 0.3))
    s = torch.rand(64, generator=g) + 0.5
    got = candidate_weights([a, b, c], s, [4] * 3, [16] * 3, [True] * 3, [NVFP4] * 3, ["qkv", "qkv", None])
    top = max(float((a * s).abs().max()), float((b * s).abs().max()))
    assert torch.equal(got[0], _writer(a * s, NVFP4, top) / s)
    assert torch.equal(got[1], _writer(b * s, NVFP4, top) / s)
    assert torch.equal(got[2], _writer(c * s, NVFP4) / s)
    assert not torch.equal(got[0], _writer(a * s, NVFP4) / s)  # its own global scale would round otherwise
    mx = candidate_weights([a], s, [4], [32], [True], [MXFP4], [None])[0]
    assert torch.equal(mx, _writer(a * s, MXFP4) / s)
    assert torch.equal(e2m1_fake_quantize(a, MXFP4), _writer(a, MXFP4))


@pytest.mark.parametrize("grid", [NVFP4, MXFP4])
def test_the_clip_search_scores_what_the_writer_stores(grid):
    """Each group's chosen threshold gives an output error no larger than the unclipped rounding's (threshold 1 is
    a candidate), and the clipped weight rounded by the writer is what the search scored."""
    w, x = _salient(7)
    gs = GROUPS[grid]
    absmax = float(w.abs().max()) * 1.5  # a fused set's larger absmax: the clip keeps that global scale
    clip = search_clip(w, x, 4, gs, True, grid=grid, absmax=absmax if grid == NVFP4 else None)
    gram = group_grams(x, gs)

    def err(wq: torch.Tensor) -> torch.Tensor:  # [out, G]: each group's mean squared partial output error
        d = (wq - w).reshape(w.shape[0], -1, gs).permute(1, 0, 2)
        return torch.bmm(d, gram).mul(d).sum(-1).t()

    absmax = absmax if grid == NVFP4 else None
    clipped, plain = _writer(clip_groups(w, clip, gs), grid, absmax), _writer(w, grid, absmax)
    assert (err(clipped) <= err(plain) * (1 + 1e-5) + 1e-12).all()
    assert (clip < w.abs().reshape(w.shape[0], -1, gs).amax(-1)).any()  # some group is clipped


def _check_artifact(out, grid: str, arch_name: str, algorithm: str = "awq") -> None:
    """Every packed weight decompresses through compressed-tensors as kvq reads it; NVFP4: each fused set carries
    one global scale."""
    manifest = json.loads((out / "kvq-manifest.json").read_text())
    assert manifest["recipe"]["algorithm"] == algorithm
    assert any(f.get("awq_ratios") for f in manifest["quality"]["layers"])
    qc, modules = decompress_as_kvq_reads(out)
    assert qc["config_groups"]["group_0"]["format"] == f"{grid}-pack-quantized"
    if grid != NVFP4:
        return
    arch, shared = get_arch(arch_name), 0
    for m, t in modules.items():
        prefix, rel = m.split(".", 3)[:3], m.split(".", 3)[3]
        for peer in fused_peers(arch, rel):
            other = ".".join(prefix + [peer])
            if other in modules and other != m:
                assert torch.equal(t["weight_global_scale"], modules[other]["weight_global_scale"]), (m, other)
                shared += 1
    assert shared


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory, tokenizer):
    """A tiny published DeepSeek-V3 row: layer 0 dense, layers 1-2 of four routed experts and a shared one."""
    return make_published(tmp_path_factory.mktemp("awq-fp4") / "ds", tokenizer, "deepseek_v3", num_hidden_layers=3)


@pytest.mark.parametrize("grid", [NVFP4, MXFP4])
def test_llama_artifact_stores_the_searched_weights_and_reads_back(grid, wide_llama, tmp_path, capsys, monkeypatch):
    """The bundled recipe on a tiny Llama: q/k of layer 0 are the writer's rounding of the source weights times
    the scale the search chose (no clip search on them, no later group divides their rows), under the global scale
    of q/k/v scaled (NVFP4); the artifact reads back as compressed-tensors reads it; verify and serve-smoke pass."""
    from safetensors.torch import load_file

    from compressor.quant import awq_layer

    chosen, real = {}, awq_layer.fold_group

    def spy(layer, group, s, *a, **k):
        chosen.setdefault(group.prev_op, s.clone())
        return real(layer, group, s, *a, **k)

    monkeypatch.setattr(awq_layer, "fold_group", spy)
    out = tmp_path / "art"
    quantize_cli(wide_llama, out, capsys, "--recipe", RECIPES[grid], "--set", "awq.n_grid=5")
    _check_artifact(out, grid, "llama")
    src = load_file(str(wide_llama / "model.safetensors"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    modules = packed_tensors(out)
    s = chosen["input_layernorm"]  # layer 0's, the first folded
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    scaled = [src[n + ".weight"].float() * s for n in names]
    top = max(float(w.abs().max()) for w in scaled)  # v_proj's unclipped weights count: the set's global scale
    for n, w in zip(names[:2], scaled[:2]):  # q/k: no clip search (arch.clip_skip)
        got = read_quant_weight("compressed-tensors", qc, n, modules[n]).dequantize(torch.float32)
        assert torch.equal(got, _writer(w, grid, top if grid == NVFP4 else None)), n
    verify_and_serve(out, capsys)


@pytest.mark.parametrize("grid", [NVFP4, MXFP4])
def test_deepseek_artifact_reads_back_with_shared_global_scales(grid, moe_source, tmp_path, capsys):
    """MLA's q_a/kv_a and each expert's gate/up (NVFP4: one global scale each), clip search on the experts:
    the artifact reads back as compressed-tensors reads it."""
    out = tmp_path / "art"
    quantize_cli(moe_source, out, capsys, "--recipe", RECIPES[grid], "--set", "awq.n_grid=4")
    _check_artifact(out, grid, "deepseek_v3")


@pytest.mark.parametrize("grid", [NVFP4, MXFP4])
def test_awq_gptq_on_the_fp4_grid(grid, wide_llama, tmp_path, capsys):
    """``--algorithm awq-gptq`` with the FP4 recipes: AWQ's scales searched on the grid and folded, then GPTQ on
    the folded weights; the artifact reads back as compressed-tensors reads it, one global scale per fused set."""
    out = tmp_path / "art"
    quantize_cli(wide_llama, out, capsys, "--recipe", RECIPES[grid], "--algorithm", "awq-gptq", "--set", "awq.n_grid=4")
    _check_artifact(out, grid, "llama", "awq-gptq")


#: one routed expert held (hidden 64, expert width 32, float32 and its codes): 1.5 of them reads one at a time
ONE = 1.5 * 3 * 64 * 32 * 5 / 2**30


@pytest.mark.slow
@pytest.mark.parametrize("grid", [NVFP4, MXFP4])
def test_streamed_experts_give_the_whole_layers_tensors(grid, moe_source, tmp_path):
    """The MoE layers' experts read one at a time (compressor.moe_stream_awq: each candidate's expert gate/up
    rounded in one call, their global scale their own set's) give the whole layer's tensors and AWQ ratios."""
    kw = dict(model=str(moe_source), recipe=[RECIPES[grid]], settings=(("awq.n_grid", 4),), calib_samples=4,
              calib_seqlen=48, threads=1)
    run_quantize(QuantizeOptions(output=tmp_path / "one", memory_budget_gib=ONE, **kw))
    run_quantize(QuantizeOptions(output=tmp_path / "whole", **kw))
    assert digests(tmp_path / "one") == digests(tmp_path / "whole")
    one, whole = (load_manifest(tmp_path / d).quality["layers"] for d in ("one", "whole"))
    assert one[1]["weight_groups"] == 5 and "weight_groups" not in whole[1]
    for i in (1, 2):
        assert one[i]["awq_ratios"] == whole[i]["awq_ratios"] and one[i]["modules"] == whole[i]["modules"]
    _check_artifact(tmp_path / "one", grid, "deepseek_v3")


@pytest.mark.slow  # starts processes
def test_two_ranks_write_the_single_process_artifact(moe_source, tmp_path):
    """Two ranks (the dense layer's searches dealt by grid ranges, the experts owned by halves) give the single
    process's NVFP4 AWQ artifact, digest by digest."""
    from rank_procs import ends, ranks

    args = ["--recipe", RECIPES[NVFP4], "--set", "awq.n_grid=4", "--calib-samples", "4", "--calib-seqlen", "48",
            "--threads", "1", "--json"]
    run_quantize(QuantizeOptions(model=str(moe_source), output=tmp_path / "one", recipe=[RECIPES[NVFP4]],
                                 settings=(("awq.n_grid", 4),), calib_samples=4, calib_seqlen=48, threads=1))
    got = ends(ranks(2, [moe_source, "-o", tmp_path / "two", *args]))
    assert [g[0] for g in got] == [0, 0], got
    assert digests(tmp_path / "two") == digests(tmp_path / "one")
