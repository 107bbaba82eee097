"""The block-wise refinement of GPTQ's result (recipe section ``refine``, compressor.quant.refine;
the bundled ``w4a16-best`` / ``w3a16-best``): its start is GPTQ's integers, the calibration loss it
records never grows, dense and MoE layers (whole or streamed), and artifacts that verify."""

from __future__ import annotations

import json

import pytest
import torch

from compressor.commands.options import QuantizeOptions
from compressor.commands.quantize import run_quantize
from compressor.manifest import load_manifest
from compressor.pipeline import quantize_model
from compressor.quant import refine
from compressor.quant.gptq import gptq_quantize
from compressor.recipe import apply_settings, load_recipe

from conftest import kvq_run
from tiny_models import ROW_FAST, make_published, tiny_llama

#: a few steps on 4 of the 8 calibration sequences: enough to move, fast on the CPU
FEW = {"weights.group_size": 32, "refine.iters": 12, "refine.batch": 4, "refine.lr": 0.02}


def _ids(n=8, seed=1):
    return torch.randint(0, 320, (n, 48), generator=torch.Generator().manual_seed(seed))


def _best(name="w4a16-best", **kw):
    return apply_settings(load_recipe(name), {**FEW, **kw})


def _checked(layers):
    """Every layer's ``refine`` entry: losses that never grow, GPTQ kept exactly when nothing improved."""
    entries = [f["refine"] for f in layers]
    for e in entries:
        assert e["loss_end"] <= e["loss_start"], e
        assert (e["kept"] == "refined") == (e["loss_end"] < e["loss_start"]), e
        assert e["kept"] == "gptq" or e["best_iter"] > 0, e
    return entries


@pytest.mark.parametrize("act_order,static,sym", [(True, True, False), (True, False, False), (False, False, True)])
def test_the_first_iterate_is_gptqs_rounding(act_order, static, sym):
    """``v = 0`` with range factors 1 on GPTQ's rounded weights (``keep_target``) gives GPTQ's
    integers, scales and zero points exactly, with act-order (its g_idx too) and without; and
    keeping the rounded weights changes nothing GPTQ returns."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g) @ torch.randn(16, 128, generator=g) + 0.1 * torch.randn(512, 128, generator=g)
    H = 2 * x.t() @ x / x.shape[0]
    w = torch.randn(48, 128, generator=g) * 0.02
    kw = dict(act_order=act_order, static_groups=static, scale_dtype=torch.float16, clip_grid=20)
    r = gptq_quantize(w, H, 4, 32, sym, keep_target=True, **kw)
    plain = gptq_quantize(w, H, 4, 32, sym, **kw)
    assert plain.target is None and torch.equal(plain.q, r.q) and torch.equal(plain.scale, r.scale)
    assert (r.g_idx is not None) == (act_order and not static)
    gi = r.g_idx.long() if r.g_idx is not None else torch.arange(128) // 32
    s0 = r.scale.float()
    p = refine._Linear("w", "w", r.target, w, s0, torch.zeros_like(s0) if sym else r.zero_point.float(), gi,
                       r.g_idx, 32, 4, sym, torch.zeros_like(w), torch.ones_like(s0), torch.ones_like(s0))
    deq, q, s, z = p.grid(torch.float16)
    assert torch.equal(q.to(torch.int8), r.q) and torch.equal(s, s0)
    assert sym or torch.equal(z.to(torch.int8), r.zero_point)
    assert not torch.equal(r.target, w)  # GPTQ's feedback moved the weights it rounded


def test_tiny_llama_refined_never_worse_and_better_than_gptaq():
    """w4a16-best on a tiny Llama: each layer records its calibration loss before and after; it
    never grows, at least one layer improves, the in-memory weights are what the records
    dequantize to, and the model's KL to the float model is below w4a16-gptaq's."""
    ids = _ids()
    ref_model = tiny_llama()
    ref = torch.log_softmax(ref_model(ids).logits, -1)

    def kl(m):
        return float(torch.nn.functional.kl_div(torch.log_softmax(m(ids).logits, -1), ref, log_target=True,
                                                reduction="batchmean"))

    m_gptaq, m_best = tiny_llama(), tiny_llama()
    quantize_model(m_gptaq, apply_settings(load_recipe("w4a16-gptaq"), {"weights.group_size": 32}), ids,
                   batch_size=4, matmul_precision="float32")
    res = quantize_model(m_best, _best(), ids, batch_size=4, matmul_precision="float32")
    entries = _checked(res.layers)
    assert any(e["kept"] == "refined" for e in entries), entries
    assert all(e["modules"] == 7 and e["iters"] == 12 and "note" not in e for e in entries)
    assert all("refine" in f["phase_seconds"] for f in res.layers)
    from compressor.quant.primitives import dequantize
    for name, r in res.modules.items():
        torch.testing.assert_close(m_best.get_submodule(name).weight,
                                   dequantize(r.q, r.scale, r.zero_point, r.group_size, g_idx=r.g_idx))
    assert all(p.requires_grad is False and p.grad is None for p in m_best.parameters())
    assert kl(m_best) < kl(m_gptaq)


def test_one_step_is_gptaq_and_a_worse_candidate_is_refused(monkeypatch):
    """refine.iters 1: the only iterate is GPTQ's start, so the artifact's tensors are w4a16-gptaq's.
    A candidate that scores worse on the whole calibration set than the start is refused: the layer
    keeps GPTQ's records and weights, and records loss_end == loss_start."""
    ids = _ids()
    gptaq = quantize_model(tiny_llama(), apply_settings(load_recipe("w4a16-gptaq"), {"weights.group_size": 32}), ids,
                           batch_size=4, matmul_precision="float32")
    one = quantize_model(tiny_llama(), _best(**{"refine.iters": 1}), ids, batch_size=4, matmul_precision="float32")
    assert [f["refine"]["kept"] for f in one.layers] == ["gptq", "gptq"]
    for name, r in gptaq.modules.items():
        o = one.modules[name]
        assert torch.equal(r.q, o.q) and torch.equal(r.scale, o.scale) and torch.equal(r.zero_point, o.zero_point)

    real = refine._descend

    def spoiled(*args):  # the best iterate turned into noise: every weight one step up
        best, ratio, _step = real(*args)
        return [((q.int() + 1).clamp(max=7).to(torch.int8), s, z) for q, s, z in best], ratio, 5

    monkeypatch.setattr(refine, "_descend", spoiled)
    m = tiny_llama()
    res = quantize_model(m, _best(), ids, batch_size=4, matmul_precision="float32")
    for f in res.layers:
        e = f["refine"]
        assert e["kept"] == "gptq" and e["loss_end"] == e["loss_start"] and e["best_iter"] == 0, e
    from compressor.quant.primitives import dequantize
    for name, r in res.modules.items():
        torch.testing.assert_close(m.get_submodule(name).weight,
                                   dequantize(r.q, r.scale, r.zero_point, r.group_size, g_idx=r.g_idx))


