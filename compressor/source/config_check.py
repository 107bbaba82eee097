"""``config.json`` against the checkpoint it describes, before anything is built.

A Hugging Face folder's ``config.json`` decides every shape transformers allocates; the
safetensors headers say what the weights really are. A config that lies (``hidden_size:
0``, a ``vocab_size`` other than the embedding's rows, ``intermediate_size: 1e12``, a
head count that does not divide, a billion layers) would otherwise build a wrong model,
allocate without bound, or hang; kvq refuses it in one line naming the field
(:class:`compressor.errors.InputError`, exit 2), reading only the JSON and the headers.

Checked (each only where the checkpoint holds the tensor that proves it):

* sizes are positive integers below :data:`MAX_DIM` (layers below :data:`MAX_LAYERS`);
* ``vocab_size`` x ``hidden_size`` is the input embedding's shape;
* ``num_hidden_layers`` is the number of decoder layers stored (multi-token-prediction
  layers that DeepSeek-V3/GLM checkpoints add after them, ``num_nextn_predict_layers``,
  are allowed on top);
* ``num_key_value_heads`` divides ``num_attention_heads``; q/k/v projection rows are
  ``heads x head_dim`` (``head_dim`` from the config, else ``hidden_size / heads``);
* ``intermediate_size`` is the rows of the first dense MLP's ``gate_proj``/``up_proj``
  (or half of a fused ``gate_up_proj``);
* ``max_position_embeddings`` is a positive integer below :data:`MAX_POSITIONS`; norm
  epsilons are finite and in (0, 1); ``rope_theta`` is finite and positive; ``hidden_act``
  and the RoPE scaling type are ones transformers knows;
* the router agrees with the experts (:func:`check_routing`): ``num_experts_per_tok`` at most
  the experts (and the experts its ``topk_group`` groups hold), ``n_group`` divides them,
  ``topk_group`` at most ``n_group``; ``sliding_window`` is a positive integer or null;
* a multimodal wrapper (Kimi K2.5, :class:`compressor.arch.Wrapper`): its ``text_config``
  (a text model type the row names) is what the checks above read, against the tensors
  under the text prefix; every tensor is the text model's or one the row carries.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import InputError

#: the largest width kvq accepts for any size field (the largest published is ~10^6 vocab)
MAX_DIM = 1 << 24
#: the most decoder layers kvq accepts (published models have < 200)
MAX_LAYERS = 10_000
#: the largest config.json kvq parses (published ones are a few KiB)
MAX_CONFIG_BYTES = 4 << 20

#: tensors only a DeepSeek-V3/GLM multi-token-prediction module holds (its layer-relative names)
MTP_TENSORS = ("eh_proj.", "enorm.", "hnorm.")
_SIZE_FIELDS = ("hidden_size", "vocab_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "num_experts", "num_local_experts")


def read_config(path: str | Path) -> dict:
    """Parse ``config.json`` as a JSON object.

    Raises:
        InputError: unreadable, not a regular file, larger than :data:`MAX_CONFIG_BYTES`, not
            JSON, nested too deeply to parse, or not an object.
    """
    from ..files import read_limited

    path = Path(path)
    try:  # bounded, and a FIFO or device is refused rather than waited on
        text = read_limited(path, "model config", MAX_CONFIG_BYTES).decode("utf-8")
        data = json.loads(text)
    except InputError:
        raise
    except RecursionError:
        raise InputError(f"{path} is nested too deeply to be a model config") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a JSON object")
    return data


def text_config(cfg: dict) -> dict:
    """The language model's config: ``text_config`` of a multimodal wrapper, else ``cfg``."""
    inner = cfg.get("text_config")
    return inner if isinstance(inner, dict) else cfg


def quantization_config(cfg: dict):
    """A config's ``quantization_config``: the top level's, else (a multimodal wrapper such as
    Kimi K2.5 may keep it there) its ``text_config``'s; ``None`` when neither has one."""
    return cfg.get("quantization_config") or text_config(cfg).get("quantization_config")


