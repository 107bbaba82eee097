"""``kvq quantize`` on an already-quantized source: the KV cache calibrated, the weights carried.

A source whose ``config.json`` declares packed weights (``quantization_config.quant_method``
``compressed-tensors`` with config groups, ``awq`` or ``gptq``: a kvq artifact or another
tool's, e.g. Kimi K2 Thinking's INT4 ``pack-quantized`` release) is never quantized again.
With a KV-only recipe (``--recipe kv-fp8`` / ``kv-int8``) kvq

1. builds the model from the packed weights, dequantized by the same readers ``kvq
   verify`` and the runtime use (streamed one decoder layer at a time through
   :class:`PackedCheckpoint`, else whole through :func:`compressor.artifact.load_artifact`),
   so the KV scales are calibrated on the weights as they will be served;
2. runs the float path's calibration pass (:func:`compressor.pipeline.quantize_model`
   with algorithm ``none``: post-RoPE observers on each layer's recomputed outputs);
3. writes an artifact whose tensors are the source's, byte for byte (every name, dtype,
   shape and data range copied from the source shards, :func:`compressor.safetensors_io.write_shards`),
   plus the ``k_scale``/``v_scale`` tensors; ``config.json`` is the source's with the KV
   scheme declared the way its format declares it (:meth:`compressor.formats.base.WeightFormat.with_kv`);
   every other file (tokenizer, generation config, custom code) copied as it is; a new
   manifest whose ``source`` block records the source's file digests (and, for a kvq
   source, its manifest's content digest, after checking the source against it).

A weight recipe on such a source is refused in one line (:func:`check_carry`): kvq does
not quantize quantized weights again. AWQ and GPTQ have no field for static KV scales
(vLLM reads ``k_scale``/``v_scale`` only with compressed-tensors), so only dynamic schemes
(int8 per token, KIVI; recorded in the manifest) apply to them, as with ``--format awq``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..source.config_check import PACKED_SOURCES, quantization_config, read_config
from ..errors import CheckFailed, InputError
from ..source.lazy import LazyCheckpoint

#: files of the source that the artifact rewrites (config.json) or must not inherit
_NOT_COPIED = ("config.json", "kvq-manifest.json", "model.sig")
#: leaves of a source's KV-cache scale tensors (replaced by the new scheme's)
KV_LEAVES = ("k_scale", "v_scale")
#: what the manifest's ``quantization.algorithm`` says of weights kvq did not touch
CARRIED = "carried"


def packed_method(folder: Path) -> Optional[str]:
    """The ``quant_method`` of a folder whose ``config.json`` declares packed weights
    (compressed-tensors with at least one config group, awq, gptq), else ``None`` (also for
    a file, a folder without a readable config, or a KV-only compressed-tensors config)."""
    try:
        cfg = read_config(Path(folder) / "config.json") if Path(folder).is_dir() else {}
    except InputError:
        return None  # resolve_source names the problem
    qc = quantization_config(cfg)  # a multimodal wrapper's (Kimi K2.5) may sit in its text_config
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in PACKED_SOURCES:
        return None
    if method == "compressed-tensors" and not qc.get("config_groups"):
        return None  # KV-only (format dense): the weights are float
    return method


@dataclass(frozen=True)
class PackedSource:
    """An already-quantized source folder: its config, ``quantization_config`` and, for a
    kvq artifact, its manifest (:class:`compressor.manifest.Manifest`, else ``None``)."""

    folder: Path
    spec: str
    method: str
    config: dict
    manifest: object

    @property
    def qc(self) -> dict:
        """The source's ``quantization_config`` (top level, else its ``text_config``'s)."""
        return quantization_config(self.config)

    @property
    def format(self):
        """The :class:`~compressor.formats.base.WeightFormat` that reads (and names) it."""
        from ..formats import reader_for

        return reader_for(self.method)

    def schemes(self) -> list[dict]:
        """The weight schemes the config declares (:meth:`WeightFormat.declared`)."""
        return self.format.declared(self.qc)

    def describe(self) -> str:
        """e.g. ``compressed-tensors pack-quantized, 4-bit group 32 asymmetric``."""
        parts = []
        for s in self.schemes():
            group = "per channel" if s["group_size"] == -1 else f"group {s['group_size']}"
            parts.append(f"{s['num_bits']}-bit {group}" + ("" if s["symmetric"] is None else
                                                          " symmetric" if s["symmetric"] else " asymmetric"))
        layout = f" {self.qc['format']}" if self.qc.get("format") else ""
        return f"{self.format.name}{layout}, " + (" / ".join(parts) or "no weight scheme declared")

    def declared_dtype(self) -> str:
        """The float dtype its config declares (``dtype``, older ``torch_dtype``), else the
        dtype most of its float bytes are stored in; ``bfloat16`` when neither says."""
        from ..artifact import DTYPES
        from ..source.resolve import ModelSource, source_float_dtype

        for key in ("dtype", "torch_dtype"):
            if self.config.get(key) in DTYPES:
                return self.config[key]
        found = source_float_dtype(ModelSource(self.spec, "hf", self.folder))
        return found if found in DTYPES else "bfloat16"


def find_packed(spec: str) -> Optional[PackedSource]:
    """The :class:`PackedSource` at ``spec``, or ``None`` for a float source (or an alias,
    a GGUF file, a path that does not exist: :func:`compressor.source.resolve.resolve_source` judges those).

    Raises:
        InputError: the folder's ``kvq-manifest.json`` is invalid.
    """
    from ..manifest import MANIFEST_NAME, load_manifest

    folder = Path(spec)
    method = packed_method(folder)
    if method is None:
        return None
    manifest = load_manifest(folder) if (folder / MANIFEST_NAME).is_file() else None
    return PackedSource(folder, spec, method, read_config(folder / "config.json"), manifest)


def check_carry(packed: PackedSource, recipe, opts):
    """Every refusal of a run on a packed source, before anything is loaded; returns the recipe
    the run uses (``kv_cache.key_rotation: auto`` becomes ``none``: the q/k tensors are carried).

    Raises:
        InputError: the recipe quantizes weights (named, with the format and bits of the
            source and the KV recipes to use instead); it has no KV-cache scheme (nothing
            to do); a ``head:`` or ``embedding:`` section; ``--format``/``--dtype`` other than the source's (its tensors are
            carried as they are); a static KV scheme on an AWQ/GPTQ source; a layout kvq
            cannot dequantize; ``--resume`` or several torchrun ranks; ``kv_cache.key_rotation: pairs``.
    """
    from ..artifact import check_readable
    from ..quant.algorithms import get_algorithm

    what = f"{packed.spec} holds weights that are already quantized ({packed.describe()})"
    hint = "pass --recipe kv-fp8 or --recipe kv-int8 (see `kvq recipes`)"
    if get_algorithm(recipe.algorithm).quantizes_weights:
        raise InputError(f"{what}; kvq does not quantize quantized weights again (recipe {recipe.name} asks for "
                         f"{recipe.algorithm.upper()}): to calibrate the KV cache on the weights as they are, {hint}")
    for section in ("head", "embedding"):
        if getattr(recipe, section) is not None:
            raise InputError(f"{what}; its tensors are carried as they are, so the recipe's {section}: section cannot "
                             f"be applied (quantize the {section} from the float model)")
    if recipe.kv_cache is None:
        raise InputError(f"{what} and the recipe has no KV-cache scheme: nothing to do; {hint}")
    w = opts.write
    if w.format not in ("compressed-tensors", packed.format.name):  # the default cannot be told from a choice
        raise InputError(f"--format {w.format}: the artifact keeps the source's {packed.format.name} layout "
                         "(its packed tensors are carried byte for byte, not converted)")
    if w.dtype not in ("auto", packed.declared_dtype()):
        raise InputError(f"--dtype {w.dtype}: the source's float tensors are carried as they are "
                         f"({packed.declared_dtype()}); drop --dtype")
    packed.format.with_kv(packed.qc, recipe.kv_cache.spec())  # a static scheme AWQ/GPTQ cannot declare
    check_readable(packed.folder, packed.qc)
    if opts.execution.resume:
        raise InputError("--resume: a run on an already-quantized source keeps no layers to resume; rerun without it")
    if os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1"):
        raise InputError(f"{packed.spec} is already quantized: its KV-cache calibration runs in one process, not under torchrun")
    if recipe.kv_cache.key_rotation == "pairs":
        raise InputError(f"{what}; its q_proj/k_proj tensors are carried as they are, so kv_cache.key_rotation pairs "
                         "cannot change them: use auto or none")
    if recipe.kv_cache.key_rotation == "auto":
        from ..recipe import with_overrides

        recipe = with_overrides(recipe, **{"kv_cache.key_rotation": "none"})
    return recipe


def carried_key_rotation(packed: PackedSource) -> str:
    """The source's ``kv_cache.key_rotation`` (``pairs`` or ``none``): its q_proj/k_proj
    tensors are carried, so their per-RoPE-pair factors are the new artifact's too and
    ``kvq verify`` must undo them (a source without a kvq manifest: ``none``)."""
    kv = (packed.manifest.kv_cache or {}) if packed.manifest is not None else {}
    return kv.get("key_rotation", "none")


def check_source_integrity(packed: PackedSource) -> None:
    """A kvq source is checked against its own manifest before its weights are carried.

    Raises:
        CheckFailed: a file or tensor differs from the source's ``kvq-manifest.json`` (named).
    """
    from ..integrity import check_hashes

    if packed.manifest is None:
        return
    h = check_hashes(packed.folder)
    if not h["ok"]:
        bad = next(iter(h["modified_tensors"] + h["missing_tensors"] + h["extra_tensors"] + h["modified_files"]
                        + h["missing_files"] + h["extra_files"] + h["unsafe_files"] + h["unreadable_files"]), "?")
        raise CheckFailed(f"source {packed.spec} does not match its kvq-manifest.json ({bad} differs); kvq does not "
                          "carry weights its own manifest disowns (kvq verify --hashes-only names every difference)")


# ---------------------------------------------------------------------------------------
# load


class PackedCheckpoint(LazyCheckpoint):
    """A packed folder read as float: ``<module>.weight`` of a packed linear is built from
    the module's stored leaves by the format's reader and dequantized to the dtype asked for
    (:func:`compressor.formats.read_quant_weight`: the values
    :func:`compressor.artifact.load_artifact` gives); every other tensor reads as stored.

    Raises:
        InputError: (from :meth:`get`) leaves the format's reader refuses, named.
    """

    def __init__(self, packed: PackedSource):
        super().__init__(packed.folder, block_fp8=None)
        self.method, self.qc, fmt = packed.method, packed.qc, packed.format
        self.leaves = fmt.leaves
        suffix = "." + fmt.marker
        self.packed_modules = {n[: -len(suffix)] for n in self.where if n.endswith(suffix)}

    @property
    def dequantizes(self) -> bool:
        """Always: packed linears are read as float weights."""
        return True

    def _packed(self, name: str) -> Optional[str]:
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        return module if module in self.packed_modules else None  # an FP8 module stores its codes as weight

    def activations(self) -> dict[str, tuple]:
        """Packed module -> ``(act, group size)`` of its input's quantization (FP8 W8A8, W4A8; NVFP4 W4A4 adds
        its ``input_global_scale``, float32 ``[1]``), for those whose config group declares one (compressed-tensors
        ``input_activations``; :func:`compressor.quant.fp8_inputs.quantize_input`).

        Raises:
            InputError: an NVFP4 W4A4 module without ``input_global_scale``.
        """
        from ..formats.compressed_tensors import activation_scheme, module_group
        from ..quant.fp4_inputs import ACT

        if self.method != "compressed-tensors":
            return {}
        acts = {m: activation_scheme(module_group(self.qc, m).get("input_activations")) for m in self.packed_modules}
        for m, a in acts.items():
            if a[0] == ACT:  # W4A4: the static input global scale beside the weight
                if f"{m}.input_global_scale" not in self.where:
                    raise InputError(f"{m}: NVFP4 activations (W4A4) need input_global_scale")
                acts[m] = a + (self._read(f"{m}.input_global_scale").float().reshape(1),)
        return {m: a for m, a in acts.items() if a[0]}

    def __contains__(self, name: str) -> bool:
        return name in self.where or self._packed(name) is not None

    def get(self, name: str, dtype):
        """``name`` as ``dtype``; a packed linear's ``weight`` dequantized ``[out, in]``."""
        from ..formats import read_quant_weight

        module = self._packed(name)
        if module is None:
            return super().get(name, dtype)
        t = {leaf: self._read(f"{module}.{leaf}") for leaf in self.leaves if f"{module}.{leaf}" in self.where}
        return read_quant_weight(self.method, self.qc, module, t).dequantize(dtype)


