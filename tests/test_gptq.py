"""GPTQ: the Hessian path, act-order / static groups, damping retry, dead channels, pipeline."""

import pytest
import torch

from compressor.errors import QuantizationError
from compressor.pipeline import quantize_model
from compressor.quant.gptq import HessianAccumulator, gptq_quantize
from compressor.quant.primitives import dequantize, fake_quantize
from compressor.recipe import load_recipe, with_overrides

from conftest import gptq_recipe
from tiny_models import tiny_llama


def _correlated_inputs(n=4096, d=128, rank=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, rank, generator=g) @ torch.randn(rank, d, generator=g)
    x += 0.05 * torch.randn(n, d, generator=g)
    x[:, :3] *= 8  # a few outlier channels, as real activations have
    return x


def _hessian(x):
    acc = HessianAccumulator(x.shape[1])
    for chunk in x.split(1000):
        acc.add(chunk)
    return acc.hessian()


def _out_err(x, w, w_hat):
    return float(((x @ w_hat.t() - x @ w.t()) ** 2).mean())


def test_hessian_accumulator_matches_definition():
    x = torch.randn(3, 50, 16)
    H = _hessian(x.reshape(-1, 16))
    xf = x.reshape(-1, 16).double()
    torch.testing.assert_close(H.double(), 2 * xf.t() @ xf / 150, rtol=1e-5, atol=1e-5)
    with pytest.raises(QuantizationError, match="no calibration tokens"):
        HessianAccumulator(4).hessian()


@pytest.mark.parametrize("bits,gs,sym", [(4, 32, False), (4, -1, True), (3, 64, False), (2, 32, False), (8, 128, True)])
def test_gptq_output_error_below_rtn(bits, gs, sym):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    x = _correlated_inputs()
    H = _hessian(x)
    r = gptq_quantize(w, H, bits, gs, sym)
    w_hat = dequantize(r.q, r.scale, None if sym else r.zero_point, gs)
    rtn = fake_quantize(w, bits, gs, sym)
    assert r.q.dtype == torch.int8 and r.g_idx is None and r.retries == 0
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    assert int(r.q.min()) >= lo and int(r.q.max()) <= hi
    assert _out_err(x, w, w_hat) < 0.7 * _out_err(x, w, rtn)
    assert r.loss > 0


def test_act_order_dynamic_groups_give_g_idx():
    torch.manual_seed(1)
    w = torch.randn(64, 128) * 0.05
    x = _correlated_inputs()
    H = _hessian(x)
    r = gptq_quantize(w, H, 4, 32, False, act_order=True)
    assert r.g_idx is not None and r.g_idx.dtype == torch.int32 and r.g_idx.shape == (128,)
    # every group holds exactly group_size columns, and the highest-diag(H) columns come first
    assert torch.bincount(r.g_idx.long()).tolist() == [32] * 4
    top = torch.argsort(torch.diag(H), descending=True)[:32]
    assert set(r.g_idx[top].tolist()) == {0}
    w_hat = dequantize(r.q, r.scale, r.zero_point, 32, g_idx=r.g_idx)
    assert _out_err(x, w, w_hat) < 0.7 * _out_err(x, w, fake_quantize(w, 4, 32, False))


def test_act_order_static_groups_keep_contiguous_groups():
    torch.manual_seed(2)
    w = torch.randn(64, 128) * 0.05
    x = _correlated_inputs()
    H = _hessian(x)
    r = gptq_quantize(w, H, 4, 32, False, act_order=True, static_groups=True)
    assert r.g_idx is None  # group boundaries survived the reordering
    # static qparams are the min-max qparams of the original weight's groups
    from compressor.quant.primitives import compute_qparams

    s0, z0 = compute_qparams(w, 4, 32, False)
    torch.testing.assert_close(r.scale, s0)
    assert torch.equal(r.zero_point, z0)
    w_hat = dequantize(r.q, r.scale, r.zero_point, 32)
    assert _out_err(x, w, w_hat) < _out_err(x, w, fake_quantize(w, 4, 32, False))


