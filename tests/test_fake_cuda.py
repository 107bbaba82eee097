"""kvq's ``--device cuda`` paths on a CUDA device faked on the CPU (tests/fake_cuda.py).

The first real GPU run (2026-12-04, an H200) failed every ``kvq quantize --device cuda``
(AWQ's clip search, the KV scale search, the MoE routed-token counts kept CPU tensors beside
CUDA ones) and the Triton step of the GPU check (the W4 packing shifts): CI had run the
CUDA paths' code only with every tensor on the CPU. Here the same code runs with "cuda"
tensors that refuse a CPU operand as a GPU does, and each artifact is compared with the
CPU run's, tensor digest for tensor digest.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from compressor.commands.options import QuantizeOptions
from compressor.commands.quantize import run_quantize

from conftest import digests, make_model_dir
from fake_cuda import FakeCudaTensor, fake_cuda, reference_triton_kernels
from tiny_models import make_published, to_block_fp8

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

FAST = dict(group_size=32, kv_scheme="fp8", calib_samples=4, calib_seqlen=48, seed=0)
ROWS = ("llama", "kimi_k2", "glm4_moe", "glm_moe_dsa")


def test_the_fake_device_refuses_what_a_gpu_refuses(monkeypatch):
    """The harness can fail: a CPU operand beside a fake CUDA tensor raises CUDA's error, a CPU
    scalar and CPU indices pass, modules move, ``.device`` says cuda, ``.numpy()`` refuses."""
    with fake_cuda() as mode:
        lin = torch.nn.Linear(8, 4).to("cuda")
        assert isinstance(lin.weight, FakeCudaTensor) and lin.weight.device.type == "cuda" and lin.weight.is_cuda
        x = torch.randn(2, 8, device="cuda")
        y = lin(x) * torch.tensor(2.0)  # a CPU scalar: allowed
        assert y.device.type == "cuda" and y[torch.tensor([1])].shape == (1, 4)
        with pytest.raises(RuntimeError, match="same device"):
            _ = y + torch.ones(4)
        with pytest.raises(RuntimeError, match="same device"):
            torch.zeros(4).add_(y[0])
        with pytest.raises(TypeError, match="numpy"):
            y.numpy()
        acc = torch.zeros(4, device=y.device)
        acc += y.sum(0)
        assert acc.device.type == "cuda" and torch.equal(acc.cpu(), y.cpu().sum(0))
        assert mode.ops > 0
    assert not torch.cuda.is_available() or torch.cuda.get_device_name(0) != "fake CUDA (CPU)"


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tokenizer):
    """One tiny model per row: llama (GQA), Kimi K2 as published (block FP8, MLA, MoE),
    GLM-4.5 (GQA, qk-norm, MoE), GLM-5 (MLA, sparse attention, MoE)."""
    root, out = tmp_path_factory.mktemp("fake_cuda"), {}
    out["llama"] = make_model_dir(root / "llama", tokenizer)
    to_block_fp8(make_published(root / "kimi_bf16", tokenizer, "kimi_k2"), root / "kimi_k2")
    out["kimi_k2"] = root / "kimi_k2"
    out["glm4_moe"] = make_published(root / "glm4_moe", tokenizer, "glm4_moe")
    out["glm_moe_dsa"] = make_published(root / "glm_moe_dsa", tokenizer, "glm_moe_dsa", index_topk=256)
    return out


#: the CPU twin's calibration precision: CUDA runs in float32, while ``auto`` on a CPU with
#: AVX512-BF16 or AMX is bfloat16 (other integer codes)
CPU_AS_CUDA = "float32"


@pytest.mark.parametrize("row,algorithm", [("llama", a) for a in ("awq", "gptq", "awq-gptq", "rtn")]
                         + [(r, a) for r in ROWS[1:] for a in ("awq", "gptq")])
@pytest.mark.slow  # whole runs on the faked CUDA device against the CPU's (make test-fast leaves it out)
def test_quantize_on_cuda_equals_cpu(row, algorithm, sources, tmp_path, monkeypatch):
    """``quantize --device cuda`` runs on the fake device and writes the CPU run's artifact,
    byte for byte (every tensor digest), with an fp8 KV cache whose scales are searched."""
    opts = dict(model=str(sources[row]), algorithm=algorithm, matmul_precision=CPU_AS_CUDA, **FAST)
    run_quantize(QuantizeOptions(output=tmp_path / "cpu", **opts))
    with fake_cuda() as mode:
        run_quantize(QuantizeOptions(output=tmp_path / "cuda", device="cuda", **opts))
    assert mode.ops > 1000  # the layers really ran on the (fake) device
    cpu, cuda = digests(tmp_path / "cpu"), digests(tmp_path / "cuda")
    assert cpu.keys() == cuda.keys()
    assert [n for n in cpu if cpu[n] != cuda[n]] == []


@pytest.mark.parametrize("recipes,kw", [
    (["w4a16-gptq"], {"kv_scheme": "int4"}),  # KIVI int4 KV, GPTQ with act-order
    (["w3a16-gptaq-g64"], {}),
    (["w4a16-best"], {"settings": (("refine.iters", 3), ("refine.batch", 2))}),  # GPTQ's layers refined by autograd
    (["w4a16-mixed"], {}),
    (["w4a16-awq-gptq"], {"settings": (("head.num_bits", 8), ("head.untie", True))}),  # 8-bit LM head (tied source)
    (["w4a16-gptq"], {"settings": (("gptq.static_groups", False),), "format": "gptq"}),
    (["w4a16-awq"], {"format": "awq"}),
])
@pytest.mark.slow  # whole runs on the faked CUDA device against the CPU's (make test-fast leaves it out)
def test_recipes_on_cuda_equal_cpu(recipes, kw, sources, tmp_path):
    """The bundled recipes' other paths (KIVI KV, GPTAQ at 3 bits, the refinement after GPTQ, mixed
    precision, a quantized LM head, GPTQ and AutoAWQ formats) on the fake device: the CPU run's digests."""
    opts = dict(model=str(sources["llama"]), recipe=recipes, group_size=32, calib_samples=4, calib_seqlen=48, seed=0,
                matmul_precision=CPU_AS_CUDA, **kw)
    run_quantize(QuantizeOptions(output=tmp_path / "cpu", **opts))
    with fake_cuda():
        run_quantize(QuantizeOptions(output=tmp_path / "cuda", device="cuda", **opts))
    cpu, cuda = digests(tmp_path / "cpu"), digests(tmp_path / "cuda")
    assert cpu.keys() == cuda.keys() and [n for n in cpu if cpu[n] != cuda[n]] == []


