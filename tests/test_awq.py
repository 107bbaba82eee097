import pytest
import torch

from compressor.errors import QuantizationError
from compressor.quant.awq import candidate_scales, pick_scale, search_clip, search_scale_range, search_scales, weight_mean
from compressor.quant.awq_layer import grid_ranges
from compressor.quant.primitives import fake_quantize


def _outlier_problem(seed=0, n=2048, d_in=128, d_out=96):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    x[:, :4] *= 40.0  # a few salient input channels with large activations (AWQ, Fig. 2)
    w = torch.randn(d_out, d_in, generator=g) * 0.05
    return x, w


def test_awq_beats_rtn_on_outlier_channels():
    x, w = _outlier_problem()
    ref = x @ w.t()

    def loss_fn(cands):
        return (x @ cands[0].t() - ref).pow(2).mean()

    s, ratio, losses = search_scales(x.abs().mean(0), [w], loss_fn, 4, 32, False, n_grid=20)
    rtn_loss = float(loss_fn([fake_quantize(w, 4, 32, False)]))
    awq_loss = float(loss_fn([fake_quantize(w * s, 4, 32, False) / s]))
    # without duo scaling, ratio 0 gives s = 1: the first grid point is exactly RTN
    _, _, plain = search_scales(x.abs().mean(0), [w], loss_fn, 4, 32, False, n_grid=4, duo_scaling=False)
    assert plain[0] == rtn_loss
    assert ratio > 0
    assert awq_loss < 0.8 * rtn_loss


@pytest.mark.parametrize("parts", [2, 3, 7, 20, 25])
@pytest.mark.parametrize("losses_at", ["real", "tie", "nan-first", "one-finite"])
def test_a_grid_searched_in_ranges_picks_the_whole_grids_scales(parts, losses_at):
    # ranks search a group's grid in consecutive ranges (awq_layer._dealt_searches): the pick is the whole grid's
    x, w = _outlier_problem(seed=1, n=256)
    ref = x @ w.t()
    real = lambda c: (x @ c[0].t() - ref).pow(2).mean()  # noqa: E731
    fixed = {"tie": [3.0, 2.0, 5.0, 1.0, 4.0, 1.0] * 4,  # the first of two equal smallest losses is the choice
             "nan-first": [float("nan")] * 12 + [2.0, 1.0] * 4,
             "one-finite": [float("inf")] * 17 + [0.5, float("nan"), float("inf")]}.get(losses_at)
    at = {"i": 0}  # the grid index of the next candidate tried

    def loss_fn(cands):
        at["i"] += 1
        return real(cands) if fixed is None else torch.tensor(fixed[at["i"] - 1])

    args = (x.abs().mean(0), [w], loss_fn, 4, 32, False)
    s, ratio, losses = search_scales(*args, n_grid=20)
    ranges = grid_ranges(20, parts)
    assert [i for r in ranges for i in r] == list(range(20)) and all(len(r) for r in ranges)
    picks = []
    for r in ranges:
        at["i"] = r.start
        got, pick = search_scale_range(*args, r, n_grid=20)
        assert list(map(repr, got)) == list(map(repr, losses[r.start:r.stop]))
        picks.append(pick)
    s2, ratio2 = pick_scale(picks, "g")
    assert ratio2 == ratio and torch.equal(s2, s)
    if losses_at == "tie":
        assert ratio == 3 / 20
    if losses_at == "one-finite":
        assert ratio == 17 / 20


def test_a_grid_without_a_finite_loss_in_any_range_is_an_error():
    with pytest.raises(QuantizationError, match="no finite loss"):
        pick_scale([None, None], "layers.0.mlp")


def test_scales_finite_with_dead_channels_and_zero_weights():
    x_mean = torch.rand(64)
    x_mean[:8] = 0.0  # dead input channels
    w = torch.randn(32, 64)
    w[:, 8:16] = 0.0  # all-zero weight columns
    wm = weight_mean([w], 32)
    for ratio in (0.0, 0.5, 0.95):
        s = candidate_scales(x_mean, wm, ratio)
        assert torch.isfinite(s).all() and (s > 0).all()


