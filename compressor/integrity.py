"""Artifact integrity without torch: manifest digests, signature checks.

Everything ``kvq verify --hashes-only`` and ``kvq sign`` (:mod:`compressor.commands.sign`) need lives here and imports
neither torch nor transformers, so those commands start in about a second.
"""

from __future__ import annotations

import os
import platform
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from .console import capped_list, capped_names
from .console import warnings as show_warnings
from .errors import CheckFailed, InputError
from .manifest import MANIFEST_NAME, SIGNATURE_NAME, FileRecord, Manifest, TensorRecord, load_manifest
from .safetensors_io import FolderDigests, digest_files, file_digest
from .signing import VerifyKeys, verify_signature


def build_manifest(folder: Path, fields: dict, extra_provenance: dict | None = None,
                   digest_algorithm: str = "sha256") -> Manifest:
    """Hash every file and every tensor of ``folder`` (one pass, both cores) and assemble the manifest.

    ``extra_provenance`` (timings, device) joins the creation time in the ``provenance``
    block, the only part outside the content digest.

    Raises:
        InputError: a safetensors file with a bad header; unknown ``digest_algorithm``.
    """
    names = sorted(f.name for f in folder.iterdir() if f.name not in (MANIFEST_NAME, SIGNATURE_NAME) and f.is_file())
    d = digest_files(folder, names, digest_algorithm)
    if d.errors:
        raise InputError(next(iter(d.errors.values())))
    files = {n: FileRecord(size=size, digest=digest, covers=covers) for n, (size, digest, covers) in d.files.items()}
    tensors = {n: TensorRecord(file=f, dtype=e.dtype, shape=list(e.shape), digest=digest)
               for n, (f, e, digest) in sorted(d.tensors.items())}
    provenance = {"created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
                  **(extra_provenance or {})}
    return Manifest(files=files, tensors=tensors, provenance=provenance, digest_algorithm=digest_algorithm, **fields)


def scan_artifact_folder(folder: Path) -> tuple[set[str], list[str]]:
    """Sort the entries of ``folder`` into plain files and unsafe ones.

    Returns ``(present, unsafe)``: the names of the plain files other than the manifest
    and the signature, and one ``"name: reason"`` line per symlink, folder or special file
    (a manifest or signature that is not a regular file included). Links are never followed.
    """
    present, unsafe = set(), []
    for p in folder.iterdir():
        if p.name in (MANIFEST_NAME, SIGNATURE_NAME):
            if p.is_symlink() or not p.is_file():
                unsafe.append(f"{p.name}: not a regular file")
            continue
        if p.is_symlink():
            target = os.readlink(p)
            where = "outside" if not (folder / target).resolve().is_relative_to(folder.resolve()) else "inside"
            unsafe.append(f"{p.name}: symlink to {target} ({where} the artifact; kvq does not follow links)")
        elif not p.is_file():
            unsafe.append(f"{p.name}: {'folder' if p.is_dir() else 'special file'} (an artifact holds plain files only)")
        else:
            present.add(p.name)
    return present, unsafe


def _modified_files(folder: Path, manifest: Manifest, d: FolderDigests, names: list[str]) -> list[str]:
    """The files among ``names`` (listed and present) whose size or digest differ from the manifest.

    A safetensors file recorded by its header that no longer parses is modified; a file
    recorded whole (v1 manifest, or a file kvq could not parse then) but now hashed by
    header is rehashed whole.
    """
    algo = manifest.digest_algorithm
    modified = []
    for name in names:
        rec = manifest.files[name]
        size, digest, covers = d.files[name]
        if name in d.errors and rec.covers == "header":
            modified.append(name)
        elif size != rec.size or (covers == rec.covers and digest != rec.digest):
            modified.append(name)
        elif covers != rec.covers:  # recorded whole (v1 manifest, or a file kvq could not parse then)
            if file_digest(folder / name, algo) != rec.digest:
                modified.append(name)
    return modified