def load_packed(packed: PackedSource, source, stream: bool, spill_dir: Path, budget_gib: float):
    """The float model the KV scales are calibrated on: the source's weights dequantized.

    Args:
        source: ``packed`` resolved (:class:`compressor.source.resolve.ModelSource`).
        stream: read one decoder layer at a time (released after it); ``False`` or a
            layout :func:`compressor.source.open.open_lazy` cannot address: whole.

    Returns:
        ``(model, tokenizer, hooks, loading)``: a float32 model (decoder layers on ``meta``
        when streamed), its tokenizer, the pipeline's :class:`compressor.pipeline.LayerHooks`
        (load / release each layer), and how the weights were read (for the summary).

    Raises:
        InputError: tensors the format's reader refuses, or that do not match the architecture;
            a tokenizer id beyond the embedding.
    """
    from ..arch import get_arch
    from ..artifact import load_artifact
    from ..pipeline import LayerHooks
    from ..source.lazy import layer_names, load_into, to_meta
    from ..source.open import open_lazy
    from ..tokens import check_vocabulary

    budget = int(budget_gib * 2**30)
    if stream:
        lazy = open_lazy(source, ckpt=PackedCheckpoint(packed))
        if lazy[0] is not None:
            model, tokenizer, ckpt = lazy
            check_vocabulary(tokenizer, model.config.vocab_size, f"{packed.folder}: tokenizer")  # as load_artifact
            arch = get_arch(model.config.model_type)
            hooks = LayerHooks(load=lambda i, _layer: load_into(model, ckpt, arch, layer_names(model, arch, i)),
                               done=lambda _i, layer, _result, _hidden: to_meta(layer),
                               activation_budget=budget, spill_dir=spill_dir)
            return model, tokenizer, hooks, "streamed: one decoder layer at a time, packed weights dequantized per tensor"
        loading = f"whole model, packed weights dequantized ({lazy[1]})"
    else:
        loading = "whole model, packed weights dequantized (--no-stream)"
    model, tokenizer = load_artifact(packed.folder)
    return model, tokenizer, LayerHooks(load=lambda i, layer: None, done=lambda i, layer, result, hidden: None,
                                        activation_budget=budget, spill_dir=spill_dir), loading


