"""Several processes quantizing one model together, through ``torch.distributed``.

Launch ``kvq quantize`` under ``torchrun`` (it sets ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT``); docs/distributed.md has the command lines for one
machine and for several::

    torchrun --nproc-per-node 2 .venv/bin/kvq quantize MODEL --recipe w4a16-gptq -o OUT

Every rank runs the same layer-by-layer pass (same calibration activations, same
Hessians). In a MoE layer of a streamed source each rank reads, calibrates and quantizes only
its own block of the routed experts (:mod:`compressor.moe_ranks`: :func:`alone`, :func:`post`,
:func:`broadcast`); the other GPTQ solves of each pass are dealt round-robin to the ranks
(:func:`deal`), and each rank's results are broadcast from it as flat tensors (no pickling)
before any rank moves on, so every rank holds the same quantized layer and the artifact is
bit-identical to a single-process run. Rank 0 writes the artifact and the resume checkpoint; a ``--resume`` run
takes the checkpoint's activations from rank 0 (:func:`share`), whatever the number of ranks
that wrote it. Backend: ``gloo`` on CPU (the tested path), ``nccl`` with ``--device cuda``
(one GPU per rank, ``LOCAL_RANK``). The KV observers run on every rank unchanged; AWQ's scale
search on every rank, its sums over a MoE layer's experts combined across them (:mod:`compressor.moe_ranks`).

Faults (:class:`Watch`): every rank beats a counter in the rendezvous store (the TCPStore that
``torchrun``'s agent, or rank 0 without it, keeps at ``MASTER_ADDR:MASTER_PORT``) once a
second and reads the others'. A rank whose counter stops for :data:`PEER_TIMEOUT_S` seconds
(``KVQ_PEER_TIMEOUT_S``), or for :data:`SUSPECT_S` once a collective has failed or a signal
came, is dead; one that stopped on its own error or interruption says so in the store. Either
way every other rank prints one line naming it and exits 1 (:data:`FAULT_EXIT`) -- from the
watch thread itself, as the main thread may be blocked inside a collective that only a timeout
of 30 minutes would end. This is the one place outside ``cli.py`` that ends the process.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable

import torch

from .errors import InputError, KvqError, first_line
from .flat import pack, unpack

#: seconds without a heartbeat after which a running rank is declared lost (``KVQ_PEER_TIMEOUT_S`` overrides)
PEER_TIMEOUT_S = 30.0
#: once a collective failed or a signal came: a rank whose heartbeat stops this long is dead
SUSPECT_S = 5.0
#: how long a collective may wait for a live peer (torch's own default for gloo)
COLLECTIVE_TIMEOUT_S = 1800
#: what a rank exits with when another rank was lost or stopped
FAULT_EXIT = 1

#: a rank's state in the store: still running, past its last collective, or stopped
RUNNING, FINISHED, ERROR, INTERRUPTED, PEER_STOPPED = 0, 1, 2, 3, 4


def setup(device: str) -> tuple[int, int, str]:
    """Join the process group that ``torchrun`` describes (if any) and start the
    :class:`Watch` of the other ranks.

    Returns:
        ``(rank, world_size, device)``; ``(0, 1, device)`` outside ``torchrun``. With CUDA
        the device becomes ``cuda:<LOCAL_RANK>``.

    Raises:
        InputError: a malformed ``WORLD_SIZE``/``RANK``/``KVQ_PEER_TIMEOUT_S``, or the process
            group cannot form.
    """
    import torch.distributed as dist

    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        raise InputError("WORLD_SIZE and RANK must be integers (launch with torchrun)") from None
    if world <= 1:
        return 0, 1, device
    timeout = peer_timeout()
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        except Exception as e:  # connection, rendezvous or backend errors
            raise InputError(f"cannot join the torch.distributed group (rank {rank} of {world}, {backend}): "
                             f"{first_line(e)}") from None
    rank, world = dist.get_rank(), dist.get_world_size()
    if _watch.get("now") is None:
        _watch["now"] = Watch.connect(rank, world, timeout)
    return rank, world, device


def peer_timeout() -> float:
    """:data:`PEER_TIMEOUT_S`, or ``KVQ_PEER_TIMEOUT_S`` (seconds, 1 to 600).

    Raises:
        InputError: ``KVQ_PEER_TIMEOUT_S`` is not a number in that range.
    """
    text = os.environ.get("KVQ_PEER_TIMEOUT_S", "")
    if not text:
        return PEER_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 1 <= value <= 600:
        raise InputError(f"KVQ_PEER_TIMEOUT_S must be a number of seconds from 1 to 600, not {text!r}")
    return value


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the current process group, ``(0, 1)`` without one or inside
    :func:`alone`."""
    import torch.distributed as dist

    if not _alone and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_alone: list = []  # non-empty inside alone()


