"""Grouped-query attention of the runtime (MHA/GQA/MQA), over a preallocated KV cache.

One class serves every GQA row: optional per-head q/k RMSNorms before RoPE (Qwen3,
GLM-4-MoE's ``use_qk_norm``, Gemma 3), q/k/v biases (Qwen2, GLM-4), a rotary layout
(:func:`~compressor.runtime.blocks.apply_rope`: Llama ``half``, GLM-4 ``pairs``, partial
rotary through the width of ``cos``), the softmax scale (``head_dim ** -0.5``, Gemma's
``query_pre_attn_scalar ** -0.5``), a sliding window (the mask the decoder builds for it) and
Gemma 2/3's attention-logit soft-capping (``tanh(s / cap) * cap``, computed eagerly since SDPA
has no such hook). Shapes are commented ``# (B, H, T, D)`` as in nanoGPT.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .blocks import RMSNorm, apply_rope


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                    softcap: float | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale [softcapped] + mask) v`` as transformers' ``eager_attention_forward``.

    Args:
        q: ``(B, H, T, Dk)``; k: ``(B, Hkv, L, Dk)``; v: ``(B, Hkv, L, Dv)`` (``H % Hkv == 0``).
        mask: bool ``(B, 1, T, L)``, True where a key is visible.

    Returns:
        ``(B, H, T, Dv)`` in ``q.dtype`` (softmax in float32).
    """
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(2, 3)) * scale  # (B, H, T, L)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)


class Attention:
    """GQA self-attention of one layer.

    Args:
        lin: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` -> Linear.
        n_heads, n_kv_heads, head_dim: geometry (``n_heads % n_kv_heads == 0``).
        scale: softmax scale.
        rope_layout: ``half`` | ``pairs`` (see :func:`~compressor.runtime.blocks.apply_rope`).
        q_norm, k_norm: per-head RMSNorms applied before RoPE (or None).
        softcap: attention-logit soft-capping (None: off).
        window: sliding window in tokens (None: full attention); picks the decoder's mask.
        rope_key: which of the decoder's rotary embeddings this layer uses.
    """

    def __init__(self, index: int, lin: dict, n_heads: int, n_kv_heads: int, head_dim: int, scale: float,
                 rope_layout: str = "half", q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                 softcap: float | None = None, window: int | None = None, rope_key=None):
        self.index, self.lin = index, lin
        self.n_heads, self.n_kv_heads, self.head_dim, self.scale = n_heads, n_kv_heads, head_dim, scale
        self.rope_layout, self.q_norm, self.k_norm = rope_layout, q_norm, k_norm
        self.softcap, self.window, self.rope_key = softcap, window, rope_key

    def norms(self) -> dict:
        """Relative name -> RMSNorm (for byte accounting)."""
        return {n: m for n, m in (("q_norm", self.q_norm), ("k_norm", self.k_norm)) if m is not None}

    def __call__(self, h, ropes, masks, cache, start, n_new):
        B, T, _ = h.shape
        q = self.lin["q_proj"](h).view(B, T, self.n_heads, self.head_dim)
        k = self.lin["k_proj"](h).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.lin["v_proj"](h).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D)
        cos, sin = ropes[self.rope_key]
        c, sn = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, R)
        q, k = apply_rope(q, c, sn, self.rope_layout), apply_rope(k, c, sn, self.rope_layout)
        keys, values = cache.update(self.index, k, v, start, n_new)  # (B, Hkv, L, D) dequantized
        mask = masks[self.window]
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if self.softcap:
            o = eager_attention(q, keys, values, mask, self.scale, self.softcap)
        else:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale,
                                               enable_gqa=self.n_heads != self.n_kv_heads)  # (B, H, T, D)
        return self.lin["o_proj"](o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
