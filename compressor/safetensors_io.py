"""Validated reading of safetensors headers and streaming per-tensor digests.

The layout follows the safetensors README ("Format"): an 8-byte little-endian header
length ``N``, ``N`` bytes of JSON (``name -> {dtype, shape, data_offsets}`` plus an
optional ``__metadata__`` string map), then the byte buffer. Every check here raises
:class:`InputError` naming the file and the tensor, so hostile or truncated files never
reach a loader that would crash on them.
"""

from __future__ import annotations

import errno
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


def no_duplicate_keys(message: str):
    """A ``json.loads`` ``object_pairs_hook`` raising ``InputError(message.format(key=...))`` on a repeated key."""

    def hook(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise InputError(message.format(key=k))
            seen[k] = v
        return seen

    return hook


_no_duplicates = no_duplicate_keys("duplicate tensor name '{key}' in safetensors header")


def read_header(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """Parse and validate the header of a safetensors file.

    Raises:
        InputError: truncated file, header length beyond the file or above 100 MiB,
            invalid or too deeply nested JSON, duplicate names, unknown dtype, negative or
            non-integer shapes, offsets that do not match the shape, overlap or run past
            the end of the file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            span = read_header_span(f, size, path)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    return parse_header(span, size, path)


def read_header_span(f, size: int, path: str | os.PathLike) -> bytes:
    """The first ``8 + N`` bytes of the open safetensors file ``f`` (length prefix and JSON header).

    ``size`` is the file's size in bytes; ``f`` is read from its current position (0).

    Raises:
        InputError: shorter than 8 bytes, a header length beyond the file or above 100 MiB.
        OSError: the read failed.
    """
    head = f.read(8)
    if len(head) < 8:
        raise InputError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER_BYTES or n > size - 8:
        raise InputError(f"{path}: bad safetensors header: length {n} exceeds the file or the 100 MiB limit")
    raw = f.read(n)
    if len(raw) < n:
        raise InputError(f"{path}: not a safetensors file (truncated header)")
    return head + raw


def parse_header(span: bytes, size: int, path: str | os.PathLike) -> dict[str, TensorEntry]:
    """Validate the header bytes ``span`` (from :func:`read_header_span`) of a file of ``size`` bytes.

    Returns ``{name: TensorEntry}`` with absolute byte ranges. Parsing the very bytes that
    were hashed is what lets a loader serve what it checked.

    Raises:
        InputError: see :func:`read_header`.
    """
    n = len(span) - 8
    try:
        header = json.loads(span[8:].decode("utf-8"), object_pairs_hook=_no_duplicates)
    except InputError as e:
        raise InputError(f"{path}: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: bad safetensors header: invalid JSON ({e})") from None
    except RecursionError:
        raise InputError(f"{path}: bad safetensors header: JSON nested too deeply") from None
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
        # type(..) is int: JSON true/false are bools, which isinstance(.., int) would accept
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise InputError(f"{path}: tensor '{name}': bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
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
    # the format forbids holes ("the byte buffer needs to be entirely indexed"): bytes no
    # tensor covers could carry hidden content past every per-tensor digest
    covered = data_start
    for s0, e0, n0 in spans:
        if s0 != covered:
            raise InputError(f"{path}: bad safetensors file: {s0 - covered} unindexed bytes before tensor '{n0}'")
        covered = e0
    if covered != size:
        raise InputError(f"{path}: bad safetensors file: {size - covered} unindexed bytes after the last tensor")
    return entries


def header_span(path: str | os.PathLike) -> int:
    """Length in bytes of the 8-byte length prefix plus the JSON header (``8 + N``)."""
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


HASH_ALGORITHMS = ("sha256", "blake3")
_BLAKE3_THREADED_MIN = 1 << 20  # below 1 MiB blake3's own threads do not pay off
_BATCH_BYTES = 4 << 20  # tensors below this are hashed in batches (one pool task per batch)


def new_hasher(algorithm: str, nbytes: int = 0):
    """A hashlib-style object for ``algorithm`` (``sha256`` or ``blake3``).

    BLAKE3 (the ``blake3`` package, O'Connor et al. 2020) hashes one input on several
    threads itself, so large inputs get ``max_threads=AUTO``; SHA-256 is sequential per
    input and gets its parallelism from hashing several tensors at once.

    Raises:
        InputError: unknown algorithm.
    """
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(max_threads=blake3.blake3.AUTO if nbytes >= _BLAKE3_THREADED_MIN else 1)
    raise InputError(f"unknown digest algorithm {algorithm!r} (choose from {', '.join(HASH_ALGORITHMS)})")


def digest_bytes(data, algorithm: str = "sha256") -> str:
    """Hex digest of the bytes-like ``data``: a tensor's stored bytes, a header span, a whole file.

    The same digest :func:`digest_files` computes from the file (it feeds the same bytes
    to the same hasher in slices), for a loader that hashes what it read into memory.

    Raises:
        InputError: unknown algorithm.
    """
    view = memoryview(data)
    h = new_hasher(algorithm, view.nbytes)
    h.update(view)
    return h.hexdigest()


@dataclass(frozen=True)
class _Job:
    file: str
    name: str | None  # tensor name, or None for the header / whole file
    start: int
    end: int


@dataclass
class FolderDigests:
    """Digests of an artifact folder's files, computed in one pass.

    ``files[name] = (size, digest, covers)``: ``covers`` is ``"header"`` for safetensors
    files (the digest covers the length prefix and JSON header; the tensors' digests cover
    the data buffer, which the format forbids to have holes, so every byte is covered
    exactly once) and ``"file"`` for all other files. ``tensors[name] = (file, entry,
    digest)``. ``errors[file]`` holds the one-line reason a safetensors file could not be
    parsed (it is then hashed as a whole file).
    """

    algorithm: str
    files: dict[str, tuple[int, str, str]]
    tensors: dict[str, tuple[str, TensorEntry, str]]
    errors: dict[str, str]
    bytes_hashed: int
    seconds: float


def default_workers() -> int:
    """The number of CPUs this process may use (hashing threads by default)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class _Plan:
    """What :func:`digest_files` will hash: jobs (largest first) and what it learnt per file."""

    jobs: list[_Job]
    kinds: dict[str, str]  # file -> "header" (safetensors, hashed per tensor) or "file" (hashed whole)
    sizes: dict[str, int]
    entries: dict[str, dict[str, TensorEntry]]
    errors: dict[str, str]  # safetensors files whose header did not parse (hashed whole)


def _plan_jobs(folder: Path, names, parse_safetensors: bool) -> _Plan:
    """One job per safetensors header and tensor range, one per other file; sorted largest first.

    Raises:
        InputError: a file that cannot be stat'ed.
    """
    plan = _Plan([], {}, {}, {}, {})
    for name in names:
        p = folder / name
        try:
            plan.sizes[name] = p.stat().st_size
        except OSError as e:
            raise InputError(f"cannot read {p}: {e.strerror}") from None
        if parse_safetensors and name.endswith(".safetensors"):
            try:
                plan.entries[name] = read_header(p)
            except InputError as e:
                plan.errors[name] = str(e)
        if name in plan.entries:
            plan.kinds[name] = "header"
            plan.jobs.append(_Job(name, None, 0, header_span(p)))
            plan.jobs.extend(_Job(name, t.name, t.start, t.end) for t in plan.entries[name].values())
        else:
            plan.kinds[name] = "file"
            plan.jobs.append(_Job(name, None, 0, plan.sizes[name]))
    plan.jobs.sort(key=lambda j: j.end - j.start, reverse=True)
    return plan


def _batch_jobs(jobs: list[_Job]) -> list[list[_Job]]:
    """One pool task per job of at least 4 MiB; small tensors (norms, scales) in batches of >= 4 MiB."""
    batches: list[list[_Job]] = []
    small: list[_Job] = []
    small_bytes = 0
    for j in jobs:
        if j.end - j.start >= _BATCH_BYTES:
            batches.append([j])
            continue
        small.append(j)
        small_bytes += j.end - j.start
        if small_bytes >= _BATCH_BYTES:
            batches.append(small)
            small, small_bytes = [], 0
    if small:
        batches.append(small)
    return batches


def _hash_batch(batch: list[_Job], maps: dict[str, tuple], algorithm: str) -> list[tuple[_Job, str]]:
    """Hash each job's byte range of its mapped file, in 64 MiB slices; ``[(job, hex digest)]``.

    Each hashed slice is dropped from this process's RSS (``madvise(MADV_DONTNEED)``) as soon
    as it is hashed.
    """
    out = []
    for job in batch:
        n = job.end - job.start
        h = new_hasher(algorithm, n)
        if n:
            _f, mm, view = maps[job.file]
            step = 1 << 26  # 64 MiB slices keep page-cache pressure bounded on huge tensors
            for off in range(job.start, job.end, step):
                stop = min(off + step, job.end)
                h.update(view[off:stop])
                # drop the hashed pages from this process's RSS (they stay in the page
                # cache; a neighbour still being hashed just faults its page back in)
                first = off - off % mmap.PAGESIZE
                mm.madvise(mmap.MADV_DONTNEED, first, stop - first)
        out.append((job, h.hexdigest()))
    return out


def _hash_mapped(folder: Path, plan: _Plan, algorithm: str, workers: int) -> list[tuple[_Job, str]]:
    """Map every non-empty file read-only, hash all jobs, then unmap and close every file.

    BLAKE3 (threaded inside one input) or one worker: batches one after another; otherwise
    a pool of ``workers`` threads (hashlib releases the GIL).
    """
    maps: dict[str, tuple] = {}
    try:
        for name in plan.kinds:
            if plan.sizes[name] == 0:
                continue
            f = open(folder / name, "rb")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            maps[name] = (f, mm, memoryview(mm))
        batches = _batch_jobs(plan.jobs)
        if algorithm == "blake3" or workers == 1:  # blake3 threads inside one input: one job at a time
            results = [r for b in batches for r in _hash_batch(b, maps, algorithm)]
        else:
            with ThreadPoolExecutor(max_workers=workers) as ex:
                results = [r for rs in ex.map(lambda b: _hash_batch(b, maps, algorithm), batches) for r in rs]
    finally:
        for f, mm, view in maps.values():
            view.release()
            mm.close()
            f.close()
    return results


def digest_files(folder: str | os.PathLike, names, algorithm: str = "sha256", workers: int | None = None,
                 parse_safetensors: bool = True) -> FolderDigests:
    """Hash the plain files ``names`` of ``folder`` (mmap, streamed, parallel).

    Each safetensors file is read once: its header and every tensor's byte range are
    separate jobs (:func:`_plan_jobs`); all jobs of all files go to one pool of ``workers``
    threads (default: the CPUs this process may use), largest first, so a few large tensors
    do not leave a core idle at the end (longest-processing-time-first scheduling;
    :func:`_hash_mapped`). hashlib and blake3 release the GIL while hashing, so threads use
    several cores. Nothing is loaded into memory beyond the page cache.

    Raises:
        InputError: unknown algorithm, or a file that cannot be opened.
    """
    import time

    t0 = time.perf_counter()
    folder = Path(folder)
    new_hasher(algorithm)  # validate early
    workers = workers or default_workers()
    plan = _plan_jobs(folder, names, parse_safetensors)
    results = _hash_mapped(folder, plan, algorithm, workers)
    files: dict[str, tuple[int, str, str]] = {}
    tensors: dict[str, tuple[str, TensorEntry, str]] = {}
    for job, digest in results:
        if job.name is None:
            files[job.file] = (plan.sizes[job.file], digest, plan.kinds[job.file])
        else:
            tensors[job.name] = (job.file, plan.entries[job.file][job.name], digest)
    return FolderDigests(algorithm, files, tensors, plan.errors, sum(plan.sizes.values()), time.perf_counter() - t0)


def tensor_digests(path: str | os.PathLike, algorithm: str = "sha256", workers: int | None = None) -> dict[str, str]:
    """Hex digest of every tensor's stored bytes of one safetensors file (see :func:`digest_files`).

    Raises:
        InputError: bad header (see :func:`read_header`).
    """
    path = Path(path)
    d = digest_files(path.parent, [path.name], algorithm, workers)
    if d.errors:
        raise InputError(d.errors[path.name])
    return {name: digest for name, (_f, _e, digest) in d.tensors.items()}


def file_digest(path: str | os.PathLike, algorithm: str = "sha256") -> str:
    """Streaming hex digest of a whole file."""
    h = new_hasher(algorithm, Path(path).stat().st_size)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _shard_groups(entries: list, shard_bytes: int, linked: set) -> tuple[list[list], set[int]]:
    """``entries`` (``(part, TensorEntry)`` in order) split into shards: each part of ``linked``
    whole, the rest packed in order into shards of at most ``shard_bytes`` data bytes (a larger
    tensor alone). Returns the groups and the indices of those that are one linked part."""
    groups: list[list] = [[]]
    whole: set[int] = set()
    size = 0
    for item in entries:
        n = item[1].end - item[1].start
        if item[0] in linked:
            if not groups[-1] or groups[-1][0][0] != item[0]:
                if groups[-1]:
                    groups.append([])
                whole.add(len(groups) - 1)
            groups[-1].append(item)
            continue
        if groups[-1] and (size + n > shard_bytes or len(groups) - 1 in whole):
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups, whole


def write_shards(parts: list[str | os.PathLike], out_dir: str | os.PathLike, shard_bytes: int,
                 metadata: dict[str, str] | None = None, skip: dict | None = None,
                 link: list[str | os.PathLike] = ()) -> dict[str, str]:
    """Concatenate the tensors of safetensors ``parts`` into shards of at most ``shard_bytes``
    of data each (a tensor larger than that gets a shard of its own), streaming the bytes
    (memory stays O(copy buffer), whatever the model size).

    One shard is written as ``model.safetensors``; several as
    ``model-0000k-of-0000N.safetensors`` plus ``model.safetensors.index.json``
    (``{"metadata": {"total_size"}, "weight_map": {tensor: file}}``, the Hugging Face
    sharded-checkpoint index). ``skip`` maps a part to the tensor names left out of that part
    (the same name in another part is kept: a replacement). Tensors keep the order of the parts; within a shard the
    header is sorted by name and the data follows in that order (safetensors spec: 8-byte
    little-endian header length, JSON header padded with spaces to 8 bytes, data buffer
    fully indexed, no holes).

    ``link`` names parts (on the same file system as ``out_dir``) that become shards of their
    own, as hard links, when the tensors do not fit one shard and nothing is skipped from them:
    no byte is copied, so assembling an artifact of decoder-layer parts needs no second copy of
    it on disk (a Kimi K2 artifact is hundreds of GB). Such a shard keeps the part's own
    layout (safetensors' writer orders tensors by alignment, then name).

    Returns:
        ``{tensor name: shard file name}``.

    Raises:
        InputError: a part has a bad header, or two parts hold the same tensor name.
    """
    out_dir = Path(out_dir)
    entries: list[tuple[Path, TensorEntry]] = []
    seen: set[str] = set()
    skip = {Path(k): v for k, v in (skip or {}).items()}
    for p in parts:
        left_out = skip.get(Path(p), ())
        for e in read_header(p).values():
            if e.name in left_out:
                continue
            if e.name in seen:
                raise InputError(f"tensor {e.name} written twice while assembling the shards")
            seen.add(e.name)
            entries.append((Path(p), e))
    data_bytes = sum(e.end - e.start for _p, e in entries)
    linked = ({Path(p) for p in link if not skip.get(Path(p))} if data_bytes > shard_bytes else set())
    groups, whole = _shard_groups(entries, shard_bytes, linked)
    total = len(groups)
    names = ["model.safetensors"] if total == 1 else [f"model-{k:05d}-of-{total:05d}.safetensors" for k in range(1, total + 1)]
    weight_map: dict[str, str] = {}
    for k, (fname, group) in enumerate(zip(names, groups)):
        if k in whole:  # a part placed whole: a hard link, no copy
            os.link(group[0][0], out_dir / fname)
            weight_map.update({e.name: fname for _p, e in group})
            continue
        group = sorted(group, key=lambda it: it[1].name)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        off = 0
        for _p, e in group:
            n = e.end - e.start
            header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out_dir / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.flush()  # the data goes through the file descriptor (_copy_range)
            handles: dict[Path, object] = {}
            try:
                for p, e in group:
                    if p not in handles:
                        handles[p] = open(p, "rb")
                    _copy_range(handles[p].fileno(), f.fileno(), e.start, e.end - e.start, p)
                    weight_map[e.name] = fname
            finally:
                for h in handles.values():
                    h.close()
    if total > 1:
        index = {"metadata": {"total_size": data_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def _copy_range(src: int, dst: int, start: int, n: int, path: Path) -> None:
    """Append bytes ``[start, start + n)`` of the file open as ``src`` (a descriptor) at ``dst``'s
    position: in the kernel (``os.copy_file_range``: no copy through this process, no buffer of it
    allocated) where the system allows, else read and written in slices of 64 MiB.

    Raises:
        InputError: ``src`` ends before ``start + n`` (named by ``path``).
    """
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < n:
                k = os.copy_file_range(src, dst, n - done, start + done)
                if not k:
                    break
                done += k
        except OSError as e:  # not between these files (another file system, an old kernel): copied below
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
                raise
    while done < n:
        chunk = os.pread(src, min(n - done, 64 << 20), start + done)
        if not chunk:
            raise InputError(f"{path}: truncated while assembling the shards")
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view):]
        done += len(chunk)
