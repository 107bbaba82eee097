"""Tensor digests of every bundled recipe's artifact on fixed tiny models: the before/after
check of a refactor that must not change a byte of any artifact.

Builds tiny random-init models (seeded; llama, qwen3_moe, deepseek_v3, gemma3_text, glm4)
into ``--work``, quantizes each with every bundled recipe (and the AWQ/GPTQ formats) through
the ``kvq`` command line in this process, and writes one JSON: run name -> {content digest,
tensor name -> digest}. Compare two such files with ``--compare A.json B.json``.

    python bench/recipe_digests.py --out before.json     # on the old commit
    python bench/recipe_digests.py --out after.json      # on the new one
    python bench/recipe_digests.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
_TOP2 = dict(num_experts_per_tok=2)
CONFIGS = {
    "llama": {},
    "qwen3_moe": dict(head_dim=16, moe_intermediate_size=32, num_experts=4, mlp_only_layers=[0], **_TOP2),
    "deepseek_v3": dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1, **_TOP2),
    "gemma3_text": dict(head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                        final_logit_softcapping=30.0, query_pre_attn_scalar=16, tie_word_embeddings=True),
    "glm4": dict(head_dim=16),
}
#: recipes run on every model; the rest on llama only
EVERY_MODEL = ("w4a16-awq", "w4a16-gptq", "w4a16-rtn-g64", "kv-fp8")


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from compressor.calib import load_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = load_text("embedded", part="calib").text[:200_000]
    tok.train_from_iterator([text[i: i + 2000] for i in range(0, len(text), 2000)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _model(model_type: str, folder: Path, tokenizer) -> Path:
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    cfg = CONFIG_MAPPING[model_type](**{**_BASE, "vocab_size": len(tokenizer), **CONFIGS[model_type]})
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5) if model_type.startswith("gemma") else p.uniform_(0.5, 1.5)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif p.ndim == 3:
                p.normal_(0, 0.05)
    m.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _runs(recipes: list[str]) -> list[tuple[str, str, list[str]]]:
    out = []
    for mt in CONFIGS:
        for r in recipes:
            if mt == "llama" or r in EVERY_MODEL:
                out.append((f"{mt}/{r}", mt, ["--recipe", r]))
    out.append(("llama/w4a16-awq+kv-fp8", "llama", ["--recipe", "w4a16-awq", "--recipe", "kv-fp8"]))
    out.append(("llama/w4a16-awq@awq", "llama", ["--recipe", "w4a16-awq", "--format", "awq"]))
    out.append(("llama/w4a16-gptq@gptq", "llama", ["--recipe", "w4a16-gptq", "--format", "gptq"]))
    out.append(("llama/w4a16-rtn-g64@blake3", "llama", ["--recipe", "w4a16-rtn-g64", "--digest", "blake3"]))
    return out


def collect(work: Path) -> dict:
    from compressor.cli import main
    from compressor.manifest import load_manifest
    from compressor.recipe import bundled_recipes

    work.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    models = {mt: _model(mt, work / "src" / mt, tok) for mt in CONFIGS}
    (work / "out").mkdir(exist_ok=True)
    result = {}
    for name, mt, args in _runs(sorted(bundled_recipes())):
        out = work / "out" / name.replace("/", "__")
        argv = ["quantize", str(models[mt]), *args, "--calib", "embedded", "--calib-samples", "8",
                "--calib-seqlen", "64", "--group-size", "32", "-o", str(out), "--overwrite", "--json"]
        if "kv-" in args[1] and len(args) == 2:
            argv.remove("--group-size"), argv.remove("32")
        try:
            main(argv)
        except SystemExit as e:
            if e.code not in (0, None):
                result[name] = {"error": f"exit {e.code}"}
                continue
        if not out.is_dir():
            raise SystemExit(f"{name}: kvq wrote no artifact")
        m = load_manifest(out)
        result[name] = {"content_digest": m.content_digest(),
                        "tensors": {t: r.digest for t, r in sorted(m.tensors.items())}}
        print(f"{name}: {len(m.tensors)} tensors, content {m.content_digest()[:16]}", file=sys.stderr)
        shutil.rmtree(out)
    return result


def compare(a: dict, b: dict) -> int:
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'after' if name not in a else 'before'}")
            bad += 1
            continue
        ta, tb = a[name].get("tensors", {}), b[name].get("tensors", {})
        diff = sorted(t for t in set(ta) | set(tb) if ta.get(t) != tb.get(t))
        if "error" in a[name] or "error" in b[name] or diff:
            bad += 1
            print(f"{name}: DIFFERENT ({a[name].get('error') or b[name].get('error') or ', '.join(diff[:5])})")
        else:
            print(f"{name}: {len(ta)} tensor digests identical")
    print(f"{len(set(a) | set(b)) - bad} of {len(set(a) | set(b))} runs identical")
    return 1 if bad else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the digests here")
    ap.add_argument("--work", type=Path, default=Path("bench/work/recipe_digests"))
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    a = ap.parse_args()
    if a.compare:
        sys.exit(compare(*(json.loads(p.read_text()) for p in a.compare)))
    res = collect(a.work)
    a.out.write_text(json.dumps(res, indent=1, sort_keys=True))
    print(f"wrote {a.out}: {len(res)} runs")
