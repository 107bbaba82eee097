"""GPTQ and GPTAQ on the FP4 e2m1 grids (NVFP4, MXFP4; issue #49): each column rounded onto the format's
steps, fixed from the weights before any column is rounded, with GPTQ's error feedback.

The column step against the format's round-to-nearest (a diagonal Hessian feeds no error back, so GPTQ must
give RTN's codes bit for bit), the objective against RTN on correlated inputs, and the command line: tiny
Llama and DeepSeek-V3 rows quantized, read back by kvq's reader and compressed-tensors' decompressor, verified
and served; the combinations not implemented refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from compressor.quant import fp4, mxfp4
from compressor.quant.gptq import gptq_quantize

from conftest import assert_clean_error, decompress_as_kvq_reads, kvq_run, quantize_cli, verify_and_serve
from tiny_models import make_dir

GRIDS = {"nvfp4": (16, lambda w: fp4.group_steps(w)[0], lambda w: fp4.quantize_weight(w)[0]),
         "mxfp4": (32, lambda w: mxfp4.group_steps(w)[0], lambda w: mxfp4.quantize_weight(w)[0])}


def _weights(out: int = 48, cols: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, cols, generator=g) * torch.logspace(-1, 1, cols)[torch.randperm(cols, generator=g)]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("grid", list(GRIDS))
def test_a_diagonal_hessian_gives_the_formats_round_to_nearest(grid, act_order):
    """With ``H`` diagonal no error reaches another column: the codes are the format's RTN codes, exactly."""
    gs, steps, rtn = GRIDS[grid]
    w = _weights()
    H = torch.diag(torch.rand(w.shape[1], generator=torch.Generator().manual_seed(1)) + 0.5)
    r = gptq_quantize(w, H, 4, gs, True, act_order=act_order, e2m1_steps=steps(w))
    assert r.g_idx is None  # fixed steps: the groups stay contiguous whatever the visiting order
    assert torch.equal(r.q.to(torch.uint8), rtn(w))
    assert torch.equal(r.scale, steps(w))


@pytest.mark.parametrize("grid", list(GRIDS))
def test_error_feedback_lowers_the_output_error_below_rtn(grid):
    """On correlated inputs GPTQ's output error ``|X (W_hat - W)^T|`` is below RTN's on the same steps."""
    gs, steps, rtn = GRIDS[grid]
    w = _weights(seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1024, 16, generator=g) @ torch.randn(16, w.shape[1], generator=g) \
        + 0.1 * torch.randn(1024, w.shape[1], generator=g)
    r = gptq_quantize(w, 2 * x.t() @ x / x.shape[0], 4, gs, True, act_order=True, e2m1_steps=steps(w))
    n, k = w.shape
    step = steps(w).repeat_interleave(gs, dim=1)
    ours = fp4.e2m1_values(r.q.to(torch.uint8)) * step
    theirs = fp4.e2m1_values(rtn(w)) * step
    err = lambda wh: float((x @ (wh - w).t()).norm())  # noqa: E731
    assert err(ours) < 0.8 * err(theirs), (err(ours), err(theirs))


@pytest.mark.parametrize("recipe", ["w4a16-nvfp4", "w4a16-mxfp4"])
@pytest.mark.parametrize("row", ["llama", "deepseek_v3"])
def test_gptq_artifact_reads_back_verifies_and_serves(row, recipe, tmp_path, tokenizer, capsys):
    """``--algorithm gptq`` on the FP4 recipes: exit 0 (GPTAQ on the MLA row, with an fp8 KV cache), the manifest
    names GPTQ, every packed weight kvq's reader gives equals compressed-tensors' decompressor's, and verify and
    serve-smoke pass."""
    widths = (dict(hidden_size=128, intermediate_size=256) if row == "llama" else
              dict(hidden_size=128, q_lora_rank=64, kv_lora_rank=64, v_head_dim=32, moe_intermediate_size=64,
                   intermediate_size=128))
    src = make_dir(tmp_path / "m", tokenizer, row, **widths)
    extra = (["--set", "gptq.act_order=true"] if row == "llama"  # fixed steps: no g_idx, no actorder recorded
             else ["--set", "gptq.gptaq_alpha=0.25", "--recipe", "kv-fp8"])
    out = tmp_path / "art"
    quantize_cli(src, out, capsys, "--recipe", recipe, "--algorithm", "gptq", *extra)
    manifest = json.loads((out / "kvq-manifest.json").read_text())
    assert manifest["recipe"]["algorithm"] == "gptq"
    qc, _ = decompress_as_kvq_reads(out)
    assert qc["config_groups"]["group_0"]["weights"].get("actorder") is None
    # a random tiny model's greedy top-1 is argmax noise (tests/test_w4a8.py): serve-smoke's prompt KL gate stays
    verify_and_serve(out, capsys, 50 if recipe == "w4a16-nvfp4" else 25)


@pytest.mark.parametrize("change, words", [
    (["--algorithm", "awq-gptq", "--set", "gptq.clip=true"], "gptq.clip on the NVFP4 grid is not implemented"),
    (["--algorithm", "gptq", "--set", "gptq.clip=true"], "gptq.clip on the NVFP4 grid is not implemented"),
    (["--algorithm", "gptq", "--set", "refine.iters=10"], "the refine section on the NVFP4 grid is not implemented"),
])
def test_what_is_not_implemented_on_the_fp4_grid_is_refused(change, words, tmp_path, capsys, wide_llama):
    code, _, err = kvq_run(["quantize", wide_llama, "-o", tmp_path / "o", "--recipe", "w4a16-nvfp4", *change], capsys)
    assert_clean_error(code, err, 2, words, tmp_path)
