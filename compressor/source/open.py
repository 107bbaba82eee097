"""Opening a model source: the entry point of :mod:`compressor.source`.

A command names a source (a Hugging Face folder, a GGUF file, an alias), has it located and
checked by :func:`compressor.source.resolve.resolve_source`, then opens it here: streamed
(:func:`open_lazy`: decoder layers on ``meta``, read one at a time through
:mod:`compressor.source.lazy`) or whole (:func:`load_model`). A GGUF file is converted by
transformers' GGUF loader once and stored in kvq's cache (:mod:`compressor.source.gguf_cache`);
later runs, streamed ones included, read the cache.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InputError, first_line
from .gguf_cache import _write_gguf_cache, cache_root, cache_writable, cached_gguf_folder
from .lazy import LazyCheckpoint, _from_config, check_source_layout, load_whole, open_folder, trim_heap
from .resolve import ModelSource, _block_fp8, check_buildable, load_config, register_for, wrapper_of


def open_lazy(source: ModelSource, dtype: torch.dtype = torch.float32, tokenizer_dir: str | Path | None = None,
              ckpt: LazyCheckpoint | None = None, defer_head: bool = False, convert_gguf: bool = False,
              outer: bool = True, defer_embedding: bool = False):
    """Build ``(model, tokenizer, checkpoint)`` with decoder layers on ``meta`` and the rest loaded
    (:func:`compressor.source.lazy.open_folder` says what is read and how).

    A GGUF file streams from kvq's cache once converted. ``convert_gguf``: a GGUF file not in
    the cache yet is converted whole once (:func:`load_model` stores it there), released, and
    streamed from the cache (when the cache folder is writable; otherwise ``(None, reason)`` as
    without it). ``outer`` False: the tensors outside the decoder layers stay on ``meta`` too;
    ``defer_head`` / ``defer_embedding``: an untied head / embedding does (``open_folder``).

    Returns:
        ``(model, tokenizer, checkpoint)``, or ``(None, reason)`` when the source cannot be
        streamed (a GGUF file not cached, a kind other than a folder, a folder
        :func:`~compressor.source.lazy.open_folder` refuses).

    Raises:
        InputError: unreadable config/tokenizer, bad shard headers.
    """
    if source.kind == "gguf":  # a GGUF converted once before streams from kvq's cache
        cached = cached_gguf_folder(source)
        if cached is None and convert_gguf:
            if not cache_writable():
                return None, (f"kvq's cache folder {cache_root()} cannot be written: the GGUF file is converted "
                              "whole on every run")
            load_model(source)  # converted and stored in kvq's cache; the whole model is released here
            trim_heap()
            cached = cached_gguf_folder(source)
        if cached is None:
            return None, ("a GGUF file is dequantized whole by transformers' GGUF loader the first time "
                          "(cached for later runs)")
        source = ModelSource(source.spec, "hf", cached)
    elif source.kind != "hf":
        return None, f"{source.kind} sources are loaded whole"
    return open_folder(source, dtype, tokenizer_dir, ckpt, defer_head, outer, defer_embedding)


def meta_skeleton(source: ModelSource):
    """The model ``source``'s configuration describes, built on ``meta`` from the configuration
    alone (no weight read, nothing allocated): the widths of every linear, for the refusals
    that need only shapes (a group size that does not divide a width) before the model loads.

    The configuration is a Hugging Face folder's ``config.json`` (a multimodal wrapper's text
    model; a source quantization block dropped, as the streamed reader drops it), a GGUF file's
    converted ``config.json`` from kvq's cache, or else the GGUF file's metadata (read by
    transformers' GGUF config reader: seconds, where converting the file takes tens).

    Returns:
        the model (eval mode, no gradients; routed experts as transformers builds them, fused
        3-D parameters), or ``None`` when the configuration does not build here: the loader then
        reports the problem in its own words.
    """
    from transformers import AutoConfig

    cached = cached_gguf_folder(source)
    try:
        if source.kind == "gguf" and cached is None:
            cfg = AutoConfig.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
        else:
            cfg = load_config(cached if cached is not None else source.path)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        with torch.device("meta"):
            return _from_config(cfg, torch.float32)
    except Exception:  # any failure here (an InputError too) is the loader's to word, as it always was
        return None


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32, tokenizer_dir: str | Path | None = None):
    """Load ``(model, tokenizer)`` in ``dtype`` on CPU, eval mode, no gradients.

    For GGUF the quantization marker transformers sets (``quant_method: gguf``) is removed,
    since the weights are plain float once loaded; the converted model is cached
    (:func:`cached_gguf_folder`) and later loads read the cache. A block-FP8 folder is read
    through kvq's own dequantizing reader (:func:`compressor.source.lazy.load_whole`, the
    tensors a streamed run reads). Published model types transformers has no class for
    are built with the classes they publish (:func:`register_published_types`); the
    tokenizer comes from :func:`load_tokenizer` (``tokenizer_dir`` overrides).

    Raises:
        InputError: the files cannot be parsed by transformers.
    """
    from transformers import AutoModelForCausalLM

    if source.kind == "hf":
        register_for(source.path)
    cached = cached_gguf_folder(source)
    if cached is not None:
        model, tokenizer = load_model(ModelSource(source.spec, "hf", cached), dtype)
        return model, tokenizer
    if source.kind == "hf" and (_block_fp8(source.path) is not None or wrapper_of(source.path) is not None):
        return load_whole(source, dtype, tokenizer_dir)
    from transformers import AutoTokenizer

    try:
        if source.kind == "gguf":
            kw = {"gguf_file": source.path.name}
            folder = str(source.path.parent)
            tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw)
            for obj in (model.config,):
                if hasattr(obj, "quantization_config"):
                    del obj.quantization_config
            model.hf_quantizer = None
            model.is_quantized = False
            if dtype == torch.float32:
                _write_gguf_cache(source, model, tokenizer)
        else:
            tokenizer = check_source_layout(source, tokenizer_dir)  # a config describing other tensors: refused first
            model, info = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype, use_safetensors=True,
                                                               output_loading_info=True)
            check_buildable(model.config, source.spec)
            _refuse_missing(model, info, source.spec)
    except InputError:
        raise
    except Exception as e:  # transformers raises many types for unreadable files
        first = first_line(e)
        raise InputError(f"cannot load model {source.spec}: {first}") from None
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _refuse_missing(model, info: dict, spec: str) -> None:
    """Tensors transformers' loader did not find (it leaves them at their random init) or
    found with another shape: refused, named (a tied head is not missing)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [k for k in info.get("missing_keys") or [] if not (tied and k == "lm_head.weight")]
    if missing:
        raise InputError(f"{spec}: the checkpoint does not store {missing[0]} ({len(missing)} tensor(s) the model "
                         "its config.json describes needs); check config.json against the shards")
    if info.get("mismatched_keys"):
        raise InputError(f"{spec}: tensor {info['mismatched_keys'][0][0]} has another shape in the checkpoint than "
                         "config.json describes")
