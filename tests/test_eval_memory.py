"""Verify's statistics on a large vocabulary: perplexity, KL and top-1 are computed a chunk of
positions at a time (issue #22), so peak memory follows the chunk, not seqlen x vocab; the
chunked figures equal the whole-window ones."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from compressor.evaluate import LOGIT_CHUNK, LogitHead, compare, perplexity, window_logits
from compressor.stats import kl_and_top1

from tiny_models import tiny_lm


def _reference_figures(ref, cand, wins):
    """The whole-window computation (what verify did before chunking)."""
    out = {"nll_ref": 0.0, "nll": 0.0, "kl": [], "same": 0}
    for w in wins:
        x = w.unsqueeze(0)
        rl, cl = window_logits(ref, x), window_logits(cand, x)
        out["nll_ref"] += torch.nn.functional.cross_entropy(rl, x[0, 1:], reduction="sum").item()
        out["nll"] += torch.nn.functional.cross_entropy(cl, x[0, 1:], reduction="sum").item()
        kl, same = kl_and_top1(rl, cl)
        out["kl"].append(kl)
        out["same"] += int(same.sum())
    return out


@pytest.mark.parametrize("model_type,kw", [("llama", {}),
                                           ("gemma3_text", dict(head_dim=16, final_logit_softcapping=5.0,
                                                                 query_pre_attn_scalar=16, sliding_window=64))])
def test_chunked_statistics_equal_whole_window(model_type, kw):
    ref, cand = tiny_lm(500, 0, model_type=model_type, **kw), tiny_lm(500, 1, model_type=model_type, **kw)
    wins = torch.randint(0, 500, (2, 3 * LOGIT_CHUNK + 5), generator=torch.Generator().manual_seed(0))
    assert LogitHead(ref, wins[:1, :8]).usable  # softcapping (Gemma) is reproduced
    got = compare(ref, {"c": (cand, None)}, wins)
    want = _reference_figures(ref, cand, wins)
    n = wins.shape[0] * (wins.shape[1] - 1)
    assert got["reference"]["nll"] == pytest.approx(want["nll_ref"] / n, rel=1e-6)
    assert got["c"]["nll"] == pytest.approx(want["nll"] / n, rel=1e-6)
    assert got["c"]["top1_agreement"] == want["same"] / n
    assert torch.allclose(torch.from_numpy(got["c"]["kl_values"]), torch.cat(want["kl"]), rtol=1e-4, atol=1e-7)
    assert perplexity(cand, wins)["nll"] == pytest.approx(want["nll"] / n, rel=1e-6)


def test_head_with_unknown_scaling_falls_back_to_whole_logits():
    """A head kvq cannot reproduce (here: logits scaled after lm_head) is detected by the
    probe, and the statistics use the model's own logits."""
    ref = tiny_lm(300, 0)
    cand = tiny_lm(300, 1)
    orig = type(cand).forward

    class Scaled(type(cand)):
        def forward(self, *a, **k):
            out = orig(self, *a, **k)
            out.logits = out.logits * 0.5
            return out

    cand.__class__ = Scaled
    wins = torch.randint(0, 300, (1, 100), generator=torch.Generator().manual_seed(0))
    assert not LogitHead(cand, wins[:, :8]).usable
    got = compare(ref, {"c": (cand, None)}, wins)
    want = _reference_figures(ref, cand, wins)
    assert got["c"]["nll"] == pytest.approx(want["nll"] / 99, rel=1e-6)


_MEMORY = r"""
import json, resource, sys, torch
sys.path.insert(0, sys.argv[1])
from tiny_models import tiny_lm
from compressor.evaluate import compare
vocab, seqlen = 131072, 512
ref, cand = tiny_lm(vocab, 0), tiny_lm(vocab, 1)
wins = torch.randint(0, vocab, (1, seqlen), generator=torch.Generator().manual_seed(0))
compare(ref, {"c": (cand, None)}, wins[:, :16])  # warm-up: allocator, kernels
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
compare(ref, {"c": (cand, None)}, wins)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"delta_mib": (after - before) / 1024, "logits_mib": seqlen * vocab * 4 / 2**20}))
"""


