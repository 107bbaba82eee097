"""Integrity at load: every byte the runtime serves is read once, hashed, and served from that read.

``kvq serve`` and ``kvq serve-smoke`` read an artifact only through :class:`ArtifactReader`:

1. **open**: the folder's entries against the manifest's file list (an extra, missing or
   unsafe entry is refused before anything is parsed); every other file (``config.json``,
   tokenizer files, ...) is read once, hashed, compared with its record and written into a
   private snapshot folder, from which transformers reads the config and the tokenizer;
   every safetensors header is read once, hashed, compared and parsed from those same
   bytes, and its file stays open.
2. **load**: each tensor's byte range is read once, through the open file, into the buffer
   the runtime builds the tensor on (:meth:`ArtifactReader.read_into`), hashed and
   compared with the tensor's record before the loader sees it.
3. **finish** (:meth:`ArtifactReader.finish`): the tensors the runtime did not use are
   read and hashed too, and all digests are compared with the manifest by the function
   ``kvq verify`` uses (:func:`compressor.integrity.compare_with_manifest`).

Digests are the manifest's (:mod:`compressor.manifest`): a safetensors file's covers its
length prefix and JSON header, each tensor's its stored bytes, any other file's all of it
(:func:`compressor.safetensors_io.digest_bytes`, the same bytes :func:`~compressor.
safetensors_io.digest_files` hashes from disk). A file replaced (renamed over) once open
has no effect: the open file is read. A file overwritten in place is read as it is when
each tensor is read, so a change is a digest mismatch. On the first difference nothing
more is built: the rest of the artifact is hashed and :class:`ArtifactMismatch` names
every difference, as ``kvq verify --hashes-only`` would. A version-1 manifest records
whole-file digests of safetensors files; those files are hashed again, whole, at finish.

Without a manifest (``--no-manifest``, or the library reading a plain model folder) the
reader only parses headers and reads tensors: nothing is hashed. No torch import here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from .errors import CheckFailed, InputError
from .integrity import (check_artifact_folder, check_signature, compare_with_manifest, describe_differences, refuse_uncovered,
                        scan_artifact_folder)
from .manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, parse_manifest
from .safetensors_io import (FolderDigests, TensorEntry, digest_bytes, digest_files, new_hasher, parse_header,
                             read_header_span)

#: test hook: ``AFTER_READ(file, tensor)`` runs after each piece is read (and hashed, when
#: checking), before anything is built from it; ``tensor`` is None for a whole file or a
#: safetensors header. Tests use it to change the artifact on disk in the middle of a load.
AFTER_READ: Optional[Callable[[str, Optional[str]], None]] = None

_CHUNK = 1 << 24  # 16 MiB reads when hashing without keeping the bytes


class ArtifactMismatch(CheckFailed):
    """The artifact differs from its manifest (exit 1).

    ``report`` is :func:`compressor.integrity.compare_with_manifest`'s dict, built from
    the bytes the load read; the message names the differences on one line.
    """

    def __init__(self, folder: Path, report: dict):
        self.report = report
        what = describe_differences(report) or "it changed while it was read"
        super().__init__(f"{folder} does not match its manifest: {what}")


class SignatureFailed(CheckFailed):
    """``model.sig`` did not verify, or the manifest read is not the one it signed (exit 1);
    ``signature`` is :func:`compressor.integrity.check_signature`'s dict."""

    def __init__(self, signature: dict):
        self.signature = signature
        diffs = "; ".join(signature.get("differences") or [])
        super().__init__(f"signature FAILED: {signature['error']}" + (f" ({diffs})" if diffs else ""))


