"""Start-up of ``kvq serve``: from the process start to the line naming the URL (issue #16).

Runs ``kvq serve ARTIFACT --port 0`` as a child, reads its output until the line
``kvq: serving ... on http://...``, then stops it (SIGTERM) and exits 0; exits 1 when the
server exits first or the line does not come within TIMEOUT seconds. The process as a whole
is what a whole-process timer measures (e.g. ``/usr/bin/time -v python
bench/serve_startup.py ART``); with ``PYTHONPATH`` naming another checkout it measures that
checkout's code (the before/after pair in BENCHMARKS.md).

Usage: python bench/serve_startup.py ARTIFACT [kvq serve options ...]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

TIMEOUT = float(os.environ.get("TIMEOUT", "300"))


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python bench/serve_startup.py ARTIFACT [kvq serve options ...]", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "compressor", "serve", argv[0], "--port", "0", *argv[1:]],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in p.stdout:
            if line.startswith("kvq: serving ") and " on http" in line:
                print(f"serving after {time.perf_counter() - t0:.2f} s: {line.strip()}")
                return 0
            if time.perf_counter() - t0 > TIMEOUT:
                break
        print(f"kvq serve did not start (exit {p.poll()})", file=sys.stderr)
        return 1
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
