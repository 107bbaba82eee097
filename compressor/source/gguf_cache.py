"""kvq's cache of converted GGUF files (issue #19: start-up under 5 s on a second command).

transformers converts a GGUF file (metadata, tokenizer, dequantization) on every load, which
takes tens of seconds; :func:`compressor.source.open.load_model` stores the converted float32
model once, as an ordinary Hugging Face folder, keyed by the GGUF file's SHA-256 and the
transformers version, with each file's BLAKE3 digest checked on every use.

A cache entry stands in for the GGUF file it was made from, so its index (the GGUF's SHA-256,
each file's BLAKE3) is authenticated: a keyed BLAKE3 over it with a 32-byte key kept outside
the cache (:func:`cache_key_file`, readable by its owner only). Anyone who can write the cache
but not read the key cannot make an entry kvq accepts (an edited file with its digest rewritten
in the index fails the check, is named and converted again), so a command's claim that it read
the GGUF (the manifest's ``source``, verify's ``reference_matches_source``) holds for what it
read from the cache too.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import resource_problem
from ..safetensors_io import file_digest

if TYPE_CHECKING:
    from .resolve import ModelSource

#: file in a GGUF cache entry recording what it was made from and each file's BLAKE3 digest
GGUF_CACHE_INDEX = "kvq-gguf-cache.json"
GGUF_CACHE_VERSION = 2  # 2: the index is authenticated with the cache key (entries of version 1 are not read)
#: bytes of the cache key
CACHE_KEY_BYTES = 32


def cache_root() -> Path:
    """kvq's cache folder: ``$KVQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvq``, else ``~/.cache/kvq``."""
    if os.environ.get("KVQ_CACHE_DIR"):
        return Path(os.environ["KVQ_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvq"


def cache_key_file() -> Path:
    """Where kvq's cache key lives, outside the cache folder: ``$KVQ_CACHE_KEY_FILE``, else
    ``$XDG_CONFIG_HOME/kvq/cache-key``, else ``~/.config/kvq/cache-key``."""
    if os.environ.get("KVQ_CACHE_KEY_FILE"):
        return Path(os.environ["KVQ_CACHE_KEY_FILE"])
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "kvq" / "cache-key"


def _read_key(path: Path) -> bytes | str:
    """The key at ``path``, or why it cannot be trusted (a ``str``): not there, a link or not a
    file, owned by another user, readable or writable by others, not :data:`CACHE_KEY_BYTES` long."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return f"kvq's cache key {path} does not exist"
    except OSError as e:
        return f"kvq's cache key {path} cannot be read ({e.strerror}; a link is not followed)"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"kvq's cache key {path} is not a file"
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            return f"kvq's cache key {path} is owned by another user or open to others (it must be yours, mode 600)"
        key = os.read(fd, CACHE_KEY_BYTES + 1)
    finally:
        os.close(fd)
    return key if len(key) == CACHE_KEY_BYTES else f"kvq's cache key {path} is not {CACHE_KEY_BYTES} bytes"


def _cache_key(create: bool = False) -> bytes | str:
    """The cache key (:func:`cache_key_file`), made once (random, mode 600, in a folder of mode
    700) when ``create`` and it does not exist; or why there is none to use (a ``str``)."""
    path = cache_key_file()
    key = _read_key(path)
    if isinstance(key, bytes) or not create or os.path.lexists(path):
        return key
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_bytes(CACHE_KEY_BYTES))
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # never replaces a key another process made meanwhile
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        return f"kvq's cache key {path} cannot be made ({e.strerror})"
    return _read_key(path)


def _index_mac(key: bytes, entry: str, gguf_sha256: str, files: dict) -> str:
    """The keyed BLAKE3 of what an entry's index vouches for: its name (GGUF SHA-256, transformers
    and cache version), the GGUF's SHA-256 and each file's BLAKE3."""
    import blake3

    body = json.dumps({"entry": entry, "gguf_sha256": gguf_sha256, "files": files}, sort_keys=True)
    return blake3.blake3(body.encode(), key=key).hexdigest()


def cache_writable() -> bool:
    """Whether kvq's cache folder (:func:`cache_root`) exists or can be made, and can be written."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(root, os.W_OK | os.X_OK)


def _stat(path: Path) -> tuple:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


#: (path, its _stat) -> SHA-256: a command reads the GGUF's key more than once (the early check,
#: the streamed load, the conversion); the file is hashed once per process while it is unchanged
_GGUF_SHA256: dict[tuple, str] = {}


def _gguf_sha256(path: Path) -> str:
    key = (str(path), _stat(path))
    if key not in _GGUF_SHA256:
        _GGUF_SHA256[key] = file_digest(path)
    return _GGUF_SHA256[key]


def _gguf_key(source: ModelSource) -> str:
    import transformers

    return f"{_gguf_sha256(source.path)}-tf{transformers.__version__}-v{GGUF_CACHE_VERSION}"


#: entry folder -> the _stat of each of its files when their BLAKE3 digests last matched in this
#: process: a second check of an unchanged entry (same inode, size and mtime) hashes nothing
_VERIFIED: dict[Path, dict] = {}


#: what happened to kvq's GGUF cache in this process that a user should hear about (an entry
#: that failed its check and is converted again, one that could not be stored); commands
#: print them as warnings (:func:`take_cache_notes`)
_CACHE_NOTES: list[str] = []


def take_cache_notes() -> list[str]:
    """The cache notes gathered since the last call (each once), emptied."""
    notes = list(dict.fromkeys(_CACHE_NOTES))
    _CACHE_NOTES.clear()
    return notes


def stale_cache_notes(source: ModelSource) -> list[str]:
    """The notes (:func:`take_cache_notes`) on a cache entry of ``source`` that fails its check:
    said before a command converts the file again (tens of seconds) rather than after."""
    cached_gguf_folder(source)
    return take_cache_notes()


def cached_gguf_folder(source: ModelSource) -> Path | None:
    """The converted form of a GGUF source (float32 safetensors, ``config.json``, tokenizer
    files) from kvq's cache, or ``None`` when there is none or it fails its check.

    Converting a GGUF file (metadata, tokenizer, dequantization) takes transformers tens of
    seconds on every load; :func:`load_model` stores the result once, keyed by the GGUF
    file's SHA-256 and the transformers version, and every use re-checks each cached
    file's BLAKE3 digest (a damaged or edited entry is ignored, rebuilt, and named in a
    note: :func:`take_cache_notes`). The folder is an ordinary Hugging Face folder, so a
    cached GGUF source also streams one decoder layer at a time
    (:func:`compressor.source.open.open_lazy`).
    """
    if source.kind != "gguf":
        return None
    folder = cache_root() / "gguf" / _gguf_key(source)
    if not os.path.lexists(folder):
        return None
    problem = None
    try:
        index = json.loads((folder / GGUF_CACHE_INDEX).read_text())
        files = index["files"]
        stats = {name: _stat(folder / name) for name in [GGUF_CACHE_INDEX, *files] if (folder / name).is_file()}
        key = _cache_key()
        if isinstance(key, str):
            problem = f"it cannot be authenticated: {key}"
        elif not hmac.compare_digest(str(index.get("mac")),
                                     _index_mac(key, folder.name, str(index.get("gguf_sha256")), files)):
            problem = "its index is not the one kvq wrote with this user's cache key (edited, or written elsewhere)"
        elif _VERIFIED.get(folder) == stats and len(stats) == len(files) + 1:
            return folder  # checked earlier in this process, unchanged since
        elif index.get("gguf_sha256") != _gguf_sha256(source.path):
            problem = "it was made from another file"
        elif "config.json" not in files:
            problem = "it has no config.json"
        else:
            problem = next(filter(None, (_file_problem(folder / name, digest) for name, digest in files.items())), None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        problem = f"its index cannot be read ({type(e).__name__})"
    if problem is None:
        _VERIFIED[folder] = stats
        return folder
    _VERIFIED.pop(folder, None)
    _CACHE_NOTES.append(f"kvq's cached conversion of {source.path.name} ({folder}) failed its check: {problem}; "
                        "the GGUF file is converted again")
    return None


def _file_problem(path: Path, digest: str) -> str | None:
    """Why a cached file is not the one recorded (missing, not a file, another BLAKE3), else ``None``."""
    if not os.path.lexists(path):
        return f"{path.name} is missing"
    if not path.is_file():
        return f"{path.name} is not a file"
    return None if file_digest(path, "blake3") == digest else f"{path.name} does not match its BLAKE3 digest"


def _write_gguf_cache(source: ModelSource, model, tokenizer) -> None:
    """Store the converted GGUF model (best effort: a cache that cannot be written -- no room,
    no cache key, a file-size limit -- is skipped, with a note, :func:`take_cache_notes`); a
    damaged entry, or a file in its place, is replaced. The index is authenticated with the
    cache key (:func:`_cache_key`, made on first use)."""
    import shutil
    import tempfile

    folder = cache_root() / "gguf" / _gguf_key(source)
    try:
        key = _cache_key(create=True)
        if isinstance(key, str):
            raise OSError(key)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
            files = {p.name: file_digest(p, "blake3") for p in sorted(tmp.iterdir()) if p.is_file()}
            sha = _gguf_sha256(source.path)
            (tmp / GGUF_CACHE_INDEX).write_text(json.dumps(
                {"gguf": str(source.path), "gguf_sha256": sha, "files": files,
                 "mac": _index_mac(key, folder.name, sha, files)}, indent=1))
            if folder.is_dir() and not folder.is_symlink():
                shutil.rmtree(folder, ignore_errors=True)
            elif os.path.lexists(folder):  # a file or a link where the entry belongs
                folder.unlink()
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - the cache is best effort: safetensors' own errors (a full disk) too
        why = resource_problem(e) or (e.strerror if isinstance(e, OSError) and e.strerror else None) \
            or (str(e).splitlines()[0] if str(e).strip() else type(e).__name__)
        _CACHE_NOTES.append(f"the converted GGUF file could not be stored in kvq's cache ({folder}): "
                            f"{why}; every command converts it whole again")
