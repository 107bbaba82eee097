"""Peak memory and wall time of `kvq quantize` on synthetic models larger than the test
models (issue #9): random-init llama models of about 0.5 B, 1 B and 3 B parameters and
one mixture-of-experts model, stored as bf16 safetensors shards with an index.

The dense models share their width (hidden 1536, MLP 4096, 12 heads, 4 KV heads, the
SmolLM2 tokenizer's 49,152-token vocabulary, tied embeddings) and differ only in depth
(15, 33 and 104 layers), so peak RSS against depth shows what streaming buys. Weights
are N(0, 0.02) (norms 1), generated tensor by tensor and written shard by shard, so the
generator itself never holds a model.

Kimi K2 and GLM-5 sizes (issues #15, #43): ``kimi-k2`` and ``glm5`` are the published layer widths
with every routed expert (384 and 256), three layers, the first dense. ``kimi-fp8`` has Kimi K2's widths (DeepSeek-V3 layout, MLA,
hidden 7168, routed experts 2048 wide, a dense first layer 18432 wide) stored as a
block-FP8 release (``float8_e4m3fn`` projections with a float32 ``weight_scale_inv`` per
128 x 128 block, ``quantization_config.quant_method: fp8``) with 150 routed experts, so
its MoE layer is 25.2 GiB in float32: more than a 24 GiB machine holds. ``kimi-fp8-16e``
is the same with 16 routed experts (3.2 GiB a layer) for a calibrated run, which holds
one whole layer.

GLM-4.5's layout (issue #43): ``glm45`` is a ``glm4_moe`` of 3 MoE layers with 64 routed
experts 1024 wide and one shared expert at hidden 1024 (2.3 GiB in float32; one layer's routed
experts 0.75 GiB), ``glm45-tiny`` the same at the tests' tiny width; both with the tests'
320-token byte-level BPE tokenizer, so the embedding and head stay small beside the layers.

Usage: python bench/scale_bench.py [--sizes 0.5b,1b,3b,moe] [--recipe w4a16-rtn-g64]
          [--calib-samples 8] [--calib-seqlen 256] [--work DIR]
Writes bench/results/scale_bench-<recipe>[-<tag>].json and prints a Markdown table.
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
KIMI = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=2,
            first_k_dense_replace=1, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_shared_experts=1, num_experts_per_tok=8,
            n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827, scoring_func="sigmoid",
            topk_method="noaux_tc", num_nextn_predict_layers=0, vocab_size=VOCAB, tie_word_embeddings=True,
            max_position_embeddings=4096, rope_theta=50000.0, _fp8=True)
#: GLM-5's widths (transformers' glm_moe_dsa defaults are GLM-5's), block FP8 as its FP8 release
GLM5 = dict(hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048, first_k_dense_replace=1,
            mlp_layer_types=["dense", "sparse", "sparse"], layer_types=["indexed_attention"] * 3,
            indexer_types=["full"] * 3, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048,
            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, n_shared_experts=1,
            num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
            num_nextn_predict_layers=0, vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=4096,
            _fp8=True)
GLM45 = dict(intermediate_size=4096, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=0, n_group=1,
             topk_group=1, norm_topk_prob=True, use_qk_norm=True, num_hidden_layers=3, num_nextn_predict_layers=0,
             vocab_size=320, tie_word_embeddings=False, max_position_embeddings=4096, _tiny_tokenizer=True)
SIZES = {
    "0.5b": ("llama", dict(DENSE, num_hidden_layers=15)),
    "1b": ("llama", dict(DENSE, num_hidden_layers=33)),
    "3b": ("llama", dict(DENSE, num_hidden_layers=104)),
    # Qwen3-MoE layout: 16 experts, 4 routed per token, every layer sparse
    "moe": ("qwen3_moe", dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704, num_experts=16,
                              num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=16,
                              num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=VOCAB,
                              tie_word_embeddings=True, max_position_embeddings=4096, norm_topk_prob=True)),
    # Kimi K2's widths (DeepSeek-V3 layout: MLA, hidden 7168, routed experts 2048 wide, 18432-wide dense
    # first layer) as a block-FP8 release; 150 routed experts make the MoE layer 24.6 GiB in float32
    "kimi-fp8": ("deepseek_v3", dict(KIMI, n_routed_experts=150)),
    # the same widths with 16 routed experts, for a calibrated (GPTQ/AWQ) run that holds one layer whole
    "kimi-fp8-16e": ("deepseek_v3", dict(KIMI, n_routed_experts=16)),
    # Kimi K2 at its full layer width (issue #43): 384 routed experts + 1 shared, a dense first layer, two MoE
    # layers of 384 x 3 x 7168 x 2048 weights (68 GB each in float32, 17 GB on disk in block FP8)
    "kimi-k2": ("deepseek_v3", dict(KIMI, n_routed_experts=384, num_hidden_layers=3)),
    # Kimi K2's widths with 64 routed experts, three layers (issue #44's ranks)
    "kimi-fp8-64e": ("deepseek_v3", dict(KIMI, n_routed_experts=64, num_hidden_layers=3)),
    # GLM-5 at its full layer width (glm_moe_dsa: MLA with the DSA indexer, 256 routed experts of width 2048 at
    # hidden 6144, one shared), a dense first layer and two MoE layers (38.6 GB each in float32)
    "glm5": ("glm_moe_dsa", dict(GLM5, n_routed_experts=256, num_hidden_layers=3)),
    # GLM-4.5's layout at a width this machine holds (issue #43): 3 MoE layers of 64 routed experts 1024 wide and one
    # shared expert at hidden 1024, top-8; a 320-token vocabulary (the tests' byte-level BPE) keeps the embedding and
    # head out of the way of the layers' memory; 2.3 GiB in float32, one layer's routed experts 0.75 GiB
    "glm45": ("glm4_moe", dict(GLM45, hidden_size=1024, moe_intermediate_size=1024, n_routed_experts=64,
                               num_attention_heads=8, head_dim=128, num_key_value_heads=2)),
    # the same layout at the tests' tiny width (hidden 64, 4 experts 32 wide, top-2): the process's own footprint
    "glm45-tiny": ("glm4_moe", dict(GLM45, hidden_size=64, moe_intermediate_size=32, n_routed_experts=4,
                                    num_experts_per_tok=2, num_attention_heads=4, head_dim=16, num_key_value_heads=2)),
    # a tiny MoE + MLA model (DeepSeek-V3 layout) for the runtime's decode benchmark (bench/serve_bench.py)
    "tiny-mla": ("deepseek_v3", dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
                                     first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256,
                                     kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                                     n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1,
                                     norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
                                     vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=4096)),
}
#: the block shape of the FP8 sizes (``weight_block_size``), DeepSeek-V3's and Kimi K2's
FP8_BLOCK = (128, 128)
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


def largest_layer_f32_bytes(model_type: str, kw: dict) -> int:
    """Float32 bytes of the largest decoder layer (what a whole-layer run would hold)."""
    import re

    shapes = param_shapes(make_config(model_type, {k: v for k, v in kw.items() if not k.startswith("_")}))
    per: dict[int, int] = {}
    for name, shape in shapes.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m:
            per[int(m.group(1))] = per.get(int(m.group(1)), 0) + int(torch.Size(shape).numel()) * 4
    return max(per.values())


def generate(folder: Path, model_type: str, kw: dict) -> int:
    """Write the synthetic model into ``folder`` (skipped when complete); returns the parameter count."""
    from safetensors.torch import save_file

    kw = dict(kw)
    fp8 = kw.pop("_fp8", False)
    tiny_tokenizer = kw.pop("_tiny_tokenizer", False)
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
        elif fp8 and ".layers." in name and name.endswith("proj.weight"):  # block FP8, W = q * 0.02
            t = torch.randn(shape, generator=gen).to(torch.float8_e4m3fn)
            rows, cols = (-(-shape[0] // FP8_BLOCK[0]), -(-shape[1] // FP8_BLOCK[1]))
            shards[-1][name + "_scale_inv"] = torch.full((rows, cols), 0.02, dtype=torch.float32)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shards[-1][name] = t
        size += t.numel() * t.element_size()
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
        {"metadata": {"total_size": sum((tmp / f).stat().st_size for f in set(weight_map.values()))},
         "weight_map": weight_map}, indent=2))
    cfg.dtype = "bfloat16"
    if fp8:
        cfg.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": list(FP8_BLOCK)}
    cfg.save_pretrained(tmp)
    if tiny_tokenizer:  # the tests' byte-level BPE of cfg.vocab_size ids, trained on the embedded corpus
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import tiny_tokenizer as bpe

        bpe(cfg.vocab_size).save_pretrained(tmp)
    else:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER / f, tmp / f)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return n_params


def write_tokenizer() -> None:
    """SmolLM2's tokenizer files into ``TOKENIZER`` (from kvq's GGUF conversion, made once)."""
    sys.path.insert(0, str(ROOT))
    from compressor.source.gguf_cache import cached_gguf_folder
    from compressor.source.open import load_model
    from compressor.source.resolve import resolve_source

    source = resolve_source("smollm2-135m")
    folder = cached_gguf_folder(source)
    if folder is None:  # converts the GGUF once and caches it
        load_model(source)
        folder = cached_gguf_folder(source)
    TOKENIZER.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / f, TOKENIZER / f)


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
    ap.add_argument("--tag", default="", help="suffix of the results file (scale_bench-<recipe>-<tag>.json)")
    ap.add_argument("--whole", default="", help="sizes to quantize a second time with --no-stream (comparison)")
    a = ap.parse_args()
    if not (TOKENIZER / "tokenizer.json").exists() and any(not SIZES[s][1].get("_tiny_tokenizer")
                                                           for s in a.sizes.split(",")):
        write_tokenizer()
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
                     source_bytes=sum(p.stat().st_size for p in folder.glob("*.safetensors")),
                     largest_layer_f32_gib=round(largest_layer_f32_bytes(model_type, kw) / 2**30, 2),
                     source_format="block FP8 (128 x 128)" if kw.get("_fp8") else "bf16")
            rows.append(r)
            print(json.dumps(r), flush=True)
            shutil.rmtree(work / f"out-{size}", ignore_errors=True)
    if not rows:
        return
    res = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
           "recipe": a.recipe, "calibration": f"{a.calib_samples} x {a.calib_seqlen}", "rows": rows}
    out = ROOT / "bench" / "results" / f"scale_bench-{a.recipe}{'-' + a.tag if a.tag else ''}.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"recipe {a.recipe}, calibration {a.calib_samples} x {a.calib_seqlen}")
    print("| model | parameters | layers | source (GiB) | largest layer, float32 (GiB) | source loading | wall (s) "
          "| peak RSS (MiB) | artifact (MiB) | shards |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} ({r['model_type']}, {r['source_format']}) | {r['params'] / 1e9:.2f} B | {r['layers']} "
              f"| {r['source_bytes'] / 2**30:.2f} | {r['largest_layer_f32_gib']:.2f} | {r['mode']} | {r['wall_seconds']:.0f} "
              f"| {r['peak_rss_mib']:,.0f} | {r['artifact_bytes'] / 2**20:,.0f} | {r['shards']} |")


if __name__ == "__main__":
    main()
