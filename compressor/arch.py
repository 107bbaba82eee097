"""Per-architecture descriptions, as data.

Adding a model family is a new row in :data:`ARCHITECTURES`, keyed by
``config.model_type``; an unknown architecture is an :class:`InputError` listing the
supported ones, never a silent default. The pipeline, the quality report, the artifact
writer/reader and the runtime read these rows; none of them tests ``model_type``.

Module names are relative to a decoder layer. A name holding ``{e}`` stands for each
routed expert of a mixture-of-experts layer: transformers 5 stores the experts of a layer
fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``);
kvq unfuses them into per-expert ``nn.Linear`` modules ``mlp.experts.<e>.gate_proj`` /
``up_proj`` / ``down_proj`` (:mod:`compressor.moe`) so every algorithm sees ordinary
linears. Names that do not exist in a layer are skipped (DeepSeek-V3's first
``first_k_dense_replace`` layers have a dense ``mlp.gate_proj`` and no experts; its later
layers the reverse).

Each :class:`ScalingGroup` is one AWQ scaling group (Lin et al., 2023, section 3.2):
the input channels of ``linears`` are scaled up by ``s`` and the output of ``prev_op``
(a norm or a linear) is scaled down by ``s``, which leaves the float function unchanged.
Groups fold only where that is exact: into a norm directly followed by the linears
(never into Gemma's/GLM's *post* norms, which normalize the scaled output), into a
linear feeding another linear through an elementwise product (``up_proj -> down_proj``),
and into a Gemma ``(1 + weight)`` RMSNorm through ``w' = (w + 1) / s - 1``
(``norm_offset``). Float modules reading the same input (MoE routers) absorb ``s`` on
their input columns (``also_scale``), so routing is unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from .errors import InputError
from .kv_layout import kv_layout

EXPERT = "{e}"


@dataclass(frozen=True)
class ScalingGroup:
    """One AWQ group; module names are relative to a decoder layer.

    ``prev_op``: the norm or linear whose output is divided by ``s``; ``linears`` the
    consumers whose input columns are multiplied by ``s``; ``inspect`` the module whose
    output the AWQ loss compares; ``inputs_at`` the module whose *input* is the group's
    input (default ``linears[0]``; MoE: the whole ``mlp`` block, since one expert sees
    only the tokens routed to it). ``prev_rows = (k, n)``: only the ``k``-th of ``n``
    equal chunks of ``prev_op``'s output rows feeds the linears (GLM-4's fused
    ``gate_up_proj``: the ``up`` half). ``also_scale``: float modules reading ``prev_op``'s
    output (routers), whose input columns absorb ``s``. ``per_expert``: one group per
    routed expert (``{e}`` substituted); otherwise ``{e}`` expands to every expert inside
    the one group.
    """

    prev_op: str
    linears: tuple[str, ...]
    inspect: str
    inspect_is_attention: bool = False
    # only applied when prev_op's output width equals the linears' input width and every
    # linear has the same in_features (e.g. v_proj -> o_proj needs num_kv_heads == num_heads)
    requires_square: bool = False
    prev_rows: tuple[int, int] | None = None
    also_scale: tuple[str, ...] = ()
    per_expert: bool = False
    inputs_at: str | None = None


@dataclass(frozen=True)
class MoESpec:
    """Where a mixture-of-experts block keeps its parts (relative to a decoder layer).

    ``experts``: the fused experts module (``gate_up_proj [E, 2I, H]``, gate rows first,
    then up; ``down_proj [E, H, I]``); ``router``: the routing module (kept in float and
    listed in the format's ignore list); ``block``: the MoE block (its input is every
    token of the layer).
    """

    experts: str = "mlp.experts"
    router: str = "mlp.gate"
    block: str = "mlp"


@dataclass(frozen=True)
class Wrapper:
    """A multimodal checkpoint whose text decoder kvq quantizes alone (Kimi K2.5).

    ``text_config``: the ``config.json`` key holding the text model's config, which is built
    with the transformers classes of its own ``model_type`` (one of ``text_types``; the first
    is the default when it names none). ``prefix``: the checkpoint prefix of the text model's
    tensors (its in-memory names with ``prefix`` prepended: ``language_model.model.layers.0...``,
    ``language_model.lm_head.weight``). ``carried``: checkpoint prefixes of the tensors kvq
    never builds, quantizes or evaluates: copied into the artifact untouched (same names,
    dtypes and bytes; block-FP8 ones dequantized), listed in the format's ignore list and
    checked by digest only. ``what`` names them in messages.
    """

    text_config: str
    prefix: str
    carried: tuple[str, ...]
    what: str
    text_types: tuple[str, ...]


@dataclass(frozen=True)
class ArchSpec:
    """Where the parts of a decoder-only model live (dotted paths from the top module)."""

    layers: str
    embed_tokens: str
    final_norm: str
    lm_head: str
    linears: tuple[str, ...]
    awq_groups: tuple[ScalingGroup, ...]
    # attention module of a decoder layer: where compressed-tensors/vLLM keep k_scale/v_scale
    attention: str = "self_attn"
    # GPTQ true-sequential stages, in execution order; within a stage, linears listed
    # together in ``fused`` read the same input (one Hessian per fused set)
    sequential: tuple[tuple[str, ...], ...] = ()
    # linears vLLM fuses into one kernel (qkv_proj, gate_up_proj): they must share a scheme
    fused: tuple[tuple[str, ...], ...] = ()
    # AutoAWQ skips clipping for the query/key projections (attention scores are sensitive)
    clip_skip: tuple[str, ...] = field(default=("self_attn.q_proj", "self_attn.k_proj"))
    # RMSNorm computes x_hat * (norm_offset + weight): 0 (Llama), 1 (Gemma)
    norm_offset: float = 0.0
    moe: MoESpec | None = None
    # KV-cache layout (compressor.kv_layout.kv_layout): "gqa" keys/values per KV head, "mla"
    # one compressed latent + decoupled RoPE key per token (DeepSeek-V2/V3, Kimi K2)
    kv: str = "gqa"
    # the bundled runtime (kvq serve-smoke / serve) runs this layout
    runtime: bool = False
    # config field bounding the sequence length at which the runtime's dense attention is
    # exact (DeepSeek sparse attention: ``index_topk``; longer sequences are refused)
    dense_exact_within: str | None = None
    # in-memory name -> checkpoint name templates (relative to a layer), for checkpoints
    # whose names differ from transformers' modules (Mixtral: block_sparse_moe.experts.<e>.w1)
    checkpoint_names: tuple[tuple[str, str], ...] = ()
    # decoder layers return ``(hidden, extra)`` instead of ``hidden`` (GLM-5: the top-k
    # indices handed to the next layer); stand-ins for a layer must return the same shape
    layer_returns_tuple: bool = False
    # a multimodal wrapper around this text decoder (Kimi K2.5), None for a text-only checkpoint
    wrapper: Wrapper | None = None
    # the oldest transformers whose implementation caches what kvq's KV schemes quantize for this
    # layout (DeepSeek sparse attention cached the expanded keys/values, not the MLA latent, up to 5.17)
    kv_min_transformers: str | None = None

    def check_kv_support(self, model_type: str) -> None:
        """Refuse a KV-cache scheme (InputError, one line) on a transformers older than :attr:`kv_min_transformers`."""
        import transformers
        from packaging.version import Version

        need = self.kv_min_transformers
        if need is not None and Version(transformers.__version__).release < Version(need).release:
            raise InputError(
                f"{model_type}: a KV-cache scheme needs transformers >= {need} (installed: {transformers.__version__}, "
                f"whose {model_type} caches the expanded keys and values instead of the compressed latent kvq "
                f"quantizes, as vLLM does); pip install -U 'transformers>={need}'")

    def kv_layout(self, config):
        """The model's :class:`compressor.kv_layout.KVLayout` (what one token costs in the cache).

        Raises:
            InputError: see :meth:`check_kv_support`.
        """
        self.check_kv_support(config.model_type)
        return kv_layout(config, self.kv)


_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_DENSE = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_EXPERTS = ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")
_SHARED = ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")

_ATTN_GROUPS = (
    ScalingGroup("input_layernorm", _QKV, "self_attn", inspect_is_attention=True),
    ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj", requires_square=True),
)


def _mlp_groups(norm: str = "post_attention_layernorm") -> tuple[ScalingGroup, ...]:
    """Dense SwiGLU MLP, routed experts (+ shared experts) behind ``norm``."""
    return (
        ScalingGroup(norm, ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        ScalingGroup(norm, ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj",
                            "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
                     "mlp", also_scale=("mlp.gate",), inputs_at="mlp"),
        ScalingGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
        ScalingGroup("mlp.experts.{e}.up_proj", ("mlp.experts.{e}.down_proj",), "mlp.experts.{e}.down_proj",
                     per_expert=True),
        ScalingGroup("mlp.shared_experts.up_proj", ("mlp.shared_experts.down_proj",), "mlp.shared_experts.down_proj"),
    )


_MLP_STAGES = (
    ("mlp.gate_proj", "mlp.up_proj", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj",
     "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
    ("mlp.down_proj", "mlp.experts.{e}.down_proj", "mlp.shared_experts.down_proj"),
)
_MLP_FUSED = (("mlp.gate_proj", "mlp.up_proj"), ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"),
              ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"))
_TOP = dict(layers="model.layers", embed_tokens="model.embed_tokens", final_norm="model.norm", lm_head="lm_head")

#: Llama, Mistral, Qwen2 (qkv bias: a bias is never scaled by input scales), Qwen3 (q/k
#: RMSNorms after q_proj/k_proj: AWQ only scales their inputs, so they are untouched)
_LLAMA_LIKE = ArchSpec(
    **_TOP,
    linears=_ATTN + _DENSE,
    awq_groups=_ATTN_GROUPS + _mlp_groups()[0:1] + _mlp_groups()[2:3],
    sequential=(_QKV, ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)),
    fused=(_QKV, ("mlp.gate_proj", "mlp.up_proj")),
    runtime=True,
)

#: Gemma 3 text: (1 + weight) RMSNorms; the MLP reads pre_feedforward_layernorm; the
#: post_attention/post_feedforward norms normalize sublayer outputs (never folded into);
#: embedding scaling and logit soft-capping live in transformers' modules, unchanged
_GEMMA3 = ArchSpec(
    **_TOP,
    linears=_ATTN + _DENSE,
    awq_groups=_ATTN_GROUPS + (ScalingGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
                               ScalingGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj")),
    sequential=_LLAMA_LIKE.sequential,
    fused=_LLAMA_LIKE.fused,
    norm_offset=1.0,
    runtime=True,
)

#: GLM-4 (0414): fused gate_up_proj (gate rows, then up rows), post_self_attn/post_mlp
#: norms on sublayer outputs (not foldable), partial rotary embeddings
_GLM4 = ArchSpec(
    **_TOP,
    linears=_ATTN + ("mlp.gate_up_proj", "mlp.down_proj"),
    awq_groups=_ATTN_GROUPS + (
        ScalingGroup("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
        ScalingGroup("mlp.gate_up_proj", ("mlp.down_proj",), "mlp.down_proj", prev_rows=(1, 2)),
    ),
    sequential=(_QKV, ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
    fused=(_QKV,),
    runtime=True,
)

#: Mixtral, Qwen3-MoE (and its dense mlp_only_layers), GLM-4.5 (glm4_moe: shared experts,
#: first_k_dense_replace dense layers, sigmoid router with a score-correction bias)
_MOE = ArchSpec(
    **_TOP,
    linears=_ATTN + _DENSE + _EXPERTS + _SHARED,
    awq_groups=_ATTN_GROUPS + _mlp_groups(),
    sequential=(_QKV, ("self_attn.o_proj",)) + _MLP_STAGES,
    fused=(_QKV,) + _MLP_FUSED,
    moe=MoESpec(),
    runtime=True,
)

_MIXTRAL = replace(_MOE, checkpoint_names=(
    ("mlp.experts.{e}.gate_proj", "block_sparse_moe.experts.{e}.w1"),
    ("mlp.experts.{e}.up_proj", "block_sparse_moe.experts.{e}.w3"),
    ("mlp.experts.{e}.down_proj", "block_sparse_moe.experts.{e}.w2"),
    ("mlp.gate", "block_sparse_moe.gate"),
))

#: DeepSeek-V3 (Kimi K2's architecture): multi-head latent attention (q_a/q_b low-rank
#: queries or a plain q_proj, kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj), routed +
#: shared experts after first_k_dense_replace dense layers; the KV cache holds the latent
_MLA_Q = ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")
_DEEPSEEK_V3 = ArchSpec(
    **_TOP,
    linears=_MLA_Q + ("self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj") + _DENSE + _EXPERTS + _SHARED,
    awq_groups=(
        ScalingGroup("input_layernorm", _MLA_Q, "self_attn", inspect_is_attention=True),
        ScalingGroup("self_attn.q_a_layernorm", ("self_attn.q_b_proj",), "self_attn.q_b_proj"),
        ScalingGroup("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",), "self_attn.kv_b_proj"),
    ) + _mlp_groups(),
    sequential=(_MLA_Q, ("self_attn.q_b_proj", "self_attn.kv_b_proj"), ("self_attn.o_proj",)) + _MLP_STAGES,
    # vLLM fuses q_a_proj and kv_a_proj_with_mqa (fused_qkv_a_proj)
    fused=(("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),) + _MLP_FUSED,
    clip_skip=_MLA_Q + ("self_attn.q_b_proj", "self_attn.kv_b_proj"),
    moe=MoESpec(),
    kv="mla",
    runtime=True,
)

#: DeepSeek sparse attention (DeepSeek-V3.2 ``deepseek_v32``, GLM-5 ``glm_moe_dsa``): MLA
#: plus a lightning indexer per layer (``self_attn.indexer``: ``wq_b`` on the query latent,
#: ``wk`` and ``weights_proj`` on the layer input, ``k_norm``) that picks the top-k keys each
#: query attends to. Its projections stay float and are listed in the format's ignore
#: list: their relu(q.k) scores decide a discrete top-k selection (an error there swaps
#: which tokens are attended, not how much), they are ~1% of a layer's weights, and vLLM
#: builds ``weights_proj`` unquantized. AWQ scaling groups whose prev_op feeds the indexer
#: scale its input columns too (``also_scale``), so the selection is unchanged by folding.
#: The indexer's key cache (``index_head_dim`` per token) is not a kvq KV scheme: kvq neither
#: calibrates nor quantizes it and bytes/token count the MLA latent only.
#: The bundled runtime has no indexer: it computes dense MLA, which is exact while a sequence
#: holds at most ``index_topk`` tokens (the indexer then selects every earlier key: transformers
#: takes ``min(index_topk, keys)`` of the causally masked scores), and refuses longer ones.
_INDEXER = "self_attn.indexer"
_DSA = replace(_DEEPSEEK_V3, awq_groups=(
    ScalingGroup("input_layernorm", _MLA_Q, "self_attn", inspect_is_attention=True,
                 also_scale=(f"{_INDEXER}.wk", f"{_INDEXER}.weights_proj")),
    ScalingGroup("self_attn.q_a_layernorm", ("self_attn.q_b_proj",), "self_attn.q_b_proj",
                 also_scale=(f"{_INDEXER}.wq_b",)),
    ScalingGroup("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",), "self_attn.kv_b_proj"),
) + _mlp_groups(), dense_exact_within="index_topk", kv_min_transformers="5.18")

#: model_type -> ArchSpec
ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma3_text": _GEMMA3,
    "glm4": _GLM4,
    "glm4_moe": _MOE,
    "qwen3_moe": _MOE,
    "mixtral": _MIXTRAL,
    "deepseek_v3": _DEEPSEEK_V3,
    "kimi_k2": _DEEPSEEK_V3,  # DeepSeek-V3 fields and tensor names under Moonshot's model_type
    "glm4_moe_lite": _DEEPSEEK_V3,  # GLM-4.7-Flash: MLA + routed/shared experts, DeepSeek-V3 names
    "deepseek_v32": _DSA,
    "glm_moe_dsa": replace(_DSA, layer_returns_tuple=True),  # GLM-5: layers pass their top-k on
    # Kimi K2.5: transformers' vision-language wrapper (Kimi_K25ForConditionalGeneration); its
    # text_config is Kimi K2 (DeepSeek-V3), stored as the release does: language_model.model.*,
    # language_model.lm_head.weight, vision_tower.*, mm_projector.* (transformers' kimi_k25
    # checkpoint conversion reads exactly these names, vLLM's KimiK25ForConditionalGeneration too)
    "kimi_k25": replace(_DEEPSEEK_V3, wrapper=Wrapper(
        text_config="text_config", prefix="language_model.", carried=("vision_tower.", "mm_projector."),
        what="vision tower and projector", text_types=("deepseek_v3", "kimi_k2"))),
}

#: published ``model_type`` that transformers has no class for -> the transformers
#: ``model_type`` whose config and model classes compute it (same fields, same tensor
#: names). kvq builds it with those classes and never runs the repository's own code
#: (``auto_map``); the artifact's ``config.json`` keeps the published ``model_type`` and
#: fields (:func:`compressor.source.resolve.register_published_types`).
PUBLISHED_AS: dict[str, str] = {"kimi_k2": "deepseek_v3"}

#: model_type -> why kvq refuses it (said in the one-line error)
REFUSED: dict[str, str] = {}


def get_arch(model_type: str) -> ArchSpec:
    """Return the :class:`ArchSpec` for ``config.model_type``.

    Raises:
        InputError: the architecture is not in the table (one line listing the supported ones).
    """
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        why = f" ({REFUSED[model_type]})" if model_type in REFUSED else ""
        raise InputError(
            f"unsupported architecture '{model_type}'{why}; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None


def get_module(root, dotted: str):
    """Resolve a dotted attribute path (``model.layers``) on ``root``."""
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def find_module(root, dotted: str):
    """Like :func:`get_module`, but ``None`` when some part of the path is missing (or ``None``)."""
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part, None) if not part.isdigit() else (
            obj[int(part)] if isinstance(obj, torch.nn.ModuleList) and int(part) < len(obj) else None)
        if obj is None:
            return None
    return obj


# ---------------------------------------------------------------------------------------
# expanding the rows for one decoder layer


def num_experts(arch: ArchSpec, layer) -> int:
    """Routed experts in ``layer`` (0 for a dense layer), fused or unfused."""
    if arch.moe is None:
        return 0
    experts = find_module(layer, arch.moe.experts)
    if experts is None:
        return 0
    if isinstance(experts, torch.nn.ModuleList):
        return len(experts)
    fused = getattr(experts, "gate_up_proj", None)
    return int(fused.shape[0]) if isinstance(fused, torch.Tensor) and fused.ndim == 3 else 0


def expand(pattern: str, n_experts: int) -> list[str]:
    """``pattern`` with ``{e}`` replaced by each expert index (itself when it has none)."""
    return [pattern.replace(EXPERT, str(e)) for e in range(n_experts)] if EXPERT in pattern else [pattern]


def _exists(arch: ArchSpec, layer, rel: str) -> bool:
    return find_module(layer, rel) is not None or (_fused_expert(arch, layer, rel) is not None)


def layer_linears(arch: ArchSpec, layer) -> list[str]:
    """The linears of one decoder layer (relative names, experts expanded), in table order."""
    n = num_experts(arch, layer)
    return [r for pat in arch.linears for r in expand(pat, n) if _exists(arch, layer, r)]


def layer_fused_sets(arch: ArchSpec, layer) -> list[tuple[str, ...]]:
    """The ``fused`` sets of one layer, experts expanded, restricted to linears that exist."""
    n = num_experts(arch, layer)
    out = []
    for fused in arch.fused:
        reps = n if any(EXPERT in f for f in fused) else 1
        for e in range(reps):
            names = tuple(f.replace(EXPERT, str(e)) for f in fused)
            names = tuple(r for r in names if _exists(arch, layer, r))
            if names:
                out.append(names)
    return out


def layer_groups(arch: ArchSpec, layer) -> list[ScalingGroup]:
    """The AWQ groups of one layer: experts expanded, missing linears dropped, groups whose
    ``prev_op`` or ``inspect`` is missing (or with no linear left) skipped."""
    n = num_experts(arch, layer)
    out = []
    for g in arch.awq_groups:
        variants = [str(e) for e in range(n)] if g.per_expert else [None]
        for e in variants:
            sub = (lambda s: s.replace(EXPERT, e)) if e is not None else (lambda s: s)
            lins = tuple(r for pat in g.linears for r in (expand(pat, n) if e is None else [sub(pat)])
                         if _exists(arch, layer, r))
            if not lins or not _exists(arch, layer, sub(g.prev_op)) or not _exists(arch, layer, sub(g.inspect)):
                continue
            out.append(ScalingGroup(sub(g.prev_op), lins, sub(g.inspect), g.inspect_is_attention, g.requires_square,
                                    g.prev_rows, tuple(a for a in g.also_scale if find_module(layer, a) is not None),
                                    False, g.inputs_at))
    return out


def is_expert(arch: ArchSpec, rel: str) -> bool:
    """True for a routed expert's linear (it sees only the tokens routed to it)."""
    return arch.moe is not None and rel.startswith(arch.moe.experts + ".")


