"""Writing and reading kvq artifacts (compressed-tensors folders plus the manifest).

Writing is atomic: everything goes to a temporary folder beside the destination, which
is renamed into place only after the manifest is complete, so a failure or an
interruption never leaves a half-written artifact.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from . import __version__, interrupts
from .arch import get_arch, is_text_tensor, memory_name, mtp_layer, state_from_checkpoint
from .source.config_check import check_routing, quantization_config, text_config
from .errors import InputError, resource_problem
from .formats import READ_CT_FORMATS, read_quant_weight, reader_for
from .integrity import build_manifest, check_hashes  # noqa: F401  (re-exported)
from .manifest import MANIFEST_NAME, Manifest, load_manifest
from .quant.fp8_inputs import install_activation_quant
from .safetensors_io import read_header
from .tokens import check_vocabulary

WEIGHTS_NAME = "model.safetensors"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse an existing output folder unless ``overwrite``; run before any work.

    ``overwrite`` replaces only an empty folder or a kvq artifact (a folder holding
    ``kvq-manifest.json``): any other folder is refused, so a mistyped ``-o`` never
    deletes unrelated files. A missing parent folder is created.

    Raises:
        InputError: ``out`` is a symlink (dangling or not: the artifact is put in place by
            renaming a folder onto that path, which a link cannot take); the folder (or a
            file) exists and ``overwrite`` is false; it exists, is not empty and is not a
            kvq artifact; or its parent cannot be created or written.
    """
    out = Path(out)
    if out.is_symlink():
        target = os.readlink(out)
        state = "a dangling symlink" if not out.exists() else "a symlink"
        raise InputError(f"output path {out} is {state} (to {target}); kvq renames the finished artifact into "
                         "place and does not write through links: give the real path as -o")
    if out.exists() and not out.is_dir():
        raise InputError(f"output path {out} exists and is not a folder; choose another -o")
    if out.exists() and not overwrite:
        raise InputError(f"output folder {out} exists; choose another -o or pass --overwrite")
    if out.exists():
        try:
            empty = next(out.iterdir(), None) is None
        except OSError as e:
            raise InputError(f"cannot read output folder {out}: {e.strerror}") from None
        manifest = out / MANIFEST_NAME
        if not empty and (manifest.is_symlink() or not manifest.is_file()):
            raise InputError(f"output folder {out} is not a kvq artifact; refusing to overwrite it (it holds files but "
                             f"no {MANIFEST_NAME}; --overwrite replaces only an empty folder or an earlier kvq artifact)")
    parent = out.resolve().parent
    try:  # a missing parent is made (``-o out/model`` in a fresh checkout), as ``mkdir -p`` does
        parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InputError(f"parent of {out} is not a folder") from None
    except OSError as e:
        raise InputError(f"cannot create the parent folder of {out}: {e.strerror}") from None
    try:  # the artifact is written to a temporary folder beside the destination: prove we can
        probe = Path(tempfile.mkdtemp(prefix=f".{out.name}.kvq-probe-", dir=parent))
        probe.rmdir()
    except OSError as e:
        raise InputError(f"cannot write into {parent}: {e.strerror}") from None


