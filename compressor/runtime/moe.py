"""Mixture-of-experts blocks of the runtime: each family's router, routed experts, shared experts.

Routers compute exactly what transformers' ``*TopkRouter`` modules compute:

======================  =====================================================================
router                  rule (``E`` experts, ``k = num_experts_per_tok``)
======================  =====================================================================
:class:`SoftmaxRouter`  ``softmax(x W^T)`` in float32, top-``k``, renormalized to sum 1 when
                        ``norm_topk_prob`` (Mixtral always; Qwen3-MoE as configured); the
                        weights stay float32 (Mixtral) or return to the logits' dtype (Qwen3-MoE)
:class:`SigmoidRouter`  DeepSeek-V3 / Kimi K2 / GLM-4.5: ``s = sigmoid(x W^T)`` in float32;
                        choice scores ``s + e_score_correction_bias``; experts in ``n_group``
                        groups, a group scored by the sum of its two best choice scores, the
                        ``topk_group`` best groups kept; top-``k`` choice scores among them;
                        weights ``s`` of those experts, renormalized (``+1e-20``) when
                        ``norm_topk_prob``, times ``routed_scaling_factor``
======================  =====================================================================

:class:`MoE` groups the tokens per expert, so each routed expert's gate/up/down Linears run
once per step on the tokens routed to it (packed int4/int8 experts stay packed: each is an
ordinary runtime Linear), accumulating ``weight * expert(x)`` in transformers' order (experts
ascending; within an expert, by top-k slot then token). Shared experts (DeepSeek-V3,
GLM-4.5) run on every token and are added. On CUDA with the Triton backend the routed experts
of a 4-bit layer run instead as two grouped W4A16 launches
(:class:`GroupedW4Experts`, :func:`~compressor.runtime.triton_kernels.moe_w4a16`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .blocks import GatedMLP


class SoftmaxRouter:
    """Mixtral / Qwen3-MoE routing (module table). ``weight`` ``[E, C]`` in the compute dtype."""

    def __init__(self, weight: torch.Tensor, top_k: int, normalize: bool, cast_back: bool):
        self.weight, self.top_k, self.normalize, self.cast_back = weight, int(top_k), bool(normalize), bool(cast_back)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, C]`` -> ``(weights [N, k], expert ids int64 [N, k])``."""
        logits = F.linear(x, self.weight)  # (N, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top.to(logits.dtype) if self.cast_back else top), idx


