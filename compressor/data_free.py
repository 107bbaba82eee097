"""Data-free conversion by a pool of worker processes: ``kvq quantize --workers N``.

A recipe whose steps read nothing but each weight (RTN integer weights, the FP8 W8A8 recipes,
float weights with a dynamic KV scheme or none: :func:`refusal`) runs no forward pass: each
layer's linears are quantized where they lie (:func:`compressor.pipeline._quantize_layer`), a
MoE layer above ``--memory-budget-gib`` in groups of routed experts
(:meth:`compressor.staging.LayerWriter.expert_groups`). Those pieces do not depend on each
other, so ``N`` processes can read, quantize and write them at once.

The work. :func:`plan_units` cuts the layers left to do into units -- a layer that is read
whole, or, for a layer read in groups, its non-expert part and each group of experts -- and
:func:`assign` hands each worker a contiguous run of them, of about equal weight count (the
same split for the same source, budget and ``N``). Each worker (a ``spawn`` process: a fresh
interpreter, no torch state copied) opens its own reader over the source's shards
(:func:`compressor.source.open.open_lazy`, nothing outside the decoder layers read;
block-FP8 weights dequantized as read), runs the same per-layer step as one process
(:meth:`compressor.quant.algorithms.Algorithm.quantize_layer` over the unit's linears) and
writes the same part files into the staging folder through the same
:class:`~compressor.staging.LayerWriter`, one unit at a time: a worker holds one unit's
weights, as one process does (within ``--memory-budget-gib``). torch's threads are
``--threads`` divided among the workers (at least one each).

The main process holds the model on ``meta`` and the records. As each worker reports a unit
(its relative errors, schemes, part files and their SHA-256s), the main process takes the
finished layers in order: the layer's figures from the errors in one process's order, its
schemes and parts in one process's order, the resume checkpoint (no part is hashed twice),
the progress line. The artifact is then written as ever (:func:`compressor.artifact.write_artifact`):
each part is byte for byte the one a single process writes and the parts are joined in its
order, so every tensor, file and the manifest's content digest are the single process's,
for any ``N`` (RTN's codes come from elementwise arithmetic and maxima, whatever the thread
count). A worker that dies (killed, out of memory) stops the run: one line naming it
(:class:`~compressor.errors.CheckFailed`, exit 1), the other workers terminated, no artifact.
A worker's own error (a tensor holding NaN) is raised again in the main process, as one
process raises it. A worker ends itself when the main process is gone.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import errors
from .arch import checkpoint_name, get_arch, get_module
from .activations import peak_rss_mib
from .errors import CheckFailed, InputError
from .layer_figures import layer_figures
from .pipeline import QuantizeResult, _plan, _record_moe
from .quant.kv_search import search_warnings
from .quant.layer import LayerContext, LinearQuantizer
from .safetensors_io import file_digest
from .staging import LayerWriter, Staging

__all__ = ["WorkerSpec", "assign", "plan_units", "quantize_with_workers", "refusal"]

#: how worker processes start: a fresh interpreter each (no copy of the parent's torch threads or locks)
START_METHOD = "spawn"


def refusal(algorithm, kv, workers: int, stream: bool = True, packed: bool = False) -> str | None:
    """Why ``--workers workers`` cannot run (``None``: it can, or ``workers`` is 1): a step that
    needs a calibration forward pass (AWQ, GPTQ, GPTAQ, a ``refine`` section: ``algorithm``'s
    ``needs_calibration``), static KV scales (``kv``: the recipe's KV spec), a step that does not
    quantize each linear on its own, ``--no-stream``, an already-quantized source (``packed``),
    several ``torchrun`` ranks (``WORLD_SIZE`` above 1)."""
    if workers <= 1:
        return None
    ranks = int(os.environ.get("WORLD_SIZE") or 1)
    why = (f"{algorithm.name.upper()} needs a calibration forward pass, which runs layer after layer in one process"
           if algorithm.needs_calibration else
           f"static KV-cache scales ({kv.describe()}) are observed on a calibration forward pass"
           if kv is not None and kv.static else
           f"algorithm {algorithm.name} does not quantize each linear on its own" if not algorithm.per_linear else
           "--no-stream loads the whole model in one process" if not stream else
           "an already-quantized source's weights are carried, not converted" if packed else
           f"torchrun's {ranks} ranks divide the experts already" if ranks > 1 else None)
    if why is None:
        return None
    return (f"--workers {workers}: {why}; only data-free recipes run in several workers (RTN or FP8 weights, float "
            "weights, dynamic or no KV scales): use --workers 1")


@dataclass(frozen=True)
class Unit:
    """One piece of work: decoder layer ``layer`` whole (``group`` None), or its non-expert part
    (``group`` 0) or its ``group``-th group of routed experts; ``size``: the weights it holds."""

    layer: int
    group: int | None
    size: int


def plan_units(writer: LayerWriter, n_layers: int) -> tuple[list[Unit], dict[int, list[list[str]] | None]]:
    """The units of layers ``writer.start`` to ``n_layers - 1`` in one process's order, and each
    layer's groups (:meth:`~compressor.staging.LayerWriter.expert_groups`: ``None`` for a layer read
    whole; else its tensor names, the non-expert ones first)."""
    from .moe_ranks import split_layer

    units, groups = [], {}
    for i in range(writer.start, n_layers):
        g = groups[i] = writer.expert_groups(i)
        sizes = split_layer(writer.model, writer.arch, i, 1)[2]
        if g is None:
            units.append(Unit(i, None, sum(sizes.values())))
        else:
            units += [Unit(i, k, sum(sizes[n] for n in names)) for k, names in enumerate(g)]
    return units, groups


def assign(units: list[Unit], workers: int) -> list[list[Unit]]:
    """``units`` dealt to ``workers`` as contiguous runs of about equal size: unit ``u`` goes to the
    worker whose share of the total holds the middle of ``u`` (each worker reads the source
    forwards; the same split for the same units and ``workers``)."""
    total = sum(u.size for u in units) or 1
    shares: list[list[Unit]] = [[] for _ in range(workers)]
    at = 0
    for u in units:
        shares[min(workers - 1, (2 * at + u.size) * workers // (2 * total))].append(u)
        at += u.size
    return shares


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to open the source and write parts (picklable: it travels to a new interpreter)."""

    source: object  # compressor.source.resolve.ModelSource
    recipe: object  # compressor.recipe.Recipe, the effective one
    fmt: str
    dtype: torch.dtype  # storage dtype of scales and float tensors
    staging: Path  # the staging folder the parts go into
    memory_budget_gib: float
    threads: int  # torch's intra-op threads of each worker