def uncalibrated(model, spec):
    """The pipeline's result for a dynamic KV scheme (int8 per token, KIVI), which has no
    static scale to calibrate: empty, after the layout check the pipeline would make.

    Raises:
        InputError: a scheme the attention layout cannot hold (per-head scales on MLA).
    """
    from ..arch import get_arch
    from ..pipeline import QuantizeResult
    from ..quant.kv import check_layout

    check_layout(spec, get_arch(model.config.model_type).kv_layout(model.config))
    return QuantizeResult(group_size=None)


# ---------------------------------------------------------------------------------------
# manifest records


def source_record(packed: PackedSource) -> dict:
    """The manifest's ``source`` block: ``spec`` (absolute path: verify's default
    reference), ``kind``, ``files`` (SHA-256 of each safetensors file, what verify compares
    a reference with) and ``carried``: the source's format, the SHA-256 of every file it
    holds, its signature's presence and, for a kvq source, its manifest's content digest."""
    from ..manifest import MANIFEST_NAME, SIGNATURE_NAME
    from ..safetensors_io import file_digest

    digests = {p.name: file_digest(p) for p in sorted(packed.folder.iterdir()) if p.is_file()}
    m = packed.manifest
    return {
        "spec": str(packed.folder.resolve()), "kind": "hf",
        "files": {n: d for n, d in digests.items() if n.endswith(".safetensors")},
        "carried": {
            "format": packed.format.name, "quant_method": packed.method, "digest_algorithm": "sha256",
            "files": digests, "signed": SIGNATURE_NAME in digests,
            "kvq_manifest": None if m is None else {
                "content_digest": m.content_digest(), "file": MANIFEST_NAME, "checked": True,
                "source_spec": m.source.get("spec"), "algorithm": m.quantization.get("algorithm")},
        },
    }


