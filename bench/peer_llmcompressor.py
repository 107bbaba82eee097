"""llm-compressor side of the peer benchmark; runs in its own venv (bench/.peers/llmcompressor).

  quantize --algo gptq|awq|rtn --model FLOAT_DIR --calib IDS.safetensors --out DIR --json OUT [--bits 4]
           [--scheme FP8_DYNAMIC|FP8_BLOCK]
      llm-compressor ``oneshot`` with the settings kvq's recipes use (W4A16, group 64,
      asymmetric; GPTQ: actorder "weight" (= kvq act_order + static groups), damp 0.01,
      block 128; AWQ: duo scaling, 20 grid points; RTN: QuantizationModifier alone), fed the
      very token ids kvq gets; saves the compressed-tensors artifact. Times the whole process
      part (load, oneshot, save) and oneshot alone. ``--scheme`` (RTN only): one of
      llm-compressor's preset schemes instead, FP8 W8A8 per channel with dynamic per-token
      activations (``FP8_DYNAMIC``, kvq's ``w8a8-fp8``) or 128 x 128 blocks with dynamic
      per-group activations (``FP8_BLOCK``, kvq's ``w8a8-fp8-block``); ``lm_head`` ignored.

The evaluation of any folder through transformers' loading path is ``bench/eval_ids.py
--loader transformers`` run with this venv's Python.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch


def recipe(algo: str, bits: int = 4, scheme: str | None = None):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if scheme is not None:  # a preset (FP8_DYNAMIC, FP8_BLOCK): data-free RTN on its grid
        from llmcompressor.modifiers.quantization import QuantizationModifier

        if algo != "rtn":
            raise SystemExit(f"--scheme {scheme} is run with --algo rtn")
        return [QuantizationModifier(targets=["Linear"], scheme=scheme, ignore=["lm_head"])]

    act = "weight" if algo == "gptq" else None
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=False, strategy="group", group_size=64, actorder=act)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    if algo == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        return [GPTQModifier(config_groups=groups, ignore=["lm_head"], dampening_frac=0.01, block_size=128)]
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if algo == "awq":
        from llmcompressor.modifiers.transform.awq import AWQModifier

        return [AWQModifier(duo_scaling=True, n_grid=20), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    return [QuantizationModifier(config_groups=groups, ignore=["lm_head"])]


def quantize(a) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():
        # llm-compressor 0.14.0.1's AWQ pins its cached activations (pin_memory) before the
        # grid search, which raises "Cannot access accelerator device" on a machine without
        # one. Pinning only speeds up host-to-GPU copies; skipping it changes no result.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    t0 = time.perf_counter()
    ids = load_file(a.calib)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(a.model)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    t1 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe(a.algo, a.bits, a.scheme), num_calibration_samples=ids.shape[0],
            max_seq_length=ids.shape[1], shuffle_calibration_samples=False, pipeline="sequential" if a.algo != "rtn" else "datafree")
    t2 = time.perf_counter()
    model.save_pretrained(a.out, save_compressed=True)
    tok.save_pretrained(a.out)
    t3 = time.perf_counter()
    size = sum(f.stat().st_size for f in Path(a.out).glob("*.safetensors"))
    res = {"tool": "llm-compressor", "algo": a.algo, "bits": a.bits, "scheme": a.scheme,
           "calib_samples": int(ids.shape[0]), "calib_seqlen": int(ids.shape[1]),
           "load_seconds": round(t1 - t0, 2), "quantize_seconds": round(t2 - t1, 2), "save_seconds": round(t3 - t2, 2),
           "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "artifact_bytes": size,
           "versions": versions()}
    Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("--algo", choices=("gptq", "awq", "rtn"), required=True)
    q.add_argument("--model", required=True)
    q.add_argument("--calib", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--json", required=True)
    q.add_argument("--bits", type=int, default=4, help="weight bits (issue #18's table: 4 and 3)")
    q.add_argument("--scheme", choices=("FP8_DYNAMIC", "FP8_BLOCK"), default=None,
                   help="an llm-compressor preset scheme instead of W<bits>A16 g64 (--algo rtn)")
    a = ap.parse_args()
    quantize(a)


if __name__ == "__main__":
    main()