class _PartWriter(LayerWriter):
    """A worker's :class:`~compressor.staging.LayerWriter`: it writes parts; the main process keeps the checkpoint."""

    def checkpoint(self, i, result, hidden) -> None:
        pass


def quantize_with_workers(model, recipe, writer: LayerWriter, spec: WorkerSpec, workers: int,
                          on_layer=None) -> QuantizeResult:
    """The data-free layer loop of :func:`compressor.pipeline.quantize_model` divided among ``workers``
    processes (see the module docstring); ``model``: the streamed source's model (decoder layers on
    ``meta``), ``writer`` its :class:`~compressor.staging.LayerWriter` (restored when resuming);
    ``on_layer(i, n, figures)`` as the layers finish, in order.

    Raises:
        InputError: the source or recipe (as one process raises it: a NaN in a tensor, a group size).
        CheckFailed: a worker died (named).
        QuantizationError: a non-finite value was produced (named, as one process names it).
    """
    if writer.ckpt is None:
        raise InputError(f"--workers {workers}: the source is loaded whole, not streamed (see the source_loading "
                         "line); only a streamed source is divided among workers: use --workers 1")
    t0 = time.perf_counter() - sum(f.get("seconds", 0.0) for f in writer.layers)
    plan = _plan(model, recipe, None)  # the refusals of one process, and the schemes its figures show
    result = QuantizeResult(group_size=plan.group_size, warnings=plan.warnings)
    result.layers += writer.layers
    result.moe += writer.moe
    ctx = LayerContext(plan.arch, recipe, LinearQuantizer(plan.schemes, spec.dtype), plan.targets, result.modules,
                       None, 1)
    layers = get_module(model, plan.arch.layers)
    units, groups = plan_units(writer, len(layers))
    writer.release_outer()  # the embedding and head are read again for the last part
    pool = _Pool(spec, assign(units, workers))
    try:
        pool.start()
        got: dict[tuple, dict] = {}
        for i in range(writer.start, len(layers)):
            keys = [None] if groups[i] is None else list(range(len(groups[i])))
            while any((i, k) not in got for k in keys):
                got.update(pool.next_units())
            _layer_done(i, layers[i], [got.pop((i, k)) for k in keys], groups[i], ctx, plan, result, writer)
            if on_layer is not None:
                on_layer(i, len(layers), result.layers[-1])
        pool.finish()
    finally:
        pool.stop()
    model_bytes = getattr(writer.ckpt, "bytes_read", 0)
    writer.ckpt.bytes_read = model_bytes + sum(w["bytes_read"] for w in pool.ends)  # the source read by all
    writer.ckpt.expert_bytes_read += sum(w["expert_bytes_read"] for w in pool.ends)
    result.workers = pool.ends
    result.warnings += plan.algorithm.run_warnings(result.layers) + search_warnings(result.layers, recipe.kv_cache)
    result.seconds = time.perf_counter() - t0
    return result