def hidden_size(cfg: dict) -> int | None:
    """The language model's ``hidden_size`` (``text_config``'s in a multimodal wrapper), or ``None``."""
    v = text_config(cfg).get("hidden_size")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _size(cfg: dict, name: str, where: str, limit: int = MAX_DIM, required: bool = False) -> int | None:
    if name not in cfg or cfg[name] is None:
        if required:
            raise InputError(f"{where}: {name} is missing")
        return None
    v = cfg[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise InputError(f"{where}: {name} must be a whole number, got {v!r}")
    if not 0 < v <= limit:
        raise InputError(f"{where}: {name} = {v:,} is out of range (1 .. {limit:,})")
    return v


#: the longest context kvq accepts in ``max_position_embeddings`` (published models reach ~10^7)
MAX_POSITIONS = 1 << 26
_EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")


def _real(cfg: dict, name: str, where: str, low: float, high: float) -> None:
    """``cfg[name]``, where present, is a finite number with ``low < value < high``."""
    import math

    v = cfg.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InputError(f"{where}: {name} must be a finite number, got {v!r}")
    if not low < v < high:
        raise InputError(f"{where}: {name} = {v!r} is out of range ({low:g} < {name} < {high:g})")


def _check_numbers(c: dict, where: str) -> None:
    """Fields that are not sizes but that a model is built from: norm epsilons, the RoPE
    base and scaling type, the context length and the activation, each named when wrong."""
    _size(c, "max_position_embeddings", where, MAX_POSITIONS)
    for f in _EPS_FIELDS:
        _real(c, f, where, 0.0, 1.0)
    _real(c, "rope_theta", where, 0.0, float("inf"))
    for f in ("hidden_act", "hidden_activation"):
        v = c.get(f)
        if v is None:
            continue
        from transformers.activations import ACT2FN

        if not isinstance(v, str) or v not in ACT2FN:
            raise InputError(f"{where}: {f} {v!r} is not an activation transformers knows ({', '.join(sorted(ACT2FN))})")
    for f in ("rope_scaling", "rope_parameters"):
        v = c.get(f)
        if v is None:
            continue
        if not isinstance(v, dict):
            raise InputError(f"{where}: {f} must be an object, got {v!r}")
        blocks = v.values() if v and all(isinstance(b, dict) for b in v.values()) else [v]  # Gemma 3: one per layer type
        for b in blocks:
            _check_rope(b, f, where)


def _whole(c: dict, name: str, where: str, low: int, high: int, why: str = "") -> int | None:
    """``c[name]``, where present and not null: a whole number in ``low .. high`` (``why`` says
    what decides the range), else :class:`InputError` naming the field."""
    v = c.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise InputError(f"{where}: {name} must be a whole number, got {v!r}")
    if not low <= v <= high:
        raise InputError(f"{where}: {name} = {v:,} is out of range ({low:,} .. {high:,}{why})")
    return v


def check_routing(c: dict, where: str = "config.json") -> None:
    """The fields a model is run with that no tensor shape proves, against each other: a
    mixture-of-experts router's ``num_experts_per_tok`` (at most the experts), ``n_group``
    (divides the experts into groups of at least two: a group is scored by its two best
    experts), ``topk_group`` (at most ``n_group``) and ``num_experts_per_tok`` again (at most
    the experts the kept groups hold); ``sliding_window`` (a positive integer, or null for none).
    ``c`` is the language model's config (:func:`text_config`).

    Raises:
        InputError: the first field that contradicts the others, named, with the range it must be in.
    """
    _whole(c, "sliding_window", where, 1, MAX_POSITIONS, "; null for no sliding window")
    experts = next((c[f] for f in ("n_routed_experts", "num_experts", "num_local_experts")
                    if isinstance(c.get(f), int) and not isinstance(c.get(f), bool)), None)
    if experts is None:
        return
    if "num_experts_per_tok" in c and c["num_experts_per_tok"] is None:  # a router that picks no expert
        raise InputError(f"{where}: num_experts_per_tok must be a whole number (1 .. {experts}), got null")
    k = _whole(c, "num_experts_per_tok", where, 1, experts, f": the {experts} experts")
    groups = _whole(c, "n_group", where, 1, experts, f": the {experts} experts")
    if groups is not None:
        if experts % groups or (c.get("routed_scaling_factor") is not None and experts // groups < 2):
            raise InputError(f"{where}: n_group = {groups} does not divide the {experts} experts into groups of at "
                             "least two (a group is scored by its two best experts)")
    kept = _whole(c, "topk_group", where, 1, groups or 1, f": n_group = {groups or 1}")
    if k is not None and kept is not None:
        reachable = kept * (experts // (groups or 1))
        if k > reachable:
            raise InputError(f"{where}: num_experts_per_tok = {k} but the topk_group = {kept} groups kept hold "
                             f"{reachable} experts")


def _check_rope(b: dict, field: str, where: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = b.get("rope_type", b.get("type", "default"))
    if kind != "default" and (not isinstance(kind, str) or kind not in ROPE_INIT_FUNCTIONS):
        raise InputError(f"{where}: {field}.rope_type {kind!r} is not a RoPE type transformers knows "
                         f"(default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
    _real(b, "rope_theta", f"{where}: {field}", 0.0, float("inf"))
    _real(b, "factor", f"{where}: {field}", 0.0, float("inf"))


def _shape(shapes: dict[str, list[int]], *names: str) -> list[int] | None:
    for n in names:
        if n in shapes:
            return shapes[n]
    return None


def check_config(cfg: dict, shapes: dict[str, list[int]], where: str = "config.json", layers_path: str = "model.layers") -> None:
    """Check a model config against the checkpoint's tensor shapes.

    Args:
        cfg: the parsed ``config.json`` (a multimodal wrapper's ``text_config`` is used).
        shapes: checkpoint tensor name -> shape, from the safetensors headers.
        where: how to name the config in messages.
        layers_path: the decoder layers' name prefix (``compressor.arch`` rows' ``layers``).

    Raises:
        InputError: the first field that contradicts the checkpoint or is out of range,
            named, with what the checkpoint holds.
    """
    c = text_config(cfg)
    for f in _SIZE_FIELDS:
        _size(c, f, where)
    _check_numbers(c, where)
    check_routing(c, where)
    n_layers = _size(c, "num_hidden_layers", where, MAX_LAYERS, required=True)
    hidden = _size(c, "hidden_size", where, required=True)
    prefix = layers_path + "."
    pre = "language_model." if any(n.startswith("language_model.") for n in shapes) else ""
    emb = _shape(shapes, f"{pre}model.embed_tokens.weight", "model.embed_tokens.weight",
                 "model.language_model.embed_tokens.weight", "language_model.model.embed_tokens.weight")
    if emb is not None and len(emb) == 2:
        if emb[1] != hidden:
            raise InputError(f"{where}: hidden_size = {hidden} but the embedding is {emb[0]} x {emb[1]}")
        vocab = _size(c, "vocab_size", where)
        if vocab is not None and vocab != emb[0]:
            raise InputError(f"{where}: vocab_size = {vocab} but the embedding has {emb[0]} rows")
    _check_depth(c, shapes, prefix, pre, n_layers, where)
    _check_attention(c, shapes, prefix, pre, hidden, where)
    _check_mlp(c, shapes, prefix, pre, n_layers, where)


def _layer_shapes(shapes: dict, prefix: str, pre: str) -> dict[int, dict[str, list[int]]]:
    pat = re.compile(r"^(?:language_model\.|model\.language_model\.)?" + re.escape(prefix) + r"(\d+)\.(.+)$")
    out: dict[int, dict[str, list[int]]] = {}
    for name, shape in shapes.items():
        m = pat.match(name)
        if m:
            out.setdefault(int(m.group(1)), {})[m.group(2)] = shape
    return out


def _check_depth(c: dict, shapes: dict, prefix: str, pre: str, n_layers: int, where: str) -> None:
    stored = _layer_shapes(shapes, prefix, pre)
    if not stored:
        return
    top = max(stored) + 1
    mtp = c.get("num_nextn_predict_layers") or 0
    mtp = mtp if isinstance(mtp, int) and not isinstance(mtp, bool) and 0 <= mtp <= 16 else 0
    if not n_layers <= top <= n_layers + mtp:
        extra = f" (+ {mtp} multi-token-prediction layer(s))" if mtp else ""
        raise InputError(f"{where}: num_hidden_layers = {n_layers:,}{extra} but the checkpoint stores {top} decoder layers")
    for i in range(n_layers, top):  # a multi-token-prediction module has its own projection and norms
        if not any(k.startswith(MTP_TENSORS) for k in stored.get(i, {})):
            raise InputError(f"{where}: num_hidden_layers = {n_layers:,} but the checkpoint's layer {i} is an ordinary "
                             f"decoder layer, not a multi-token-prediction module (no {', '.join(MTP_TENSORS)} "
                             f"tensors); num_hidden_layers is {top} there")


def _check_attention(c: dict, shapes: dict, prefix: str, pre: str, hidden: int, where: str) -> None:
    heads = _size(c, "num_attention_heads", where)
    kv = _size(c, "num_key_value_heads", where) or heads
    if heads is None:
        return
    if heads % kv:
        raise InputError(f"{where}: num_key_value_heads = {kv} does not divide num_attention_heads = {heads}")
    layer0 = _layer_shapes(shapes, prefix, pre).get(0, {})
    if "kv_lora_rank" in c and c.get("kv_lora_rank"):
        return  # MLA: q/k/v widths follow qk_nope/qk_rope/v head dims, checked by the arch row's loader
    head_dim = c.get("head_dim") or (hidden // heads if hidden % heads == 0 else None)
    if head_dim is None:
        raise InputError(f"{where}: hidden_size = {hidden} is not a multiple of num_attention_heads = {heads} and no head_dim is given")
    for proj, n in (("q_proj", heads), ("k_proj", kv), ("v_proj", kv)):
        s = layer0.get(f"self_attn.{proj}.weight")
        if s is not None and s[0] != n * head_dim:
            field = "num_attention_heads" if proj == "q_proj" else "num_key_value_heads"
            raise InputError(f"{where}: {field} = {n} x head_dim {head_dim} = {n * head_dim} but "
                             f"{prefix}0.self_attn.{proj}.weight has {s[0]} rows")


def _check_mlp(c: dict, shapes: dict, prefix: str, pre: str, n_layers: int, where: str) -> None:
    inter = _size(c, "intermediate_size", where)
    if inter is None:
        return
    for i, layer in sorted(_layer_shapes(shapes, prefix, pre).items()):
        if i >= n_layers:
            break
        s = _shape(layer, "mlp.gate_proj.weight", "mlp.up_proj.weight", "feed_forward.w1.weight")
        rows = s[0] if s is not None else None
        if rows is None and "mlp.gate_up_proj.weight" in layer:
            rows = layer["mlp.gate_up_proj.weight"][0] // 2
        if rows is not None:
            if rows != inter:
                raise InputError(f"{where}: intermediate_size = {inter:,} but {prefix}{i}'s MLP has {rows} rows")
            return


#: source ``quant_method``s another part of kvq reads (already-quantized artifacts)
PACKED_SOURCES = ("compressed-tensors", "awq", "gptq")


def source_quantization(cfg: dict, where: str = "config.json") -> tuple[int, int] | None:
    """The block shape ``(rows, cols)`` of a block-FP8 source, ``None`` for a float source.

    Block FP8 is DeepSeek-V3's layout (also Kimi K2's and the GLM ``-FP8`` releases'):
    ``quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}``.
    compressed-tensors / AWQ / GPTQ sources also give ``None`` (packed artifacts, read
    elsewhere).

    Raises:
        InputError: any other ``quant_method`` (named), FP8 without ``weight_block_size``
            (per-tensor FP8) or with another format than e4m3, a malformed block size.
    """
    qc = quantization_config(cfg)
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise InputError(f"{where}: quantization_config must be an object")
    method = qc.get("quant_method")
    if method in PACKED_SOURCES:
        return None
    if method != "fp8":
        raise InputError(f"{where}: quantization_config.quant_method {method!r} is not a source kvq reads "
                         "(float safetensors, or block FP8 as DeepSeek-V3 / Kimi K2 / GLM -FP8 publish it)")
    block = qc.get("weight_block_size")
    if block is None:
        raise InputError(f"{where}: quant_method 'fp8' without weight_block_size (per-tensor FP8) is not a source "
                         "kvq reads; it reads block FP8 (weight_block_size [128, 128], weight_scale_inv per block)")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_DIM for b in block)):
        raise InputError(f"{where}: quantization_config.weight_block_size must be two positive integers, got {block!r}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise InputError(f"{where}: block FP8 format {qc.get('fmt')!r} is not read (kvq reads e4m3)")
    return int(block[0]), int(block[1])


def check_folder(folder: str | Path, model_type: str | None = None) -> dict:
    """Read ``folder/config.json`` and check it against the folder's safetensors headers.

    Returns:
        the parsed config.

    Raises:
        InputError: see :func:`read_config` and :func:`check_config`.
    """
    from ..safetensors_io import read_header

    folder = Path(folder)
    cfg = read_config(folder / "config.json")
    source_quantization(cfg, f"{folder / 'config.json'}")
    shapes: dict[str, list[int]] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        shapes.update({n: list(e.shape) for n, e in read_header(shard).items()})
    from ..arch import ARCHITECTURES

    where = f"{folder / 'config.json'}"
    outer = ARCHITECTURES.get(cfg.get("model_type")) if isinstance(cfg.get("model_type"), str) else None
    if outer is not None and outer.wrapper is not None:
        model_type = model_type or wrapper_text(cfg, where)[1]
        _check_wrapped_names(outer, shapes, where)
    layers = "model.layers"
    mt = model_type or text_config(cfg).get("model_type")
    if isinstance(mt, str):
        if mt not in ARCHITECTURES:
            return cfg  # an unsupported model_type is refused by its own check, with the supported list
        layers = ARCHITECTURES[mt].layers
    check_config(cfg, shapes, where, layers)
    return cfg


def wrapper_text(cfg: dict, where: str = "config.json") -> tuple[dict, str]:
    """``(text config, its model_type)`` of a multimodal wrapper's ``config.json`` (its row's
    :class:`compressor.arch.Wrapper`: a text model type it names; the first when none is given).

    Raises:
        InputError: no text config object, or a text ``model_type`` the row does not name.
    """
    from ..arch import get_arch

    mt = cfg.get("model_type")
    w = get_arch(mt).wrapper
    text = cfg.get(w.text_config)
    if not isinstance(text, dict):
        raise InputError(f"{where}: model_type {mt!r} needs a {w.text_config} object (the text model's config)")
    text_type = text.get("model_type") or w.text_types[0]
    if text_type not in w.text_types:
        raise InputError(f"{where}: {w.text_config}.model_type {text_type!r} is not a text model kvq builds for {mt} "
                         f"({', '.join(w.text_types)})")
    return text, text_type


def _check_wrapped_names(arch, shapes: dict, where: str) -> None:
    """Every tensor of a wrapper's checkpoint is its text model's or one kvq carries (no tensor is dropped)."""
    w = arch.wrapper
    stray = sorted(n for n in shapes if not n.startswith((w.prefix,) + w.carried))
    if stray:
        raise InputError(f"{where}: tensor {stray[0]} is neither the text model's ({w.prefix}*) nor the {w.what}'s "
                         f"({', '.join(p + '*' for p in w.carried)}); kvq would not carry it into the artifact")
    if not any(n.startswith(w.prefix) for n in shapes):
        raise InputError(f"{where}: no tensor is stored under {w.prefix} (where this wrapper keeps its text model)")
