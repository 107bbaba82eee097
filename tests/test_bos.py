"""The tokenizer's own BOS rule in every place text becomes ids (issue #41): calibration,
verify's drift prompts, the runtime and its HTTP API, the plain-text chat fallback; and a
tokenizer that adds no BOS (SmolLM2's) leaves the ids as they were."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from conftest import kvq_run as run
from conftest import make_model_dir, quantize_tiny


def _with_bos(base):
    """``base`` (the tiny BPE tokenizer) plus a ``<s>`` token its post-processor puts in front of every text,
    as Llama 3's, Mistral's and DeepSeek-V3's tokenizers do."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer.__class__.from_str(base.backend_tokenizer.to_str()),
                                  eos_token="<eos>")
    tok.add_special_tokens({"bos_token": "<s>"})
    bos = tok.convert_tokens_to_ids("<s>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return tok


@pytest.fixture(scope="module")
def bos_tokenizer(tokenizer):
    return _with_bos(tokenizer)


@pytest.fixture(scope="module")
def bos_art(tmp_path_factory, bos_tokenizer):
    root = tmp_path_factory.mktemp("bos")
    model = make_model_dir(root / "model", bos_tokenizer)
    return quantize_tiny(root / "art", model, kv_scheme="fp8")


def test_rule_is_read_from_the_tokenizer(tokenizer, bos_tokenizer):
    from compressor.tokens import bos_rule, bos_token_id, encode

    bos = bos_tokenizer.convert_tokens_to_ids("<s>")
    assert bos_token_id(bos_tokenizer) == bos and bos_rule(bos_tokenizer)["bos_token_id"] == bos
    plain = bos_tokenizer("The cat sat.", add_special_tokens=False)["input_ids"]
    assert encode(bos_tokenizer, "The cat sat.") == [bos] + plain
    assert encode(bos_tokenizer, "") == [bos]
    # a tokenizer that adds none: the ids are the text's tokens, unchanged
    assert bos_token_id(tokenizer) is None and bos_rule(tokenizer)["bos_token_id"] is None
    assert encode(tokenizer, "The cat sat.") == tokenizer("The cat sat.", add_special_tokens=False)["input_ids"]


def test_calibration_windows_follow_the_rule():
    from compressor.calib import sample_windows

    ids = torch.arange(100, 200)
    plain = sample_windows(ids, 4, 16, seed=3)
    assert plain.shape == (4, 16) and plain.tolist() == sample_windows(ids, 4, 16, seed=3, bos_id=None).tolist()
    with_bos = sample_windows(ids, 4, 16, seed=3, bos_id=7)
    assert with_bos.shape == (4, 16) and (with_bos[:, 0] == 7).all()
    assert all(torch.equal(w[1:], ids[int(w[1]) - 100: int(w[1]) - 100 + 15]) for w in with_bos)  # contiguous text


def test_quantize_calibrates_with_the_bos_and_records_the_rule(tmp_path, bos_tokenizer, tokenizer, monkeypatch):
    import compressor.commands.quantize as q

    seen = []
    real = q.quantize_model

    def spy(model, recipe, calib_ids, *a, **kw):
        seen.append(calib_ids.clone())
        return real(model, recipe, calib_ids, *a, **kw)

    monkeypatch.setattr(q, "quantize_model", spy)
    bos = bos_tokenizer.convert_tokens_to_ids("<s>")
    art = quantize_tiny(tmp_path / "bos-art", make_model_dir(tmp_path / "bos-model", bos_tokenizer), kv_scheme="fp8")
    assert (seen[-1][:, 0] == bos).all() and (seen[-1][:, 1:] != bos).all()
    cal = json.loads((art / "kvq-manifest.json").read_text())["calibration"]
    assert cal["bos_token_id"] == bos and "adds a BOS" in cal["bos_rule"]

    art = quantize_tiny(tmp_path / "plain-art", make_model_dir(tmp_path / "plain-model", tokenizer), kv_scheme="fp8")
    from compressor.calib import load_text, sample_windows, tokenize

    text = load_text("embedded", part="calib").text  # quantize_tiny's source: 4 x 32 ids, seed 0, as before the rule
    assert torch.equal(seen[-1], sample_windows(tokenize(tokenizer, text), 4, 32, 0))
    cal = json.loads((art / "kvq-manifest.json").read_text())["calibration"]
    assert cal["bos_token_id"] is None and "no BOS" in cal["bos_rule"]


class _Recorder(torch.nn.Module):
    """A model whose ``generate`` records the prompt ids and continues with token 5."""

    def __init__(self):
        super().__init__()
        self.prompts = []

    def generate(self, ids, max_new_tokens, **kw):
        self.prompts.append(ids[0].tolist())
        return torch.cat([ids, torch.full((1, max_new_tokens), 5, dtype=ids.dtype)], dim=1)


def test_drift_prompts_follow_the_rule(bos_tokenizer, tokenizer):
    from compressor.quality import greedy_drift

    bos = bos_tokenizer.convert_tokens_to_ids("<s>")
    ref, art = _Recorder(), _Recorder()
    out = greedy_drift(ref, art, bos_tokenizer, ["The cat", ""], max_new_tokens=3)
    assert out["identical"] == 2
    assert ref.prompts[0] == [bos] + bos_tokenizer("The cat", add_special_tokens=False)["input_ids"] == art.prompts[0]
    assert ref.prompts[1] == [bos]
    ref = _Recorder()
    greedy_drift(ref, _Recorder(), tokenizer, ["The cat"], max_new_tokens=3)
    assert ref.prompts[0] == tokenizer("The cat", add_special_tokens=False)["input_ids"]


def _engine(art):
    from transformers import AutoTokenizer

    from compressor.runtime import Runtime
    from compressor.runtime.engine import Engine

    eng = Engine(Runtime.from_artifact(art, kv="artifact"), AutoTokenizer.from_pretrained(str(art)), "tiny")
    seen = []
    real = eng.runtime.generate

    def spy(prompts, *a, **kw):
        seen.extend(list(p) for p in prompts)
        return real(prompts, *a, **kw)

    eng.runtime.generate = spy
    return eng, seen


def test_runtime_and_http_ids_start_with_the_bos(bos_art):
    from compressor.runtime.server import Server

    eng, seen = _engine(bos_art)
    bos = eng.tokenizer.convert_tokens_to_ids("<s>")
    assert eng.bos_rule["bos_token_id"] == bos and not eng.chat_template
    text_ids = eng.tokenizer("hello world", add_special_tokens=False)["input_ids"]
    assert eng.encode("hello world") == [bos] + text_ids
    chat = eng.encode_chat([{"role": "user", "content": "hi"}])  # the plain-text fallback
    assert chat[0] == bos and eng.tokenizer.decode(chat[1:]) == "user: hi\nassistant:"
    srv = Server(eng).start()
    try:
        async def go():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                one = await c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 2})
                two = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 2})
                return one, two

        one, two = asyncio.run(go())
    finally:
        srv.stop()
        eng.close()
    assert one.status_code == 200 and two.status_code == 200
    assert one.json()["usage"]["prompt_tokens"] == 1 + len(text_ids)
    assert [bos] + text_ids in seen and chat in seen
    assert all(p[0] == bos for p in seen)