def expert_index(arch: ArchSpec, rel: str) -> int | None:
    """The expert number in ``mlp.experts.<e>.gate_proj``, ``None`` for other linears."""
    if not is_expert(arch, rel):
        return None
    return int(rel[len(arch.moe.experts) + 1:].split(".", 1)[0])


# ---------------------------------------------------------------------------------------
# weights of fused experts (transformers 5 layout) as per-expert 2-D slices

_PROJ_SLICE = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}


def _fused_expert(arch: ArchSpec, layer, rel: str):
    """``(param, expert, half)`` for a per-expert name inside fused experts, else ``None``."""
    if not is_expert(arch, rel):
        return None
    experts = find_module(layer, arch.moe.experts)
    if experts is None or isinstance(experts, torch.nn.ModuleList):
        return None
    e, _, proj = rel[len(arch.moe.experts) + 1:].partition(".")
    if proj not in _PROJ_SLICE or not e.isdigit():
        return None
    pname, half = _PROJ_SLICE[proj]
    param = getattr(experts, pname, None)
    if not isinstance(param, torch.Tensor) or param.ndim != 3 or int(e) >= param.shape[0]:
        return None
    return param, int(e), half


def linear_weight(arch: ArchSpec, layer, rel: str) -> torch.Tensor:
    """The ``[out, in]`` weight of linear ``rel`` of ``layer``: a ``Linear``'s weight, or
    the expert's 2-D slice of fused experts (``gate_up_proj[e, :I]`` gate, ``[e, I:]`` up,
    ``down_proj[e]``). A view: writes reach the model.

    Raises:
        InputError: ``rel`` is neither.
    """
    mod = find_module(layer, rel)
    if mod is not None and isinstance(getattr(mod, "weight", None), torch.Tensor):
        return mod.weight
    hit = _fused_expert(arch, layer, rel)
    if hit is None:
        raise InputError(f"{rel} is not a linear of this layer")
    param, e, half = hit
    if half is None:
        return param[e]
    i = param.shape[1] // 2
    return param[e, half * i:(half + 1) * i]


def mtp_layer(arch: ArchSpec, num_hidden_layers: int, name: str) -> int | None:
    """The layer index of a multi-token-prediction tensor (``name`` as the checkpoint stores
    it: a wrapper's under its text prefix), else ``None``.

    DeepSeek-V3, GLM-4.5/4.7/5 and DeepSeek-V3.2 checkpoints store their
    ``num_nextn_predict_layers`` MTP modules as decoder layers ``num_hidden_layers, ...``
    (``<layers>.<n>.enorm/hnorm/eh_proj/shared_head.*`` plus a full decoder layer);
    transformers builds no module for them (its loaders drop them as unexpected keys).
    """
    prefix = checkpoint_name(arch, arch.layers) + "."
    if not name.startswith(prefix):
        return None
    idx = name[len(prefix):].split(".", 1)[0]
    return int(idx) if idx.isdigit() and int(idx) >= num_hidden_layers else None


def is_carried(arch: ArchSpec, name: str) -> bool:
    """True for a checkpoint tensor outside a wrapper's text model that kvq copies untouched
    (Kimi K2.5's ``vision_tower.*`` / ``mm_projector.*``, :class:`Wrapper`)."""
    return arch.wrapper is not None and name.startswith(arch.wrapper.carried)


def is_text_tensor(arch: ArchSpec, name: str) -> bool:
    """True for a checkpoint tensor of the text model (all of them, unless the row is a wrapper)."""
    return arch.wrapper is None or name.startswith(arch.wrapper.prefix)


