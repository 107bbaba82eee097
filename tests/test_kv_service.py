"""The KV cache where it breaks in service (issue #47): verify's figures by position, the long
generation and its gate, the multi-turn chat -- a cache whose error grows with position is
caught, a good one passes."""

import json
import math

import numpy as np
import pytest
import torch

from compressor.commands.options import QuantizeOptions, VerifyOptions
from compressor.commands.quantize import run_quantize
from compressor.commands.verify import run_verify
from compressor.errors import InputError
from compressor.positions import buckets, sequence_buckets
from compressor.report import VerifyReport, markdown, write_report
from compressor.report_service import MultiTurn
from compressor.service_eval import repeated_4gram_pct, user_turns
from conftest import kvq_run as run
from conftest import make_model_dir

CHAT = ("{% for m in messages %}<eos>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<eos>assistant\n{% endif %}")
FAST = dict(seqlen=1024, max_windows=1, kv_chunk=128, max_new_tokens=4, hidden_batches=1, long_tokens=256, turns=2,
            threads=1)


@pytest.fixture(scope="module")
def kv_art(tmp_path_factory, tokenizer):
    """A KV-only int8 artifact of a tiny llama whose context reaches 2048 and whose tokenizer has a chat template."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT
    root = tmp_path_factory.mktemp("kvservice")
    src = make_model_dir(root / "model", tok, max_position_embeddings=2048)
    art = root / "kv-int8"
    run_quantize(QuantizeOptions(model=str(src), output=art, recipe="kv-int8"))
    return art


def drifting(monkeypatch, strength: float = 2.0):
    """Make verify's quantized cache add to every value a fixed pattern growing with the token's
    position: ``strength * (position / 256) ** 2`` times the values' standard deviation (a test-only scheme
    whose error grows with position, as a scale or rotation bug that accumulates would)."""
    import compressor.commands.verify_common as v

    real = v.quantized_cache

    def make(*a, **kw):
        cache = real(*a, **kw)
        for layer in cache.layers:
            def update(k, val, *args, _update=layer.update, _layer=layer, **kws):
                start = _layer.cumulative_length
                pos = torch.arange(start, start + k.shape[-2], dtype=val.dtype).view(1, 1, -1, 1)
                g = torch.Generator().manual_seed(7)
                pattern = torch.randn(val.shape[-1], generator=g, dtype=val.dtype)
                return _update(k, val + strength * (pos / 256) ** 2 * val.std() * pattern, *args, **kws)

            layer.update = update
        return cache

    monkeypatch.setattr(v, "quantized_cache", make)


# --- definitions ----------------------------------------------------------------------------

def test_buckets_cover_the_positions_measured_and_omit_the_rest():
    assert buckets(1023) == [("0-512", 0, 512), ("512-2k", 512, 1023)]
    assert [b[0] for b in buckets(10_000)] == ["0-512", "512-2k", "2k-8k", "8k+"]
    assert buckets(2047)[-1] == ("512-2k", 512, 2047) and len(buckets(2049)) == 3
    assert buckets(600, first=127) == [("0-512", 127, 512), ("512-2k", 512, 600)]
    got = sequence_buckets([0.0] * 385 + [1.0] * 88, [True] * 385 + [False] * 88, first=127)
    assert [(b["bucket"], b["tokens"], b["kl_mean"], b["top1_pct"]) for b in got] == [
        ("0-512", 385, 0.0, 100.0), ("512-2k", 88, 1.0, 0.0)]


def test_repeated_4grams_and_user_turns_by_hand():
    assert repeated_4gram_pct([1, 2, 3, 4, 5]) == 0.0
    assert repeated_4gram_pct([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(100 * 1 / 5)  # (1,2,3,4) twice of 5
    assert repeated_4gram_pct([1, 2, 3]) is None
    text = " = Heading = \n\nshort\n\n" + "word " * 200 + "\n\n" + "Second   paragraph, long enough to be a turn.\n"
    turns = user_turns(text, 5, chars=50)
    assert len(turns) == 2 and len(turns[0]) <= 50 and turns[0].startswith("word") and not turns[0].endswith(" ")
    assert turns[1] == "Second paragraph, long enough to be a turn."
    wiki = (" = Title = \n First paragraph of the article , long enough to be a turn .\n = = Part = = \n"
            " Second one , also a line of its own in the text .\n")  # one paragraph a line, no blank lines
    assert user_turns(wiki, 2) == ["First paragraph of the article , long enough to be a turn .",
                                   "Second one , also a line of its own in the text ."]


# --- verify end to end ------------------------------------------------------------------------

@pytest.mark.slow  # a 1024-token window and 256 generated tokens, twice (make test-fast leaves it out)
def test_a_good_cache_passes_and_its_figures_add_up(kv_art, tmp_path):
    rep = run_verify(VerifyOptions(artifact=kv_art, min_long_agreement=90, **FAST))
    bp = rep["by_position"]
    assert [b["bucket"] for b in bp["buckets"]] == ["0-512", "512-2k"]  # 2k-8k and 8k+ lie beyond the window
    assert sum(b["tokens"] for b in bp["buckets"]) == rep["eval"]["predicted_tokens"] == 1023
    kv = [b["configurations"]["KV only"] for b in bp["buckets"]]
    weights = [b["tokens"] for b in bp["buckets"]]
    # the same per-position values as the window figures: token-weighted bucket means are the totals
    assert np.average([k["kl_mean"] for k in kv], weights=weights) == pytest.approx(rep["distribution"]["kl"]["mean"],
                                                                                     rel=1e-4)
    assert np.average([k["top1_pct"] for k in kv], weights=weights) == pytest.approx(
        rep["distribution"]["top1_agreement_pct"], rel=1e-4)
    log_ppl = np.average([math.log(k["ppl"]) for k in kv], weights=weights)
    assert math.exp(log_ppl) == pytest.approx(rep["perplexity"]["artifact"], rel=1e-4)
    lg = rep["long_generation"]
    assert lg["tokens"] == len(lg["kl_per_token"]) == 256 and lg["prompt_tokens"] == 128
    assert lg["top1_agreement_pct"] >= 90 and lg["measured_on"] == "KV only"
    gate = next(g for g in rep["gates"] if g["name"] == "min_long_agreement_pct")
    assert gate["passed"] and gate["value"] == lg["top1_agreement_pct"] and rep["passed"]
    turns = rep["multi_turn"]["turns"]
    assert [t["turn"] for t in turns] == [1, 2] and turns[1]["context_tokens"] > turns[0]["prompt"]["tokens"]
    assert all(t["reply"]["top1_pct"] >= 90 for t in turns)
    files = write_report(rep, tmp_path / "r")
    assert (tmp_path / "r" / "kv_by_position.png") in files
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| 512-2k (512-1022) | 511 |" in md and "Long generation (KV only)" in md and "Multi-turn" in md
    VerifyReport.model_validate(json.loads((tmp_path / "r" / "report.json").read_text()))


@pytest.mark.slow  # a 1024-token window and 256 generated tokens, twice (make test-fast leaves it out)
def test_a_cache_drifting_with_position_is_caught(kv_art, monkeypatch, capsys):
    """The position buckets show the error growing, the long generation diverges and its gate
    fails (exit 1, named); the JSON report validates against the schema."""
    drifting(monkeypatch)
    code, out, err = run(["verify", kv_art, "--seqlen", 1024, "--max-windows", 1, "--max-new-tokens", 4,
                          "--hidden-batches", 1, "--threads", 1, "--long-tokens", 256, "--turns", 2,
                          "--min-long-agreement", 90, "--json"], capsys)
    assert code == 1, err
    rep = json.loads(out)
    VerifyReport.model_validate(rep)
    early, late = (b["configurations"]["KV only"] for b in rep["by_position"]["buckets"])
    assert late["kl_mean"] > 2 * early["kl_mean"] and late["top1_pct"] < early["top1_pct"] - 30
    lg = rep["long_generation"]
    assert lg["top1_agreement_pct"] < 90 and lg["first_divergence"] is not None and lg["disagreements"]
    assert "min_long_agreement_pct" in rep["failed_gates"]
    first, second = rep["multi_turn"]["turns"]  # the second turn's reply sits further out: more error
    assert second["reply"]["kl_mean"] > 10 * first["reply"]["kl_mean"]


def test_multi_turn_without_a_chat_template_is_skipped_with_a_note(tmp_path, tokenizer, capsys):
    src = make_model_dir(tmp_path / "model", tokenizer)  # the tiny tokenizer has no chat template
    art = tmp_path / "kv"
    run_quantize(QuantizeOptions(model=str(src), output=art, recipe="kv-int8"))
    rep = run_verify(VerifyOptions(artifact=art, **{**FAST, "seqlen": 128, "long_tokens": 8}))
    assert rep["multi_turn"]["turns"] == [] and "no chat template" in rep["multi_turn"]["note"]
    assert any("no chat template" in w for w in rep["warnings"])
    assert "no chat template" in markdown(rep)


def test_the_long_agreement_gate_needs_a_long_generation(kv_art, tiny_model_dir, tmp_path):
    with pytest.raises(InputError, match="--min-long-agreement cannot be evaluated: --long-tokens is 0"):
        run_verify(VerifyOptions(artifact=kv_art, min_long_agreement=90, **{**FAST, "long_tokens": 0}))
    w4 = tmp_path / "w4"  # weights only, no KV scheme
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=w4, algorithm="rtn", group_size=32,
                                 calib_samples=4, calib_seqlen=32))
    with pytest.raises(InputError, match="no KV scheme"):
        run_verify(VerifyOptions(artifact=w4, min_long_agreement=90, **{**FAST, "seqlen": 64}))


def test_serve_smoke_long_generation_through_the_runtime(kv_art, capsys):
    """``kvq serve-smoke --long-tokens``: the runtime's greedy continuation against the reference
    teacher-forced on it; a good KV cache agrees, and the figures are per generated position."""
    code, out, err = run(["serve-smoke", kv_art, "--max-new-tokens", 4, "--threads", 1, "--long-tokens", 96, "--json"],
                         capsys)
    assert code == 0, err
    lg = json.loads(out)["long_generation"]
    assert lg["tokens"] == len(lg["kl_per_token"]) == 96 and lg["first_position"] == lg["prompt_tokens"] - 1
    assert lg["top1_agreement_pct"] >= 90 and lg["kl"]["max"] < 0.05
    assert lg["top1_agreement_pct"] == pytest.approx(100 * (1 - len(lg["disagreements"]) / 96))
    assert [b["bucket"] for b in lg["by_position"]] == ["0-512"] and lg["by_position"][0]["tokens"] == 96
    assert set(lg["repeated_4gram_pct"]) == {"reference", "runtime"}


def test_serve_smoke_multi_turn_through_the_runtime(kv_art, capsys):
    """``kvq serve-smoke --turns``: the prompts as user turns through the chat template, one runtime cache kept
    across turns; the reference teacher-forced on the conversation agrees with a good cache at every turn (a
    position off by one would compare unrelated distributions), and the figures count what was fed."""
    code, out, err = run(["serve-smoke", kv_art, "--max-new-tokens", 4, "--threads", 1, "--turns", 3, "--json"],
                         capsys)
    assert code == 0, err
    mt = json.loads(out)["multi_turn"]
    MultiTurn.model_validate(mt)  # verify's section, the same shape
    assert mt["measured_on"] == "runtime (weights + KV as served)" and mt["note"] is None
    turns = mt["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and turns[0]["context_tokens"] == 0
    for a, b in zip(turns, turns[1:]):  # each turn's prompt (its first token uncompared) and reply stay in the cache
        assert b["context_tokens"] == a["context_tokens"] + a["prompt"]["tokens"] + 1 + a["reply"]["tokens"]
    for t in turns:
        assert t["reply"]["tokens"] == 48 or t["ended"] == "eos"
        assert t["prompt"]["top1_pct"] >= 90 and t["reply"]["top1_pct"] >= 90
        assert t["prompt"]["kl_mean"] < 0.02 and t["reply"]["kl_mean"] < 0.02


def test_the_runtime_chat_keeps_its_cache_and_a_drifting_cache_is_caught(kv_art, monkeypatch):
    """The chat's cache kept across turns gives the logits of the whole conversation read afresh (prefix
    reuse is exact up to the cache's rounding); a runtime cache whose values drift with position makes the
    later turns' replies disagree with the reference."""
    import compressor.runtime.kv_cache as kc
    from compressor.commands.smoke_service import turns_compare, turns_runtime, whole_reference
    from compressor.runtime.generate import Runtime
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rt, tok = Runtime.from_artifact(kv_art), AutoTokenizer.from_pretrained(kv_art)
    users = ["the first question", "a second, longer question about the same thing", "a third"]
    chat = turns_runtime(rt, tok, users, 12)
    seq = [i for t in chat["turns"] for i in t["ids"] + t["reply"]]
    fresh = rt.logits([seq])[0]
    at = 0
    for t in chat["turns"]:
        n = len(t["ids"]) + len(t["reply"])
        torch.testing.assert_close(t["served"], fresh[at:at + n - 1], atol=2e-3, rtol=1e-3)
        at += n
    ref = whole_reference(AutoModelForCausalLM.from_pretrained(json.loads(
        (kv_art / "kvq-manifest.json").read_text())["source"]["spec"]), "cpu")[0]
    good = turns_compare(chat, ref, 12)["turns"]
    real = kc.KVCache.update

    def drifting_update(self, layer, k, v, start, n_new):
        pos = (start[:, None] + torch.arange(k.shape[2])[None, :]).to(v.dtype)[:, None, :, None]
        pattern = torch.randn(v.shape[-1], generator=torch.Generator().manual_seed(7)).to(v.dtype)
        return real(self, layer, k, v + 2.0 * (pos / 64) ** 2 * v.std() * pattern, start, n_new)

    monkeypatch.setattr(kc.KVCache, "update", drifting_update)
    bad = turns_compare(turns_runtime(rt, tok, users, 12), ref, 12)["turns"]
    assert bad[-1]["reply"]["kl_mean"] > 10 * max(good[-1]["reply"]["kl_mean"], 1e-4)
    assert bad[-1]["prompt"]["kl_mean"] > 10 * bad[0]["prompt"]["kl_mean"]


def _stopped_at_the_context(rep: dict, context: int) -> None:
    """A report whose 5-turn chat stopped, with its note and warning, before the turn that would pass ``context``."""
    mt = rep["multi_turn"]
    assert 1 <= len(mt["turns"]) < 5
    assert f"past {context} tokens (the model's context length): stopped there" in mt["note"]
    assert any("multi-turn: turn" in w for w in rep["warnings"])
    last = mt["turns"][-1]
    assert last["context_tokens"] + last["prompt"]["tokens"] + 1 + last["reply"]["tokens"] <= context


def test_a_chat_past_the_context_stops_with_a_note_and_a_long_generation_past_it_is_refused(tmp_path, tokenizer,
                                                                                           capsys):
    """A model whose context holds two of the chat's turns: the third is not run, a note and a warning say why
    (exit 0: the turns that ran are compared); ``--long-tokens`` past the context is refused before generating."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT
    art = tmp_path / "kv"
    run_quantize(QuantizeOptions(model=str(make_model_dir(tmp_path / "m", tok, max_position_embeddings=150)),
                                 output=art, recipe="kv-int8"))
    code, out, err = run(["serve-smoke", art, "--max-new-tokens", 4, "--threads", 1, "--turns", 5, "--json"], capsys)
    assert code == 0, err
    _stopped_at_the_context(json.loads(out), 150)
    code, _, err = run(["serve-smoke", art, "--threads", 1, "--long-tokens", 200], capsys)
    assert code == 2 and "prompt 1: " in err and "+ --long-tokens 200 exceeds the model's context length 150" in err
    assert "Traceback" not in err
    # verify's chat (the model with a float and a quantized cache) stops at the same bound
    code, out, err = run(["verify", art, "--seqlen", 64, "--max-windows", 1, "--max-new-tokens", 2, "--threads", 1,
                          "--long-tokens", 0, "--turns", 5, "--json"], capsys)
    assert code in (0, 1), err
    _stopped_at_the_context(json.loads(out), 150)
    code, _, err = run(["verify", art, "--seqlen", 64, "--max-windows", 1, "--long-tokens", 23], capsys)
    assert code == 2 and "--long-tokens 23 after the long generation's 128-token prompt exceeds the model's context " \
                         "(max_position_embeddings 150); use --long-tokens 22 or less" in err
    assert "Traceback" not in err
