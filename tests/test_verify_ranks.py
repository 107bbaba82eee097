"""``kvq verify`` under several ranks (issue #44, compressor/verify_ranks.py): the windows dealt to
the ranks in contiguous blocks, every window's figures added on rank 0 in window order -- the
one-process figures bit for bit, on the whole-model path and the streamed one -- one report, and
the same exit code on every rank.

The in-process tests play the ranks one after another (:class:`Played`: rank 1's records kept,
then rank 0 given them); the process tests start two gloo ranks on a 3-layer tiny llama.
"""

from __future__ import annotations

import json

import pytest
import torch

from compressor.artifact import load_artifact, read_kv_cache
from compressor.arch import get_arch
from compressor.calib import load_text, tokenize
from compressor.commands.kv_only import PackedCheckpoint, find_packed
from compressor.errors import InputError
from compressor.evaluate import compare, hidden_state_errors, windows
from compressor.quant.kv import quantized_cache
from compressor.source.open import load_model
from compressor.source.resolve import ModelSource, resolve_source
from compressor.streamed_eval import open_model, streamed_compare
from compressor.verify_ranks import Share, agree

from conftest import make_model_dir, quantize_tiny
from rank_procs import ends, kvq_lines, ranks


class Played(Share):
    """Rank ``rank`` of ``world`` without a process group: what :meth:`gather` receives from the
    other ranks is ``sent`` (filled by the ranks played before, in rank order)."""

    def __init__(self, rank: int, world: int, sent: dict):
        super().__init__(rank, world)
        object.__setattr__(self, "sent", sent)

    def gather(self, items):
        self.sent.setdefault(self.rank, []).append(items)
        if self.rank != 0:
            return None
        calls = [self.sent[r].pop(0) for r in range(self.world)]
        return [x for part in calls for x in part]


def played(run, world: int):
    """``run(share)`` on ranks ``world - 1`` down to 0 (so rank 0 finds every other rank's
    records); rank 0's result, and the others' (which must be ``None`` figures)."""
    sent: dict = {}
    others = [run(Played(r, world, sent)) for r in range(world - 1, 0, -1)]
    return run(Played(0, world, sent)), others