def _renamed_files(folder: Path, manifest: Manifest, d: FolderDigests, missing: list[str],
                   extra: list[str]) -> dict[str, str]:
    """``{old: new}``: a missing file whose size and digest turn up under an extra name (each claimed once)."""
    algo = manifest.digest_algorithm
    renamed: dict[str, str] = {}
    for old in list(missing):
        rec = manifest.files[old]
        for new in extra:
            if new in renamed.values() or new not in d.files:
                continue
            size, digest, covers = d.files[new]
            if rec.covers != covers and rec.covers == "file":
                digest = file_digest(folder / new, algo)
            if size == rec.size and digest == rec.digest:
                renamed[old] = new
                break
    return renamed


def _tensor_differences(manifest: Manifest, d: FolderDigests,
                        shard_of: dict[str, str]) -> tuple[set[str], list[str], list[str]]:
    """Compare every hashed tensor with its manifest record.

    ``shard_of`` maps a renamed file's new name to its recorded one. Returns ``(seen,
    modified, extra)``: the names hashed, those whose bytes, file, or header dtype or shape
    differ (in hashing order), and those the manifest does not list.
    """
    seen, modified, extra = set(), [], []
    for tname, (shard, entry, digest) in d.tensors.items():
        seen.add(tname)
        rec = manifest.tensors.get(tname)
        if rec is None:
            extra.append(tname)
        elif (rec.file != shard_of.get(shard, shard) or rec.digest != digest or rec.dtype != entry.dtype
              or tuple(rec.shape) != tuple(entry.shape)):  # a header edit of dtype or shape names the tensor
            modified.append(tname)
    return seen, modified, extra


def _renamed_tensors(manifest: Manifest, d: FolderDigests, missing: list[str], unclaimed: list[str],
                     shard_of: dict[str, str]) -> dict[str, str]:
    """``{old: new}``: a missing tensor whose file, dtype, shape and digest turn up under an extra name.

    Claimed names are removed from ``unclaimed`` (sorted, modified in place).
    """
    renamed: dict[str, str] = {}
    for old in missing:
        rec = manifest.tensors[old]
        for new in unclaimed:
            shard, entry, digest = d.tensors[new]
            if (shard_of.get(shard, shard) == rec.file and digest == rec.digest and entry.dtype == rec.dtype
                    and tuple(entry.shape) == tuple(rec.shape)):
                renamed[old] = new
                unclaimed.remove(new)
                break
    return renamed


def _compare_tensors(report: dict, manifest: Manifest, d: FolderDigests, shard_of: dict[str, str],
                     listed: set[str]) -> int:
    """Fill the ``*_tensors`` lists of ``report`` (and the files holding modified tensors); the number of tensors seen."""
    seen, modified, extra_tensors = _tensor_differences(manifest, d, shard_of)
    report["modified_tensors"].extend(modified)
    # a file holding a modified tensor is a modified file too
    for tname in report["modified_tensors"]:
        shard = d.tensors[tname][0]
        if shard in listed and shard not in report["modified_files"]:
            report["modified_files"].append(shard)
    # tensors of a file that could not be parsed are reported through that file, not one by one
    unparsed = {n for n in d.errors}
    missing_tensors = sorted(t for t in set(manifest.tensors) - seen if manifest.tensors[t].file not in unparsed)
    # renamed in the header: a missing tensor whose file, dtype, shape and digest turn up under an extra name
    unclaimed = sorted(extra_tensors)
    renamed_tensors = _renamed_tensors(manifest, d, missing_tensors, unclaimed, shard_of)
    report["renamed_tensors"] = [f"{o} -> {n}" for o, n in sorted(renamed_tensors.items())]
    report["missing_tensors"] = [t for t in missing_tensors if t not in renamed_tensors]
    report["extra_tensors"] = unclaimed
    return len(seen)


#: a decoder layer's index in a tensor name (``model.layers.3.``, ``language_model.model.layers.3.``)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def listing_problem(manifest: Manifest) -> str | None:
    """Why ``manifest``'s lists cannot describe a model (no ``config.json``, no ``.safetensors``
    weight file, no tensor), else ``None``: a manifest that lists nothing proves nothing."""
    if "config.json" not in manifest.files:
        return "its manifest does not list config.json"
    if not any(name.endswith(".safetensors") for name in manifest.files):
        return "its manifest lists no weight file (.safetensors)"
    if not manifest.tensors:
        return "its manifest lists no tensor"
    return None