def routers(arch: ArchSpec, model) -> list[str]:
    """Full in-memory names of the MoE routers (float, never quantized unless targeted)."""
    if arch.moe is None:
        return []
    layers = get_module(model, arch.layers)
    return [f"{arch.layers}.{i}.{arch.moe.router}" for i, layer in enumerate(layers)
            if num_experts(arch, layer) and find_module(layer, arch.moe.router) is not None]


# ---------------------------------------------------------------------------------------
# checkpoint names (what the artifact stores; what vLLM and transformers' loaders read)


def _template_regex(t: str) -> re.Pattern:
    return re.compile("^" + re.escape(t).replace(re.escape(EXPERT), r"(?P<e>\d+)") + r"(?=\.|$)")


def _rename(arch: ArchSpec, name: str, reverse: bool) -> str:
    if not arch.checkpoint_names:
        return name
    prefix = arch.layers + "."
    if not name.startswith(prefix):
        return name
    idx, _, rel = name[len(prefix):].partition(".")
    for mem, ckpt in arch.checkpoint_names:
        src, dst = (ckpt, mem) if reverse else (mem, ckpt)
        m = _template_regex(src).match(rel)
        if m:
            new = dst.replace(EXPERT, m.group("e")) if "e" in m.groupdict() else dst
            return f"{prefix}{idx}.{new}{rel[m.end():]}"
    return name


