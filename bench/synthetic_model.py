"""A model folder at a real model's shape with seeded random weights, for the GPU check on a
machine the real weights cannot reach (the first GPU run could carry 64 MiB, and SmolLM2's GGUF
is 98 MB). Shape-bound figures (time, memory, kernel choice, CUDA-vs-CPU agreement) stand for
the real model; quality figures (perplexity, agreement with the float model) mean nothing.

    python bench/synthetic_model.py prepare smollm2-135m DIR   # config + tokenizer, no weights (~4 MB)
    python bench/synthetic_model.py fill DIR [--seed 0]         # seeded random weights, bfloat16

``bench/gpu_check.py --model DIR`` fills a folder that has no weights itself (in its work folder).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARKER = "kvq-synthetic.json"


def prepare(spec: str, out: Path) -> Path:
    """Write ``spec``'s config and tokenizer (no weights) to ``out`` (an alias, a GGUF file or a
    Hugging Face folder, as ``kvq quantize`` reads it). Returns ``out``.

    Raises:
        compressor.errors.InputError: ``spec`` cannot be read.
    """
    from compressor.source.open import load_model
    from compressor.source.resolve import resolve_source

    model, tokenizer = load_model(resolve_source(spec))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / MARKER).write_text(json.dumps({"shape_of": spec, "weights": "none yet: bench/synthetic_model.py fill"}) + "\n")
    return out


def needs_weights(folder: Path) -> bool:
    """True for a folder with a config.json and no safetensors (a :func:`prepare` output)."""
    folder = Path(folder)
    return folder.is_dir() and (folder / "config.json").is_file() and not any(folder.glob("*.safetensors"))


def fill(folder: Path, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Give ``folder`` seeded random weights (transformers' own initialisation, ``dtype``)
    and record the seed in ``kvq-synthetic.json``. Returns ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    for f in folder.glob("*.safetensors"):
        f.chmod(0o644)  # as the config and tokenizer files
    meta = json.loads((folder / MARKER).read_text()) if (folder / MARKER).is_file() else {}
    meta.update(weights=f"random, torch.manual_seed({seed}), transformers' initialisation, {dtype}")
    (folder / MARKER).write_text(json.dumps(meta) + "\n")
    return folder


def filled_copy(folder: Path, work: Path, seed: int = 0) -> Path:
    """A copy of a weightless ``folder`` under ``work`` with :func:`fill`'s weights (made once)."""
    dst = Path(work) / "synthetic-model"
    if not any(dst.glob("*.safetensors")):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(folder, dst)
        fill(dst, seed)
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a model folder at a real model's shape with random weights")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare", help="config + tokenizer of MODEL, no weights")
    a.add_argument("model")
    a.add_argument("out", type=Path)
    b = sub.add_parser("fill", help="seeded random weights into DIR")
    b.add_argument("dir", type=Path)
    b.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        from compressor.errors import InputError

        try:
            print(prepare(args.model, args.out))
        except InputError as e:
            p.error(str(e))
    elif not needs_weights(args.dir):
        p.error(f"{args.dir} is not a folder with a config.json and no weights")
    else:
        print(fill(args.dir, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
