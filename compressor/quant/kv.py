"""KV-cache quantization: layouts, calibration observers, a quantized transformers cache, accounting.

The arithmetic of each scheme (encode/decode, static scale rule, bytes, config field) is
one class in :mod:`compressor.kv_schemes` and the layouts are in :mod:`compressor.kv_layout`, both
re-exported here and shared with the runtime cache (:mod:`compressor.runtime.kv_cache`).

Keys and values are ``[batch, kv_heads, tokens, head_dim]`` tensors, keys **after RoPE**
(what a runtime stores). Schemes:

==========  ============  ===========================================================
scheme      strategy      what is stored per layer
==========  ============  ===========================================================
``fp8``     ``tensor``    float8 e4m3 codes, one static ``k_scale`` / ``v_scale``
            ``head``      float8 e4m3 codes, static scales ``[kv_heads]``
``int8``    ``token``     int8 codes, dynamic asymmetric scale + zero point per
                          (head, token) (computed on write, no calibration)
            ``head``      int8 codes, static symmetric scales ``[kv_heads]``
``int4``    ``kivi``      KIVI (Liu et al., 2024, arXiv:2402.02750): keys per channel in
``int2``                  groups of ``group_size`` tokens, values per token in groups of
                          ``group_size`` channels, both asymmetric; the most recent
                          tokens (between ``residual_length - group_size + 1`` and
                          ``residual_length``) stay in full precision
==========  ============  ===========================================================

Static scales follow the compressed-tensors / vLLM convention ``stored = Q(x / scale)``,
``x ≈ stored * scale`` (docs/formats.md, KV cache): fp8 ``scale = absmax / 448``, int8
``scale = absmax / 127``, from absmax statistics collected by :class:`KVObserver` during
the sequential calibration pass.

Pre-RoPE key quantization (KVQuant, Hooper et al., 2024) would quantize keys before the
rotation, where per-channel outlier structure is cleaner, and apply RoPE after
dequantization; kvq quantizes what the runtime stores, post-RoPE, so the scales are the
ones vLLM's fp8 cache uses.

Multi-head latent attention (MLA; DeepSeek-V2, arXiv:2405.04434, section 2.1; DeepSeek-V3
and Kimi K2) caches, per layer and token, not keys and values per head but the
compressed latent ``c_kv`` (``kv_a_proj_with_mqa`` output after ``kv_a_layernorm``,
``kv_lora_rank`` wide) and the decoupled RoPE key ``k_rope`` (``qk_rope_head_dim`` wide,
after RoPE, shared by all heads); keys and values are re-expanded from them by
``kv_b_proj`` at read. transformers calls ``cache.update(c_kv [B, 1, T, r], k_rope [B,
1, T, d_rope])``, so the two cache slots hold exactly that. On an MLA model the schemes
quantize:

==========  ============  ===========================================================
scheme      strategy      MLA cache entry ``[c_kv | k_rope]``
==========  ============  ===========================================================
``fp8``     ``tensor``    float8 e4m3 codes of both parts with **one** static scale per
                          layer, ``max(absmax(c_kv), absmax(k_rope)) / 448`` (vLLM's MLA
                          cache writes the concatenated entry with ``k_scale``; the
                          artifact stores it as ``k_scale`` and, equal, ``v_scale``)
``int8``    ``token``     int8 codes, dynamic asymmetric scale + zero point per token
                          for ``c_kv`` and for ``k_rope``
``int4``    ``kivi``      both parts per channel in groups of ``group_size`` tokens
``int2``                  (KIVI's key treatment: ``c_kv`` becomes keys through
                          ``kv_b_proj`` and carries the norm's per-channel gains,
                          ``k_rope`` is a post-RoPE key), same residual window
==========  ============  ===========================================================

Per-head strategies (``fp8 head``, ``int8 head``) do not apply: MLA has no KV heads, and
are refused. Bytes per token (:func:`layout_bytes_per_token`) count ``(kv_lora_rank +
qk_rope_head_dim)`` elements per layer, not ``2 * num_heads * head_dim``.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..kv_layout import (  # noqa: F401  (re-exported: the layouts live there)
    KVComponent, KVLayout, check_layout, gqa_layout, kv_layout, mla_layout, turn_keys,
)
from ..kv_schemes import (  # noqa: F401  (re-exported: the scheme classes and the tensor quantizers live there)
    FP8_MAX, KV_SCHEMES, FP8HeadScheme, FP8TensorScheme, Int8HeadScheme, Int8TokenScheme, KIVIScheme, KVScheme, KVSpec,
    dequantize_asym, dequantize_fp8, dequantize_int_static, make_spec, quantize_asym, quantize_fp8, quantize_int_static,
)


def layer_scales(k_absmax: torch.Tensor, v_absmax: torch.Tensor, spec: KVSpec, layout: KVLayout | None = None):
    """Static ``(k_scale, v_scale)`` of one layer from observed absmax (see :func:`static_scales`);
    with ``layout.shared_scale`` both are the scale of the larger absmax."""
    if layout is not None and layout.shared_scale:
        a = torch.maximum(k_absmax.float().max(), v_absmax.float().max()).reshape(1)
        s = static_scales(a, spec)
        return s, s.clone()
    return static_scales(k_absmax, spec), static_scales(v_absmax, spec)


@torch.no_grad()
def fake_quantize_kv(x: torch.Tensor, spec: KVSpec, kind: str, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize a whole ``[B, H, T, D]`` key (``kind='k'``) or value tensor.

    KIVI here quantizes every complete token group (no residual window: the cache class
    handles recency); used by tests and error-bound checks.

    Raises:
        InputError: a static scheme without ``scale``.
    """
    if spec.static and scale is None:
        raise InputError(f"KV scheme {spec.describe()} needs calibrated scales")
    return spec.codec.fake_quantize(x, kind, scale)


