"""A compact llama-family decoder that runs an artifact's packed weights.

Embedding -> N x [RMSNorm -> GQA attention (RoPE with the model's scaling config; Qwen3
q/k norms and Qwen2 q/k/v biases when the checkpoint has them; sliding windows where the
config sets them) -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> head
(tied to the embedding or not). Shapes are commented ``# (B, H, T, D)`` as in nanoGPT.
The arithmetic mirrors transformers' Llama (RMSNorm in float32, ``rotate_half`` RoPE
from the same ``ROPE_INIT_FUNCTIONS``), so float weights give transformers' logits.

:func:`load_decoder` reads ``config.json`` and the safetensors shards tensor by tensor
(memory-mapped): float tensors become compute-dtype tensors, packed Linears become
:class:`~compressor.runtime.weights.QuantWeight` codes handed to
:func:`~compressor.runtime.linear.make_linear`; no dequantized copy of the model is built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..arch import ARCHITECTURES, ArchSpec, get_arch
from ..errors import InputError
from .linear import Linear, check_backend, make_linear
from .weights import MARKER, PACKED_LEAVES, read_quant_weight

#: RoPE types whose frequencies do not depend on the sequence length (``dynamic`` and
#: ``longrope`` rescale with the current length, which this runtime does not do)
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class DecoderSpec:
    """The geometry of a decoder, from ``config.json`` (via transformers' ``AutoConfig``)."""

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
    sliding_windows: tuple = field(default=())  # per layer: window or None

    @classmethod
    def from_config(cls, cfg) -> "DecoderSpec":
        """Raises InputError: a missing field or GQA heads that do not divide."""
        try:
            n_heads = int(cfg.num_attention_heads)
            n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
            head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
            n_layers = int(cfg.num_hidden_layers)
            windows = [None] * n_layers
            sw = getattr(cfg, "sliding_window", None)
            layer_types = getattr(cfg, "layer_types", None)
            if sw:
                if layer_types:
                    windows = [int(sw) if t == "sliding_attention" else None for t in layer_types]
                elif cfg.model_type == "mistral":
                    windows = [int(sw)] * n_layers
            spec = cls(cfg.model_type, int(cfg.vocab_size), int(cfg.hidden_size), n_layers, n_heads, n_kv, head_dim,
                       float(getattr(cfg, "rms_norm_eps", 1e-6)), str(getattr(cfg, "hidden_act", "silu")),
                       bool(getattr(cfg, "tie_word_embeddings", False)),
                       int(getattr(cfg, "max_position_embeddings", 0) or 0), tuple(windows))
        except (AttributeError, TypeError, ValueError) as e:
            raise InputError(f"config.json lacks a field the runtime needs ({e})") from None
        if n_heads % n_kv:
            raise InputError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
        return spec


class RMSNorm:
    """``weight * x / sqrt(mean(x^2) + eps)``, normalized in float32 (as transformers' LlamaRMSNorm)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dt)


def rope_frequencies(cfg) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim/2] float32, attention_scaling)`` from the config's RoPE parameters.

    Uses transformers' own ``ROPE_INIT_FUNCTIONS`` so scaled variants (linear, llama3,
    yarn) match the reference bit for bit.

    Raises:
        InputError: a length-dependent RoPE type (``dynamic``, ``longrope``) or an unknown one.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_type" not in params and params:  # per-layer-type parameters
        params = next(iter(params.values()))
    rope_type = (params or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE:
        raise InputError(f"RoPE type '{rope_type}' is not supported by the runtime (supported: {', '.join(STATIC_ROPE)})")
    if float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0) or 1.0)) != 1.0:
        raise InputError("partial rotary embeddings (partial_rotary_factor < 1) are not supported by the runtime")
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg)
    return inv_freq.float().cpu(), float(scaling)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


#: the Linears a llama-like decoder layer has (names relative to the layer, as in compressor.arch)
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class DecoderLayer:
    """One block; ``linears`` maps the arch table's relative names to :class:`Linear` layers."""

    def __init__(self, spec: DecoderSpec, index: int, linears: dict[str, Linear], norms: dict[str, RMSNorm], act):
        self.spec, self.index, self.lin, self.norms, self.act = spec, index, linears, norms, act
        self.window = spec.sliding_windows[index] if spec.sliding_windows else None

    def __call__(self, x, cos, sin, masks, cache, start, n_new):
        s = self.spec
        B, T, _ = x.shape
        h = self.norms["input_layernorm"](x)
        q = self.lin["self_attn.q_proj"](h).view(B, T, s.n_heads, s.head_dim)
        k = self.lin["self_attn.k_proj"](h).view(B, T, s.n_kv_heads, s.head_dim)
        v = self.lin["self_attn.v_proj"](h).view(B, T, s.n_kv_heads, s.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if "q_norm" in self.norms:  # Qwen3: per-head RMSNorm before RoPE
            q, k = self.norms["q_norm"](q), self.norms["k_norm"](k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D)
        c, sn = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D)
        q = q * c + _rotate_half(q) * sn
        k = k * c + _rotate_half(k) * sn
        keys, values = cache.update(self.index, k, v, start, n_new)  # (B, Hkv, L, D) dequantized
        mask = masks[self.window]
        o = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                           scale=s.head_dim ** -0.5, enable_gqa=s.n_heads != s.n_kv_heads)  # (B, H, T, D)
        x = x + self.lin["self_attn.o_proj"](o.transpose(1, 2).reshape(B, T, s.n_heads * s.head_dim))
        h = self.norms["post_attention_layernorm"](x)
        return x + self.lin["mlp.down_proj"](self.act(self.lin["mlp.gate_proj"](h)) * self.lin["mlp.up_proj"](h))