@pytest.mark.parametrize("case", ["rtn_memory_budget", "gptq_memory_budget", "awq_spilled_activations", "kv_only"])
@pytest.mark.slow  # whole runs on the faked CUDA device against the CPU's (make test-fast leaves it out)
def test_bounded_memory_paths_on_cuda_equal_cpu(case, sources, tmp_path):
    """Kimi K2 (block FP8, MoE) through the paths that hold less than a layer: routed experts read
    and written in groups (RTN; GPTQ, each expert calibrated on its routed tokens, its tensors moved
    to the device group by group), calibration activations in memory-mapped files (AWQ), and a
    KV-only run on a packed source: the CPU run's digests."""
    import compressor.quant.gptq_layer as gl

    src, kw = sources["kimi_k2"], {}
    if case == "rtn_memory_budget":  # one routed expert's float32 + int8 codes, x1.5
        kw = dict(algorithm="rtn", memory_budget_gib=1.5 * 3 * 64 * 32 * 5 / 2**30)
    elif case == "gptq_memory_budget":  # below one expert's Hessians and weights
        kw = dict(algorithm="gptq", memory_budget_gib=int(1.5 * gl.HESSIAN_BYTES * 64 ** 2) / 2**30)
    elif case == "awq_spilled_activations":
        kw = dict(algorithm="awq", activation_budget_gib=0)
    else:
        run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "w4", algorithm="rtn", group_size=32))
        src, kw = tmp_path / "w4", dict(recipe=["kv-fp8"])
    opts = dict(model=str(src), group_size=32, calib_samples=4, calib_seqlen=48, seed=0, matmul_precision=CPU_AS_CUDA, **kw)
    run_quantize(QuantizeOptions(output=tmp_path / "cpu", **opts))
    with fake_cuda():
        run_quantize(QuantizeOptions(output=tmp_path / "cuda", device="cuda", **opts))
    cpu, cuda = digests(tmp_path / "cpu"), digests(tmp_path / "cuda")
    assert cpu.keys() == cuda.keys() and [n for n in cpu if cpu[n] != cuda[n]] == []