def static_scales(absmax: torch.Tensor, spec: KVSpec) -> torch.Tensor:
    """Scale from observed absmax (``[kv_heads]`` per head, reduced to ``[1]`` for ``tensor``);
    the scheme's rule (:meth:`~compressor.kv_schemes.KVScheme.scale_from_absmax`)."""
    return spec.codec.scale_from_absmax(absmax)


# ---------------------------------------------------------------------------------------
# observers and the quantized cache (transformers Cache API, layers of CacheLayerMixin)


def cache_kwarg(module) -> str:
    """Name of the cache argument of ``module.forward``: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _layer_base():
    from transformers.cache_utils import DynamicIndexedLayer

    return DynamicIndexedLayer


def kv_observer(n_layers: int):
    """A transformers ``Cache`` for calibration: each layer records the per-head absmax of
    the post-RoPE keys and values it is given, stores nothing and returns them unchanged.

    Pass it as ``past_key_values`` (with ``use_cache=True``) to the model or to a decoder
    layer; :func:`observed_absmax` reads ``layer -> (k [kv_heads], v [kv_heads])``.
    """
    from transformers.cache_utils import Cache

    base = _layer_base()

    class ObserverLayer(base):
        def __init__(self):
            super().__init__()
            self.k_absmax = self.v_absmax = None

        def update(self, key_states, value_states, *args, **kwargs):
            k = key_states.detach().abs().float().amax(dim=(0, 2, 3)).cpu()
            v = value_states.detach().abs().float().amax(dim=(0, 2, 3)).cpu()
            self.k_absmax = k if self.k_absmax is None else torch.maximum(self.k_absmax, k)
            self.v_absmax = v if self.v_absmax is None else torch.maximum(self.v_absmax, v)
            return key_states, value_states

        def update_indexer(self, indexer_key_states, *args, **kwargs):
            return indexer_key_states

        def get_seq_length(self) -> int:
            return 0

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return query_length, 0

    return Cache(layers=[ObserverLayer() for _ in range(n_layers)])


def observed_absmax(observer) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``layer -> (k_absmax [kv_heads], v_absmax [kv_heads])`` from a :func:`kv_observer`."""
    return {i: (l.k_absmax, l.v_absmax) for i, l in enumerate(observer.layers) if l.k_absmax is not None}


