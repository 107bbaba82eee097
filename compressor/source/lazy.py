"""Reading a source larger than memory: lazy source weights, a model built on ``meta``.

A Hugging Face safetensors folder becomes a model on the ``meta`` device (no weight memory)
whose embedding, final norm and head are read from the source shards
(:class:`LazyCheckpoint`, plain reads: nothing stays mapped; block-FP8 weights dequantized per
tensor) and whose decoder layers are materialized one at a time by the caller
(:func:`load_into`, :func:`layer_names`) and sent back to ``meta`` (:func:`to_meta`). Buffers no
checkpoint stores (rotary ``inv_freq``, Gemma 3's ``embed_scale``) are computed by the model's
own classes from its config (:func:`_real_buffers`). GGUF sources, and folders whose tensor names
do not map onto the model (a layout kvq cannot address tensor by tensor), are loaded whole
instead (:func:`load_whole`). MTP layers and carried (vision) tensors are kept as they are
(:func:`kept_tensor_names`, :func:`copy_kept_tensors`).

The staging folder (per-layer parts, resume checkpoints, activation spill) is
:mod:`compressor.staging`'s.
"""

from __future__ import annotations

import functools
import gc
import re
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from ..errors import InputError, first_line
from ..quant.inplace_linalg import all_finite
from ..safetensors_io import read_header

RESUME_NAME = "resume.json"
HIDDEN_PREFIX = "resume-hidden-"  # + layers done + .safetensors: a new file per checkpoint
ARTIFACT_DIR = "artifact"  # the artifact is assembled here, renamed to OUT when complete
#: a routed expert's tensors (``...experts.<e>.``; not ``shared_experts``), in kvq's and checkpoints' names
ROUTED_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