def test_half_precision_statistics_stay_finite():
    x_mean = (torch.rand(64) * 60000).half()  # near fp16 max: squaring would overflow in half
    s = candidate_scales(x_mean, weight_mean([torch.randn(16, 64).half()], 32), 0.9)
    assert s.dtype == torch.float32 and torch.isfinite(s).all()


def test_clip_search_never_worse_than_no_clip():
    x, w = _outlier_problem(seed=1)
    w[:, 7] = 1.0  # an outlier weight column that clipping should tame
    clip = search_clip(w, x[:256], 4, 32, False, clip_grid=20, max_shrink=0.5)
    org_max = w.reshape(96, 4, 32).abs().amax(-1)
    assert clip.shape == (96, 4) and torch.all(clip <= org_max + 1e-6) and torch.all(clip >= 0.5 * org_max - 1e-6)
    from compressor.quant.rtn import rtn_quantize
    from compressor.quant.primitives import dequantize

    def err(cm):
        q, sc, zp = rtn_quantize(w, 4, 32, False, cm)
        return (x[:256] @ dequantize(q, sc, zp, 32).t() - x[:256] @ w.t()).pow(2).mean()

    assert err(clip) <= err(None) * 1.0001


def test_dead_channels_do_not_drive_the_scales():
    """A channel that never carries activation (x_mean == 0) gets scale 1 and is left out of
    the sqrt(max * min) normalisation: the live channels' scales are those of the model
    without it (issue #22: one Gemma (1 + w) = 0 channel drove the others to 47-303)."""
    from compressor.quant.awq import candidate_scales

    x = torch.tensor([0.5, 2.0, 0.0, 1.0])
    w = torch.tensor([0.3, 0.6, 0.4, 0.5])
    for ratio in (0.25, 0.5, 0.95):
        s = candidate_scales(x, w, ratio)
        live = candidate_scales(x[[0, 1, 3]], w[[0, 1, 3]], ratio)
        assert s[2] == 1 and torch.allclose(s[[0, 1, 3]], live)
        assert s.max() < 10