def quantization_record(packed: PackedSource, dtype: str, dtype_reason: str) -> dict:
    """The manifest's ``quantization`` block: the weights are carried (``algorithm``
    :data:`CARRIED`), with the format, bits, group size and symmetry the source declares,
    the number of packed modules and the algorithm that made them (``unknown`` unless the
    source's kvq manifest says)."""
    from ..safetensors_io import read_header

    schemes = packed.schemes()
    base = schemes[0] if schemes else {"num_bits": None, "group_size": None, "symmetric": None}
    marker = "." + packed.format.marker
    modules = sum(1 for s in packed.folder.glob("*.safetensors") for n in read_header(s) if n.endswith(marker))
    rec = {"algorithm": CARRIED, "format": packed.format.name, **base, "modules": modules, "storage_dtype": dtype,
           "storage_dtype_reason": dtype_reason,
           "weights": "carried from the source byte for byte (not re-quantized)",
           "carried_from": str(packed.folder.resolve()),
           "source_algorithm": packed.manifest.quantization.get("algorithm", "unknown") if packed.manifest else "unknown"}
    if len(schemes) > 1:
        rec["schemes"] = schemes
    return rec


# ---------------------------------------------------------------------------------------
# write


def _carried_config(packed: PackedSource, spec) -> dict:
    """The source's ``config.json`` with the KV scheme declared by its format, at the top
    (a wrapper's ``text_config`` keeps no second, stale copy)."""
    cfg = {**packed.config, "quantization_config": packed.format.with_kv(packed.qc, spec)}
    text = cfg.get("text_config")
    if isinstance(text, dict) and "quantization_config" in text:
        cfg["text_config"] = {k: v for k, v in text.items() if k != "quantization_config"}
    return cfg


