"""Streamed verify with MoE layers read in groups of routed experts (issue #43): the non-expert
part of each layer held, routing computed by the layer's own router, each group of experts read,
run on the tokens routed to it and released before the next, on both sides (the reference from
its source, block-FP8 included; the artifact dequantized from its packed tensors). The figures
(perplexity, KL, top-1 with and without an fp8 KV cache fed in chunks, per-layer hidden-state
error, weight SQNR, AWQ scales undone) equal the whole-model path's for groups of one expert and
of all, and never more than one group is materialized."""

from __future__ import annotations

import pytest
import torch

from compressor.arch import expert_index, get_arch
from compressor.artifact import load_artifact, read_kv_cache
from compressor.calib import load_text, tokenize
from compressor.commands.common import load_reference
from compressor.commands.kv_only import PackedCheckpoint, find_packed
from compressor.evaluate import compare, hidden_state_errors, windows
from compressor.moe import ExpertMLP
from compressor.quality import weight_report, weight_summary
from compressor.quant.kv import quantized_cache
from compressor.source.resolve import ModelSource, resolve_source
from compressor.streamed_eval import BASELINE_BYTES, GIB, memory_plan, open_model, streamed_compare
from conftest import assert_same_eval, assert_same_report, close_figures, quantize_tiny
from tiny_models import make_dir, make_published, to_block_fp8

ROWS = ["glm4_moe", "deepseek_v3", "qwen3_moe", "kimi_k2"]
ALL = 2**62  # one group of every expert


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tokenizer):
    """row -> (source, RTN W4 artifact); kimi_k2's source is a block-FP8 release."""
    root = tmp_path_factory.mktemp("moe-stream")
    out = {}
    for row in ROWS:
        if row == "kimi_k2":
            src = root / row
            to_block_fp8(make_published(root / "kimi-bf16", tokenizer, row), src)
        else:
            src = make_dir(root / row, tokenizer, row)
        out[row] = (src, quantize_tiny(root / f"{row}-art", src, kv_scheme="fp8"))
    return out


def _open(src, art):
    ref, _ = open_model(resolve_source(str(src)), torch.float32, "reference")
    a, tok = open_model(ModelSource(str(art), "hf", art), torch.float32, "artifact",
                        ckpt=PackedCheckpoint(find_packed(str(art))))
    return ref, a, tok


def _materialized(lm) -> int:
    """Routed experts of ``lm`` with any tensor read."""
    return sum(1 for m in lm.model.modules() if isinstance(m, ExpertMLP)
               and any(not p.is_meta for p in m.parameters()))


def _streamed(src, art, wins, group: int | None, cands: dict):
    """streamed_compare's figures, weight statistics in the whole layer's order, and the most routed
    experts materialized at any expert's forward and at any group's start (both models together)."""
    ref, a, _ = _open(src, art)
    arch = ref.arch
    most, groups, tensors = [0], [], []

    def count(*_):
        most[0] = max(most[0], _materialized(ref) + _materialized(a))

    hooks = [m.register_forward_pre_hook(count) for lm in (ref, a) for m in lm.model.modules()
             if isinstance(m, ExpertMLP)]

    def on_layer(i, lr, la):
        tensors.extend(weight_report(ref.model, a.model, "rtn", layers=[(i, lr, la)])["tensors"])

    def on_experts(i, lr, la, experts):
        groups.append((i, tuple(experts), _materialized(ref), _materialized(a)))
        chosen = set(experts)
        tensors.extend(weight_report(ref.model, a.model, "rtn", layers=[(i, lr, la)],
                                     select=lambda rel: expert_index(arch, rel) in chosen)["tensors"])

    try:
        got = streamed_compare(ref, a, cands, wins, kv_chunk=16, hidden_of="weights only", hidden_rows=(2, 32),
                               on_layer=on_layer, on_experts=on_experts, expert_group=group)
    finally:
        for h in hooks:
            h.remove()
    order = {t: k for k, t in enumerate(_whole_weights(src, art, arch)["names"])}
    tensors.sort(key=lambda t: order[t["name"]])
    assert all(p.is_meta for lm in (ref, a) for p in lm.layers.parameters())
    return got, weight_summary(tensors, False, False), most[0], groups


_WHOLE: dict = {}


def _whole_weights(src, art, arch):
    key = str(art)
    if key not in _WHOLE:
        r = weight_report(load_reference(str(src), resolve_source(str(src))), load_artifact(art)[0], "rtn")
        _WHOLE[key] = {"report": r, "names": [t["name"] for t in r["tensors"]]}
    return _WHOLE[key]


def _check_row(src, art):
    ref_whole = load_reference(str(src), resolve_source(str(src)))
    art_whole, tok = load_artifact(art)
    wins = windows(tokenize(tok, load_text("embedded", part="eval").text), 64, 2)
    kv_info = read_kv_cache(art)
    layout = get_arch(ref_whole.config.model_type).kv_layout(ref_whole.config)
    n_layers = ref_whole.config.num_hidden_layers
    make_cache = lambda: quantized_cache(kv_info[0], n_layers, kv_info[1], layout)  # noqa: E731
    whole = {"weights only": (art_whole, None), "weights + KV": (art_whole, make_cache),
             "KV only": (ref_whole, make_cache)}
    want = compare(ref_whole, whole, wins, kv_chunk=16)  # the KV configurations in chunks of 16 tokens
    want_hidden = hidden_state_errors(ref_whole, art_whole, wins[:2, :32])
    want_weights = _whole_weights(src, art, get_arch(ref_whole.config.model_type))["report"]
    cands = {label: ("reference" if m is ref_whole else "artifact", mc) for label, (m, mc) in whole.items()}
    for group, size in ((1, 1), (ALL, None)):
        got, weights, most, groups = _streamed(src, art, wins, group, cands)
        assert_same_eval(got["results"], want)
        assert got["hidden_state_error"] == pytest.approx(want_hidden, rel=1e-4)
        assert [t["name"] for t in weights["tensors"]] == [t["name"] for t in want_weights["tensors"]]
        assert [t["sqnr_db"] for t in weights["tensors"]] == pytest.approx(
            [t["sqnr_db"] for t in want_weights["tensors"]], rel=1e-6)
        assert groups, "no MoE layer was read in groups"
        per_group = {len(e) for _, e, _, _ in groups}
        if size == 1:
            assert per_group == {1}
            assert most == 2  # one expert of each model at a time
        else:
            assert len(groups) == len({i for i, _, _, _ in groups})  # one group a layer
            assert most == 2 * max(per_group)
        # at a group's start exactly its experts are read, in each model
        assert all(r == a == len(e) for _, e, r, a in groups)


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.slow  # four rows quantized and evaluated three ways each (make test-fast runs test_plan_* only)
def test_grouped_experts_give_the_whole_model_figures(row, pairs):
    _check_row(*pairs[row])


#: a tiny glm4_moe whose MoE layer is mostly routed experts (16 of width 64: 0.75 MiB in float32; the dense first
#: layer 0.14 MiB), so that groups hold less than the whole layer
WIDE = dict(n_routed_experts=16, moe_intermediate_size=64)


def test_plan_counts_the_expert_group_not_the_layer(tmp_path, tokenizer):
    src = make_dir(tmp_path / "src", tokenizer, "glm4_moe", **WIDE)
    art = quantize_tiny(tmp_path / "art", src)
    ref, a, _ = _open(src, art)
    whole = memory_plan(ref, a, 2, 64, ["reference", "artifact"])
    assert whole.experts_per_group == 0 and whole.expert_group_limit is None
    expert = 3 * 64 * 64 * 4  # one routed expert in float32 (hidden 64, moe_intermediate 64)
    experts = ref.experts(1)
    layer = sum(p.numel() for p in ref.layers[1].parameters()) * 4
    one = memory_plan(ref, a, 2, 64, ["reference", "artifact"], budget=1)
    assert one.experts_per_group == 1 and one.expert_group == 2 * expert
    assert one.layers == 2 * max(layer - len(experts) * expert,  # the MoE layer's non-expert part
                                 sum(p.numel() for p in ref.layers[0].parameters()) * 4)  # the dense first layer
    assert one.routed_io == 2 * 2 * 64 * 64 * 4  # the experts' recorded inputs: one more copy of the hidden states
    assert one.peak > one.expert_group + one.layers + BASELINE_BYTES
    assert "routed experts in groups of 1" in one.describe()
    assert memory_plan(ref, a, 2, 64, ["reference", "artifact"], budget=whole.peak) == whole  # whole layers fit
    # room for two more experts of each model than the smallest unit: groups of 3, below the whole layers' peak
    three = memory_plan(ref, a, 2, 64, ["reference", "artifact"], budget=one.peak + 2 * 2 * expert)
    assert three.experts_per_group == 3 and three.peak == one.peak + 2 * 2 * expert < whole.peak


def test_verify_groups_experts_within_the_budget(tmp_path, tokenizer, capsys):
    """kvq verify --stream with --memory-budget-gib below one MoE layer: the plan names the group,
    the report's figures are the whole-model report's; a budget below one expert is refused in one line."""
    import json

    from conftest import assert_clean_error, kvq_run

    src = make_dir(tmp_path / "src", tokenizer, "glm4_moe", **WIDE)
    art = quantize_tiny(tmp_path / "art", src, kv_scheme="fp8")
    ref, a, _ = _open(src, art)
    args = ["verify", str(art), "--seqlen", "64", "--max-windows", "2", "--max-new-tokens", "4", "--hidden-batches",
            "2", "--eval-dtype", "float32", "--json"]
    owners = ["reference", "artifact", "artifact", "reference"]  # the reference, weights only, weights + KV, KV only
    smallest = memory_plan(ref, a, 2, 64, owners, weight_stats=True, budget=1)
    budget = (smallest.peak - BASELINE_BYTES + smallest.expert_group // 2) / GIB  # groups of 1 expert (of both)
    code, out, err = kvq_run(args, capsys)
    assert code == 0, err
    want = json.loads(out)
    code, out, err = kvq_run([*args, "--stream", "--memory-budget-gib", f"{budget:.12f}"], capsys)
    assert code == 0, err
    got = json.loads(out)
    assert got["evaluated_in"]["streamed"]["memory_plan"]["experts_per_group"] == 1
    assert_same_report(got, want)
    low = (smallest.peak - BASELINE_BYTES - smallest.expert_group // 4) / GIB
    code, _, err = kvq_run([*args, "--stream", "--memory-budget-gib", f"{low:.12f}"], capsys)
    assert_clean_error(code, err, 2, "cannot hold streamed verify's smallest unit: ")
    assert "routed experts in groups of 1" in err


def test_awq_weight_statistics_in_groups(tmp_path, tokenizer):
    """An AWQ artifact's weight statistics with the experts read in groups of one: the scales folded
    into the norm before the experts are undone from the held norm, each expert's up -> down scales
    from its own group; every tensor's figures are the whole-model report's."""
    from compressor.commands.options import QuantizeOptions, VerifyOptions
    from compressor.commands.quantize import run_quantize
    from compressor.commands.verify import run_verify

    src = make_dir(tmp_path / "src", tokenizer, "glm4_moe", **WIDE)
    art = tmp_path / "art"
    run_quantize(QuantizeOptions(model=str(src), output=art, algorithm="awq", group_size=32, calib_samples=4,
                                 calib_seqlen=32))
    ref, a, _ = _open(src, art)
    a = open_model(ModelSource(str(art), "hf", art), torch.bfloat16, "artifact",
                   ckpt=PackedCheckpoint(find_packed(str(art))))[0]  # the artifact's declared dtype
    smallest = memory_plan(ref, a, 0, 0, [], weight_stats=True, budget=1)
    budget = (smallest.peak - BASELINE_BYTES + smallest.expert_group // 2) / GIB
    want = run_verify(VerifyOptions(artifact=art, weights_only=True))
    got = run_verify(VerifyOptions(artifact=art, weights_only=True, stream=True, memory_budget_gib=budget))
    assert got["evaluated_in"]["streamed"]["memory_plan"]["experts_per_group"] == 1
    assert want["weights"]["awq_scales_undone"] and got["weights"]["awq_scales_undone"]
    assert [t["name"] for t in got["weights"]["tensors"]] == [t["name"] for t in want["weights"]["tensors"]]
    close_figures(got["weights"], want["weights"], "weights")
