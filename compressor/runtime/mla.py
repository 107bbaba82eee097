"""Multi-head latent attention (MLA; DeepSeek-V2 arXiv:2405.04434 section 2.1, DeepSeek-V3, Kimi K2,
GLM-4.7-Flash) and its KV cache, which holds the compressed latent and the decoupled RoPE key.

Per layer and token the cache stores ``c_kv`` (``kv_a_proj_with_mqa`` output after
``kv_a_layernorm``, ``kv_lora_rank`` wide) and ``k_rope`` (``qk_rope_head_dim`` wide, after
RoPE, shared by all heads): exactly the two tensors transformers' ``DeepseekV3Attention``
passes to ``cache.update``, so the runtime cache quantizes them with the same
:class:`~compressor.kv_schemes.KVScheme` calls as ``kvq verify``'s
:func:`~compressor.quant.kv.quantized_cache` with :func:`~compressor.quant.kv.mla_layout`
(fp8 ``tensor``: one static scale per layer shared by both parts; int8 ``token``: a dynamic
scale and zero point per token and part; int4/int2 KIVI: both parts per channel in groups of
tokens, :class:`MLAKIVICache`). Per-head schemes do not apply (one latent shared by all heads)
and are refused.

Attention, per head ``h`` with ``W_kv_b = kv_b_proj.weight`` viewed ``[H, d_nope + d_v, r]``:

* **expanded** (prefill, ``T > 1``; transformers' order): ``k_nope, v = kv_b_proj(c_kv)``,
  keys ``[k_nope | k_rope]``, then scaled-dot-product attention.
* **absorbed** (decode, ``T == 1``): ``q_lat = q_nope W_uk`` (``W_uk = W_kv_b[:, :d_nope]``),
  scores ``q_lat c_kv^T + q_rope k_rope^T``, ``o = (softmax c_kv) W_uv^T`` -- the same
  products regrouped, so a step reads the ``r + d_rope`` cached floats per token instead of
  expanding every cached latent through ``kv_b_proj``. ``W_kv_b`` is dequantized from the
  packed codes once per step and layer (no float copy is kept).

Shapes are commented ``# (B, H, T, D)`` as in nanoGPT.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..quant.kv import check_layout, mla_layout
from ..kv_schemes import KIVIScheme, KVSpec
from .attention import attention_dtype
from .blocks import RMSNorm, apply_rope
from .kv_cache import CACHE_CLASSES, KIVICache, KVCache, QuantKVCache, _pack_codes, _unpack_codes


# ---------------------------------------------------------------------------------------
# the cache: one head, slot widths (kv_lora_rank, qk_rope_head_dim)


class _MLAStorage:
    """Mixin over a runtime cache class: slot ``k`` holds the latent ``[B, 1, Lmax, r]``, slot
    ``v`` the RoPE key ``[B, 1, Lmax, d_rope]`` (the base classes give both slots ``head_dim``)."""

    def __init__(self, *args, widths: tuple[int, int], **kw):
        self.widths = {"k": int(widths[0]), "v": int(widths[1])}
        super().__init__(*args, **kw)

    def _alloc(self) -> None:
        shp = (self.batch, 1, self.max_len)
        if isinstance(self, QuantKVCache):
            self.parts = {kind: [tuple(self._zeros(*shp, w, dtype=dt) for w, dt in self.codec.token_parts(self.widths[kind]))
                                 for _ in range(self.n_layers)] for kind in "kv"}
        else:
            self.k = [self._zeros(*shp, self.widths["k"]) for _ in range(self.n_layers)]
            self.v = [self._zeros(*shp, self.widths["v"]) for _ in range(self.n_layers)]


class MLAKIVICache(KIVICache):
    """KIVI int4/int2 over the MLA entry: the latent and the RoPE key both grouped per channel over
    ``group_size`` tokens (KIVI's key treatment, as :func:`~compressor.quant.kv.mla_layout` says and
    ``kvq verify``'s cache does), the same residual window rule as the GQA cache.

    Storage per layer: codes ``[B, 1, Lg, w * bits / 8]``, float32 scale/zero ``[B, 1, Lg / g, w]``
    and a float window ``[B, 1, R + 1, w]`` for each part (``w`` = ``kv_lora_rank`` or
    ``qk_rope_head_dim``; slot ``k`` the latent, slot ``v`` the RoPE key).

    Raises:
        InputError: as :class:`~compressor.runtime.kv_cache.KIVICache`; a width not a multiple of ``8 / bits``.
    """

    def __init__(self, *args, widths: tuple[int, int], **kw):
        self.widths = {"k": int(widths[0]), "v": int(widths[1])}
        super().__init__(*args, **kw)
        if self.widths["v"] % (8 // self.bits):
            raise InputError(f"KIVI {self.bits}-bit packing needs qk_rope_head_dim divisible by {8 // self.bits}, "
                             f"got {self.widths['v']}")

    def _alloc(self):
        B, L, g = self.batch, self.max_len, self.g
        n_groups = math.ceil(L / g)
        store = {}
        for kind, w in self.widths.items():
            store[kind] = (
                [self._zeros(B, 1, n_groups * g, w * self.bits // 8, dtype=torch.uint8) for _ in range(self.n_layers)],
                [self._zeros(B, 1, n_groups, w, dtype=torch.float32) for _ in range(self.n_layers)],
                [self._zeros(B, 1, n_groups, w, dtype=torch.float32) for _ in range(self.n_layers)],
                [self._zeros(B, 1, self.R + 1, w) for _ in range(self.n_layers)])
        (self.kc, self.ks, self.kz, self.rk), (self.vc, self.vs, self.vz, self.rv) = store["k"], store["v"]

    def _parts(self, kind: str):
        return (self.kc, self.ks, self.kz) if kind == "k" else (self.vc, self.vs, self.vz)

    def _quantize_into(self, layer, row, pos, k, v):
        n, g = k.shape[1], self.g
        for kind, x in (("k", k), ("v", v)):
            codes, scale, zero = self._parts(kind)
            c, s, z = self.codec.encode(x.unsqueeze(0), None, "k")  # per channel, groups of g tokens
            codes[layer][row, :, pos:pos + n] = _pack_codes(c[0], self.bits)
            scale[layer][row, :, pos // g:(pos + n) // g] = s[0]
            zero[layer][row, :, pos // g:(pos + n) // g] = z[0]

    def _read(self, layer, q1, end):
        length, lq = int(end.max()), int(q1.max())
        q1d = q1.to(self.device).view(-1, 1)
        pos = torch.arange(length, device=self.device).view(1, -1)
        idx = (pos - q1d).clamp(0, self.R)  # [B, L] slot in the window
        out = []
        for kind in "kv":
            res = (self.rk if kind == "k" else self.rv)[layer]
            win = res.gather(2, idx[:, None, :, None].expand(-1, 1, -1, self.widths[kind]))
            if lq:
                codes, scale, zero = self._parts(kind)
                parts = (_unpack_codes(codes[layer][:, :, :lq], self.bits), scale[layer][:, :, :lq // self.g],
                         zero[layer][:, :, :lq // self.g])
                deq = torch.nn.functional.pad(self.codec.decode(parts, None, "k", self.dtype), (0, 0, 0, length - lq))
                win = torch.where((pos < q1d)[:, None, :, None], deq, win)
            out.append(win)
        return out[0], out[1]


@lru_cache(maxsize=None)
def _mla_class(base: type) -> type:
    return type(f"MLA{base.__name__}", (_MLAStorage, base), {"__doc__": f"{base.__name__} holding an MLA latent + RoPE key."})


def make_mla_cache(spec: KVSpec | None, scales, n_layers: int, batch: int, max_len: int, kv_lora_rank: int,
                   rope_dim: int, dtype: torch.dtype, device) -> KVCache:
    """The runtime cache of an MLA model (float when ``spec`` is None).

    Args:
        spec: the KV scheme; scales: layer -> ``(k_scale, v_scale)`` ``[1]`` for a static one.
        kv_lora_rank, rope_dim: widths of the latent and of the RoPE key.

    Raises:
        InputError: a per-head scheme (no KV heads on MLA), a static scheme without scales,
            KIVI limits (:class:`MLAKIVICache`).
    """
    geo = (n_layers, batch, 1, max_len, kv_lora_rank)
    widths = (kv_lora_rank, rope_dim)
    if spec is None:
        return _mla_class(KVCache)(*geo, dtype=dtype, device=device, widths=widths)
    check_layout(spec, mla_layout(n_layers, kv_lora_rank, rope_dim))
    if isinstance(spec.codec, KIVIScheme):
        return MLAKIVICache(*geo, dtype=dtype, device=device, spec=spec, widths=widths)
    if spec.static and scales is None:
        raise InputError(f"KV scheme {spec.describe()} needs calibrated k_scale/v_scale (an artifact quantized with it has them)")
    cls = next(c for c in CACHE_CLASSES if isinstance(spec.codec, c.codecs))
    return _mla_class(cls)(*geo, dtype=dtype, device=device, spec=spec, scales=scales, widths=widths)


# ---------------------------------------------------------------------------------------
# attention


def mla_scale(cfg) -> float:
    """Softmax scale ``(qk_nope + qk_rope) ** -0.5``, times ``mscale^2`` for YaRN with
    ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = (int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)) ** -0.5
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= m * m
    return scale