def test_damping_retry_is_reported():
    torch.manual_seed(3)
    w = torch.randn(16, 32)
    H = torch.eye(32)
    H[0, 0] = -0.05  # indefinite: the first damping (0.01 * mean diag) cannot fix it
    r = gptq_quantize(w, H, 4, -1, True, damp=0.01, damp_increment=0.1, max_damp=1.0)
    assert r.retries > 0 and r.damp > 0.01
    with pytest.raises(QuantizationError, match="not positive definite even with damping"):
        gptq_quantize(w, -torch.eye(32), 4, -1, True, max_damp=0.5, name="layer.x")
    H_nan = torch.eye(32)
    H_nan[1, 2] = float("nan")
    with pytest.raises(QuantizationError, match="NaN or Inf"):
        gptq_quantize(w, H_nan, 4, -1, True)


def test_dead_input_channels_are_zeroed():
    torch.manual_seed(4)
    w = torch.randn(16, 64)
    x = torch.randn(512, 64)
    x[:, 5] = 0.0
    r = gptq_quantize(w, _hessian(x), 4, 32, True)
    assert r.dead_channels == 1
    w_hat = dequantize(r.q, r.scale, None, 32)
    assert torch.all(w_hat[:, 5] == 0)


def test_scales_rounded_to_storage_dtype_during_search():
    torch.manual_seed(5)
    w = torch.randn(32, 64) * 0.01
    r = gptq_quantize(w, _hessian(_correlated_inputs(d=64)), 4, 32, False, scale_dtype=torch.float16)
    assert torch.equal(r.scale, r.scale.half().float())


@pytest.mark.parametrize("true_sequential,act_order,static", [(True, True, True), (False, False, False), (True, True, False)])
def test_pipeline_gptq_beats_rtn(true_sequential, act_order, static):
    ref_model = tiny_llama()
    ids = torch.randint(0, 320, (8, 48), generator=torch.Generator().manual_seed(1))
    ref = torch.log_softmax(ref_model(ids).logits, -1)

    def kl(m):
        out = torch.log_softmax(m(ids).logits, -1)
        return float(torch.nn.functional.kl_div(out, ref, log_target=True, reduction="batchmean"))

    m_rtn = tiny_llama()
    quantize_model(m_rtn, gptq_recipe(algorithm="rtn"), None)
    m = tiny_llama()
    recipe = gptq_recipe(**{"gptq.true_sequential": true_sequential, "gptq.act_order": act_order,
                             "gptq.static_groups": static})
    res = quantize_model(m, recipe, ids, batch_size=4, matmul_precision="float32")  # the figure below is exact
    assert len(res.modules) == 14
    assert all(f["gptq"]["damp_retries"] == 0 and f["output_rel_error"] > 0 for f in res.layers)
    assert set(res.layers[0]["phase_seconds"]) == {"reference", "hessian", "gptq", "recompute"}
    # layer 0's output error (float reference on the first REF_SEQUENCES = 2 sequences) equals
    # the error of the full models' layer-0 hidden states on those sequences
    with torch.no_grad():
        f0 = ref_model(ids[:2], output_hidden_states=True).hidden_states[1]
        q0 = m(ids[:2], output_hidden_states=True).hidden_states[1]
    assert res.layers[0]["output_rel_error"] == pytest.approx(float((q0 - f0).norm() / f0.norm()), rel=1e-4)
    dynamic = act_order and not static
    assert all((r.g_idx is not None) == dynamic for r in res.modules.values())
    # the in-memory model holds exactly what the records dequantize to
    r = res.modules["model.layers.1.mlp.down_proj"]
    torch.testing.assert_close(m.model.layers[1].mlp.down_proj.weight,
                               dequantize(r.q, r.scale, r.zero_point, r.group_size, g_idx=r.g_idx))
    # no hook left behind
    assert all(not mod._forward_pre_hooks for mod in m.modules())
    assert kl(m) < kl(m_rtn)


def test_mixed_precision_schemes_and_fused_check():
    from compressor.errors import InputError

    ids = torch.randint(0, 320, (4, 32))
    res = quantize_model(tiny_llama(), with_overrides(load_recipe("w4a16-mixed"), **{"weights.group_size": 32}), ids,
                         batch_size=4)
    down = res.modules["model.layers.0.mlp.down_proj"]
    assert down.scheme[:3] == (8, -1, True) and down.zero_point is None
    assert res.modules["model.layers.0.mlp.up_proj"].scheme[:3] == (4, 32, False)
    assert res.layers[0]["num_bits"] == [4, 8]
    bad = with_overrides(load_recipe("w4a16-mixed"), overrides=[{"targets": ["re:.*k_proj"], "weights": {"num_bits": 8}}])
    with pytest.raises(InputError, match="fused into one kernel by vLLM and must share"):
        quantize_model(tiny_llama(), bad, ids)
    partial = with_overrides(load_recipe("w4a16-rtn-g64"), ignore=["re:.*gate_proj"], **{"weights.group_size": 32})
    with pytest.raises(InputError, match="quantize all of them or none"):
        quantize_model(tiny_llama(), partial, None)


