"""``kvq-manifest.json``: what an artifact holds and how it was made.

Rules (MUST unless marked MAY):

* ``schema_version`` is ``"kvq.manifest/2"``; readers refuse unknown versions (version 1,
  which named every digest ``sha256``, is read and upgraded in memory).
* ``digest_algorithm`` is ``sha256`` (default) or ``blake3``; every digest is 64
  lowercase hex characters.
* Sizes and shape dimensions are non-negative JSON integers (not strings, not floats);
  no JSON object repeats a key.
* ``files`` maps every file of the artifact folder except the manifest and the signature
  (``model.sig``) to its size and digest; names are plain file names (no ``/``, no
  ``..``, not absolute). ``covers`` says what the digest covers: ``file`` (all bytes) or,
  for safetensors files, ``header`` (the 8-byte length and the JSON header): the data
  buffer is covered by the tensors' digests, and the format forbids holes in it, so every
  byte is hashed exactly once.
* ``tensors`` maps every stored tensor name to its file, dtype, shape and the digest of
  its stored bytes (the safetensors data range, not a re-serialization).
* ``recipe`` is the effective recipe; ``calibration`` the calibration provenance
  (source, SHA-256 of the text, samples, seqlen, seed) or null for RTN.
* ``provenance`` (creation time, host) MAY change between identical runs and is the
  only part excluded from :meth:`Manifest.content_digest`.
* Serialization is canonical: sorted keys, 2-space indent, UTF-8, trailing newline.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import InputError
from .safetensors_io import no_duplicate_keys

SCHEMA_VERSION = "kvq.manifest/2"
MANIFEST_NAME = "kvq-manifest.json"
SIGNATURE_NAME = "model.sig"
READ_VERSIONS = ("kvq.manifest/1", SCHEMA_VERSION)
HEX64 = r"^[0-9a-f]{64}$"
#: bounds on a manifest read from disk, checked before it is parsed or validated. The largest
#: published MoE models quantized by kvq list about 300k tensors (Kimi K2: 384 experts x 61
#: layers, four tensors per packed linear) in a manifest of about 80 MB.
MAX_MANIFEST_BYTES = 512 * 2**20
MAX_MANIFEST_ENTRIES = 1_000_000  # files + tensors


def _safe_name(name: str) -> str:
    if (not name or "/" in name or "\\" in name or "\x00" in name or name in (".", "..") or name.startswith("..")
            or name in (MANIFEST_NAME, SIGNATURE_NAME)):
        raise ValueError(f"unsafe file name {name!r} (must be a plain name inside the artifact)")
    return name


def _hex64(v):
    # runs before pydantic's own checks (type, ``pattern``) so a wrong digest gets this message
    if isinstance(v, str) and (len(v) != 64 or any(c not in "0123456789abcdef" for c in v)):
        raise ValueError("digest must be 64 lowercase hex characters")
    return v


# strict: "1877", 1877.0 and true are not sizes or dimensions (pydantic would coerce them)
_Count = Annotated[int, Field(strict=True, ge=0)]
_Digest = Annotated[str, Field(strict=True, pattern=HEX64)]


class FileRecord(BaseModel):
    """One file of the artifact: size in bytes, digest, and what the digest covers."""

    model_config = ConfigDict(extra="forbid")
    size: _Count
    digest: _Digest
    covers: Literal["file", "header"] = "file"
    _v = field_validator("digest", mode="before")(classmethod(lambda cls, v: _hex64(v)))


class TensorRecord(BaseModel):
    """One stored tensor: its file, safetensors dtype, shape and the digest of its bytes."""

    model_config = ConfigDict(extra="forbid")
    file: str
    dtype: str
    shape: list[_Count] = Field(max_length=64)
    digest: _Digest
    _v = field_validator("digest", mode="before")(classmethod(lambda cls, v: _hex64(v)))
    _f = field_validator("file")(classmethod(lambda cls, v: _safe_name(v)))


class Manifest(BaseModel):
    """The artifact manifest (see module docstring for the rules)."""

    model_config = ConfigDict(extra="forbid")
    schema_version: Literal["kvq.manifest/2"] = SCHEMA_VERSION
    digest_algorithm: Literal["sha256", "blake3"] = "sha256"
    format: str = "compressed-tensors"  # a registered --format (compressor.registry.FORMATS)
    tool: dict[str, Any]
    source: dict[str, Any]
    recipe: dict[str, Any]
    calibration: Optional[dict[str, Any]] = None
    quantization: dict[str, Any]
    kv_cache: Optional[dict[str, Any]] = None
    quality: dict[str, Any] = Field(default_factory=dict)
    files: dict[str, FileRecord]
    tensors: dict[str, TensorRecord]
    provenance: dict[str, Any] = Field(default_factory=dict)

    @field_validator("files")
    @classmethod
    def _names(cls, v):
        for name in v:
            _safe_name(name)
        return v

    @model_validator(mode="after")
    def _tensor_files_listed(self):
        for tname, rec in self.tensors.items():
            if rec.file not in self.files:
                raise ValueError(f"tensor {tname!r} is in file {rec.file!r}, which the manifest does not list")
        return self

    def to_json(self) -> str:
        """Canonical serialization (sorted keys, 2-space indent, trailing newline)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, indent=2, ensure_ascii=False) + "\n"

    def content_digest(self) -> str:
        """SHA-256 of the canonical JSON without ``provenance``: equal for identical runs."""
        data = self.model_dump(mode="json")
        data.pop("provenance", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


_no_duplicate_keys = no_duplicate_keys("duplicate key {key!r}")


def load_manifest(folder: str | Path) -> Manifest:
    """Read and validate ``folder/kvq-manifest.json``.

    Raises:
        InputError: missing, larger than :data:`MAX_MANIFEST_BYTES`, not JSON, duplicate
            keys, nested too deeply, more than :data:`MAX_MANIFEST_ENTRIES` files and
            tensors, unknown schema version, unsafe paths, bad digests, sizes or shapes that
            are not integers.
    """
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise InputError(f"{folder} has no {MANIFEST_NAME}: not a kvq artifact (another tool's artifact: kvq verify "
                         "--no-manifest --reference MODEL)")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise InputError(f"{path}: {size:,} bytes, above the {MAX_MANIFEST_BYTES // 2**20} MiB a kvq manifest may "
                         "take; not read")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    return parse_manifest(raw, path)


def parse_manifest(raw: bytes, path: str | Path) -> Manifest:
    """Validate the manifest bytes ``raw`` (read from ``path``, named in errors): what
    :func:`load_manifest` does once the file is read, for a caller that must use the very
    bytes it checked (e.g. against a signature).

    Raises:
        InputError: see :func:`load_manifest`.
    """
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except InputError as e:  # a duplicate key: JSON allows it, but which value counts is parser-defined
        raise InputError(f"{path}: {e} (a manifest must not repeat a key)") from None
    except RecursionError:
        raise InputError(f"{path}: not a manifest (JSON nested too deeply)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: manifest must be a JSON object")
    entries = sum(len(data[k]) for k in ("files", "tensors") if isinstance(data.get(k), dict))
    if entries > MAX_MANIFEST_ENTRIES:
        raise InputError(f"{path}: {entries:,} files and tensors listed, above the {MAX_MANIFEST_ENTRIES:,} a kvq "
                         "manifest may list; not read")
    if data.get("schema_version") == "kvq.manifest/1":
        data = _upgrade_v1(data)
    if data.get("schema_version") != SCHEMA_VERSION:
        raise InputError(f"{path}: unknown schema_version {data.get('schema_version')!r} "
                         f"(this kvq reads {' and '.join(READ_VERSIONS)})")
    try:
        return Manifest.model_validate(data)
    except RecursionError:
        raise InputError(f"{path}: not a manifest (JSON nested too deeply)") from None
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise InputError(f"{path}: {loc or 'manifest'}: {first['msg']}") from None


def _upgrade_v1(data: dict) -> dict:
    """Version 1 named every digest ``sha256`` and always covered whole files."""
    data = dict(data, schema_version=SCHEMA_VERSION, digest_algorithm="sha256")
    for key in ("files", "tensors"):
        recs = data.get(key)
        if isinstance(recs, dict):
            data[key] = {n: ({("digest" if k == "sha256" else k): v for k, v in r.items()} if isinstance(r, dict) else r)
                         for n, r in recs.items()}
    return data


def json_schema() -> dict:
    """The manifest's JSON Schema (draft 2020-12, from the pydantic model); ``docs/manifest.schema.json``."""
    schema = Manifest.model_json_schema()
    schema["$id"] = "urn:kvq:manifest:2"
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


if __name__ == "__main__":  # python -m compressor.manifest > docs/manifest.schema.json
    print(json.dumps(json_schema(), indent=2, sort_keys=True))
