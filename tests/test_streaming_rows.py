"""Every row of the architecture table streams (issue #41): a tiny checkpoint of each row, built
with the row's own transformers classes (Gemma 3's ``Gemma3TextScaledWordEmbedding``, whose
``embed_scale`` is a non-persistent buffer, included), opens with its decoder layers on ``meta``
(:func:`compressor.source.open.open_lazy` returns a model, not a reason), and once its layers are
read the streamed model's logits equal the whole-loaded model's (and Gemma 3's streamed GPTQ run
writes the whole-model run's tensors). A buffer the second build cannot compute sends the source
down the whole-model path, naming it. The streaming table of docs/streaming.md (*Models larger than
memory*) is checked against the rows that stream here."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from compressor.arch import ARCHITECTURES, PUBLISHED_AS, get_arch, get_module
from compressor.source.open import load_model
from compressor.source.resolve import resolve_source
from compressor.source.lazy import layer_names, load_into
from compressor.source.open import open_lazy

from conftest import FAST, digests
from tiny_models import CONFIGS, PUBLISHED, WRAPPED, make_dir, make_k25, make_published

STREAMING_DOC = Path(__file__).resolve().parents[1] / "docs" / "streaming.md"
IDS = torch.randint(1, 300, (2, 16), generator=torch.Generator().manual_seed(3))


def _transformers_type(row: str) -> str:
    """The transformers ``model_type`` whose classes build ``row``."""
    if row == "kimi_k25":
        return ARCHITECTURES[row].wrapper.text_types[0]
    return PUBLISHED_AS.get(row, row)


def _make(path: Path, tokenizer, row: str) -> Path:
    """A tiny checkpoint of ``row`` (tests/tiny_models.py) as its release lays it out (published
    config and MTP layer where the row has them; Kimi K2.5's wrapper), else as transformers saves
    the row's tiny model."""
    if row == "kimi_k25":
        return make_k25(path, tokenizer)
    if row in PUBLISHED:
        make_published(path, tokenizer, row)
        return path
    return make_dir(path, tokenizer, row)


def _buildable(row: str) -> bool:
    from transformers import CONFIG_MAPPING

    return _transformers_type(row) in CONFIG_MAPPING


ROWS = sorted(ARCHITECTURES)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tokenizer):
    """row -> tiny checkpoint folder, for each row transformers can build."""
    root = tmp_path_factory.mktemp("rows")
    return {row: _make(root / row, tokenizer, row) for row in ROWS if _buildable(row)}


@pytest.fixture(scope="module")
def opened(sources):
    """row -> what :func:`open_lazy` returns for its tiny checkpoint."""
    return {row: open_lazy(resolve_source(str(src))) for row, src in sources.items()}


def test_every_row_has_a_tiny_checkpoint():
    assert all(row in CONFIGS or row in WRAPPED for row in ROWS)


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.slow  # one quantize -> verify / serve per architecture row (make test-fast leaves it out)
def test_row_streams_with_the_whole_models_logits(row, sources, opened):
    if row not in sources:
        pytest.skip(f"this transformers has no {_transformers_type(row)} classes")
    model, reason = opened[row][:2]
    assert model is not None, reason
    ckpt = opened[row][2]
    arch = get_arch(model.config.model_type)
    layers = get_module(model, arch.layers)
    assert all(p.is_meta for p in layers.parameters())  # nothing of the decoder layers read yet
    assert not any(b.is_meta for m in model.modules() for n, b in m._buffers.items()
                   if n in m._non_persistent_buffers_set)  # computed, not read: in no checkpoint
    for i in range(len(layers)):
        load_into(model, ckpt, arch, layer_names(model, arch, i))
    whole, _ = load_model(resolve_source(str(sources[row])))
    with torch.no_grad():
        # experts unfused in the streamed model (same arithmetic, another summation order)
        torch.testing.assert_close(model(IDS).logits, whole(IDS).logits, atol=1e-5, rtol=0)


def test_an_embedding_keeping_a_non_persistent_buffer_streams(sources, opened):
    """The case of issue #41: Gemma 3's embedding multiplies by ``embed_scale`` (sqrt(hidden)),
    a non-persistent buffer transformers computes in ``__init__`` and never stores; built on
    ``meta`` it holds no value, and kvq computes it from the config."""
    from compressor.source.lazy import _meta_model

    meta, _, _ = _meta_model(resolve_source(str(sources["gemma3_text"])), torch.float32, None)
    emb = meta.model.embed_tokens
    assert type(emb).__name__ == "Gemma3TextScaledWordEmbedding"
    assert "embed_scale" in emb._non_persistent_buffers_set and emb.embed_scale.is_meta
    got = opened["gemma3_text"][0].model.embed_tokens.embed_scale
    assert got.dtype == torch.float32 and float(got) == math.sqrt(meta.config.hidden_size)


@pytest.mark.slow  # one quantize -> verify / serve per architecture row (make test-fast leaves it out)
def test_gemma3_streamed_quantize_equals_whole_model(sources, tmp_path):
    """``kvq quantize`` on the Gemma 3 row streams (it was loaded whole) and writes the tensors
    of the whole-model run."""
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize

    got = {}
    for stream in (True, False):
        got[stream] = run_quantize(QuantizeOptions(model=str(sources["gemma3_text"]), output=tmp_path / str(stream),
                                                   algorithm="gptq", stream=stream, **FAST))["source_loading"]
    assert got[True] == "streamed: one decoder layer at a time" and got[False].startswith("whole model")
    assert digests(tmp_path / "True") == digests(tmp_path / "False")


def test_a_buffer_its_class_fills_from_weight_storage_is_loaded_whole(sources, monkeypatch):
    """The guard: a non-persistent buffer written into ``torch.empty`` storage (which the
    second build keeps on ``meta``) is never left on ``meta``: the source is loaded whole,
    the reason naming the buffer."""
    from transformers.models.gemma3 import modeling_gemma3 as g3

    real = g3.Gemma3TextScaledWordEmbedding.__init__

    def filled(self, *a, **k):
        real(self, *a, **k)
        self.embed_scale = torch.nn.Buffer(torch.empty(()).fill_(self.scalar_embed_scale), persistent=False)

    monkeypatch.setattr(g3.Gemma3TextScaledWordEmbedding, "__init__", filled)
    model, reason = open_lazy(resolve_source(str(sources["gemma3_text"])))
    assert model is None and "model.embed_tokens.embed_scale" in reason, reason


def doc_stream_table() -> dict[str, str]:
    """docs/streaming.md's streaming table (*Models larger than memory*): row -> its ``streamed`` cell."""
    lines = STREAMING_DOC.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if re.match(r"\|\s*rows\s*\|\s*streamed\s*\|", ln))
    out = {}
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        for row in re.findall(r"`([a-z0-9_]+)`", cells[0]):
            assert row not in out, f"docs/streaming.md: {row} is in two lines of the streaming table"
            out[row] = cells[1]
    return out


def test_doc_streaming_table_is_the_rows_that_stream(opened):
    table = doc_stream_table()
    assert set(table) == set(ARCHITECTURES)
    says = {row for row, cell in table.items() if cell.startswith("yes")}
    streams = {row for row, lazy in opened.items() if lazy[0] is not None}
    assert says & set(opened) == streams
