"""Preallocated KV caches for a batch of sequences, float or quantized on write.

Every cache holds, per layer, storage for ``[batch, kv_heads, max_len, ...]`` allocated
once (zero-filled: masked slots must never hold NaN bit patterns) and a per-sequence
length ``lengths [batch]``; sequence ``b`` occupies token slots ``0 .. lengths[b] - 1``
(no left padding). Keys are stored after RoPE. A decoder step calls, for each layer,
``update(layer, k, v, start, n_new)`` with the step's keys/values ``[B, H, T, D]``
(row ``b`` has ``n_new[b] <= T`` real tokens, the rest padding) and gets back the
dequantized keys and values ``[B, H, L, D]`` for ``L = max(start + n_new)``, what
attention reads; then :meth:`KVCache.commit` advances ``lengths``. Slots past a row's
length hold stale or padding data that the attention mask hides.

Every quantized cache encodes and decodes through the scheme object ``spec.codec``
(:class:`~compressor.kv_schemes.KVScheme`), the same one
:func:`~compressor.quant.kv.quantized_cache` calls, so the runtime serves exactly what
``kvq verify`` measures:

============================  ==============================================================
class                         storage per layer (``B, H, Lmax, D``)
============================  ==============================================================
:class:`KVCache`              float K, V in the compute dtype
:class:`FP8KVCache`           float8 e4m3 codes, static ``k_scale``/``v_scale`` ([1] or [H])
:class:`Int8HeadKVCache`      int8 codes, static per-head scales (absmax / 127)
:class:`Int8TokenKVCache`     uint8 codes + float32 scale and zero per (head, token)
:class:`KIVICache`            int4/int2 codes packed along ``D`` (2 or 4 per byte); keys:
                              float32 scale/zero per channel for each group of ``g`` tokens
                              ``[B, H, Lmax/g, D]``; values: per token for each group of
                              ``g`` channels ``[B, H, Lmax, D/g]``; a float residual window
                              of at most ``R`` recent tokens per sequence ``[B, H, R+1, D]``
============================  ==============================================================

KIVI (Liu et al., 2024, arXiv:2402.02750) boundary: after ``T`` tokens a sequence has its
first ``f(T) = max(0, ceil((T - R) / g)) * g`` tokens quantized and the rest (between
``R - g + 1`` and ``R``) in float (:meth:`~compressor.kv_schemes.KIVIScheme.quantized_length`,
the rule :func:`~compressor.quant.kv.make_quantized_layer_class` follows too), whatever the
chunking, so it is derived from ``lengths`` alone (what a prefill
chunk's queries read does depend on the chunking: tokens quantized within the chunk are
read back dequantized, as in the reference). Scales and zero
points are float32 (as :func:`~compressor.kv_schemes.quantize_asym` returns them), so
bytes/token here are a little above :func:`~compressor.quant.kv.kv_bytes_per_token`'s
fp16 accounting; :meth:`KVCache.bytes_per_token` reports what is actually stored.
"""

from __future__ import annotations

import math

import torch

