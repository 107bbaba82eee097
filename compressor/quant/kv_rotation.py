"""Exact changes of the key basis, one per RoPE pair, for a static fp8 KV cache (``kv_cache.key_rotation: pairs``).

RoPE (Su et al., 2021, "RoFormer"; transformers' ``rotate_half`` layout) turns each pair of a
head's channels ``(p, p + d/2)`` as one complex number, ``k_p = k[p] + i k[p + d/2]``, and an
attention logit is ``Re sum_p q_p conj(k_p)``. Multiplying a KV head's pair ``p`` by a complex
``z_p``, and pair ``p`` of every query head that reads it by ``1 / conj(z_p)``, commutes with RoPE
and leaves every logit unchanged: the artifact computes the same function (up to float
rounding) in a key basis chosen for float8's relative rounding. These per-pair complex factors
(a scaled rotation of each pair) are the only linear changes of the key basis that commute with
every RoPE rotation; they live in ``q_proj``'s and ``k_proj``'s rows (and biases), so a
serving engine reads the artifact as any other (vLLM's ``k_scale``/``v_scale`` layout unchanged).

e4m3's rounding error is about proportional to each value, so a key's error reaches a logit with
variance about ``sigma^2 sum_c q_c^2 k_c^2``; a static scale can only shift where the values fall
on the 3-bit mantissa grid. Two steps per decoder layer (:mod:`compressor.pipeline`):

1. **Angles**, before the layer's weights are quantized (:func:`rotate_layer`): for each pair an
   angle ``z = e^{i phi}``, one of :data:`ANGLES` in [0, 90) degrees, minimising
   ``E[q_a^2] E[k_a^2] + E[q_b^2] E[k_b^2]`` of the turned pair over the float layer's post-RoPE
   queries and keys on ``scale_search_samples`` calibration sequences (a pair whose query and
   key energy sit on one channel gains up to 2x from being turned by 45 degrees). The rows are
   turned in float, then quantized as usual.
2. **Factors**, after the layer's recompute and static scale search
   (:mod:`compressor.quant.kv_search`; :func:`scale_layer_pairs`): for each pair a factor ``z = c``,
   one of :data:`FACTORS` (``2^(-j/16)``, ``j = 0 .. 15``: shrinking only, so no key newly clips at
   the layer's scale), minimising ``sum_t Var_{s ~ A_t}((q_a(t) e_a(s) + q_b(t) e_b(s)) / c)``,
   the variance under the layer's attention probabilities ``A`` of the pair's own logit error,
   with ``e`` the real rounding error of ``c k`` at the layer's k scale (a constant logit error
   cancels in the softmax). ``k_proj``'s rows are multiplied by ``c`` and ``q_proj``'s by ``1/c``:
   for a quantized linear only its group scales move (the integer codes are exact).

Step 1 runs only where ``q_proj`` and ``k_proj`` stay float (KV-only runs, or recipes that
leave them unquantized): turned before rounding, the rows' W4 error grows by more than the
cache gains (:func:`rotate_layer`). Step 2 is exact on quantized rows and always runs.

Measured on SmolLM2-135M (BENCHMARKS.md, issue #18): a KV-only float32 artifact, per-tensor fp8
keys and values, 32 x 512 calibration, first 20 windows of wiki.test.raw, against the float-KV
model: perplexity +0.83 % -> +0.65 %, mean KL 0.00805 -> 0.00637 (``kvq verify``).

Supported where transformers applies RoPE to the whole head in the ``rotate_half`` layout with
separate ``q_proj``/``k_proj`` and no q/k norm (:data:`ARCHS`); ``auto`` skips other layouts and
``pairs`` refuses them. ``kvq verify`` undoes the change in its weight statistics
(:func:`undo_pairs`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..arch import get_module
from ..errors import InputError
from .kv_search import AttentionRecorder, resolve_scale_search, search_kv_ranges
from .layer import StopForward, layer_forward, stored_dequantize

#: model types whose attention rotates whole heads in the ``rotate_half`` layout, with
#: separate q_proj/k_proj and no q/k norm (what the exactness argument needs)
ARCHS = frozenset({"llama", "mistral", "mixtral", "qwen2"})
#: angles tried per pair, evenly in [0, 90) degrees (90 degrees swaps the pair: the same moments)
ANGLES = 32
#: factors tried per pair: one binade in 16 steps, shrinking only
FACTORS = tuple(2 ** (-j / 16) for j in range(16))
#: bytes of attention-weighted error statistics one factor search holds at once (pairs are chunked to fit)
WORK_BYTES = 256 << 20


def unsupported(config) -> str | None:
    """Why a model of ``config`` cannot take per-pair key changes, or ``None`` when it can."""
    if config.model_type not in ARCHS:
        return (f"model type {config.model_type!r} is not one whose RoPE layout kvq knows to commute with "
                f"per-pair changes ({', '.join(sorted(ARCHS))})")
    if getattr(config, "partial_rotary_factor", None) not in (None, 1.0):
        return "RoPE covers part of each head (partial_rotary_factor)"
    return None


def resolve_key_rotation(kv_options, config, scale_search: str) -> str:
    """``none`` or ``pairs``: what ``kv_options.key_rotation`` (a recipe's ``kv_cache`` section, or
    ``None``) means for a model of ``config`` whose static scales are chosen by ``scale_search``
    (:func:`compressor.quant.kv_search.resolve_scale_search`). ``auto`` is ``pairs`` for an fp8
    cache searched on the attention output on a supported architecture, else ``none``.

    Raises:
        InputError: ``pairs`` asked for where it cannot apply (names why).
    """
    mode = "none" if kv_options is None else kv_options.key_rotation
    if mode == "none":
        return "none"
    reason = unsupported(config)
    if reason is None and scale_search != "attention":
        reason = "it needs the static scales searched on the attention output (kv_cache.scale_search attention or auto)"
    if mode == "pairs" and reason is not None:
        raise InputError(f"kv_cache.key_rotation pairs: {reason}")
    return "pairs" if reason is None and (mode == "pairs" or kv_options.scheme == "fp8") else "none"


def resolve_kv_search(kv_options, layout, config) -> tuple[str, str]:
    """``(scale_search, key_rotation)`` of a run: :func:`~compressor.quant.kv_search.resolve_scale_search`
    on the cache's ``layout``, then :func:`resolve_key_rotation` for a model of ``config``.

    Raises:
        InputError: either asks for what cannot apply.
    """
    search = resolve_scale_search(kv_options, layout)
    return search, resolve_key_rotation(kv_options, config, search)


def _grouped_moments(x: torch.Tensor, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor):
    """Second moments ``([n, kv_heads, P], [n, kv_heads, P])`` of each pair's channels turned by
    each of ``n`` angles (``cos``/``sin [n]``), over batch, tokens and the query heads of a KV head;
    ``x [b, heads, T, d]``."""
    b, heads, t, d = x.shape
    p = d // 2
    x = x.double().view(b, kv_heads, heads // kv_heads, t, d)
    a, bb = x[..., :p], x[..., p:]
    aa, ab, b2 = ((u * v).mean((0, 2, 3)) for u, v in ((a, a), (a, bb), (bb, bb)))  # [kv_heads, P]
    c, s = cos.view(-1, 1, 1), sin.view(-1, 1, 1)
    return c * c * aa - 2 * c * s * ab + s * s * b2, s * s * aa + 2 * c * s * ab + c * c * b2


def choose_angles(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per KV head and pair, the angle (radians, ``[kv_heads, d/2]`` float32) of :data:`ANGLES`
    minimising ``E[q_a'^2] E[k_a'^2] + E[q_b'^2] E[k_b'^2]`` of the turned pair.

    ``q [b, heads, T, d]``, ``k [b, kv_heads, T, d]``: post-RoPE queries and keys (any float dtype).
    """
    phis = torch.arange(ANGLES, dtype=torch.float64, device=k.device) * (math.pi / 2 / ANGLES)
    cos, sin = phis.cos(), phis.sin()
    (qa, qb), (ka, kb) = _grouped_moments(q, k.shape[1], cos, sin), _grouped_moments(k, k.shape[1], cos, sin)
    return phis[(qa * ka + qb * kb).argmin(0)].float()


