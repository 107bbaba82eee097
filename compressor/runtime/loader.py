"""Build a runtime :class:`~compressor.runtime.model.Decoder` from an artifact folder.

:func:`load_decoder` reads ``config.json`` (through transformers' ``AutoConfig``) and the
safetensors shards tensor by tensor through an :class:`~compressor.load_integrity.ArtifactReader`:
each tensor's stored bytes are read once into the buffer it is built on (and, for ``kvq serve``
and ``kvq serve-smoke``, hashed and compared with the manifest first). Module names come from the architecture
row (:mod:`compressor.arch`) and are looked up under their checkpoint names
(:func:`~compressor.arch.checkpoint_name`: Mixtral's ``block_sparse_moe.experts.<e>.w1``).
What a layer is follows what it stores: a router (``<moe.router>.weight``) makes it a
mixture of experts (dense-first layers of DeepSeek-V3/GLM-4.5, Qwen3-MoE's
``mlp_only_layers`` have none), shared experts are used when stored, ``q_norm``/``k_norm``
when stored, the norm layout by the norms stored (:data:`~compressor.runtime.model.NORM_LAYOUTS`).
Packed Linears become :class:`~compressor.formats.base.QuantWeight` codes handed to
:func:`~compressor.runtime.linear.make_linear`; float tensors become compute-dtype tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..arch import ArchSpec, checkpoint_name, get_arch
from ..source.config_check import quantization_config
from ..errors import InputError
from .attention import Attention
from .blocks import FusedGatedMLP, GatedMLP, RMSNorm, Rotary, rope_frequencies, row_traits
from .linear import FloatLinear, Linear, check_backend, make_linear
from .mla import MLAttention, mla_scale
from .model import NORM_LAYOUTS, Decoder, DecoderLayer, DecoderSpec, LoadInfo, check_servable
from .moe import MoE, make_router
from ..formats import READ_CT_FORMATS, read_quant_weight, reader_for

#: eps of MLA's q_a_layernorm / kv_a_layernorm: transformers' DeepSeek-V3, GLM-4.7-Flash,
#: DeepSeek-V3.2 and GLM-5 modules build them with their RMSNorm's default, whatever
#: config.rms_norm_eps says
MLA_LATENT_NORM_EPS = 1e-6

#: kernel name reported for routed experts served by the grouped Triton MoE kernel
GROUPED_KERNEL = "triton-moe-w4a16"


def _read_config(folder: Path, shown: Path | None = None) -> tuple[dict, object]:
    """``(raw dict, transformers config)`` of ``folder/config.json``; errors name ``shown`` (the artifact)."""
    from ..source.resolve import load_config

    shown = shown or folder
    if not (folder / "config.json").is_file():
        raise InputError(f"{shown} has no config.json")
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{shown}/config.json: {e}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{shown}/config.json must be a JSON object")
    check_servable(str(raw.get("model_type")))
    try:
        cfg = load_config(folder)  # a multimodal wrapper's text model (Kimi K2.5: DeepSeek-V3)
    except InputError:
        raise
    except Exception as e:  # transformers raises many types for a bad config
        raise InputError(f"{shown}/config.json: {str(e).splitlines()[0]}") from None
    return raw, cfg


#: safetensors dtype -> torch dtype
TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
    "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32, "I64": torch.int64,
    "U64": torch.uint64, "F64": torch.float64,
}


class Tensors:
    """Name -> tensor over an :class:`~compressor.load_integrity.ArtifactReader`: each tensor is
    read once into a fresh buffer (checked against the manifest when the reader checks)
    and built on that very buffer, so the runtime serves the bytes that were hashed."""

    def __init__(self, reads):
        self.reads = reads
        self.folder = reads.folder

    def __contains__(self, name: str) -> bool:
        return name in self.reads

    def keys(self):
        """Every stored tensor name."""
        return self.reads.where.keys()

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` with its stored dtype and shape (CPU, owns its memory).

        Raises:
            InputError: no shard stores ``name``.
            ArtifactMismatch: its bytes differ from the manifest (checking reader).
        """
        e = self.reads.entry(name)
        buf = torch.empty(e.end - e.start, dtype=torch.uint8)
        self.reads.read_into(name, memoryview(buf.numpy()))
        return buf.view(TORCH_DTYPES[e.dtype]).reshape(e.shape)

    def leaves(self, module: str, leaves: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """``{leaf: tensor}`` for the stored ``<module>.<leaf>`` among ``leaves``."""
        return {leaf: self.get(f"{module}.{leaf}") for leaf in leaves if f"{module}.{leaf}" in self}


def _float(t: torch.Tensor, device, dtype) -> torch.Tensor:
    return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)


