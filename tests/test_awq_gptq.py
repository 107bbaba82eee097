"""``algorithm: awq-gptq``: AWQ's folded scales, then GPTQ (compressor/quant/awq_gptq_layer.py)."""

import json

import torch

from compressor.pipeline import quantize_model
from conftest import kvq_run
from compressor.quant.primitives import dequantize
from conftest import gptq_recipe
from tiny_models import tiny_llama

IDS = torch.randint(0, 320, (8, 48), generator=torch.Generator().manual_seed(1))


def _kl(m, ref):
    with torch.no_grad():
        out = torch.log_softmax(m(IDS).logits, -1)
    return float(torch.nn.functional.kl_div(out, ref, log_target=True, reduction="batchmean"))


def test_unit_scales_give_exactly_gptq():
    """With one grid point and no duo scaling AWQ's scales are all 1: the folds change nothing
    and the result is GPTQ's, integer for integer (float32 storage: a folded norm is not rounded)."""
    plain = quantize_model(tiny_llama(), gptq_recipe(), IDS, batch_size=4, dtype=torch.float32)
    both = quantize_model(tiny_llama(),
                          gptq_recipe(algorithm="awq-gptq", **{"awq.n_grid": 1, "awq.duo_scaling": False}),
                          IDS, batch_size=4, dtype=torch.float32)
    assert plain.modules.keys() == both.modules.keys()
    for name, r in plain.modules.items():
        o = both.modules[name]
        assert torch.equal(r.q, o.q) and torch.equal(r.scale, o.scale), name


def test_scales_are_folded_then_gptq_rounds():
    ref_model = tiny_llama()
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(IDS).logits, -1)
    rtn = tiny_llama()
    quantize_model(rtn, gptq_recipe(algorithm="rtn"), None)
    m = tiny_llama()
    res = quantize_model(m, gptq_recipe(algorithm="awq-gptq"), IDS, batch_size=4)
    assert len(res.modules) == 14
    layer = res.layers[0]
    assert layer["awq_ratios"] and layer["gptq"]["damp_retries"] == 0
    assert {"observe", "scale_search", "hessian", "gptq"} <= set(layer["phase_seconds"])
    # AWQ folded its scales into the norms (the float function is the same, the weights are not)
    assert not torch.equal(m.model.layers[0].input_layernorm.weight, ref_model.model.layers[0].input_layernorm.weight)
    # the live model holds what the records dequantize to (GPTQ's integers of the folded weights)
    r = res.modules["model.layers.1.mlp.down_proj"]
    torch.testing.assert_close(m.model.layers[1].mlp.down_proj.weight,
                               dequantize(r.q, r.scale, r.zero_point, r.group_size, g_idx=r.g_idx))
    assert _kl(m, ref) < _kl(rtn, ref)


def test_artifact_records_gptq_actorder_and_loads(tmp_path, tiny_model_dir, capsys):
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize
    from compressor.artifact import load_artifact

    out = tmp_path / "art"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, recipe="w4a16-gptq", algorithm="awq-gptq",
                                 group_size=32, calib_samples=4, calib_seqlen=32))
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    manifest = json.loads((out / "kvq-manifest.json").read_text())
    assert manifest["quantization"]["algorithm"] == "awq-gptq"
    assert manifest["quantization"]["act_order"] is True
    model, _ = load_artifact(out)
    with torch.no_grad():
        assert torch.isfinite(model(IDS[:, :16]).logits).all()
    # verify undoes the folded scales, as for AWQ: the weight SQNR is that of 4-bit rounding
    code, text, _ = kvq_run(["verify", out, "--reference", tiny_model_dir, "--weights-only", "--json"], capsys)
    weights = json.loads(text)["weights"]
    assert code == 0 and weights["awq_scales_undone"] and weights["min_sqnr_db"] > 10


def test_bundled_recipe_runs_awq_gptq_with_its_grid(tmp_path, tiny_model_dir):
    """``--recipe w4a16-awq-gptq``: the algorithm and the 10-point scale grid come from the
    recipe, and the float reference is AWQ's (GPTQ's passes do not run a batch to the end for it)."""
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize

    out = tmp_path / "art"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, recipe="w4a16-awq-gptq",
                                 group_size=32, calib_samples=4, calib_seqlen=32))
    manifest = json.loads((out / "kvq-manifest.json").read_text())
    assert manifest["quantization"]["algorithm"] == "awq-gptq"
    assert manifest["recipe"]["awq"]["n_grid"] == 10
    layers = manifest["quality"]["layers"]
    assert layers and all(len(x["awq_ratios"]) >= 2 for x in layers)
    assert all(0 <= r < 1 and round(r * 10, 6) == round(r * 10) for x in layers for r in x["awq_ratios"].values())
    assert all(x["output_rel_error"] > 0 for x in layers)
    assert {x["output_error_sequences"] for x in layers} == {4}  # the recipe's awq.loss_samples


def test_the_layer_table_says_what_the_output_error_compares(tmp_path, tiny_model_dir):
    """Each calibrated layer records how many sequences its output error compares (GPTQ: the 2 of
    its float reference); the table's caption says so, and says what '-' means without a calibration pass."""
    from rich.console import Console

    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize
    from compressor.console import layer_table

    out = tmp_path / "g"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, algorithm="gptq", group_size=32,
                                 calib_samples=4, calib_seqlen=32))
    layers = [{**x, "seconds": 0.0} for x in json.loads((out / "kvq-manifest.json").read_text())["quality"]["layers"]]
    assert {x["output_error_sequences"] for x in layers} == {2}
    con = Console(record=True, width=200)
    layer_table(con, layers)
    assert "on the first 2 calibration sequence(s)" in " ".join(con.export_text().split())
    rtn = [{**x, "output_rel_error": None, "output_error_sequences": None} for x in layers]
    con = Console(record=True, width=200)
    layer_table(con, rtn)
    assert "not measured (this algorithm runs no float reference layer" in " ".join(con.export_text().split())


def test_gptq_takes_the_float_reference_it_is_given(monkeypatch):
    """``gptq_layer(float_out=...)`` keeps the caller's float output; plain GPTQ runs the float
    layer once on the first ``REF_SEQUENCES`` sequences for it (not a whole calibration batch)."""
    from compressor.quant import gptq_layer as gl

    rows = []  # rows of every decoder-layer forward gptq_layer runs
    real = gl.layer_forward
    monkeypatch.setattr(gl, "layer_forward", lambda layer, h, kw, *a: (rows.append(h.shape[0]), real(layer, h, kw, *a))[1])
    quantize_model(tiny_llama(), gptq_recipe(algorithm="awq-gptq"), IDS, batch_size=4)
    assert rows and set(rows) == {4}  # calibration batches only: AWQ's observe pass gave the reference
    rows.clear()
    quantize_model(tiny_llama(), gptq_recipe(), IDS, batch_size=4)
    assert gl.REF_SEQUENCES == 2 and rows.count(2) == len(tiny_llama().model.layers)  # once a layer
