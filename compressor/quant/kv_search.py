"""Static KV-cache scales chosen by the attention output's error (``kv_cache.scale_search: attention``).

A static scheme stores one scale per layer (or per KV head) and ``Q(x / scale)``. The rule
``absmax / 448`` (fp8 e4m3; ``/ 127`` for int8) only avoids clipping: float8's rounding is
relative, so where each of the cache's largest values lands on e4m3's 3-bit mantissa grid,
and with it the error of the attention logits, depends on the scale's position inside one
binade in a way absmax ignores. On SmolLM2-135M the fp8 cache with ``absmax / 448`` costs
+1.08 % perplexity (4 windows of wiki.test.raw); scales chosen by this search cost +0.6 %
(BENCHMARKS.md, issue #18).

The search, per decoder layer, after the layer's calibration recompute (the quantized
weights' keys and values, as the observers saw them):

1. the attention's post-RoPE queries, keys and values of the first ``samples`` calibration
   sequences are recorded at the attention function (:class:`AttentionRecorder`);
2. for each multiplier ``m`` of :data:`GRID` (``2^(j/16)``, ``j = -2 .. 15``: one binade and
   a little clipping), the keys are rounded with the scale of ``m x absmax`` (in the stored
   scale's dtype) and the values with ``absmax``'s scale, the layer's own attention function
   runs on them, and the squared error of ``o_proj``'s output against the unrounded
   attention is summed (per KV head for per-head schemes: the error of the query heads
   reading it, through their ``o_proj`` columns); the best ``m`` is kept for the keys;
3. the same for the values, with the keys at their chosen scale.

The layer's ranges become ``absmax x m`` (what the scales, the manifest's ``absmax`` record
and a resumed run read). Only layouts with KV heads (GQA, MHA) are searched: on an MLA cache
(one scale over ``c_kv`` and ``k_rope``) ``auto`` keeps absmax and ``attention`` is refused
(:func:`resolve_scale_search`).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from ..arch import get_module
from ..errors import InputError
from ..kv_schemes import KVSpec

#: scale multipliers tried (applied to the observed absmax): one binade in 16 steps and two below 1
GRID = tuple(2 ** (j / 16) for j in range(-2, 16))
#: the attention implementation name the recorder registers with transformers
RECORD_NAME = "kvq_kv_record"


class AttentionRecorder:
    """Records the inputs of one attention module's attention function (``q [b, heads, T, d]``,
    ``k``/``v [b, kv_heads, T, d]`` post-RoPE, the mask and keyword arguments) for the first
    ``max_sequences`` sequences it sees, and the function itself (the one the model would
    have called), so that :func:`search_kv_ranges` can rerun it on rounded keys and values."""

    def __init__(self, attn: torch.nn.Module, max_sequences: int):
        self.attn = attn
        self.max_sequences = max_sequences
        self.records: list[tuple] = []
        self.seen = 0
        self.delegate = None

    def _call(self, module, query, key, value, attention_mask, **kwargs):
        out = self.delegate(module, query, key, value, attention_mask, **kwargs)
        if module is self.attn and self.seen < self.max_sequences:
            n = min(query.shape[0], self.max_sequences - self.seen)
            mask = attention_mask[:n] if attention_mask is not None and attention_mask.shape[0] > 1 else attention_mask
            self.records.append((query[:n].detach(), key[:n].detach(), value[:n].detach(), mask, kwargs))
            self.seen += n
        return out

    @contextmanager
    def active(self):
        """While active, ``self.attn``'s config names the recorder as its attention implementation."""
        with _attention_swapped(self.attn, self._call) as delegate:
            self.delegate = delegate
            yield self


@contextmanager
def _attention_swapped(attn: torch.nn.Module, call):
    """While active, the config ``attn`` reads names ``call`` (registered under
    :data:`RECORD_NAME`) as its attention implementation; yields the function the model would
    have called (its implementation, or the modeling file's eager one), restored on exit."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = attn.config
    original = config._attn_implementation
    eager = getattr(sys.modules.get(type(attn).__module__), "eager_attention_forward", None)
    delegate = ALL_ATTENTION_FUNCTIONS.get_interface(original, eager)
    if delegate is None:
        raise RuntimeError(f"no attention function for implementation {original!r}")
    ALL_ATTENTION_FUNCTIONS[RECORD_NAME] = call
    config._attn_implementation = RECORD_NAME
    try:
        yield delegate
    finally:
        config._attn_implementation = original
        del ALL_ATTENTION_FUNCTIONS[RECORD_NAME]


def _errors(rec: AttentionRecorder, spec: KVSpec, k_scales: list, v_scales: list, kv_heads: int) -> torch.Tensor:
    """``[len(k_scales), kv_heads]`` float64: per candidate ``(k_scale, v_scale)`` pair, the squared
    error of ``o_proj``'s output (or of the attention output where there is none) summed over
    the recorded tokens, per KV head's query heads; computed in float32 from the records."""
    o_proj = getattr(rec.attn, "o_proj", None)
    w = o_proj.weight.float().view(o_proj.weight.shape[0], kv_heads, -1) if o_proj is not None else None
    device = rec.records[0][0].device if rec.records else None  # the attention's (the layer's) device
    errs = torch.zeros(len(k_scales), kv_heads, dtype=torch.float64, device=device)
    for q, k, v, mask, kw in rec.records:
        # in float32 whatever the model runs in: a bfloat16 attention's own rounding would drown
        # the differences between candidates (a no-op for the pipeline's float32 layers)
        q, k, v = q.float(), k.float(), v.float()
        if mask is not None and mask.is_floating_point():
            mask = mask.float()
        ref, _ = rec.delegate(rec.attn, q, k, v, mask, **kw)  # [b, T, heads, d]
        b, t = ref.shape[:2]
        ref = ref.float().reshape(b * t, kv_heads, -1)  # each KV head's query heads side by side
        kq = vq = ks_done = vs_done = None  # one side's scale is the same for every candidate: rounded once
        for c, (ks, vs) in enumerate(zip(k_scales, v_scales)):
            if ks is not ks_done:
                kq, ks_done = spec.codec.fake_quantize(k, "k", ks), ks
            if vs is not vs_done:
                vq, vs_done = spec.codec.fake_quantize(v, "v", vs), vs
            out, _ = rec.delegate(rec.attn, q, kq, vq, mask, **kw)
            diff = out.float().reshape(b * t, kv_heads, -1) - ref
            if w is not None:  # each KV head's query heads through their o_proj columns: [kv_heads, b*t, H]
                diff = torch.bmm(diff.transpose(0, 1), w.permute(1, 2, 0))
                errs[c] += diff.pow(2).sum((1, 2), dtype=torch.float64)
            else:
                errs[c] += diff.pow(2).sum((0, 2), dtype=torch.float64)
    return errs


