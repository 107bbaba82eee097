import pytest
import torch

from compressor.errors import InputError
from compressor.formats import get_format
from compressor.pipeline import quantize_model
from compressor.recipe import load_recipe, resolve_group_size, with_overrides

from tiny_models import tiny_llama


def _recipe(alg, **kw):
    over = {"algorithm": alg, "weights.group_size": 32, "awq.loss_samples": 4, **kw}
    return with_overrides(load_recipe("w4a16-awq"), **over)


def test_sequential_awq_better_than_rtn_and_modules_complete():
    ref_model = tiny_llama()
    ids = torch.randint(0, 320, (8, 48), generator=torch.Generator().manual_seed(1))
    ref = torch.log_softmax(ref_model(ids).logits, -1)
    kls = {}
    for alg in ("rtn", "awq"):
        m = tiny_llama()
        res = quantize_model(m, _recipe(alg), ids, batch_size=4)
        assert len(res.modules) == 2 * 7
        assert all(f["mean_rel_error"] > 0 for f in res.layers)
        out = torch.log_softmax(m(ids).logits, -1)
        kls[alg] = float(torch.nn.functional.kl_div(out, ref, log_target=True, reduction="batchmean"))
        for name, r in res.modules.items():
            assert r.q.dtype == torch.int8 and r.zero_point is not None and r.g_idx is None
            assert r.scheme[:3] == (4, 32, False) and r.scale.dtype == torch.float16
    assert kls["awq"] < kls["rtn"]


def test_awq_preserves_float_function_before_quantization():
    """With 8-bit weights the AWQ-folded model is (nearly) the float model: folding is exact."""
    ref_model = tiny_llama()
    ids = torch.randint(0, 320, (4, 32))
    m = tiny_llama()
    quantize_model(m, _recipe("awq", **{"weights.num_bits": 8}), ids, batch_size=4)
    torch.testing.assert_close(m(ids).logits, ref_model(ids).logits, atol=0.05, rtol=0.05)


def test_awq_needs_calibration_and_ignore_list():
    with pytest.raises(InputError, match="calibration"):
        quantize_model(tiny_llama(), _recipe("awq"), None)
    r = _recipe("rtn", ignore=["re:.*mlp\\.down_proj"])
    res = quantize_model(tiny_llama(), r, None)
    assert len(res.modules) == 2 * 6 and not any("down_proj" in n for n in res.modules)
    with pytest.raises(InputError, match="exclude every linear"):
        quantize_model(tiny_llama(), _recipe("rtn", ignore=["re:.*"]), None)