from ..errors import InputError
from ..kv_schemes import (
    FP8_MAX, FP8TensorScheme, Int8HeadScheme, Int8TokenScheme, KIVIScheme, KVScheme, KVSpec, make_spec,
)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class KVCache:
    """Float KV cache (scheme ``none``); base class of the quantized ones.

    Args:
        n_layers, batch, kv_heads, max_len, head_dim: storage geometry.
        dtype: compute dtype of what :meth:`update` returns (and of the float storage).
        device: where the storage lives.
    """

    scheme = "none"

    def __init__(self, n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        if min(n_layers, batch, kv_heads, max_len, head_dim) <= 0:
            raise InputError(f"bad KV-cache geometry: layers {n_layers}, batch {batch}, heads {kv_heads}, "
                             f"max_len {max_len}, head_dim {head_dim}")
        self.n_layers, self.batch, self.kv_heads, self.max_len, self.head_dim = n_layers, batch, kv_heads, max_len, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.lengths = torch.zeros(batch, dtype=torch.long)  # host copy: drives indexing decisions
        self._alloc()

    # -- storage ------------------------------------------------------------------------
    def _zeros(self, *shape, dtype=None) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype or self.dtype, device=self.device)

    def _alloc(self) -> None:
        shp = (self.batch, self.kv_heads, self.max_len, self.head_dim)
        self.k = [self._zeros(*shp) for _ in range(self.n_layers)]
        self.v = [self._zeros(*shp) for _ in range(self.n_layers)]

    def _token_stores(self, layer: int) -> list[torch.Tensor]:
        """Per-token tensors of ``layer`` (token dim 2), for bytes/token accounting."""
        return [self.k[layer], self.v[layer]]

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the whole cache (codes, scales, residual windows)."""
        return sum(_nbytes(t) for t in self._all_tensors())

    def _all_tensors(self):
        for i in range(self.n_layers):
            yield from self._token_stores(i)

    def bytes_per_token(self) -> float:
        """Stored bytes per token over all layers, K and V, per-token metadata included
        (fixed per-sequence parts such as a KIVI residual window excluded)."""
        per = sum(_nbytes(t) for i in range(self.n_layers) for t in self._token_stores(i))
        return per / (self.batch * self.max_len)

    def fixed_bytes_per_sequence(self) -> int:
        """Bytes each sequence holds whatever its length (a KIVI residual window; 0 here)."""
        return 0

    # -- protocol -----------------------------------------------------------------------
    def check_room(self, n_new: torch.Tensor) -> None:
        """Raises InputError when a step would write past ``max_len`` for some sequence."""
        end = self.lengths + n_new.cpu()
        if bool((end > self.max_len).any()):
            b = int(torch.argmax(end))
            raise InputError(f"KV cache full: sequence {b} needs {int(end[b])} tokens, the cache holds {self.max_len}")

    def commit(self, n_new: torch.Tensor) -> None:
        """Advance ``lengths`` by ``n_new [B]`` once every layer has been updated."""
        self.lengths += n_new.cpu()

    def reset(self, rows: list[int] | None = None) -> None:
        """Forget the contents of ``rows`` (all by default); storage stays allocated."""
        if rows is None:
            self.lengths.zero_()
        else:
            self.lengths[rows] = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
               n_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's ``k, v [B, H, T, D]`` at ``start [B]`` (``n_new[b]`` real tokens per
        row) and return the cache contents ``[B, H, L, D]`` in the compute dtype."""
        self._write(layer, self._encode(layer, k, "k"), self._encode(layer, v, "v"), start, n_new)
        length = int((start + n_new).max())
        return self._decode(layer, "k", length), self._decode(layer, "v", length)

    # -- per-token schemes: encode the new tokens, write their codes, decode a prefix ----
    def _stores(self, layer: int, kind: str) -> tuple[torch.Tensor, ...]:
        return ((self.k if kind == "k" else self.v)[layer],)

    def _encode(self, layer: int, x: torch.Tensor, kind: str) -> tuple[torch.Tensor, ...]:
        return (x.to(self.dtype),)

    def _decode(self, layer: int, kind: str, length: int) -> torch.Tensor:
        return self._stores(layer, kind)[0][:, :, :length]

    def _write(self, layer, k_parts, v_parts, start, n_new) -> None:
        starts = start.tolist()
        ns = n_new.tolist()
        T = k_parts[0].shape[2]
        rows = range(self.batch)
        for store, vals in zip(self._stores(layer, "k") + self._stores(layer, "v"), k_parts + v_parts):
            if len(set(starts)) == 1 and starts[0] + T <= self.max_len:  # prefill / equal lengths: one slice
                store[:, :, starts[0]:starts[0] + T] = vals
            elif T == 1:  # decode: one slot per row
                idx = torch.tensor(starts, device=self.device)
                live = torch.tensor(ns, device=self.device) > 0
                b = torch.arange(self.batch, device=self.device)[live]
                store[b, :, idx[live]] = vals[live, :, 0]
            else:
                for r in rows:
                    if ns[r]:
                        store[r, :, starts[r]:starts[r] + ns[r]] = vals[r, :, :ns[r]]