class Decoder:
    """The whole model. ``forward`` runs one step for a batch against a :class:`~compressor.runtime.kv_cache.KVCache`."""

    def __init__(self, spec: DecoderSpec, embed: torch.Tensor, layers: list[DecoderLayer], norm: RMSNorm,
                 lm_head: Linear, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype,
                 device: torch.device, layers_path: str = "model.layers", lm_head_name: str = "lm_head"):
        self.spec, self.embed, self.layers, self.norm, self.lm_head = spec, embed, layers, norm, lm_head
        self.layers_path, self.lm_head_name = layers_path, lm_head_name
        self.inv_freq, self.attention_scaling = inv_freq.to(device), attention_scaling
        self.dtype, self.device = dtype, device

    def linears(self) -> dict[str, Linear]:
        """Full module name -> layer (for reports of which kernel serves what)."""
        out = {}
        for layer in self.layers:
            for name, lin in layer.lin.items():
                out[f"{self.layers_path}.{layer.index}.{name}"] = lin
        out[self.lm_head_name] = self.lm_head
        return out

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos[..., None].float() * self.inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(self.dtype), (emb.sin() * self.attention_scaling).to(self.dtype)

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
        cos, sin = self._rope(pos)
        length = int((start + n_new).max())
        kpos = torch.arange(length, device=self.device)[None, None, :]  # (1, 1, L)
        qpos = pos[:, :, None]  # (B, T, 1)
        valid = (kpos <= qpos) & (kpos < (start + n_new).to(self.device)[:, None, None])
        masks = {w: (valid if w is None else valid & (kpos > qpos - w))[:, None] for w in set(self.spec.sliding_windows) | {None}}
        x = F.embedding(ids.to(self.device), self.embed)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin, masks, cache, start, n_new)
        cache.commit(n_new)
        if last_only:
            x = x[torch.arange(B, device=self.device), (n_new - 1).clamp(min=0).to(self.device)]  # (B, C)
        return self.lm_head(self.norm(x))


# ---------------------------------------------------------------------------------------
# loading


@dataclass
class LoadInfo:
    """What :func:`load_decoder` found: format, kernels per module, fallbacks, bytes."""

    quant_method: str | None
    kernels: dict[str, str]
    fallbacks: dict[str, str]
    weight_bytes: int
    config: object = None


def _read_config(folder: Path) -> tuple[dict, object]:
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise InputError(f"{folder} has no config.json")
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{folder}/config.json: {e}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{folder}/config.json must be a JSON object")
    check_servable(str(raw.get("model_type")))
    try:
        cfg = AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many types for a bad config
        raise InputError(f"{folder}/config.json: {str(e).splitlines()[0]}") from None
    return raw, cfg


def check_servable(model_type: str) -> None:
    """Refuse, in one line, an architecture the runtime does not run (the arch row's ``runtime`` flag).

    Raises:
        InputError: not in the architecture table (lists the supported ones), or in it
            but not served by this runtime (MoE, MLA, Gemma's and GLM's norm layouts;
            lists the served ones and points to ``kvq verify``).
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


class _Tensors:
    """Name -> tensor over the artifact's shards, opened memory-mapped, read one tensor at a time."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        from ..safetensors_io import read_header

        shards = sorted(folder.glob("*.safetensors"))
        if not shards:
            raise InputError(f"{folder} has no .safetensors file")
        self.files = []
        self.where: dict[str, int] = {}
        for s in shards:
            read_header(s)  # hostile headers are refused before safetensors parses them
            f = safe_open(str(s), framework="pt")
            for key in f.keys():
                self.where[key] = len(self.files)
            self.files.append(f)
        self.folder = folder

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise InputError(f"{self.folder}: tensor {name} is missing")
        return self.files[self.where[name]].get_tensor(name)

    def leaves(self, module: str, leaves: tuple[str, ...]) -> dict[str, torch.Tensor]:
        return {leaf: self.get(f"{module}.{leaf}") for leaf in leaves if f"{module}.{leaf}" in self}


def _float(t: torch.Tensor, device, dtype) -> torch.Tensor:
    return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)