@pytest.mark.parametrize("width", [300, "wide"])
def test_hessians_sum_their_upper_block_triangle(width):
    """The rows are summed in blocks, each holding only its columns from the diagonal on (the
    upper block triangle; inputs at least ROW_BLOCK_FROM wide in ROW_BLOCK rows, narrower ones in
    SYMMETRIC_BLOCKS blocks): the same symmetric Hessian as one product, to float32 rounding,
    and with ``consume`` the same values block by block."""
    from compressor.quant import gptq as g

    d = g.ROW_BLOCK_FROM + 70 if width == "wide" else width
    x = torch.randn(2, 8 if width == "wide" else 200, d, generator=torch.Generator().manual_seed(0))
    x[..., :3] *= 8
    acc = HessianAccumulator(d)
    assert len(acc.blocks) == (5 if width == "wide" else 3)
    assert [tuple(b.shape) for b in acc.blocks] == [(min(acc.starts[1], d - r0), d - r0) for r0 in acc.starts]
    acc.add(x[0])
    acc.add(x[1])
    flat = x.reshape(-1, x.shape[-1]).double()
    ref = (2.0 * flat.t() @ flat / flat.shape[0]).float()
    H = acc.hessian()
    assert torch.equal(H, H.t())
    assert torch.allclose(H, ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(H, acc.hessian(consume=True))  # in place: the same values
    assert acc.blocks is None


@pytest.mark.parametrize("act_order", [False, True])
def test_consuming_the_hessian_gives_the_same_result(act_order):
    """``consume_hessian`` works in the Hessian's storage (no copy): bit-identical output."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=g)
    H = _hessian(_correlated_inputs(d=64))
    keep = H.clone()
    a = gptq_quantize(w, H, 4, 32, False, act_order=act_order, static_groups=act_order)
    assert torch.equal(H, keep)  # not modified without consume_hessian
    b = gptq_quantize(w, H, 4, 32, False, act_order=act_order, static_groups=act_order, consume_hessian=True)
    for f in ("q", "scale", "zero_point"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert a.loss == b.loss and a.damp == b.damp


# --- the range search (gptq.clip): each group's range scored by its block of H -------------

def _full_rank_inputs(n=4096, d=128, seed=0):
    """Correlated inputs of full rank with outlier channels (as a transformer's linear sees).
    On the low-rank inputs above GPTQ's error feedback cancels most of any group's error, and
    a range chosen for the group's error alone is no better than min-max."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) @ (0.1 * torch.randn(d, d, generator=g) + torch.eye(d))
    x[:, :4] *= 10
    return x


def _group_errors(w, w_hat, H, gs):
    d = (w_hat - w).reshape(w.shape[0], -1, gs)
    blocks = torch.stack([H[g:g + gs, g:g + gs] for g in range(0, w.shape[1], gs)])
    return torch.einsum("ogi,gij,ogj->og", d, blocks, d)


@pytest.mark.parametrize("sym", [False, True])
def test_search_qparams_never_worse_than_min_max_per_group(sym):
    from compressor.quant.primitives import compute_qparams, quantize, search_qparams

    torch.manual_seed(7)
    w = torch.randn(48, 128) * 0.05
    w[torch.rand_like(w) < 0.02] *= 6  # outliers: where clipping pays
    H = _hessian(_full_rank_inputs())
    blocks = torch.stack([H[g:g + 32, g:g + 32] for g in range(0, 128, 32)])
    s0, z0 = compute_qparams(w, 3, 32, sym)
    s1, z1 = search_qparams(w, 3, 32, sym, blocks, grid=50, max_shrink=0.3)
    assert s1.shape == s0.shape == (48, 4) and z1.dtype == torch.int8
    if sym:
        assert not z1.any()
    deq0 = dequantize(quantize(w, s0, z0, 3, 32), s0, None if sym else z0, 32)
    deq1 = dequantize(quantize(w, s1, z1, 3, 32), s1, None if sym else z1, 32)
    e0, e1 = _group_errors(w, deq0, H, 32), _group_errors(w, deq1, H, 32)
    assert (e1 <= e0 * (1 + 1e-5) + 1e-9).all()  # p = 1 (min-max) is a candidate
    assert float(e1.sum()) < 0.8 * float(e0.sum())  # and shrinking pays on outlier groups
    assert (s1 <= s0 * (1 + 1e-6)).all()  # it only ever shrinks the range
    # one candidate (max_shrink below one step) is min-max itself, in the storage dtype too
    s2, z2 = search_qparams(w, 3, 32, sym, blocks, grid=50, max_shrink=0.01)
    torch.testing.assert_close(s2, s0)
    assert torch.equal(z2, z0)
    # with bfloat16 scales: the stored min-max scale, and each group's error at most min-max's
    # (the zero point may be refitted to the stored scale where that lowers the error)
    s3, z3 = search_qparams(w, 3, 32, sym, blocks, grid=50, max_shrink=0.01, scale_dtype=torch.bfloat16)
    sb = s0.bfloat16().float()
    assert torch.equal(s3, sb)
    e_mm = _group_errors(w, dequantize(quantize(w, sb, z0, 3, 32), sb, None if sym else z0, 32), H, 32)
    e3 = _group_errors(w, dequantize(quantize(w, s3, z3, 3, 32), s3, None if sym else z3, 32), H, 32)
    assert (e3 <= e_mm * (1 + 1e-6) + 1e-12).all()


@pytest.mark.parametrize("static", [True, False])
def test_gptq_with_a_single_candidate_search_is_gptq(static):
    """clip with only p = 1 searched gives GPTQ's own artifact (float32 scales, asymmetric: the
    refitted zero point is min-max's, and ties keep min-max)."""
    torch.manual_seed(9)
    w = torch.randn(64, 128) * 0.05
    H = _hessian(_full_rank_inputs())
    kw = dict(act_order=True, static_groups=static, scale_dtype=torch.float32)
    a = gptq_quantize(w, H, 3, 32, False, **kw)
    b = gptq_quantize(w, H, 3, 32, False, clip_grid=100, clip_max_shrink=0.001, **kw)
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)


def test_search_qparams_without_hessian_is_plain_weight_error_and_rounds_scales():
    from compressor.quant.primitives import search_qparams

    torch.manual_seed(3)
    w = torch.randn(16, 64)
    w[:, 0] = 40.0  # one huge column: unweighted, clipping it trades much error elsewhere
    s, z = search_qparams(w, 4, 64, False, None, grid=20, max_shrink=0.5, scale_dtype=torch.bfloat16)
    assert torch.equal(s, s.bfloat16().float())
    # weighted by a diagonal that ignores column 0, the search clips it hard
    hd = torch.ones(1, 64)
    hd[0, 0] = 0.0
    s_w, _ = search_qparams(w, 4, 64, False, hd, grid=20, max_shrink=0.5)
    assert (s_w < s).all()


@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("act_order,static", [(True, True), (True, False), (False, False)])
def test_gptq_range_search_lowers_output_error(bits, act_order, static):
    torch.manual_seed(11)
    w = torch.randn(96, 128) * 0.05
    w[torch.rand_like(w) < 0.01] *= 8
    x = _full_rank_inputs()
    H = _hessian(x)
    errs = {}
    for clip in (None, 100):
        r = gptq_quantize(w, H, bits, 32, False, act_order=act_order, static_groups=static, clip_grid=clip)
        assert (r.g_idx is not None) == (act_order and not static)
        errs[clip] = _out_err(x, w, dequantize(r.q, r.scale, r.zero_point, 32, g_idx=r.g_idx))
    assert errs[100] < 0.97 * errs[None]


def test_per_channel_range_search_uses_the_diagonal():
    torch.manual_seed(2)
    w = torch.randn(64, 256) * 0.05
    w[torch.rand_like(w) < 0.01] *= 10
    x = _full_rank_inputs(d=256)
    H = _hessian(x)
    base = gptq_quantize(w, H, 4, -1, True)
    r = gptq_quantize(w, H, 4, -1, True, clip_grid=100)
    assert r.scale.shape == (64, 1) and (r.scale <= base.scale * (1 + 1e-6)).all()
    assert _out_err(x, w, dequantize(r.q, r.scale, None, -1)) < _out_err(x, w, dequantize(base.q, base.scale, None, -1))


def test_recipe_clip_is_left_out_of_dumps_while_off():
    from compressor.recipe import FULL_DUMP, apply_settings

    r = load_recipe("w4a16-gptq")
    assert "clip" not in r.model_dump()["gptq"]  # digests of recipes without the search unchanged
    assert r.model_dump(context=FULL_DUMP)["gptq"]["clip"] is False
    on = apply_settings(r, {"gptq.clip": True})
    assert on.model_dump()["gptq"]["clip"] is True and on.model_dump()["gptq"]["clip_grid"] == 100
    # a knob set away from its default is kept even with the search off (it says what was asked)
    assert apply_settings(r, {"gptq.clip_max_shrink": 0.4}).model_dump()["gptq"]["clip_max_shrink"] == 0.4
    from compressor.errors import InputError

    for key, bad in (("gptq.clip_grid", True), ("gptq.clip_max_shrink", float("nan")), ("gptq.clip_max_shrink", 1.5),
                     ("gptq.block_size", True), ("gptq.block_size", 64.5)):
        with pytest.raises(InputError, match=key):
            apply_settings(r, {key: bad})
    # pairs apply in order: a key given twice, the last wins
    assert apply_settings(r, [("gptq.damp", 0.05), ("gptq.clip", True), ("gptq.damp", 0.02)]).gptq.damp == 0.02


def test_gptq_settings_under_an_algorithm_without_gptq_are_said_to_do_nothing():
    """``--set gptq.clip=true`` on an RTN or AWQ recipe is recorded but changes nothing: a warning
    says so; the algorithms that read the section, and a default section, say nothing."""
    from compressor.quant.algorithms import get_algorithm
    from compressor.recipe import apply_settings

    rtn = apply_settings(load_recipe("w4a16-rtn-g64"), {"gptq.clip": True, "gptq.damp": 0.05})
    for name in ("rtn", "awq", "none"):
        w = [x for x in get_algorithm(name).flag_warnings({}, rtn, "compressed-tensors") if "gptq settings" in x]
        assert w == [f"the recipe's gptq settings (damp, clip) have no effect with algorithm {name} "
                     "(gptq and awq-gptq read them)"]
    for name in ("gptq", "awq-gptq"):
        assert not any("gptq settings" in x for x in get_algorithm(name).flag_warnings({}, rtn, "compressed-tensors"))
    assert not any("gptq settings" in x for x in get_algorithm("rtn").flag_warnings(
        {}, load_recipe("w4a16-rtn-g64"), "compressed-tensors"))
    # the awq section likewise: changed under gptq, rtn or none (the awq-gptq recipe's n_grid and loss_samples under gptq)
    ag = load_recipe("w4a16-awq-gptq")
    for name in ("gptq", "rtn", "none"):
        w = [x for x in get_algorithm(name).flag_warnings({}, ag, "compressed-tensors") if "awq settings" in x]
        assert w == [f"the recipe's awq settings (n_grid, loss_samples) have no effect with algorithm {name} "
                     "(awq and awq-gptq read them)"]
    for name in ("awq", "awq-gptq"):
        assert not any("awq settings" in x for x in get_algorithm(name).flag_warnings({}, ag, "compressed-tensors"))
    assert not any("settings" in x for x in get_algorithm("awq-gptq").flag_warnings({}, ag, "compressed-tensors"))
    # --act-order under rtn: one warning (the flag's), not a second one for the setting it made
    w = get_algorithm("rtn").flag_warnings({"act_order": True}, apply_settings(load_recipe("w4a16-rtn-g64"),
                                                                              {"gptq.act_order": True}), "compressed-tensors")
    assert w == ["--act-order/--no-act-order has no effect with algorithm rtn (GPTQ only)"]


def test_manifest_quantization_block_names_the_range_search():
    """The summary (``--json``, manifest ``quantization``) shows the range search when it is on,
    and nothing new when it is off (earlier manifests keep their bytes)."""
    from compressor.quant.algorithms import get_algorithm
    from compressor.recipe import apply_settings

    r = load_recipe("w4a16-gptq")
    for name in ("gptq", "awq-gptq"):
        assert "clip" not in get_algorithm(name).summary_fields(r, "compressed-tensors")
        on = get_algorithm(name).summary_fields(apply_settings(r, {"gptq.clip": True, "gptq.clip_grid": 50}), "gptq")
        assert (on["clip"], on["clip_grid"], on["clip_max_shrink"]) == (True, 50, 0.25) and "gptq_checkpoint_format" in on


def test_float_target_is_the_least_squares_weight_for_the_float_outputs():
    """``alpha = 1`` gives ``argmin_W' ‖W X_f - W' X_q‖`` (GPTAQ's target), ``alpha = 0`` W itself,
    and the accumulator's matrix is ``2 (X_f - X_q)ᵀ X_q / n`` summed over batches."""
    from compressor.quant.gptq import CrossAccumulator, float_target

    torch.manual_seed(0)
    xq = torch.randn(512, 24, dtype=torch.float64)
    xf = xq + 0.1 * torch.randn(512, 24, dtype=torch.float64)
    w = torch.randn(16, 24)
    acc, hacc = CrossAccumulator(24), HessianAccumulator(24)
    for a, b in ((xf[:200], xq[:200]), (xf[200:], xq[200:])):
        acc.add(a, b)
        hacc.add(b)
    cross, H = acc.matrix(), hacc.hessian()
    torch.testing.assert_close(cross, (2 * (xf - xq).t() @ xq / 512).float(), rtol=1e-5, atol=1e-6)
    best = torch.linalg.lstsq(xq, xf @ w.double().t()).solution.t()  # W' with W' X_q closest to W X_f
    torch.testing.assert_close(float_target(w, H, cross, 1.0, 1e-9).double(), best, rtol=1e-3, atol=1e-4)
    assert torch.equal(float_target(w, H, cross, 0.0, 0.01), w)
    half = float_target(w, H, cross, 0.5, 1e-9)
    torch.testing.assert_close(half, (w + float_target(w, H, cross, 1.0, 1e-9)) / 2, rtol=1e-5, atol=1e-5)
    with pytest.raises(QuantizationError):
        CrossAccumulator(4).matrix()


def test_pipeline_gptaq_alpha_moves_only_what_the_float_stream_changes():
    """With ``gptq.gptaq_alpha``: layer 0's q/k/v see the same inputs in both streams (codes
    unchanged); layers after it are quantized towards the float model's outputs (codes change);
    the float stream's phase is timed; the recipe's dump names the setting only when it is on
    (a recipe without it digests as before); bad values are refused naming the key."""
    from compressor.errors import InputError
    from compressor.recipe import apply_settings

    ids = torch.randint(0, 320, (8, 48), generator=torch.Generator().manual_seed(1))
    base = gptq_recipe()
    assert "gptaq_alpha" not in base.model_dump()["gptq"]
    on = apply_settings(base, {"gptq.gptaq_alpha": 0.25})
    assert on.model_dump()["gptq"]["gptaq_alpha"] == 0.25
    m0, m1 = tiny_llama(), tiny_llama()
    r0 = quantize_model(m0, base, ids, batch_size=4, matmul_precision="float32")
    r1 = quantize_model(m1, on, ids, batch_size=4, matmul_precision="float32")
    for n in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(r0.modules[f"model.layers.0.self_attn.{n}"].q, r1.modules[f"model.layers.0.self_attn.{n}"].q)
    assert not torch.equal(r0.modules["model.layers.0.self_attn.o_proj"].q, r1.modules["model.layers.0.self_attn.o_proj"].q)
    assert not torch.equal(r0.modules["model.layers.1.self_attn.q_proj"].q, r1.modules["model.layers.1.self_attn.q_proj"].q)
    assert "float_stream" in r1.layers[1]["phase_seconds"] and "float_stream" not in r0.layers[1]["phase_seconds"]
    assert all(not mod._forward_pre_hooks for mod in m1.modules())
    for bad in (1.5, -0.1, True, float("nan")):  # a YAML true is not a number (nor for any float knob)
        with pytest.raises(InputError, match="gptq.gptaq_alpha"):
            apply_settings(base, {"gptq.gptaq_alpha": bad})
    with pytest.raises(InputError, match="gptq.damp"):
        apply_settings(base, {"gptq.damp": True})


@pytest.mark.parametrize("act_order, static, sym, clip", [(True, True, True, None), (True, False, False, 4),
                                                          (False, False, True, None)])
def test_a_slice_of_rows_is_quantized_as_in_the_whole_solve(act_order, static, sym, clip):
    """GPTQ treats every row on its own given H, so the ranks may solve a lone linear in slices
    of rows (compressor.quant.gptq_layer.row_slices): each slice's integers, scales, zero points,
    g_idx and kept target equal those rows of the whole solve, bit for bit, and joined back
    (join_slices) they are the whole result."""
    from compressor.quant.gptq_layer import join_slices, row_slices

    torch.manual_seed(3)
    x = torch.randn(512, 256) * torch.rand(256) * 3
    H = (x.double().T @ x.double()).float() * (2 / 512)
    w = torch.randn(97, 256) * 0.02

    def solve(rows):
        return gptq_quantize(w[rows[0]:rows[1]], H, 4, 64, sym, act_order=act_order, static_groups=static,
                             clip_grid=clip, keep_target=True)

    whole = solve((0, 97))
    pieces = row_slices([(("o_proj",), "o_proj")], 2, lambda rel: 97)
    assert [p[2] for p in pieces] == [(0, 48), (48, 97)]
    results = [([(r.q, r.scale, r.zero_point, r.g_idx, r.target)], r.damp, r.retries, r.dead_channels)
               for r in (solve(p[2]) for p in pieces)]
    (joined,), damp, _retries, _dead = join_slices(pieces, results)[0]
    for got, want in zip(joined, (whole.q, whole.scale, whole.zero_point, whole.g_idx, whole.target)):
        assert (got is None and want is None) or torch.equal(got, want)
    assert damp == whole.damp
    # every linear of a pass in slices (one factor per set, divided), unless a routed expert's
    # among as many tasks as ranks, or a linear too short to halve: solved whole
    two = [(("a",), "a"), (("b",), "b")]
    assert [p[2] for p in row_slices(two, 2, lambda rel: 97)] == [(0, 48), (48, 97)] * 2
    assert [p[2] for p in row_slices(two, 2, lambda rel: 97, lambda rel: rel == "b")] == [(0, 48), (48, 97), None]
    assert [p[2] for p in row_slices(two[1:], 2, lambda rel: 97, lambda rel: rel == "b")] == [(0, 48), (48, 97)]
    assert [p[2] for p in row_slices([(("a",), "a")], 2, lambda rel: 3)] == [None]
    assert [p[2] for p in row_slices([(("a",), "a")], 1, lambda rel: 97)] == [None]


@pytest.mark.parametrize("act_order, static, clip", [(True, True, 4), (True, False, 4), (False, False, None)])
def test_a_hessians_factor_reused_by_another_linear_gives_its_own_solve(act_order, static, clip):
    """Two linears reading the same input (a routed expert's gate and up, solved one by one, or
    the head's blocks of rows) share the Hessian's factor (gptq.HessianFactor): the second solve
    reuses it -- without reading H, here replaced by zeros -- and gives what its own
    factorization does, bit for bit; settings the factor depends on (group size) are not mixed."""
    torch.manual_seed(5)
    x = torch.randn(512, 256) * torch.rand(256) * 3
    x[:, 7] = 0  # a dead input channel
    H = (x.double().T @ x.double()).float() * (2 / 512)
    gate, up = torch.randn(40, 256) * 0.02, torch.randn(24, 256) * 0.02
    kw = dict(act_order=act_order, static_groups=static, clip_grid=clip, keep_target=True)
    factors: dict = {}
    gptq_quantize(gate, H, 4, 64, True, factors=factors, **kw)
    assert len(factors) == 1
    shared = gptq_quantize(up, torch.zeros_like(H), 4, 64, True, factors=factors, **kw)
    own = gptq_quantize(up, H, 4, 64, True, **kw)
    for k in ("q", "scale", "zero_point", "g_idx", "target"):
        a, b = getattr(shared, k), getattr(own, k)
        assert (a is None and b is None) or torch.equal(a, b), k
    assert (shared.damp, shared.retries, shared.dead_channels) == (own.damp, own.retries, own.dead_channels) == (
        own.damp, own.retries, 1)
    other = gptq_quantize(up, H, 4, 32, True, factors=factors, **kw)  # another group size: its own factor
    assert len(factors) == 2 and torch.equal(other.q, gptq_quantize(up, H, 4, 32, True, **kw).q)