def _layer_done(i: int, layer, reports: list[dict], groups, ctx: LayerContext, plan, result: QuantizeResult,
                writer: LayerWriter) -> None:
    """Layer ``i``'s units (``reports``, in group order) recorded as one process records the layer:
    its figures, MoE record, schemes and parts (the expert groups' before the non-expert part's),
    then the resume checkpoint."""
    errs = [e for r in reports for e in r["errs"]]  # the non-expert part's first, then each group's
    extra = {} if groups is None else {"weight_groups": len(groups)}
    fig = layer_figures(i, ctx.quantizer.schemes, f"{ctx.arch.layers}.{i}.", errs, None, 0.0, **extra)
    fig["seconds"] = round(sum(r["seconds"] for r in reports), 3)
    _record_moe(i, layer, ctx, plan.algorithm, result, None)
    result.layers.append(fig)
    staging = writer.staging
    for r in reports[1:] + reports[:1]:  # one process writes the expert groups, then the layer's own part
        writer._add_schemes(dict(r["schemes"]))
        for name, digest in r["parts"]:
            path = staging.path / name
            if path not in staging.parts:
                staging.parts.append(path)
            staging.state.setdefault("digests", {})[name] = digest  # hashed by the worker: not read again here
    writer.checkpoint(i, result, None)


