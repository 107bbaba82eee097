"""KV-cache schemes: one class per (scheme, strategy), shared by verify's cache and the runtime's.

Each class says how one cache slot's tensor ``[B, H, T, D]`` (keys after RoPE, values,
or on MLA the latent and the RoPE key) becomes codes and back, whether it needs
calibrated scales, what it costs per token and what compressed-tensors calls it.
:func:`compressor.quant.kv.quantized_cache` (evaluation) and
:mod:`compressor.runtime.kv_cache` (serving) both call :meth:`KVScheme.encode` /
:meth:`KVScheme.decode`, and both follow :meth:`KIVIScheme.quantized_length` for which
tokens KIVI keeps in full precision, so the runtime serves exactly what verify measured.

Registered classes and what :meth:`KVScheme.encode` returns for a slot tensor ``[B, H, T, D]``:

- ``fp8 tensor`` :class:`FP8TensorScheme` (static): ``(codes float8_e4m3fn [B, H, T, D],)``, scale ``[1]``.
- ``fp8 head`` :class:`FP8HeadScheme` (static): the same, scale ``[kv_heads]``.
- ``int8 token`` :class:`Int8TokenScheme` (dynamic): ``(codes uint8 [B, H, T, D], scale float32
  [B, H, T, 1], zero float32 [B, H, T, 1])``.
- ``int8 head`` :class:`Int8HeadScheme` (static): ``(codes int8 [B, H, T, D],)``, scale ``[kv_heads]``.
- ``int4 kivi`` / ``int2 kivi`` :class:`KIVI4Scheme` / :class:`KIVI2Scheme` (dynamic):
  ``(codes uint8 [B, H, T, D], scale, zero)`` float32, keys (``kind='k'``) ``[B, H, T/g, D]``
  (per channel, groups of ``g`` tokens), values (``kind='v'``) ``[B, H, T, D/g]`` (per token,
  groups of ``g`` channels; one group when ``g`` does not divide ``D``).

Static scales follow the compressed-tensors / vLLM convention ``stored = Q(x / scale)``,
``x ≈ stored * scale``: fp8 ``scale = absmax / 448``, int8 ``scale = absmax / 127``.
KIVI: Liu et al., 2024, arXiv:2402.02750.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .errors import InputError

FP8_MAX = 448.0  # largest finite float8_e4m3fn


# ---------------------------------------------------------------------------------------
# tensor-level quantizers (pure functions)


def _bshape(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Broadcast a static scale (``[]``, ``[1]`` or ``[kv_heads]``) against ``[B, H, T, D]``."""
    s = scale.float().to(x.device)
    return s.reshape(1, -1, 1, 1) if s.numel() > 1 else s.reshape(1, 1, 1, 1)


@torch.no_grad()
def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 codes of ``x / scale`` (saturated at ±448); ``x`` ``[B, H, T, D]``."""
    return (x.float() / _bshape(scale, x)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


@torch.no_grad()
def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``codes * scale`` in ``dtype`` (inverse of :func:`quantize_fp8`)."""
    return (codes.float() * _bshape(scale, codes)).to(dtype)


@torch.no_grad()
def quantize_int_static(x: torch.Tensor, scale: torch.Tensor, num_bits: int = 8) -> torch.Tensor:
    """Symmetric int codes (int8 tensor) of ``x / scale`` with a static per-head scale."""
    qmax = (1 << (num_bits - 1)) - 1
    return torch.round(x.float() / _bshape(scale, x)).clamp_(-qmax - 1, qmax).to(torch.int8)