class _Builder:
    """Reads one artifact's modules into runtime blocks (names relative to a decoder layer)."""

    def __init__(self, tensors: Tensors, arch: ArchSpec, cfg, spec: DecoderSpec, method, qc: dict,
                 backend: str, device: torch.device, dtype: torch.dtype, act_dtype):
        self.t, self.arch, self.cfg, self.spec = tensors, arch, cfg, spec
        self.method, self.qc, self.fmt = method, qc, reader_for(method)
        self.marker = self.fmt.marker if self.fmt is not None else None
        self.backend, self.device, self.dtype, self.act_dtype = backend, device, dtype, act_dtype
        self.kernels: dict[str, str] = {}
        self.fallbacks: dict[str, str] = {}
        self.extra_bytes = 0  # float tensors outside Linears and norms (routers)
        self.act = self._activation()
        self.traits = row_traits(cfg.model_type)

    def _activation(self):
        from transformers.activations import ACT2FN

        if self.spec.hidden_act not in ACT2FN:
            raise InputError(f"activation {self.spec.hidden_act!r} is unknown")
        return ACT2FN[self.spec.hidden_act]

    # -- names and tensors ----------------------------------------------------------------
    def name(self, i: int, rel: str) -> str:
        """Checkpoint name of layer ``i``'s module ``rel``."""
        return checkpoint_name(self.arch, f"{self.arch.layers}.{i}.{rel}")

    def has_module(self, name: str) -> bool:
        return f"{name}.weight" in self.t or bool(self.marker and f"{name}.{self.marker}" in self.t)

    def linear(self, name: str) -> Linear:
        t = self.t
        bias = t.get(f"{name}.bias") if f"{name}.bias" in t else None
        if self.marker and f"{name}.{self.marker}" in t:
            w = read_quant_weight(self.method, self.qc, name, t.leaves(name, self.fmt.leaves))
        else:
            w = t.get(f"{name}.weight")
        lin = make_linear(w, bias, self.backend, self.device, self.dtype, self.act_dtype)
        self.kernels[name] = lin.kernel
        if lin.fallback_reason:
            self.fallbacks[name] = lin.fallback_reason
        return lin

    def table(self, name: str) -> torch.Tensor:
        """An embedding table ``[vocab, hidden]`` in the compute dtype: stored float, or packed
        (recipe ``embedding:``) and dequantized here, once (a tied head then reads it too)."""
        if not (self.marker and f"{name}.{self.marker}" in self.t):
            return _float(self.t.get(f"{name}.weight"), self.device, self.dtype)
        w = read_quant_weight(self.method, self.qc, name, self.t.leaves(name, self.fmt.leaves))
        return w.dequantize(self.dtype).to(self.device)

    def norm(self, name: str, offset: float | None = None, eps: float | None = None) -> RMSNorm:
        w = _float(self.t.get(f"{name}.weight"), self.device, self.dtype)
        return RMSNorm(w, self.spec.rms_norm_eps if eps is None else eps,
                       self.arch.norm_offset if offset is None else offset)

    def float_tensor(self, name: str, dtype=None) -> torch.Tensor:
        x = _float(self.t.get(name), self.device, dtype or self.dtype)
        self.extra_bytes += x.numel() * x.element_size()
        return x

    # -- blocks ---------------------------------------------------------------------------
    def rotaries(self) -> dict:
        """Rotary key -> Rotary: one per layer type when the config gives per-type parameters (Gemma 3)."""
        params = getattr(self.cfg, "rope_parameters", None) or {}
        types = getattr(self.cfg, "layer_types", None) or []
        keys = sorted({t for t in types if isinstance(params.get(t), dict)}) or [None]
        out = {}
        for key in keys:
            inv_freq, scaling = rope_frequencies(self.cfg, key)
            out[key] = Rotary(inv_freq, scaling, self.dtype, self.device)
        return out

    def rope_key(self, i: int, rotaries: dict):
        if None in rotaries:
            return None
        return self.cfg.layer_types[i]

    def attention(self, i: int, rope_key):
        s, cfg, a = self.spec, self.cfg, self.arch.attention
        if s.kv == "mla":
            rels = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
            lin = {r: self.linear(self.name(i, f"{a}.{r}")) for r in rels if self.has_module(self.name(i, f"{a}.{r}"))}
            # transformers builds the latent norms with its RMSNorm's default eps (1e-6), not
            # config.rms_norm_eps (GLM-4.7-Flash and GLM-5 publish 1e-5), in every MLA row
            q_norm = self.norm(self.name(i, f"{a}.q_a_layernorm"), eps=MLA_LATENT_NORM_EPS) if "q_a_proj" in lin else None
            dims = (s.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
            layout = row_traits(cfg.model_type).mla_rope or ("deinterleave" if getattr(cfg, "rope_interleave", False)
                                                             else "half")
            kv_norm = self.norm(self.name(i, f"{a}.kv_a_layernorm"), eps=MLA_LATENT_NORM_EPS)
            return MLAttention(i, lin, q_norm, kv_norm, dims, mla_scale(cfg),
                               layout, rope_key)
        lin = {r: self.linear(self.name(i, f"{a}.{r}")) for r in ("q_proj", "k_proj", "v_proj", "o_proj")}
        qk = [self.norm(self.name(i, f"{a}.{n}")) if self.has_module(self.name(i, f"{a}.{n}")) else None
              for n in ("q_norm", "k_norm")]
        scalar = getattr(cfg, "query_pre_attn_scalar", None)
        scale = float(scalar) ** -0.5 if scalar else s.head_dim ** -0.5
        window = s.sliding_windows[i] if s.sliding_windows else None
        return Attention(i, lin, s.n_heads, s.n_kv_heads, s.head_dim, scale, self.traits.rope, *qk,
                         window=window, rope_key=rope_key)

    def gated(self, prefix: str) -> GatedMLP:
        return GatedMLP(*(self.linear(f"{prefix}.{p}") for p in ("gate_proj", "up_proj", "down_proj")), self.act)

    def mlp(self, i: int):
        moe = self.arch.moe
        if moe is not None and f"{self.name(i, moe.router)}.weight" in self.t:
            return self.moe(i)
        if self.has_module(self.name(i, "mlp.gate_up_proj")):
            return FusedGatedMLP(self.linear(self.name(i, "mlp.gate_up_proj")), self.linear(self.name(i, "mlp.down_proj")),
                                 self.act)
        return GatedMLP(*(self.linear(self.name(i, f"mlp.{p}")) for p in ("gate_proj", "up_proj", "down_proj")), self.act)

    def moe(self, i: int) -> MoE:
        moe = self.arch.moe
        router = self.name(i, moe.router)
        bias_name = f"{router}.e_score_correction_bias"
        route_dtype = torch.float32 if getattr(self.cfg, "routed_scaling_factor", None) is not None else self.dtype
        weight = self.float_tensor(f"{router}.weight", route_dtype)
        bias = self.float_tensor(bias_name, torch.float32) if bias_name in self.t else None
        experts, e = [], 0
        while self.has_module(self.name(i, f"{moe.experts}.{e}.gate_proj")):
            experts.append(GatedMLP(*(self.linear(self.name(i, f"{moe.experts}.{e}.{p}"))
                                      for p in ("gate_proj", "up_proj", "down_proj")), self.act))
            e += 1
        if not experts:
            raise InputError(f"{self.t.folder}: layer {i} has a router but no {moe.experts}.0.gate_proj tensors")
        if weight.shape[0] != len(experts):
            raise InputError(f"{self.t.folder}: {router}.weight routes to {weight.shape[0]} experts, the layer stores {len(experts)}")
        shared_prefix = self.name(i, "mlp.shared_experts")
        shared = self.gated(shared_prefix) if self.has_module(f"{shared_prefix}.gate_proj") else None
        grouped = _grouped(experts, self.act)
        if grouped is not None:  # report what runs: one grouped launch per projection for all experts
            for e in range(len(experts)):
                for p in ("gate_proj", "up_proj", "down_proj"):
                    self.kernels[self.name(i, f"{moe.experts}.{e}.{p}")] = GROUPED_KERNEL
        return MoE(make_router(self.cfg, weight, bias), experts, shared, grouped=grouped)

    def layer(self, i: int, rope_key) -> DecoderLayer:
        stored = {n for _, roles in NORM_LAYOUTS for n in roles.values() if f"{self.name(i, n)}.weight" in self.t}
        roles = next(r for marker, r in NORM_LAYOUTS if marker is None or marker in stored)
        norms = {role: self.norm(self.name(i, n)) for role, n in roles.items()}
        attn = self.attention(i, rope_key)
        return DecoderLayer(i, attn, self.mlp(i), norms, roles, self.arch.attention)


def _grouped(experts: list[GatedMLP], act):
    """A :class:`~compressor.runtime.moe.GroupedW4Experts` when every routed expert runs the Triton
    W4A16 kernel with one shape and group size, else None (the per-expert loop)."""
    from .linear import TritonW4Linear
    from .moe import GroupedW4Experts

    lins = [lin for m in experts for lin in (m.gate, m.up, m.down)]
    if not all(isinstance(lin, TritonW4Linear) and lin.in_perm is None and lin.bias is None for lin in lins):
        return None
    shapes = {(m.gate.out_features, m.gate.in_features, m.gate.group_size, m.down.group_size) for m in experts}
    if len(shapes) != 1 or any(m.up.group_size != m.gate.group_size for m in experts):
        return None
    return GroupedW4Experts(experts, act)


def _check_method(folder: Path, qc: dict) -> str | None:
    method = qc.get("quant_method")
    if qc and reader_for(method) is None:
        raise InputError(f"{folder}: quant_method {method!r} is not one the runtime reads (compressed-tensors, awq, gptq)")
    if method == "compressed-tensors" and qc.get("format") not in READ_CT_FORMATS:
        known = ", ".join(READ_CT_FORMATS[:2] + READ_CT_FORMATS[4:])
        raise InputError(f"{folder}: only compressed-tensors {known} (and mixed-precision of "
                         f"them) artifacts can be served (format {qc.get('format')!r})")
    return method


def load_decoder(folder: str | Path, device: str | torch.device = "cpu", backend: str = "auto",
                 dtype: torch.dtype | None = None, act_dtype: torch.dtype | None = None,
                 reads=None) -> tuple[Decoder, LoadInfo]:
    """Build a :class:`~compressor.runtime.model.Decoder` from an artifact (or a plain float safetensors model folder).

    Args:
        folder: holds ``config.json`` and ``*.safetensors`` (compressed-tensors
            ``pack-quantized``, AutoAWQ GEMM, GPTQ v1/v2, or float).
        device: ``cpu`` or ``cuda[:i]``.
        backend: ``auto`` | ``aten`` | ``dequant`` | ``triton`` (see :mod:`compressor.runtime.linear`).
        dtype: compute dtype (default: :func:`compute_dtype` ``auto``, bfloat16 for a
            bfloat16 artifact, else float32 on CPU and float16 on CUDA).
        act_dtype: activation dtype inside aten/Triton kernels (see :func:`~compressor.runtime.linear.make_linear`).
        reads: the :class:`~compressor.load_integrity.ArtifactReader` to read ``folder``
            through (``config.json`` from its checked snapshot, every tensor hashed as it
            is read); default: an unchecking reader, closed on return.

    Raises:
        InputError: missing files, hostile headers, an unsupported architecture,
            quantization method or RoPE type, missing or inconsistent tensors, a backend
            that cannot run on ``device``.
        ArtifactMismatch: with a checking reader, a file or tensor that differs from the manifest.
    """
    from ..load_integrity import ArtifactReader

    folder = Path(folder)
    device = torch.device(device)
    check_backend(backend, device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda but torch sees no CUDA device")
    if reads is not None:
        return _load(folder, device, backend, dtype, act_dtype, reads)
    config = _read_config(folder)  # a bad config is refused before any header is read
    with ArtifactReader(folder) as own:
        return _load(folder, device, backend, dtype, act_dtype, own, config)


#: ``--dtype`` choices of the serving commands
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")


def compute_dtype(raw_config: dict, device: torch.device, choice: str = "auto") -> torch.dtype:
    """The runtime's compute dtype for an artifact whose ``config.json`` is ``raw_config``.

    ``auto``: an artifact that declares ``bfloat16`` (``config.json``'s ``dtype`` /
    ``torch_dtype``, or its ``text_config``'s; kvq's default storage) is computed in bfloat16 on CPU and CUDA, the
    dtype transformers and vLLM load it in and ``kvq verify --eval-dtype auto`` measures
    (on CPU the aten int4/int8 ops take bfloat16 activations, so no casts around them);
    any other is computed in float32 on CPU (CPU half-precision matmuls are slow) and in
    float16 on CUDA (the Triton kernels' half-precision activations).
    ``float32`` / ``bfloat16``: that dtype.

    Raises:
        InputError: an unknown choice.
    """
    if choice not in COMPUTE_DTYPES:
        raise InputError(f"unknown compute dtype '{choice}'; choose one of {', '.join(COMPUTE_DTYPES)}")
    if choice != "auto":
        return getattr(torch, choice)
    text = raw_config.get("text_config")  # a multimodal wrapper (Kimi K2.5) may declare it there only
    declared = {str(c.get("dtype", c.get("torch_dtype"))) for c in (raw_config, text) if isinstance(c, dict)}
    if "bfloat16" in declared:
        return torch.bfloat16
    return torch.float32 if device.type == "cpu" else torch.float16


def _load(folder: Path, device: torch.device, backend: str, dtype, act_dtype, reads,
          config=None) -> tuple[Decoder, LoadInfo]:
    """:func:`load_decoder`'s body once the reader is open (``config``: already read)."""
    raw, cfg = config or _read_config(reads.files_folder, folder)
    arch = get_arch(cfg.model_type)
    spec = DecoderSpec.from_config(cfg, arch.kv, arch.dense_exact_within)
    dtype = compute_dtype(raw, device, "auto") if dtype is None else dtype
    qc = quantization_config(raw) or {}  # a wrapper's may sit in its text_config
    method = _check_method(folder, qc)
    b = _Builder(Tensors(reads), arch, cfg, spec, method, qc, backend, device, dtype, act_dtype)
    rotaries = b.rotaries()
    embed_name, head_name = checkpoint_name(arch, arch.embed_tokens), checkpoint_name(arch, arch.lm_head)
    embed = b.table(embed_name)
    if embed.shape != (spec.vocab_size, spec.hidden_size):
        raise InputError(f"{folder}: {embed_name}.weight has shape {tuple(embed.shape)}, "
                         f"expected {(spec.vocab_size, spec.hidden_size)}")
    layers = [b.layer(i, b.rope_key(i, rotaries)) for i in range(spec.n_layers)]
    norm = b.norm(checkpoint_name(arch, arch.final_norm))
    if spec.tie_word_embeddings and not b.has_module(head_name):
        head = FloatLinear(embed)
        b.kernels[head_name] = head.kernel
    else:
        head = b.linear(head_name)
    scale = spec.hidden_size ** 0.5 if b.traits.embed_scale else None
    dec = Decoder(spec, embed, layers, norm, head, rotaries, dtype, device, arch.layers, arch.lm_head, scale)
    return dec, LoadInfo(method, b.kernels, b.fallbacks, _weight_bytes(dec, embed) + b.extra_bytes, cfg)


def _weight_bytes(dec: Decoder, embed: torch.Tensor) -> int:
    total = embed.numel() * embed.element_size()
    for lin in dec.linears().values():
        stored = [t for t in lin._stored() if t is not None and t is not embed]
        total += sum(t.numel() * t.element_size() for t in stored) + getattr(lin, "fused_bytes", 0)
    for layer in dec.layers:
        total += sum(n.weight.numel() * n.weight.element_size() for n in layer.all_norms())
    return total + dec.norm.weight.numel() * dec.norm.weight.element_size()
