"""Shared fixtures and helpers: tiny random-init models built in the test (no downloads), and
the in-process CLI runner every CLI test uses (``from conftest import kvq_run as run``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def kvq_run(argv, capsys) -> tuple[int, str, str]:
    """Run ``kvq ARGV...`` in this process (``compressor.cli.main``): (exit code, stdout, stderr).

    ``argv`` items may be paths or numbers (each is passed through ``str``); ``capsys`` is
    pytest's fixture, read (and so cleared) once the command exits.
    """
    from compressor.cli import main

    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    cap = capsys.readouterr()
    return exc.value.code, cap.out, cap.err


def assert_clean_error(code, err, expected_code, pattern, parent: Path | None = None):
    """The CLI error contract: exit ``expected_code``, the last stderr line ``kvq: error: ...``
    containing ``pattern``, no traceback, and (with ``parent``) no ``kvq-tmp`` folder left in it."""
    assert code == expected_code, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("kvq: error:"), err
    assert "Traceback" not in err
    assert pattern in err, err
    if parent is not None:
        assert not [p for p in parent.iterdir() if "kvq-tmp" in p.name], "temp folder left behind"


def tiny_config(**kw):
    from transformers import LlamaConfig

    base = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, rms_norm_eps=1e-5,
    )
    base.update(kw)
    return LlamaConfig(**base)


def tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on the embedded corpus (deterministic, offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from compressor.calib import load_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = load_text("embedded", part="calib").text[:200_000]
    tok.train_from_iterator([text[i : i + 2000] for i in range(0, len(text), 2000)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


def make_model_dir(path: Path, tokenizer, seed: int = 0, **cfg_kw) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=len(tokenizer), **cfg_kw)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # give the norms some spread so AWQ has something to fold
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny") / "model", tokenizer)


def quantize_tiny(out: Path, model_dir: Path, **kw) -> Path:
    """A tiny RTN W4 (group 32) artifact of ``model_dir`` at ``out``, calibrated on 4 x 32 tokens; ``kw`` adds
    :class:`~compressor.api.QuantizeOptions` fields (``kv_scheme="fp8"``, ``digest_algorithm="blake3"``)."""
    from compressor.api import QuantizeOptions, run_quantize

    run_quantize(QuantizeOptions(model=str(model_dir), output=out, algorithm="rtn", group_size=32, calib_samples=4,
                                 calib_seqlen=32, **kw))
    return out