def test_runtime_ids_unchanged_without_a_bos(tmp_path, tokenizer):
    art = quantize_tiny(tmp_path / "art", make_model_dir(tmp_path / "model", tokenizer))
    eng, _ = _engine(art)
    try:
        assert eng.bos_rule["bos_token_id"] is None
        assert eng.encode("hello world") == tokenizer("hello world", add_special_tokens=False)["input_ids"]
    finally:
        eng.close()


def test_serve_smoke_reports_the_rule_and_the_missing_chat_template(bos_art, capsys):
    from compressor.runtime.engine import CHAT_FALLBACK_NOTE

    code, out, err = run(["serve-smoke", bos_art, "--max-new-tokens", "4", "--json"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    tok = rep["tokenizer"]
    assert tok["bos_token_id"] is not None and "adds a BOS" in tok["rule"] and tok["chat_template"] is False
    assert CHAT_FALLBACK_NOTE in rep["warnings"]


def test_serve_announces_the_missing_chat_template(bos_art, monkeypatch):
    """``kvq serve`` says at start-up how prompts are encoded and that chat falls back to plain text."""
    from compressor.runtime import server
    from compressor.runtime.engine import CHAT_FALLBACK_NOTE

    class _Stop(Exception):
        pass

    class _Srv:
        def __init__(self, *a, **kw):
            pass

        def start(self):
            raise _Stop

    monkeypatch.setattr(server, "Server", _Srv)
    lines = []
    with pytest.raises(_Stop):
        server.run_server(server.ServeOptions(bos_art, "127.0.0.1", 0, False, "auto", "cpu", 2, 4), announce=lines.append)
    # said before the port opens (the fake server stops the start-up there)
    assert any("adds a BOS" in ln for ln in lines) and any(CHAT_FALLBACK_NOTE in ln for ln in lines), lines
