"""The Triton part of the GPU check (``bench/gpu_check.py``, step ``triton``): W4A16 vs torch.

The runtime's Triton W4A16 layer (:class:`compressor.runtime.linear.TritonW4Linear`, i.e.
:func:`compressor.runtime.triton_kernels.w4a16_matmul`) against torch on the same inputs
(the runtime's ``dequant`` layer: dequantize to float16, then ``F.linear``) and against a
float16 ``F.linear`` on the pre-dequantized weight (the float baseline), for SmolLM2's
Linear shapes (out x in: 576x576, 576x1536, 1536x576) and a 4096x11008 / 11008x4096 pair.

Per case: max abs error vs torch and vs the kernels' numerics contract
(:func:`~compressor.runtime.triton_kernels.w4a16_reference`); time per call: the median of
``reps`` replays of a CUDA graph that holds one call per weight copy (launch overhead out of
the figure), timed with CUDA events by ``bench/triton_bench.py``'s ``_time``; enough weight
copies rotate that one replay touches over 3x the L2 cache, so weights stream from HBM as
in a real model; achieved bandwidth = :func:`w4a16_bytes` / time, as a fraction of the
device-to-device copy bandwidth measured in the same run (``triton_bench.copy_bandwidth``).

:func:`case_numerics` runs on CPU too under ``TRITON_INTERPRET=1`` (tests/test_gpu_check.py);
the timing needs CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "bench"):  # compressor (this checkout), triton_bench
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

#: (out_features N, in_features K) of the cases
SHAPES = ((576, 576), (576, 1536), (1536, 576), (4096, 11008), (11008, 4096))
#: grouped MoE cases: (name, experts E, N, K, top-k): GLM-4.5-Air's routed gate/up (128 experts,
#: 2 x 1408 x 4096) and down (4096 x 1408), top-8
MOE_SHAPES = (("glm45air-gate_up", 128, 2816, 4096, 8), ("glm45air-down", 128, 4096, 1408, 8))
#: tokens per decode step of the MoE cases
MOE_TOKENS = (1, 8)
#: the config sweep's cases (N, K, M) and candidates (BLOCK_N, BLOCK_K, SPLIT_K, num_warps), M <= 8
SWEEP_CASES = ((1536, 576, 1), (576, 1536, 1), (4096, 11008, 1), (11008, 4096, 1), (4096, 11008, 8))
SWEEP_GRID = tuple((bn, bk, sk, 4) for bn in (32, 64, 128) for bk in (32, 64, 128) for sk in (1, 2, 4, 8))


def w4a16_bytes(m: int, n: int, k: int, group_size: int, act_bytes: int = 2) -> int:
    """Bytes one W4A16 call ``x [m, k] @ W[n, k].T`` moves at least.

    Packed int4 weights ``n * k / 2`` + scales and zeros ``2 * n * (k / group_size) * act_bytes``
    + activations ``m * k * act_bytes`` + output ``m * n * act_bytes``.

    Raises:
        ValueError: ``k`` not a multiple of 8 and of ``group_size``.
    """
    if k % 8 or group_size <= 0 or k % group_size:
        raise ValueError(f"in_features {k} must be a multiple of 8 and of the group size {group_size}")
    return n * k // 2 + 2 * n * (k // group_size) * act_bytes + (m * k + m * n) * act_bytes


def log(msg: str) -> None:
    print(f"gpu-check: {msg}", file=sys.stderr, flush=True)


def fp16_bytes(m: int, n: int, k: int) -> int:
    """Bytes a float16 ``F.linear`` moves at least: weight ``2nk`` + activations ``2mk`` + output ``2mn``."""
    return 2 * (n * k + m * k + m * n)


def random_weight(n: int, k: int, group_size: int, device, gen):
    """A random asymmetric 4-bit :class:`~compressor.formats.base.QuantWeight` ``[n, k]`` on ``device``."""
    import torch

    from compressor.formats.base import QuantWeight

    g = k // group_size
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=device, generator=gen)
    scale = (torch.rand(n, g, device=device, generator=gen) * 0.02 + 0.001).half()
    zp = torch.randint(-8, 8, (n, g), dtype=torch.int8, device=device, generator=gen)
    return QuantWeight(q, scale, zp, 4, group_size)


def case_numerics(w, m: int, seed: int = 0) -> tuple[dict, dict]:
    """Errors of the Triton layer vs torch (dequantize, float16 matmul) and vs the reference contract.

    Args:
        w: a 4-bit :class:`~compressor.formats.base.QuantWeight` ``[N, K]`` on CUDA, or on
            CPU under ``TRITON_INTERPRET=1`` (tiny shapes only).
        m: activation rows; ``x`` is float16 ``[m, K]`` drawn with ``seed``.

    Returns:
        ``(row, parts)``: the JSON row (shape, kernel kind, errors) and ``{"x", "tri", "deq"}``
        (the input and the two layers, for timing).

    Raises:
        RuntimeError: the runtime did not choose the Triton kernel for this weight.
    """
    import torch

    from compressor.runtime.linear import make_linear
    from compressor.runtime.triton_kernels import choose_config, device_sm_count, w4a16_reference

    dev = w.q.device
    n, k, gs = w.out_features, w.in_features, w.group_size
    tri = make_linear(w, None, "triton", dev, torch.float16)
    if tri.kernel != "triton-w4a16":
        raise RuntimeError(f"the Triton layer was not chosen for [{n}, {k}]: {tri.fallback_reason}")
    deq = make_linear(w, None, "dequant", dev, torch.float16)
    x = torch.randn(m, k, device=dev, generator=torch.Generator(device=dev).manual_seed(seed)).half()
    y_tri, y_torch = tri(x).float(), deq(x).float()
    ref = w4a16_reference(x, tri.qweight, tri.scales, tri.zeros, gs).float()
    cfg = choose_config(m, n, k, gs, device_sm_count(dev))  # what the launcher uses on this device
    row = {"n": n, "k": k, "m": m, "group_size": gs, "kernel": cfg.kind, "split_k": cfg.split_k,
           "blocks_mnk": [cfg.block_m, cfg.block_n, cfg.block_k],
           "max_abs_err_vs_torch": float((y_tri - y_torch).abs().max()),
           "max_abs_err_vs_reference": float((y_tri - ref).abs().max()),
           "max_abs_output": float(ref.abs().max())}
    return row, {"x": x, "tri": tri, "deq": deq}


def _copies(bytes_per_copy: int, l2_bytes: int) -> int:
    """Weight copies to rotate so one pass touches more than 3x the L2 cache (at most 1024)."""
    return max(1, min(1024, -(-3 * l2_bytes // max(bytes_per_copy, 1))))


def time_calls(fns: list, reps: int, graph: bool = True) -> tuple[float, str]:
    """Median seconds per call: ``fns`` (one call per weight copy, at least 16) captured in one
    CUDA graph, replayed ``reps`` times under ``triton_bench._time``; eager if capture fails or
    ``graph`` is False (calls that read a device value on the host cannot be captured)."""
    import torch
    from triton_bench import _time

    fns = fns * -(-16 // len(fns))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (and Triton compilation) off the capture
        for f in fns[:3]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if not graph:
        return _time(lambda: [f() for f in fns], reps=reps, warm=3) / len(fns), "eager"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        return _time(graph.replay, reps=reps, warm=3) / len(fns), "cuda-graph"
    except Exception as e:  # noqa: BLE001 -- record and fall back
        torch.cuda.synchronize()
        return _time(lambda: [f() for f in fns], reps=reps, warm=3) / len(fns), f"eager ({type(e).__name__})"


class ShapeCopies:
    """Weight copies of one ``[N, K]`` shape for timing (Triton layers, dequant layers, float16
    weights), each list long enough to exceed 3x the L2 cache; the first copy is ``w``'s."""

    def __init__(self, w, l2_bytes: int):
        import torch

        from compressor.runtime.linear import make_linear

        n, k, gs, dev = w.out_features, w.in_features, w.group_size, w.q.device
        gen = torch.Generator(device=dev).manual_seed(1)
        ws = [w]
        self.layers = {}
        for backend in ("triton", "dequant"):
            first = make_linear(w, None, backend, dev, torch.float16)
            count = _copies(first.weight_bytes, l2_bytes)
            while len(ws) < count:
                ws.append(random_weight(n, k, gs, dev, gen))
            self.layers[backend] = [first] + [make_linear(v, None, backend, dev, torch.float16) for v in ws[1:count]]
        del ws[1:]
        count = _copies(2 * n * k, l2_bytes)
        self.fp16 = [w.dequantize(torch.float16)] + [torch.randn(n, k, device=dev, generator=gen).half()
                                                     for _ in range(count - 1)]


