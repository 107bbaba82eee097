"""``--matmul-precision``: the calibration pass's CPU matmuls in bfloat16 (explicit casts and oneDNN), GPTQ's solve
always in float32, the choice resolved, recorded and refused where it does not apply."""

from __future__ import annotations

import json

import pytest
import torch

from compressor import precision
from compressor.errors import InputError
from compressor.precision import (calibration_matmuls, cpu_has_bf16_matmul, float32_matmuls, flags_have_bf16,
                                  resolve_matmul_precision)
from conftest import assert_clean_error, kvq_run as run

SETTING = torch.backends.mkldnn.matmul


def test_cpu_flags_are_read_from_cpuinfo():
    amx = "processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile\n"
    avx = "flags\t\t: fpu avx512f avx512_bf16\n"
    plain = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"
    assert flags_have_bf16(amx) and flags_have_bf16(avx)
    assert not flags_have_bf16(plain) and not flags_have_bf16("") and not flags_have_bf16("model name: x\n")


@pytest.mark.parametrize("has_bf16,device,choice,expected", [
    (True, "cpu", "auto", "bfloat16"), (False, "cpu", "auto", "float32"),
    (True, "cuda", "auto", "float32"), (False, "cpu", "bfloat16", "bfloat16"),
    (True, "cpu", "float32", "float32"), (True, "cuda", "float32", "float32"),
])
def test_auto_is_bfloat16_only_on_a_cpu_that_multiplies_it(monkeypatch, has_bf16, device, choice, expected):
    monkeypatch.setattr(precision, "cpu_has_bf16_matmul", lambda: has_bf16)
    assert resolve_matmul_precision(choice, device) == expected


def test_bfloat16_on_cuda_and_unknown_choices_are_refused():
    with pytest.raises(InputError, match="CPU setting"):
        resolve_matmul_precision("bfloat16", "cuda")
    with pytest.raises(InputError, match="unknown matmul precision 'fp16'"):
        resolve_matmul_precision("fp16", "cpu")


def test_contexts_set_and_restore_onednn_precision():
    before = SETTING.fp32_precision
    with calibration_matmuls("bfloat16"):
        assert SETTING.fp32_precision == "bf16"
        with float32_matmuls():
            assert SETTING.fp32_precision == "ieee"
        assert SETTING.fp32_precision == "bf16"
    assert SETTING.fp32_precision == before
    with pytest.raises(RuntimeError):
        with calibration_matmuls("bfloat16"):
            raise RuntimeError("boom")
    assert SETTING.fp32_precision == before  # restored on error too
    with calibration_matmuls("float32"):
        assert SETTING.fp32_precision == "ieee"


def test_bfloat16_linears_are_one_bfloat16_matmul_and_float32_elsewhere():
    """Inside a bfloat16 pass an ``nn.Linear`` on float32 CPU rows is exactly the bfloat16 product of
    the rounded input and weight (bias added in float32); under ``float32``, inside GPTQ's
    ``float32_matmuls``, on too few rows and after the pass it is the IEEE one. In another thread
    it is not the explicit cast: the IEEE product where oneDNN ignores its process-wide bfloat16
    setting (an EPYC without AMX), the setting's product where it honours it (AMX)."""
    import threading

    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 40)
    x = torch.randn(3, 50, 96)
    exact = torch.nn.functional.linear(x, lin.weight, lin.bias)
    with precision._mkldnn_fp32_precision("bf16"):
        by_setting = torch.nn.functional.linear(x, lin.weight, lin.bias)  # == exact where oneDNN ignores it
    rounded = (torch.nn.functional.linear(x.bfloat16(), lin.weight.bfloat16()).float() + lin.bias)
    assert not torch.equal(exact, rounded)
    other = []
    with calibration_matmuls("bfloat16"):
        assert torch.equal(lin(x), rounded)
        small = torch.randn(precision.MIN_ROWS - 1, 96)
        assert torch.equal(lin(small), torch.nn.functional.linear(small, lin.weight, lin.bias))
        with float32_matmuls():
            assert torch.equal(lin(x), exact)
        assert torch.equal(lin(x), rounded)
        t = threading.Thread(target=lambda: other.append(lin(x)))
        t.start()
        t.join()
    assert torch.equal(other[0], by_setting) and not torch.equal(other[0], rounded)
    with calibration_matmuls("float32"):
        assert torch.equal(lin(x), exact)
    assert torch.equal(lin(x), exact) and torch.nn.Linear.forward is precision._LINEAR_FORWARD
    with pytest.raises(RuntimeError):
        with calibration_matmuls("bfloat16"):
            raise RuntimeError("boom")
    assert torch.nn.Linear.forward is precision._LINEAR_FORWARD and not precision.bf16_active()


