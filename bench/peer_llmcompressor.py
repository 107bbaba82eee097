"""llm-compressor side of the peer benchmark; runs in its own venv (bench/.peers/llmcompressor).

  quantize --algo gptq|awq|rtn --model FLOAT_DIR --calib IDS.safetensors --out DIR --json OUT [--bits 4]
           [--scheme PRESET] [--group-size N]
      llm-compressor ``oneshot`` with the settings kvq's recipes use (W4A16, group 64,
      asymmetric; GPTQ: actorder "weight" (= kvq act_order + static groups), damp 0.01,
      block 128; AWQ: duo scaling, 20 grid points; RTN: QuantizationModifier alone), fed the
      very token ids kvq gets; saves the compressed-tensors artifact. Times the whole process
      part (load, oneshot, save) and oneshot alone. ``--scheme``: one of compressed-tensors'
      preset schemes instead (issue #49's formats), ``lm_head`` ignored: FP8 W8A8 per channel with
      dynamic per-token activations (``FP8_DYNAMIC``, kvq's ``w8a8-fp8``) or 128 x 128 blocks with
      dynamic per-group activations (``FP8_BLOCK``, ``w8a8-fp8-block``), both RTN only; int4 weights
      with dynamic fp8 per-token inputs (``W4AFP8``, ``w4a8-gptq``); ``NVFP4A16`` / ``MXFP4A16``
      (``w4a16-nvfp4`` / ``w4a16-mxfp4``) and ``NVFP4`` (W4A4, its input global scale observed on
      the calibration ids: ``w4a4-nvfp4``), each with ``--algo rtn`` or ``gptq`` (actorder
      "weight" where the preset's weights are grouped integers, damp 0.01, block 128).
      ``--group-size`` replaces the preset's weight group size (W4AFP8's 128 does not divide
      SmolLM2-135M's 576).

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


def preset_recipe(algo: str, scheme: str, group_size: int | None = None):
    """``scheme``'s preset as one config group (its weight group size replaced by ``group_size``)."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if algo == "awq" or (algo == "gptq" and scheme.startswith("FP8")):
        raise SystemExit(f"--scheme {scheme} is run with --algo rtn{'' if scheme.startswith('FP8') else ' or gptq'}")
    s = preset_name_to_scheme(scheme, ["Linear"])
    w = s.weights.model_copy(update={"group_size": group_size} if group_size else {})
    if algo == "gptq" and w.type == "int" and w.strategy == "group":
        w = w.model_copy(update={"actorder": "weight"})  # kvq: act_order with static groups
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=w, input_activations=s.input_activations)}
    if algo == "gptq":
        return [GPTQModifier(config_groups=groups, ignore=["lm_head"], dampening_frac=0.01, block_size=128)]
    return [QuantizationModifier(config_groups=groups, ignore=["lm_head"])]


def recipe(algo: str, bits: int = 4, scheme: str | None = None, group_size: int | None = None):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if scheme is not None:  # a compressed-tensors preset, RTN or GPTQ on its grid
        return preset_recipe(algo, scheme, group_size)

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
    # NVFP4's input global scale is observed on the calibration ids: it needs their forward
    calibrated = a.algo != "rtn" or a.scheme == "NVFP4"
    oneshot(model=model, dataset=ds, recipe=recipe(a.algo, a.bits, a.scheme, a.group_size),
            num_calibration_samples=ids.shape[0], max_seq_length=ids.shape[1], shuffle_calibration_samples=False,
            pipeline="sequential" if calibrated else "datafree")
    t2 = time.perf_counter()
    model.save_pretrained(a.out, save_compressed=True)
    tok.save_pretrained(a.out)
    t3 = time.perf_counter()
    size = sum(f.stat().st_size for f in Path(a.out).glob("*.safetensors"))
    res = {"tool": "llm-compressor", "algo": a.algo, "bits": a.bits, "scheme": a.scheme, "group_size": a.group_size,
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
    q.add_argument("--scheme", choices=("FP8_DYNAMIC", "FP8_BLOCK", "W4AFP8", "NVFP4A16", "MXFP4A16", "NVFP4"),
                   default=None, help="a compressed-tensors preset scheme instead of W<bits>A16 g64")
    q.add_argument("--group-size", type=int, default=None, help="the preset's weight group size replaced")
    a = ap.parse_args()
    quantize(a)


if __name__ == "__main__":
    main()
