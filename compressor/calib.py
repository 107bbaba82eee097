"""Calibration and evaluation text sources, sampling, and provenance.

Sources (``--calib``):

* a local ``.txt``, ``.jsonl`` or ``.parquet`` file, read through ``datasets``
  (``text_field`` names the column of jsonl/parquet files);
* ``wikitext2`` / ``c4`` / ``pileval``: named Hugging Face sets, only when online;
* a ``.safetensors`` file holding one int64 tensor ``input_ids`` ``[n_samples, seqlen]``:
  pre-tokenized calibration windows used as they are (no tokenization, no sampling), so
  two tools can be fed the very same token ids (``bench/`` does this);
* ``embedded``: an offline corpus that needs no download -- the English reference
  prose every CPython ships in ``pydoc_data.topics``. Its topics are split
  deterministically (SHA-256 of the topic name) into a calibration part (80 %) and an
  evaluation part (20 %), so calibration and evaluation never share text. It is a
  smoke-test default, not a benchmark corpus.

Sampling follows the GPTQ/AWQ convention: the whole text is tokenized once without
special tokens, and ``n_samples`` windows of ``seqlen`` tokens start at offsets drawn
with ``torch.Generator().manual_seed(seed)``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError
from .files import file_kind

NAMED_SETS = {
    "wikitext2": ("wikitext", "wikitext-2-raw-v1", "train", "text"),
    "c4": ("allenai/c4", "en", "validation", "text"),
    "pileval": ("mit-han-lab/pile-val-backup", None, "validation", "text"),
}


@dataclass(frozen=True)
class TextSource:
    """Loaded text plus its provenance."""

    name: str
    text: str
    sha256: str
    note: str = ""

    def provenance(self) -> dict:
        return {"source": self.name, "sha256": self.sha256, "chars": len(self.text), "note": self.note}


def _embedded(part: str) -> TextSource:
    from pydoc_data.topics import topics

    keep = []
    for key in sorted(topics):
        bucket = hashlib.sha256(key.encode()).digest()[0] % 5
        if (bucket == 0) == (part == "eval"):
            keep.append(topics[key])
    text = "\n\n".join(keep)
    return TextSource(
        f"embedded:{part}",
        text,
        hashlib.sha256(text.encode()).hexdigest(),
        "embedded CPython pydoc topics: a smoke-test corpus, not a benchmark",
    )


def load_text(spec: str, text_field: str = "text", part: str = "calib") -> TextSource:
    """Load a text source named by ``spec`` (see module docstring).

    ``part`` selects the calibration or evaluation split of the embedded corpus.

    Raises:
        InputError: missing or unreadable file, unknown extension, missing column,
            empty text, or a named set while offline.
    """
    if spec == "embedded":
        return _embedded(part)
    if spec in NAMED_SETS:
        return _named(spec)
    path = Path(spec)
    if path.exists() and not path.is_file():  # a FIFO, a device, a folder: named as what it is, never read
        raise InputError(f"text source {spec} is {file_kind(path.stat().st_mode)}, not a file: give a .txt/.jsonl/.parquet file")
    if not path.is_file():
        raise InputError(
            f"text source '{spec}' not found: give a .txt/.jsonl/.parquet file, 'embedded', or one of {', '.join(NAMED_SETS)}"
        )
    suffix = path.suffix.lower()
    if suffix == ".txt" or suffix == ".raw":
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read text file {spec}: {e}") from None
    elif suffix in (".jsonl", ".json", ".parquet"):
        text = _via_datasets(path, "json" if suffix != ".parquet" else "parquet", text_field)
    else:
        raise InputError(f"text file {spec}: unsupported extension '{suffix}' (use .txt, .jsonl or .parquet)")
    if not text.strip():
        raise InputError(f"text file {spec} is empty")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return TextSource(str(path), text, digest)


def _via_datasets(path: Path, builder: str, field: str) -> str:
    import datasets

    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as e:  # datasets raises many types for malformed files
        raise InputError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if field not in ds.column_names:
        raise InputError(f"{path} has no column '{field}' (columns: {', '.join(ds.column_names)}); use --calib-field")
    return "\n\n".join(str(t) for t in ds[field] if t)


def _named(name: str) -> TextSource:
    import datasets

    repo, config, split, field = NAMED_SETS[name]
    try:
        ds = datasets.load_dataset(repo, config, split=split)
    except Exception:
        raise InputError(
            f"calibration set '{name}' needs the Hugging Face hub, which is unreachable; "
            "give a local .txt/.jsonl/.parquet file or 'embedded'"
        ) from None
    text = "\n\n".join(str(t) for t in ds[field] if t)
    return TextSource(f"hf:{repo}/{config or ''}:{split}", text, hashlib.sha256(text.encode()).hexdigest())


def is_token_file(spec: str) -> bool:
    """True when ``spec`` names a pre-tokenized calibration file (``.safetensors``)."""
    return spec.lower().endswith(".safetensors")


def load_token_ids(spec: str, vocab_size: int | None = None) -> tuple[torch.Tensor, dict]:
    """Read pre-tokenized calibration windows from a safetensors file.

    The file must hold exactly one tensor, ``input_ids``: integer ``[n_samples, seqlen]``
    (any integer dtype; returned as int64), every id in ``[0, vocab_size)``.

    Returns:
        (ids int64 ``[n_samples, seqlen]``, provenance dict with the file's SHA-256).

    Raises:
        InputError: missing/unreadable file, other tensors, wrong rank or dtype, ids out of range.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(spec)
    if path.exists() and not path.is_file():  # a FIFO, a device, a folder: named as what it is, never read
        raise InputError(f"calibration token file {spec} is {file_kind(path.stat().st_mode)}, not a file")
    if not path.is_file():
        raise InputError(f"calibration token file '{spec}' not found")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"cannot read calibration token file {spec}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if set(tensors) != {"input_ids"}:
        raise InputError(f"calibration token file {spec} must hold one tensor 'input_ids' (found: {', '.join(sorted(tensors)) or 'none'})")
    ids = tensors["input_ids"]
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool or ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise InputError(f"calibration token file {spec}: 'input_ids' must be an integer [n_samples >= 1, seqlen >= 2] tensor "
                         f"(got {str(ids.dtype).removeprefix('torch.')} {list(ids.shape)})")
    ids = ids.to(torch.int64)
    if int(ids.min()) < 0:
        raise InputError(f"calibration token file {spec}: negative token id {int(ids.min())}")
    if vocab_size is not None and int(ids.max()) >= vocab_size:
        raise InputError(f"calibration token file {spec}: token ids span [{int(ids.min())}, {int(ids.max())}], "
                         f"outside the model's vocabulary [0, {vocab_size})")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    prov = {"source": str(path), "sha256": digest, "chars": 0, "note": "pre-tokenized input_ids",
            "samples": int(ids.shape[0]), "seqlen": int(ids.shape[1]), "seed": None}
    return ids, prov


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Tokenize ``text`` once, without special tokens; returns int64 ``[n_tokens]``."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def sample_windows(ids: torch.Tensor, n_samples: int, seqlen: int, seed: int, bos_id: int | None = None) -> torch.Tensor:
    """Draw ``n_samples`` windows of ``seqlen`` tokens; returns int64 ``[n_samples, seqlen]``.

    With ``bos_id`` (the tokenizer adds a BOS: :func:`compressor.tokens.bos_token_id`) each
    window is that BOS followed by ``seqlen - 1`` text tokens drawn as above, so calibration
    sees what the model sees in service (and what verify's windows hold); without it the
    windows are ``seqlen`` text tokens, the GPTQ/AWQ convention, unchanged.

    Raises:
        InputError: fewer tokens than one window, or non-positive sizes.
    """
    if n_samples < 1 or seqlen < 2:
        raise InputError(f"calibration needs samples >= 1 and seqlen >= 2 (got {n_samples} x {seqlen})")
    if ids.numel() < seqlen:
        raise InputError(
            f"calibration text has {ids.numel()} tokens, shorter than one sample of {seqlen}; "
            "give more text or a smaller --calib-seqlen"
        )
    body = seqlen - (bos_id is not None)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - body + 1, (n_samples,), generator=gen)
    out = torch.stack([ids[s : s + body] for s in starts.tolist()])
    if bos_id is not None:
        out = torch.cat([torch.full((n_samples, 1), bos_id, dtype=out.dtype), out], dim=1)
    return out
