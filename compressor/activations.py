"""Calibration activations and memory: whether a run's activations fit (in memory, spilled
to disk, on the device), and the memory-mapped files they move to when they do not (in the
staging folder, :mod:`compressor.staging`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from .errors import InputError


def available_memory() -> int | None:
    """Bytes of memory this process can still take: ``MemAvailable`` of ``/proc/meminfo``,
    lowered to the cgroup's limit minus its usage where one is set (a container); ``None``
    where neither can be read (the memory check is then skipped)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            cap = Path("/sys/fs/cgroup", limit).read_text().strip()
            if cap != "max" and int(cap) < 2**60:
                found.append(max(int(cap) - int(Path("/sys/fs/cgroup", usage).read_text()), 0))
                break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def address_space_left() -> tuple[int, int] | None:
    """``(bytes, limit)``: how much more this process may map under its address-space limit
    (``RLIMIT_AS``, ``ulimit -v``; the limit minus ``VmSize`` of ``/proc/self/status``), and
    the limit; ``None`` when there is no limit. Memory-mapped (spilled) activations count
    against it as much as anonymous ones."""
    import re
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        used = int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    except (OSError, AttributeError, ValueError):
        used = 0
    return max(limit - used, 0), limit


def free_disk(folder: Path) -> int | None:
    """Free bytes on the file system of ``folder`` (``None`` when it cannot be asked)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def plan_activations(samples: int, seqlen: int, hidden: int, budget_bytes: int, folder: Path,
                     device: str = "cpu", streams: int = 1) -> tuple[bool, str | None]:
    """Check, before any work, that the calibration activations fit; returns ``(spill_all, note)``.

    One copy is ``streams x samples x seqlen x hidden x 4`` bytes (float32; ``streams`` 2 when
    GPTQ's float target runs the float model's activations beside the quantized model's,
    ``gptq.gptaq_alpha``); the layer loop holds a
    layer's inputs and its recomputed outputs (two copies) plus the int64 token ids, and the
    resume checkpoint writes the next layer's inputs to the staging folder after every layer
    (two files while one replaces the other). Above ``budget_bytes`` (``--activation-budget-gib``)
    the inputs move to memory-mapped files there: one copy in memory, three on disk. When two
    copies would not fit in :func:`available_memory` although one is within the budget, they
    are spilled anyway: ``spill_all`` is then true (run with a budget of 0) and the note says so. On CUDA the
    activations stay on the device (no spill): two copies must fit in its free memory.

    Only these activations are counted (the model's layer and the algorithm's buffers come on
    top), so a refusal is certain, a pass is not a guarantee.

    Raises:
        InputError: they cannot fit in memory (spilled or not), in the device's memory, in
            the address space the process may still map (``ulimit -v``:
            :func:`address_space_left`), or in the free disk of ``folder``; the line says how
            much each needs.
    """
    copy, ids = streams * samples * seqlen * hidden * 4, samples * seqlen * 8
    what = (f"calibration activations of {samples:,} x {seqlen:,} tokens x hidden size {hidden:,} (float32, "
            f"{_gib(copy)} a copy{', the float and the quantized stream' if streams > 1 else ''})")
    fix = "lower --calib-samples or --calib-seqlen"
    mem, spill_all, note = available_memory(), False, None
    if device.startswith("cuda"):
        import torch

        dev = torch.cuda.mem_get_info(torch.device(device))[0]
        if 2 * copy > dev:
            raise InputError(f"{what} need {_gib(2 * copy)} (inputs and outputs of a layer) on {device}, which has "
                             f"{_gib(dev)} free: {fix}")
        spilled, ram, disk = False, ids + copy, 2 * copy  # the checkpoint goes through host memory
    else:
        if copy <= budget_bytes and mem is not None and 2 * copy + ids > mem:
            spill_all = True
            note = (f"{what}: two copies do not fit in the {_gib(mem)} of memory available, so they are spilled to "
                    "memory-mapped files in the staging folder (as with a lower --activation-budget-gib)")
        spilled = spill_all or copy > budget_bytes
        ram, disk = ids + copy * (1 if spilled else 2), copy * (3 if spilled else 2)
    if mem is not None and ram > mem:
        raise InputError(f"{what} need at least {_gib(ram)} of memory ({'one copy spilled to disk, ' if spilled else ''}"
                         f"plus the token ids), but {_gib(mem)} is available: {fix}")
    mapped, space = ids + (copy if device.startswith("cuda") else 2 * copy), address_space_left()
    if space is not None and mapped > space[0]:  # a spilled copy is mapped: it saves memory, not address space
        raise InputError(f"{what} need {_gib(mapped)} of address space (a layer's inputs and outputs, spilled or not, "
                         f"plus the token ids), but this process may map {_gib(space[0])} more under its limit of "
                         f"{_gib(space[1])} (ulimit -v): {fix}")
    room = free_disk(folder)
    if room is not None and disk > room:
        raise InputError(f"{what} need {_gib(disk)} of disk in {folder} for the resume checkpoints"
                         f"{' and the spilled copy' if spilled else ''}, which has {_gib(room)} free: {fix}")
    return spill_all, note


def spill(hidden: list[torch.Tensor], folder: Path, tag: str, budget_bytes: int) -> list[torch.Tensor]:
    """Move ``hidden`` to memory-mapped files in ``folder`` when their total size exceeds
    ``budget_bytes``; returns tensors backed by those files (or ``hidden`` unchanged)."""
    total = sum(h.numel() * h.element_size() for h in hidden)
    if total <= budget_bytes or not hidden or hidden[0].device.type != "cpu":
        return hidden
    out = []
    for j, h in enumerate(hidden):
        path = folder / f"act-{os.getpid()}-{tag}-{j}.bin"
        with open(path, "wb") as f:
            f.truncate(h.numel() * h.element_size())
        m = torch.from_file(str(path), shared=True, size=h.numel(), dtype=h.dtype).view(h.shape)
        m.copy_(h)
        out.append(m)
        path.unlink()  # the mapping keeps the pages; the name is not needed (nothing left behind on a crash)
    return out


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (one decimal): ``VmHWM`` of ``/proc/self/status``
    where there is one (a process started by ``spawn`` begins its own there, while ``ru_maxrss``
    carries the parent's peak across the exec), else ``getrusage``'s ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