def load_decoder(folder: str | Path, device: str | torch.device = "cpu", backend: str = "auto",
                 dtype: torch.dtype | None = None, act_dtype: torch.dtype | None = None) -> tuple[Decoder, LoadInfo]:
    """Build a :class:`Decoder` from an artifact (or a plain float safetensors model folder).

    Args:
        folder: holds ``config.json`` and ``*.safetensors`` (compressed-tensors
            ``pack-quantized``, AutoAWQ GEMM, GPTQ v1/v2, or float).
        device: ``cpu`` or ``cuda[:i]``.
        backend: ``auto`` | ``aten`` | ``dequant`` | ``triton`` (see :mod:`compressor.runtime.linear`).
        dtype: compute dtype (default float32 on CPU; on CUDA the artifact's bfloat16 if
            so stored, else float16).
        act_dtype: activation dtype inside aten/Triton kernels (see :func:`make_linear`).

    Raises:
        InputError: missing files, hostile headers, an unsupported architecture,
            quantization method or RoPE type, missing or inconsistent tensors, a backend
            that cannot run on ``device``.
    """
    folder = Path(folder)
    device = torch.device(device)
    check_backend(backend, device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda but torch sees no CUDA device")
    raw, cfg = _read_config(folder)
    arch: ArchSpec = get_arch(cfg.model_type)
    spec = DecoderSpec.from_config(cfg)
    inv_freq, scaling = rope_frequencies(cfg)
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else (
            torch.bfloat16 if str(raw.get("dtype", raw.get("torch_dtype"))) == "bfloat16" else torch.float16)
    qc = raw.get("quantization_config") or {}
    method = qc.get("quant_method")
    if qc and method not in PACKED_LEAVES:
        raise InputError(f"{folder}: quant_method {method!r} is not one the runtime reads (compressed-tensors, awq, gptq)")
    if method == "compressed-tensors" and qc.get("format") not in ("pack-quantized", "dense"):
        raise InputError(f"{folder}: only compressed-tensors pack-quantized artifacts can be served (format {qc.get('format')!r})")
    from transformers.activations import ACT2FN

    if spec.hidden_act not in ACT2FN:
        raise InputError(f"activation {spec.hidden_act!r} is unknown")
    act = ACT2FN[spec.hidden_act]
    tensors = _Tensors(folder)
    marker = MARKER.get(method)
    kernels, fallbacks = {}, {}

    def linear(name: str) -> Linear:
        bias = tensors.get(f"{name}.bias") if f"{name}.bias" in tensors else None
        if marker and f"{name}.{marker}" in tensors:
            w = read_quant_weight(method, qc, name, tensors.leaves(name, PACKED_LEAVES[method]))
        else:
            w = tensors.get(f"{name}.weight")
        lin = make_linear(w, bias, backend, device, dtype, act_dtype)
        kernels[name] = lin.kernel
        if lin.fallback_reason:
            fallbacks[name] = lin.fallback_reason
        return lin

    embed = _float(tensors.get(f"{arch.embed_tokens}.weight"), device, dtype)
    if embed.shape != (spec.vocab_size, spec.hidden_size):
        raise InputError(f"{folder}: {arch.embed_tokens}.weight has shape {tuple(embed.shape)}, "
                         f"expected {(spec.vocab_size, spec.hidden_size)}")
    layers = []
    for i in range(spec.n_layers):
        prefix = f"{arch.layers}.{i}"
        lins = {rel: linear(f"{prefix}.{rel}") for rel in LAYER_LINEARS}
        norms = {n: RMSNorm(_float(tensors.get(f"{prefix}.{n}.weight"), device, dtype), spec.rms_norm_eps)
                 for n in ("input_layernorm", "post_attention_layernorm")}
        for n in ("q_norm", "k_norm"):
            key = f"{prefix}.{arch.attention}.{n}.weight"
            if key in tensors:
                norms[n] = RMSNorm(_float(tensors.get(key), device, dtype), spec.rms_norm_eps)
        layers.append(DecoderLayer(spec, i, lins, norms, act))
    norm = RMSNorm(_float(tensors.get(f"{arch.final_norm}.weight"), device, dtype), spec.rms_norm_eps)
    head_stored = f"{arch.lm_head}.weight" in tensors or (marker and f"{arch.lm_head}.{marker}" in tensors)
    if spec.tie_word_embeddings and not head_stored:
        from .linear import FloatLinear

        head = FloatLinear(embed)
        kernels[arch.lm_head] = head.kernel
    else:
        head = linear(arch.lm_head)
    dec = Decoder(spec, embed, layers, norm, head, inv_freq, scaling, dtype, device, arch.layers, arch.lm_head)
    return dec, LoadInfo(method, kernels, fallbacks, _weight_bytes(dec, embed), cfg)


def _weight_bytes(dec: Decoder, embed: torch.Tensor) -> int:
    total = embed.numel() * embed.element_size()
    for lin in dec.linears().values():
        stored = [t for t in lin._stored() if t is not None and t is not embed]
        total += sum(t.numel() * t.element_size() for t in stored)
    for layer in dec.layers:
        total += sum(n.weight.numel() * n.weight.element_size() for n in layer.norms.values())
    return total + dec.norm.weight.numel() * dec.norm.weight.element_size()