def coverage_problem(folder: Path, manifest: Manifest) -> str | None:
    """Why ``manifest`` does not cover what ``folder`` needs to be a model, else ``None``:
    :func:`listing_problem`, then, from the (already checked) ``config.json``, an embedding
    (``embed_tokens``) and at least one tensor of each of its ``num_hidden_layers`` decoder
    layers. Reads only ``config.json``; no torch."""
    from .source.config_check import read_config, text_config

    problem = listing_problem(manifest)
    if problem is not None:
        return problem
    try:
        n = text_config(read_config(folder / "config.json")).get("num_hidden_layers")
    except InputError as e:
        return str(e)
    if not any("embed_tokens." in t for t in manifest.tensors):
        return "its manifest lists no embedding (embed_tokens)"
    if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 100_000:
        stored = {int(m.group(1)) for t in manifest.tensors if (m := _LAYER_INDEX.search(t))}
        missing = [i for i in range(n) if i not in stored]
        if missing:
            return (f"its manifest lists no tensor of decoder layer {missing[0]} ({len(missing)} of the "
                    f"num_hidden_layers = {n} config.json declares)")
    return None


def refuse_uncovered(folder: Path, manifest: Manifest, doing: str, listing_only: bool = False) -> None:
    """Raise :class:`CheckFailed` when ``manifest`` does not cover a model (:func:`coverage_problem`;
    ``listing_only``: :func:`listing_problem`, before ``config.json`` is checked). ``doing``
    ends the line (``refusing to sign it``)."""
    problem = listing_problem(manifest) if listing_only else coverage_problem(folder, manifest)
    if problem is not None:
        raise CheckFailed(f"{folder} is not a complete artifact: {problem}; {doing}")


def check_hashes(folder: str | Path, workers: int | None = None) -> dict:
    """Recompute every file and tensor digest and compare them with the manifest.

    Every byte of the artifact is hashed once (safetensors: header plus each tensor's
    range; other files whole), on all cores. Returns :func:`compare_with_manifest`'s
    report. Like model-signing, it names every difference rather than stopping at the
    first. The runtime's loader computes the same digests from the bytes it loads instead
    (:mod:`compressor.load_integrity`) and compares them with the same function.

    Raises:
        InputError: no manifest, or an invalid one (see :func:`load_manifest`).
    """
    folder = Path(folder)
    manifest = load_manifest(folder)
    present, unsafe = scan_artifact_folder(folder)
    d = digest_files(folder, sorted(present), manifest.digest_algorithm, workers)
    return compare_with_manifest(folder, manifest, present, unsafe, d)


def compare_with_manifest(folder: Path, manifest: Manifest, present: set[str], unsafe: list[str],
                          d: FolderDigests) -> dict:
    """Compare digests ``d`` of the plain files ``present`` of ``folder`` with ``manifest``.

    ``present`` and ``unsafe`` come from :func:`scan_artifact_folder`; ``d`` holds a
    digest of every file of ``present`` and of every tensor of its parseable safetensors
    files, however they were read (:func:`digest_files` by :func:`check_hashes`, or the
    runtime loader from the bytes it loads).

    Returns a dict with ``ok`` and the sorted lists ``modified_tensors`` (bytes, file, or
    the header's dtype or shape differ from the manifest), ``missing_tensors``,
    ``extra_tensors``, ``renamed_tensors`` (``"old -> new"``: a missing tensor whose
    file, dtype, shape and digest reappear under another name in the header),
    ``modified_files``, ``missing_files``, ``extra_files``, ``renamed_files`` (``"old ->
    new"``: a missing file whose size and digest reappear under another name),
    ``unsafe_files`` (symlinks, folders, special files: kvq never writes them and never
    follows them) and ``unreadable_files`` (safetensors files whose header no longer
    parses), plus counts, ``bytes_hashed``, ``seconds`` and ``mb_per_s`` (10^6 bytes per
    second).

    Steps: file comparison (:func:`_modified_files`, :func:`_renamed_files`), tensor
    comparison (:func:`_compare_tensors`).
    """
    algo = manifest.digest_algorithm
    unsafe_names = {u.split(":", 1)[0] for u in unsafe}
    listed = set(manifest.files)
    extra = sorted(present - listed)
    report = {"digest_algorithm": algo, "missing_files": sorted(listed - present - unsafe_names), "extra_files": [],
              "renamed_files": [], "modified_files": [], "modified_tensors": [], "missing_tensors": [],
              "extra_tensors": [], "renamed_tensors": [], "unsafe_files": sorted(unsafe),
              "unreadable_files": sorted(f"{n}: {e}" for n, e in d.errors.items())}
    report["modified_files"].extend(_modified_files(folder, manifest, d, sorted(listed & present)))
    # renames: a missing file whose size and digest turn up under an extra name
    renamed = _renamed_files(folder, manifest, d, report["missing_files"], extra)
    report["renamed_files"] = [f"{o} -> {n}" for o, n in sorted(renamed.items())]
    report["missing_files"] = [n for n in report["missing_files"] if n not in renamed]
    report["extra_files"] = [n for n in extra if n not in renamed.values()]
    shard_of = {v: k for k, v in renamed.items()}
    tensors_checked = _compare_tensors(report, manifest, d, shard_of, listed)
    for k in list(report):
        if isinstance(report[k], list):
            report[k] = sorted(report[k])
    report["ok"] = not any(v for k, v in report.items() if isinstance(v, list))
    report["tensors_checked"] = tensors_checked
    report["files_checked"] = len(listed & present)
    report["bytes_hashed"] = d.bytes_hashed
    report["seconds"] = round(d.seconds, 4)
    report["mb_per_s"] = round(d.bytes_hashed / 1e6 / max(d.seconds, 1e-9), 1)
    return report