def library_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "compressed-tensors", "safetensors", "gguf"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def state_tensors(model, modules: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype, rename=None,
                  prefix: str | None = None, skip_prefix: str | None = None, names: set[str] | None = None,
                  exclude: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors to store: ``model``'s float state (in ``dtype``; tied ``lm_head`` once;
    weights of packed modules left out) plus ``modules``' packed tensors, by checkpoint
    name. ``prefix`` keeps only names under it (one decoder layer); ``skip_prefix`` drops
    names under it (the decoder layers, already written part by part); ``names`` keeps only
    those in-memory names, ``exclude`` drops them (a layer's expert groups, written before)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if (prefix is not None and not name.startswith(prefix)) or (skip_prefix is not None and name.startswith(skip_prefix)):
            continue
        if (names is not None and name not in names) or (exclude and name in exclude):
            continue
        name = rename(name) if rename is not None else name  # checkpoint names (e.g. Mixtral's block_sparse_moe)
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module in modules:
            continue
        if tied and name == "lm_head.weight":
            continue  # tied to the input embeddings: stored once
        out[name] = tensor.detach().to(dtype).contiguous() if tensor.is_floating_point() else tensor.contiguous()
    for module, tensors in modules.items():
        for key, t in tensors.items():
            out[f"{module}.{key}"] = t.contiguous()
    return dict(sorted(out.items()))


def _config_dict(model, quant_config: dict, dtype_name: str) -> dict:
    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    data = cfg.to_dict()
    data.pop("_name_or_path", None)
    data.pop("quantization_config", None)
    data["dtype"] = dtype_name
    if not data.get("architectures"):  # a GGUF source has none; vLLM picks the model class from this field
        data["architectures"] = [type(model).__name__]
    if quant_config is not None:
        data["quantization_config"] = quant_config
    return data


def _published_config_dict(raw: dict, quant_config: dict, dtype_name: str) -> dict:
    """A multimodal wrapper's published ``config.json`` as it is (``model_type``,
    ``architectures``, ``auto_map``, vision and text configs), with the artifact's
    ``quantization_config`` at the top (where vLLM and transformers read it; the source's,
    top-level or the text config's, removed) and its storage dtype declared."""
    data = copy.deepcopy(raw)
    text = data.get(get_arch(data["model_type"]).wrapper.text_config)
    for d in (data, text):
        d.pop("quantization_config", None)
        d.pop("_name_or_path", None)
        for key in ("dtype", "torch_dtype"):
            if key in d or (key == "dtype" and d is data):
                d[key] = dtype_name
    if quant_config is not None:
        data["quantization_config"] = quant_config
    return data


def write_artifact(
    out: Path,
    model,
    tokenizer,
    modules: dict[str, dict[str, torch.Tensor]],
    quant_config: dict,
    manifest_fields: dict,
    dtype_name: str = "float16",
    overwrite: bool = False,
    provenance: dict | None = None,
    digest_algorithm: str = "sha256",
    finalize=None,
    rename=None,
    staging=None,
    skip_prefix: str | None = None,
    shard_bytes: int = 5 * 10**9,
    on_committed: Callable[[Path], None] | None = None,
    published_config: dict | None = None,
) -> Manifest:
    """Write the artifact folder ``out`` atomically and return its manifest.

    Args:
        model: the quantized in-memory model (norms hold folded AWQ scales).
        modules: full module name -> stored compressed-tensors tensors.
        quant_config: ``config.json["quantization_config"]``.
        manifest_fields: ``tool``/``source``/``recipe``/``calibration``/``quantization``/``quality``.
        dtype_name: storage dtype of float tensors.
        digest_algorithm: ``sha256`` or ``blake3`` for the manifest's digests.
        finalize: called with the temporary folder once the manifest is written and
            before the rename (signing happens here, so a signed artifact never appears
            unsigned); an exception from it leaves nothing behind.
        rename: maps the model's tensor names to checkpoint names (``modules`` are already
            named so), see :func:`compressor.arch.checkpoint_name`.
        staging: a :class:`compressor.staging.Staging` whose folder becomes the artifact
            and whose part files (decoder layers written as they finished) are assembled
            into the shards; ``skip_prefix`` then names the tensors already in those parts.
        shard_bytes: maximum data bytes per shard; one shard is ``model.safetensors``,
            several are ``model-0000k-of-0000N.safetensors`` plus the index.
        on_committed: called with ``out`` right after the rename that places the
            artifact (while signals are deferred), e.g. to record that ``out`` now holds a
            complete artifact (the CLI passes one that its interruption message reads).
        published_config: a multimodal wrapper's ``config.json`` (Kimi K2.5), kept as
            published instead of ``model``'s (the text model's) config.

    Raises:
        InputError: the output folder is refused (:func:`check_output`); a resource ran out
            while writing (disk full, quota, file-size limit: :func:`compressor.errors.resource_problem`),
            named; nothing is placed at ``out``.
    """
    from safetensors.torch import save_file

    from .safetensors_io import write_shards

    out = Path(out)
    check_output(out, overwrite)
    if staging is not None:  # assembled inside the staging folder, whose checkpoint stays valid meanwhile
        tmp = staging.artifact_dir
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    else:
        tmp = new_temp_folder(out)
    last = (staging.path if staging is not None else tmp) / "part-final.safetensors"
    placed = False
    try:
        tensors = state_tensors(model, modules, DTYPES[dtype_name], rename, skip_prefix=skip_prefix)
        parts = list(staging.parts) if staging is not None else []
        save_file(tensors, str(last), metadata={"format": "pt"})
        del tensors
        parts.append(last)
        # decoder-layer parts become shards by hard link when the artifact needs several shards,
        # so the assembly needs no second copy of the artifact on disk
        write_shards(parts, tmp, shard_bytes, link=list(staging.parts) if staging is not None else ())
        last.unlink()
        cfg = (_config_dict(model, quant_config, dtype_name) if published_config is None
               else _published_config_dict(published_config, quant_config, dtype_name))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(tmp))
        save_tokenizer(tokenizer, tmp)
        manifest = seal_folder(tmp, manifest_fields, provenance, digest_algorithm, finalize)
        place_folder(tmp, out, on_committed, after=(lambda: shutil.rmtree(staging.path, ignore_errors=True))
                     if staging is not None else None)
        placed = True
    except BaseException as e:
        if not placed:
            shutil.rmtree(tmp, ignore_errors=True)  # the staging folder's checkpoint is the caller's to keep or drop
            last.unlink(missing_ok=True)
        problem = resource_problem(e) if isinstance(e, Exception) and not isinstance(e, InputError) else None
        if problem is not None:  # disk full, quota, file-size limit: one line naming it (nothing was placed)
            raise InputError(f"cannot write the artifact {out}: {problem} (assembled in {tmp.parent}); nothing was "
                             "written") from None
        raise
    return manifest


