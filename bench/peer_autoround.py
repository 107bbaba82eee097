"""AutoRound side of the peer benchmark (issue #18); runs in its own venv (bench/.peers/autoround).

  quantize --model FLOAT_DIR --calib IDS.safetensors --out DIR --json OUT [--bits 4] [--group-size 64]
           [--iters 200] [--batch-size 8] [--lr LR]
      Intel's AutoRound (sign-gradient rounding, Cheng et al. 2023, arXiv:2309.05516;
      PyPI ``auto-round``) on the CPU, asymmetric weights, groups of ``--group-size``,
      ``lm_head`` left in float, fed the very token ids kvq gets (``[N, 512]``, one batch of
      ``--batch-size`` rows at a time), exported as compressed-tensors
      (``format="llm_compressor"``) so the same evaluation script reads it. Times the whole
      process part (load, tune, save) and the tuning alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch


def quantize(a) -> None:
    from auto_round import AutoRound
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    ids = load_file(a.calib)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(a.model)
    batches = list(ids.split(a.batch_size))
    t1 = time.perf_counter()
    ar = AutoRound(model, tok, bits=a.bits, group_size=a.group_size, sym=False, dataset=batches, iters=a.iters,
                   nsamples=int(ids.shape[0]), seqlen=int(ids.shape[1]), batch_size=a.batch_size, device_map="cpu",
                   **({} if a.lr is None else {"lr": a.lr}))
    ar.quantize_and_save(a.out, format="llm_compressor")
    t2 = time.perf_counter()
    size = sum(f.stat().st_size for f in Path(a.out).rglob("*.safetensors"))
    res = {"tool": "auto-round", "algo": "autoround", "bits": a.bits, "group_size": a.group_size, "iters": a.iters, "lr": a.lr,
           "calib_samples": int(ids.shape[0]), "calib_seqlen": int(ids.shape[1]),
           "load_seconds": round(t1 - t0, 2), "quantize_seconds": round(t2 - t1, 2),
           "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "artifact_bytes": size,
           "versions": versions()}
    Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("auto-round", "transformers", "torch")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("--model", required=True)
    q.add_argument("--calib", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--json", required=True)
    q.add_argument("--bits", type=int, default=4)
    q.add_argument("--group-size", type=int, default=64)
    q.add_argument("--iters", type=int, default=200)
    q.add_argument("--batch-size", type=int, default=8)
    q.add_argument("--lr", type=float, default=None, help="AutoRound's learning rate (default: its own, 1 / iters)")
    a = ap.parse_args()
    torch.manual_seed(0)
    quantize(a)


if __name__ == "__main__":
    main()
