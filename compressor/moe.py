"""Mixture-of-experts layers as per-expert linears, with routed-token counts.

transformers 5 stores a layer's routed experts as fused 3-D parameters
(``gate_up_proj [E, 2I, H]``: rows ``[:I]`` gate, ``[I:]`` up; ``down_proj [E, H, I]``)
behind a module called as ``experts(hidden [N, H], top_k_index [N, k], top_k_weights
[N, k])``. :func:`unfuse_experts` replaces each such module by :class:`UnfusedExperts`,
a ``ModuleList`` of :class:`ExpertMLP` (``gate_proj``, ``up_proj``, ``down_proj``
``nn.Linear``; the names of the Qwen2-MoE/DeepSeek/GLM checkpoints) with the same forward
arithmetic, so the sequential pipeline quantizes each expert like any linear and its
hooks see exactly the tokens routed to that expert. :attr:`UnfusedExperts.counts`
accumulates how many (token, slot) routings each expert received.
"""

from __future__ import annotations

import torch

from .arch import ArchSpec, find_module, get_module, num_experts


class ExpertMLP(torch.nn.Module):
    """One routed expert: ``down_proj(act(gate_proj(x)) * up_proj(x))``; ``x [n, H]``."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act):
        super().__init__()
        i, h = gate.shape
        self.gate_proj = torch.nn.Linear(h, i, bias=False, dtype=gate.dtype, device=gate.device)
        self.up_proj = torch.nn.Linear(h, i, bias=False, dtype=up.dtype, device=up.device)
        self.down_proj = torch.nn.Linear(i, h, bias=False, dtype=down.dtype, device=down.device)
        with torch.no_grad():
            self.gate_proj.weight.copy_(gate)
            self.up_proj.weight.copy_(up)
            self.down_proj.weight.copy_(down)
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class UnfusedExperts(torch.nn.ModuleList):
    """Drop-in for transformers' fused experts module (same call, same arithmetic).

    ``forward(hidden [N, H], top_k_index int64 [N, k], top_k_weights [N, k]) -> [N, H]``:
    each expert runs on the tokens routed to it; outputs are weighted and summed with
    ``index_add_`` as in transformers' reference loop. ``counts`` (int64 ``[E]``) adds the
    routed (token, slot) pairs of every call; reset it with ``counts.zero_()``.
    """

    def __init__(self, experts: list[ExpertMLP]):
        super().__init__(experts)
        self.register_buffer("counts", torch.zeros(len(experts), dtype=torch.int64), persistent=False)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        n = len(self)
        flat = top_k_index.reshape(-1)
        valid = flat[(flat >= 0) & (flat < n)]
        self.counts += torch.bincount(valid, minlength=n)[:n].to(self.counts.device)
        for e in torch.unique(valid).tolist():
            token_idx, slot = torch.where(top_k_index == e)
            y = self[e](hidden_states[token_idx]) * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def unfuse_experts(model, arch: ArchSpec) -> int:
    """Replace every fused experts module of ``model`` by :class:`UnfusedExperts`, in place.

    The fused parameters are released (no second copy is kept). Returns the number of
    MoE layers converted (0 for dense architectures or an already unfused model).
    """
    if arch.moe is None:
        return 0
    parent_path, _, leaf = arch.moe.experts.rpartition(".")
    converted = 0
    for layer in get_module(model, arch.layers):
        fused = find_module(layer, arch.moe.experts)
        if fused is None or isinstance(fused, UnfusedExperts) or not num_experts(arch, layer):
            continue
        gu, dn = fused.gate_up_proj.detach(), fused.down_proj.detach()
        i = gu.shape[1] // 2
        experts = [ExpertMLP(gu[e, :i], gu[e, i:], dn[e], fused.act_fn) for e in range(gu.shape[0])]
        unfused = UnfusedExperts(experts).requires_grad_(fused.gate_up_proj.requires_grad)
        setattr(get_module(layer, parent_path) if parent_path else layer, leaf, unfused)
        converted += 1
    return converted


def routed_experts(layer, arch: ArchSpec) -> UnfusedExperts | None:
    """Decoder layer ``layer``'s unfused routed experts, or ``None`` (dense layer, or experts not unfused)."""
    if arch.moe is None:
        return None
    m = find_module(layer, arch.moe.experts)
    return m if isinstance(m, UnfusedExperts) else None


def cold_experts(counts: list[int] | None, min_tokens: int) -> set[int]:
    """Experts routed fewer than ``max(min_tokens, 1)`` (token, slot) pairs (none without counts)."""
    if counts is None:
        return set()
    limit = max(min_tokens, 1)
    return {e for e, c in enumerate(counts) if c < limit}
