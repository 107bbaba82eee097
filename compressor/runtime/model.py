"""A compact decoder that runs an artifact's packed weights, for every served row of the
architecture table.

Embedding (``* sqrt(hidden)`` on Gemma) -> N x [norm -> attention -> (output norm) ->
residual -> norm -> MLP -> (output norm) -> residual] -> norm -> head (tied to the embedding
or not) -> (soft-capping). Attention is GQA (:mod:`~compressor.runtime.attention`) or
multi-head latent attention (:mod:`~compressor.runtime.mla`); the MLP is dense SwiGLU/GeGLU,
GLM-4's fused ``gate_up_proj`` (:mod:`~compressor.runtime.blocks`) or a mixture of experts
(:mod:`~compressor.runtime.moe`). The norm roles of a layer come from the norms its
checkpoint stores (:data:`NORM_LAYOUTS`). The arithmetic mirrors transformers' modules, so
float weights give transformers' logits.

:func:`load_decoder` (:mod:`~compressor.runtime.loader`) reads ``config.json`` and the
safetensors shards tensor by tensor (memory-mapped): packed Linears become runtime kernels
over their integer codes; no dequantized copy of the model is built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..arch import ARCHITECTURES, get_arch
from ..errors import InputError
from .blocks import STATIC_ROPE, RMSNorm, Rotary, rope_frequencies  # noqa: F401  (re-exported)
from .linear import Linear

#: (marker norm, role -> norm name): the first layout whose marker a layer stores is its
#: layout. ``attn_in``/``mlp_in`` normalize a sublayer's input; ``attn_out``/``mlp_out`` its
#: output before the residual add (Gemma 2/3's sandwich norms, GLM-4's post-sublayer norms).
NORM_LAYOUTS: tuple[tuple[str | None, dict[str, str]], ...] = (
    ("pre_feedforward_layernorm", {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
                                   "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"}),
    ("post_self_attn_layernorm", {"attn_in": "input_layernorm", "attn_out": "post_self_attn_layernorm",
                                  "mlp_in": "post_attention_layernorm", "mlp_out": "post_mlp_layernorm"}),
    (None, {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"}),
)


@dataclass(frozen=True)
class DecoderSpec:
    """The geometry of a decoder, from ``config.json`` (via transformers' ``AutoConfig``).

    ``kv``: the arch row's cache layout (``gqa`` | ``mla``); ``kv_widths``: on MLA
    ``(kv_lora_rank, qk_rope_head_dim)``. ``sliding_windows``: per layer, window or None.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_windows: tuple = field(default=())
    kv: str = "gqa"
    kv_widths: tuple = field(default=())
    final_logit_softcapping: float | None = None
    #: longest sequence for which the dense attention computed here is exact (DeepSeek sparse
    #: attention's ``index_topk``); ``None``: no such bound
    dense_limit: int | None = None

    @classmethod
    def from_config(cls, cfg, kv: str = "gqa", dense_field: str | None = None) -> "DecoderSpec":
        """Raises InputError: a missing field, GQA heads that do not divide, router or
        sliding-window fields that contradict the experts (:func:`compressor.source.config_check.check_routing`)."""
        from ..source.config_check import check_routing, text_config

        if hasattr(cfg, "to_dict"):
            check_routing(text_config(cfg.to_dict()))
        try:
            n_heads = int(cfg.num_attention_heads)
            n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
            head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
            n_layers = int(cfg.num_hidden_layers)
            windows = [None] * n_layers
            sw = getattr(cfg, "sliding_window", None)
            layer_types = getattr(cfg, "layer_types", None)
            if sw:  # per layer type (Gemma 3, Qwen2/3), else every layer (Mistral, Mixtral, Qwen3-MoE)
                windows = [int(sw) if t == "sliding_attention" else None for t in layer_types] if layer_types \
                    else [int(sw)] * n_layers
            act = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None) or "silu"
            widths = (int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)) if kv == "mla" else ()
            cap = getattr(cfg, "final_logit_softcapping", None)
            spec = cls(cfg.model_type, int(cfg.vocab_size), int(cfg.hidden_size), n_layers, n_heads, n_kv, head_dim,
                       float(getattr(cfg, "rms_norm_eps", 1e-6)), str(act),
                       bool(getattr(cfg, "tie_word_embeddings", False)),
                       int(getattr(cfg, "max_position_embeddings", 0) or 0), tuple(windows), kv, widths,
                       None if cap is None else float(cap),
                       None if dense_field is None else int(getattr(cfg, dense_field)))
        except (AttributeError, TypeError, ValueError) as e:
            raise InputError(f"config.json lacks a field the runtime needs ({e})") from None
        if n_heads % n_kv:
            raise InputError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
        return spec


class DecoderLayer:
    """One block: ``attn`` (GQA or MLA), ``mlp`` (dense or MoE), ``norms`` by role (:data:`NORM_LAYOUTS`)."""

    def __init__(self, index: int, attn, mlp, norms: dict[str, RMSNorm], names: dict[str, str],
                 attention: str = "self_attn"):
        self.index, self.attn, self.mlp, self.norms, self.names = index, attn, mlp, norms, names
        self.attention = attention
        self.window = getattr(attn, "window", None)

    @property
    def lin(self) -> dict[str, Linear]:
        """Relative module name -> Linear (attention, then MLP; MoE experts expanded)."""
        out = {f"{self.attention}.{n}": lin for n, lin in self.attn.lin.items()}
        out.update({f"mlp.{n}": lin for n, lin in self.mlp.linears().items()})
        return out

    def all_norms(self) -> list[RMSNorm]:
        """Every norm of the layer (block norms, q/k or MLA norms)."""
        return list(self.norms.values()) + list(self.attn.norms().values())

    def __call__(self, x, ropes, masks, cache, start, n_new):
        n = self.norms
        a = self.attn(n["attn_in"](x), ropes, masks, cache, start, n_new)
        x = x + (n["attn_out"](a) if "attn_out" in n else a)
        m = self.mlp(n["mlp_in"](x))
        return x + (n["mlp_out"](m) if "mlp_out" in n else m)