@torch.no_grad()
def search_kv_ranges(rec: AttentionRecorder, spec: KVSpec, k_absmax: torch.Tensor, v_absmax: torch.Tensor,
                     scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ranges (``absmax x m``, ``[kv_heads]`` float32 each) whose static scales give the
    smallest attention error on the recorded sequences, keys first, then values; returns
    ``(k_range, v_range, k_multipliers, v_multipliers)``.

    ``k_absmax``/``v_absmax``: the layer's observed absmax per KV head ``[kv_heads]``;
    ``scale_dtype``: the dtype the artifact stores the scales in (each candidate is rounded
    to it). Per-tensor schemes choose one multiplier for all heads, per-head schemes one per
    KV head. With no record the ranges are the absmax (multipliers 1).
    """
    kv_heads = k_absmax.numel()
    ones = torch.ones(kv_heads, device=k_absmax.device)
    if not rec.records:
        return k_absmax.float(), v_absmax.float(), ones, ones

    def scales(absmax, m):
        return spec.codec.scale_from_absmax(absmax.float() * m).to(scale_dtype).float()

    def choose(errs):
        if spec.codec.per_tensor:
            return torch.full((kv_heads,), GRID[int(errs.sum(1).argmin())], device=k_absmax.device)
        return torch.tensor([GRID[j] for j in errs.argmin(0).tolist()], device=k_absmax.device)

    v_base = scales(v_absmax, ones)
    mk = choose(_errors(rec, spec, [scales(k_absmax, m) for m in GRID], [v_base] * len(GRID), kv_heads))
    k_best = scales(k_absmax, mk)
    mv = choose(_errors(rec, spec, [k_best] * len(GRID), [scales(v_absmax, m) for m in GRID], kv_heads))
    return k_absmax.float() * mk, v_absmax.float() * mv, mk, mv


def resolve_scale_search(kv_options, layout) -> str:
    """``absmax`` or ``attention``: what ``kv_options.scale_search`` (a recipe's ``kv_cache``
    section, or ``None``) means on a cache of ``layout`` (:class:`~compressor.quant.kv.KVLayout`):
    ``auto`` is ``attention`` where the cache has KV heads and ``absmax`` on MLA (one scale
    over ``c_kv`` and ``k_rope``); dynamic schemes have nothing to search.

    Raises:
        InputError: ``attention`` asked for on an MLA cache.
    """
    if kv_options is None or not kv_options.spec().static or kv_options.scale_search == "absmax":
        return "absmax"
    if layout.shared_scale:
        if kv_options.scale_search == "attention":
            raise InputError("kv_cache.scale_search attention needs a cache with KV heads (GQA/MHA); this model's "
                             "MLA cache shares one scale over c_kv and k_rope: use absmax or auto")
        return "absmax"
    return "attention"


def layer_recorder(layer, ctx) -> AttentionRecorder | None:
    """The recorder of decoder layer ``layer``'s attention when the run searches its KV scales
    (``ctx.kv_scale_search == "attention"``, observers on), else ``None``."""
    if ctx.observer is None or ctx.kv_scale_search != "attention":
        return None
    return AttentionRecorder(get_module(layer, ctx.arch.attention), ctx.recipe.kv_cache.scale_search_samples)


def search_warnings(layers: list[dict], kv_options) -> list[str]:
    """A warning when the search saw fewer calibration sequences than ``scale_search_samples``
    asked for (the calibration set is smaller): ``layers`` are the run's layer figures."""
    seen = [f["kv_scale_multipliers"]["sequences"] for f in layers if "sequences" in f.get("kv_scale_multipliers", {})]
    if kv_options is None or not seen or min(seen) >= kv_options.scale_search_samples:
        return []
    return [f"kv_cache.scale_search_samples is {kv_options.scale_search_samples} but the calibration set has "
            f"{min(seen)} sequence(s): the KV scale search used {min(seen)}"]