def make_quantized_layer_class():
    """Build the cache-layer class lazily (transformers is imported only when needed)."""
    base = _layer_base()

    class KVQuantizedLayer(base):
        """One layer of :func:`quantized_cache`: quantizes on write, dequantizes on read,
        through the scheme's :class:`~compressor.kv_schemes.KVScheme` (``spec.codec``).

        Per-token schemes quantize every written token. KIVI appends to a full-precision
        residual and, whenever it holds more than ``residual_length`` tokens, moves its
        oldest tokens, in whole groups of ``group_size``, into the quantized store
        (:meth:`~compressor.kv_schemes.KIVIScheme.quantized_length`, the rule the
        runtime cache follows), so between ``residual_length - group_size + 1`` and
        ``residual_length`` recent tokens stay in full precision.
        """

        is_croppable = False

        def __init__(self, spec: KVSpec, k_scale=None, v_scale=None, kinds=("k", "v"), key_basis=None):
            super().__init__()
            self.spec, self.k_scale, self.v_scale = spec, k_scale, v_scale
            self.key_basis = key_basis  # complex [kv_heads, d/2] or None (see quantized_cache)
            self.codec = spec.codec  # the scheme's encode/decode, shared with the runtime cache
            self.kinds = kinds  # KIVI grouping of the two slots (MLA: both per channel)
            self.qk: list = []  # quantized chunks, as the codec's encode returns them
            self.qv: list = []
            self.n_quantized = 0
            self.cumulative_length = 0
            self.read: list = []  # the chunks decoded so far, [keys, values] (decode is per chunk: done once)
            self.n_read = 0  # chunks of qk/qv in self.read

        def lazy_initialization(self, key_states, value_states):
            super().lazy_initialization(key_states, value_states)
            self.dtype = key_states.dtype

        def _write(self, k, v):
            self.qk.append(self.codec.encode(k, self.k_scale, self.kinds[0]))
            self.qv.append(self.codec.encode(v, self.v_scale, self.kinds[1]))
            self.n_quantized += k.shape[-2]

        def _flush(self):
            """KIVI: move the oldest residual tokens to the quantized store per the scheme's rule."""
            total = torch.tensor(self.n_quantized + self.keys.shape[-2])
            n = int(self.codec.quantized_length(total)) - self.n_quantized
            if n > 0:
                self._write(self.keys[..., :n, :], self.values[..., :n, :])
                self.keys, self.values = self.keys[..., n:, :], self.values[..., n:, :]

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.cumulative_length += key_states.shape[-2]
            kivi = isinstance(self.codec, KIVIScheme)
            if not kivi:
                self._write(key_states if self.key_basis is None else turn_keys(key_states, self.key_basis), value_states)
            else:
                self.keys = torch.cat([self.keys, key_states], dim=-2) if self.keys.numel() else key_states
                self.values = torch.cat([self.values, value_states], dim=-2) if self.values.numel() else value_states
                self._flush()
            ks, vs = self._decoded()
            if kivi and self.keys.numel():
                ks.append(self.keys)
                vs.append(self.values)
            keys = torch.cat(ks, dim=-2)
            return keys if self.key_basis is None else turn_keys(keys, 1 / self.key_basis), torch.cat(vs, dim=-2)

        def _decoded(self) -> tuple[list, list]:
            """``([keys], [values])`` of every quantized chunk (empty lists before the first), decoding only the
            chunks written since the last read (a decode step writes one token: no re-decoding the whole cache)."""
            new = [(self.codec.decode(c, self.k_scale, self.kinds[0], self.dtype),
                    self.codec.decode(d, self.v_scale, self.kinds[1], self.dtype))
                   for c, d in zip(self.qk[self.n_read:], self.qv[self.n_read:])]
            if new:
                parts = ([self.read[0]], [self.read[1]]) if self.read else ([], [])
                self.read = [torch.cat(parts[0] + [k for k, _ in new], dim=-2),
                             torch.cat(parts[1] + [v for _, v in new], dim=-2)]
                self.n_read = len(self.qk)
            return ([self.read[0]], [self.read[1]]) if self.read else ([], [])

        def get_seq_length(self) -> int:
            return self.cumulative_length

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.cumulative_length + query_length, 0

        def reset(self) -> None:
            self.qk, self.qv, self.n_quantized, self.cumulative_length = [], [], 0, 0
            self.read, self.n_read = [], 0
            self.keys = self.values = None
            self.is_initialized = False

    return KVQuantizedLayer