@contextmanager
def alone():
    """Work this rank does by itself (a routed expert it owns, :mod:`compressor.moe_ranks`):
    inside, :func:`world` is ``(0, 1)``, so :func:`deal` solves every task here and
    :func:`share` sends nothing -- the same calls, in the same order, as a single process."""
    _alone.append(True)
    try:
        yield
    finally:
        _alone.pop()


# ---------------------------------------------------------------------------------------
# collectives of flat tensors (compressor.flat)

def _comm_device() -> torch.device:
    """Where collectives take their tensors: the current GPU under nccl, else the CPU."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def share(obj, src: int = 0):
    """``obj`` of rank ``src`` on every rank (the others pass anything, e.g. ``None``), sent as
    three broadcasts of flat tensors (:func:`pack`: sizes, codes, bytes); ``obj`` itself
    without a process group.

    Raises:
        TypeError: ``obj`` holds what :func:`pack` cannot send.
    """
    import torch.distributed as dist

    rank, size = world()
    if size == 1:
        return obj
    dev = _comm_device()
    if rank == src:
        sizes, codes_t, payload = _encode(obj, dev)
    else:
        sizes = torch.empty(2, dtype=torch.int64, device=dev)
    _collective(dist.broadcast, sizes, src)
    if rank != src:
        codes_t = torch.empty(int(sizes[0]), dtype=torch.int64, device=dev)
        payload = torch.empty(int(sizes[1]), dtype=torch.uint8, device=dev)
    _collective(dist.broadcast, codes_t, src)
    if payload.numel():
        _collective(dist.broadcast, payload, src)
    return obj if rank == src else unpack(codes_t.tolist(), payload)


def broadcast(tensor: torch.Tensor, src: int) -> None:
    """Rank ``src``'s ``tensor`` into ``tensor`` on every rank, in place (a failure waits for the
    watch to name a lost rank, as every collective here)."""
    import torch.distributed as dist

    _collective(dist.broadcast, tensor, src)


def all_max(tensor: torch.Tensor) -> None:
    """``tensor`` replaced in place, on every rank, by its elementwise maximum over the ranks (an
    all-reduce with ``MAX``: the same value in any order of the ranks)."""
    import torch.distributed as dist

    _collective(lambda x, _s: dist.all_reduce(x, op=dist.ReduceOp.MAX), tensor, 0)


def send(tensor: torch.Tensor, dst: int) -> None:
    """``tensor`` to rank ``dst`` alone (point to point; it calls :func:`recv` at the same step)."""
    import torch.distributed as dist

    _collective(dist.send, tensor, dst)


def recv(tensor: torch.Tensor, src: int) -> None:
    """Rank ``src``'s :func:`send` into ``tensor``, in place."""
    import torch.distributed as dist

    _collective(dist.recv, tensor, src)