def open_for_serving(folder: str | Path, keys=None, no_manifest: bool = False,
                     note: Callable[[str], None] = lambda line: None) -> tuple["ArtifactReader", dict]:
    """The integrity steps of ``kvq serve`` and ``kvq serve-smoke`` before the runtime loads.

    1. The manifest is read once (its bytes are the ones parsed).
    2. With key material (:class:`~compressor.signing.VerifyKeys`), ``model.sig`` is
       checked first, and the manifest's SHA-256 must be the one the verified statement
       lists, so the digests the load compares with are the signed ones.
    3. An :class:`ArtifactReader` checking against that manifest is opened (the file list,
       the small files and every safetensors header are checked now, each tensor as the
       runtime loads it). ``no_manifest``: an unchecking reader; ``note`` receives one line
       saying that nothing (or only the signature) was checked.

    Returns ``(reader, signature)``: the open reader (the caller closes it) and the
    signature dict (``checked`` False without key material).

    Raises:
        InputError: not a folder; no manifest without ``no_manifest``, or one with it; an
            invalid manifest; unreadable key files.
        CheckFailed: a manifest that lists no config.json, weight file or tensor.
        SignatureFailed: the signature does not verify, or the manifest is not the signed one.
        ArtifactMismatch: the folder's files, small files or headers differ from the manifest.
    """
    folder = check_artifact_folder(folder)
    path = folder / MANIFEST_NAME
    has_manifest = path.exists() or path.is_symlink()
    if no_manifest and has_manifest:
        raise InputError(f"{folder} has a {MANIFEST_NAME}: drop --no-manifest (its digests would go unchecked)")
    if not no_manifest and not has_manifest:
        raise InputError(f"{folder} has no {MANIFEST_NAME}: not a kvq artifact (another tool's artifact: pass --no-manifest)")
    manifest, raw = None, None
    if not no_manifest:
        if path.is_symlink() or not path.is_file():
            raise CheckFailed(f"{path}: not a regular file (kvq does not follow links)")
        raw = path.read_bytes()
        manifest = parse_manifest(raw, path)
        refuse_uncovered(folder, manifest, "nothing it lists would prove anything", listing_only=True)
    sig = check_signature(folder, keys)
    if sig["checked"] and not sig["ok"]:
        raise SignatureFailed(sig)
    if sig["checked"]:
        if raw is not None and sig["signed_files"].get(MANIFEST_NAME) != digest_bytes(raw, "sha256"):
            raise SignatureFailed({**sig, "ok": False, "error": f"{MANIFEST_NAME} is not the file {SIGNATURE_NAME} "
                                   "signed (it changed while the signature was checked)"})
        note(f"signature ok ({sig['method']}): {SIGNATURE_NAME} verifies over every file")
    elif sig["present"]:
        note(f"signature present but not checked: pass --public-key, --certificate-chain or --identity/--issuer "
             f"to check {SIGNATURE_NAME}")
    if no_manifest:
        note("no kvq manifest (--no-manifest): " + ("file and tensor digests not checked; only the signature was"
                                                    if sig["checked"] else "nothing was checked"))
    return ArtifactReader(folder, manifest), sig


