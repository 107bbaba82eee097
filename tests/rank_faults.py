"""``kvq`` (:func:`compressor.entry.main`) with one rank made to fail in the middle of a decoder
layer: the driver of tests/test_distributed.py and bench/dist_faults.py, run as a script in
place of ``kvq`` (``torchrun ... tests/rank_faults.py quantize ...``).

``KVQ_FAULT=RANK:LAYER:HOW``: rank ``RANK`` (``$RANK``), at its first GPTQ solve of decoder
layer ``LAYER``, does ``HOW``: ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself: a hung
process or an unreachable machine) or ``error`` (an input error of its own); under ``verify``, at
the start of the ``LAYER``-th evaluation window it evaluates (from 0). ``KVQ_FAULT_STAMP``:
a file that gets ``time.time()`` just before. ``KVQ_NO_PICKLE=1``: torch.distributed's object
collectives raise (results must travel as tensors). ``KVQ_READS=DIR``: each tensor name the
rank reads from the source is appended to ``DIR/rank<RANK>.txt``. ``KVQ_CODE``: the checkout
whose ``compressor`` runs (default: this one).
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("KVQ_CODE") or str(Path(__file__).resolve().parents[1]))

try:
    from compressor.entry import ranks_defaults  # noqa: E402
except ImportError:  # KVQ_CODE: a checkout from before it (bench/dist_faults.py BEFORE=)
    pass
else:
    ranks_defaults()  # as kvq's entry point does before torch loads

import compressor.quant.algorithms  # noqa: E402,F401 (registers the layer algorithms)
import compressor.quant.gptq_layer as pl  # noqa: E402


def _fault(how: str) -> None:
    stamp = os.environ.get("KVQ_FAULT_STAMP")
    if stamp:
        Path(stamp).write_text(repr(time.time()))
    if how == "error":
        from compressor.errors import InputError

        raise InputError(f"a simulated input error on rank {os.environ.get('RANK')}")
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def _patch() -> None:
    rank, layer, how = os.environ["KVQ_FAULT"].split(":")
    real_layer, real_deal = pl.gptq_layer, pl.deal
    at = {"layer": -1}

    def gptq_layer(i, *a, **k):
        at["layer"] = i
        return real_layer(i, *a, **k)

    def deal(tasks, solve):
        def solve_or_fail(t):
            if at["layer"] == int(layer) and os.environ.get("RANK", "0") == rank:
                _fault(how)
            return solve(t)

        return real_deal(tasks, solve_or_fail)

    pl.gptq_layer, pl.deal = gptq_layer, deal
    import compressor.evaluate as ev
    import compressor.streamed_eval as se

    real_record, seen = ev.window_record, [0]

    def window_record(*a, **k):  # kvq verify: every window's figures, on both paths
        if seen[0] == int(layer) and os.environ.get("RANK", "0") == rank:
            _fault(how)
        seen[0] += 1
        return real_record(*a, **k)

    ev.window_record = se.window_record = window_record


def _no_pickle() -> None:
    import torch.distributed as dist

    def refuse(*a, **k):
        raise AssertionError("an object collective (pickle) was called")

    for name in ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"):
        setattr(dist, name, refuse)


def _log_reads(folder: str) -> None:
    from compressor.source.lazy import LazyCheckpoint

    real = LazyCheckpoint._read
    log = Path(folder) / f"rank{os.environ.get('RANK', '0')}.txt"

    def read(self, name):
        with open(log, "a") as f:
            f.write(name + "\n")
        return real(self, name)

    LazyCheckpoint._read = read


if os.environ.get("KVQ_FAULT"):
    _patch()
if os.environ.get("KVQ_READS"):
    _log_reads(os.environ["KVQ_READS"])
if os.environ.get("KVQ_NO_PICKLE"):
    _no_pickle()

from compressor.entry import main  # noqa: E402

main(sys.argv[1:])