def checkpoint_name(arch: ArchSpec, name: str) -> str:
    """The checkpoint name of an in-memory module/tensor name (identity for most rows; a
    wrapper's text model is stored under its prefix: ``language_model.model.layers.0...``)."""
    return (arch.wrapper.prefix if arch.wrapper is not None else "") + _rename(arch, name, reverse=False)


def memory_name(arch: ArchSpec, name: str) -> str:
    """Inverse of :func:`checkpoint_name`."""
    if arch.wrapper is not None and name.startswith(arch.wrapper.prefix):
        name = name[len(arch.wrapper.prefix):]
    return _rename(arch, name, reverse=True)


def state_from_checkpoint(arch: ArchSpec, model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map a checkpoint-layout state dict onto ``model``'s parameters.

    Renames (:func:`memory_name`) and, where ``model`` keeps experts fused (transformers 5),
    stacks the per-expert ``<experts>.<e>.gate_proj/up_proj/down_proj.weight`` tensors into
    ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]``.

    Raises:
        InputError: some expert of a fused layer is missing a tensor.
    """
    state = {memory_name(arch, k): v for k, v in state.items()}
    if arch.moe is None:
        return state
    layers = get_module(model, arch.layers)
    for i, layer in enumerate(layers):
        experts = find_module(layer, arch.moe.experts)
        n = num_experts(arch, layer)
        if not n or isinstance(experts, torch.nn.ModuleList):
            continue
        base = f"{arch.layers}.{i}.{arch.moe.experts}"
        try:
            gate = [state.pop(f"{base}.{e}.gate_proj.weight") for e in range(n)]
            up = [state.pop(f"{base}.{e}.up_proj.weight") for e in range(n)]
            down = [state.pop(f"{base}.{e}.down_proj.weight") for e in range(n)]
        except KeyError as err:
            raise InputError(f"expert tensor {checkpoint_name(arch, err.args[0])} is missing") from None
        state[f"{base}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        state[f"{base}.down_proj"] = torch.stack(down)
    return state