HASH_KEYS = ("unsafe_files", "unreadable_files", "modified_tensors", "missing_tensors", "extra_tensors",
             "renamed_tensors", "modified_files", "missing_files", "extra_files", "renamed_files")


def describe_differences(hashes: dict, limit: int = 6) -> str:
    """:func:`check_hashes`' differences on one line: ``modified tensor a, extra file b (+3 more)``."""
    items = [f"{key.replace('_', ' ')[:-1]} {name}" for key in HASH_KEYS for name in hashes[key]]
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def hashes_summary(hashes: dict) -> str:
    """``N tensors, M files match the manifest (sha256, X MB in S s, R MB/s)`` for a passed :func:`check_hashes`."""
    return (f"{hashes['tensors_checked']} tensors, {hashes['files_checked']} files match the manifest "
            f"({hashes['digest_algorithm']}, {hashes['bytes_hashed'] / 1e6:.0f} MB in {hashes['seconds']:.2f} s, "
            f"{hashes['mb_per_s']:.0f} MB/s)")


def print_hashes(console, hashes: dict) -> None:
    """Print :func:`check_hashes`' result: one summary line, or one line per difference (at
    most :data:`compressor.console.LIST_LIMIT` of each kind, then how many more) and a
    verdict line counting them."""
    if hashes["ok"]:
        console.print(f"[green]hashes ok[/]: {hashes_summary(hashes)}", highlight=False)
        return
    for key in HASH_KEYS:  # at most LIST_LIMIT lines of each kind, then a count
        capped_list(console, key.replace("_", " ")[:-1], hashes[key])
    counts = ", ".join(f"{len(hashes[k])} {k.replace('_', ' ')[:-1] if len(hashes[k]) == 1 else k.replace('_', ' ')}"
                       for k in HASH_KEYS if hashes[k])
    console.print(f"[red]hashes FAILED[/]: the artifact does not match its manifest ({counts})", highlight=False)


def check_signature(folder: Path, keys: Optional[VerifyKeys], console=None) -> dict:
    """Signature step of verify: checked when key material is given; otherwise only noted.

    Returns ``{"present", "checked", "ok" (True/False, or None when unchecked), ...}``.
    """
    present = (folder / SIGNATURE_NAME).exists() or (folder / SIGNATURE_NAME).is_symlink()
    if keys is None or not keys.given():
        sig = {"present": present, "checked": False, "ok": None}
        if console and present:
            console.print(f"[yellow]signature present but not checked[/]: pass --public-key, --certificate-chain or "
                          f"--identity/--issuer to check {SIGNATURE_NAME}", highlight=False)
        elif console:  # not a failure (nothing was asked to be checked), but say it: nobody vouches for these files
            console.print(f"[yellow]note:[/] no signature ({SIGNATURE_NAME} is missing): who made this artifact is not "
                          "checked; sign it with `kvq sign`, then verify with --public-key", highlight=False)
        return sig
    sig = {"present": present, **verify_signature(folder, keys)}
    if console:
        if sig["ok"]:
            console.print(f"[green]signature ok[/] ({sig['method']}): {SIGNATURE_NAME} verifies over every file", highlight=False)
        else:
            console.print(f"[red]signature FAILED[/]: {sig['error']}", highlight=False)
            capped_list(console, "  signed files differ", [capped_names(d) for d in sig["differences"]])
    return sig