def test_awq_bf16_artifact_keeps_its_quality_with_a_zero_gemma_norm_channel(tmp_path, tokenizer):
    """Gemma-style (1 + w) norms with one channel at w = -1 in every folded norm: the bf16
    artifact's KL to the float model stays within 25 % of the float32 artifact's (it was
    3.5x worse before dead channels were left out of the scale normalisation)."""
    from tiny_models import tiny

    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize
    from compressor.artifact import load_artifact

    m = tiny("gemma3_text", 0, len(tokenizer))
    with torch.no_grad():
        for layer in m.model.layers:
            layer.input_layernorm.weight[3] = -1.0
            layer.pre_feedforward_layernorm.weight[5] = -1.0
    m.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    ids = torch.randint(1, 300, (4, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = m(ids).logits.float().log_softmax(-1)
    kl = {}
    for dt in ("float32", "bfloat16"):
        out = tmp_path / dt
        run_quantize(QuantizeOptions(model=str(tmp_path / "src"), output=out, recipe="w4a16-awq", group_size=32,
                                     calib_samples=16, calib_seqlen=64, dtype=dt))
        with torch.no_grad():
            lp = load_artifact(out)[0](ids).logits.float().log_softmax(-1)
        kl[dt] = float((ref.exp() * (ref - lp)).sum(-1).mean())
    assert kl["bfloat16"] <= 1.25 * kl["float32"], kl


def test_folded_norm_is_rounded_to_the_storage_dtype():
    """The live model holds the folded norm as the artifact stores it, so the recomputed
    outputs and the reported output error are those of the stored model (issue #22)."""
    from compressor.quant.awq_layer import fold_scales

    norm = torch.nn.LayerNorm(8, elementwise_affine=True, bias=False)
    torch.nn.init.uniform_(norm.weight, -0.9, 0.5)
    s = torch.linspace(0.5, 40.0, 8)
    exact = (norm.weight.detach().float() + 1) / s - 1
    fold_scales(norm, s, None, 1.0, torch.bfloat16)
    assert torch.equal(norm.weight.detach(), exact.to(torch.bfloat16).float())
    assert not torch.equal(norm.weight.detach(), exact)  # bf16 rounding did change it


def test_group_gram_gives_the_partial_output_error():
    """``Δ_g G_g Δ_gᵀ`` equals the mean squared partial output of group ``g`` (float64 reference)."""
    from compressor.quant.awq import group_grams

    x, w = _outlier_problem(seed=3, n=300)
    delta = fake_quantize(w, 4, 32, False) - w
    gram = group_grams(x, 32)
    assert gram.shape == (4, 32, 32)
    direct = torch.stack([((x[:, g * 32:(g + 1) * 32].double() @ delta[:, g * 32:(g + 1) * 32].double().t()) ** 2).mean(0)
                          for g in range(4)], 1)  # [out, G]
    dg = delta.reshape(96, 4, 32).permute(1, 0, 2)
    via_gram = torch.bmm(dg, gram).mul(dg).sum(-1).t()
    torch.testing.assert_close(via_gram.double(), direct, rtol=1e-4, atol=1e-9)


def test_clip_search_matches_a_direct_search():
    """The Gram-based clip search picks, per row and group, the threshold a direct float64
    search over the partial outputs picks (the reference implementation's objective)."""
    x, w = _outlier_problem(seed=4, n=512)
    clip = search_clip(w, x, 4, 32, False, clip_grid=20, max_shrink=0.5)
    from compressor.quant.primitives import fake_quantize_grouped

    wb = w.reshape(96, 4, 32)
    xg = x.double().reshape(-1, 4, 32).permute(1, 2, 0)
    ref = torch.bmm(wb.double().permute(1, 0, 2), xg)
    org = wb.abs().amax(-1, keepdim=True)
    errs, maxes = [], []
    for i in range(10):  # the candidates rounded in float32 as the search rounds them, scored in float64
        mv = org * (1 - i / 20)
        q = fake_quantize_grouped(torch.maximum(torch.minimum(wb, mv), -mv), 4, False).double()
        errs.append((torch.bmm(q.permute(1, 0, 2), xg) - ref).pow(2).mean(-1).t())
        maxes.append(mv.squeeze(-1))
    errs, maxes = torch.stack(errs), torch.stack(maxes)
    best = maxes.gather(0, errs.argmin(0, keepdim=True))[0].float()
    # near-ties (relative gap below 1e-5) may resolve either way in float32
    srt = errs.sort(0).values
    clear = (srt[1] - srt[0]) > 1e-5 * srt[0]
    assert clear.float().mean() > 0.9
    torch.testing.assert_close(clip[clear], best[clear])


def test_gram_loss_equals_the_forward_loss():
    """A lone linear's scale-search loss from ``xᵀx`` equals the forward loss (same candidates)."""
    import compressor.quant.algorithms  # noqa: F401  (registers the algorithms; awq_layer alone is a cycle)
    from compressor.quant.awq_layer import forward_loss, gram_loss, gram_worthwhile

    x, w = _outlier_problem(seed=5, n=512)
    lin = torch.nn.Linear(128, 96, bias=True)
    lin.weight.data.copy_(w)
    xb = x.reshape(4, 128, 128)
    cand = [fake_quantize(w, 4, 32, False)]
    fwd = forward_loss(lin, [lin], [w.clone()], [True], xb, {}, False)
    gram = gram_loss(xb, w.clone(), True)
    torch.testing.assert_close(float(gram(cand)), float(fwd(cand)), rtol=1e-4, atol=0)
    assert torch.equal(lin.weight.data, w)  # the forward loss puts the weight back
    assert float(gram_loss(xb, w, False)(cand)) == 0.0
    assert gram_worthwhile(lin, [lin], xb)  # 128 channels, 512 tokens
    assert not gram_worthwhile(lin, [lin], xb[:1])  # 128 tokens: the forward is cheaper
    assert not gram_worthwhile(lin, [lin, lin], xb)


def test_chunked_forward_loss_equals_the_whole_batch():
    """The MLP loss summed over token chunks equals the whole-batch mean."""
    import compressor.quant.algorithms  # noqa: F401
    from compressor.quant import awq_layer

    g = torch.Generator().manual_seed(6)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Linear(64, 32))
    x = torch.randn(6, 50, 32, generator=g)
    lins = [mlp[0]]
    w = mlp[0].weight.detach().clone()
    cand = [fake_quantize(w, 4, 32, False)]
    old = awq_layer.LOSS_CHUNK_TOKENS
    try:
        awq_layer.LOSS_CHUNK_TOKENS = 10 ** 9  # one chunk
        whole = awq_layer.forward_loss(mlp, lins, [w], [True], x, {}, False)(cand)
        awq_layer.LOSS_CHUNK_TOKENS = 100  # two sequences a chunk
        chunked = awq_layer.forward_loss(mlp, lins, [w], [True], x, {}, False)(cand)
    finally:
        awq_layer.LOSS_CHUNK_TOKENS = old
    mlp[0].weight.data.copy_(cand[0])
    with torch.no_grad():
        direct = mlp(x).double()  # the candidate's output
    mlp[0].weight.data.copy_(w)
    with torch.no_grad():
        expected = (direct - mlp(x).double()).pow(2).mean()
    torch.testing.assert_close(chunked.double(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(whole.double(), chunked.double(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("row", ["llama", "deepseek_v3", "qwen3_moe", "glm4_moe"])
def test_searches_run_at_once_where_no_earlier_fold_reaches_them(row, tmp_path, tokenizer, monkeypatch):
    """AWQ's scale searches cut into runs (search_waves: each run searched at once, then folded in
    order; under ranks the searches of a run are dealt) give the artifact of searching and folding
    one group at a time, tensor for tensor, on dense, MLA and MoE rows (MoE layers held whole);
    and the runs are not trivial: some run holds several groups."""
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize
    from compressor.quant import awq_layer
    from conftest import digests
    from tiny_models import ROW_FAST, make_dir

    src = make_dir(tmp_path / "src", tokenizer, row, num_hidden_layers=2)
    seen = []
    real = awq_layer.search_waves

    def spy(groups):
        waves = real(groups)
        seen.append([len(w) for w in waves])
        return waves

    monkeypatch.setattr(awq_layer, "search_waves", spy)
    run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "runs", algorithm="awq", threads=1, **ROW_FAST))
    monkeypatch.setattr(awq_layer, "search_waves", lambda groups: [[g] for g in groups])
    run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "one", algorithm="awq", threads=1, **ROW_FAST))
    assert digests(tmp_path / "runs") == digests(tmp_path / "one")
    assert any(max(w) > 1 for w in seen if w), seen


def test_a_search_waits_for_an_earlier_fold_it_reads():
    """A group inspected on a module an earlier group folds into starts a new run; one that reads
    nothing the run folds joins it."""
    from compressor.arch import ScalingGroup
    from compressor.quant.awq_layer import search_waves

    attn = ScalingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj"), "self_attn", True)
    v_o = ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj")
    mlp = ScalingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp")
    down = ScalingGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj")
    reads_up = ScalingGroup("mlp.gate_proj", ("mlp.up_proj",), "mlp.up_proj")  # reads up, which `mlp` folds
    assert search_waves([attn, v_o, mlp, down]) == [[attn, v_o, mlp, down]]
    assert search_waves([mlp, reads_up, down]) == [[mlp], [reads_up, down]]
    assert search_waves([v_o, attn]) == [[v_o], [attn]]  # attn's forward reads o_proj, which v_o folds