class LazyCheckpoint:
    """Tensor name -> shard of a safetensors folder; tensors are read on demand (``pread``).

    Block-FP8 checkpoints (DeepSeek-V3, Kimi K2, the GLM ``-FP8`` releases: ``config.json``
    ``quantization_config: {quant_method: fp8, weight_block_size: [bo, bi]}``) store a
    linear's weight ``W [out, in]`` as ``float8_e4m3fn`` ``q`` plus a float32
    ``<name>_scale_inv [ceil(out / bo), ceil(in / bi)]``, one scale per ``bo x bi`` block
    (edge blocks ragged). :meth:`get` dequantizes such a tensor as it reads it:
    ``W[i, j] = float32(q[i, j]) * scale_inv[i // bo, j // bi]`` computed in float32 (the
    e4m3 -> float32 conversion is exact; the product is one float32 rounding), then cast
    to the dtype asked for (round to nearest even) -- the arithmetic of DeepSeek's own
    ``weight_dequant``. ``block_fp8`` is ``(bo, bi)``; by default it is read from the
    folder's ``config.json`` (:func:`compressor.source.config_check.source_quantization`).

    :attr:`bytes_read` counts the bytes read from the shards so far, :attr:`expert_bytes_read`
    those of routed experts' tensors (:data:`ROUTED_EXPERT`, their block scales included): what
    a ``torchrun`` rank reads of the source (:mod:`compressor.moe_ranks`).

    Raises:
        InputError: a shard with a bad header; a tensor name in two shards; a
            ``quantization_config`` kvq does not read.
    """

    def __init__(self, folder: str | Path, block_fp8: tuple[int, int] | None | str = "config"):
        self.folder = Path(folder)
        self.bytes_read = self.expert_bytes_read = 0
        self.where: dict[str, tuple[Path, object]] = {}
        for shard in sorted(self.folder.glob("*.safetensors")):
            for name, entry in read_header(shard).items():
                if name in self.where:
                    raise InputError(f"{self.folder}: tensor {name} is stored in both {self.where[name][0].name} and {shard.name}")
                self.where[name] = (shard, entry)
        if block_fp8 == "config":
            from .config_check import read_config, source_quantization

            cfg_file = self.folder / "config.json"
            block_fp8 = source_quantization(read_config(cfg_file), str(cfg_file)) if cfg_file.is_file() else None
        self.block_fp8 = block_fp8

    def __contains__(self, name: str) -> bool:
        return name in self.where

    @property
    def dequantizes(self) -> bool:
        """True when :meth:`get` turns quantized stored tensors into float weights (the
        model is then built without the source's ``quantization_config``)."""
        return self.block_fp8 is not None

    def _read(self, name: str) -> torch.Tensor:
        """``name`` as stored (its own dtype), in a private buffer."""
        shard, e = self.where[name]
        if e.dtype not in _DTYPES:
            raise InputError(f"{shard}: tensor {name} has dtype {e.dtype}, which kvq does not load")
        n = e.end - e.start
        if not n:
            return torch.empty(e.shape, dtype=_DTYPES[e.dtype])
        # torch's allocator, not a zero-filled bytearray: no page is written twice, and large
        # buffers come as huge pages (compressor.entry.ALLOCATOR_ENV)
        raw = torch.empty(n, dtype=torch.uint8)
        with open(shard, "rb") as f:
            got = f.readinto(memoryview(raw.numpy())) if f.seek(e.start) == e.start else 0
        if got != n:
            raise InputError(f"{shard}: truncated while reading {name}")
        self.bytes_read += n
        if ROUTED_EXPERT.search(name):
            self.expert_bytes_read += n
        return raw.view(_DTYPES[e.dtype]).view(e.shape)

    def get(self, name: str, dtype: torch.dtype, as_stored: bool = False) -> torch.Tensor:
        """Read ``name`` into memory as ``dtype`` (a private copy; block-FP8 weights dequantized);
        with ``as_stored``, float tensors keep their stored dtype and bytes (only block-FP8
        weights become ``dtype``).

        The bytes are read with ``pread`` rather than through a memory map, so the source
        shards never count towards this process's resident memory (a map would keep every
        page read so far resident: peak RSS would grow with the model).

        Raises:
            InputError: truncated shard, a dtype kvq does not load, an FP8 tensor without
                its ``_scale_inv`` (or with one of the wrong shape).
        """
        t = self._read(name)
        if t.dtype == torch.float8_e4m3fn:
            return self._dequantize(name, t).to(dtype)
        if as_stored:
            return t  # _read's private buffer: the stored bytes
        return t.to(dtype) if t.is_floating_point() else t.clone()

    def _dequantize(self, name: str, q: torch.Tensor) -> torch.Tensor:
        """Block-FP8 ``q [out, in]`` times its ``scale_inv`` block by block, in float32."""
        shard = self.where[name][0]
        scale_name = name + "_scale_inv"
        if self.block_fp8 is None or scale_name not in self.where or q.ndim != 2:
            raise InputError(f"{shard}: tensor {name} is float8_e4m3fn but kvq finds no block scale for it "
                             "(config.json quantization_config {quant_method: fp8, weight_block_size} and a "
                             f"2-D weight with {scale_name})")
        bo, bi = self.block_fp8
        out, inp = q.shape
        scale = self._read(scale_name).to(torch.float32)
        if tuple(scale.shape) != (-(-out // bo), -(-inp // bi)):
            raise InputError(f"{shard}: {scale_name} is {list(scale.shape)}, but {name} [{out}, {inp}] in "
                             f"{bo} x {bi} blocks needs [{-(-out // bo)}, {-(-inp // bi)}]")
        w = torch.empty(out, inp, dtype=torch.float32)
        q = q.contiguous()
        rows = max(1, _LOOKUP_ELEMS // max(inp, 1))
        for r in range(scale.shape[0]):  # one block row at a time: no full-size scale tensor
            row_scale = scale[r].repeat_interleave(bi)[:inp]
            for a in range(r * bo, min(out, (r + 1) * bo), rows):  # converted and scaled while in cache
                b = min(a + rows, (r + 1) * bo, out)
                fp8_to_float32(q[a:b], out=w[a:b]).mul_(row_scale)
        return w


#: float8 codes :func:`fp8_to_float32` converts at a time: the index copy NumPy makes of each
#: slice (8 bytes a value) and the slice's output stay in the core's cache
_LOOKUP_ELEMS = 1 << 17


@functools.lru_cache(maxsize=1)
def _fp8_table():
    """float32 value of each of the 256 ``float8_e4m3fn`` codes, as torch converts them (a NumPy array)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn).to(torch.float32).numpy()


@functools.lru_cache(maxsize=1)
def _fp8_pairs():
    """The float32 values of two ``float8_e4m3fn`` codes side by side, for each pair read as one
    little-endian ``uint16`` (the first code in the low byte): a ``uint64`` NumPy array of 65,536
    entries (512 KiB), each the bits of :func:`_fp8_table`'s two values."""
    import numpy as np

    table, i = _fp8_table(), np.arange(65536)
    pairs = np.empty((65536, 2), dtype=np.float32)
    pairs[:, 0], pairs[:, 1] = table[i & 255], table[i >> 8]
    return pairs.view(np.uint64).reshape(-1)


def fp8_to_float32(q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` (``float8_e4m3fn``, any shape, CPU) as float32 (into ``out``, contiguous, of ``q``'s shape,
    when given): each byte looked up in a 256-entry table of torch's own conversions
    (:func:`_fp8_table`), so the values are ``q.to(torch.float32)``'s bit for bit. On a little-endian
    host two codes are looked up at once as one 16-bit index (:func:`_fp8_pairs`), and
    :data:`_LOOKUP_ELEMS` codes at a time: on this project's 2-core Xeon (2,048 x 7,168, one thread)
    19 ms against 39 ms for one code a lookup over the whole tensor and 66 ms for torch's elementwise
    conversion, which a block-FP8 release (Kimi K2, DeepSeek-V3) would run on every weight it reads."""
    import numpy as np

    codes = q.contiguous().view(torch.uint8).reshape(-1).numpy()
    res = torch.empty(q.shape, dtype=torch.float32) if out is None else out
    dst = res.view(-1).numpy()
    n, step = codes.size, _LOOKUP_ELEMS
    if sys.byteorder == "little" and n % 2 == 0 and codes.ctypes.data % 2 == 0 and dst.ctypes.data % 8 == 0:
        codes, dst, table, n, step = codes.view(np.uint16), dst.view(np.uint64), _fp8_pairs(), n // 2, step // 2
    else:
        table = _fp8_table()
    for a in range(0, n, step):
        np.take(table, codes[a:a + step], out=dst[a:a + step], mode="clip")  # in range: clip never acts
    return res


def _set_tensor(model, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if leaf in module._parameters:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise KeyError(name)


class _StorageOnMeta(TorchFunctionMode):
    """``torch.empty`` lands on ``meta`` (whatever ``device`` it is given); every other
    factory runs as asked. A module's ``__init__`` creates its weights with ``torch.empty``
    (``nn.Linear``, ``nn.Embedding``, transformers' fused experts) and computes its buffers
    from ``arange`` / ``tensor`` / ``ones`` and arithmetic, so under this mode the buffers come
    out real and the weights take no memory. A buffer filled into ``torch.empty`` storage
    stays on ``meta``, where :func:`_real_buffers` sees it and refuses."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _real_buffers(model, dtype: torch.dtype) -> str | None:
    """Compute the non-persistent buffers ``model`` (built on ``meta`` in ``dtype``) holds on
    ``meta``, in place; return why one cannot be computed (a phrase naming it), else None.

    Non-persistent buffers are not in the checkpoint: each module computes them in its
    ``__init__`` from the config (rotary embeddings' ``inv_freq`` per layer type, Gemma 3's
    ``Gemma3TextScaledWordEmbedding.embed_scale = sqrt(hidden_size)``), and on ``meta``
    those values are lost. They are taken from a second build of ``model``'s class from
    ``model.config`` in ``dtype`` on the CPU under :class:`_StorageOnMeta`: the class's own
    ``__init__`` code, with no weight storage. That is correct for any class whose buffers
    depend on its config alone (every row of :data:`compressor.arch.ARCHITECTURES`, each
    tested: tests/test_streaming_rows.py), needs no per-class rule, and is what
    ``from_pretrained`` reproduces class by class in ``_init_weights`` (the whole-model path).
    Parameters ``__init__`` fills with a constant (norm weights; routers' zero-initialized
    ``[experts, hidden]`` weights) are allocated and freed with that copy (DeepSeek-V3 at
    full size: 0.43 GB float32, under a second). Each buffer taken must exist in the copy
    with the same shape and dtype and hold values (not ``meta``); otherwise
    :func:`open_lazy` loads the model whole, saying why.

    Persistent buffers (a MoE router's ``e_score_correction_bias``) are part of the state
    dict: they are read from the checkpoint with the parameters (:func:`open_lazy` checks
    every one is stored), so they need no computing. kvq's own buffers (``counts`` of
    :class:`compressor.moe.UnfusedExperts`) are created on the CPU."""
    wanted = [f"{m}.{b}" if m else b for m, module in model.named_modules()
              for b, t in module._buffers.items()
              if t is not None and t.is_meta and b in module._non_persistent_buffers_set]
    if not wanted:
        return None
    cls = type(model).__name__
    try:
        with torch.device("cpu"), _StorageOnMeta():
            fresh = _from_config(model.config, dtype)
    except Exception as e:  # it built on meta; whatever fails here, the whole-model path still loads it
        return f"buffer {wanted[0]}: {cls} cannot be built without its weights ({first_line(e)})"
    for name in wanted:
        module_name, _, leaf = name.rpartition(".")
        old = model.get_submodule(module_name)._buffers[leaf]
        try:
            new = fresh.get_buffer(name)
        except AttributeError:
            new = None
        if new is None or new.is_meta or new.shape != old.shape or new.dtype != old.dtype:
            return f"buffer {name} is not computed by {cls}'s __init__ without the weights"
        _set_tensor(model, name, new)
    return None


def open_folder(source, dtype: torch.dtype = torch.float32, tokenizer_dir: str | Path | None = None,
                ckpt: LazyCheckpoint | None = None, defer_head: bool = False, outer: bool = True,
                defer_embedding: bool = False):
    """Build ``(model, tokenizer, checkpoint)`` from a Hugging Face folder (``source.kind == "hf"``)
    with decoder layers on ``meta`` and the rest loaded: what :func:`compressor.source.open.open_lazy`
    (the entry point, which also takes a GGUF file through kvq's cache) returns.

    MoE experts are unfused (:func:`compressor.moe.unfuse_experts`) so parameter names are
    the per-expert ones; each maps to a checkpoint tensor through
    :func:`compressor.arch.checkpoint_name`. Routers' score-correction biases are read
    from the checkpoint like parameters; block-FP8 weights are dequantized as they are
    read (:class:`LazyCheckpoint`); published model types transformers has no class for
    (``kimi_k2``) are built with the classes of the architecture they publish
    (:data:`compressor.arch.PUBLISHED_AS`); the tokenizer comes from
    :func:`compressor.source.resolve.load_tokenizer` (``tokenizer_dir`` overrides the model's).
    Multi-token-prediction layers stored after the decoder layers have no module: see
    :func:`kept_tensor_names`. ``ckpt`` replaces the folder's default reader (e.g. one that
    dequantizes packed linears: :class:`compressor.commands.kv_only.PackedCheckpoint`).
    ``defer_head``: leave an untied ``lm_head`` on ``meta`` (nothing before the write needs
    it; :func:`outer_names` / :func:`load_into` read it then); ``defer_embedding`` the same for the
    embedding, and a head tied to it (the calibration reads only its tokens' rows:
    :func:`compressor.layer_inputs.read_rows`). ``outer`` False: read nothing, every
    tensor stays on ``meta`` (a data-free worker, :mod:`compressor.data_free`, reads decoder layers only).

    Returns:
        ``(model, tokenizer, checkpoint)``, or ``(None, reason)`` when the folder cannot be
        streamed (tensor names that do not map, a non-persistent buffer its class does not
        compute without its weights: :func:`_real_buffers`).

    Raises:
        InputError: unreadable config/tokenizer, bad shard headers.
    """
    from ..arch import checkpoint_name, get_arch
    from ..moe import unfuse_experts
    from .layout_check import check_layout

    model, tokenizer, ckpt = _meta_model(source, dtype, tokenizer_dir, ckpt)
    cfg = model.config
    arch = get_arch(cfg.model_type)
    unfuse_experts(model, arch)
    why = _real_buffers(model, dtype)
    if why is not None:
        return None, why
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    names = [n for n in model.state_dict() if not (tied and n == "lm_head.weight") and not n.endswith(".counts")]
    missing = check_layout(model, arch, ckpt, names, source.spec)  # a config that describes another layout: refused
    if missing:
        return None, f"tensor {checkpoint_name(arch, missing[0])} is not stored under that name in the source shards"
    prefix = arch.layers + "."
    for n in names if outer else []:
        if not n.startswith(prefix) and not (defer_head and n == f"{arch.lm_head}.weight") and not (
                defer_embedding and n == f"{arch.embed_tokens}.weight"):
            _load_one(model, ckpt, arch, n, dtype)
    if tied:
        model.tie_weights()
    return model, tokenizer, ckpt


def check_source_layout(source, tokenizer_dir=None):
    """:func:`compressor.source.layout_check.check_layout` for a Hugging Face folder loaded whole
    (``--no-stream``, or a folder that does not stream): the model its config describes is
    built on the meta device and compared with the shards' headers before transformers reads
    any weight (transformers would keep a tensor the shards lack at its random init).
    Returns the tokenizer loaded with it (:func:`compressor.source.resolve.load_tokenizer`).

    Raises:
        InputError: see :func:`~compressor.source.layout_check.check_layout`.
    """
    from ..arch import get_arch
    from .layout_check import check_layout
    from ..moe import unfuse_experts

    model, tokenizer, ckpt = _meta_model(source, torch.float32, tokenizer_dir)
    arch = get_arch(model.config.model_type)
    unfuse_experts(model, arch)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    names = [n for n in model.state_dict() if not (tied and n == "lm_head.weight") and not n.endswith(".counts")]
    check_layout(model, arch, ckpt, names, source.spec)
    return tokenizer


def outer_names(model, arch) -> list[str]:
    """In-memory names of the tensors outside the decoder layers (embedding, final norm, an
    untied head, buffers such as a router's), as :func:`open_lazy` reads them."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    prefix = arch.layers + "."
    return [n for n in model.state_dict() if not n.startswith(prefix) and not (tied and n == "lm_head.weight")
            and not n.endswith(".counts")]


def _meta_model(source, dtype: torch.dtype, tokenizer_dir, ckpt: LazyCheckpoint | None = None):
    """``(model on meta, tokenizer, checkpoint)`` of a Hugging Face folder, eval mode, no gradients."""
    from .resolve import check_buildable, load_config, load_tokenizer, register_for

    register_for(source.path)
    ckpt = ckpt if ckpt is not None else LazyCheckpoint(source.path)  # reads (and checks) the source's quantization_config
    try:
        cfg = load_config(source.path)  # a multimodal wrapper's text model (Kimi K2.5), else AutoConfig's
        tokenizer = load_tokenizer(source.path, source.spec, tokenizer_dir)
        check_buildable(cfg, source.spec)
        if ckpt.dequantizes and hasattr(cfg, "quantization_config"):  # the weights are dequantized as they are read
            del cfg.quantization_config
        with torch.device("meta"):
            model = _from_config(cfg, dtype)
    except InputError:
        raise
    except Exception as e:  # transformers raises many types for unreadable files
        raise InputError(f"cannot load model {source.spec}: {first_line(e)}") from None
    return model, tokenizer, ckpt


def _from_config(cfg, dtype: torch.dtype):
    """transformers' causal-LM class for ``cfg`` built from it in ``dtype`` (on the current
    default device), in eval mode, without gradients."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval().requires_grad_(False)


def _load_one(model, ckpt: LazyCheckpoint, arch, name: str, dtype: torch.dtype, on_nonfinite=None) -> None:
    from ..arch import checkpoint_name

    t = ckpt.get(checkpoint_name(arch, name), dtype)
    if t.is_floating_point() and not all_finite(t):
        if on_nonfinite is None:
            raise InputError(f"source model tensor {name} contains NaN or Inf; refusing to quantize")
        on_nonfinite(name)
    _set_tensor(model, name, t)


def load_into(model, ckpt: LazyCheckpoint, arch, names: list[str], dtype: torch.dtype = torch.float32,
              on_nonfinite=None) -> None:
    """Read ``names`` (in-memory names) from ``ckpt`` into ``model``; ``on_nonfinite(name)``, when
    given, is called for a tensor holding NaN or Inf (loaded all the same) instead of refusing it.

    Raises:
        InputError: a tensor holds NaN or Inf (named), without ``on_nonfinite``.
    """
    for n in names:
        _load_one(model, ckpt, arch, n, dtype, on_nonfinite)


def layer_names(model, arch, i: int) -> list[str]:
    """Full names of decoder layer ``i``'s parameters and persistent buffers."""
    layer = model.get_submodule(f"{arch.layers}.{i}")
    skip = {f"{n}" for n, m in layer.named_modules() for b in m._non_persistent_buffers_set for n in [f"{n}.{b}" if n else b]}
    return [f"{arch.layers}.{i}.{n}" for n in layer.state_dict() if n not in skip]


def load_whole(source, dtype: torch.dtype = torch.float32, tokenizer_dir: str | Path | None = None):
    """``(model, tokenizer)`` with every weight read through :class:`LazyCheckpoint`: the
    whole-model path for block-FP8 sources (transformers' own FP8 loader dequantizes
    differently, or not at all on CPU), giving the tensors a streamed run reads, in
    transformers' module layout (fused experts, as :func:`compressor.source.open.load_model`
    returns). Multi-token-prediction layers are not read (no module holds them).

    Raises:
        InputError: a tensor of the model is not stored in the folder, or holds NaN/Inf.
    """
    from ..arch import checkpoint_name, get_arch, is_text_tensor, mtp_layer, state_from_checkpoint

    model, tokenizer, ckpt = _meta_model(source, dtype, tokenizer_dir)
    cfg = model.config
    arch = get_arch(cfg.model_type)
    state = {}
    for name in ckpt.where:
        if (name.endswith("_scale_inv") and name[: -len("_scale_inv")] in ckpt.where) \
                or mtp_layer(arch, cfg.num_hidden_layers, name) is not None or not is_text_tensor(arch, name):
            continue
        t = ckpt.get(name, dtype)
        if t.is_floating_point() and not all_finite(t):
            raise InputError(f"source model tensor {name} contains NaN or Inf; refusing to quantize")
        state[name] = t
    state = state_from_checkpoint(arch, model, state)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    missing = [n for n in model.load_state_dict(state, strict=False, assign=True).missing_keys
               if not (tied and n == "lm_head.weight")]
    if missing:
        raise InputError(f"cannot load model {source.spec}: tensor {checkpoint_name(arch, missing[0])} is not stored in it")
    why = _real_buffers(model, dtype)
    if why is not None:
        raise InputError(f"cannot load model {source.spec}: {why}")
    if tied:
        model.tie_weights()
    return model, tokenizer


def kept_tensor_names(ckpt: LazyCheckpoint, arch, num_hidden_layers: int) -> list[str]:
    """Checkpoint names of the multi-token-prediction tensors kvq keeps, sorted.

    DeepSeek-V3 / GLM checkpoints store ``num_nextn_predict_layers`` MTP layers as decoder
    layers ``num_hidden_layers, ...`` (:func:`compressor.arch.mtp_layer`); transformers
    builds no module for them, so neither load path reads them. kvq copies them into the
    artifact in float (block-FP8 ones dequantized; each ``_scale_inv`` is consumed by its
    weight), unquantized, so a serving engine's speculative decoding still finds them.
    """
    from ..arch import mtp_layer

    return sorted(n for n in ckpt.where if mtp_layer(arch, num_hidden_layers, n) is not None
                  and not (n.endswith("_scale_inv") and n[: -len("_scale_inv")] in ckpt.where))


def carried_tensor_names(ckpt: LazyCheckpoint, arch) -> list[str]:
    """Checkpoint names of the tensors a multimodal wrapper carries untouched (Kimi K2.5's
    vision tower and projector, :class:`compressor.arch.Wrapper`), sorted; a block-FP8
    weight's ``_scale_inv`` is consumed by its weight. Empty for a text-only row."""
    from ..arch import is_carried

    return sorted(n for n in ckpt.where if is_carried(arch, n)
                  and not (n.endswith("_scale_inv") and n[: -len("_scale_inv")] in ckpt.where))


def kept_modules(ckpt: LazyCheckpoint, names: list[str]) -> list[str]:
    """The linears among kept tensors (owners of a 2-D ``.weight``; embeddings and output
    heads excepted, as ``lm_head`` is): the names a format's ignore list must carry so a
    loader does not expect them packed."""
    return sorted(n[: -len(".weight")] for n in names if n.endswith(".weight") and len(ckpt.where[n][1].shape) == 2
                  and not n.endswith(("embed_tokens.weight", "shared_head.head.weight")))


def copy_kept_tensors(ckpt: LazyCheckpoint, names: list[str], dtype: torch.dtype, save_part,
                      part_bytes: int = 1 << 30, tag: str = "mtp", as_stored: bool = False) -> int:
    """Copy ``names`` from ``ckpt`` (float in ``dtype``, block FP8 dequantized; with
    ``as_stored`` float tensors keep their stored dtype and bytes) through
    ``save_part(name, tensors)`` in parts of at most ``part_bytes`` (one tensor more if a
    single tensor is larger), so an MTP layer of a large MoE never sits in memory whole.
    Returns the number of parts written (``<tag>-00000``, ...).

    Raises:
        InputError: a tensor holds NaN or Inf.
    """
    part, size, n = {}, 0, 0
    for name in names:
        t = ckpt.get(name, dtype, as_stored)
        if t.is_floating_point() and not all_finite(t):
            raise InputError(f"source model tensor {name} contains NaN or Inf; refusing to copy it")
        part[name] = t
        size += t.numel() * t.element_size()
        if size >= part_bytes:
            save_part(f"{tag}-{n:05d}", part)
            part, size, n = {}, 0, n + 1
            trim_heap()
    if part:
        save_part(f"{tag}-{n:05d}", part)
        n += 1
    return n


def to_meta(*modules: torch.nn.Module) -> None:
    """Release the parameters of ``modules`` (replaced by ``meta`` tensors of the same shape) and
    hand the freed heap back to the OS once it holds :data:`HEAP_SLACK` free (glibc keeps freed
    blocks of up to 32 MB in its heap, where fragmentation would otherwise let RSS grow layer
    after layer); one trim for all of them (a group of routed experts). The garbage collection
    before the trim runs once :data:`HEAP_SLACK` bytes of parameters were released since the last
    one: a streamed pass over a small model releases its groups hundreds of times a token, and a
    full collection each time cost three quarters of its wall time."""
    released = 0
    for module in modules:
        for m in module.modules():
            for k, p in list(m._parameters.items()):
                if p is not None and not p.is_meta:
                    released += p.numel() * p.element_size()
                    m._parameters[k] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
    _RELEASED[0] += released
    if _RELEASED[0] >= HEAP_SLACK:
        _RELEASED[0] = 0
        trim_heap(HEAP_SLACK)


#: parameter bytes :func:`to_meta` released since its last trim
_RELEASED = [0]


#: free bytes the C heap may keep between layers (:func:`to_meta`): below this the freed blocks
#: are reused by the next layer instead of being handed back and faulted in again page by page
#: (RTN on SmolLM2: 30-50 MB a layer; a trim after each layer cost about 200,000 page faults)
HEAP_SLACK = 256 * 2**20


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library (looked up once: ``find_library`` asks the linker cache), ``None`` where it cannot be loaded;
    its ``mallinfo2`` (if any) returns glibc's ``struct mallinfo2``."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = MallInfo2
    return libc


def heap_free_bytes() -> int | None:
    """Bytes the C heap holds free (glibc ``mallinfo2().fordblks``), ``None`` where unknown."""
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    return None if fn is None else int(fn().fordblks)


def trim_heap(min_free: int = 0) -> None:
    """Collect garbage and hand the C heap's free pages back to the system (glibc ``malloc_trim``),
    when it holds at least ``min_free`` bytes free (or that cannot be known)."""
    gc.collect()
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):  # not glibc: nothing to trim
        return
    if min_free:
        free = heap_free_bytes()
        if free is not None and free < min_free:
            return
    libc.malloc_trim(0)