@torch.no_grad()
def dequantize_int_static(codes: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``codes * scale`` in ``dtype`` (inverse of :func:`quantize_int_static`)."""
    return (codes.float() * _bshape(scale, codes)).to(dtype)


@torch.no_grad()
def quantize_asym(x: torch.Tensor, num_bits: int, dim: int, group_size: int | None = None):
    """Asymmetric min-max quantization of ``x`` along ``dim`` in groups of ``group_size`` (None: whole dim).

    Returns ``(codes uint8 same shape as x, scale float32, zero float32)`` where ``scale``/``zero``
    have ``dim`` replaced by the number of groups (``x ≈ (codes - zero) * scale``).
    """
    n = x.shape[dim]
    g = n if group_size is None or group_size >= n else group_size
    if n % g:
        g = n
    xm = x.float().movedim(dim, -1)
    shp = xm.shape
    xg = xm.reshape(*shp[:-1], n // g, g)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    qmax = (1 << num_bits) - 1
    scale = ((hi - lo) / qmax).clamp(min=1e-8)
    zero = torch.round(-lo / scale)
    codes = torch.clamp(torch.round(xg / scale) + zero, 0, qmax).to(torch.uint8)
    codes = codes.reshape(shp).movedim(-1, dim)
    return codes, scale.squeeze(-1).movedim(-1, dim), zero.squeeze(-1).movedim(-1, dim)


@torch.no_grad()
def dequantize_asym(codes, scale, zero, dim: int, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_asym`."""
    n = codes.shape[dim]
    n_groups = scale.shape[dim]
    cm = codes.float().movedim(dim, -1)
    shp = cm.shape
    cg = cm.reshape(*shp[:-1], n_groups, n // n_groups)
    x = (cg - zero.movedim(dim, -1).unsqueeze(-1)) * scale.movedim(dim, -1).unsqueeze(-1)
    return x.reshape(shp).movedim(-1, dim).to(dtype)


# ---------------------------------------------------------------------------------------
# the spec (what a recipe names) and the scheme classes (what it computes)


@dataclass(frozen=True)
class KVSpec:
    """A resolved KV-cache scheme (see the module table). ``group_size``/``residual_length`` apply to KIVI.

    :attr:`codec` is the :class:`KVScheme` object that does the arithmetic.
    """

    scheme: str
    strategy: str
    group_size: int = 32
    residual_length: int = 128

    @property
    def codec(self) -> "KVScheme":
        """The registered :class:`KVScheme` instance for ``(scheme, strategy)``."""
        return _codec(self)

    @property
    def bits(self) -> int:
        return self.codec.bits

    @property
    def static(self) -> bool:
        """True when calibrated scales are stored in the artifact."""
        return self.codec.static

    def describe(self) -> str:
        extra = f", group {self.group_size}, residual {self.residual_length}" if self.codec.residual_window else ""
        return f"{self.scheme} ({self.strategy}{extra})"


#: ``(scheme, strategy) -> KVScheme subclass``, in registration order (the first strategy
#: registered for a scheme is its default).
KV_SCHEMES: dict[tuple[str, str], type] = {}


def register(scheme: str, strategy: str):
    """Class decorator: make ``cls`` the implementation of ``(scheme, strategy)``."""
    def deco(cls):
        KV_SCHEMES[(scheme, strategy)] = cls
        return cls
    return deco


@lru_cache(maxsize=None)
def _codec(spec: KVSpec) -> "KVScheme":
    try:
        cls = KV_SCHEMES[(spec.scheme, spec.strategy)]
    except KeyError:
        raise InputError(f"unknown KV-cache scheme {spec.scheme} ({spec.strategy})") from None
    return cls(spec)


class KVScheme:
    """One KV-cache scheme: encode/decode of a cache slot, static or dynamic, bytes, config field.

    ``kind`` names a slot's KIVI grouping (``'k'`` per channel over groups of tokens,
    ``'v'`` per token over groups of channels); schemes other than KIVI ignore it.
    ``scale`` is the slot's static scale (``[1]`` or ``[kv_heads]``), ``None`` for dynamic
    schemes. Subclasses set :attr:`bits`, :attr:`static`, :attr:`per_head` and implement
    :meth:`encode` / :meth:`decode`.
    """

    bits: int = 8
    static: bool = False  # calibrated scales stored in the artifact
    per_head: bool = False  # needs KV heads (refused on MLA)
    scale_max: float = 127.0  # static scale = absmax / scale_max
    per_tensor: bool = False  # static scale reduced to one value per layer
    config_type: str | None = None  # compressed-tensors "type" of a static scheme
    residual_window: bool = False  # the last ``residual_length`` tokens stay float (KIVI); sizes checked by make_spec
    #: ``kv_cache.scale_search`` that ``kvq quantize --kv-scheme`` sets (fp8: ``auto``, the attention-output search)
    flag_scale_search: str = "absmax"

    def __init__(self, spec: KVSpec):
        self.spec = spec

    def encode(self, x: torch.Tensor, scale: torch.Tensor | None = None, kind: str = "k") -> tuple[torch.Tensor, ...]:
        """Codes (and per-token metadata) of ``x [B, H, T, D]`` (see the module table)."""
        raise NotImplementedError

    def decode(self, parts: tuple[torch.Tensor, ...], scale: torch.Tensor | None = None, kind: str = "k",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[B, H, T, D]`` in ``dtype`` from what :meth:`encode` returned (possibly sliced along tokens)."""
        raise NotImplementedError

    def fake_quantize(self, x: torch.Tensor, kind: str, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``decode(encode(x))`` in ``x.dtype``."""
        return self.decode(self.encode(x, scale, kind), scale, kind, x.dtype)

    def token_parts(self, width: int) -> tuple[tuple[int, torch.dtype], ...]:
        """Per-token storage of :meth:`encode`'s outputs: ``(last dim, dtype)`` per part
        (token-wise schemes; KIVI groups over tokens and has none)."""
        raise NotImplementedError

    def scale_from_absmax(self, absmax: torch.Tensor) -> torch.Tensor:
        """Static scale from observed absmax ``[kv_heads]`` (``[1]`` for per-tensor schemes)."""
        a = absmax.float().clamp(min=1e-6)
        if self.per_tensor:
            a = a.max().reshape(1)
        return a / self.scale_max

    def meta_bytes(self, component) -> float:
        """Per-token metadata bytes (fp16 scale/zero) of one cache component (``heads x width``)."""
        return 0

    def bytes_per_token(self, layout) -> float:
        """Bytes per token over all layers of a :class:`~compressor.quant.kv.KVLayout` (codes + metadata)."""
        total = 0.0
        for c in layout.components:
            total += c.heads * c.width * self.bits / 8
            total += self.meta_bytes(c)
        return float(total * layout.n_layers)

    def config_field(self) -> dict | None:
        """compressed-tensors ``kv_cache_scheme`` (static schemes; vLLM accepts strategy ``tensor`` /
        ``attn_head``, symmetric only); ``None`` for dynamic schemes, which the manifest records."""
        if not self.static:
            return None
        return {
            "num_bits": 8,
            "type": self.config_type,
            "strategy": "tensor" if self.per_tensor else "attn_head",
            "dynamic": False,
            "symmetric": True,
            "group_size": None,
            "block_structure": None,
            "actorder": None,
            "observer": "minmax",
            "observer_kwargs": {},
        }

    def record_fields(self) -> dict:
        """The scheme's own entries in the manifest's ``kv_cache`` block, after the common ones; none by default."""
        return {}


@register("fp8", "tensor")
class FP8TensorScheme(KVScheme):
    """float8 e4m3 codes with one static scale per layer (``absmax / 448``)."""

    static, per_tensor, scale_max, config_type = True, True, FP8_MAX, "float"
    flag_scale_search = "auto"

    def encode(self, x, scale=None, kind="k"):
        return (quantize_fp8(x, scale),)

    def decode(self, parts, scale=None, kind="k", dtype=torch.float32):
        return dequantize_fp8(parts[0], scale, dtype)

    def token_parts(self, width):
        return ((width, torch.float8_e4m3fn),)


@register("fp8", "head")
class FP8HeadScheme(FP8TensorScheme):
    """float8 e4m3 codes with static per-KV-head scales ``[kv_heads]``."""

    per_tensor, per_head = False, True


@register("int8", "token")
class Int8TokenScheme(KVScheme):
    """uint8 codes, dynamic asymmetric scale + zero point per (head, token); no calibration."""

    def encode(self, x, scale=None, kind="k"):
        return quantize_asym(x, 8, dim=-1)

    def decode(self, parts, scale=None, kind="k", dtype=torch.float32):
        c, s, z = parts
        return dequantize_asym(c, s, z, dim=-1, dtype=dtype)

    def token_parts(self, width):
        return ((width, torch.uint8), (1, torch.float32), (1, torch.float32))

    def meta_bytes(self, c):
        return c.heads * 2 * 2  # scale + zero point (fp16) per head and token


@register("int8", "head")
class Int8HeadScheme(KVScheme):
    """int8 codes with static symmetric per-head scales (``absmax / 127``)."""

    static, per_head, config_type = True, True, "int"

    def encode(self, x, scale=None, kind="k"):
        return (quantize_int_static(x, scale),)

    def decode(self, parts, scale=None, kind="k", dtype=torch.float32):
        return dequantize_int_static(parts[0], scale, dtype)

    def token_parts(self, width):
        return ((width, torch.int8),)


class KIVIScheme(KVScheme):
    """KIVI int4/int2: keys per channel in groups of ``group_size`` tokens, values per token in
    groups of ``group_size`` channels, both asymmetric min-max; a full-precision window of
    recent tokens (:meth:`quantized_length`)."""

    residual_window = True

    def record_fields(self) -> dict:
        return {"group_size": self.spec.group_size, "residual_length": self.spec.residual_length,
                "keys": "per channel, groups of group_size tokens",
                "values": "per token, groups of group_size channels"}

    def dim(self, kind: str) -> int:
        """The grouped dimension: tokens (-2) for ``kind='k'``, channels (-1) for ``'v'``."""
        return -2 if kind == "k" else -1

    def encode(self, x, scale=None, kind="k"):
        return quantize_asym(x, self.bits, dim=self.dim(kind), group_size=self.spec.group_size)

    def decode(self, parts, scale=None, kind="k", dtype=torch.float32):
        return dequantize_asym(*parts, dim=self.dim(kind), dtype=dtype)

    def fake_quantize(self, x, kind, scale=None):
        """Every complete token group quantized (no residual window: the caches handle recency)."""
        if kind != "k":
            return super().fake_quantize(x, kind, scale)
        T = x.shape[-2] - x.shape[-2] % self.spec.group_size
        if T == 0:
            return x
        return torch.cat([super().fake_quantize(x[..., :T, :], kind, scale), x[..., T:, :]], dim=-2)

    def quantized_length(self, total: torch.Tensor) -> torch.Tensor:
        """The residual rule: after ``total`` tokens (int64 tensor, elementwise) the first
        ``f(T) = min(T, ceil(max(0, T - R) / g) * g)`` are quantized and the rest (between
        ``R - g + 1`` and ``R`` when ``R >= g``) stay in full precision, whatever the chunking
        (``R = residual_length``, ``g = group_size``; ``R = 0`` quantizes every token)."""
        g = self.spec.group_size
        extra = (total - self.spec.residual_length).clamp(min=0)
        return torch.minimum((extra + g - 1) // g * g, total)

    def meta_bytes(self, c):
        g = self.spec.group_size
        if c.kind == "k":
            return c.heads * c.width / g * 2 * 2  # (scale + zero) per channel, shared by g tokens
        return c.heads * self.value_groups(c.width) * 2 * 2  # (scale + zero) per channel group of each token

    def value_groups(self, width: int) -> int:
        """Channel groups per value token: ``width / g``, or one when ``g`` does not divide ``width``
        (as :func:`quantize_asym` groups)."""
        g = self.spec.group_size
        return width // g if g < width and width % g == 0 else 1


@register("int4", "kivi")
class KIVI4Scheme(KIVIScheme):
    """KIVI with 4-bit codes."""

    bits = 4


@register("int2", "kivi")
class KIVI2Scheme(KIVIScheme):
    """KIVI with 2-bit codes."""

    bits = 2


def scheme_names() -> tuple[str, ...]:
    """The registered schemes (``fp8``, ``int8``, ...), in registration order (the command line's choices)."""
    return tuple(dict.fromkeys(s for s, _ in KV_SCHEMES))


def strategies(scheme: str) -> tuple[str, ...]:
    """The strategies registered for ``scheme``, its default first."""
    return tuple(st for sc, st in KV_SCHEMES if sc == scheme)


def strategy_names() -> tuple[str, ...]:
    """Every registered strategy, in registration order."""
    return tuple(dict.fromkeys(st for _, st in KV_SCHEMES))


def make_spec(scheme: str, strategy: str | None = None, group_size: int = 32, residual_length: int = 128) -> KVSpec:
    """Validate and complete a scheme.

    Raises:
        InputError: unknown scheme, a strategy the scheme does not have, or residual-window
            sizes that do not fit (KIVI: ``group_size`` >= 1, ``residual_length`` a multiple of it).
    """
    if scheme not in scheme_names():
        raise InputError(f"unknown KV-cache scheme '{scheme}'; choose one of {', '.join(scheme_names())}")
    valid = strategies(scheme)
    strategy = strategy or valid[0]
    if strategy not in valid:
        raise InputError(f"KV-cache scheme {scheme} has strategies {', '.join(valid)}, not '{strategy}'")
    if KV_SCHEMES[(scheme, strategy)].residual_window:
        if group_size < 1 or residual_length < 0 or residual_length % group_size:
            raise InputError(f"KIVI needs group_size >= 1 and residual_length a multiple of it "
                             f"(got {group_size}, {residual_length})")
    return KVSpec(scheme, strategy, int(group_size), int(residual_length))