def test_gptq_solve_runs_in_float32_inside_a_bfloat16_calibration(monkeypatch):
    from compressor.quant import gptq

    seen = []
    columns = gptq._quantize_columns

    def spy(*a, **k):
        seen.append(SETTING.fp32_precision)
        return columns(*a, **k)

    monkeypatch.setattr(gptq, "_quantize_columns", spy)
    torch.manual_seed(0)
    X = torch.randn(512, 64)
    H, W = 2 * X.t() @ X / 512, torch.randn(32, 64)
    ref = gptq.gptq_quantize(W, H, 4, 32, False, act_order=True)
    with calibration_matmuls("bfloat16"):
        got = gptq.gptq_quantize(W, H, 4, 32, False, act_order=True)
        assert SETTING.fp32_precision == "bf16"
    assert seen == ["ieee", "ieee"]
    assert torch.equal(ref.q, got.q) and torch.equal(ref.scale, got.scale)


def test_quantize_model_runs_the_calibration_forwards_at_the_given_precision(tokenizer):
    from compressor.pipeline import quantize_model
    from compressor.recipe import load_recipes
    from conftest import tiny_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(vocab_size=len(tokenizer))).eval()
    seen = set()
    for layer in model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda m, a: seen.add(SETTING.fp32_precision))
    recipe = load_recipes(["w4a16-gptq"]).model_copy(deep=True)
    recipe.weights.group_size = 32
    before = SETTING.fp32_precision
    quantize_model(model, recipe, torch.randint(0, len(tokenizer), (4, 32)), matmul_precision="bfloat16")
    assert seen == {"bf16"}
    assert SETTING.fp32_precision == before
    # and the linears' explicit bfloat16 products: the same run with the casts undone differs
    torch.manual_seed(0)
    twin = LlamaForCausalLM(tiny_config(vocab_size=len(tokenizer))).eval()
    ids = torch.randint(0, len(tokenizer), (4, 32))
    quantize_model(twin, recipe, ids, matmul_precision="bfloat16")
    torch.manual_seed(0)
    twin2 = LlamaForCausalLM(tiny_config(vocab_size=len(tokenizer))).eval()
    quantize_model(twin2, recipe, ids, matmul_precision="float32")
    assert any(not torch.equal(p, q) for p, q in zip(twin.state_dict().values(), twin2.state_dict().values()))


def test_cli_records_the_precision_and_refuses_bfloat16_on_cuda(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "a"
    code, stdout, err = run(["quantize", tiny_model_dir, "-o", out, "--recipe", "w4a16-gptq", "--group-size", "32",
                             "--calib-samples", "4", "--calib-seqlen", "32", "--matmul-precision", "float32",
                             "--json"], capsys)
    assert code in (0, None), err
    assert json.loads(stdout)["matmul_precision"] == "float32"
    assert json.loads((out / "kvq-manifest.json").read_text())["provenance"]["matmul_precision"] == "float32"
    code, _, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "b", "--matmul-precision", "fp16"], capsys)
    assert code == 2 and "fp16" in err and "Traceback" not in err
    if not torch.cuda.is_available():  # --device cuda is refused first without a GPU: the API meets the check
        from compressor.commands.options import QuantizeOptions
        from compressor.commands.quantize import run_quantize

        with pytest.raises(InputError, match="CPU setting"):
            run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=tmp_path / "c", device="cuda",
                                         matmul_precision="bfloat16", calib_samples=4, calib_seqlen=32))
        assert not (tmp_path / "c").exists()
    code, _, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "d", "--device", "cuda",
                        "--matmul-precision", "bfloat16"], capsys)
    assert_clean_error(code, err, 2, "cuda" if not torch.cuda.is_available() else "CPU setting")


