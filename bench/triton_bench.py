"""Triton W4A16 on a CUDA GPU: correctness against the torch reference, GEMV time vs copy bandwidth.

For each shape (out x in, group 128 and 64): random int4 codes, scales and zero points;
the kernel's output is compared with :func:`compressor.runtime.triton_kernels.w4a16_reference`
(same numerics contract) at M = 1, 8, 64; then batch-1 GEMV is timed with CUDA events
(median of 200 after 20 warm-ups) and its effective bandwidth (bytes of packed weights +
scales + zeros + activations + output, per call) is compared with the GPU's measured
device-to-device copy bandwidth (a large ``tensor.copy_``: read + write bytes per second).

Needs a CUDA GPU and triton; without one it says so and exits 0 (CI has no GPU; the
kernels are covered on CPU by tests/test_runtime.py under TRITON_INTERPRET=1).
Usage: python bench/triton_bench.py  -> bench/results/triton_bench.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (1536, 576)]


def _time(fn, reps=200, warm=20) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), reps=50, warm=5)
    return 2 * src.numel() / t


def main() -> None:
    from compressor.runtime.triton_kernels import pack_w4, triton_available, w4a16_matmul, w4a16_reference

    if not torch.cuda.is_available() or not triton_available():
        print("no CUDA GPU or no triton here: nothing to measure (CPU coverage: tests/test_runtime.py, TRITON_INTERPRET=1)")
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    rows = []
    for n, k in SHAPES:
        for gs in (128, 64):
            if k % gs:
                continue
            q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device="cuda", generator=g)
            scale = torch.rand(n, k // gs, device="cuda", generator=g) * 0.02 + 0.001
            zp = torch.randint(-8, 8, (n, k // gs), dtype=torch.int8, device="cuda", generator=g)
            qw, s, z = pack_w4(q, scale, zp, torch.float16)
            err = {}
            for m in (1, 8, 64):
                x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g)
                y = w4a16_matmul(x, qw, s, z, gs)
                ref = w4a16_reference(x, qw, s, z, gs)
                err[m] = float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))
            x1 = torch.randn(1, k, device="cuda", dtype=torch.float16, generator=g)
            t = _time(lambda: w4a16_matmul(x1, qw, s, z, gs))
            moved = qw.numel() * 4 + s.numel() * 2 + z.numel() * 2 + k * 2 + n * 2
            w16 = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=g)
            t16 = _time(lambda: torch.nn.functional.linear(x1, w16))
            rows.append({"n": n, "k": k, "group_size": gs, "max_rel_err": err, "gemv_us": t * 1e6,
                         "gb_per_s": moved / t / 1e9, "fraction_of_copy_bw": moved / t / bw,
                         "fp16_gemv_us": t16 * 1e6, "speedup_vs_fp16": t16 / t})
            print(json.dumps(rows[-1]), flush=True)
            del w16
    out = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gb_s": bw / 1e9, "rows": rows}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "triton_bench.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s on {out['device']}")


if __name__ == "__main__":
    main()