def test_verify_memory_is_bounded_by_the_chunk_not_the_vocabulary(tmp_path):
    """131k vocabulary, one window of 512 tokens: the whole window's logits are 256 MiB per
    copy (the unchunked statistics held about seven copies, ~1.8 GiB); chunked, the
    statistics add less than 400 MiB to the process's peak RSS."""
    from pathlib import Path

    r = subprocess.run([sys.executable, "-c", _MEMORY, str(Path(__file__).parent)], capture_output=True, text=True,
                       timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["delta_mib"] < 400, got


def test_a_quantized_head_is_applied_chunk_by_chunk(tmp_path, tokenizer, monkeypatch):
    """An artifact with a packed 8-bit LM head, verified as served (bfloat16): its statistics take
    the chunked path (the head on ``LOGIT_CHUNK`` positions at a time), like a float head's; the
    whole-window logits are never computed."""
    import compressor.evaluate as evaluate
    from conftest import make_model_dir

    from compressor.commands.options import QuantizeOptions, VerifyOptions
    from compressor.commands.quantize import run_quantize
    from compressor.commands.verify import run_verify
    from compressor.artifact import load_artifact

    src = make_model_dir(tmp_path / "src", tokenizer, tie_word_embeddings=False)
    recipe = tmp_path / "head.yaml"
    recipe.write_text("algorithm: rtn\nweights: {num_bits: 4, group_size: 32, symmetric: false}\nhead: {num_bits: 8}\n")
    out = tmp_path / "out"
    run_quantize(QuantizeOptions(model=str(src), output=out, recipe=str(recipe), calib_samples=4, calib_seqlen=32))
    art, _ = load_artifact(out, dtype=torch.bfloat16)
    assert LogitHead(art, torch.randint(0, 300, (1, 8))).usable
    monkeypatch.setattr(evaluate, "window_logits", lambda *a, **k: pytest.fail("whole-window logits computed"))
    rep = run_verify(VerifyOptions(artifact=out, seqlen=3 * LOGIT_CHUNK + 5, max_windows=2, max_new_tokens=4,
                                   hidden_batches=1))
    assert rep["evaluated_in"]["dtype"] == "bfloat16"
    assert any(t["name"] == "lm_head.weight" for t in rep["weights"]["tensors"])  # the head is the packed one


_WEIGHT_MEMORY = r"""
import json, resource, torch
from compressor.entry import malloc_defaults
from compressor.stats import weight_error, weight_stats
malloc_defaults()  # the kvq process's glibc settings (compressor.entry)
w = torch.randn(49152, 576)  # SmolLM2's LM head: 226 MB per float64 copy
w_hat = w.bfloat16()
weight_error(w[:8], w_hat[:8]); weight_stats(w[:8])  # warm-up
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weight_error(w, w_hat); weight_stats(w); weight_stats(w_hat)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"delta_mib": (after - before) / 1024}))
"""


def test_weight_statistics_of_a_large_head_stay_in_blocks():
    """The weight statistics of a ``[49152, 576]`` head (verify's ``weights`` section with a
    quantized head) add under 100 MiB to the peak RSS of a process with kvq's malloc settings
    (40-56 MiB measured); in float64 copies of the whole tensor they added 864 MiB."""
    r = subprocess.run([sys.executable, "-c", _WEIGHT_MEMORY], capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["delta_mib"] < 100, got


def _tokenizer(add_bos: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "Hello": 2, "world": 3, "a": 4, "b": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def test_bos_rule_follows_the_tokenizer():
    """A tokenizer that adds a BOS gets windows that start with it (llama.cpp's rule); one
    that adds none (SmolLM2's) gets plain text windows, as before."""
    from compressor.tokens import bos_token_id
    from compressor.evaluate import windows

    assert bos_token_id(_tokenizer(True)) == 0
    assert bos_token_id(_tokenizer(False)) is None
    ids = torch.arange(10, 30)
    plain = windows(ids, 5)
    assert plain.tolist()[0] == [10, 11, 12, 13, 14] and plain.shape == (4, 5)
    bos = windows(ids, 5, bos_id=0)
    assert bos.tolist()[:2] == [[0, 10, 11, 12, 13], [0, 14, 15, 16, 17]] and bos.shape == (5, 5)
    assert windows(ids, 5, max_windows=2, bos_id=0).shape == (2, 5)
