"""Peak memory and wall time of `kvq quantize` on synthetic models larger than the test
models (issue #9): random-init llama models of about 0.5 B, 1 B and 3 B parameters and
one mixture-of-experts model, stored as bf16 safetensors shards with an index.

The dense models share their width (hidden 1536, MLP 4096, 12 heads, 4 KV heads, the
SmolLM2 tokenizer's 49,152-token vocabulary, tied embeddings) and differ only in depth
(15, 33 and 104 layers), so peak RSS against depth shows what streaming buys. Weights
are N(0, 0.02) (norms 1), generated tensor by tensor and written shard by shard, so the
generator itself never holds a model.

Usage: python bench/scale_bench.py [--sizes 0.5b,1b,3b,moe] [--recipe w4a16-rtn-g64]
          [--calib-samples 8] [--calib-seqlen 256] [--work DIR]
Writes bench/results/scale_bench.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("KVQ_DATA", ROOT.parent / "shared" / "data"))
TOKENIZER = ROOT / "bench" / "work" / "peer" / "smollm2-135m-f32"  # written by peer_bench.py / prepared here
VOCAB = 49152
DENSE = dict(hidden_size=1536, intermediate_size=4096, num_attention_heads=12, num_key_value_heads=4,
             vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-5)
SIZES = {
    "0.5b": ("llama", dict(DENSE, num_hidden_layers=15)),
    "1b": ("llama", dict(DENSE, num_hidden_layers=33)),
    "3b": ("llama", dict(DENSE, num_hidden_layers=104)),
    # Qwen3-MoE layout: 16 experts, 4 routed per token, every layer sparse
    "moe": ("qwen3_moe", dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704, num_experts=16,
                              num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=16,
                              num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=VOCAB,
                              tie_word_embeddings=True, max_position_embeddings=4096, norm_topk_prob=True)),
}
SHARD_BYTES = 1 << 30


def make_config(model_type: str, kw: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kw)


def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of the model's parameters, read from a meta-device
    instance (MoE experts per expert, as Hugging Face checkpoints store them)."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    from compressor.arch import checkpoint_name, get_arch
    from compressor.moe import unfuse_experts

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    arch = get_arch(cfg.model_type)
    unfuse_experts(model, arch)
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {checkpoint_name(arch, n): tuple(t.shape) for n, t in state.items()}


def generate(folder: Path, model_type: str, kw: dict) -> int:
    """Write the synthetic model into ``folder`` (skipped when complete); returns the parameter count."""
    from safetensors.torch import save_file

    cfg = make_config(model_type, kw)
    shapes = param_shapes(cfg)
    n_params = sum(int(torch.Size(s).numel()) for s in shapes.values())
    if (folder / "model.safetensors.index.json").exists():
        return n_params
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    names: list[list[str]] = [[]]

    def flush(final: bool = False):
        nonlocal size
        if shards[-1]:
            save_file(shards[-1], str(tmp / f"part-{len(shards):05d}.safetensors"))
            names[-1] = list(shards[-1])
            shards[-1] = {}
        if not final:
            shards.append({})
            names.append([])
        size = 0

    for name, shape in shapes.items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        elif name.endswith("mlp.gate.weight"):  # routers: spread, so tokens reach many experts
            t = (torch.randn(shape, generator=gen) * 0.5).to(torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shards[-1][name] = t
        size += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    flush(final=True)
    parts = [(i, n) for i, n in enumerate(names, 1) if n]
    total = len(parts)
    weight_map = {}
    for k, (i, ns) in enumerate(parts, 1):
        final = f"model-{k:05d}-of-{total:05d}.safetensors"
        os.replace(tmp / f"part-{i:05d}.safetensors", tmp / final)
        weight_map.update({n: final for n in ns})
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": n_params * 2}, "weight_map": weight_map}, indent=2))
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, tmp / f)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return n_params


def quantize(folder: Path, out: Path, recipe: str, samples: int, seqlen: int, extra: list[str]) -> dict:
    kvq = Path(sys.executable).with_name("kvq")
    cmd = [str(kvq), "quantize", str(folder), "--recipe", recipe, "--calib", str(DATA / "wikitext-2" / "valid.txt"),
           "--calib-samples", str(samples), "--calib-seqlen", str(seqlen), "-o", str(out), "--overwrite", "--json", *extra]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"scale-bench: kvq quantize failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    summary = json.loads(p.stdout[p.stdout.index("{"):])
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # max over children so far
    return {"command": " ".join(cmd[1:]), "wall_seconds": round(wall, 1), "peak_rss_mib": summary.get("peak_rss_mib"),
            "children_max_rss_mib": round(rss, 1), "quantize_seconds": summary.get("quantize_seconds"),
            "artifact_bytes": summary.get("artifact_bytes"), "phase_seconds": summary.get("phase_seconds"),
            "shards": len(list(out.glob("*.safetensors")))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5b,1b,3b,moe")
    ap.add_argument("--recipe", default="w4a16-gptq")
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument("--calib-seqlen", type=int, default=256)
    ap.add_argument("--work", default=str(ROOT / "bench" / "work" / "scale"))
    ap.add_argument("--extra", default="", help="extra kvq quantize flags (space separated)")
    ap.add_argument("--generate-only", action="store_true")
    ap.add_argument("--whole", default="", help="sizes to quantize a second time with --no-stream (comparison)")
    a = ap.parse_args()
    if not (TOKENIZER / "tokenizer.json").exists():
        sys.exit(f"scale-bench: {TOKENIZER} missing: run `QUICK=1 python bench/peer_bench.py` first (it writes the float SmolLM2 folder)")
    work = Path(a.work)
    rows = []
    for size in a.sizes.split(","):
        model_type, kw = SIZES[size]
        folder = work / f"synthetic-{size}"
        t0 = time.perf_counter()
        n = generate(folder, model_type, kw)
        print(f"scale-bench: {size}: {n / 1e9:.2f} B parameters in {folder} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if a.generate_only:
            continue
        for mode in ["stream"] + (["whole"] if size in a.whole.split(",") else []):
            extra = a.extra.split() + (["--no-stream"] if mode == "whole" else [])
            r = quantize(folder, work / f"out-{size}", a.recipe, a.calib_samples, a.calib_seqlen, extra)
            r.update(size=size, mode=mode, model_type=model_type, params=n, layers=kw["num_hidden_layers"],
                     source_bytes=sum(p.stat().st_size for p in folder.glob("*.safetensors")))
            rows.append(r)
            print(json.dumps(r), flush=True)
            shutil.rmtree(work / f"out-{size}", ignore_errors=True)
    if not rows:
        return
    res = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
           "recipe": a.recipe, "calibration": f"{a.calib_samples} x {a.calib_seqlen}", "rows": rows}
    out = ROOT / "bench" / "results" / f"scale_bench-{a.recipe}.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"recipe {a.recipe}, calibration {a.calib_samples} x {a.calib_seqlen}")
    print("| model | parameters | layers | source bf16 (GiB) | source loading | wall (s) | peak RSS (MiB) | artifact (MiB) | shards |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} ({r['model_type']}) | {r['params'] / 1e9:.2f} B | {r['layers']} | {r['source_bytes'] / 2**30:.2f} "
              f"| {r['mode']} | {r['wall_seconds']:.0f} | {r['peak_rss_mib']:,.0f} | {r['artifact_bytes'] / 2**20:,.0f} | {r['shards']} |")


if __name__ == "__main__":
    main()
