"""Starting kvq ranks as processes for the tests (tests/test_distributed.py, tests/test_verify_ranks.py):
each rank its own ``kvq`` process (tests/rank_faults.py) with the environment torchrun would set, gloo."""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "rank_faults.py"
#: what a test waits for a process before calling it hung (not a figure: the fault itself is bounded by the watch)
HANG_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVQ_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", KVQ_PEER_TIMEOUT_S="8", **extra)
    return env


def ranks(n: int, args: list, command: str = "quantize", **env) -> list[subprocess.Popen]:
    """``n`` kvq ranks as torchrun would start them (rank 0 keeps the store), without torchrun."""
    port = str(free_port())
    return [subprocess.Popen([sys.executable, str(DRIVER), command, *map(str, args)], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=rank_env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                          MASTER_PORT=port, **env))
            for r in range(n)]


def ends(procs) -> list[tuple[int, str, str]]:
    """Each process's exit code, stdout and stderr; a process still running after :data:`HANG_S` is a hang."""
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a rank still runs after {HANG_S} s: {' '.join(p.args)}") from None
        out.append((p.returncode, o, e))
    return out


def kvq_lines(err: str) -> list[str]:
    """kvq's own lines of a rank's stderr (rank 0 prints progress lines there under --json too)."""
    return [ln for ln in err.splitlines() if ln.startswith("kvq:")]
