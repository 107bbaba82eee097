"""Per-architecture descriptions, as data.

Adding a model family is a new row in :data:`ARCHITECTURES`, keyed by
``config.model_type``; an unknown architecture is an :class:`InputError` listing the
supported ones, never a silent default.

Each :class:`ScalingGroup` is one AWQ scaling group (Lin et al., 2023, section 3.2):
the input channels of ``linears`` are scaled up by ``s`` and the output of ``prev_op``
(a norm or a linear) is scaled down by ``s``, which leaves the float function unchanged.
The AWQ loss is measured on the output of ``inspect``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import InputError


@dataclass(frozen=True)
class ScalingGroup:
    """One AWQ group; module names are relative to a decoder layer."""

    prev_op: str
    linears: tuple[str, ...]
    inspect: str
    inspect_is_attention: bool = False
    # only applied when prev_op's output width equals the linears' input width and every
    # linear has the same in_features (e.g. v_proj -> o_proj needs num_kv_heads == num_heads)
    requires_square: bool = False


@dataclass(frozen=True)
class ArchSpec:
    """Where the parts of a decoder-only model live (dotted paths from the top module)."""

    layers: str
    embed_tokens: str
    rotary_emb: str
    final_norm: str
    lm_head: str
    linears: tuple[str, ...]
    awq_groups: tuple[ScalingGroup, ...]
    # attention module of a decoder layer: where compressed-tensors/vLLM keep k_scale/v_scale
    attention: str = "self_attn"
    # GPTQ true-sequential stages, in execution order; the linears of one stage read the
    # same input tensor (one Hessian per stage)
    sequential: tuple[tuple[str, ...], ...] = ()
    # linears vLLM fuses into one kernel (qkv_proj, gate_up_proj): they must share a scheme
    fused: tuple[tuple[str, ...], ...] = ()
    # AutoAWQ skips clipping for the query/key projections (attention scores are sensitive)
    clip_skip: tuple[str, ...] = field(default=("self_attn.q_proj", "self_attn.k_proj"))


_LLAMA_LIKE = ArchSpec(
    layers="model.layers",
    embed_tokens="model.embed_tokens",
    rotary_emb="model.rotary_emb",
    final_norm="model.norm",
    lm_head="lm_head",
    linears=(
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ),
    awq_groups=(
        ScalingGroup(
            "input_layernorm",
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn",
            inspect_is_attention=True,
        ),
        ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj", requires_square=True),
        ScalingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        ScalingGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
    sequential=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
    fused=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("mlp.gate_proj", "mlp.up_proj"),
    ),
)

#: model_type -> ArchSpec. Llama-family layouts share one row; Qwen2 differs only by
#: qkv bias, which the pipeline handles generically (bias is scaled with its weight).
ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
}


def get_arch(model_type: str) -> ArchSpec:
    """Return the :class:`ArchSpec` for ``config.model_type``.

    Raises:
        InputError: the architecture is not in the table.
    """
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise InputError(
            f"unsupported architecture '{model_type}'; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None


def get_module(root, dotted: str):
    """Resolve a dotted attribute path (``model.layers``) on ``root``."""
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj
