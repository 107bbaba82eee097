"""Calibration batches divided across ranks (issue #44, compressor/sample_ranks.py): each rank runs
only its batches through a layer that divides them, and the artifact is one process's, bit for bit.

Each rank is its own ``kvq`` process (tests/rank_procs.py, gloo). 24 calibration sequences make
three batches of 8: two ranks hold two and one, three ranks one each."""

import json
import shutil

import pytest
import torch

from compressor.commands.options import QuantizeOptions
from compressor.commands.quantize import run_quantize
from compressor.manifest import load_manifest
from compressor.sample_ranks import Samples

from conftest import digests
from rank_procs import ends, kvq_lines, ranks
from tiny_models import make_published

CALIB = dict(group_size=32, calib_samples=24, calib_seqlen=32, threads=1)
ARGS = ["--group-size", "32", "--calib-samples", "24", "--calib-seqlen", "32", "--threads", "1", "--json"]
#: the layer figures that are times (or, for routed experts, the read groups: every rank's own)
TIMING = {"seconds", "phase_seconds", "weight_groups"}
#: tiny budget: a MoE layer's routed experts read in groups, as the ranks read theirs
GROUPED = 1e-4


def test_one_process_divides_nothing():
    """Without a process group there is no division: the driver keeps every batch."""
    assert Samples.of([torch.zeros(8, 4, 2)] * 3) is None


def _layers(folder) -> list[dict]:
    return [{k: v for k, v in f.items() if k not in TIMING} for f in load_manifest(folder).quality["layers"]]


CASES = {
    # name: (source, ranks, kvq flags, the single process's options)
    "gptq-3-ranks": ("deep", 3, ["--algorithm", "gptq"], dict(algorithm="gptq")),
    "gptaq-fp8-spilled": ("deep", 2, ["--algorithm", "gptq", "--set", "gptq.gptaq_alpha=0.25", "--kv-scheme", "fp8",
                                      "--activation-budget-gib", "0"],
                          dict(algorithm="gptq", settings=(("gptq.gptaq_alpha", 0.25),), kv_scheme="fp8",
                               activation_budget_gib=0)),
    "kv-only": ("deep", 2, ["--recipe", "kv-fp8"], dict(recipe="kv-fp8")),
    # MoE layers (experts read in groups, owned per rank): the non-expert part divided, every batch's routed
    # tokens sent to every rank for the experts
    "moe-gptq-fp8": ("moe", 2, ["--algorithm", "gptq", "--kv-scheme", "fp8", "--memory-budget-gib", str(GROUPED)],
                     dict(algorithm="gptq", kv_scheme="fp8", memory_budget_gib=GROUPED)),
    "moe-gptaq-3-ranks": ("moe", 3, ["--algorithm", "gptq", "--set", "gptq.gptaq_alpha=0.25", "--memory-budget-gib",
                                     str(GROUPED)],
                          dict(algorithm="gptq", settings=(("gptq.gptaq_alpha", 0.25),), memory_budget_gib=GROUPED)),
    "moe-no-true-sequential-spilled": (
        "moe", 2, ["--algorithm", "gptq", "--set", "gptq.true_sequential=false", "--activation-budget-gib", "0",
                   "--memory-budget-gib", str(GROUPED)],
        dict(algorithm="gptq", settings=(("gptq.true_sequential", False),), activation_budget_gib=0,
             memory_budget_gib=GROUPED)),
    "moe-rtn-fp8": ("moe", 2, ["--algorithm", "rtn", "--kv-scheme", "fp8", "--memory-budget-gib", str(GROUPED)],
                    dict(algorithm="rtn", kv_scheme="fp8", memory_budget_gib=GROUPED)),
    # AWQ: observe's per-call |x| sums and the loss sequences travel in batch order; the scale searches dealt
    "awq-3-ranks": ("deep", 3, ["--algorithm", "awq", "--set", "awq.n_grid=4"],
                    dict(algorithm="awq", settings=(("awq.n_grid", 4),))),
    "awq-gptq-fp8-spilled": ("deep", 2, ["--algorithm", "awq-gptq", "--set", "awq.n_grid=4", "--kv-scheme", "fp8",
                                         "--activation-budget-gib", "0"],
                             dict(algorithm="awq-gptq", settings=(("awq.n_grid", 4),), kv_scheme="fp8",
                                  activation_budget_gib=0)),
    # more loss sequences than the first batch holds: every batch gathered, nothing divided
    "awq-loss-beyond-a-batch": ("deep", 2, ["--algorithm", "awq", "--set", "awq.n_grid=4", "--set",
                                            "awq.loss_samples=12"],
                                dict(algorithm="awq", settings=(("awq.n_grid", 4), ("awq.loss_samples", 12)))),
    # a streamed MoE layer's AWQ: the observe's routed calls sent to every rank, the experts owned per rank
    "moe-awq": ("moe", 2, ["--algorithm", "awq", "--set", "awq.n_grid=4", "--memory-budget-gib", str(GROUPED)],
                dict(algorithm="awq", settings=(("awq.n_grid", 4),), memory_budget_gib=GROUPED)),
    "moe-awq-gptq-3-ranks-spilled": (
        "moe", 3, ["--algorithm", "awq-gptq", "--set", "awq.n_grid=4", "--kv-scheme", "fp8", "--activation-budget-gib",
                   "0", "--memory-budget-gib", str(GROUPED)],
        dict(algorithm="awq-gptq", settings=(("awq.n_grid", 4),), kv_scheme="fp8", activation_budget_gib=0,
             memory_budget_gib=GROUPED)),
}
#: the layers each case runs divided (every layer where not named)
DIVIDED = {"awq-loss-beyond-a-batch": 0}