def new_temp_folder(out: Path) -> Path:
    """A fresh temporary folder beside ``out`` (``.<name>.kvq-tmp-*``), where an artifact is
    assembled before :func:`place_folder` renames it into place."""
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.kvq-tmp-", dir=out.resolve().parent))


def seal_folder(tmp: Path, manifest_fields: dict, provenance: dict | None, digest_algorithm: str,
                finalize=None) -> Manifest:
    """Hash the assembled folder ``tmp`` into its manifest, write it, run ``finalize(tmp)``
    (signing), and give the files the permissions the umask allows; returns the manifest.

    Raises:
        InputError: a bad safetensors header (from :func:`build_manifest`); whatever
            ``finalize`` raises.
    """
    manifest = build_manifest(tmp, manifest_fields, provenance, digest_algorithm)
    (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    if finalize is not None:
        finalize(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for f in tmp.iterdir():
        os.chmod(f, 0o666 & ~umask)
    return manifest


def place_folder(tmp: Path, out: Path, on_committed: Callable[[Path], None] | None = None,
                 after: Callable[[], None] | None = None) -> None:
    """Rename the sealed folder ``tmp`` to ``out`` with signals deferred (an earlier ``out``
    is moved aside first and removed after), so ``out`` is never missing nor half-written;
    then ``on_committed(out)`` and ``after()``, still deferred."""
    with interrupts.deferred():  # a signal here waits: OUT is never left half-replaced
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.kvq-old-", dir=out.resolve().parent))
            os.replace(out, old / "artifact")
        os.replace(tmp, out)
        if on_committed is not None:
            on_committed(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if after is not None:
            after()


LOAD_OPTIONS = ("local_files_only", "is_local")  # how the tokenizer was loaded, not what it is


def save_tokenizer(tokenizer, folder: Path) -> None:
    """``tokenizer.save_pretrained(folder)`` without the loading options transformers copies
    into ``tokenizer_config.json`` (``local_files_only`` follows ``HF_HUB_OFFLINE``): the
    artifact's bytes must not depend on the environment kvq ran in."""
    tokenizer.save_pretrained(str(folder))
    p = Path(folder) / "tokenizer_config.json"
    if p.is_file():
        cfg = json.loads(p.read_text(encoding="utf-8"))
        if any(k in cfg for k in LOAD_OPTIONS):
            for k in LOAD_OPTIONS:
                cfg.pop(k, None)
            p.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def tool_info() -> dict:
    return {"name": "kvq", "version": __version__, "libraries": library_versions()}


def check_readable(folder: Path, qc: dict) -> None:
    """Refuse a ``quantization_config`` :func:`load_artifact` cannot dequantize.

    Raises:
        InputError: a ``quant_method`` other than compressed-tensors, awq, gptq; a
            compressed-tensors ``format`` other than those of :data:`~compressor.formats.READ_CT_FORMATS`.
    """
    method = qc.get("quant_method")
    if qc and reader_for(method) is None:
        raise InputError(f"{folder}: quant_method {method!r} is not one kvq reads (compressed-tensors, awq, gptq)")
    if method == "compressed-tensors" and qc.get("format") not in READ_CT_FORMATS:
        known = ", ".join(READ_CT_FORMATS[:2] + READ_CT_FORMATS[4:])
        raise InputError(f"{folder}: only compressed-tensors {known} (and mixed-precision of "
                         f"them) artifacts can be loaded (format {qc.get('format')!r})")


def load_artifact(folder: str | Path, dtype: torch.dtype = torch.float32):
    """Load an artifact as a float model (dequantized) plus tokenizer, for evaluation.

    Reads ``config.json``'s ``quantization_config`` (compressed-tensors ``pack-quantized``
    with one or several config groups, AutoAWQ GEMM, or GPTQ v1/v2 with ``g_idx``),
    validates every safetensors header first, dequantizes each packed Linear and loads
    the rest as stored.

    Raises:
        InputError: missing files, bad headers, a quantization config kvq cannot read,
            tensors missing or unexpected for the model's architecture, router fields that
            contradict the experts, a tokenizer id beyond the embedding.
    """
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from .source.resolve import load_config, load_tokenizer

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise InputError(f"{folder} has no config.json")
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise InputError(f"{folder} has no .safetensors file")
    for s in shards:
        read_header(s)
    try:
        raw_cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{folder}/config.json: {e}") from None
    qc = quantization_config(raw_cfg) or {}  # a wrapper's may sit in its text_config
    method = qc.get("quant_method")
    check_readable(folder, qc)
    try:
        cfg = load_config(folder)  # a multimodal wrapper's text model (Kimi K2.5), else AutoConfig's
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"{folder}/config.json: {str(e).splitlines()[0]}") from None
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    check_routing(text_config(cfg.to_dict()), f"{folder}/config.json")  # a router the experts contradict
    arch = get_arch(cfg.model_type)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x (pyproject allows >= 4.56) keeps it in modeling_utils
        from transformers.modeling_utils import no_init_weights

    with no_init_weights():  # every parameter is loaded below (a missing one is refused): random init is wasted work
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    fmt = reader_for(method)
    leaves = fmt.leaves if fmt is not None else ()
    state: dict[str, torch.Tensor] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}
    acts: dict[str, tuple] = {}  # module -> its input's quantization (FP8 W8A8, W4A8, NVFP4 W4A4)
    marked = _packed_modules(shards, fmt)
    for s in shards:
        with safe_open(str(s), framework="pt") as f:
            for key in f.keys():
                module, _, leaf = key.rpartition(".")
                if leaf in ("k_scale", "v_scale") or not is_text_tensor(arch, key) \
                        or mtp_layer(arch, cfg.num_hidden_layers, key) is not None:
                    continue  # KV-cache scales (read_kv_cache), carried tensors and MTP layers (no module holds them)
                if leaf in leaves and module in marked:
                    packed.setdefault(module, {})[leaf] = f.get_tensor(key)
                else:
                    state[key] = f.get_tensor(key).to(dtype) if f.get_slice(key).get_dtype() in ("F16", "BF16", "F32", "F64") else f.get_tensor(key)
    for module, t in packed.items():
        try:  # the format's reader (the runtime uses the same): one validation, then kvq's dequantization
            w = read_quant_weight(method, qc, module, t)
        except InputError as e:
            raise InputError(f"{folder}: {e}") from None
        state[f"{module}.weight"] = w.dequantize(dtype)
        if w.act:  # NVFP4 W4A4 adds its static input global scale
            acts[memory_name(arch, module)] = (w.act, w.act_group) + \
                ((w.input_global_scale,) if w.input_global_scale is not None else ())
    state = state_from_checkpoint(arch, model, state)  # MoE: per-expert tensors -> fused experts
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise InputError(f"{folder}: tensors do not match the {cfg.model_type} architecture ({what})")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.eval().requires_grad_(False)
    install_activation_quant(model, arch, acts)  # FP8 W8A8, W4A8, W4A4: each input quantized as the kernel does
    tokenizer = load_tokenizer(folder)  # a tokenizer that needs repository code (Kimi's tiktoken) is converted
    check_vocabulary(tokenizer, cfg.vocab_size, f"{folder}: tokenizer")
    return model, tokenizer


def _packed_modules(shards: list[Path], fmt) -> set[str]:
    """Checkpoint names of the modules stored packed: those with the format's ``marker`` leaf."""
    if fmt is None:
        return set()
    return {key.rpartition(".")[0] for s in shards for key in read_header(s) if key.rpartition(".")[2] == fmt.marker}


@dataclass(frozen=True)
class ForeignManifest:
    """What ``kvq verify --no-manifest`` knows of an artifact another tool wrote.

    Mirrors the fields of :class:`compressor.manifest.Manifest` that verification reads:
    no recipe gates, no recorded source, ``quantization.algorithm`` ``"unknown"`` (weights
    packed) or ``"none"``, and the KV-cache scheme read from compressed-tensors'
    ``kv_cache_scheme`` (static fp8 per tensor / int8 or fp8 per head).
    """

    quantization: dict
    recipe: dict
    source: dict
    kv_cache: Optional[dict]


#: the kv_cache_scheme fields a refusal quotes
_KV_KEYS = ("type", "num_bits", "strategy", "dynamic", "symmetric", "group_size")


def foreign_manifest(folder: str | Path) -> ForeignManifest:
    """Describe a quantized folder that has no kvq manifest (e.g. llm-compressor's output).

    Raises:
        InputError: the folder has a kvq manifest (verify it normally), no readable
            config.json, or a ``kv_cache_scheme`` kvq has no evaluation for.
    """
    from .manifest import MANIFEST_NAME

    folder = Path(folder)
    if (folder / MANIFEST_NAME).exists():
        raise InputError(f"{folder} has a {MANIFEST_NAME}: verify it without --no-manifest (its digests would go unchecked)")
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise InputError(f"{folder} has no config.json") from None
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{folder}/config.json: {e}") from None
    qc = quantization_config(cfg) or {}
    algorithm = "unknown" if qc else "none"
    kv = qc.get("kv_cache_scheme")
    kv_rec = None
    if kv:
        if not isinstance(kv, dict):
            raise InputError(f"{folder}/config.json: quantization_config.kv_cache_scheme must be an object "
                             f"(compressed-tensors' QuantizationArgs), got {type(kv).__name__} {kv!r}")
        scheme = {("float", 8): "fp8", ("int", 8): "int8"}.get((kv.get("type"), kv.get("num_bits")))
        strategy = {"tensor": "tensor", "attn_head": "head"}.get(kv.get("strategy"))
        bad = ("dynamic" if kv.get("dynamic") else "symmetric" if kv.get("symmetric") is False
               else "group_size" if kv.get("group_size") is not None else None)
        if scheme is None or strategy is None or bad or scheme == "int8" and strategy != "head":
            field = bad or ("type/num_bits" if scheme is None or scheme == "int8" and strategy == "tensor" else "strategy")
            raise InputError(f"{folder}: kv_cache_scheme's {field} ({', '.join(f'{k}={kv.get(k)}' for k in _KV_KEYS)}) "
                             "is not one kvq evaluates (static symmetric fp8 per tensor or head, int8 per head)")
        kv_rec = {"scheme": scheme, "strategy": strategy}
    return ForeignManifest({"algorithm": algorithm}, {"algorithm": algorithm, "gates": {}}, {}, kv_rec)


def read_kv_cache(folder: str | Path, manifest=None, tensors=None, n_layers: int | None = None):
    """The artifact's KV-cache scheme and static scales, or ``None`` when it has none.

    Returns ``(KVSpec, {layer: (k_scale, v_scale)} | None)``; scales are read from the
    ``<layers>.<i>.<attention>.k_scale``/``v_scale`` tensors (float32, flattened).

    Args:
        tensors: where to read them (an object with ``keys()`` and ``get(name)``, the
            runtime's checked reader); default: the folder's safetensors shards.
        n_layers: decoder layers (default: ``config.json``'s ``num_hidden_layers``).

    Raises:
        InputError: the manifest names a static scheme but scale tensors are missing.
    """
    from .quant.kv import make_spec

    folder = Path(folder)
    manifest = manifest or load_manifest(folder)
    rec = manifest.kv_cache
    if not rec:
        return None
    spec = make_spec(rec["scheme"], rec.get("strategy"), rec.get("group_size", 32), rec.get("residual_length", 128))
    if not spec.static:
        return spec, None
    scales: dict[int, list] = {}
    for key, get in _scale_tensors(folder, tensors):
        module, _, leaf = key.rpartition(".")
        idx = [p for p in module.split(".") if p.isdigit()]
        if idx:
            scales.setdefault(int(idx[0]), [None, None])[0 if leaf == "k_scale" else 1] = get().float().flatten()
    if n_layers is None:
        from .source.config_check import text_config  # a multimodal wrapper's text model (Kimi K2.5)

        n_layers = int(text_config(json.loads((folder / "config.json").read_text())).get("num_hidden_layers", len(scales)))
    missing = [i for i in range(n_layers) if i not in scales or None in scales[i]]
    if missing:
        raise InputError(f"{folder}: KV scheme {spec.describe()} but k_scale/v_scale missing for layer {missing[0]}")
    sizes = {k.numel() for pair in scales.values() for k in pair}
    if spec.strategy == "tensor" and sizes != {1}:  # per-head scales under a per-tensor label
        raise InputError(f"{folder}: KV scheme {spec.describe()} but k_scale/v_scale hold {max(sizes)} values a layer, "
                         "not one: the declared strategy and the stored scales disagree")
    if spec.strategy == "head" and sizes == {1} and _kv_heads(folder) != 1:
        raise InputError(f"{folder}: KV scheme {spec.describe()} but every k_scale/v_scale holds one value: "
                         "the declared strategy (per head) and the stored scales (per tensor) disagree")
    return spec, {i: (k, v) for i, (k, v) in scales.items()}


def _kv_heads(folder: Path) -> int | None:
    """``num_key_value_heads`` of the folder's (text) config, ``None`` when it cannot be read."""
    from .source.config_check import text_config

    try:
        return text_config(json.loads((folder / "config.json").read_text())).get("num_key_value_heads")
    except (OSError, ValueError, AttributeError):
        return None


def _scale_tensors(folder: Path, tensors):
    """``(name, read)`` for each stored ``k_scale``/``v_scale`` tensor, from ``tensors`` or the folder's shards."""
    is_scale = lambda key: key.rpartition(".")[2] in ("k_scale", "v_scale")  # noqa: E731
    if tensors is not None:
        yield from ((key, lambda key=key: tensors.get(key)) for key in list(tensors.keys()) if is_scale(key))
        return
    from safetensors import safe_open

    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            yield from ((key, lambda key=key, f=f: f.get_tensor(key)) for key in f.keys() if is_scale(key))


