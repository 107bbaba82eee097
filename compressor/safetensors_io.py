"""Validated reading of safetensors headers and streaming per-tensor digests.

The layout follows the safetensors README ("Format"): an 8-byte little-endian header
length ``N``, ``N`` bytes of JSON (``name -> {dtype, shape, data_offsets}`` plus an
optional ``__metadata__`` string map), then the byte buffer. Every check here raises
:class:`InputError` naming the file and the tensor, so hostile or truncated files never
reach a loader that would crash on them.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError

MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: absolute byte range ``[start, end)`` in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise InputError(f"duplicate tensor name '{k}' in safetensors header")
        seen[k] = v
    return seen


def read_header(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """Parse and validate the header of a safetensors file.

    Raises:
        InputError: truncated file, header length beyond the file or above 100 MiB,
            invalid JSON, duplicate names, unknown dtype, negative shapes, offsets that do
            not match the shape, overlap or run past the end of the file.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InputError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise InputError(f"{path}: bad safetensors header: length {n} exceeds the file or the 100 MiB limit")
            raw = f.read(n)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except InputError as e:
        raise InputError(f"{path}: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: bad safetensors header: invalid JSON ({e})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: bad safetensors header: not a JSON object")
    data_start = 8 + n
    data_len = size - data_start
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
            raise InputError(f"{path}: tensor '{name}': malformed header entry")
        dtype = info.get("dtype")
        if dtype not in DTYPE_SIZES:
            raise InputError(f"{path}: tensor '{name}': unknown dtype {dtype!r}")
        shape = info.get("shape")
        offs = info.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise InputError(f"{path}: tensor '{name}': bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
            raise InputError(f"{path}: tensor '{name}': bad data_offsets {offs!r}")
        begin, end = offs
        numel = 1
        for d in shape:
            numel *= d
        if begin < 0 or end < begin or end - begin != numel * DTYPE_SIZES[dtype]:
            raise InputError(f"{path}: tensor '{name}': data_offsets {offs} do not match dtype {dtype} and shape {shape}")
        if end > data_len:
            raise InputError(f"{path}: tensor '{name}': data runs past the end of the file (truncated?)")
        entries[name] = TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)
    spans = sorted((e.start, e.end, e.name) for e in entries.values() if e.end > e.start)
    for (s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise InputError(f"{path}: tensors '{n0}' and '{n1}' overlap in the data buffer")
    return entries


def tensor_digests(path: str | os.PathLike, algorithm: str = "sha256", workers: int = 2) -> dict[str, str]:
    """Hex digest of every tensor's stored bytes (mmap, streamed, ``workers`` threads).

    Never loads the file into memory: each tensor's byte range is hashed from a memory map
    (hashlib releases the GIL, so threads use several cores).
    """
    entries = read_header(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return {}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)

            def _one(e: TensorEntry) -> tuple[str, str]:
                h = hashlib.new(algorithm)
                h.update(view[e.start : e.end])
                return e.name, h.hexdigest()

            try:
                with ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
                    return dict(ex.map(_one, entries.values()))
            finally:
                view.release()


def file_digest(path: str | os.PathLike, algorithm: str = "sha256") -> str:
    """Streaming hex digest of a whole file."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
