"""Weight-space and generation comparisons of an artifact against its reference model.

Used by ``kvq verify``; the statistics themselves are defined in :mod:`compressor.stats`.
"""

from __future__ import annotations

import math

import torch

from .arch import checkpoint_name, find_module, get_arch, layer_groups, layer_linears, linear_weight
from .quant.algorithms import find_algorithm
from .quant.awq_layer import kv_repeat
from .stats import STATS_BLOCK, first_divergence, summarize, weight_error, weight_stats
from .tokens import bos_token_id, encode


def _awq_equivalent_scales(reference, artifact, arch, layers=None) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Scales AWQ folded into each linear: full module name -> ``(row_scale [out] | None, col_scale [in] | None)``.

    AWQ (Lin et al., 2023) multiplies a linear's input channels by ``s`` and divides the
    preceding op's output by ``s``, so the artifact's ``W_hat`` approximates
    ``diag(1/s_row) W diag(s_col)``, not ``W`` (``s_row`` when the linear is itself the
    preceding op of another group, e.g. ``up_proj`` before ``down_proj``). For a norm
    before the linear, ``s = (norm_ref + o) / (norm_art + o)`` exactly (up to the stored
    dtype; ``o`` the arch's ``norm_offset``, 1 for Gemma's ``(1 + weight)`` norms). For a
    linear ``P`` before it the scale is fitted per output row of ``P`` (whose rows were
    divided by ``s``; only the group's chunk of rows, ``prev_rows``, for GLM-4's fused
    ``gate_up_proj``): ``s_j = <P_j, P_j> / <P_hat_j, P_j>`` (least squares, ``P`` taken
    with its own input scales; it absorbs the error component along ``P_j``, about
    ``1/in_features`` of ``P``'s error energy). A change that rescales whole output rows
    of ``P`` is indistinguishable from AWQ's own scaling and shows up in the consuming
    linear instead. Experts kept fused by transformers are read as per-expert slices.
    ``layers``: ``(i, reference layer, artifact layer)`` triples (default: every decoder layer).
    """
    out: dict[str, list] = {}
    ones = lambda t: torch.allclose(t, torch.ones_like(t), rtol=0, atol=1e-6)  # noqa: E731
    for i, lr, la in _layer_pairs(reference, artifact, arch) if layers is None else layers:
        for group in layer_groups(arch, lr):
            prev_r = find_module(lr, group.prev_op)
            is_norm = prev_r is not None and not isinstance(prev_r, torch.nn.Linear)
            rows = kv = None
            if is_norm:
                off = arch.norm_offset
                num = prev_r.weight.detach().double() + off
                den = la.get_submodule(group.prev_op).weight.detach().double() + off
                nz = den.abs() > 0
                s = torch.where(nz, num / torch.where(nz, den, torch.ones_like(den)), torch.ones_like(den))
            else:
                p = linear_weight(arch, lr, group.prev_op).detach()
                p_hat = linear_weight(arch, la, group.prev_op).detach()
                if p.is_meta or p_hat.is_meta:
                    continue  # a routed expert not read yet (a streamed verify reads them in groups)
                if group.prev_rows is not None:
                    k, n = group.prev_rows
                    step = p.shape[0] // n
                    rows = slice(k * step, (k + 1) * step)
                    p, p_hat = p[rows], p_hat[rows]
                kv = kv_repeat(lr, group) if group.requires_square else None  # GQA v -> o: s repeated per query head
                if linear_weight(arch, lr, group.linears[0]).shape[1] != p.shape[0] and kv is None:
                    continue  # the group was skipped at quantization (shapes do not chain)
                # fit from the producer, whose output rows were divided by s: P_hat_j ~ P_j diag(c) / s_j
                sq, dot = _row_fit(p, p_hat, out.get(f"{arch.layers}.{i}.{group.prev_op}", [None, None])[1])
                s = sq / dot.where(dot.abs() > 1e-30, torch.full_like(dot, 1e-30))
            if ones(s):
                continue
            s_cols = s
            if not is_norm and kv is not None:
                s_cols = s.view(kv[0], 1, kv[2]).expand(*kv).reshape(-1)
            for rel in group.linears:
                out.setdefault(f"{arch.layers}.{i}.{rel}", [None, None])[1] = s_cols
            if not is_norm:
                full = s
                if rows is not None:
                    full = torch.ones(linear_weight(arch, lr, group.prev_op).shape[0], dtype=s.dtype)
                    full[rows] = s
                out.setdefault(f"{arch.layers}.{i}.{group.prev_op}", [None, None])[0] = full
    return {k: (v[0], v[1]) for k, v in out.items()}


#: elements of a producer's weight :func:`_row_fit` takes in float64 at once (32 MiB a copy)
FIT_BLOCK = 2**22


def _row_fit(p: torch.Tensor, p_hat: torch.Tensor, c: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(<P_j, P_j>, <P_hat_j, P_j>)`` per output row ``j`` in float64, ``P`` = ``p [out, in]`` times ``c [in]``
    (its own input scales) when given, ``P_hat`` = ``p_hat``. Rows are taken in blocks of about
    :data:`FIT_BLOCK` elements: each row's sums are its own, and the float64 copies stay small (a Kimi K2
    dense up_proj is 132 M weights: 1 GB a copy in float64)."""
    step = max(1, FIT_BLOCK // max(1, p.shape[1]))
    sq, dot = [], []
    for r in range(0, p.shape[0], step):
        pb = p[r:r + step].double()
        if c is not None:
            pb = pb * c.view(1, -1)
        sq.append(pb.pow(2).sum(1))
        dot.append((p_hat[r:r + step].double() * pb).sum(1))
    return torch.cat(sq), torch.cat(dot)


def _layer_pairs(reference, artifact, arch) -> list[tuple[int, torch.nn.Module, torch.nn.Module]]:
    """``(i, reference layer i, artifact layer i)`` for every decoder layer."""
    return [(i, lr, la) for i, (lr, la) in enumerate(zip(reference.get_submodule(arch.layers),
                                                          artifact.get_submodule(arch.layers)))]


@torch.no_grad()
def key_basis(reference, artifact, algorithm: str, layers: list | None = None) -> dict[int, torch.Tensor]:
    """Per decoder layer, the artifact's key basis relative to the reference
    (``kv_cache.key_rotation: pairs``): the complex factor per KV head and RoPE pair
    (``[kv_heads, d/2]`` complex128) fitted from the two ``k_proj`` weights
    (:func:`compressor.quant.kv_rotation.fit_pairs`), AWQ's folded input scales undone first
    when ``algorithm`` folds them. ``kvq verify`` turns the reference's keys into it for the
    KV-only figures, whose static scales were chosen in that basis. ``layers``: as for :func:`weight_report`."""
    from .quant.kv_rotation import fit_pairs

    arch = get_arch(reference.config.model_type)
    handler = find_algorithm(algorithm)
    layers = _layer_pairs(reference, artifact, arch) if layers is None else layers
    scales = _awq_equivalent_scales(reference, artifact, arch, layers) if handler is not None and handler.folds_input_scales else {}
    out = {}
    for i, lr, la in layers:
        rel = f"{arch.attention}.k_proj"
        w_hat = linear_weight(arch, la, rel).detach().double()
        col = scales.get(f"{arch.layers}.{i}.{rel}", (None, None))[1]
        out[i] = fit_pairs(linear_weight(arch, lr, rel).detach(), w_hat if col is None else w_hat / col.view(1, -1),
                           _head_dim(reference.config))
    return out


#: largest relative residual of a KV-only artifact's q_proj/k_proj after its per-pair factors are
#: divided out (bfloat16 storage alone leaves at most 0.0017 on SmolLM2-135M)
KEY_PAIRS_TOLERANCE = 1e-2


@torch.no_grad()
def key_pairs_residual(reference, artifact, layers: list | None = None) -> tuple[float, str]:
    """How far a KV-only artifact's ``q_proj``/``k_proj`` are from the reference's rows turned per
    RoPE pair (``kv_cache.key_rotation: pairs``, float weights): the largest relative Frobenius
    residual after :func:`compressor.quant.kv_rotation.undo_pairs`, and the tensor it is in.
    ``kvq verify`` runs the KV-only figures on the reference in the artifact's key basis, which
    describes the artifact only while this stays within :data:`KEY_PAIRS_TOLERANCE`. ``layers``: as for
    :func:`weight_report`."""
    from .quant.kv_rotation import undo_pairs

    arch = get_arch(reference.config.model_type)
    worst, name = 0.0, ""
    for i, lr, la in _layer_pairs(reference, artifact, arch) if layers is None else layers:
        for rel in (f"{arch.attention}.q_proj", f"{arch.attention}.k_proj"):
            w = linear_weight(arch, lr, rel).detach().double()
            back = undo_pairs(w, linear_weight(arch, la, rel).detach().double(), _head_dim(reference.config))
            r = float(weight_error(w, back)["rel_fro"])
            if not r <= worst:  # NaN counts as the worst
                worst, name = r, checkpoint_name(arch, f"{arch.layers}.{i}.{rel}") + ".weight"
    return worst, name


def _head_dim(cfg) -> int:
    """Channels per attention head of a model config (``head_dim``, else hidden / heads)."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


@torch.no_grad()
def weight_report(reference, artifact, algorithm: str, quantized_head: bool = False, key_pairs: bool = False,
                  basis: dict | None = None, layers: list | None = None, quantized_embedding: bool = False,
                  select=None) -> dict:
    """Per quantized linear: relative Frobenius error, SQNR (dB) and original-vs-artifact
    statistics; plus a per-decoder-layer summary.

    Args:
        reference: the original float model.
        artifact: the artifact loaded as a float model (dequantized weights).
        algorithm: the recipe's algorithm; when its handler folds input scales into the
            weights (``awq``: :attr:`~compressor.quant.algorithms.Algorithm.folds_input_scales`)
            they are undone first (see :func:`_awq_equivalent_scales`); a name without a
            handler (``unknown``: a foreign artifact) undoes nothing.
        key_pairs: the artifact's q_proj/k_proj rows carry per-RoPE-pair factors
            (``kv_cache.key_rotation: pairs``); each pair's least-squares factor is divided out
            (:func:`compressor.quant.kv_rotation.undo_pairs`).
        basis: with ``key_pairs``, filled with what :func:`key_basis` returns (the ``k_proj``
            factors fitted here), so ``kvq verify`` does not fit them twice.
        layers: ``(i, reference layer, artifact layer)`` triples to compare (default: every
            decoder layer; a streamed verify passes one layer at a time and joins the tensors
            with :func:`weight_summary`). Linears whose weight is on ``meta`` in either layer
            are left out (routed experts a streamed verify has not read yet: it passes an MoE
            layer once per group of experts).
        select: ``select(rel)`` true for the linears to compare (relative names such as
            ``mlp.experts.3.up_proj``; default: all): a streamed verify's group of experts.

    Every linear of the architecture row is compared, routed experts one by one (named
    ``<layers>.<i>.mlp.experts.<e>.gate_proj.weight`` etc., sliced from transformers'
    fused expert tensors); with ``quantized_head`` (the artifact stores its LM head packed:
    recipe ``head:``) the head is listed too, as layer ``num_hidden_layers``; with
    ``quantized_embedding`` (recipe ``embedding:``, the ``[vocab, hidden]`` table stored packed)
    the input embedding is listed the same way (for a tied model it is the head's table too).

    Returns:
        ``{"tensors": [{"name", "layer", "rel_fro", "sqnr_db", "original": stats,
        "artifact": stats}], "layers": [{"layer", "mean_rel_fro", "min_sqnr_db",
        "max_rel_fro"}], "min_sqnr_db", "min_sqnr_tensor", "awq_scales_undone", "key_pairs_undone"}``.
    """
    from .quant.kv_rotation import fit_pairs, undo_pairs

    arch = get_arch(reference.config.model_type)
    handler = find_algorithm(algorithm)
    folded = handler is not None and handler.folds_input_scales
    layers = _layer_pairs(reference, artifact, arch) if layers is None else layers
    scales = _awq_equivalent_scales(reference, artifact, arch, layers) if folded else {}
    tensors = []
    head_dim = _head_dim(reference.config)
    pair_rows = {f"{arch.attention}.q_proj", f"{arch.attention}.k_proj"} if key_pairs else set()
    for i, lr, la in layers:
        for rel in layer_linears(arch, lr):
            if select is not None and not select(rel):
                continue
            name = f"{arch.layers}.{i}.{rel}"
            w = linear_weight(arch, lr, rel).detach()
            w_hat = linear_weight(arch, la, rel).detach()
            if w.is_meta or w_hat.is_meta:
                continue  # a routed expert not read yet: a streamed verify reads the experts in groups
            if rel in pair_rows:  # the pair fit works in float64 (attention projections: small)
                w, w_hat = w.double(), w_hat.double()
            row, col = scales.get(name, (None, None))
            # AWQ scales undone: W_hat -> diag(s_row) W_hat diag(1/s_col), in the original's space,
            # where the error acts on the original activations (what the served function sees)
            w_back = w_hat if row is None and col is None else _undo_scales(w_hat, row, col)
            if rel in pair_rows:  # the key basis changed per RoPE pair: back to the reference's
                same = torch.equal(w, w_back)  # a reference that is the artifact's own (carried) source
                z = fit_pairs(w, w_back, head_dim) if not same else torch.ones(w.shape[0] // head_dim, head_dim // 2,
                                                                                dtype=torch.complex128)
                if basis is not None and rel.endswith("k_proj"):
                    basis[i] = z
                w_back = w_back if same else undo_pairs(w, w_back, head_dim, z)
            err = weight_error(w, w_back)
            if err["rel_fro"] == 0.0:
                continue  # left in float (ignored by the recipe)
            if math.isnan(err["rel_fro"]) or math.isnan(err["sqnr_db"]):  # NaN/Inf in the artifact: worst possible
                err = {"rel_fro": math.inf, "sqnr_db": -math.inf}
            tensors.append({"name": f"{checkpoint_name(arch, name)}.weight", "layer": i, **err,
                            "original": weight_stats(w), "artifact": weight_stats(w_back)})
    if quantized_head:  # recipe ``head:`` (a float head differs from the reference by storage rounding only)
        head_ref, head_art = reference.get_submodule(arch.lm_head), artifact.get_submodule(arch.lm_head)
        err = weight_error(head_ref.weight.detach(), head_art.weight.detach())
        tensors.append({"name": f"{checkpoint_name(arch, arch.lm_head)}.weight", "layer": reference.config.num_hidden_layers,
                        **err, "original": weight_stats(head_ref.weight.detach()), "artifact": weight_stats(head_art.weight.detach())})
    if quantized_embedding:  # recipe ``embedding:``: the table itself is quantized
        emb_ref = find_module(reference, arch.embed_tokens).weight.detach()
        emb_art = find_module(artifact, arch.embed_tokens).weight.detach()
        tensors.append({"name": f"{checkpoint_name(arch, arch.embed_tokens)}.weight", "layer": reference.config.num_hidden_layers,
                        **weight_error(emb_ref, emb_art), "original": weight_stats(emb_ref), "artifact": weight_stats(emb_art)})
    return weight_summary(tensors, bool(scales), bool(pair_rows))


def _undo_scales(w_hat: torch.Tensor, row: torch.Tensor | None, col: torch.Tensor | None) -> torch.Tensor:
    """``diag(row) w_hat diag(1/col)`` (``w_hat [out, in]``, ``row [out]``, ``col [in]``, either
    None), computed in float64 a block of rows at a time (:data:`compressor.stats.STATS_BLOCK`
    elements) into one copy in ``w_hat``'s dtype widened to at least float32: a Kimi-width
    linear (7168 x 18432) costs 0.5 GiB here, not three float64 copies (3.2 GiB)."""
    out = torch.empty(w_hat.shape, dtype=torch.promote_types(w_hat.dtype, torch.float32), device=w_hat.device)
    rows = max(1, STATS_BLOCK // max(1, w_hat.shape[1]))
    col64 = None if col is None else col.double().view(1, -1)
    for r in range(0, w_hat.shape[0], rows):
        b = w_hat[r:r + rows].double()
        if row is not None:
            b.mul_(row[r:r + rows].double().view(-1, 1))
        if col64 is not None:
            b.div_(col64)
        out[r:r + rows] = b
    return out


def weight_summary(tensors: list[dict], awq_scales_undone: bool, key_pairs_undone: bool) -> dict:
    """:func:`weight_report`'s dict from its per-tensor entries (``tensors``, in layer order):
    the per-layer summary and the worst tensor added."""
    layers = []
    for i in sorted({t["layer"] for t in tensors}):
        ts = [t for t in tensors if t["layer"] == i]
        layers.append({"layer": i, "mean_rel_fro": sum(t["rel_fro"] for t in ts) / len(ts),
                       "max_rel_fro": max(t["rel_fro"] for t in ts), "min_sqnr_db": min(t["sqnr_db"] for t in ts)})
    worst = min(tensors, key=lambda t: t["sqnr_db"], default=None)
    return {"tensors": tensors, "layers": layers, "min_sqnr_db": None if worst is None else worst["sqnr_db"],
            "min_sqnr_tensor": None if worst is None else worst["name"], "awq_scales_undone": awq_scales_undone,
            "key_pairs_undone": key_pairs_undone}


@torch.no_grad()
def greedy_drift(reference, artifact, tokenizer, prompts: list[str], max_new_tokens: int = 32,
                 make_cache=None, device: str = "cpu", on_prompt=None) -> dict:
    """Greedy generations of both models from each prompt and where they first diverge.

    Returns ``{"prompts", "max_new_tokens", "first_divergence": [int|None per prompt],
    "median", "min", "identical"}``: ``None`` for a prompt whose ``max_new_tokens`` all agree
    (it never diverged; ``identical`` counts them); ``median`` counts such a prompt as
    ``max_new_tokens`` (the statistic of the gate ``min_median_divergence``: a prompt that never
    diverged passes any threshold it accepts); ``min`` is the earliest first divergence of the
    prompts that diverged, ``None`` when none did. ``make_cache`` gives the artifact a
    quantized KV cache (as served). Prompts are encoded by the tokenizer's own rule
    (:func:`compressor.tokens.encode`: its BOS first when it adds one). ``on_prompt(i, n)``
    is called after the i-th prompt (1-based) of ``n``.
    """
    from .quant.kv import cache_kwarg

    def gen(model, ids, cache):
        kw = {cache_kwarg(model): cache} if cache is not None else {}
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             attention_mask=torch.ones_like(ids), pad_token_id=tokenizer.eos_token_id or 0,
                             eos_token_id=None, **kw)
        return out[0, ids.shape[1]:].tolist()

    firsts, bos = [], bos_token_id(tokenizer)
    for p in prompts:  # the tokenizer's own rule: its BOS first, if it adds one (as served)
        ids = torch.tensor([encode(tokenizer, p, bos)], device=device)
        r = gen(reference, ids, None)
        a = gen(artifact, ids, make_cache() if make_cache else None)
        firsts.append(first_divergence(r, a))
        if on_prompt is not None:
            on_prompt(len(firsts), len(prompts))
    eff = [max_new_tokens if f is None else f for f in firsts]
    diverged = [f for f in firsts if f is not None]
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "first_divergence": firsts,
            "median": summarize(eff)["median"], "min": float(min(diverged)) if diverged else None,
            "identical": len(firsts) - len(diverged)}
