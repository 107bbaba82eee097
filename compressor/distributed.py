"""Several processes quantizing one model together, through ``torch.distributed``.

Launch ``kvq quantize`` under ``torchrun`` (it sets ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT``)::

    torchrun --nproc-per-node 2 .venv/bin/kvq quantize MODEL --recipe w4a16-gptq -o OUT

Every rank runs the same layer-by-layer pass (same calibration activations, same
Hessians); the GPTQ solves of each pass -- one per linear, experts included, the part
whose cost grows with width and expert count -- are dealt round-robin to the ranks, and
the results are exchanged with ``all_gather_object`` before any rank moves on, so every
rank holds the same quantized layer and the artifact is bit-identical to a
single-process run. Rank 0 writes the artifact; the others write nothing. Backend:
``gloo`` on CPU (the tested path), ``nccl`` with ``--device cuda`` (one GPU per rank,
``LOCAL_RANK``). RTN, AWQ's search and KV observers run on every rank unchanged.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from .errors import InputError


def setup(device: str) -> tuple[int, int, str]:
    """Join the process group that ``torchrun`` describes (if any).

    Returns:
        ``(rank, world_size, device)``; ``(0, 1, device)`` outside ``torchrun``. With CUDA
        the device becomes ``cuda:<LOCAL_RANK>``.

    Raises:
        InputError: a malformed ``WORLD_SIZE``/``RANK``, or the process group cannot form.
    """
    import torch.distributed as dist

    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        raise InputError("WORLD_SIZE and RANK must be integers (launch with torchrun)") from None
    if world <= 1:
        return 0, 1, device
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    try:
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    except Exception as e:  # connection, rendezvous or backend errors
        raise InputError(f"cannot join the torch.distributed group (rank {rank} of {world}, {backend}): {e}") from None
    return rank, world, device


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the current process group, ``(0, 1)`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def deal(tasks: list, solve: Callable[[object], object]) -> list:
    """Solve ``tasks`` across the ranks: task ``j`` on rank ``j % world_size``; returns
    every task's result, in order, on every rank (``all_gather_object``; tensors are
    pickled, which is what gloo carries). Without a process group: ``[solve(t) ...]``."""
    import torch.distributed as dist

    rank, size = world()
    if size == 1:
        return [solve(t) for t in tasks]
    mine = {j: solve(t) for j, t in enumerate(tasks) if j % size == rank}
    gathered: list = [None] * size
    dist.all_gather_object(gathered, mine)
    merged: dict = {}
    for part in gathered:
        merged.update(part)
    return [merged[j] for j in range(len(tasks))]