def _copy_files(packed: PackedSource, tmp: Path, tokenizer, warnings: list[str]) -> None:
    """Every plain file of the source except its weights, index, config, manifest and
    signature, copied as it is (links followed); folders are skipped (an artifact holds
    plain files only), with a warning. A tokenizer that needs the repository's code is
    saved converted too (:func:`compressor.source.resolve.load_tokenizer`), as the float path does."""
    from ..artifact import save_tokenizer

    skipped = []
    for p in sorted(packed.folder.iterdir()):
        if p.is_dir():
            skipped.append(p.name)
        elif p.is_file() and not p.name.endswith((".safetensors", ".safetensors.index.json")) and p.name not in _NOT_COPIED:
            shutil.copyfile(p, tmp / p.name)
    if skipped:
        warnings.append(f"folders of the source not carried (an artifact holds plain files only): {', '.join(skipped)}")
    tcfg = tmp / "tokenizer_config.json"
    auto = json.loads(tcfg.read_text()).get("auto_map") if tcfg.is_file() else None
    if isinstance(auto, dict) and auto.get("AutoTokenizer") or isinstance(auto, list):
        save_tokenizer(tokenizer, tmp)


def write_carried(packed: PackedSource, out: Path, spec, scales: dict, fields: dict, write_opts, tokenizer,
                  provenance: dict, on_committed=None) -> object:
    """Write the artifact ``out`` atomically and return its manifest.

    Args:
        spec: the new KV scheme (:class:`compressor.kv_schemes.KVSpec`).
        scales: ``{checkpoint name: tensor}`` of the KV scale tensors (``[1]`` or
            ``[kv_heads, 1, 1]``, storage dtype); empty for a dynamic scheme. A source's
            own ``k_scale``/``v_scale`` tensors are replaced (a warning in ``fields``' quality says so).
        fields: the manifest's fields (``tool``, ``source``, ``recipe``, ``calibration``,
            ``quantization``, ``quality``, ``kv_cache``, ``format``).
        write_opts: :class:`compressor.commands.options.WriteOptions` (overwrite, shard
            size, digest, signing).

    Raises:
        InputError: the output cannot be written, a source shard's header is bad.
    """
    from safetensors.torch import save_file

    from ..artifact import check_output, new_temp_folder, place_folder, seal_folder
    from ..safetensors_io import read_header, write_shards
    from ..signing import sign_folder

    check_output(out, write_opts.overwrite)
    shards = sorted(packed.folder.glob("*.safetensors"))
    old_scales = {s: {n for n in read_header(s) if n.rpartition(".")[2] in KV_LEAVES} for s in shards}
    if any(old_scales.values()):
        fields["quality"]["warnings"].append(f"the source's {sum(map(len, old_scales.values()))} KV-cache scale tensors were replaced by "
                                             f"the {spec.describe()} scheme's")
    tmp = new_temp_folder(out)
    try:
        parts = list(shards)
        if scales:
            parts.append(tmp / "kv-scales.part")
            save_file({n: t.contiguous() for n, t in scales.items()}, str(parts[-1]), metadata={"format": "pt"})
        write_shards(parts, tmp, write_opts.shard_bytes, skip=old_scales)
        if scales:
            parts[-1].unlink()
        (tmp / "config.json").write_text(json.dumps(_carried_config(packed, spec), indent=2, sort_keys=True) + "\n")
        _copy_files(packed, tmp, tokenizer, fields["quality"]["warnings"])
        finalize = (lambda d: sign_folder(d, write_opts.sign)) if write_opts.sign is not None else None
        manifest = seal_folder(tmp, fields, provenance, write_opts.digest_algorithm, finalize)
        place_folder(tmp, out, on_committed)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