def _encode(obj, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``obj`` as the three tensors :func:`share` and :func:`gather` send: ``int64 [2]`` (how
    many codes, how many bytes), the codes and the bytes (:func:`pack`), on ``dev``."""
    codes, chunks = pack(obj)
    payload = torch.cat([c.to(dev) for c in chunks]) if chunks else torch.empty(0, dtype=torch.uint8, device=dev)
    sizes = torch.tensor([len(codes), payload.numel()], dtype=torch.int64, device=dev)
    return sizes, torch.tensor(codes, dtype=torch.int64, device=dev), payload


def gather(obj, dst: int = 0) -> list | None:
    """Every rank's ``obj`` on rank ``dst``, in rank order (the others get None), each sent to
    it alone as flat tensors (:func:`post`, then :func:`receive` there); ``[obj]`` without a
    process group.

    Raises:
        TypeError: ``obj`` holds what :func:`pack` cannot send.
    """
    rank, size = world()
    if size == 1:
        return [obj]
    if rank != dst:
        wait(post(obj, dst))
        return None
    return [obj if src == rank else receive(src) for src in range(size)]


def post(obj, dst: int = 0) -> list:
    """Start sending ``obj`` to rank ``dst`` alone, without waiting for it to arrive: its three
    flat tensors (:func:`pack`: sizes, codes, bytes) go with ``isend``, in order, and rank ``dst``
    takes them with :func:`receive` whenever it comes to it. Returns the pending sends, for
    :func:`wait`: ``[(work, tensor), ...]``, whose tensors (held by it) are ``obj``'s bytes.

    Raises:
        TypeError: ``obj`` holds what :func:`pack` cannot send.
    """
    import torch.distributed as dist

    out = []
    for t in _encode(obj, _comm_device()):
        if t.numel():
            _collective(lambda x, d: out.append((dist.isend(x, d), x)), t, dst)
    return out


def wait(posted: list) -> None:
    """Until every send of ``posted`` (:func:`post`) has arrived (a lost peer: as every collective)."""
    for work, t in posted:
        _collective(lambda _x, _d: work.wait(), t, 0)


def receive(src: int):
    """The next object rank ``src`` sent this rank (:func:`post`, :func:`gather`), unpacked."""
    dev = _comm_device()
    sizes = torch.empty(2, dtype=torch.int64, device=dev)
    recv(sizes, src)
    codes_t = torch.empty(int(sizes[0]), dtype=torch.int64, device=dev)
    payload = torch.empty(int(sizes[1]), dtype=torch.uint8, device=dev)
    recv(codes_t, src)
    if payload.numel():
        recv(payload, src)
    return unpack(codes_t.tolist(), payload)


def deal(tasks: list, solve: Callable[[object], object], costs: list[float] | None = None) -> list:
    """Solve ``tasks`` across the ranks: task ``j`` on rank ``j % world_size``, or, with ``costs``
    (each task's expected work, the same list on every rank), on the rank :func:`owners` gives it;
    returns every task's result, in order, on every rank, each rank's results broadcast from it
    as flat tensors (:func:`share`), bit for bit. Without a process group: ``[solve(t) ...]``.

    Raises:
        TypeError: a result holds what :func:`pack` cannot send.
    """
    rank, size = world()
    if size == 1:
        return [solve(t) for t in tasks]
    owner = owners(costs, size) if costs is not None else [j % size for j in range(len(tasks))]
    mine = {j: solve(t) for j, t in enumerate(tasks) if owner[j] == rank}
    merged: dict = {}
    for src in range(size):
        merged.update(share(mine if src == rank else None, src))
    return [merged[j] for j in range(len(tasks))]


def owners(costs: list[float], size: int) -> list[int]:
    """The rank of each task of ``costs`` (expected work) among ``size`` ranks: largest first, each
    to the rank with the least work so far (the lowest rank on a tie; Graham's LPT rule, within
    4/3 of the best makespan), the same on every rank for the same ``costs``."""
    load, out = [0.0] * size, [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        out[j] = min(range(size), key=lambda r: (load[r], r))
        load[out[j]] += costs[j]
    return out


def _collective(op, tensor: torch.Tensor, src: int) -> None:
    """``op(tensor, src)``; a failure (a peer's connection closed) waits for the watch to name
    the rank at fault (:meth:`Watch.settle`, which then ends the process) before it is raised."""
    try:
        op(tensor, src)
    except Exception:
        w = _watch.get("now")
        if w is not None:
            w.settle(own=False)
        raise


# ---------------------------------------------------------------------------------------
# faults

_watch: dict = {}  # "now": the running Watch, if any


class Watch:
    """The heartbeat of this rank and the watch over the others, in a daemon thread.

    Keys in the rendezvous store, under a prefix of the run (torchrun's run id and restart
    count, and how many watches this rank started before): ``hb/<r>`` (a counter rank ``r``
    raises every ``interval`` seconds), ``state/<r>`` (:data:`RUNNING` ... :data:`PEER_STOPPED`)
    and ``lost/<r>`` (raised by the rank that found ``r`` dead, so the others name the same
    rank). ``stop(line)`` ends the process (:func:`_stop_process`); tests pass their own.
    """

    def __init__(self, store, rank: int, size: int, timeout: float, prefix: str, where: str = "",
                 stop: Callable[[str], None] | None = None):
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        self.prefix, self.where = prefix, where
        self.interval = min(1.0, timeout / 10)
        self.suspect_after = min(timeout, max(SUSPECT_S, 3 * self.interval))
        self.stop_fn = stop or _stop_process
        self.note: Callable[[], str] | None = None  # rank 0: where the finished layers are kept
        self.suspect = False  # a collective failed or a signal came: a short silence is death
        self.own_stop = False  # stopping for a reason of its own: the others' stops are not news
        self.settled = threading.Event()
        self._marks: dict | None = None  # heartbeats at the first read after settle() began
        self._io = threading.Lock()  # one store request at a time
        self._done = threading.Event()
        self._fired = False
        self._peers = [p for p in range(size) if p != rank]
        self._keys = [self._key(k, p) for p in range(size) for k in ("hb", "state", "lost")]
        with self._io:
            for k in self._keys:  # every key exists before anyone reads it (multi_get waits for missing ones)
                self.store.add(k, 0)
        self._thread = threading.Thread(target=self._loop, name="kvq-watch", daemon=True)
        self._thread.start()

    @classmethod
    def connect(cls, rank: int, size: int, timeout: float) -> "Watch":
        """A watch on a new connection to the store at ``MASTER_ADDR:MASTER_PORT``.

        Raises:
            InputError: the store does not answer.
        """
        import torch.distributed as dist

        host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                                  wait_for_workers=False)
            env = os.environ
            run = f"kvq/watch/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            generation = store.add(f"{run}/gen/{rank}", 1)
        except Exception as e:
            raise InputError(f"cannot reach the rendezvous store at {host}:{port} (rank {rank} of {size}): "
                             f"{first_line(e)}") from None
        return cls(store, rank, size, timeout, f"{run}/{generation}", f"{host}:{port}")

    def _key(self, kind: str, r: int) -> str:
        return f"{self.prefix}/{kind}/{r}"

    def _loop(self) -> None:
        last = {p: (-1, time.monotonic()) for p in self._peers}
        while not self._done.is_set():
            try:
                with self._io:
                    self.store.add(self._key("hb", self.rank), 1)
                    values = [int(v) for v in self.store.multi_get(self._keys)]
            except Exception:
                if not self._done.is_set():
                    self._fire(self._store_lost(last))
                return
            line = self._judge({r: values[3 * r:3 * r + 3] for r in range(self.size)}, last)
            if line:
                self._fire(line)
                return
            self._done.wait(self.interval)

    def _store_lost(self, last: dict) -> str:
        """The line when the store stops answering: it lives in rank 0 (or in torchrun's agent
        on rank 0's machine), unless a running rank had gone silent first."""
        now = time.monotonic()
        silent = {p: now - t for p, (_, t) in last.items()}
        p = max(silent, key=silent.get, default=0)
        if p != 0 and silent[p] > 2 * self.interval + 1:
            return (f"kvq: rank {p} of {self.size} died: no heartbeat for {silent[p]:.0f} s, then the rendezvous "
                    f"store at {self.where} stopped answering; rank {self.rank} stops too")
        return (f"kvq: rank 0 of {self.size} is gone (the rendezvous store at {self.where} that it, or torchrun on "
                f"its machine, keeps stopped answering); rank {self.rank} stops too")

    def _judge(self, seen: dict, last: dict) -> str | None:
        """The line to stop with, from every rank's ``[hb, state, lost]``; None while all is well."""
        now = time.monotonic()
        of = f"of {self.size}"
        lost = [r for r in self._peers if seen[r][2]]
        if lost:
            return f"kvq: rank {lost[0]} {of} died (its heartbeat stopped); rank {self.rank} stops too"
        for p in self._peers:
            hb, state, _ = seen[p]
            if state in (ERROR, INTERRUPTED) and not self.own_stop:
                why = "stopped on an error (its own line says which)" if state == ERROR else "was interrupted"
                return f"kvq: rank {p} {of} {why}; rank {self.rank} stops too"
            if state != RUNNING:
                last.pop(p, None)  # finished, or stopping: its silence says nothing
                continue
            if hb != last[p][0]:
                last[p] = (hb, now)
                continue
            silent = now - last[p][1]
            if silent > (self.suspect_after if self.suspect else self.timeout):
                with self._io:
                    self.store.add(self._key("lost", p), 1)
                how = ("died" if self.suspect else
                       "stopped responding (it died, hangs, or its machine is unreachable)")
                return f"kvq: rank {p} {of} {how}: no heartbeat for {silent:.0f} s; rank {self.rank} stops too"
        if self._marks is None and self.suspect:
            self._marks = {p: seen[p][0] for p in self._peers}
        elif self._marks is not None and all(seen[p][0] > self._marks[p] or seen[p][1] != RUNNING
                                             for p in self._peers):
            self.settled.set()  # every other rank is alive or has said why it stopped
        return None

    def _fire(self, line: str) -> None:
        if self._fired or self._done.is_set():
            return
        self._fired = True
        try:
            with self._io:
                self.store.add(self._key("state", self.rank), PEER_STOPPED)
        except Exception:
            pass  # the store is what was lost
        note = self.note() if self.note is not None else ""
        self.stop_fn(line + note)

    def settle(self, own: bool) -> None:
        """After a failed collective or a signal (``own``: this rank stops for a reason of its
        own, an error or a signal): wait until every other rank is seen alive -- its heartbeat
        moved after the first read since the call -- or has said why it stopped; a rank silent
        for ``suspect_after`` seconds meanwhile is dead and the watch ends the process. Returns
        (then this rank's own reason goes on) when none is, or after ``suspect_after`` plus three
        heartbeats."""
        self.own_stop = own
        self._marks = None
        self.suspect = True
        self.settled.wait(self.suspect_after + 3 * self.interval)

    def say(self, state: int, linger: float = 0.0) -> None:
        """Record this rank's ``state`` (:data:`FINISHED` ...) and end the watch; then wait up to
        ``linger`` seconds until every other rank has stopped running (rank 0 keeps the store
        without torchrun: the others read why before it goes). The watch thread has ended
        when it returns."""
        self._done.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.timeout)  # its last store request, if one is under way
        deadline = time.monotonic() + linger
        try:
            with self._io:
                self.store.add(self._key("state", self.rank), state)
            while time.monotonic() < deadline:
                with self._io:
                    states = [int(v) for v in self.store.multi_get([self._key("state", p) for p in self._peers])]
                if all(v != RUNNING for v in states):
                    return
                time.sleep(self.interval / 4)
        except Exception:
            pass  # a store already gone: the others find out by themselves


def _stop_process(line: str) -> None:
    """Print ``line`` on stderr and end the process with :data:`FAULT_EXIT` at once: the main
    thread may be blocked in a collective, and the run cannot go on without the lost rank."""
    if os.isatty(2):
        os.write(2, b"\n\x1b[?25h")  # past a progress bar, cursor shown again
    os.write(2, (line + "\n").encode())
    os._exit(FAULT_EXIT)


def on_stop(note: Callable[[], str]) -> None:
    """``note()`` is appended to the line a lost rank makes this rank stop with (rank 0: where
    the finished layers are kept for ``--resume``)."""
    w = _watch.get("now")
    if w is not None:
        w.note = note


def finished() -> None:
    """This rank is past its last collective: it says so, its watch ends (rank 0, which keeps
    the store without torchrun, may exit while the others finish) and the process group is
    destroyed. Without that, gloo's worker threads still run when the interpreter exits and
    the process may end in ``std::terminate`` (SIGABRT) after a run that succeeded. After
    it, :func:`world` is ``(0, 1)``."""
    import torch.distributed as dist

    w = _watch.pop("now", None)
    if w is not None:
        w.say(FINISHED)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def watched():
    """Around a command under several ranks: an exception or a signal leaving it first lets the
    watch find a rank that died meanwhile (:meth:`Watch.settle`: then the process ends with the
    line naming it), then tells the other ranks why this one stops; no-op without a watch."""
    try:
        yield
    except BaseException as e:
        w = _watch.pop("now", None)
        if w is not None:
            w.settle(own=isinstance(e, (KvqError, KeyboardInterrupt)))
            keeps_store = w.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            w.say(INTERRUPTED if isinstance(e, KeyboardInterrupt) else ERROR,
                  linger=w.suspect_after if keeps_store else 0.0)
        raise
    finished()