def quantized_cache(spec: KVSpec, n_layers: int, scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
                    layout: KVLayout | None = None, key_basis: dict[int, torch.Tensor] | None = None):
    """A transformers ``Cache`` whose layers quantize K/V with ``spec``.

    Args:
        scales: layer index -> ``(k_scale, v_scale)`` for static schemes.
        layout: the model's :class:`KVLayout` (default GQA); on MLA the two slots are the
            latent and the RoPE key, both grouped per channel by KIVI (module docstring).
        key_basis: layer index -> complex ``[kv_heads, d/2]``: keys are turned into that basis
            before they are quantized and back after (an artifact's ``kv_cache.key_rotation:
            pairs`` applied to the reference model; :func:`compressor.kv_layout.turn_keys`).

    Raises:
        InputError: a static scheme without scales for some layer; a per-head scheme on MLA;
            a key basis for a dynamic scheme.
    """
    from transformers.cache_utils import Cache

    if layout is not None:
        check_layout(spec, layout)
    if key_basis and not spec.static:
        raise InputError(f"a key basis applies to static KV scales, not {spec.describe()}")
    if spec.static and (scales is None or any(i not in scales for i in range(n_layers))):
        raise InputError(f"KV scheme {spec.describe()} needs calibrated k_scale/v_scale for every layer")
    cls = make_quantized_layer_class()
    kinds = layout.kinds if layout is not None else ("k", "v")
    layers = [cls(spec, *(scales[i] if spec.static else (None, None)), kinds=kinds,
                  key_basis=(key_basis or {}).get(i)) for i in range(n_layers)]
    return Cache(layers=layers)


# ---------------------------------------------------------------------------------------
# memory accounting


def layout_bytes_per_token(spec: KVSpec | None, layout: KVLayout, fp_bytes: int = 2) -> float:
    """Average KV-cache bytes per token over all layers of ``layout``, scale overhead included.

    Per layer, for each of the two components (``heads x width`` elements): ``spec=None``
    costs ``fp_bytes`` per element; a scheme costs ``bits / 8`` per element plus, for
    per-token int8, an fp16 scale and zero point per (head, token); for KIVI, fp16 scale +
    zero for every ``group_size`` tokens of each channel (``k`` components) or for every
    group of ``group_size`` channels of each token (``v`` components; one group when
    ``group_size`` does not divide the width). Static scales are per layer (negligible, not
    counted). GQA: ``2 * layers * kv_heads * head_dim`` elements; MLA:
    ``layers * (kv_lora_rank + qk_rope_head_dim)``. The KIVI full-precision residual
    window is a per-sequence constant, see :func:`kv_budget`.
    """
    if spec is not None:
        return spec.codec.bytes_per_token(layout)
    total = 0.0
    for c in layout.components:
        total += c.heads * c.width * fp_bytes
    return float(total * layout.n_layers)


def kv_bytes_per_token(spec: KVSpec | None, n_layers: int, kv_heads: int, head_dim: int, fp_bytes: int = 2) -> float:
    """:func:`layout_bytes_per_token` of a GQA cache (keys and values, ``kv_heads x head_dim`` each)."""
    return layout_bytes_per_token(spec, gqa_layout(n_layers, kv_heads, head_dim), fp_bytes)


def kv_budget(spec: KVSpec | None, n_layers: int, kv_heads: int, head_dim: int, budget_gib: float,
              contexts: tuple[int, ...] = (2048, 8192, 32768), layout: KVLayout | None = None) -> dict:
    """How many tokens (context × batch) a KV budget holds, and the batch at a few context lengths.

    ``layout`` (e.g. MLA) replaces the GQA shape given by ``n_layers, kv_heads, head_dim``.
    Returns ``{"bytes_per_token", "max_tokens", "max_batch": {context: batch}}``; for KIVI
    each sequence also keeps up to ``residual_length`` tokens in fp16.
    """
    layout = layout or gqa_layout(n_layers, kv_heads, head_dim)
    per_tok = layout_bytes_per_token(spec, layout)
    fp_tok = layout_bytes_per_token(None, layout)
    budget = budget_gib * 2**30
    residual = spec.residual_length if spec is not None and spec.codec.residual_window else 0
    max_batch = {}
    for ctx in contexts:
        r = min(residual, ctx)
        per_seq = (ctx - r) * per_tok + r * fp_tok
        max_batch[ctx] = int(budget // per_seq)
    return {"bytes_per_token": per_tok, "max_tokens": int(budget // per_tok), "max_batch": max_batch}
