"""Grouped-query attention of the runtime (MHA/GQA/MQA), over a preallocated KV cache.

One class serves every GQA row: optional per-head q/k RMSNorms before RoPE (Qwen3,
GLM-4-MoE's ``use_qk_norm``, Gemma 3), q/k/v biases (Qwen2, GLM-4), a rotary layout
(:func:`~compressor.runtime.blocks.apply_rope`: Llama ``half``, GLM-4 ``pairs``, partial
rotary through the width of ``cos``), the softmax scale (``head_dim ** -0.5``, Gemma's
``query_pre_attn_scalar ** -0.5``) and a sliding window (the mask the decoder builds for it).
On CPU attention itself runs in float32 (:func:`attention_dtype`), the output cast back to
the compute dtype. Gemma 3's ``attn_logit_softcapping`` is ignored, as transformers' ``Gemma3Attention`` ignores
it (only the final logits are soft-capped). Shapes are commented ``# (B, H, T, D)`` as in nanoGPT.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .blocks import RMSNorm, apply_rope
from .linear import FusedDecode


def attention_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype attention is computed in: float32 on CPU whatever the compute dtype (CPU
    half-precision attention is about 3x slower than float32 on AVX2, measured: batch 8, 60
    keys, 419 vs 132 us per layer), the compute dtype on CUDA."""
    return torch.float32 if q.device.type == "cpu" else q.dtype


class Attention:
    """GQA self-attention of one layer.

    Args:
        lin: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` -> Linear.
        n_heads, n_kv_heads, head_dim: geometry (``n_heads % n_kv_heads == 0``).
        scale: softmax scale.
        rope_layout: ``half`` | ``pairs`` (see :func:`~compressor.runtime.blocks.apply_rope`).
        q_norm, k_norm: per-head RMSNorms applied before RoPE (or None).
        window: sliding window in tokens (None: full attention); picks the decoder's mask.
        rope_key: which of the decoder's rotary embeddings this layer uses.
    """

    def __init__(self, index: int, lin: dict, n_heads: int, n_kv_heads: int, head_dim: int, scale: float,
                 rope_layout: str = "half", q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                 window: int | None = None, rope_key=None):
        self.index, self.lin = index, lin
        self.n_heads, self.n_kv_heads, self.head_dim, self.scale = n_heads, n_kv_heads, head_dim, scale
        self.rope_layout, self.q_norm, self.k_norm = rope_layout, q_norm, k_norm
        self.window, self.rope_key = window, rope_key
        self.qkv = FusedDecode.of([lin["q_proj"], lin["k_proj"], lin["v_proj"]])

    def norms(self) -> dict:
        """Relative name -> RMSNorm (for byte accounting)."""
        return {n: m for n, m in (("q_norm", self.q_norm), ("k_norm", self.k_norm)) if m is not None}

    def __call__(self, h, ropes, masks, cache, start, n_new):
        B, T, _ = h.shape
        if self.qkv is not None:  # one decode call for the three projections
            q, k, v = self.qkv.outputs(h)
        else:
            q, k, v = (self.lin[n](h) for n in ("q_proj", "k_proj", "v_proj"))
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D)
        cos, sin = ropes[self.rope_key]
        c, sn = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, R)
        # one rotation over the query and key heads together (elementwise: the same values as two)
        qk = apply_rope(torch.cat((q, k), dim=1), c, sn, self.rope_layout)
        q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
        keys, values = cache.update(self.index, k, v, start, n_new)  # (B, Hkv, L, D) dequantized
        mask = masks[self.window]
        ad = attention_dtype(q)
        o = F.scaled_dot_product_attention(q.to(ad), keys.to(ad), values.to(ad), attn_mask=mask, scale=self.scale,
                                           enable_gqa=self.n_heads != self.n_kv_heads)  # (B, H, T, D)
        return self.lin["o_proj"](o.to(h.dtype).transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