class MLAttention:
    """MLA self-attention of one layer (see the module docstring).

    Args:
        lin: ``q_proj`` or ``q_a_proj`` + ``q_b_proj``; ``kv_a_proj_with_mqa``, ``kv_b_proj``,
            ``o_proj`` -> Linear.
        q_a_norm, kv_a_norm: ``q_a_layernorm`` (None without ``q_lora_rank``), ``kv_a_layernorm``.
        dims: ``(n_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)``.
        scale: softmax scale (:func:`mla_scale`); rope_layout: ``deinterleave``
            (``config.rope_interleave``) or ``half``.
    """

    def __init__(self, index: int, lin: dict, q_a_norm: RMSNorm | None, kv_a_norm: RMSNorm, dims: tuple,
                 scale: float, rope_layout: str, rope_key=None):
        self.index, self.lin, self.q_a_norm, self.kv_a_norm = index, lin, q_a_norm, kv_a_norm
        self.n_heads, self.rank, self.d_nope, self.d_rope, self.d_v = (int(d) for d in dims)
        self.scale, self.rope_layout, self.rope_key = scale, rope_layout, rope_key
        self.window = None

    def norms(self) -> dict:
        """Relative name -> RMSNorm (for byte accounting)."""
        return {n: m for n, m in (("q_a_layernorm", self.q_a_norm), ("kv_a_layernorm", self.kv_a_norm)) if m is not None}

    def _query(self, h: torch.Tensor) -> torch.Tensor:
        if "q_proj" in self.lin:
            return self.lin["q_proj"](h)
        return self.lin["q_b_proj"](self.q_a_norm(self.lin["q_a_proj"](h)))

    def __call__(self, h, ropes, masks, cache, start, n_new):
        B, T, _ = h.shape
        H = self.n_heads
        q = self._query(h).view(B, T, H, self.d_nope + self.d_rope).transpose(1, 2)  # (B, H, T, dn + dr)
        q_nope, q_rot = torch.split(q, [self.d_nope, self.d_rope], dim=-1)
        lat, k_rot = torch.split(self.lin["kv_a_proj_with_mqa"](h), [self.rank, self.d_rope], dim=-1)
        lat = self.kv_a_norm(lat).reshape(B, 1, T, self.rank)  # (B, 1, T, r)
        k_rot = k_rot.reshape(B, 1, T, self.d_rope)  # (B, 1, T, dr)
        cos, sin = ropes[self.rope_key]
        c, sn = cos.unsqueeze(1), sin.unsqueeze(1)
        q_rot, k_rot = apply_rope(q_rot, c, sn, self.rope_layout), apply_rope(k_rot, c, sn, self.rope_layout)
        lat_all, rot_all = cache.update(self.index, lat, k_rot, start, n_new)  # (B, 1, L, r), (B, 1, L, dr)
        ad = attention_dtype(q)  # float32 on CPU, as GQA attention
        q_nope, q_rot, lat_all, rot_all = (t.to(ad) for t in (q_nope, q_rot, lat_all, rot_all))
        mask = masks[None]
        if T == 1:
            o = self._absorbed(q_nope, q_rot, lat_all, rot_all, mask)
        else:
            o = self._expanded(q_nope, q_rot, lat_all, rot_all, mask)
        return self.lin["o_proj"](o.to(h.dtype).transpose(1, 2).reshape(B, T, H * self.d_v))  # o: (B, H, T, dv)

    def _expanded(self, q_nope, q_rot, lat, rot, mask):
        B, _, L, _ = lat.shape
        kv = self.lin["kv_b_proj"](lat).view(B, L, self.n_heads, self.d_nope + self.d_v).transpose(1, 2)  # (B, H, L, dn+dv)
        k_nope, v = torch.split(kv, [self.d_nope, self.d_v], dim=-1)
        keys = torch.cat([k_nope, rot.expand(-1, self.n_heads, -1, -1)], dim=-1)  # (B, H, L, dn + dr)
        q = torch.cat([q_nope, q_rot], dim=-1)
        return F.scaled_dot_product_attention(q, keys, v, attn_mask=mask, scale=self.scale)  # (B, H, T, dv)

    def _absorbed(self, q_nope, q_rot, lat, rot, mask):
        w = self.lin["kv_b_proj"].dense_weight(q_nope.dtype).view(self.n_heads, self.d_nope + self.d_v, self.rank)
        w_uk, w_uv = w[:, :self.d_nope], w[:, self.d_nope:]  # (H, dn, r), (H, dv, r)
        q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)  # (B, H, T, r)
        s = (torch.matmul(q_lat, lat.transpose(2, 3)) + torch.matmul(q_rot, rot.transpose(2, 3))) * self.scale  # (B, H, T, L)
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q_nope.dtype)
        return torch.einsum("bhtr,hvr->bhtv", torch.matmul(p, lat), w_uv)  # (B, H, T, dv)
