"""What a model's KV cache holds per token and layer (GQA keys and values per KV head, or MLA's
latent and RoPE key), read from its config; and the per-pair key basis a ``key_rotation:
pairs`` artifact stores its keys in.

Data below :mod:`compressor.arch` and :mod:`compressor.recipe` (both ask it), above only
:mod:`compressor.kv_schemes`. The cache itself, observers and accounting are in
:mod:`compressor.quant.kv`; MLA: DeepSeek-V2, arXiv:2405.04434, section 2.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError
from .kv_schemes import KVSpec


@dataclass(frozen=True)
class KVComponent:
    """One of the two tensors a cache layer stores per token: ``heads x width`` elements;
    ``kind`` ``k`` (KIVI: per channel, groups of tokens) or ``v`` (per token, groups of channels)."""

    name: str
    heads: int
    width: int
    kind: str


@dataclass(frozen=True)
class KVLayout:
    """What the KV cache of one model holds per token and layer.

    ``components``: the two tensors transformers passes to ``Cache.update`` (GQA: keys
    ``[B, kv_heads, T, head_dim]`` and values; MLA: the latent ``[B, 1, T, kv_lora_rank]``
    and the RoPE key ``[B, 1, T, qk_rope_head_dim]``). ``shared_scale``: one static scale
    covers both (MLA, as vLLM's MLA cache).
    """

    attention: str
    n_layers: int
    components: tuple[KVComponent, KVComponent]
    shared_scale: bool = False

    @property
    def kinds(self) -> tuple[str, str]:
        """KIVI grouping of the two cache slots: ``k`` per channel, ``v`` per token."""
        return self.components[0].kind, self.components[1].kind

    def describe(self) -> str:
        """One line, e.g. ``mla: 61 layers x (latent 1x512 + rope key 1x64) per token``."""
        parts = " + ".join(f"{c.name} {c.heads}x{c.width}" for c in self.components)
        return f"{self.attention}: {self.n_layers} layers x ({parts}) per token"

    def as_dict(self) -> dict:
        """JSON form for the manifest's ``kv_cache.layout`` and verify's report."""
        return {"attention": self.attention, "layers": self.n_layers, "shared_scale": self.shared_scale,
                "components": [{"name": c.name, "heads": c.heads, "width": c.width,
                                "kivi_grouping": "per channel" if c.kind == "k" else "per token"}
                               for c in self.components]}


def gqa_layout(n_layers: int, kv_heads: int, head_dim: int, v_head_dim: int | None = None) -> KVLayout:
    """Keys and values per KV head (MHA/GQA/MQA)."""
    return KVLayout("gqa", int(n_layers), (KVComponent("key", int(kv_heads), int(head_dim), "k"),
                                           KVComponent("value", int(kv_heads), int(v_head_dim or head_dim), "v")))


def mla_layout(n_layers: int, kv_lora_rank: int, qk_rope_head_dim: int) -> KVLayout:
    """Multi-head latent attention: the latent and the decoupled RoPE key (module docstring)."""
    return KVLayout("mla", int(n_layers), (KVComponent("latent", 1, int(kv_lora_rank), "k"),
                                           KVComponent("rope key", 1, int(qk_rope_head_dim), "k")), shared_scale=True)


def kv_layout(config, attention: str = "gqa") -> KVLayout:
    """The :class:`KVLayout` of a transformers config (``attention``: the arch row's ``kv``).

    Raises:
        InputError: the config lacks the fields the layout needs.
    """
    try:
        n = int(config.num_hidden_layers)
        if attention == "mla":
            return mla_layout(n, config.kv_lora_rank, config.qk_rope_head_dim)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return gqa_layout(n, kv_heads, head_dim)
    except (AttributeError, TypeError, ValueError) as e:
        raise InputError(f"config lacks a field the KV-cache layout needs ({e})") from None


def check_layout(spec: KVSpec, layout: KVLayout) -> None:
    """Refuse a scheme the layout cannot hold.

    Raises:
        InputError: a per-head strategy on an MLA cache (it has no KV heads).
    """
    if layout.attention == "mla" and spec.codec.per_head:
        raise InputError(f"KV scheme {spec.describe()}: multi-head latent attention caches one latent shared by all "
                         "heads, so per-head scales do not apply; use fp8 (tensor), int8 (token) or int4/int2 (kivi)")


def turn_keys(k: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Keys ``k [B, kv_heads, T, d]`` (post-RoPE) with each head's pair ``p`` multiplied by
    ``z [kv_heads, d/2]`` (complex), computed in float32 and returned in ``k``'s dtype: the
    reference model's keys in an artifact's key basis (``kvq verify``'s KV-only figures)."""
    p = k.shape[-1] // 2
    zr, zi = z.real.float().view(1, -1, 1, p).to(k.device), z.imag.float().view(1, -1, 1, p).to(k.device)
    a, b = k[..., :p].float(), k[..., p:].float()
    return torch.cat([zr * a - zi * b, zi * a + zr * b], -1).to(k.dtype)
