"""``kvq-manifest.json``: what an artifact holds and how it was made.

Rules (MUST unless marked MAY):

* ``schema_version`` is ``"kvq.manifest/1"``; readers refuse other versions.
* ``files`` maps every file of the artifact folder except the manifest itself to its
  size and SHA-256; names are plain file names (no ``/``, no ``..``).
* ``tensors`` maps every stored tensor name to its file, dtype, shape and the SHA-256
  of its stored bytes (the safetensors data range, not a re-serialization).
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
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import InputError

SCHEMA_VERSION = "kvq.manifest/1"
MANIFEST_NAME = "kvq-manifest.json"


def _safe_name(name: str) -> str:
    if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith(".."):
        raise ValueError(f"unsafe file name {name!r} (must be a plain name inside the artifact)")
    return name


def _hex64(v: str) -> str:
    if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
        raise ValueError("sha256 digest must be 64 lowercase hex characters")
    return v


class FileRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int = Field(ge=0)
    sha256: str
    _v = field_validator("sha256")(classmethod(lambda cls, v: _hex64(v)))


class TensorRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: str
    dtype: str
    shape: list[int]
    sha256: str
    _v = field_validator("sha256")(classmethod(lambda cls, v: _hex64(v)))
    _f = field_validator("file")(classmethod(lambda cls, v: _safe_name(v)))


class Manifest(BaseModel):
    """The artifact manifest (see module docstring for the rules)."""

    model_config = ConfigDict(extra="forbid")
    schema_version: Literal["kvq.manifest/1"] = SCHEMA_VERSION
    format: Literal["compressed-tensors", "awq", "gptq"] = "compressed-tensors"
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

    def to_json(self) -> str:
        """Canonical serialization (sorted keys, 2-space indent, trailing newline)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, indent=2, ensure_ascii=False) + "\n"

    def content_digest(self) -> str:
        """SHA-256 of the canonical JSON without ``provenance``: equal for identical runs."""
        data = self.model_dump(mode="json")
        data.pop("provenance", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def load_manifest(folder: str | Path) -> Manifest:
    """Read and validate ``folder/kvq-manifest.json``.

    Raises:
        InputError: missing, not JSON, unknown schema version, unsafe paths, bad digests.
    """
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise InputError(f"{folder} has no {MANIFEST_NAME}: not a kvq artifact")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: manifest must be a JSON object")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise InputError(f"{path}: unknown schema_version {data.get('schema_version')!r} (this kvq reads {SCHEMA_VERSION})")
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise InputError(f"{path}: {loc}: {first['msg']}") from None
