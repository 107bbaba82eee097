"""``kvq verify --stream`` by one process, by two ``torchrun`` ranks on one node, and by two
"nodes" (two ``torchrun --nnodes 2`` launches on this machine) on a small random llama (issue #44):
each rank's peak RSS (VmHWM, from the report's ``evaluated_in``), the wall time, and whether the
reports' figures are the single process's (every field but timings, hashing speed and memory).

    flock /tmp/kvq-heavy.lock .venv/bin/python bench/verify_ranks.py --work /tmp/verify-ranks

The model (random weights, the tests' tiny tokenizer) and its RTN W4 artifact are made once in
``--work``; the evaluation text is wikitext-2's test split, or ``--text`` (a shorter one keeps
tokenizing it, the same on every rank, from setting the peak).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
#: not figures of the model: timings, the hashing speed, memory, and the memory plan (rank 0's own: its windows)
NOT_FIGURES = {"seconds", "busy_note", "peak_rss_mib", "mb_per_s", "ranks", "memory_plan"}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _figures(x):
    if isinstance(x, dict):
        return {k: _figures(v) for k, v in x.items() if k not in NOT_FIGURES}
    return [_figures(v) for v in x] if isinstance(x, list) else x


def _diff(a, b, path=""):
    """The paths where ``a`` and ``b`` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [p for k in sorted(set(a) | set(b)) for p in _diff(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def _artifact(work: Path, hidden: int, layers: int, seqlen: int) -> Path:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from conftest import tiny_tokenizer
    from tiny_models import make_model_dir

    model, art = work / "model", work / "art"
    if not model.exists():
        make_model_dir(model, tiny_tokenizer(), num_hidden_layers=layers, hidden_size=hidden,
                       intermediate_size=hidden * 11 // 4, num_attention_heads=hidden // 64, num_key_value_heads=4,
                       max_position_embeddings=seqlen, tie_word_embeddings=False)
    if not art.exists():
        subprocess.run([sys.executable, "-m", "compressor", "quantize", str(model), "--recipe", "w4a16-rtn-g64",
                        "-o", str(art)], check=True, env=_env(), cwd=ROOT)
    return art


def _run(launches: list[list[str]]) -> tuple[float, list]:
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, env=_env(), cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for cmd in launches]
    outs = [p.communicate() for p in procs]
    wall = time.perf_counter() - t0
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"exit {p.returncode}: {' '.join(p.args)}\n{err[-2000:]}")
    return wall, [json.loads(o) for o, _ in outs if o.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--text", type=Path, default=TEXT, help="the evaluation text (default: wikitext-2's test split)")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    art = _artifact(a.work, a.hidden, a.layers, a.seqlen)
    args = ["verify", str(art), "--stream", "--eval", str(a.text), "--seqlen", str(a.seqlen), "--max-windows",
            str(a.windows), "--long-tokens", "0", "--turns", "0", "--threads", "1", "--json"]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    port = str(_port())
    rows = {"1 process": [[sys.executable, "-m", "compressor", *args]],
            "2 ranks, one node": [[torchrun, "--nproc-per-node", "2", "--master-port", str(_port()),
                                   "-m", "compressor", *args]],
            "2 nodes (2 launches)": [[torchrun, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                                      "--master-addr", "127.0.0.1", "--master-port", port, "-m", "compressor", *args]
                                     for n in (0, 1)]}
    want = None
    print(f"model: random llama, hidden {a.hidden}, {a.layers} layers; "
          f"{a.windows} windows x {a.seqlen} tokens, --stream")
    for name, launches in rows.items():
        wall, reports = _run(launches)
        assert len(reports) == 1, f"{name}: {len(reports)} reports"
        r = reports[0]
        ranks = r["evaluated_in"].get("ranks") or [{"rank": 0, "windows": [0, a.windows],
                                                   "peak_rss_mib": r["evaluated_in"]["streamed"]["peak_rss_mib"]}]
        want = want or _figures(r)
        same = _figures(r) == want or _diff(_figures(r), want)[:5]
        per = ", ".join(f"rank {x['rank']} windows {x['windows'][0]}-{x['windows'][1] - 1}: "
                        f"{x['peak_rss_mib']:.0f} MiB" for x in ranks)
        print(f"{name}: wall {wall:.1f} s; {per}; hidden states planned "
              f"{r['evaluated_in']['streamed']['memory_plan']['hidden_gib']:.3f} GiB (rank 0); "
              f"figures equal to one process: {same}; ppl {r['perplexity']['artifact']}")


if __name__ == "__main__":
    main()