@pytest.fixture(scope="module")
def artifacts(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_cuda_art")
    out = {}
    for row in ROWS:
        out[row] = root / row
        run_quantize(QuantizeOptions(model=str(sources[row]), output=out[row], algorithm="rtn", **FAST))
    return out


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.slow  # whole runs on the faked CUDA device against the CPU's (make test-fast leaves it out)
def test_verify_and_serve_smoke_on_cuda(row, artifacts, monkeypatch):
    """``verify --device cuda`` gives the CPU run's figures; ``serve-smoke --device cuda`` serves
    with the Triton layers (their kernels replaced by the numerics they are tested against) and
    agrees with the reference as on the CPU."""
    from compressor.commands.options import SmokeOptions, VerifyOptions
    from compressor.commands.serve_smoke import run_serve_smoke
    from compressor.commands.verify import run_verify

    vopts = dict(artifact=artifacts[row], seqlen=48, max_windows=2, max_new_tokens=4)
    gate = {"min_top1": 50.0, "max_kl": 0.01} if row == "glm_moe_dsa" else {}
    cpu = run_verify(VerifyOptions(**vopts))
    with fake_cuda() as mode:
        reference_triton_kernels(monkeypatch)
        cuda = run_verify(VerifyOptions(device="cuda", **vopts))
        smoke = run_serve_smoke(SmokeOptions(artifact=artifacts[row], device="cuda", max_new_tokens=4, **gate))
    assert mode.ops > 1000
    assert cuda["perplexity"]["artifact"] == pytest.approx(cpu["perplexity"]["artifact"], rel=1e-4)
    assert cuda["perplexity"]["reference"] == pytest.approx(cpu["perplexity"]["reference"], rel=1e-4)
    kernels = smoke["runtime"]["kernels"]
    assert any(k.startswith("triton") for k in kernels), kernels
    assert smoke["passed"], smoke.get("failed_gates")


def test_gpu_check_triton_cases_place_their_tensors(monkeypatch):
    """The GPU check's Triton step builds its weights, layers and timing copies on the device
    (the W4 packing's shift table stayed on the CPU on the first GPU run)."""
    from gpu_check_triton import ShapeCopies, case_numerics, moe_case, random_weight

    with fake_cuda():
        reference_triton_kernels(monkeypatch)
        dev = torch.device("cuda")
        w = random_weight(64, 128, 64, dev, torch.Generator(device=dev).manual_seed(0))
        row, parts = case_numerics(w, 8)
        copies = ShapeCopies(w, 2**16)
        moe, moe_parts = moe_case(6, 48, 64, 2, 3, 32, dev)
    assert row["kernel"] in ("gemv", "gemm") and row["max_abs_err_vs_reference"] < 1e-2
    assert parts["x"].device.type == "cuda" and len(copies.layers["triton"]) > 1
    assert moe_parts["idx"].device.type == "cuda" and moe["max_abs_err_vs_reference"] == 0  # the reference itself here
