"""Helpers shared by the commands: the reference model, peak memory."""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path


def load_reference(spec: str, source, artifact_dtype=None):
    """The reference model of ``verify`` / ``serve-smoke``, as a float model on the CPU.

    Args:
        spec: what the user named (``--reference`` or the manifest's source spec).
        source: ``spec`` resolved by :func:`compressor.source.resolve.resolve_source`.

    Returns:
        A ``PreTrainedModel``: a kvq artifact (a folder with a manifest) or another
        tool's packed artifact (``quantization_config.quant_method`` compressed-tensors,
        awq or gptq: the source of an artifact whose weights kvq carried unchanged)
        dequantized by kvq's readers to ``artifact_dtype`` (default float32; verify passes
        the dtype it evaluates the artifact in, so an artifact compared with itself shows
        no difference); anything else loaded as the original, in float32.

    Raises:
        InputError: the source cannot be read (from the loaders).
    """
    from ..artifact import load_artifact
    from ..manifest import MANIFEST_NAME
    from ..source.open import load_model
    from .kv_only import packed_method

    if Path(spec).is_dir() and ((Path(spec) / MANIFEST_NAME).is_file() or packed_method(Path(spec)) is not None):
        return load_artifact(spec, **({} if artifact_dtype is None else {"dtype": artifact_dtype}))[0]
    return load_model(source)[0]


def in_background(fn):
    """Start ``fn()`` on a daemon thread; returns a function that waits for its result (re-raising its
    error). hashlib and file reads release the GIL, so hashing the source runs on another core
    while the main thread imports and builds the model; a daemon thread never holds up an exit."""
    box: dict = {}

    def work():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised by the caller's wait
            box["error"] = e

    t = threading.Thread(target=work, name="kvq-source-digest", daemon=True)
    t.start()

    def wait():
        t.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    return wait


@contextmanager
def threads_restored():
    """torch's intra-op thread count as it was on entry, restored on exit: ``--threads`` is one
    command's (:func:`cpu_threads`), an in-process caller (docs/python.md) keeps its own."""
    import torch

    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def cpu_threads(requested: int | None, console=None) -> tuple[int, str | None]:
    """Apply ``--threads``: torch's intra-op threads set to ``requested`` (``None``: torch's
    default, one per usable CPU). Returns ``(threads in effect, note)``, the note also printed as
    a ``note:`` line on ``console`` (when given); the note (else ``None``) says that more threads
    were requested than the process has CPUs, or that the machine is busy when, with more than
    one thread and none requested, the 1-minute load average is at least the usable CPUs minus
    one half and another thread is runnable right now (:func:`runnable_now`; other jobs already
    keep about every core busy; kvq's threads come on top): every short parallel step (GPTQ's
    column loop runs thousands a layer) then waits for a descheduled thread. Measured here beside a
    2-thread job on 2 cores: a small GPTQ run took 66.9 s with 2 threads, 28.7 s with 1
    (14.6 s and 19.2 s on an idle machine; BENCHMARKS.md)."""
    threads, note = _threads_and_note(requested)
    if note:
        from .. import console as show

        show.note(console, f"[yellow]note:[/] {note}", highlight=False)
    return threads, note


def _threads_and_note(requested: int | None) -> tuple[int, str | None]:
    import torch

    from ..safetensors_io import default_workers

    cores = default_workers()
    if requested is not None:
        torch.set_num_threads(requested)
        if requested > cores:
            return torch.get_num_threads(), (f"--threads {requested} is more than the {cores} usable CPUs: the threads "
                                             f"beyond {cores} only wait for each other and slow every parallel step")
        return torch.get_num_threads(), None
    threads = torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not available on this platform
        return threads, None
    now = runnable_now()
    if threads > 1 and load >= cores - 0.5 and (now is None or now >= 2):
        return threads, (f"the machine is busy (load {load:.1f} on {cores} CPUs): with {threads} threads each short "
                         "parallel step waits for a descheduled thread; --threads 1 is usually faster on a shared machine")
    return threads, None


def runnable_now() -> int | None:
    """Threads runnable on the machine at this instant, the caller's included (``/proc/loadavg``'s
    fourth field), ``None`` where unknown. :func:`cpu_threads` wants at least one besides the
    caller: the 1-minute load average still counts a job that ended seconds ago (``make demo``'s
    verify right after its quantize)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def fail_unless_passed(report: dict, as_json: bool) -> None:
    """Return when ``report["passed"]``; else exit 1, and with ``--json`` (no console report on
    the terminal) say on stderr in one line what failed: the signature, the digests, the gates.

    Raises:
        SystemExit(1): the check failed.
    """
    if report.get("passed"):
        return
    if as_json:
        why = [part for part in ("signature", "hashes")
               if isinstance(report.get(part), dict) and report[part].get("ok") is False]
        why += list(report.get("failed_gates") or [])
        print(f"kvq: check failed: {', '.join(why) or 'see the JSON'} (details in the JSON)", file=sys.stderr)
    raise SystemExit(1)