@pytest.fixture(scope="module")
def moe_row(tmp_path_factory, tokenizer):
    return make_published(tmp_path_factory.mktemp("moe") / "deepseek_v3", tokenizer, "deepseek_v3",
                          num_hidden_layers=3)


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("case", list(CASES))
def test_divided_batches_give_the_single_process_artifact(case, deep_dir, moe_row, tmp_path):
    """The ranks' artifact equals one process's digest by digest, and so do the layer figures (the
    output error from rank 0's first batch, the largest activation and the KV scales as maxima over
    every rank's); each rank held its share of the batches in the layers that divide them."""
    name, n, flags, kw = CASES[case]
    src = deep_dir if name == "deep" else moe_row
    run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "one", **{**CALIB, **kw}))
    got = ends(ranks(n, [src, "-o", tmp_path / "n", *flags, *ARGS], KVQ_NO_PICKLE="1"))
    assert [g[0] for g in got] == [0] * n, got
    assert digests(tmp_path / "n") == digests(tmp_path / "one")
    assert _layers(tmp_path / "n") == _layers(tmp_path / "one")
    summary = json.loads(got[0][1])
    per_rank = summary["ranks"]
    beyond = [w for w in summary["warnings"] if "exceeds the first calibration batch" in w]
    assert beyond == (["awq.loss_samples 12 exceeds the first calibration batch (8 sequences): under 2 ranks every "
                       "layer takes every batch back (not divided)"] if case == "awq-loss-beyond-a-batch" else [])
    held = [len(range(r, 3, n)) for r in range(n)]  # batch j on rank j % n
    assert [r["calibration_batches"] for r in per_rank] == held and {r["of_batches"] for r in per_rank} == {3}
    divided = DIVIDED.get(case, 3 if name == "moe" else 4)
    assert {r["layers_divided"] for r in per_rank} == {divided}
    if kw.get("algorithm") in ("gptq", "awq-gptq"):  # every Hessian pass ran each batch on its rank alone
        forwards = [r["hessian_pass_forwards"] for r in per_rank]
        assert forwards[0] > 0 and [f * held[0] for f in forwards] == [forwards[0] * h for h in held], forwards


@pytest.mark.slow
def test_a_divided_run_killed_mid_layer_resumes_with_three_ranks_or_one(deep_dir, tmp_path):
    """Rank 1 killed at layer 2's first GPTQ solve while the batches are divided: rank 0 names it; the
    checkpoint holds every batch (gathered by rank 0), and three ranks, or one process, resume it to
    the uninterrupted artifact."""
    run_quantize(QuantizeOptions(model=str(deep_dir), output=tmp_path / "ref", algorithm="gptq", **CALIB))
    out = tmp_path / "a" / "r"
    (rc0, _, err0), (rc1, _, _) = ends(ranks(2, [deep_dir, "-o", out, "--algorithm", "gptq", *ARGS],
                                             KVQ_FAULT="1:2:kill"))
    assert rc0 == 1 and rc1 != 0 and kvq_lines(err0)[0].startswith("kvq: rank 1 of 2 died"), err0
    shutil.copytree(tmp_path / "a" / ".r.kvq-partial", tmp_path / "b" / ".r.kvq-partial")
    got = ends(ranks(3, [deep_dir, "-o", out, "--algorithm", "gptq", *ARGS, "--resume"]))
    assert [g[0] for g in got] == [0, 0, 0], got
    summary = json.loads(got[0][1])
    assert summary["resumed_from_layer"] == 2 and digests(out) == digests(tmp_path / "ref")
    assert [r["calibration_batches"] for r in summary["ranks"]] == [1, 1, 1]
    assert {r["layers_divided"] for r in summary["ranks"]} == {2}
    one = run_quantize(QuantizeOptions(model=str(deep_dir), output=tmp_path / "b" / "r", algorithm="gptq",
                                       resume=True, **CALIB))
    assert one["resumed_from_layer"] == 2 and digests(tmp_path / "b" / "r") == digests(tmp_path / "ref")


@pytest.mark.slow
def test_fewer_batches_than_ranks_is_said(deep_dir, tmp_path):
    """8 calibration sequences make one batch: two ranks cannot divide it, run every batch each, and the summary's
    warnings say so (the artifact is still one process's)."""
    flags = ["--algorithm", "gptq", "--group-size", "32", "--calib-samples", "8", "--calib-seqlen", "32", "--threads",
             "1", "--json"]
    got = ends(ranks(2, [deep_dir, "-o", tmp_path / "n", *flags]))
    assert [g[0] for g in got] == [0, 0], got
    summary = json.loads(got[0][1])
    assert ("1 calibration batch(es) of 8 sequences for 2 ranks: the batches are not divided, every rank runs every "
            "one (more than 8 calibration sequences divide them)") in summary["warnings"], summary["warnings"]
    assert {r["layers_divided"] for r in summary["ranks"]} == {0}
