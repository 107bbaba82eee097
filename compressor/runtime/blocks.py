"""Building blocks of the runtime's decoder: RMSNorms, rotary embeddings, gated MLPs, per-row traits.

Every block mirrors transformers' arithmetic for the rows it serves, so float weights give
transformers' logits to float32 rounding:

=======================  ==================================================================
block                    transformers counterpart
=======================  ==================================================================
:class:`RMSNorm`         ``LlamaRMSNorm`` (``weight * x_hat`` with ``x_hat`` cast back to the
                         input dtype first) or, with ``offset=1``, ``Gemma3RMSNorm``
                         (``x_hat * (1 + weight)`` in float32, then cast)
:class:`Rotary`          each model's ``*RotaryEmbedding`` (``ROPE_INIT_FUNCTIONS``; partial
                         rotary ``dim = head_dim * partial_rotary_factor``; per-layer-type
                         parameters as Gemma 3's sliding/full layers)
:func:`apply_rope`       ``apply_rotary_pos_emb`` in its three layouts: ``half`` (Llama's
                         ``rotate_half`` over the first ``rotary_dim`` channels, GLM-4-MoE's
                         partial rotary), ``pairs`` (GLM-4: interleaved pairs, cos/sin
                         repeated per pair), ``deinterleave`` (DeepSeek-V3's
                         ``apply_rotary_pos_emb_interleave``: pairs in, evens then odds out)
:class:`GatedMLP`        ``down(act(gate(x)) * up(x))`` (SwiGLU / GeGLU)
:class:`FusedGatedMLP`   GLM-4's ``gate_up_proj`` (gate rows, then up rows)
=======================  ==================================================================

:data:`ROW_TRAITS` holds what transformers hard-codes in a row's modeling file rather than in
``config.json`` (Gemma's embedding scale, GLM-4's interleaved rotary pairs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError

#: RoPE types whose frequencies do not depend on the sequence length (``dynamic`` and
#: ``longrope`` rescale with the current length, which this runtime does not do)
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class RowTraits:
    """What a row's transformers modeling code fixes outside ``config.json``.

    ``rope``: the rotary layout of GQA attention (:func:`apply_rope`); ``mla_rope``: the
    rotary layout of MLA attention when the modeling code fixes it (DeepSeek-V3.2 and GLM-5
    always call ``apply_rotary_pos_emb_interleave``), ``None``: ``config.rope_interleave``
    decides (DeepSeek-V3, Kimi K2, GLM-4.7-Flash); ``embed_scale``: the embedding is multiplied
    by ``sqrt(hidden_size)`` (rounded to the compute dtype, as ``Gemma3TextScaledWordEmbedding``).
    """

    rope: str = "half"
    mla_rope: str | None = None
    embed_scale: bool = False


#: model_type -> traits; rows not listed use the defaults (Llama's layout)
ROW_TRAITS: dict[str, RowTraits] = {
    "gemma3_text": RowTraits(embed_scale=True),
    "glm4": RowTraits(rope="pairs"),
    "deepseek_v32": RowTraits(mla_rope="deinterleave"),
    "glm_moe_dsa": RowTraits(mla_rope="deinterleave"),
}


def row_traits(model_type: str) -> RowTraits:
    """:data:`ROW_TRAITS` entry of ``model_type`` (the defaults when it has none)."""
    return ROW_TRAITS.get(model_type, RowTraits())


class RMSNorm:
    """Root-mean-square norm over the last dim, normalized in float32.

    ``offset=0`` (Llama): ``weight * (x_hat cast to x.dtype)``; ``offset=1`` (Gemma):
    ``(x_hat * (1 + weight)) cast to x.dtype`` with the product in float32.
    """

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0):
        self.weight, self.eps, self.offset = weight, eps, float(offset)
        self.gain = None if not self.offset else self.offset + weight.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gain is not None:
            return (h * self.gain).to(dt)
        return self.weight * h.to(dt)


# ---------------------------------------------------------------------------------------
# rotary embeddings


def _rope_params(cfg, layer_type: str | None) -> dict:
    params = getattr(cfg, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return params[layer_type]
    if isinstance(params, dict) and "rope_type" not in params and params:  # per-layer-type, no type asked
        return next(iter(params.values()))
    return params


def rope_frequencies(cfg, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim/2] float32, attention_scaling)`` from the config's RoPE parameters.

    ``rotary_dim = head_dim * partial_rotary_factor`` (GLM-4: half the head). Scaled
    variants (linear, llama3, yarn) come from transformers' own ``ROPE_INIT_FUNCTIONS``,
    so they match the reference bit for bit; ``layer_type`` selects Gemma 3's per-layer-type
    parameters (``sliding_attention`` / ``full_attention``).

    Raises:
        InputError: a length-dependent RoPE type (``dynamic``, ``longrope``) or an unknown one.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _rope_params(cfg, layer_type)
    rope_type = (params or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE:
        raise InputError(f"RoPE type '{rope_type}' is not supported by the runtime (supported: {', '.join(STATIC_ROPE)})")
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        factor = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))
        dim = int(head_dim * factor)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    kw = {"layer_type": layer_type} if layer_type is not None and isinstance(
        (getattr(cfg, "rope_parameters", None) or {}).get(layer_type), dict) else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, None, **kw)
    return inv_freq.float().cpu(), float(scaling)


class Rotary:
    """``cos, sin [B, T, rotary_dim]`` for positions, as a model's ``*RotaryEmbedding.forward``."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype, device):
        self.inv_freq, self.scaling, self.dtype = inv_freq.to(device), attention_scaling, dtype

    def __call__(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos[..., None].float() * self.inv_freq  # (B, T, R/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(self.dtype), (emb.sin() * self.scaling).to(self.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate the first ``rotary_dim = cos.shape[-1]`` channels of ``x`` ``(B, H, T, D)``.

    ``cos``/``sin`` are ``(B, 1, T, rotary_dim)`` (``cat(freqs, freqs)``); ``layout`` is one
    of ``half`` | ``pairs`` | ``deinterleave`` (module table). Channels past ``rotary_dim``
    pass through (partial rotary).
    """
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    if layout == "half":
        out = rot * cos + _rotate_half(rot) * sin
    elif layout == "pairs":
        c = cos[..., : r // 2].repeat_interleave(2, dim=-1)
        s = sin[..., : r // 2].repeat_interleave(2, dim=-1)
        out = rot * c + _rotate_pairs(rot) * s
    elif layout == "deinterleave":
        c, s = cos[..., : r // 2], sin[..., : r // 2]
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        raise InputError(f"unknown rotary layout {layout!r}")
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


# ---------------------------------------------------------------------------------------
# MLPs


class GatedMLP:
    """``down(act(gate(x)) * up(x))``; ``lin`` maps ``gate_proj``/``up_proj``/``down_proj`` to Linears."""

    def __init__(self, gate, up, down, act):
        from .linear import FusedDecode

        self.gate, self.up, self.down, self.act = gate, up, down, act
        self.fused = FusedDecode.of([gate, up])  # one decode call for gate and up (None: not fusable)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            g, u = self.fused.outputs(x)
            return self.down(self.act(g) * u)
        return self.down(self.act(self.gate(x)) * self.up(x))

    def linears(self) -> dict:
        """Relative name -> Linear."""
        return {"gate_proj": self.gate, "up_proj": self.up, "down_proj": self.down}


class FusedGatedMLP:
    """GLM-4: ``gate, up = gate_up_proj(x).chunk(2)``; ``down(up * act(gate))``."""

    def __init__(self, gate_up, down, act):
        self.gate_up, self.down, self.act = gate_up, down, act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(up * self.act(gate))

    def linears(self) -> dict:
        """Relative name -> Linear."""
        return {"gate_up_proj": self.gate_up, "down_proj": self.down}
