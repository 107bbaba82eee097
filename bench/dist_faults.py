"""Fault-stop time under torchrun (issue #44): a rank killed in the middle of a decoder layer,
how long until the other ranks' launchers have exited, on a 4-layer tiny llama (gloo, CPU).

Scenarios (each ``REPEATS`` times, default 3), every rank a ``torchrun`` worker running
tests/rank_faults.py (``kvq`` with the fault of ``KVQ_FAULT``), GPTQ W4 g32, 4 x 32 tokens:

* ``1node-kill-r1``: ``torchrun --nproc-per-node 2``, rank 1 SIGKILLed at layer 2;
* ``2nodes-kill-r1`` / ``2nodes-kill-r0``: two launches ``--nnodes 2 --node-rank 0/1
  --nproc-per-node 1 --master-addr 127.0.0.1 --master-port P`` (static rendezvous), rank 1
  (resp. 0) SIGKILLed at layer 2;
* ``2nodes-c10d-kill-r1``: the same with ``--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P``;
* ``2nodes-stop-r1``: rank 1 SIGSTOPped at layer 2 (a hung process, or a machine that no longer
  answers: its connections stay open), ``--master-addr``.

Time: from the stamp the faulty rank writes just before the signal to each launcher's exit
(``time.time()`` on this machine). ``BEFORE=<checkout>``: the same scenarios with that
checkout's ``compressor`` (``PYTHONPATH``), ``HANG_S`` (default 120) ending a launcher that
hangs. Writes bench/results/dist_faults.json and prints the table for BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = ROOT / "bench" / "results" / "dist_faults.json"
TORCHRUN = Path(sys.executable).with_name("torchrun")
QUANTIZE = ["--algorithm", "gptq", "--group-size", "32", "--calib-samples", "4", "--calib-seqlen", "32",
            "--threads", "1", "--json"]
SCENARIOS = {  # name: (nodes, rendezvous, fault)
    "1node-kill-r1": (1, "static", "1:2:kill"),
    "2nodes-kill-r1": (2, "static", "1:2:kill"),
    "2nodes-kill-r0": (2, "static", "0:2:kill"),
    "2nodes-c10d-kill-r1": (2, "c10d", "1:2:kill"),
    "2nodes-stop-r1": (2, "static", "1:2:stop"),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_args(nodes: int, rdzv: str, node: int, port: int) -> list[str]:
    if nodes == 1:
        return ["--nproc-per-node", "2", "--master-port", str(port)]
    where = (["--master-addr", "127.0.0.1", "--master-port", str(port)] if rdzv == "static" else
             ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench{port}"])
    return ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", *where]


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid``, children first (from /proc's parent ids)."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    out, todo = [], [pid]
    while todo:
        kids = [c for c, pp in parent.items() if pp == todo[0]]
        out += kids
        todo = todo[1:] + kids
    return out


def run_once(model: Path, work: Path, nodes: int, rdzv: str, fault: str, code_root: Path, hang_s: float) -> dict:
    """One scenario: each launcher's exit code, seconds from the fault to its exit (None: still
    running after ``hang_s``, then killed) and the ``kvq:`` lines of its stderr."""
    stamp = work / "stamp"
    stamp.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVQ_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(PYTHONPATH=str(code_root), KVQ_CODE=str(code_root), KVQ_FAULT=fault, KVQ_FAULT_STAMP=str(stamp))
    port = _port()
    driver = str(ROOT / "tests" / "rank_faults.py")
    procs = [subprocess.Popen([str(TORCHRUN), *_launch_args(nodes, rdzv, n, port), driver,
                               "quantize", str(model), "-o", str(work / "out"), *QUANTIZE],
                              env=env, cwd=code_root, stdout=subprocess.DEVNULL, stderr=open(work / f"err{n}", "w"))
             for n in range(nodes)]
    ended: dict[int, float] = {}
    deadline = None
    while len(ended) < nodes:
        for n, p in enumerate(procs):
            if n not in ended and p.poll() is not None:
                ended[n] = time.time()
        if deadline is None and stamp.exists():
            deadline = time.time() + hang_s
        if deadline is not None and time.time() > deadline:
            break
        time.sleep(0.05)
    for n, p in enumerate(procs):
        if n not in ended:  # the launcher and its stopped or hung workers (torchrun gives each a session of its own)
            for pid in [*_descendants(p.pid), p.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
    t0 = float(stamp.read_text())
    return {"nodes": [{"exit": p.returncode if n in ended else None,
                       "seconds": round(ended[n] - t0, 2) if n in ended else None,
                       "kvq_lines": [ln for ln in (work / f"err{n}").read_text().splitlines() if ln.startswith("kvq:")]}
                      for n, p in enumerate(procs)]}


def main() -> None:
    from conftest import make_model_dir, tiny_tokenizer

    repeats = int(os.environ.get("REPEATS", "3"))
    hang_s = float(os.environ.get("HANG_S", "120"))
    code = {"after": ROOT}
    if os.environ.get("BEFORE"):
        code["before"] = Path(os.environ["BEFORE"]).resolve()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model_dir(Path(tmp) / "model", tiny_tokenizer(), num_hidden_layers=4)
        for which, root in code.items():
            for name, (nodes, rdzv, fault) in SCENARIOS.items():
                key = f"{which}/{name}"
                if key in results:
                    continue
                runs = []
                for r in range(repeats):
                    work = Path(tmp) / f"{which}-{name}-{r}"
                    work.mkdir()
                    runs.append(run_once(model, work, nodes, rdzv, fault, root, hang_s))
                    print(key, runs[-1], flush=True)
                results[key] = runs
                RESULTS.parent.mkdir(parents=True, exist_ok=True)
                RESULTS.write_text(json.dumps(results, indent=1))
    _table(results)


def _table(results: dict) -> None:
    print("| scenario | code | launcher | exit | seconds, fault -> exit (median, max) | its kvq line |")
    print("|---|---|---|---|---|---|")
    for key, runs in results.items():
        which, name = key.split("/")
        for n in range(len(runs[0]["nodes"])):
            secs = [r["nodes"][n]["seconds"] for r in runs]
            done = [s for s in secs if s is not None]
            hang = os.environ.get("HANG_S", "120")
            fig = (f"{statistics.median(done):.1f}, {max(done):.1f}" if len(done) == len(secs)
                   else f"still running after {hang} s in {len(secs) - len(done)} of {len(secs)}")
            exits = sorted({str(r["nodes"][n]["exit"]) for r in runs})
            line = runs[0]["nodes"][n]["kvq_lines"]
            print(f"| {name} | {which} | node {n} | {'/'.join(exits)} | {fig} | {line[0][:90] if line else '-'} |")


if __name__ == "__main__":
    main()