class _Pool:
    """The worker processes, their pipes, and what they reported."""

    def __init__(self, spec: WorkerSpec, shares: list[list[Unit]]):
        self.spec, self.shares = spec, shares
        self.procs: list = []
        self.conns: list = []
        self.ends: list[dict] = []  # each worker's last report: bytes read, peak RSS
        self._ended: set[int] = set()

    def start(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context(START_METHOD)
        threads = max(1, self.spec.threads // len(self.shares))
        spec = dataclasses.replace(self.spec, threads=threads)
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # inherited: Ctrl-C reaches the main
        try:  # process alone, which stops the workers
            for w, share in enumerate(self.shares):
                ours, theirs = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_work, args=(spec, w, len(self.shares), share, theirs, os.getpid()),
                                name=f"kvq-worker-{w}", daemon=True)
                p.start()
                theirs.close()
                self.procs.append(p)
                self.conns.append(ours)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def next_units(self) -> dict[tuple, dict]:
        """Wait for reports; ``{(layer, group): report}`` of the units finished meanwhile."""
        from multiprocessing.connection import wait

        live = [w for w in range(len(self.procs)) if w not in self._ended]
        if not live:
            raise CheckFailed("the workers ended before every layer was reported (internal)")
        ready = wait([self.conns[w] for w in live] + [self.procs[w].sentinel for w in live], timeout=1.0)
        out: dict[tuple, dict] = {}
        for w in live:
            if self.conns[w] in ready or self.procs[w].sentinel in ready:
                out.update(self._drain(w))
        return out

    def _drain(self, w: int) -> dict[tuple, dict]:
        """Every message worker ``w`` has sent; a worker gone without its last report is named."""
        out: dict[tuple, dict] = {}
        conn = self.conns[w]
        while w not in self._ended and (conn.poll() or not self.procs[w].is_alive()):
            try:
                kind, *body = conn.recv()
            except (EOFError, OSError):
                self.procs[w].join(5)
                raise CheckFailed(f"worker {w} of {len(self.procs)} died ({_how(self.procs[w].exitcode)}) while "
                                  f"converting {_span(self.shares[w])}; the run stops, no artifact was written"
                                  ) from None
            if kind == "unit":
                out[(body[0], body[1])] = body[2]
            elif kind == "end":
                self.ends.append({"worker": w, **body[0]})
                self._ended.add(w)
            else:  # "error": the worker's own error, raised again here as one process raises it
                cls = getattr(errors, body[0], None)
                if isinstance(cls, type) and issubclass(cls, errors.KvqError):
                    raise cls(body[1])
                raise RuntimeError(f"worker {w}: {body[0]}: {body[1]}")
        return out

    def finish(self) -> None:
        while len(self._ended) < len(self.procs):
            self.next_units()
        for p in self.procs:
            p.join()
        self.ends.sort(key=lambda e: e["worker"])

    def stop(self) -> None:
        """End every worker still running (SIGTERM, then SIGKILL after 5 s) and wait for it."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _span(share: list[Unit]) -> str:
    layers = sorted({u.layer for u in share})
    if not layers:
        return "nothing"
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"


def _work(spec: WorkerSpec, w: int, n: int, share: list[Unit], conn, parent: int) -> None:
    """A worker process: open the source, convert ``share`` unit by unit, report each on ``conn``.
    Its own process state (threads, the watch on its parent) is set here, in its own interpreter."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(spec.threads)
    try:
        _convert(spec, share, conn)
    except errors.KvqError as e:
        conn.send(("error", type(e).__name__, str(e)))
    except BaseException as e:  # noqa: BLE001 -- reported to the main process, which stops the run
        conn.send(("error", type(e).__name__, errors.first_line(e)))
    conn.close()


def _watch_parent(parent: int) -> None:
    """End this worker when the main process is gone (killed without stopping its workers)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


@torch.no_grad()
def _convert(spec: WorkerSpec, share: list[Unit], conn) -> None:
    """Open the source (decoder layers only) and convert each layer of ``share``."""
    from .source.open import open_lazy
    from .source.lazy import to_meta

    model, _, ckpt = open_lazy(spec.source, defer_head=True, outer=False)
    arch = get_arch(model.config.model_type)
    plan = _plan(model, spec.recipe, None)
    result = QuantizeResult(group_size=plan.group_size)
    ctx = LayerContext(plan.arch, spec.recipe, LinearQuantizer(plan.schemes, spec.dtype), plan.targets,
                       result.modules, None, 1)
    writer = _PartWriter(model, arch, ckpt, Staging(spec.staging, ""), spec.fmt, spec.dtype,
                         lambda name: checkpoint_name(arch, name), 0.0, spec.memory_budget_gib)
    layers = get_module(model, arch.layers)
    for i in sorted({u.layer for u in share}):
        owned = {u.group for u in share if u.layer == i}
        if owned == {None}:
            reports = {None: _whole(i, layers[i], ctx, plan, writer, result)}
        else:
            reports = _grouped(i, layers[i], writer.expert_groups(i), owned, ctx, plan, writer, result)
            to_meta(layers[i])
        for k, r in reports.items():
            conn.send(("unit", i, k, r))
    conn.send(("end", {"bytes_read": ckpt.bytes_read, "expert_bytes_read": ckpt.expert_bytes_read,
                       "peak_rss_mib": peak_rss_mib(), "units": len(share)}))


def _whole(i, layer, ctx, plan, writer: LayerWriter, result) -> dict:
    """Layer ``i`` read whole, quantized and written (one process's ``_quantize_layer``); its report."""
    mark, t = _mark(writer), time.perf_counter()
    writer.load(i, layer)
    errs = plan.algorithm.quantize_layer(i, layer, None, None, ctx).errs
    writer.done(i, layer, result, None)
    return _since(writer, mark, {"errs": errs, "seconds": time.perf_counter() - t})


def _grouped(i, layer, groups: list[list[str]], owned: set, ctx, plan, writer: LayerWriter, result) -> dict:
    """The units ``owned`` of layer ``i`` read in ``groups`` (0: the non-expert part, written last
    as one process writes it; ``k``: the ``k``-th group of experts, written as the next is read);
    ``{group: report}``."""
    keys = [0 if 0 in owned else None] + sorted(k for k in owned if k)
    reads = [groups[0] if 0 in owned else []] + [groups[k] for k in keys[1:]]  # []: reads nothing
    reports: dict = {}
    pending = None  # (group, mark): the expert group the generator writes when it resumes
    for j, modules in enumerate(writer.load_groups(i, result, reads)):  # to its end: it writes the last group
        key = keys[j]
        if pending is not None:
            reports[pending[0]] = _since(writer, pending[1], reports[pending[0]])
            pending = None
        if key is None:
            continue
        mark, t = _mark(writer), time.perf_counter()
        sub = dataclasses.replace(ctx, targets={n: ctx.targets[n] for n in modules if n in ctx.targets})
        reports[key] = {"errs": plan.algorithm.quantize_layer(i, layer, None, None, sub).errs,
                        "seconds": time.perf_counter() - t}
        pending = (key, mark) if key else None
    if pending is not None:
        reports[pending[0]] = _since(writer, pending[1], reports[pending[0]])
    if 0 in owned:
        writer._written = {n for g in groups[1:] for n in g}  # the layer's experts: in their groups' parts
        mark, t = _mark(writer), time.perf_counter()
        writer.done(i, layer, result, None)
        reports[0]["seconds"] += time.perf_counter() - t
        reports[0] = _since(writer, mark, reports[0])
    return reports


def _mark(writer: LayerWriter) -> tuple[int, int]:
    return len(writer.schemes), len(writer.staging.parts)


def _since(writer: LayerWriter, mark: tuple[int, int], report: dict) -> dict:
    """``report`` with the schemes and parts (name, SHA-256) ``writer`` added since ``mark``."""
    parts = writer.staging.parts[mark[1]:]
    return {**report, "schemes": [(k, list(v)) for k, v in list(writer.schemes.items())[mark[0]:]],
            "parts": [(p.name, file_digest(p)) for p in parts]}
