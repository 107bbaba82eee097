"""The shared evaluation script of the peer benchmark: perplexity on saved token ids.

Every model in ``bench/peer_bench.py`` -- the float model, kvq's artifacts and
llm-compressor's -- is scored by this one function on the same ``[n_windows, seqlen]``
int64 token ids (``bench/work/peer/eval-ids.safetensors``), so tokenization, windowing
and the loss are identical; only the loader differs:

* ``--loader kvq``: kvq's own reader (``compressor.artifact.load_artifact`` for any
  compressed-tensors/AWQ/GPTQ folder, ``compressor.source.open.load_model`` for a float one);
* ``--loader transformers``: ``AutoModelForCausalLM.from_pretrained`` -- the loading path
  of transformers + compressed-tensors (run in the peer's virtual environment).

Perplexity = exp(mean over all predicted tokens of -log p(token)), each window scored on
its own (no overlap, no context carried over), logits in float32, log-softmax in float64
(the protocol of ``compressor.evaluate.perplexity``, issue #2's cross-check).

With ``--reference FLOAT_DIR`` the same pass also gives the mean KL divergence to the float
model (nats per predicted token) and the top-1 agreement (issue #18's table).

Usage: python bench/eval_ids.py MODEL --ids FILE [--loader kvq|transformers] [--max-windows N] [--out JSON]
          [--reference FLOAT_DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


@torch.inference_mode()
def perplexity_ids(model, ids: torch.Tensor, reference=None) -> dict:
    """Perplexity of ``model`` on ``ids`` int64 ``[n_windows, seqlen]``; per-window figures too.

    With ``reference`` (the float model): also the mean KL divergence ``KL(p_ref || p)`` in
    nats per predicted token and the top-1 agreement (share of positions where both models'
    most likely next token is the same), log-softmax in float64, 256 positions at a time."""
    total_nll, total_n, per_window = 0.0, 0, []
    kl_sum, agree = 0.0, 0
    for row in ids:
        logits = model(row[None]).logits[0, :-1].float()
        ref = reference(row[None]).logits[0, :-1].float() if reference is not None else None
        nll = 0.0
        for a in range(0, logits.shape[0], 256):
            logp = torch.log_softmax(logits[a:a + 256].double(), dim=-1)
            nll -= logp.gather(1, row[1 + a:1 + a + 256, None]).sum().item()
            if ref is not None:
                logq = torch.log_softmax(ref[a:a + 256].double(), dim=-1)
                kl_sum += (logq.exp() * (logq - logp)).sum().item()
                agree += int((logq.argmax(-1) == logp.argmax(-1)).sum())
        n = row.numel() - 1
        total_nll += nll
        total_n += n
        per_window.append(math.exp(nll / n))
    out = {"ppl": math.exp(total_nll / total_n), "windows": len(per_window), "tokens": total_n,
           "per_window_ppl": per_window}
    if reference is not None:
        out.update(mean_kl=kl_sum / total_n, top1_agreement=agree / total_n)
    return out


def load(model: str, loader: str):
    """Load ``model`` (a folder) with the named loader; returns a float32 causal LM in eval mode."""
    if loader == "kvq":
        from compressor.artifact import load_artifact
        from compressor.source.open import load_model
        from compressor.source.resolve import resolve_source

        folder = Path(model)
        cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
        if (folder / "kvq-manifest.json").is_file() or "quantization_config" in cfg:
            m, _ = load_artifact(folder)
        else:
            m, _ = load_model(resolve_source(model))
    else:
        from transformers import AutoModelForCausalLM

        # a quantized checkpoint is decompressed by compressed-tensors as transformers loads it
        return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    return m.float().eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--ids", required=True)
    ap.add_argument("--loader", choices=("kvq", "transformers"), default="kvq")
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--reference", default=None, help="float model folder: also mean KL and top-1 agreement against it")
    a = ap.parse_args()
    from safetensors.torch import load_file

    ids = load_file(a.ids)["input_ids"][: a.max_windows]
    t0 = time.perf_counter()
    model = load(a.model, a.loader)
    t_load = time.perf_counter() - t0
    reference = load(a.reference, a.loader) if a.reference else None
    res = perplexity_ids(model, ids, reference)
    res.update(model=a.model, loader=a.loader, load_seconds=round(t_load, 1),
               eval_seconds=round(time.perf_counter() - t0 - t_load, 1), threads=torch.get_num_threads())
    print(json.dumps({k: v for k, v in res.items() if k != "per_window_ppl"}))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