class SigmoidRouter:
    """DeepSeek-V3 routing (module table). ``weight`` ``[E, C]`` and ``bias`` ``[E]`` float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                 normalize: bool, scaling: float):
        self.weight, self.bias = weight.float(), bias.float()
        self.top_k, self.n_group, self.topk_group = int(top_k), int(n_group), int(topk_group)
        self.normalize, self.scaling = bool(normalize), float(scaling)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, C]`` -> ``(weights float32 [N, k], expert ids int64 [N, k])``."""
        E = self.weight.shape[0]
        scores = F.linear(x.float(), self.weight).sigmoid()  # (N, E)
        choice = scores + self.bias
        group_scores = choice.view(-1, self.n_group, E // self.n_group).topk(2, dim=-1)[0].sum(dim=-1)  # (N, G)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, E // self.n_group).reshape(-1, E)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.normalize:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx


def make_router(cfg, weight: torch.Tensor, bias: torch.Tensor | None):
    """The router a config describes: :class:`SigmoidRouter` when it has ``routed_scaling_factor``
    (DeepSeek-V3's family; a missing ``e_score_correction_bias`` counts as zeros), else
    :class:`SoftmaxRouter` (``norm_topk_prob`` default True, as Mixtral, which has no such field)."""
    k = int(cfg.num_experts_per_tok)
    if getattr(cfg, "routed_scaling_factor", None) is not None:
        bias = torch.zeros(weight.shape[0], device=weight.device) if bias is None else bias
        return SigmoidRouter(weight, bias, k, int(getattr(cfg, "n_group", None) or 1),
                             int(getattr(cfg, "topk_group", None) or 1), bool(getattr(cfg, "norm_topk_prob", True)),
                             float(cfg.routed_scaling_factor))
    has_flag = hasattr(cfg, "norm_topk_prob")
    return SoftmaxRouter(weight, k, bool(getattr(cfg, "norm_topk_prob", True)), cast_back=has_flag)


class MoE:
    """A mixture-of-experts MLP: router, routed experts (:class:`GatedMLP` each), optional shared experts.

    Args:
        router: :class:`SoftmaxRouter` or :class:`SigmoidRouter`.
        experts: one GatedMLP per routed expert (expert ``e`` at index ``e``).
        shared: the shared experts' GatedMLP, or None.
        grouped: a :class:`GroupedW4Experts` that replaces the per-expert loop (CUDA/Triton).
    """

    def __init__(self, router, experts: list[GatedMLP], shared: GatedMLP | None = None, grouped=None):
        self.router, self.experts, self.shared, self.grouped = router, experts, shared, grouped

    def linears(self) -> dict:
        """Relative name (``experts.<e>.gate_proj`` ...) -> Linear."""
        out = {f"experts.{e}.{n}": lin for e, mlp in enumerate(self.experts) for n, lin in mlp.linears().items()}
        if self.shared is not None:
            out.update({f"shared_experts.{n}": lin for n, lin in self.shared.linears().items()})
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x2 = x.reshape(-1, C)  # (N, C)
        w, idx = self.router(x2)  # (N, k), (N, k)
        y = self.grouped(x2, w, idx) if self.grouped is not None else self.routed(x2, w, idx)
        y = y.view(B, T, C)
        return y if self.shared is None else y + self.shared(x)

    def routed(self, x2: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``sum_k w[n, k] * expert_{idx[n, k]}(x2[n])`` with one call per expert hit (transformers' order)."""
        out = torch.zeros_like(x2)
        hits = torch.bincount(idx.flatten(), minlength=len(self.experts)).nonzero().flatten().tolist()
        slots = idx.t()  # (k, N): where() yields (top-k slot, token) pairs as transformers' expert mask
        for e in hits:
            pos, tok = torch.where(slots == e)
            y = self.experts[e](x2[tok])
            out.index_add_(0, tok, (y * w[tok, pos, None]).to(out.dtype))
        return out


class GroupedW4Experts:
    """The routed experts of one layer as stacked W4A16 tensors for the grouped Triton kernel.

    ``gate_up``: qweight int32 ``[E, 2I, C/8]``, scales/zeros ``[E, 2I, C/gs]`` (each expert's
    gate rows, then its up rows); ``down``: ``[E, C, I/8]``, ``[E, C, I/gs]`` (layout of
    :mod:`~compressor.runtime.triton_kernels`). Built from the experts' ``TritonW4Linear`` layers,
    which then hold views into these stacks (the codes are stored once).
    """

    def __init__(self, experts: list[GatedMLP], act):
        g = [m.gate for m in experts]
        u = [m.up for m in experts]
        d = [m.down for m in experts]
        self.gate_up = tuple(torch.stack([torch.cat([getattr(a, f), getattr(b, f)]) for a, b in zip(g, u)])
                             for f in ("qweight", "scales", "zeros"))
        self.down = tuple(torch.stack([getattr(m, f) for m in d]) for f in ("qweight", "scales", "zeros"))
        self.gs_in, self.gs_mid = g[0].group_size, d[0].group_size
        self.inter = g[0].out_features
        self.act = act
        i = self.inter
        for e, (a, b, c) in enumerate(zip(g, u, d)):  # the per-expert layers become views: one copy of the codes
            a.qweight, a.scales, a.zeros = (t[e, :i] for t in self.gate_up)
            b.qweight, b.scales, b.zeros = (t[e, i:] for t in self.gate_up)
            c.qweight, c.scales, c.zeros = (t[e] for t in self.down)

    def __call__(self, x2: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        from .triton_kernels import moe_w4a16

        dt = self.gate_up[1].dtype
        N, k = idx.shape
        h = moe_w4a16(x2.to(dt), idx, *self.gate_up, self.gs_in, rows_per_token=k)  # (N*k, 2I)
        gate, up = h.split(self.inter, dim=-1)
        mid = (self.act(gate) * up).contiguous()  # (N*k, I)
        y = moe_w4a16(mid, idx, *self.down, self.gs_mid, rows_per_token=1)  # (N*k, C)
        y = y.view(N, k, -1).to(x2.dtype) * w[..., None].to(x2.dtype)
        return y.sum(dim=1)