def check_artifact_folder(folder) -> Path:
    """``folder`` as the Path every later step uses: an existing folder, or :class:`InputError`
    (a file is named as such).

    A symlink given as the artifact path (``kvq verify link``, ``link/``) is resolved here,
    once, to the folder it names: model_signing refuses a symlinked model path, so checking
    or signing through the link would call a valid signature failed. Links *inside* the
    artifact stay refused (:func:`check_hashes`).
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder} is not a folder (an artifact is the folder `kvq quantize -o` wrote)")
    if not folder.is_dir():
        raise InputError(f"artifact folder {folder} not found")
    return folder.resolve() if folder.is_symlink() else folder


def verify_integrity(folder: Path, keys: Optional[VerifyKeys], console=None, print_warnings: bool = False) -> dict:
    """``kvq verify --hashes-only``: signature (when keys are given) and digests; the report
    dict (its warnings also on ``console`` with ``print_warnings``: full verify prints them
    with its table).

    Raises:
        InputError: not an artifact folder, invalid manifest, bad key files.
        CheckFailed: the manifest does not cover a model (:func:`coverage_problem`).
    """
    t0 = time.perf_counter()
    folder = check_artifact_folder(folder)
    manifest = load_manifest(folder)
    refuse_uncovered(folder, manifest, "nothing it lists would prove anything", listing_only=True)
    signature = check_signature(folder, keys, console)
    hashes = check_hashes(folder)
    if hashes["ok"]:  # config.json is the checked one now
        refuse_uncovered(folder, manifest, "nothing it lists would prove anything")
    if console:
        print_hashes(console, hashes)
    ok = hashes["ok"] and signature["ok"] is not False
    report = {"schema_version": "kvq.verify-report/1", "artifact": str(folder), "mode": "hashes-only",
              "signature": signature, "hashes": hashes, "gates": [], "failed_gates": [], "warnings": [],
              "passed": ok, "seconds": round(time.perf_counter() - t0, 2)}
    _carried(manifest, report)
    if console and print_warnings:
        show_warnings(console, report["warnings"])
    return report


def _carried(manifest, report: dict) -> None:
    """A multimodal wrapper's tensors carried untouched (Kimi K2.5's vision tower and
    projector, the manifest's ``quality.carried``): the digests are all kvq checks of them
    (verify's statistics compare the text model); the report says so."""
    rec = manifest.quality.get("carried")
    if isinstance(rec, dict) and rec.get("tensors"):
        report["carried"] = {**rec, "checked": "digest only"}
        report["warnings"].append(f"{rec.get('what')} ({rec['tensors']} tensors carried untouched from the source): "
                                  "checked by digest only; the statistics compare the text model")


def foreign_integrity(folder: Path, keys: Optional[VerifyKeys], console=None) -> dict:
    """Integrity step of ``kvq verify --no-manifest``: the signature when keys are given
    (OpenSSF model_signing needs no kvq manifest); digests cannot be checked.

    Raises:
        InputError: not an artifact folder, bad key files.
    """
    t0 = time.perf_counter()
    folder = check_artifact_folder(folder)
    signature = check_signature(folder, keys, console)
    hashes = {"ok": True, "checked": False, "tensors_checked": 0, "files_checked": 0,
              "note": "no kvq manifest (--no-manifest): digests not checked"}
    if console:
        console.print("[yellow]no kvq manifest[/]: file and tensor digests not checked (--no-manifest)", highlight=False)
    return {"schema_version": "kvq.verify-report/1", "artifact": str(folder), "mode": "hashes-only",
            "signature": signature, "hashes": hashes, "gates": [], "failed_gates": [], "warnings": [],
            "passed": signature["ok"] is not False, "seconds": round(time.perf_counter() - t0, 2)}