class QuantKVCache(KVCache):
    """Per-token quantized cache: each token's codes (and metadata) from ``spec.codec.encode``
    written in place, a prefix decoded by ``spec.codec.decode``.

    Args:
        spec: the scheme (default: the class's :attr:`default_spec`).
        scales: layer -> ``(k_scale, v_scale)`` ([1] or [H]) for a static scheme.

    Raises:
        InputError: a static scheme without scales for every layer, or scales of the wrong size.
    """

    scheme = "quantized"
    codecs: tuple[type, ...] = ()  # the KVScheme classes this cache stores
    default_spec: tuple = ()  # make_spec arguments when no spec is given

    def __init__(self, *args, spec: KVSpec | None = None, scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
                 **kw):
        self.codec: KVScheme = (spec or make_spec(*self.default_spec)).codec
        dev = kw.get("device", "cpu")
        self.scales = None if not self.codec.static else {
            i: (k.float().reshape(-1).to(dev), v.float().reshape(-1).to(dev)) for i, (k, v) in (scales or {}).items()}
        super().__init__(*args, **kw)
        if self.codec.static:
            self._check_scales()

    def _check_scales(self) -> None:
        missing = [i for i in range(self.n_layers) if i not in self.scales]
        if missing:
            raise InputError(f"KV scheme {self.scheme} needs static k_scale/v_scale for every layer; layer {missing[0]} has none")
        bad = [i for i, (k, v) in self.scales.items() if k.numel() not in (1, self.kv_heads) or v.numel() not in (1, self.kv_heads)]
        if bad:
            raise InputError(f"layer {bad[0]}: k_scale/v_scale must hold 1 or {self.kv_heads} (kv heads) values")

    def _alloc(self):
        shp = (self.batch, self.kv_heads, self.max_len)
        parts = self.codec.token_parts(self.head_dim)
        self.parts = {kind: [tuple(self._zeros(*shp, w, dtype=dt) for w, dt in parts) for _ in range(self.n_layers)]
                      for kind in "kv"}

    def _token_stores(self, layer):
        return [*self.parts["k"][layer], *self.parts["v"][layer]]

    def _stores(self, layer, kind):
        return self.parts[kind][layer]

    def _scale(self, layer, kind):
        return None if self.scales is None else self.scales[layer][0 if kind == "k" else 1]

    def _encode(self, layer, x, kind):
        return self.codec.encode(x, self._scale(layer, kind), kind)

    def _decode(self, layer, kind, length):
        parts = tuple(t[:, :, :length] for t in self._stores(layer, kind))
        return self.codec.decode(parts, self._scale(layer, kind), kind, self.dtype)


class FP8KVCache(QuantKVCache):
    """float8 e4m3 codes with static scales (``scales``: layer -> (k_scale, v_scale), [1] or [H]).

    Decoding reads a scaled lookup table instead of converting each code: one float32
    table ``[H or 1, 256]`` per (layer, kind) holding ``e4m3(byte) * scale``, the very
    float32 product :func:`~compressor.kv_schemes.dequantize_fp8` computes, so the
    result is bit-identical to ``spec.codec.decode``. On this torch a CPU float8 -> float32
    conversion runs element by element (measured on a 2-core Xeon, 3 heads x 100 tokens x 64:
    71 us per read against 18 us for the gather), and decode reads the whole prefix of every
    layer at every step.
    """

    scheme = "fp8"
    codecs = (FP8TensorScheme,)  # per tensor and (subclass) per head
    default_spec = ("fp8",)

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)  # storage (any mixin's layout), scales checked
        values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().to(self.device)
        self.luts, self.divisors = {}, {}
        for i, pair in self.scales.items():
            for kind, s in zip("kv", pair):
                self.luts[(i, kind)] = (values[None, :] * s.reshape(-1, 1)).reshape(-1)  # [(H or 1) * 256]
                self.divisors[(i, kind)] = s.reshape(1, -1, 1, 1)  # quantize_fp8's broadcast scale
        self.head_offsets = (torch.arange(self.kv_heads, device=self.device) * 256).reshape(1, -1, 1, 1)

    def _encode(self, layer, x, kind):
        # quantize_fp8's arithmetic (the same float32 division, clamp and cast), without its
        # per-call no_grad context and scale reshaping: this runs for every layer and step
        return ((x.float() / self.divisors[(layer, kind)]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn),)

    def _decode(self, layer, kind, length):
        codes = self._stores(layer, kind)[0][:, :, :length].view(torch.uint8)
        lut = self.luts[(layer, kind)]
        idx = codes.long()
        if lut.numel() > 256:  # per head: row h of the table
            idx += self.head_offsets
        out = lut.index_select(0, idx.reshape(-1)).view(codes.shape)
        return out if self.dtype == torch.float32 else out.to(self.dtype)


class Int8HeadKVCache(QuantKVCache):
    """int8 codes with static symmetric per-head scales (``scale = absmax / 127``)."""

    scheme = "int8-head"
    codecs = (Int8HeadScheme,)
    default_spec = ("int8", "head")


class Int8TokenKVCache(QuantKVCache):
    """uint8 codes, dynamic asymmetric scale + zero point per (head, token) (no calibration)."""

    scheme = "int8-token"
    codecs = (Int8TokenScheme,)
    default_spec = ("int8", "token")