def test_recipes_name_their_refinement_and_gptaq_is_unchanged():
    """The two bundled recipes: group 64, asymmetric, gptaq's GPTQ settings plus ``refine``; the
    section is left out of dumps while null (w4a16-gptaq digests as before), ``--set refine.iters``
    creates it, bad values are refused naming the key, and an algorithm that does not read it says so."""
    from compressor.errors import InputError
    from compressor.quant.algorithms import get_algorithm

    gptaq = load_recipe("w4a16-gptaq")
    assert "refine" not in gptaq.model_dump()
    for name, bits in (("w4a16-best", 4), ("w3a16-best", 3)):
        r = load_recipe(name)
        assert (r.weights.num_bits, r.weights.group_size, r.weights.symmetric) == (bits, 64, False)
        assert r.gptq == gptaq.gptq and r.algorithm == "gptq"
        assert (r.refine.iters, r.refine.lr, r.refine.range_lr, r.refine.batch) == (200, None, None, 8)
        assert get_algorithm("gptq").summary_fields(r, "compressed-tensors")["refine"]["iters"] == 200
    assert apply_settings(gptaq, {"refine.iters": 5}).refine.iters == 5
    for bad in ({"refine.iters": 0}, {"refine.lr": -1.0}, {"refine.batch": True}):
        with pytest.raises(InputError, match=next(iter(bad))):
            apply_settings(gptaq, bad)
    awq_gptq = apply_settings(gptaq, {"algorithm": "awq-gptq", "refine.iters": 5})
    warned = get_algorithm("awq-gptq").flag_warnings({}, awq_gptq, "compressed-tensors")
    assert any("refine section has no effect with algorithm awq-gptq" in w for w in warned), warned
    assert "refine" not in get_algorithm("awq-gptq").summary_fields(awq_gptq, "compressed-tensors")


@pytest.fixture(scope="module")
def moe_src(tmp_path_factory, tokenizer):
    return make_published(tmp_path_factory.mktemp("refine-moe") / "m", tokenizer, "deepseek_v3", num_hidden_layers=2)


#: one routed expert's bytes (float32 + int8 codes, hidden 64, moe_intermediate 32): a budget of 1.5 of them
#: reads the experts of an MoE layer in groups (tests/test_moe_stream.py)
ONE_EXPERT_GIB = 1.5 * 3 * 64 * 32 * 5 / 2**30


@pytest.mark.parametrize("budget", [4.0, ONE_EXPERT_GIB], ids=["whole", "streamed"])
def test_moe_layer_refined_whole_or_non_expert_part_streamed(moe_src, tmp_path, budget):
    """A tiny DeepSeek-V3 (dense layer 0, MoE layer 1): the MoE layer's loss never grows. Held whole,
    its experts are refined with the rest (more modules than its non-expert part); streamed (experts
    read in groups), its non-expert linears are, against the layer's output without its routed part,
    and the manifest's entry says so."""
    out = tmp_path / "a"
    run_quantize(QuantizeOptions(model=str(moe_src), output=out, memory_budget_gib=budget, recipe=["w4a16-best"],
                                 settings=tuple(FEW.items()), **ROW_FAST))
    layers = load_manifest(out).quality["layers"]
    entries = _checked(layers)
    streamed = budget < 1
    assert ("weight_groups" in layers[1]) == streamed
    note = entries[1].get("note", "")
    assert ("non-expert linears only" in note) == streamed
    assert "note" not in entries[0]
    n_expert_linears = 4 * 3
    assert (entries[1]["modules"] > n_expert_linears) == (not streamed), entries[1]


def test_quantize_then_verify_exits_0(tmp_path, tiny_model_dir, capsys):
    """A w4a16-best artifact of the tiny Llama loads and verifies as any other (exit 0); its
    manifest names the refinement in the quantization block and each layer's quality entry."""
    out = tmp_path / "best"
    code, _, err = kvq_run(["quantize", tiny_model_dir, "-o", out, "--recipe", "w4a16-best", "--calib-samples", "4",
                            "--calib-seqlen", "32", "--group-size", "32", "--set", "refine.iters=4",
                            "--set", "refine.batch=2"], capsys)
    assert code == 0, err
    man = load_manifest(out)
    assert man.quantization["refine"]["iters"] == 4
    _checked(man.quality["layers"])
    code, out_json, err = kvq_run(["verify", out, "--seqlen", "64", "--max-windows", "2", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out_json)["passed"]
