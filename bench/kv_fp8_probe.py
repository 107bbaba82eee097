"""Where SmolLM2-135M's fp8 KV-cache error comes from (issue #18): keys vs values, and whether a
static scale below absmax / 448 (clipping the largest values) helps.

Perplexity on the first N windows of 2048 tokens of wiki.test.raw (default 4), each window
fed in chunks of 128 tokens through a cache that rounds K and/or V to float8 e4m3 on write
with the per-tensor static scale ``m * absmax / 448`` (absmax of the post-RoPE K/V over
32 x 512 calibration tokens of wikitext-2 valid.txt, seed 0; scales stored in fp16, as
``kvq quantize --recipe kv-fp8`` does). Same rounding as ``kvq verify``'s fp8 cache
(compressor.quant.kv.fake_quantize_kv).

Usage: python bench/kv_fp8_probe.py [N_WINDOWS]; ``MULTS=0.9,1.25,2`` runs K+V at each scale
multiplier ``m`` instead of the default rows.
"""
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from transformers.cache_utils import DynamicCache
from compressor.calib import load_text, sample_windows, tokenize
from compressor.evaluate import perplexity, windows
from compressor.source.open import load_model
from compressor.source.resolve import resolve_source
from compressor.quant.kv import cache_kwarg, kv_observer, make_spec, observed_absmax, static_scales, fake_quantize_kv
torch.set_grad_enabled(False)
D = ROOT.parent / "shared" / "data"
NW = int(sys.argv[1]) if len(sys.argv) > 1 else 4
model, tok = load_model(resolve_source("smollm2-135m"))
wins = windows(tokenize(tok, load_text(f"{D}/wikitext-2-raw/wiki.test.raw", part="eval").text), 2048, NW)
calib = sample_windows(tokenize(tok, load_text(f"{D}/wikitext-2/valid.txt", part="calib").text), 32, 512, 0)
L = model.config.num_hidden_layers
obs = kv_observer(L)
for b in calib.split(8):
    model(b, use_cache=True, **{cache_kwarg(model): obs})
absmax = observed_absmax(obs)
spec = make_spec("fp8", "tensor", 32, 128)
class FQ(DynamicCache):
    def __init__(self, mk, mv, kinds):
        super().__init__(); self.mk, self.mv, self.kinds = mk, mv, kinds
    def update(self, k, v, layer_idx, *a, **kw):
        ka, va = absmax[layer_idx]
        if "k" in self.kinds:
            k = fake_quantize_kv(k, spec, "k", (static_scales(ka, spec) * self.mk[layer_idx]).half().float()).to(k.dtype)
        if "v" in self.kinds:
            v = fake_quantize_kv(v, spec, "v", (static_scales(va, spec) * self.mv[layer_idx]).half().float()).to(v.dtype)
        return super().update(k, v, layer_idx, *a, **kw)
ones = [1.0] * L
base = perplexity(model, wins)["ppl"]
print("float", base, flush=True)
import os
MULTS = [float(m) for m in os.environ["MULTS"].split(",")] if os.environ.get("MULTS") else None
RUNS = ([(f"kv m{m:g}", [m] * L, [m] * L, "kv") for m in MULTS] if MULTS else  # MULTS=0.9,1.5: a scale sweep
        [("kv m1", ones, ones, "kv"), ("k only", ones, ones, "k"), ("v only", ones, ones, "v"),
         ("kv m0.75", [0.75]*L, [0.75]*L, "kv"), ("kv m0.5", [0.5]*L, [0.5]*L, "kv")])
for name, mk, mv, kinds in RUNS:
    t = time.time()
    p = perplexity(model, wins, make_cache=lambda: FQ(mk, mv, kinds), kv_chunk=128)["ppl"]
    print(name, round(p, 4), f"{(p/base-1)*100:+.3f} %", round(time.time()-t), "s", flush=True)