def _pack_codes(c: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., D]`` (``< 2^bits``) -> ``[..., D * bits / 8]``, element ``j`` at bits
    ``(j % per) * bits`` of byte ``j // per`` (``per = 8 / bits``)."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=c.device)
    g = c.reshape(*c.shape[:-1], c.shape[-1] // per, per) << shifts
    return g.sum(-1, dtype=torch.uint8)


def _unpack_codes(p: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=p.device)
    return ((p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*p.shape[:-1], -1)


class KIVICache(KVCache):
    """int4/int2 KIVI: grouped asymmetric codes plus a float residual window (see the module docstring).

    Raises:
        InputError: ``residual_length`` 0 (the transformers reference then quantizes
            partial groups, whose layout depends on the chunking), ``head_dim`` not a
            multiple of ``8 / bits``.
    """

    scheme = "kivi"
    codecs = (KIVIScheme,)

    def __init__(self, *args, spec: KVSpec, **kw):
        if spec.residual_length < spec.group_size:
            raise InputError(f"the runtime's KIVI cache needs residual_length >= group_size (got {spec.residual_length}, "
                             f"{spec.group_size})")
        self.spec, self.bits, self.g, self.R = spec, spec.bits, spec.group_size, spec.residual_length
        self.codec: KIVIScheme = spec.codec
        super().__init__(*args, **kw)
        if self.head_dim % (8 // self.bits):
            raise InputError(f"KIVI {self.bits}-bit packing needs head_dim divisible by {8 // self.bits}, got {self.head_dim}")

    def _alloc(self):
        B, H, L, D = self.batch, self.kv_heads, self.max_len, self.head_dim
        pb = D * self.bits // 8
        n_groups = math.ceil(L / self.g)
        vg = self.codec.value_groups(D)  # value scale/zero per token: D / g groups, or one
        self.kc = [self._zeros(B, H, n_groups * self.g, pb, dtype=torch.uint8) for _ in range(self.n_layers)]
        self.vc = [self._zeros(B, H, n_groups * self.g, pb, dtype=torch.uint8) for _ in range(self.n_layers)]
        self.ks = [self._zeros(B, H, n_groups, D, dtype=torch.float32) for _ in range(self.n_layers)]
        self.kz = [self._zeros(B, H, n_groups, D, dtype=torch.float32) for _ in range(self.n_layers)]
        self.vs = [self._zeros(B, H, n_groups * self.g, vg, dtype=torch.float32) for _ in range(self.n_layers)]
        self.vz = [self._zeros(B, H, n_groups * self.g, vg, dtype=torch.float32) for _ in range(self.n_layers)]
        self.rk = [self._zeros(B, H, self.R + 1, D) for _ in range(self.n_layers)]
        self.rv = [self._zeros(B, H, self.R + 1, D) for _ in range(self.n_layers)]

    def _all_tensors(self):
        for i in range(self.n_layers):
            yield from (self.kc[i], self.vc[i], self.ks[i], self.kz[i], self.vs[i], self.vz[i], self.rk[i], self.rv[i])

    def bytes_per_token(self) -> float:
        per_seq_tokens = self.batch * self.kc[0].shape[2]
        per = sum(_nbytes(t) for i in range(self.n_layers)
                  for t in (self.kc[i], self.vc[i], self.ks[i], self.kz[i], self.vs[i], self.vz[i]))
        return per / per_seq_tokens

    def fixed_bytes_per_sequence(self) -> int:
        """Float residual window bytes of one sequence (all layers, K and V)."""
        return sum(_nbytes(self.rk[i]) + _nbytes(self.rv[i]) for i in range(self.n_layers)) // self.batch

    def quantized_length(self, length: torch.Tensor) -> torch.Tensor:
        """``f(T)``: tokens in the quantized store after ``T`` tokens (multiple of ``group_size``),
        the scheme's rule (:meth:`~compressor.kv_schemes.KIVIScheme.quantized_length`)."""
        return self.codec.quantized_length(length)

    def _quantize_into(self, layer: int, row: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize ``k, v [H, n, D]`` (``n`` a multiple of ``g``) into token slots ``pos .. pos + n``."""
        n = k.shape[1]
        kc, ks, kz = self.codec.encode(k.unsqueeze(0), None, "k")
        vc, vs, vz = self.codec.encode(v.unsqueeze(0), None, "v")
        self.kc[layer][row, :, pos:pos + n] = _pack_codes(kc[0], self.bits)
        self.ks[layer][row, :, pos // self.g:(pos + n) // self.g] = ks[0]
        self.kz[layer][row, :, pos // self.g:(pos + n) // self.g] = kz[0]
        self.vc[layer][row, :, pos:pos + n] = _pack_codes(vc[0], self.bits)
        self.vs[layer][row, :, pos:pos + n] = vs[0]
        self.vz[layer][row, :, pos:pos + n] = vz[0]

    def update(self, layer, k, v, start, n_new):
        start_c, n_c = start.cpu(), n_new.cpu()
        end = start_c + n_c
        q0, q1 = self.quantized_length(start_c), self.quantized_length(end)
        rk, rv = self.rk[layer], self.rv[layer]
        k, v = k.to(self.dtype), v.to(self.dtype)
        if k.shape[2] == 1 and bool((n_c == 1).all()):  # decode: append to the window, flush full groups
            r0 = (start_c - q0).to(self.device)
            b = torch.arange(self.batch, device=self.device)
            rk[b, :, r0] = k[:, :, 0]
            rv[b, :, r0] = v[:, :, 0]
            for row in torch.nonzero(q1 > q0).flatten().tolist():
                pos = int(q0[row])
                self._quantize_into(layer, row, pos, rk[row, :, :self.g], rv[row, :, :self.g])
                rk[row, :, :self.R + 1 - self.g] = rk[row, :, self.g:self.R + 1].clone()
                rv[row, :, :self.R + 1 - self.g] = rv[row, :, self.g:self.R + 1].clone()
        else:  # prefill / chunks: per row, window + new tokens -> quantize whole groups, keep the rest
            for row in range(self.batch):
                n = int(n_c[row])
                if n == 0:
                    continue
                r0 = int(start_c[row] - q0[row])
                kk = torch.cat([rk[row, :, :r0], k[row, :, :n]], dim=1)
                vv = torch.cat([rv[row, :, :r0], v[row, :, :n]], dim=1)
                m = int(q1[row] - q0[row])
                if m:
                    self._quantize_into(layer, row, int(q0[row]), kk[:, :m], vv[:, :m])
                rk[row, :, :kk.shape[1] - m] = kk[:, m:]
                rv[row, :, :vv.shape[1] - m] = vv[:, m:]
        return self._read(layer, q1, end)

    def _quantized(self, layer: int, kind: str, lq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``lq`` quantized tokens of ``kind`` as ``encode`` returned them (codes unpacked)."""
        if kind == "k":
            nq = lq // self.g
            return _unpack_codes(self.kc[layer][:, :, :lq], self.bits), self.ks[layer][:, :, :nq], self.kz[layer][:, :, :nq]
        return _unpack_codes(self.vc[layer][:, :, :lq], self.bits), self.vs[layer][:, :, :lq], self.vz[layer][:, :, :lq]

    def _read(self, layer: int, q1: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        length, lq = int(end.max()), int(q1.max())
        out = []
        for kind in "kv":
            if lq:
                deq = self.codec.decode(self._quantized(layer, kind, lq), None, kind, self.dtype)
                deq = torch.nn.functional.pad(deq, (0, 0, 0, length - lq))
            res = (self.rk if kind == "k" else self.rv)[layer]
            q1d = q1.to(self.device).view(-1, 1)
            pos = torch.arange(length, device=self.device).view(1, -1)
            idx = (pos - q1d).clamp(0, self.R)  # [B, L] slot in the window
            win = res.gather(2, idx[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim))
            out.append(win if not lq else torch.where((pos < q1d)[:, None, :, None], deq, win))
        return out[0], out[1]


#: runtime cache class per scheme class (:func:`make_cache` picks the first whose ``codecs`` match)
CACHE_CLASSES = (FP8KVCache, Int8HeadKVCache, Int8TokenKVCache, KIVICache)


def make_cache(spec: KVSpec | None, scales, n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
               dtype: torch.dtype, device) -> KVCache:
    """The cache class for ``spec`` (None: float).

    Raises:
        InputError: a static scheme without scales for every layer; KIVI limits (see :class:`KIVICache`).
    """
    geo = (n_layers, batch, kv_heads, max_len, head_dim)
    if spec is None:
        return KVCache(*geo, dtype=dtype, device=device)
    if spec.static and scales is None:
        raise InputError(f"KV scheme {spec.describe()} needs calibrated k_scale/v_scale (an artifact quantized with it has them)")
    cls = next(c for c in CACHE_CLASSES if isinstance(spec.codec, c.codecs))
    if cls is KIVICache:
        return KIVICache(*geo, dtype=dtype, device=device, spec=spec)
    return cls(*geo, dtype=dtype, device=device, spec=spec, scales=scales)
