"""Perplexity of a model source or a kvq artifact with kvq's evaluation code.

Usage: python bench/eval_ppl.py MODEL_OR_ARTIFACT [--eval FILE] [--seqlen 2048] [--max-windows N] [--out JSON]

The cross-check of issue #2: float SmolLM2-135M-Instruct (GGUF dequantized) on the whole
wiki.test.raw, 147 windows of 2048 -> reference perplexity 21.967.
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from compressor.artifact import load_artifact
from compressor.calib import load_text, tokenize
from compressor.evaluate import perplexity, windows
from compressor.source.open import load_model
from compressor.source.resolve import resolve_source

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--eval", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"))
ap.add_argument("--seqlen", type=int, default=2048)
ap.add_argument("--max-windows", type=int, default=None)
ap.add_argument("--out", default=None)
a = ap.parse_args()

t0 = time.time()
if (Path(a.model) / "kvq-manifest.json").is_file():
    model, tok = load_artifact(a.model)
else:
    model, tok = load_model(resolve_source(a.model))
ids = tokenize(tok, load_text(a.eval).text)
res = perplexity(model, windows(ids, a.seqlen, a.max_windows))
res.update(model=a.model, eval=a.eval, total_tokens=ids.numel(), threads=torch.get_num_threads(),
           machine=platform.processor() or platform.machine(), wall_seconds=round(time.time() - t0, 1))
print(json.dumps({k: v for k, v in res.items() if k != "per_window_ppl"}, indent=2))
if a.out:
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