def test_group_size_refused_before_work_with_suggestion():
    m = tiny_llama(hidden_size=96, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(InputError, match=r"group_size 64 does not divide .*use --group-size 32"):
        quantize_model(m, _recipe("rtn", **{"weights.group_size": 64}), None)
    assert resolve_group_size(_recipe("rtn", **{"weights.group_size": "auto"}), {"a": 576, "b": 1536}) == 64


def test_nan_in_source_is_refused():
    m = tiny_llama()
    with torch.no_grad():
        m.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(InputError, match="model.layers.1.mlp.up_proj.weight"):
        quantize_model(m, _recipe("rtn"), None)


def test_unsupported_architecture_lists_supported():
    m = tiny_llama()
    m.config.model_type = "gpt2"
    with pytest.raises(InputError, match="unsupported architecture 'gpt2'; supported: .*llama"):
        quantize_model(m, _recipe("rtn"), None)


@pytest.mark.parametrize("bits,gs,sym", [(2, 32, False), (3, 64, True), (8, -1, True)])
def test_bit_widths_and_groups(bits, gs, sym):
    m = tiny_llama()
    res = quantize_model(m, _recipe("rtn", **{"weights.num_bits": bits, "weights.group_size": gs, "weights.symmetric": sym}), None)
    t = get_format("compressed-tensors").pack_all(res.modules, torch.float16)["model.layers.0.mlp.down_proj"]
    n_groups = 1 if gs == -1 else 128 // gs
    assert t["weight_scale"].shape == (64, n_groups)
    assert t["weight_packed"].shape == (64, -(-128 * bits // 32))
    assert ("weight_zero_point" in t) == (not sym)


def test_algorithm_registry_and_unknown_name():
    from compressor.quant.algorithms import algorithm_names, find_algorithm, get_algorithm

    assert algorithm_names() == ["awq", "awq-gptq", "gptq", "none", "rtn"]
    names = ("rtn", "awq", "gptq", "awq-gptq", "none")
    assert [get_algorithm(n).needs_calibration for n in names] == [False, True, True, True, False]
    assert [get_algorithm(n).folds_input_scales for n in names] == [False, True, False, True, False]
    assert not get_algorithm("none").quantizes_weights and find_algorithm("unknown") is None
    with pytest.raises(InputError, match=r"unknown algorithm 'smoothquant' \(choose from awq, awq-gptq, gptq, none, rtn\)"):
        get_algorithm("smoothquant")


def test_algorithm_summary_fields():
    from compressor.quant.algorithms import get_algorithm

    r = _recipe("gptq", **{"gptq.act_order": True, "weights.symmetric": False})
    assert get_algorithm("gptq").summary_fields(r, "gptq") == {
        "act_order": True, "static_groups": False, "gptq_checkpoint_format": "gptq_v2"}
    assert list(get_algorithm("gptq").summary_fields(r, "compressed-tensors")) == ["act_order", "static_groups"]
    assert get_algorithm("none").summary_fields(r, "compressed-tensors") == {"num_bits": None, "group_size": None, "symmetric": None}
    assert get_algorithm("awq").summary_fields(r, "awq") == {} == get_algorithm("rtn").summary_fields(r, "gptq")


def test_algorithm_flag_warnings():
    from compressor.quant.algorithms import get_algorithm

    flags = {"bits": 3, "group_size": None, "symmetric": None, "act_order": False}
    # the awq section at its defaults: a changed one under rtn/gptq/none earns its own warning (test_gptq)
    r3 = _recipe("rtn", **{"weights.num_bits": 3, "awq.loss_samples": 8})
    odd = ("3-bit weights: vLLM's compressed-tensors WNA16 kernels serve 4 and 8 bits only; "
           "kvq verify, kvq serve and kvq serve-smoke read this artifact")
    assert get_algorithm("rtn").flag_warnings(flags, r3, "compressed-tensors") == [
        "--act-order/--no-act-order has no effect with algorithm rtn (GPTQ only)", odd]
    assert get_algorithm("gptq").flag_warnings(flags, r3, "compressed-tensors") == [odd]
    assert get_algorithm("gptq").flag_warnings(flags, r3, "gptq") == []
    assert get_algorithm("none").flag_warnings(flags, r3, "compressed-tensors") == [
        "--bits/--group-size/--symmetric have no effect: the recipe keeps weights in float (algorithm none)",
        "--act-order/--no-act-order has no effect with algorithm none (GPTQ only)"]
    assert get_algorithm("awq").flag_warnings(dict.fromkeys(flags), _recipe("awq"), "compressed-tensors") == []


def test_a_3bit_artifact_is_read_by_the_readers_its_warning_names(tmp_path, tiny_model_dir, capsys):
    """The odd-bit warning names kvq verify, kvq serve and kvq serve-smoke (not transformers, whose
    compressed-tensors loader refuses asymmetric zero points): verify's loader and the runtime that
    serve and serve-smoke run read a 3-bit asymmetric artifact to the same logits, and serve-smoke
    passes on it."""
    import json

    from conftest import kvq_run

    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize
    from compressor.artifact import load_artifact
    from compressor.runtime.generate import Runtime

    out = tmp_path / "w3"
    s = run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, recipe="w4a16-rtn-g64", bits=3,
                                     group_size=32))
    odd = [w for w in s["warnings"] if w.startswith("3-bit weights")]
    assert len(odd) == 1 and "transformers" not in odd[0]
    assert s["quantization"]["num_bits"] == 3 and s["quantization"]["symmetric"] is False
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    ours, _ = load_artifact(out)  # kvq verify's reader
    served = Runtime.from_artifact(out, kv=None, dtype=torch.float32, backend="dequant")  # kvq serve's / serve-smoke's
    with torch.no_grad():
        torch.testing.assert_close(served.logits(ids), ours(ids).logits, rtol=1e-5, atol=1e-5)
    code, stdout, err = kvq_run(["serve-smoke", out, "--max-new-tokens", "4", "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["comparison"]["top1_agreement_pct"] >= 70