def test_threads_are_applied_recorded_and_restored(tmp_path, tiny_model_dir, capsys):
    before = torch.get_num_threads()
    out = tmp_path / "t"
    code, stdout, err = run(["quantize", tiny_model_dir, "-o", out, "--algorithm", "rtn", "--group-size", "32",
                             "--threads", "1", "--json"], capsys)
    assert code in (0, None), err
    assert json.loads(stdout)["threads"] == 1 and json.loads(stdout)["busy_note"] is None  # --threads given: no note
    assert json.loads((out / "kvq-manifest.json").read_text())["provenance"]["threads"] == 1
    assert torch.get_num_threads() == before  # an in-process caller keeps its own setting
    code, _, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "u", "--threads", "0"], capsys)
    assert code == 2 and "--threads" in err and "Traceback" not in err


def test_a_busy_machine_earns_a_note_unless_threads_are_given(monkeypatch):
    import os

    from compressor.commands.common import cpu_threads

    before = torch.get_num_threads()
    monkeypatch.setattr("compressor.safetensors_io.default_workers", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr("compressor.commands.common.runnable_now", lambda: 3)
    monkeypatch.setattr(os, "getloadavg", lambda: (4.3, 3.0, 2.0))
    threads, note = cpu_threads(None)
    assert threads == 2 and "busy (load 4.3 on 2 CPUs)" in note and "--threads 1" in note
    monkeypatch.setattr(os, "getloadavg", lambda: (1.92, 1.0, 1.0))  # two busy loops on 2 CPUs, as measured
    assert "busy (load 1.9 on 2 CPUs)" in cpu_threads(None)[1]
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 1.0, 1.0))
    assert cpu_threads(None) == (2, None)  # one other job on 2 CPUs: no note
    monkeypatch.setattr(os, "getloadavg", lambda: (4.3, 3.0, 2.0))
    monkeypatch.setattr("compressor.commands.common.runnable_now", lambda: 1)
    assert cpu_threads(None) == (2, None)  # a high average, but only this thread runs now: a job that just ended
    monkeypatch.setattr("compressor.commands.common.runnable_now", lambda: None)
    assert "busy (load 4.3" in cpu_threads(None)[1]  # unknown: the average alone
    monkeypatch.undo()
    assert cpu_threads(before)[1] is None and torch.get_num_threads() == before


def test_more_threads_than_cpus_earn_a_note(monkeypatch):
    """``--threads 999`` on 2 CPUs: accepted, but said (the extra threads only wait for each other)."""
    from compressor.commands.common import cpu_threads, threads_restored

    monkeypatch.setattr("compressor.safetensors_io.default_workers", lambda: 2)
    with threads_restored():
        assert "--threads 3 is more than the 2 usable CPUs" in cpu_threads(3)[1]
        assert cpu_threads(2)[1] is None and cpu_threads(1)[1] is None


def test_the_busy_note_reaches_the_json_summary(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """CI runs use --json, where console notes have no channel: the summary carries the note."""
    import os

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
        monkeypatch.setattr("compressor.commands.common.runnable_now", lambda: 9)
        code, stdout, err = run(["quantize", tiny_model_dir, "-o", tmp_path / "b", "--algorithm", "rtn",
                                 "--group-size", "32", "--json"], capsys)
        assert code in (0, None), err
        assert "the machine is busy (load 9.0" in json.loads(stdout)["busy_note"]
    finally:
        torch.set_num_threads(before)