class Decoder:
    """The whole model. ``forward`` runs one step for a batch against a runtime KV cache.

    Args:
        rotaries: rotary key (None, or Gemma's layer type) -> :class:`~compressor.runtime.blocks.Rotary`.
        embed_scale: multiply the embedding by this (Gemma: ``sqrt(hidden)``), or None.
    """

    def __init__(self, spec: DecoderSpec, embed: torch.Tensor, layers: list[DecoderLayer], norm: RMSNorm,
                 lm_head: Linear, rotaries: dict, dtype: torch.dtype, device: torch.device,
                 layers_path: str = "model.layers", lm_head_name: str = "lm_head", embed_scale: float | None = None):
        self.spec, self.embed, self.layers, self.norm, self.lm_head = spec, embed, layers, norm, lm_head
        self.layers_path, self.lm_head_name, self.rotaries = layers_path, lm_head_name, rotaries
        self.dtype, self.device = dtype, device
        self.embed_scale = None if embed_scale is None else torch.tensor(embed_scale, dtype=dtype, device=device)

    def linears(self) -> dict[str, Linear]:
        """Full module name -> layer (for reports of which kernel serves what)."""
        out = {}
        for layer in self.layers:
            for name, lin in layer.lin.items():
                out[f"{self.layers_path}.{layer.index}.{name}"] = lin
        out[self.lm_head_name] = self.lm_head
        return out

    def new_cache(self, spec, scales, batch: int, max_len: int):
        """A preallocated cache of scheme ``spec`` (None: float) shaped for this model (GQA or MLA)."""
        from .kv_cache import make_cache
        from .mla import make_mla_cache

        s = self.spec
        # a quantized cache decodes straight into the dtype attention runs in (float32 on CPU)
        dt = torch.float32 if spec is not None and self.device.type == "cpu" else self.dtype
        if s.kv == "mla":
            return make_mla_cache(spec, scales, s.n_layers, batch, max_len, *s.kv_widths, dt, self.device)
        return make_cache(spec, scales, s.n_layers, batch, s.n_kv_heads, max_len, s.head_dim, dt, self.device)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache, n_new: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """One step.

        Args:
            ids: int64 ``[B, T]``; row ``b`` holds ``n_new[b]`` real tokens, then padding.
            cache: a KV cache with ``cache.batch == B``; its ``lengths`` are the positions
                the new tokens start at.
            n_new: int64 ``[B]`` (default: ``T`` for every row).
            last_only: return only the logits of each row's last real token.

        Returns:
            float logits ``[B, T, vocab]`` (``[B, vocab]`` with ``last_only``) in the compute dtype.

        Raises:
            InputError: the cache is too small for the step or holds another batch size.
        """
        B, T = ids.shape
        if B != cache.batch:
            raise InputError(f"batch of {B} sequences but the KV cache holds {cache.batch}")
        n_new = torch.full((B,), T, dtype=torch.long) if n_new is None else n_new.cpu().long()
        cache.check_room(n_new)
        start = cache.lengths.clone()
        pos = (start[:, None] + torch.arange(T)[None, :]).to(self.device)  # (B, T)
        ropes = {key: rot(pos) for key, rot in self.rotaries.items()}
        length = int((start + n_new).max())
        kpos = torch.arange(length, device=self.device)[None, None, :]  # (1, 1, L)
        qpos = pos[:, :, None]  # (B, T, 1)
        valid = (kpos <= qpos) & (kpos < (start + n_new).to(self.device)[:, None, None])
        masks = {w: (valid if w is None else valid & (kpos > qpos - w))[:, None] for w in set(self.spec.sliding_windows) | {None}}
        x = F.embedding(ids.to(self.device), self.embed)  # (B, T, C)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for layer in self.layers:
            x = layer(x, ropes, masks, cache, start, n_new)
        cache.commit(n_new)
        if last_only:
            x = x[torch.arange(B, device=self.device), (n_new - 1).clamp(min=0).to(self.device)]  # (B, C)
        logits = self.lm_head(self.norm(x))
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


@dataclass
class LoadInfo:
    """What :func:`load_decoder` found: format, kernels per module, fallbacks, bytes."""

    quant_method: str | None
    kernels: dict[str, str]
    fallbacks: dict[str, str]
    weight_bytes: int
    config: object = None


def check_servable(model_type: str) -> None:
    """Refuse, in one line, an architecture the runtime does not run (the arch row's ``runtime`` flag).

    Raises:
        InputError: not in the architecture table (lists the supported ones), or in it
            but not served by this runtime (lists the served ones and points to ``kvq verify``).
    """
    arch = get_arch(model_type)
    if not arch.runtime:
        served = sorted(k for k, a in ARCHITECTURES.items() if a.runtime)
        raise InputError(f"the bundled runtime does not serve architecture '{model_type}' (it serves {', '.join(served)}); "
                         "check this artifact with kvq verify")


def check_servable_folder(folder: str | Path) -> None:
    """:func:`check_servable` for an artifact folder's ``config.json`` (a missing or bad one is left to the loader)."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(raw, dict):
        check_servable(str(raw.get("model_type")))