def same(got, want, path=""):
    """Equal structure and equal numbers, bit for bit (NaN equal to NaN; tensors by their bytes)."""
    if isinstance(want, dict):
        assert set(got) == set(want) - {"seconds"} | ({"seconds"} & set(got)), path
        for k in want:
            if k != "seconds":
                same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for k, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{path}[{k}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(torch.as_tensor(got).reshape(-1).view(torch.uint8),
                           want.reshape(-1).view(torch.uint8)), path
    elif hasattr(want, "tobytes"):  # numpy arrays (kl_values)
        assert got.tobytes() == want.tobytes(), path
    elif isinstance(want, float) and want != want:
        assert got != got, path
    else:
        assert got == want, path


def test_blocks_are_contiguous_cover_every_window_and_do_not_depend_on_anything_else():
    for n, world in ((5, 2), (3, 2), (7, 3), (2, 2)):
        blocks = [Share(r, world).block(n) for r in range(world)]
        assert blocks[0][0] == 0 and blocks[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        assert max(hi - lo for lo, hi in blocks) - min(hi - lo for lo, hi in blocks) <= 1
    assert Share(1, 2).block(5) == (2, 5) and Share(1, 2).mine(2, 5) and not Share(1, 2).mine(1, 5)


def test_agree_alone_runs_the_work_and_raises_its_error():
    assert agree(None, lambda: 3, send=lambda v: v, elsewhere=lambda v: -1) == 3
    with pytest.raises(InputError, match="bad"):
        agree(None, lambda: (_ for _ in ()).throw(InputError("bad")))


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, tokenizer):
    """A 3-layer tiny llama and its RTN W4 artifact with an fp8 KV cache (static scales)."""
    root = tmp_path_factory.mktemp("ranks")
    src = make_model_dir(root / "model", tokenizer, num_hidden_layers=3, tie_word_embeddings=False)
    return src, quantize_tiny(root / "art", src, kv_scheme="fp8")


@pytest.fixture(scope="module")
def whole(tiny_pair):
    src, art = tiny_pair
    ref, (model, tok) = load_model(resolve_source(str(src)))[0], load_artifact(art)
    kv_info = read_kv_cache(art)
    layout = get_arch("llama").kv_layout(ref.config)
    make_cache = lambda: quantized_cache(kv_info[0], 3, kv_info[1], layout)  # noqa: E731
    cands = {"weights only": (model, None), "weights + KV": (model, make_cache), "KV only": (ref, make_cache)}
    wins = windows(tokenize(tok, load_text("embedded", part="eval").text), 48, 5)
    return ref, model, cands, wins


@pytest.mark.parametrize("world", [2, 3])
def test_dealt_windows_give_the_one_process_figures_bit_for_bit(whole, world):
    """Five windows over 2 and 3 ranks (blocks of 2+3, 1+2+2), a quantized KV cache among the rows:
    perplexity, KL values, top-1 and per-position sums are the one-process ones, bit for bit."""
    ref, model, cands, wins = whole
    want = compare(ref, cands, wins, kv_chunk=16)
    got, others = played(lambda s: compare(ref, cands, wins, kv_chunk=16, share=s), world)
    assert others == [None] * (world - 1)
    same(got, want)
    hb = wins[:3, :32]
    want_h = hidden_state_errors(ref, model, hb)
    got_h, others_h = played(lambda s: hidden_state_errors(ref, model, hb, share=s), world)
    assert got_h == want_h and others_h == [None] * (world - 1)


def test_streamed_dealt_windows_give_the_one_process_figures_bit_for_bit(tiny_pair, whole):
    """The streamed path: each rank advances both models a layer at a time over its own windows only."""
    src, art = tiny_pair
    ref_w, _, cands_w, wins = whole

    def run(share):
        ref, _ = open_model(resolve_source(str(src)), torch.float32, "reference")
        a, _ = open_model(ModelSource(str(art), "hf", art), torch.float32, "artifact",
                          ckpt=PackedCheckpoint(find_packed(str(art))))
        cands = {label: ("reference" if m is ref_w else "artifact", mc) for label, (m, mc) in cands_w.items()}
        return streamed_compare(ref, a, cands, wins, kv_chunk=16, hidden_of="weights only", hidden_rows=(3, 32),
                                share=share)

    want = run(None)
    got, others = played(run, 2)
    assert [o["results"] for o in others] == [None] and [o["hidden_state_error"] for o in others] == [None]
    same(got["results"], want["results"])
    assert got["hidden_state_error"] == want["hidden_state_error"]


# ---------------------------------------------------------------------------------------
# ranks as processes (gloo)

#: figures that are not figures: timings, memory, the machine's load
_NOT_FIGURES = {"seconds", "busy_note", "peak_rss_mib", "mb_per_s"}


def _figures(report):
    if isinstance(report, dict):
        return {k: _figures(v) for k, v in report.items() if k not in _NOT_FIGURES}
    if isinstance(report, list):
        return [_figures(v) for v in report]
    return report


def _verify(args: list, world: int) -> list[tuple[int, str, str]]:
    return ends(ranks(world, args, command="verify"))


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("path", [[], ["--stream"]], ids=["whole", "streamed"])
def test_two_ranks_write_the_one_process_report(tiny_pair, tmp_path, path):
    """Two ranks, 3 windows (1 + 2): rank 0's report is the one process's, figure for figure (the
    float figures bit for bit); rank 1 prints nothing and writes nothing; a failing gate exits 1 on both."""
    _, art = tiny_pair
    args = [art, "--seqlen", "48", "--max-windows", "3", "--max-new-tokens", "4", "--long-tokens", "0",
            "--turns", "0", "--threads", "1", "--json", *path]
    (rc, out, err), = _verify([*args, "--json-out", tmp_path / "one.json"], 1)
    assert rc == 0, err
    want = json.loads(out)
    (rc0, out0, err0), (rc1, out1, err1) = _verify([*args, "--json-out", tmp_path / "two.json"], 2)
    assert (rc0, rc1) == (0, 0), err0 + err1
    got = json.loads(out0)
    assert out1 == "" and not [ln for ln in err1.splitlines() if ln.startswith("kvq")], err1
    assert json.loads((tmp_path / "two.json").read_text()) == got  # the file: rank 0's report alone
    dealt = got["evaluated_in"].pop("ranks")
    assert [(r["rank"], r["windows"]) for r in dealt] == [(0, [0, 1]), (1, [1, 3])]
    assert "ranks" not in want["evaluated_in"]
    assert all(r["peak_rss_mib"] > 0 for r in dealt)
    assert _figures(got) == _figures(want)
    assert got["eval"]["windows"] == 3 and got["per_window"][2]["kl_mean"] == want["per_window"][2]["kl_mean"]
    fail = _verify([*args, "--max-mean-kl", "1e-12"], 2)
    assert [f[0] for f in fail] == [1, 1], fail
    assert json.loads(fail[0][1])["failed_gates"] == ["max_mean_kl"] and fail[1][1] == ""


@pytest.mark.slow
def test_an_input_error_exits_2_on_every_rank_said_once(tiny_pair, tmp_path):
    _, art = tiny_pair
    got = _verify([art, "--eval", tmp_path / "missing.txt", "--threads", "1"], 2)
    assert [g[0] for g in got] == [2, 2], got
    said = [[ln for ln in err.splitlines() if ln.startswith("kvq:")] for _, _, err in got]
    assert len(said[0]) == 1 and "missing.txt" in said[0][0] and said[1] == [], said



@pytest.mark.slow
@pytest.mark.parametrize("path", [[], ["--stream"]], ids=["whole", "streamed"])
def test_a_rank_killed_mid_evaluation_stops_the_other_in_one_line(tiny_pair, path):
    """Rank 1 SIGKILLed as it starts its first window: rank 0 exits 1, its one line naming rank 1."""
    _, art = tiny_pair
    procs = ranks(2, [art, "--seqlen", "48", "--max-windows", "3", "--threads", "1", "--json", *path],
                  command="verify", KVQ_FAULT="1:0:kill")
    (rc0, out0, err0), (rc1, _, _) = ends(procs)
    assert rc1 == -9 and rc0 == 1 and out0 == "", err0
    assert len(kvq_lines(err0)) == 1 and kvq_lines(err0)[0].startswith("kvq: rank 1 of 2 died"), err0
