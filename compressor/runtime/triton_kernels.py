"""W4A16 Triton kernels (fused 4-bit unpack + dequantize inside the GEMV/GEMM), launcher, reference.

Layout (``N = out_features``, ``K = in_features``, ``G = K // group_size``):

===========  ==================  =========================================================
tensor       shape / dtype       content
===========  ==================  =========================================================
qweight      int32 ``[N, K/8]``  unsigned codes ``u = q + 8`` (0..15); nibble ``j`` (bits
                                 ``4j..4j+3``) of word ``w`` in row ``n`` holds column
                                 ``8w + j``. Bit-identical to compressed-tensors 4-bit
                                 ``weight_packed``, so such artifacts need no repacking.
scales       ``[N, G]``          per-group scale, activation dtype (fp16/bf16)
zeros        ``[N, G]``          unsigned zero point ``z = zero_point + 8`` (8 when
                                 symmetric), activation dtype (small integers: exact)
===========  ==================  =========================================================

Numerics contract (shared with the torch reference :func:`w4a16_reference` and the
dequantize backend): ``w = (u - z) * s`` computed in float32, rounded to the activation
dtype; products accumulated in float32; the output rounded to the activation dtype.
``u - z = q - zero_point`` exactly, so ``w`` equals
:func:`compressor.quant.primitives.dequantize` rounded to the activation dtype.

Kernels: ``mm`` (``tl.dot`` tiles of ``BLOCK_M x BLOCK_N`` from ``[BLOCK_N, BLOCK_K]``
weight tiles read along K, the packed words' contiguous axis; every row of a decode step
in one 16-row tile, so the weight is read once; K split across programs when the output
tiles alone would leave multiprocessors idle, the float32 partial sums added after) and
``moe`` (the grouped gemm of a mixture-of-experts layer: rows sorted by expert, each
program one expert's tile; see :func:`moe_w4a16`). The dequantized tile never leaves
registers. The first GPU run (an H200, BENCHMARKS.md) timed the kernels before ``mm``
(one program per row, ``[BLOCK_K, BLOCK_N]`` tiles gathered across rows): correct, 1.3-12x
slower than dequantizing in torch; ``mm`` has not run on a GPU yet.
:func:`choose_config` picks the kernel and block sizes; :func:`w4a16_matmul` validates
and launches.

Triton is optional (``pip install kvq-compressor[triton]``): it is imported only when a
kernel is first launched. The kernels are built lazily too, because ``@triton.jit``
decides at decoration time whether to run compiled or in the interpreter
(``TRITON_INTERPRET=1``, read through ``triton.knobs.runtime.interpret``); the
interpreter runs them on CPU tensors, which is how the tests check them.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ..errors import InputError

#: activation dtypes the kernels accept (float32 only under the interpreter, for tests)
ACT_DTYPES = (torch.float16, torch.bfloat16)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


# ---------------------------------------------------------------------------------------
# layout and reference (pure torch)


@torch.no_grad()
def pack_w4(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
            dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Signed int4 codes -> the kernel layout (see the module table).

    Args:
        q: int8 ``[N, K]`` in ``[-8, 7]``, ``K % 8 == 0``.
        scale: ``[N, G]``; zero_point: int8 ``[N, G]`` in ``[-8, 7]`` or None (symmetric).
        dtype: activation dtype for ``scales``/``zeros``.

    Returns:
        ``(qweight int32 [N, K/8], scales dtype [N, G], zeros dtype [N, G])``.

    Raises:
        InputError: ``K`` not a multiple of 8 or codes outside ``[-8, 7]``.
    """
    n, k = q.shape
    if k % 8:
        raise InputError(f"W4A16 layout needs in_features divisible by 8, got {k}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise InputError("W4A16 layout needs 4-bit codes in [-8, 7]")
    u = (q.to(torch.int64) + 8).reshape(n, k // 8, 8)
    words = (u << _SHIFTS.to(u.device)).sum(-1)
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    zp = torch.zeros_like(scale, dtype=torch.int64) if zero_point is None else zero_point.to(torch.int64)
    return qweight.contiguous(), scale.to(dtype).contiguous(), (zp + 8).to(dtype).contiguous()


@torch.no_grad()
def unpack_w4(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_w4`'s packing: int32 ``[N, K/8]`` -> unsigned int64 ``[N, K]`` (0..15)."""
    w = qweight.to(torch.int64) & 0xFFFFFFFF
    return ((w.unsqueeze(-1) >> _SHIFTS.to(w.device)) & 0xF).reshape(qweight.shape[0], -1)


@torch.no_grad()
def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """Pure-torch W4A16 with the kernels' numerics: ``x [M, K] @ W.T -> [M, N]`` in ``x.dtype``."""
    u = unpack_w4(qweight).float()
    gs = int(group_size)
    s = scales.float().repeat_interleave(gs, dim=1)
    z = zeros.float().repeat_interleave(gs, dim=1)
    w = ((u - z) * s).to(x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)


# ---------------------------------------------------------------------------------------
# launch configuration


@dataclass(frozen=True)
class KernelConfig:
    """Which configuration and which (power-of-two) block sizes a launch uses."""

    kind: str  # "gemv" (M <= GEMV_MAX_M) | "gemm": the same kernel, named for the reports
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs sharing one output tile's K range (float32 partial sums, added after)

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        """Program grid: ``(ceil(N / BLOCK_N), ceil(M / BLOCK_M), SPLIT_K)``."""
        return -(-n // self.block_n), -(-m // self.block_m), self.split_k


#: largest M served by the decode configuration (one 16-row tile, split K)
GEMV_MAX_M = 8
#: streaming multiprocessors assumed when the device does not say (an H100/H200 has 132)
DEFAULT_SM_COUNT = 132


def _pow2_at_most(v: int, cap: int, floor: int) -> int:
    p = floor
    while p * 2 <= min(v, cap):
        p *= 2
    return p


def choose_config(m: int, n: int, k: int, group_size: int, sm_count: int | None = None) -> KernelConfig:
    """Block sizes for ``x [m, k] @ W[n, k].T``.

    Every program computes a ``BLOCK_M x BLOCK_N`` output tile from ``[BLOCK_N, BLOCK_K]``
    weight tiles read along K (the packed words' contiguous axis) and ``tl.dot``:

    * ``m <= GEMV_MAX_M`` (decode, ``gemv``): one 16-row tile holds every row, so the
      weight is read once whatever ``m``; ``BLOCK_N`` up to 64, ``BLOCK_K`` up to 128.
    * otherwise (prefill, ``gemm``): ``BLOCK_M`` 16/32/64 following ``m``, ``BLOCK_N`` 64
      (128 once ``m >= 64``), ``BLOCK_K`` 64 (32 when ``k < 64``); 8 warps for 64x128.

    When the tiles are fewer than twice ``sm_count`` (default :data:`DEFAULT_SM_COUNT`),
    K is split across up to 16 programs per tile (each at least two ``BLOCK_K`` steps), so
    a decode GEMV of a 4096-row weight runs on every multiprocessor, not on 32 of them.

    Raises:
        InputError: non-positive sizes, ``k % 8 != 0`` or a group size not dividing ``k``.
    """
    if min(m, n, k, group_size) <= 0:
        raise InputError(f"bad W4A16 problem size m={m} n={n} k={k} group_size={group_size}")
    if k % 8 or k % group_size:
        raise InputError(f"W4A16 needs in_features ({k}) divisible by 8 and by the group size ({group_size})")
    if m <= GEMV_MAX_M:
        kind, bm, bn, bk, warps, stages = "gemv", 16, _pow2_at_most(n, 64, 16), _pow2_at_most(k, 128, 16), 4, 3
    else:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        bn = 128 if m >= 64 and n >= 128 else _pow2_at_most(n, 64, 16)
        kind, bk, stages = "gemm", 64 if k >= 64 else 32, 3
        warps = 8 if bm * bn >= 64 * 128 else 4
    tiles = -(-n // bn) * -(-m // bm)
    steps = -(-k // bk)
    split = max(1, min(2 * (sm_count or DEFAULT_SM_COUNT) // tiles, steps // 2, 16))
    return KernelConfig(kind, bm, bn, bk, warps, stages, split)


# ---------------------------------------------------------------------------------------
# kernels (built lazily) and launcher


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    """True when ``import triton`` works (the optional extra is installed)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """Build the jitted kernels (once per interpreter mode); see the module docstring."""
    import triton
    import triton.language as tl

    @triton.jit
    def w4_mm(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, G, stride_xm, stride_om, k_chunk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
              DOT_F32: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        kw = K // 8
        ng = K // G
        k_lo = pid_k * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            mask = n_mask[:, None] & k_mask[None, :]
            # [BLOCK_N, BLOCK_K] along K: neighbouring threads read neighbouring words of a row
            words = tl.load(qw_ptr + offs_n[:, None] * kw + offs_k[None, :] // 8, mask=mask, other=0)
            u = (words >> ((offs_k[None, :] % 8) * 4)) & 0xF
            grp = offs_n[:, None] * ng + offs_k[None, :] // G
            s = tl.load(s_ptr + grp, mask=mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + grp, mask=mask, other=0.0).to(tl.float32)
            w = ((u.to(tl.float32) - z) * s).to(a.dtype)
            if DOT_F32:  # the interpreter: exact float32 products (its bf16 tl.dot is wrong, triton#11584)
                acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w), out_dtype=tl.float32)
        if SPLIT_K == 1:
            out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
        else:  # float32 partial sums [SPLIT_K, M, N], added by the launcher
            out = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
            tl.store(out, acc, mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def w4_moe(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, rows_ptr, bexp_ptr, R, N, K, G, stride_xm, stride_om,
               rows_per_token, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT_F32: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(bexp_ptr + pid_m).to(tl.int64)
        rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        r_mask = rows < R
        xrow = rows // rows_per_token
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        kw = K // 8
        ng = K // G
        qw_e = qw_ptr + e * N * kw
        s_e = s_ptr + e * N * ng
        z_e = z_ptr + e * N * ng
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(x_ptr + xrow[:, None] * stride_xm + offs_k[None, :],
                        mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            mask = n_mask[:, None] & k_mask[None, :]
            words = tl.load(qw_e + offs_n[:, None] * kw + offs_k[None, :] // 8, mask=mask, other=0)  # along K
            u = (words >> ((offs_k[None, :] % 8) * 4)) & 0xF
            grp = offs_n[:, None] * ng + offs_k[None, :] // G
            s = tl.load(s_e + grp, mask=mask, other=0.0).to(tl.float32)
            z = tl.load(z_e + grp, mask=mask, other=0.0).to(tl.float32)
            w = ((u.to(tl.float32) - z) * s).to(a.dtype)
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w), out_dtype=tl.float32)
        out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])

    return {"mm": w4_mm, "moe": w4_moe}


def check_launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int) -> None:
    """Validate a launch before any kernel runs (shapes, dtypes, devices).

    Raises:
        InputError: one line naming the mismatch: ``x`` not 2-D or of an unsupported
            dtype, tensors on different devices, a CPU tensor outside the interpreter,
            ``qweight``/``scales``/``zeros`` shapes that do not fit ``x`` and ``group_size``.
    """
    if x.ndim != 2:
        raise InputError(f"W4A16 expects x [M, K], got shape {tuple(x.shape)}")
    allowed = ACT_DTYPES + ((torch.float32,) if interpreting() else ())
    if x.dtype not in allowed:
        raise InputError(f"W4A16 activations must be float16 or bfloat16, got {x.dtype}")
    devices = {t.device for t in (x, qweight, scales, zeros)}
    if len(devices) != 1:
        raise InputError(f"W4A16 tensors are on different devices: {sorted(str(d) for d in devices)}")
    if x.device.type != "cuda" and not interpreting():
        raise InputError("the Triton W4A16 kernels need a CUDA device (or TRITON_INTERPRET=1 for the CPU interpreter)")
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (n, k // 8) or k % 8:
        raise InputError(f"qweight must be int32 [N, K/8] = [{n}, {k // 8}] for K={k}, got {qweight.dtype} {tuple(qweight.shape)}")
    if group_size <= 0 or k % group_size:
        raise InputError(f"group_size {group_size} does not divide in_features {k}")
    g = k // group_size
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (n, g):
            raise InputError(f"{name} must be [N, G] = [{n}, {g}], got {tuple(t.shape)}")


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, config: KernelConfig | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` (``x.dtype``) with the fused W4A16 kernel.

    Args:
        x: activations, float16/bfloat16, CUDA (CPU under ``TRITON_INTERPRET=1``).
        qweight, scales, zeros: the layout of the module docstring (:func:`pack_w4`).
        group_size: input columns per scale group.
        config: override :func:`choose_config` (tests).

    Raises:
        InputError: see :func:`check_launch`; triton missing.
    """
    check_launch(x, qweight, scales, zeros, group_size)
    if not triton_available():
        raise InputError("the triton backend needs the 'triton' package (pip install kvq-compressor[triton])")
    m, k = x.shape
    n = qweight.shape[0]
    cfg = config or choose_config(m, n, k, group_size, device_sm_count(x.device))
    x = x.contiguous()
    k_chunk = -(-k // (cfg.split_k * cfg.block_k)) * cfg.block_k
    kw = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
              DOT_F32=interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kern = _kernels(interpreting())["mm"][cfg.grid(m, n)]
    if cfg.split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        kern(x, qweight, scales, zeros, out, m, n, k, group_size, x.stride(0), out.stride(0), k_chunk, **kw)
        return out
    part = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
    kern(x, qweight, scales, zeros, part, m, n, k, group_size, x.stride(0), n, k_chunk, **kw)
    return part.sum(0).to(x.dtype)


@functools.lru_cache(maxsize=8)
def _sm_count_of(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def device_sm_count(device: torch.device) -> int | None:
    """The CUDA device's multiprocessor count (None on CPU, i.e. under the interpreter)."""
    if device.type != "cuda":
        return None
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


# ---------------------------------------------------------------------------------------
# grouped W4A16 for mixture-of-experts layers


def moe_block_m(rows: int, n_experts: int) -> int:
    """Rows per program of the grouped kernel: 16 (``tl.dot``'s minimum) up to 64, following
    the mean rows per expert."""
    mean = rows / max(1, n_experts)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


@torch.no_grad()
def moe_align(idx: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the routed rows by expert, each expert's run padded to a multiple of ``block_m``.

    Args:
        idx: int64 ``[T, k]`` expert of each (token, slot); row ``r = t * k + j``.

    Returns:
        ``(sorted_rows int32 [P], block_expert int32 [P / block_m])``: rows of expert ``e``
        in order, then padding ``R = T * k`` (masked by the kernel); the expert of each block.
    """
    flat = idx.flatten()
    R = flat.numel()
    counts = torch.bincount(flat, minlength=n_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(R, device=idx.device) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    dest = (torch.cumsum(padded, 0) - padded)[sorted_e] + rank
    rows = torch.full((int(padded.sum()),), R, dtype=torch.int32, device=idx.device)
    rows[dest] = order.to(torch.int32)
    blocks = torch.repeat_interleave(torch.arange(n_experts, device=idx.device, dtype=torch.int32), padded // block_m)
    return rows, blocks


def moe_w4a16_reference(x: torch.Tensor, idx: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor, group_size: int, rows_per_token: int) -> torch.Tensor:
    """Pure-torch :func:`moe_w4a16`: row ``r`` is ``x[r // rows_per_token] @ W[idx.flatten()[r]].T``."""
    flat = idx.flatten()
    out = torch.zeros(flat.numel(), qweight.shape[1], dtype=x.dtype, device=x.device)
    for e in flat.unique().tolist():
        r = (flat == e).nonzero().flatten()
        out[r] = w4a16_reference(x[r // rows_per_token], qweight[e], scales[e], zeros[e], group_size)
    return out


def moe_w4a16(x: torch.Tensor, idx: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int, rows_per_token: int = 1, block_n: int | None = None) -> torch.Tensor:
    """Grouped W4A16 over routed rows: ``out[r] = x[r // rows_per_token] @ W_e.T`` for ``e = idx.flatten()[r]``.

    One launch serves every expert of a layer: the rows are sorted by expert
    (:func:`moe_align`), each program computes ``BLOCK_M`` rows of one expert against
    ``BLOCK_N`` output columns, unpacking that expert's 4-bit tile in registers (the
    numerics of :func:`w4a16_reference`). ``rows_per_token = k`` reads each token's input
    once per routed slot (gate/up); ``1`` reads row ``r`` itself (down).

    Args:
        x: ``[M, K]`` float16/bfloat16 (float32 under the interpreter), ``M * rows_per_token == idx.numel()``.
        idx: int64 ``[T, k]`` expert ids in ``[0, E)``.
        qweight: int32 ``[E, N, K/8]``; scales, zeros: ``[E, N, K/group_size]`` (:func:`pack_w4` per expert).

    Returns:
        ``[T * k, N]`` in ``x.dtype``.

    Raises:
        InputError: shapes that do not fit, devices, dtypes (as :func:`check_launch`); triton missing.
    """
    E, n = qweight.shape[0], qweight.shape[1]
    if qweight.ndim != 3 or scales.ndim != 3 or zeros.ndim != 3 or scales.shape[0] != E or zeros.shape[0] != E:
        raise InputError(f"grouped W4A16 expects [E, N, K/8] codes and [E, N, G] scales/zeros, got "
                         f"{tuple(qweight.shape)}, {tuple(scales.shape)}, {tuple(zeros.shape)}")
    check_launch(x, qweight[0], scales[0], zeros[0], group_size)
    if idx.ndim != 2 or x.shape[0] * rows_per_token != idx.numel():
        raise InputError(f"grouped W4A16: {x.shape[0]} input rows x {rows_per_token} != {idx.numel()} routed rows")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= E):
        raise InputError(f"grouped W4A16: expert ids outside [0, {E})")
    if not triton_available():
        raise InputError("the triton backend needs the 'triton' package (pip install kvq-compressor[triton])")
    R, k = idx.numel(), x.shape[1]
    out = torch.empty(R, n, dtype=x.dtype, device=x.device)
    if R == 0:
        return out
    bm = moe_block_m(R, E)
    rows, blocks = moe_align(idx.to(x.device), E, bm)
    bn = block_n or _pow2_at_most(n, 64, 16)
    bk = 64 if k >= 64 else 32
    x = x.contiguous()
    grid = (blocks.numel(), -(-n // bn))
    _kernels(interpreting())["moe"][grid](x, qweight, scales, zeros, out, rows, blocks, R, n, k, group_size,
                                          x.stride(0), out.stride(0), rows_per_token,
                                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=interpreting(),
                                          num_warps=4, num_stages=2)
    return out