def time_case(row: dict, x, copies: ShapeCopies, reps: int, copy_bw: float) -> dict:
    """``row`` plus Triton / torch-dequant / float16 ``F.linear`` times (us) and bandwidths (CUDA)."""
    import torch.nn.functional as F

    n, k, m, gs = row["n"], row["k"], row["m"], row["group_size"]
    moved = w4a16_bytes(m, n, k, gs)
    t_tri, mode = time_calls([(lambda L=L: L(x)) for L in copies.layers["triton"]], reps)
    t_deq, _ = time_calls([(lambda L=L: L(x)) for L in copies.layers["dequant"]], reps)
    t_f16, _ = time_calls([(lambda W=W: F.linear(x, W)) for W in copies.fp16], reps)
    return {**row, "timing": mode, "weight_copies": len(copies.layers["triton"]), "bytes_moved": moved,
            "triton_us": t_tri * 1e6, "triton_gb_s": moved / t_tri / 1e9, "fraction_of_copy_bw": moved / t_tri / copy_bw,
            "torch_dequant_us": t_deq * 1e6, "speedup_vs_torch_dequant": t_deq / t_tri,
            "fp16_linear_us": t_f16 * 1e6, "fp16_fraction_of_copy_bw": fp16_bytes(m, n, k) / t_f16 / copy_bw,
            "speedup_vs_fp16_linear": t_f16 / t_tri}