def _pread_into(f, view: memoryview, offset: int) -> int:
    """Fill ``view`` from the open file ``f`` at ``offset``; the number of bytes read (short at end of file)."""
    done, n = 0, view.nbytes
    while done < n:
        got = os.preadv(f.fileno(), [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


class ArtifactReader:
    """One read of an artifact folder (see the module docstring).

    Args:
        folder: the artifact folder.
        manifest: its manifest; None reads without checking (no hashing, no snapshot).

    Attributes:
        entries: shard file name -> {tensor name -> :class:`TensorEntry`}.
        where: tensor name -> shard file name.
        report: the comparison report once :meth:`finish` ran (or a mismatch was found).

    Raises:
        InputError: unreadable files, a safetensors header that does not parse (unchecked
            mode), no safetensors file, a tensor stored in two files.
        ArtifactMismatch: with a manifest, any difference found while opening.
    """

    def __init__(self, folder: str | Path, manifest: Manifest | None = None):
        self.folder = Path(folder)
        self.manifest = manifest
        self.entries: dict[str, dict[str, TensorEntry]] = {}
        self.where: dict[str, str] = {}
        self.report: dict | None = None
        self._handles: dict[str, object] = {}
        self._files: dict[str, tuple[int, str, str]] = {}  # as FolderDigests.files
        self._tensors: dict[str, tuple[str, TensorEntry, str]] = {}
        self._errors: dict[str, str] = {}
        self._present: set[str] = set()
        self._unsafe: list[str] = []
        self._bytes = 0
        self._seconds = 0.0
        self._snapshot: Path | None = None
        try:
            self._open_checked() if manifest is not None else self._open_unchecked()
        except BaseException:
            self.close()
            raise

    # -- public -------------------------------------------------------------------------
    @property
    def checking(self) -> bool:
        """Whether digests are computed and compared (a manifest was given)."""
        return self.manifest is not None

    @property
    def files_folder(self) -> Path:
        """Where to read ``config.json`` and the tokenizer: the checked snapshot, else the folder itself."""
        return self._snapshot or self.folder

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def entry(self, name: str) -> TensorEntry:
        """The header entry of tensor ``name`` (dtype, shape, byte range).

        Raises:
            InputError: no shard stores ``name``.
        """
        shard = self.where.get(name)
        if shard is None:
            raise InputError(f"{self.folder}: tensor {name} is missing")
        return self.entries[shard][name]

    def read_into(self, name: str, buf) -> None:
        """Read tensor ``name``'s stored bytes into the writable buffer ``buf`` (exactly its
        ``end - start`` bytes), hash them and compare them with the manifest.

        Raises:
            InputError: unknown tensor; a short read without a manifest (truncated file).
            ValueError: ``buf`` has the wrong size.
            ArtifactMismatch: the bytes, file, dtype or shape differ from the tensor's record,
                or the manifest does not list it.
        """
        e = self.entry(name)
        shard = self.where[name]
        view = memoryview(buf).cast("B")
        if view.nbytes != e.end - e.start:
            raise ValueError(f"buffer of {view.nbytes} bytes for tensor {name} of {e.end - e.start}")
        t0 = time.perf_counter()
        got = _pread_into(self._handles[shard], view, e.start)
        if self.manifest is None:
            if got != view.nbytes:
                raise InputError(f"{self.folder / shard}: truncated while reading tensor {name}")
            self._hook(shard, name)
            return
        digest = digest_bytes(view[:got], self.manifest.digest_algorithm)
        self._count(got, t0)
        self._tensors[name] = (shard, e, digest)
        self._hook(shard, name)
        rec = self.manifest.tensors.get(name)
        if rec is None or (rec.file, rec.dtype, tuple(rec.shape), rec.digest) != (shard, e.dtype, e.shape, digest):
            self._fail()

    def finish(self) -> dict | None:
        """Hash the tensors not read yet and compare everything with the manifest.

        Returns the report (see :func:`~compressor.integrity.compare_with_manifest`), or
        None without a manifest.

        Raises:
            ArtifactMismatch: any difference.
        """
        if self.manifest is None:
            return None
        for name, (shard, e) in self._unread().items():
            digest = self._hash_range(shard, e.start, e.end)
            self._tensors[name] = (shard, e, digest)
            rec = self.manifest.tensors.get(name)
            if rec is None or (rec.file, rec.dtype, tuple(rec.shape), rec.digest) != (shard, e.dtype, e.shape, digest):
                self._fail()
        report = compare_with_manifest(self.folder, self.manifest, self._present, self._unsafe, self._digests())
        self.report = report
        if not report["ok"]:
            raise ArtifactMismatch(self.folder, report)
        return report

    def close(self) -> None:
        """Close every file and remove the snapshot folder (idempotent)."""
        for f in self._handles.values():
            f.close()
        self._handles.clear()
        if self._snapshot is not None:
            shutil.rmtree(self._snapshot, ignore_errors=True)
            self._snapshot = None

    def __enter__(self) -> "ArtifactReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- open ---------------------------------------------------------------------------
    def _open_unchecked(self) -> None:
        shards = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not shards:
            raise InputError(f"{self.folder} has no .safetensors file")
        for name in shards:
            self._open_shard(name)

    def _open_checked(self) -> None:
        self._present, self._unsafe = scan_artifact_folder(self.folder)
        if self._unsafe or self._present != set(self.manifest.files):
            self._fail()  # an extra, missing or unsafe entry: refused before anything is parsed
        self._snapshot = Path(tempfile.mkdtemp(prefix="kvq-load-"))
        for name in sorted(self._present):
            if name.endswith(".safetensors"):
                self._open_shard(name)
            else:
                self._copy_checked(name)
        if not self.entries:
            raise InputError(f"{self.folder} has no .safetensors file")

    def _open_file(self, name: str):
        path = self.folder / name
        try:
            f = open(path, "rb")
        except OSError as e:
            raise InputError(f"cannot read {path}: {e.strerror}") from None
        self._handles[name] = f
        return f, os.fstat(f.fileno()).st_size

    def _open_shard(self, name: str) -> None:
        """Read, hash and parse one safetensors header; the file stays open for its tensors."""
        path = self.folder / name
        f, size = self._open_file(name)
        t0 = time.perf_counter()
        try:
            span = read_header_span(f, size, path)
            entries = parse_header(span, size, path)
        except (InputError, OSError) as e:
            if self.manifest is None:
                raise InputError(str(e) if isinstance(e, InputError) else f"cannot read {path}: {e.strerror}") from None
            self._errors[name] = str(e)  # as digest_files does: hashed whole, reported as unreadable
            self._files[name] = (size, self._hash_range(name, 0, size), "file")
            self._fail()
        if self.manifest is not None:
            self._files[name] = (size, digest_bytes(span, self.manifest.digest_algorithm), "header")
            self._count(len(span), t0)
        self._hook(name, None)
        for tname in entries:
            if tname in self.where:
                raise InputError(f"{self.folder}: tensor {tname} is stored in both {self.where[tname]} and {name}")
            self.where[tname] = name
        self.entries[name] = entries  # recorded first: a refusal below hashes these tensors too, naming the changed ones
        if self.manifest is not None:
            rec = self.manifest.files[name]
            if rec.covers == "header" and (rec.size, rec.digest) != self._files[name][:2]:
                self._fail()  # (a version-1 record covers the whole file: compared at finish)

    def _copy_checked(self, name: str) -> None:
        """Read, hash and compare a file that is not safetensors, writing the same bytes into the snapshot."""
        f, _size = self._open_file(name)
        t0 = time.perf_counter()
        h = new_hasher(self.manifest.digest_algorithm)
        n = 0
        with open(self._snapshot / name, "wb") as out:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
                out.write(chunk)
                n += len(chunk)
        self._handles.pop(name).close()
        self._files[name] = (n, h.hexdigest(), "file")
        self._count(n, t0)
        self._hook(name, None)
        rec = self.manifest.files[name]
        if (rec.size, rec.digest, rec.covers) != self._files[name]:
            self._fail()

    # -- hashing and failure --------------------------------------------------------------
    def _hook(self, file: str, tensor: Optional[str]) -> None:
        if AFTER_READ is not None:
            AFTER_READ(file, tensor)

    def _count(self, nbytes: int, t0: float) -> None:
        self._bytes += nbytes
        self._seconds += time.perf_counter() - t0

    def _hash_range(self, file: str, start: int, end: int) -> str:
        """Digest of bytes ``[start, end)`` of the open ``file``, read in 16 MiB pieces (a short read hashes what there is)."""
        t0 = time.perf_counter()
        h = new_hasher(self.manifest.digest_algorithm, end - start)
        buf = memoryview(bytearray(min(_CHUNK, max(end - start, 1))))
        off = start
        while off < end:
            got = _pread_into(self._handles[file], buf[: min(_CHUNK, end - off)], off)
            h.update(buf[:got])
            off += got
            if got == 0:
                break
        self._count(off - start, t0)
        return h.hexdigest()

    def _unread(self) -> dict[str, tuple[str, TensorEntry]]:
        return {t: (shard, e) for shard, ents in self.entries.items() for t, e in ents.items() if t not in self._tensors}

    def _digests(self) -> FolderDigests:
        return FolderDigests(self.manifest.digest_algorithm, dict(self._files), dict(self._tensors), dict(self._errors),
                             self._bytes, self._seconds)

    def _fail(self) -> None:
        """Nothing more is built from this artifact: hash what was not read, compare, raise.

        Raises:
            ArtifactMismatch: always.
        """
        for name, (shard, e) in self._unread().items():
            self._tensors[name] = (shard, e, self._hash_range(shard, e.start, e.end))
        untouched = sorted(self._present - set(self._files))
        if untouched:  # never opened: hashed like kvq verify does (they are not served)
            d = digest_files(self.folder, untouched, self.manifest.digest_algorithm)
            self._files.update(d.files)
            self._tensors.update(d.tensors)
            self._errors.update(d.errors)
            self._bytes += d.bytes_hashed
            self._seconds += d.seconds
        self.report = compare_with_manifest(self.folder, self.manifest, self._present, self._unsafe, self._digests())
        raise ArtifactMismatch(self.folder, self.report)