@torch.no_grad()
def choose_factors(q: torch.Tensor, k: torch.Tensor, codec, k_scale: torch.Tensor, scaling: float) -> torch.Tensor:
    """Per KV head and pair, the factor of :data:`FACTORS` (``[kv_heads, d/2]`` float32) minimising
    the variance, under the causal attention probabilities, of the pair's logit error when the
    keys ``c k`` are rounded by ``codec`` at ``k_scale`` and the queries divided by ``c``.

    ``q [b, heads, T, d]``, ``k [b, kv_heads, T, d]`` post-RoPE (float32); ``codec``: the KV
    scheme (:class:`~compressor.kv_schemes.KVScheme`); ``k_scale [kv_heads]`` float32, the
    static key scales as stored; ``scaling``: the attention's logit scale (``d^-0.5``).
    """
    b, heads, t, d = q.shape
    kv_heads, p = k.shape[1], d // 2
    g = heads // kv_heads
    c = torch.tensor(FACTORS, device=k.device)
    n = len(c)
    chunk = max(1, min(p, WORK_BYTES // (b * g * t * n * 5 * 4)))
    eye = torch.eye(t, device=k.device).expand(b, g, t, t)
    out = torch.empty(kv_heads, p)
    for h in range(kv_heads):
        qh = q[:, h * g:(h + 1) * g].float()
        kh = k[:, h].float()  # [b, T, d]
        probs = F.scaled_dot_product_attention(qh, kh[:, None].expand(-1, g, -1, -1), eye, is_causal=True, scale=scaling)
        s = k_scale[h].reshape(1)
        for p0 in range(0, p, chunk):
            p1 = min(p, p0 + chunk)
            ka, kb = kh[:, :, p0:p1, None] * c, kh[:, :, p + p0:p + p1, None] * c  # [b, T, pairs, n]
            ea, eb = codec.fake_quantize(ka, "k", s) - ka, codec.fake_quantize(kb, "k", s) - kb
            e = torch.stack([ea * ea, ea * eb, eb * eb, ea, eb], -1).reshape(b, 1, t, -1)
            ae = (probs @ e).view(b, g, t, p1 - p0, n, 5)  # E_A over keys of each product, per query
            qa, qb = qh[..., p0:p1, None], qh[..., p + p0:p + p1, None]  # [b, g, T, pairs, 1]
            var = (qa * qa * ae[..., 0] + 2 * qa * qb * ae[..., 1] + qb * qb * ae[..., 2]
                   - (qa * ae[..., 3] + qb * ae[..., 4]) ** 2)
            out[h, p0:p1] = c[(var.sum((0, 1, 2), dtype=torch.float64) / (c * c)).argmin(-1)].cpu()
    return out


def turn_rows(lin: torch.nn.Linear, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    """Multiply each head's row pair ``(p, p + d/2)`` of ``lin``'s weight ``[heads * d, in]`` (and
    bias) by the complex ``cos + i sin`` (``[heads, d/2]``), in place: ``a' = cos a - sin b``,
    ``b' = sin a + cos b``."""
    p = head_dim // 2
    for t in (lin.weight, lin.bias):
        if t is None:
            continue
        w = t.data.view(-1, head_dim, *t.shape[1:])
        shape = (w.shape[0], p) + (1,) * (w.dim() - 2)
        c, s = cos.reshape(shape).to(w), sin.reshape(shape).to(w)
        a, b = w[:, :p].clone(), w[:, p:].clone()
        w[:, :p] = c * a - s * b
        w[:, p:] = s * a + c * b


def _geometry(attn) -> tuple[int, int, int]:
    d = attn.head_dim
    return attn.q_proj.out_features // d, attn.k_proj.out_features // d, d


def _records(rec) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([r[0] for r in rec.records]).float(), torch.cat([r[1] for r in rec.records]).float()


@torch.no_grad()
def rotate_layer(i: int, layer, hidden: list, kw: dict, ctx) -> dict:
    """Step 1 for decoder layer ``i`` (float weights, before the algorithm's step): record the
    attention's queries and keys on the first ``scale_search_samples`` sequences of ``hidden``
    (``[b, T, H]`` batches, the layer's inputs), choose the angles (:func:`choose_angles`) and turn
    ``q_proj``'s and ``k_proj``'s rows. Returns the layer's figure ``{"mean_angle_deg"}`` (``{}``
    when the run does not change the key basis, and ``{"angles": "none: q/k weights quantized"}``
    when the recipe quantizes ``q_proj`` or ``k_proj``: a turn mixes a pair's two rows before
    rounding, and a small row mixed with a large one takes the large one's group scales, which
    cost the W4 model more than the angles gain the cache; the factors of step 2 still apply)."""
    if ctx.kv_key_rotation != "pairs" or not hidden:
        return {}
    prefix = f"{ctx.arch.layers}.{i}.{ctx.arch.attention}."
    if prefix + "q_proj" in ctx.targets or prefix + "k_proj" in ctx.targets:
        return {"angles": "none: q/k weights quantized"}
    attn = get_module(layer, ctx.arch.attention)
    rec = AttentionRecorder(attn, ctx.recipe.kv_cache.scale_search_samples)

    def stop(_m, _inputs, _out):  # the rest of the layer is not needed
        if rec.seen >= rec.max_sequences:
            raise StopForward

    handle = attn.register_forward_hook(stop)
    try:
        with rec.active():
            for h in hidden:
                try:
                    layer_forward(layer, h, kw)
                except StopForward:
                    break
    finally:
        handle.remove()
    q, k = _records(rec)
    heads, kv_heads, d = _geometry(attn)
    phi = choose_angles(q, k)
    turn_rows(attn.k_proj, phi.cos(), phi.sin(), d)
    phi_q = phi.repeat_interleave(heads // kv_heads, 0)
    turn_rows(attn.q_proj, phi_q.cos(), phi_q.sin(), d)
    return {"mean_angle_deg": round(float(phi.rad2deg().mean()), 2)}


def _scale_rows(name: str, lin: torch.nn.Linear, rows: torch.Tensor, ctx) -> None:
    """Multiply ``lin``'s output rows by ``rows [out]``: a quantized linear's stored group scales
    (its integer codes unchanged; the weight re-dequantized from them), else the weight."""
    record = ctx.modules.get(name)
    if record is not None:
        scale = record.scale.float() * rows.view(-1, 1).to(record.scale.device)
        record.scale, deq = stored_dequantize(record.q, scale, record.zero_point, record.group_size, record.scale.dtype,
                                              name, record.g_idx)
        lin.weight.data.copy_(deq.to(lin.weight))
    else:
        lin.weight.data.mul_(rows.view(-1, 1).to(lin.weight))
    if lin.bias is not None:
        lin.bias.data.mul_(rows.to(lin.bias))


@torch.no_grad()
def scale_layer_pairs(i: int, rec, ctx, k_range: torch.Tensor) -> dict:
    """Step 2 for decoder layer ``i`` (quantized, recomputed, its scales searched): choose the
    factors (:func:`choose_factors`) on what ``rec`` (:class:`~compressor.quant.kv_search.AttentionRecorder`)
    recorded, at the key scales of ``k_range`` (``[kv_heads]``, the searched ranges), and move
    them into ``k_proj``'s (``x c``) and ``q_proj``'s (``/ c``) rows. Returns the layer's figure
    ``{"mean_factor"}``."""
    spec = ctx.recipe.kv_cache.spec()
    attn = rec.attn
    heads, kv_heads, d = _geometry(attn)
    scale = spec.codec.scale_from_absmax(k_range).to(ctx.quantizer.dtype).float().expand(kv_heads)
    q, k = _records(rec)
    f = choose_factors(q, k, spec.codec, scale, getattr(attn, "scaling", d ** -0.5))
    prefix = f"{ctx.arch.layers}.{i}.{ctx.arch.attention}."
    _scale_rows(prefix + "k_proj", attn.k_proj, torch.cat([f, f], 1).reshape(-1), ctx)
    fq = (1 / f).repeat_interleave(heads // kv_heads, 0)
    _scale_rows(prefix + "q_proj", attn.q_proj, torch.cat([fq, fq], 1).reshape(-1), ctx)
    return {"mean_factor": round(float(f.mean()), 4)}


def fit_pairs(w_ref: torch.Tensor, w_hat: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Per head and RoPE pair, the complex factor ``z`` (``[heads, d/2]`` complex128) that best maps
    the reference's row pair onto the artifact's, ``w_hat ~ z w`` with the pair's rows read as
    ``w_a + i w_b`` (least squares: ``z = <w, w_hat> / <w, w>``; 1 where the reference pair is
    zero). ``w_ref``/``w_hat``: ``[heads * d, in]`` (float64 for a fit to float precision)."""
    p = head_dim // 2
    r, h = w_ref.reshape(-1, head_dim, w_ref.shape[-1]).double(), w_hat.reshape(-1, head_dim, w_hat.shape[-1]).double()
    wr, wh = torch.complex(r[:, :p], r[:, p:]), torch.complex(h[:, :p], h[:, p:])
    z = (wr.conj() * wh).sum(-1) / wr.abs().pow(2).sum(-1).clamp(min=1e-300)
    return torch.where(z.abs() > 0, z, torch.ones_like(z))


def undo_pairs(w_ref: torch.Tensor, w_hat: torch.Tensor, head_dim: int, z: torch.Tensor | None = None) -> torch.Tensor:
    """``w_hat [heads * d, in]`` with each head's row pair divided by its :func:`fit_pairs` factor
    (``z [heads, d/2]`` complex, when already fitted): the artifact's q_proj/k_proj in the
    reference's key basis, for weight statistics. The fit also absorbs the (small) part of the
    quantization error along each pair's own rows, as AWQ's row-scale fit does. float64 in,
    float64 out."""
    p = head_dim // 2
    z = fit_pairs(w_ref, w_hat, head_dim) if z is None else z
    h = w_hat.reshape(-1, head_dim, w_hat.shape[-1])
    back = torch.complex(h[:, :p], h[:, p:]) / z[..., None]
    return torch.cat([back.real, back.imag], 1).reshape(w_hat.shape)


def apply_layer_search(i: int, rec: AttentionRecorder, ctx, rotation: dict | None = None) -> dict:
    """Layer ``i``'s search (:func:`~compressor.quant.kv_search.search_kv_ranges`) on what ``rec`` recorded during its
    recompute; the observer's ranges for the layer become ``absmax x m``. With
    ``ctx.kv_key_rotation == "pairs"`` the key pairs' factors follow at the searched scales
    (:func:`scale_layer_pairs`). Returns the layer's figure
    ``{"k": [m per KV head, or one for per-tensor scales], "v": [...], "sequences": n}``
    (``n``: calibration sequences the search used; ``{}`` when the observer saw nothing), plus
    ``"key_pairs"``: ``rotation`` (the layer's angle figure) and the factors' figure."""
    obs = ctx.observer.layers[i]
    if obs.k_absmax is None:
        return {}
    spec = ctx.recipe.kv_cache.spec()
    k_range, v_range, mk, mv = search_kv_ranges(rec, spec, obs.k_absmax, obs.v_absmax, ctx.quantizer.dtype)
    obs.k_absmax, obs.v_absmax = k_range, v_range
    pairs = {}
    if ctx.kv_key_rotation == "pairs" and rec.records:
        pairs = {"key_pairs": {**(rotation or {}), **scale_layer_pairs(i, rec, ctx, k_range)}}
    rec.records.clear()
    if spec.codec.per_tensor:  # one multiplier for the layer
        mk, mv = mk[:1], mv[:1]
    return {"k": [round(x, 4) for x in mk.tolist()], "v": [round(x, 4) for x in mv.tolist()], "sequences": rec.seen,
            **pairs}