def l2_cache_bytes() -> int:
    """The CUDA device's L2 cache size in bytes (64 MiB when torch does not say)."""
    import torch

    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 64 * 2**20)


def random_experts(e: int, n: int, k: int, group_size: int, device, gen, dtype=None):
    """Packed 4-bit weights of ``e`` experts in the grouped kernel's layout: int32 codes
    ``[E, N, K/8]`` (random words), scales ``[E, N, G]`` and zeros ``[E, N, G]`` (8: symmetric)."""
    import torch

    dtype = dtype or torch.float16
    g = k // group_size
    qw = torch.randint(-2**31, 2**31 - 1, (e, n, k // 8), dtype=torch.int32, device=device, generator=gen)
    scales = (torch.rand(e, n, g, device=device, generator=gen) * 0.02 + 0.001).to(dtype)
    zeros = torch.full((e, n, g), 8.0, dtype=dtype, device=device)
    return qw, scales, zeros


def moe_case(e: int, n: int, k: int, top_k: int, tokens: int, group_size: int, device, seed: int = 0,
             dtype=None) -> tuple[dict, dict]:
    """The grouped W4A16 kernel on one MoE projection vs its torch reference (gate/up layout:
    each token's input read once per routed slot, ``rows_per_token = top_k``).

    Returns ``(row, parts)``: the row (shape, routed experts, max abs error) and the launch's
    inputs for :func:`time_moe`. ``top_k`` distinct experts per token, drawn with ``seed``.
    """
    import torch

    from compressor.runtime.triton_kernels import moe_w4a16, moe_w4a16_reference

    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = dtype or torch.float16
    qw, s, z = random_experts(e, n, k, group_size, device, gen, dtype)
    x = torch.randn(tokens, k, device=device, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(e, device=device, generator=gen)[:top_k] for _ in range(tokens)])
    out = moe_w4a16(x, idx, qw, s, z, group_size, rows_per_token=top_k)
    ref = moe_w4a16_reference(x, idx, qw, s, z, group_size, top_k)
    used = int(idx.unique().numel())
    row = {"e": e, "n": n, "k": k, "top_k": top_k, "tokens": tokens, "group_size": group_size,
           "experts_routed": used, "max_abs_err_vs_reference": float((out.float() - ref.float()).abs().max()),
           "max_abs_output": float(ref.float().abs().max())}
    return row, {"x": x, "idx": idx, "w": (qw, s, z)}


def moe_bytes(row: dict, act_bytes: int = 2) -> int:
    """Bytes one grouped call moves at least: the routed experts' packed weights, scales and
    zeros, the inputs (once per token) and the outputs (one row per routed slot)."""
    n, k, g = row["n"], row["k"], row["k"] // row["group_size"]
    per_expert = n * k // 2 + 2 * n * g * act_bytes
    return row["experts_routed"] * per_expert + (row["tokens"] * k + row["tokens"] * row["top_k"] * n) * act_bytes


def time_moe(row: dict, parts: dict, reps: int, copy_bw: float) -> dict:
    """``row`` plus the grouped kernel's and the torch reference's time per call (us) and the
    kernel's bandwidth (:func:`moe_bytes`) as a fraction of the copy bandwidth (CUDA). The
    weights are one copy (a real layer's experts exceed the L2 cache already)."""
    from compressor.runtime.triton_kernels import moe_w4a16, moe_w4a16_reference

    x, idx, (qw, s, z), gs, k = parts["x"], parts["idx"], parts["w"], row["group_size"], row["top_k"]
    # eager: the launch sizes its grid from the routed counts (a host read), which a graph cannot hold
    t_tri, mode = time_calls([lambda: moe_w4a16(x, idx, qw, s, z, gs, rows_per_token=k)], reps, graph=False)
    t_ref, _ = time_calls([lambda: moe_w4a16_reference(x, idx, qw, s, z, gs, k)], max(1, reps // 10), graph=False)
    moved = moe_bytes(row)
    return {**row, "timing": mode, "bytes_moved": moved, "triton_us": t_tri * 1e6,
            "fraction_of_copy_bw": moved / t_tri / copy_bw, "torch_reference_us": t_ref * 1e6,
            "speedup_vs_torch_reference": t_ref / t_tri}


def moe_kernel_status() -> dict:
    """Whether ``compressor.runtime.triton_kernels`` has a MoE kernel (public names containing 'moe')."""
    from compressor.runtime import triton_kernels as tk

    names = sorted(n for n in dir(tk) if "moe" in n.lower() and not n.startswith("_"))
    if not names:
        return {"status": "not present"}
    return {"status": "present", "names": names}


def moe_rows(ctx, group_size: int, copy_bw: float, errors: list) -> list[dict]:
    """Every :data:`MOE_SHAPES` x :data:`MOE_TOKENS` case (timed on CUDA; a failing case is
    recorded in ``errors`` and the next runs)."""
    import torch

    rows, dev = [], getattr(ctx, "device", "cuda")
    for name, e, n, k, top_k in MOE_SHAPES:
        for t in MOE_TOKENS:
            if ctx.remaining() <= 0:
                errors.append(f"moe {name} tokens={t}: time budget spent")
                continue
            try:
                row, parts = moe_case(e, n, k, top_k, t, group_size, dev)
                row = {"name": name, **time_moe(row, parts, ctx.args.reps, copy_bw)}
                rows.append(row)
                log(f"triton moe {name} tokens={t}: {row['triton_us']:.1f} us, "
                    f"{100 * row['fraction_of_copy_bw']:.0f} % of copy BW, torch reference {row['torch_reference_us']:.1f} us")
            except Exception as ex:  # noqa: BLE001 -- recorded in the JSON
                errors.append(f"moe {name} tokens={t}: {type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}")
            parts = None
            if dev != "cpu":
                torch.cuda.empty_cache()
    return rows


def step_triton(ctx) -> dict:
    """The ``triton`` step (CUDA): every shape of :data:`SHAPES` x ``ctx.args.batches`` rows.

    ``ctx``: ``args`` (``batches``, ``group_size``, ``reps``), ``device`` (``cuda``; the
    tests drive the loop on CPU under the interpreter with the timing stubbed) and
    ``remaining()`` (seconds of budget left: shapes after the deadline are listed in a
    note, not run).

    A shape that fails is recorded (``status`` error, ``error``) and the next one runs.

    Raises:
        RuntimeError: triton is not installed.
    """
    import torch

    from compressor.runtime.triton_kernels import triton_available
    from triton_bench import copy_bandwidth

    if not triton_available():
        raise RuntimeError("triton is not installed (pip install kvq-compressor[triton])")
    args, dev = ctx.args, getattr(ctx, "device", "cuda")
    l2 = l2_cache_bytes()
    bw = copy_bandwidth()
    rows, left, errors = [], [], []
    for n, k in SHAPES:
        if ctx.remaining() <= 0:
            left += [f"{n}x{k} m={m}" for m in args.batches]
            continue
        try:  # one shape failing (e.g. out of memory) keeps the others' rows
            w = random_weight(n, k, args.group_size, dev, torch.Generator(device=dev).manual_seed(0))
            copies = ShapeCopies(w, l2)
            for m in args.batches:
                row, parts = case_numerics(w, m)
                row = time_case(row, parts["x"], copies, args.reps, bw)
                rows.append(row)
                log(f"triton {n}x{k} m={m}: {row['triton_us']:.1f} us, {100 * row['fraction_of_copy_bw']:.0f} % "
                    f"of copy BW, max err vs torch {row['max_abs_err_vs_torch']:.2e}")
        except Exception as e:  # noqa: BLE001 -- recorded in the JSON
            errors.append(f"{n}x{k}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        w = copies = parts = None
        torch.cuda.empty_cache()
    moe = moe_kernel_status()
    if moe["status"] == "present":
        moe["rows"] = moe_rows(ctx, args.group_size, bw, errors)
    res = {"copy_bandwidth_gb_s": bw / 1e9, "l2_cache_bytes": l2, "rows": rows, "moe": moe}
    if left:
        res["note"] = f"time budget spent: {len(left)} cases not run ({', '.join(left[:4])}...)"
    if errors:
        res.update(status="error", error="; ".join(errors))
    return res




def step_sweep(ctx) -> dict:
    """The ``sweep`` step (CUDA): the decode launch configurations of :data:`SWEEP_GRID` on each
    of :data:`SWEEP_CASES`, timed as the ``triton`` step times (fewer replays), against the one
    :func:`~compressor.runtime.triton_kernels.choose_config` picks: the data to tune it with.
    Cases and configurations after the budget are listed in a note, not run.

    Raises:
        RuntimeError: triton is not installed.
    """
    import torch

    from compressor.runtime.triton_kernels import (KernelConfig, choose_config, device_sm_count, triton_available,
                                                   w4a16_matmul, w4a16_reference)

    if not triton_available():
        raise RuntimeError("triton is not installed (pip install kvq-compressor[triton])")
    args, dev = ctx.args, getattr(ctx, "device", "cuda")
    gs, reps, l2 = args.group_size, max(5, args.reps // 5), (l2_cache_bytes() if dev != "cpu" else 1024)
    cases, skipped_n = [], 0
    for n, k, m in SWEEP_CASES:
        w = random_weight(n, k, gs, dev, torch.Generator(device=dev).manual_seed(0))
        layers = ShapeCopies(w, l2).layers["triton"]
        x = torch.randn(m, k, device=dev, generator=torch.Generator(device=dev).manual_seed(1)).half()
        L0 = layers[0]
        ref = w4a16_reference(x, L0.qweight, L0.scales, L0.zeros, gs).float()
        chosen = choose_config(m, n, k, gs, device_sm_count(torch.device(dev)))
        grid = [(chosen.block_n, chosen.block_k, chosen.split_k, chosen.num_warps)]
        grid += [c for c in SWEEP_GRID if c not in grid]
        rows = []
        for bn, bk, sk, warps in grid:
            if ctx.remaining() <= 0:
                skipped_n += 1
                continue
            cfg = KernelConfig(chosen.kind, chosen.block_m, bn, bk, warps, chosen.num_stages, sk)
            try:
                err = float((w4a16_matmul(x, L0.qweight, L0.scales, L0.zeros, gs, cfg).float() - ref).abs().max())
                t, _ = time_calls([(lambda L=L: w4a16_matmul(x, L.qweight, L.scales, L.zeros, gs, cfg)) for L in layers], reps)
                rows.append({"block_n": bn, "block_k": bk, "split_k": sk, "num_warps": warps, "us": t * 1e6,
                             "max_abs_err_vs_reference": err})
            except Exception as e:  # noqa: BLE001 -- a config the compiler refuses is recorded
                rows.append({"block_n": bn, "block_k": bk, "split_k": sk, "num_warps": warps,
                             "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]})
        timed = [r for r in rows if "us" in r]
        case = {"n": n, "k": k, "m": m, "group_size": gs, "configs": rows,
                "chosen": {"block_n": chosen.block_n, "block_k": chosen.block_k, "split_k": chosen.split_k,
                           "num_warps": chosen.num_warps}}
        if timed:
            best = min(timed, key=lambda r: r["us"])
            case.update(best=best, chosen_us=rows[0].get("us"))  # rows[0]: the chosen configuration
            log(f"sweep {n}x{k} m={m}: chosen {case['chosen_us'] or float('nan'):.1f} us, best {best['us']:.1f} us "
                f"(BLOCK_N {best['block_n']}, BLOCK_K {best['block_k']}, split {best['split_k']})")
        cases.append(case)
        layers = L0 = w = None
        if dev != "cpu":
            torch.cuda.empty_cache()
    res = {"cases": cases}
    if skipped_n:
        res["note"] = f"time budget spent: {skipped_n} configurations not run"
    return res
