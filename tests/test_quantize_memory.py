"""``kvq quantize``'s memory plan (compressor.commands.quantize_memory): printed before the model loads,
in the --json summary, the expert groups it counts equal to those the run reads, and a --memory-budget-gib
below one routed expert refused in one line before any weight is read."""

from __future__ import annotations

import json
import re

import pytest
import torch

from compressor import console as show
from compressor.arch import get_arch
from compressor.commands import quantize_memory as qm
from compressor.errors import InputError
from compressor.quant.gptq_layer import HESSIAN_BYTES
from compressor.recipe import load_recipes, with_overrides
from compressor.source.open import meta_skeleton
from compressor.source.resolve import resolve_source
from compressor.staging import HELD_BYTES_PER_WEIGHT, LayerWriter

from conftest import assert_clean_error, kvq_run
from tiny_models import ROW_FAST, make_published

#: one routed expert of the tiny rows held: 3 linears of 64 x 32 weights, float32 + int8 codes
EXPERT_BYTES = 3 * 64 * 32 * HELD_BYTES_PER_WEIGHT
FAST = ["--group-size", ROW_FAST["group_size"], "--calib-samples", ROW_FAST["calib_samples"], "--calib-seqlen",
        ROW_FAST["calib_seqlen"]]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, tokenizer):
    return make_published(tmp_path_factory.mktemp("qmem") / "deepseek_v3", tokenizer, "deepseek_v3",
                          num_hidden_layers=3)


def test_a_budget_below_one_routed_expert_is_refused_before_loading(kimi, tmp_path, capsys):
    """Half an expert: one line naming the layer, the expert's size and the smallest budget; exit 2, nothing
    loaded (no 'loading' step said) and nothing written."""
    budget = 0.5 * EXPERT_BYTES / 2**30
    code, out, err = kvq_run(["quantize", kimi, "--algorithm", "rtn", *FAST, "--memory-budget-gib", budget, "-o",
                              tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "cannot hold one routed expert of decoder layer 1", tmp_path)
    smallest = qm.smallest_budget(EXPERT_BYTES)
    assert f"give --memory-budget-gib {smallest} or more" in err and float(smallest) >= EXPERT_BYTES / 2**30
    assert "loading" not in out + err
    assert not (tmp_path / "out").exists()
    code, out, err = kvq_run(["quantize", kimi, "--algorithm", "rtn", *FAST, "--memory-budget-gib", smallest, "-o",
                              tmp_path / "out"], capsys)  # the budget the line names is enough
    assert code == 0, err
    assert f"(--memory-budget-gib {smallest}: weights held" in err  # the plan echoes the value as given


def test_w4a4_on_experts_read_in_groups_is_refused_before_loading(kimi, tmp_path, capsys):
    """NVFP4 activations (W4A4) take each linear's input_global_scale from its inputs on the layer's recompute,
    and routed experts read in groups are written before it: a budget that reads a MoE layer in groups is refused
    from the plan (exit 2, nothing loaded, nothing written), naming the budget that holds the layer whole, which
    then runs; several torchrun ranks (each owns its experts in groups) are refused alike, and experts the recipe
    ignores are not refused."""
    calib = ["--calib-samples", "4", "--calib-seqlen", "48"]
    code, out, err = kvq_run(["quantize", kimi, "--recipe", "w4a4-nvfp4", *calib, "--memory-budget-gib",
                              EXPERT_BYTES / 2**30, "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "NVFP4 activations (W4A4) on routed experts read in groups are not implemented",
                       tmp_path)
    assert "loading" not in out + err and not (tmp_path / "out").exists()
    line = " ".join(err.split())
    assert "reads MoE decoder layer 1 " in line
    budget = re.search(r"give --memory-budget-gib (\S+) or more \(the layer whole\), or --no-stream", line).group(1)
    code, out, err = kvq_run(["quantize", kimi, "--recipe", "w4a4-nvfp4", *calib, "--memory-budget-gib", budget,
                              "-o", tmp_path / "out"], capsys)
    assert code == 0, err
    model, arch = _skeleton(kimi)
    w4a4 = load_recipes(["w4a4-nvfp4"])
    qm.estimate(model, arch, w4a4, (4, 48), False, 4.0, False, False, 2)  # whole layers: nothing refused
    with pytest.raises(InputError, match="under 2 torchrun ranks each reads its share of MoE decoder layer 1"):
        qm.estimate(model, arch, w4a4, (4, 48), False, 4.0, False, False, 2, ranks=2)
    ignored = with_overrides(w4a4, ignore=["re:.*\\.experts\\..*"])
    qm.estimate(model, arch, ignored, (4, 48), False, EXPERT_BYTES / 2**30, False, False, 2, ranks=2)


def test_the_smallest_budget_is_rounded_up():
    """Kimi K2's expert (3 x 7168 x 2048 weights) and Mixtral 8x7B's (3 x 4096 x 14336): four digits, never
    below the expert, so the value the refusal names is accepted."""
    for n in (3 * 7168 * 2048 * 5, 3 * 4096 * 14336 * 5, EXPERT_BYTES, 2**30):
        got = qm.smallest_budget(n)
        assert float(got) * 2**30 >= n and float(got) < 1.001 * n / 2**30, (n, got)
    assert qm.smallest_budget(3 * 7168 * 2048 * 5) == "0.2051" and qm.smallest_budget(2**30) == "1"


def test_one_expert_is_enough_and_the_plan_counts_the_groups_read(kimi, tmp_path, capsys, monkeypatch):
    """A budget of exactly one expert is accepted; the printed plan and --json's memory_plan give the groups
    of one expert the writer reads, the non-expert part the writer holds, and GPTQ's Hessians."""
    read = []
    real = LayerWriter.expert_groups

    def groups(self, i, divided=False):
        got = real(self, i, divided)
        if got is not None:
            rest, _experts, sizes = self._experts  # the layer's split, as the writer made it
            read.append((i, sum(sizes[n] for n in rest),
                         max(len({n.split(".experts.")[1].split(".")[0] for n in g}) for g in got[1:])))
        return got

    monkeypatch.setattr(LayerWriter, "expert_groups", groups)
    budget = EXPERT_BYTES / 2**30
    code, out, err = kvq_run(["quantize", kimi, "--algorithm", "gptq", *FAST, "--memory-budget-gib", budget,
                              "-o", tmp_path / "out", "--json"], capsys)
    assert code == 0, err
    assert "memory plan: about" in err and "MoE layers read in groups of 1 of 4 experts" in err
    plan = json.loads(out)["memory_plan"]
    assert read and {k for _, _, k in read} == {1}
    assert plan["experts_per_group"] == 1
    held = {i: rest for i, rest, _ in read}
    assert plan["grouped_layer"]["non_expert_mib"] == round(held[plan["grouped_layer"]["layer"]] / 2**20, 3)
    assert plan["grouped_layer"]["group_mib"] == round(EXPERT_BYTES / 2**20, 3)
    assert plan["peak_mib"] > plan["process_mib"] + plan["layer_weights_mib"]
    assert plan["hessians_mib"] > 0
    assert plan["budget_mib"] == pytest.approx(EXPERT_BYTES / 2**20, abs=0.1)
    peaks = json.loads(out)["peak_rss_mib_by_layer"]  # one per layer, never falling, at most the run's peak
    assert len(peaks) == 3 and peaks == sorted(peaks) and peaks[-1] <= json.loads(out)["peak_rss_mib"]


def test_the_groups_are_named_when_the_embedding_is_the_peak(kimi):
    """A plan whose peak is layer 0's capture (many calibration tokens' embedding rows) still says how the MoE
    layers are read."""
    model, arch = _skeleton(kimi)
    mem = qm.estimate(model, arch, load_recipes(["w4a16-rtn-g64"]), None, False, 1.5 * EXPERT_BYTES / 2**30,
                      False, False, 2)
    mem.capture = 10 * mem.layer.total
    line = mem.describe()
    assert line.startswith("about") and "at peak: the calibration tokens' embedding rows in float32" in line
    assert "MoE layers read in groups of 1 of 4 experts" in line
    mem.end = 20 * mem.layer.total  # a quantized head: the end is the peak, and is named first
    assert "at peak: the embedding and head" in mem.describe()
    mem.workers = 2
    assert "at peak in each of 2 worker processes and the main one" in mem.describe()


def test_the_budget_is_echoed_as_typed():
    assert [show.as_typed(float(t)) for t in ("0.001", "1048576", "2.8610229e-05", "0.1234567")] == \
        ["0.001", "1048576", "2.8610229e-05", "0.1234567"]


def _skeleton(path):
    model = meta_skeleton(resolve_source(str(path)))
    return model, get_arch(model.config.model_type)


def test_the_estimate_by_hand(kimi, wide_llama):
    """The plan's terms computed by hand on a dense Llama and the DeepSeek-V3 row: weights at 5 bytes, GPTQ's
    largest true-sequential stage (down_proj's input, 12 bytes per width squared) or every stage at once, the
    activations' two copies (one when spilled), the embedding during capture, AWQ's search and candidates."""
    model, arch = _skeleton(wide_llama)
    cfg = model.config
    layer = model.get_submodule(arch.layers)[0]
    weights = sum(p.numel() for p in layer.parameters()) * HELD_BYTES_PER_WEIGHT
    gptq = load_recipes(["w4a16-gptq"])
    mem = qm.estimate(model, arch, gptq, (8, 64), False, 4.0, True, False, 2)
    copy = 8 * 64 * cfg.hidden_size * 4
    assert mem.activations == 2 * copy + 8 * 64 * 8
    assert mem.layer.weights == weights and mem.layer.per_group is None
    widths = [cfg.hidden_size, cfg.hidden_size, cfg.hidden_size, cfg.intermediate_size]  # qkv, o, gate/up, down
    assert mem.layer.hessians == HESSIAN_BYTES * max(widths) ** 2
    heads = cfg.num_attention_heads  # a batch of 8 sequences: every head's scores, gate/up/product, 6 hidden-wide
    assert mem.layer.work == 8 * 4 * (heads * 64 * 64 + 64 * (3 * cfg.intermediate_size + 6 * cfg.hidden_size))
    assert qm.estimate(model, arch, gptq, None, False, 4.0, True, False, 2).layer.work == 0  # no calibration
    every = qm.estimate(model, arch, with_overrides(gptq, **{"gptq.true_sequential": False}), (8, 64), True, 4.0,
                        True, False, 2)
    assert every.layer.hessians == HESSIAN_BYTES * sum(w * w for w in widths)
    assert every.activations == copy + 8 * 64 * 8  # spilled: one copy in memory
    assert mem.capture == min(model.get_submodule(arch.embed_tokens).weight.numel(), 8 * 64 * cfg.hidden_size) * 4
    assert mem.peak == qm.BASELINE_BYTES + mem.activations + max(mem.capture, mem.layer.total, mem.end)
    awq = qm.estimate(model, arch, load_recipes(["w4a16-awq"]), (8, 64), False, 4.0, False, False, 2, awq=True)
    gate_up = 2 * cfg.intermediate_size * cfg.hidden_size
    # the weights before folding, and the MLP's gate/up twice (kept and candidate), in float32
    assert awq.layer.hessians == 0 and awq.layer.search == 4 * weights // HELD_BYTES_PER_WEIGHT + 2 * 4 * gate_up

    model, arch = _skeleton(kimi)
    budget = 2.5 * EXPERT_BYTES
    mem = qm.estimate(model, arch, gptq, (8, 64), False, budget / 2**30, True, False, 2)
    moe = model.get_submodule(arch.layers)[1]
    whole = sum(p.numel() for p in moe.parameters()) * HELD_BYTES_PER_WEIGHT
    grouped = [h for h in [mem.layer] if h.per_group is not None]
    assert grouped and mem.layer.index in (1, 2)
    assert mem.layer.per_group == 2 and mem.layer.group == 2 * EXPERT_BYTES
    assert mem.layer.weights == whole - 4 * EXPERT_BYTES
    assert mem.layer.expert_hessians == HESSIAN_BYTES * (64 ** 2 + 32 ** 2)  # gate/up read 64 wide, down 32
    assert mem.layer.experts == 2 * 8 * 64 * model.config.hidden_size * 4
    awq = qm.estimate(model, arch, with_overrides(load_recipes(["w4a16-awq"]), **{"awq.n_grid": 4}), (8, 64), False,
                      budget / 2**30, False, False, 2, awq=True)
    loss = min(8, awq_loss_samples()) * 64 * model.config.hidden_size * 4
    assert awq.layer.search == min(int(budget / 2**30 * 2**30), 4 * loss)


def awq_loss_samples() -> int:
    return load_recipes(["w4a16-awq"]).awq.loss_samples


def test_no_plan_without_streaming(kimi, tmp_path, capsys):
    """--no-stream loads the model whole: no plan is printed, none in --json, and no budget is refused."""
    code, out, err = kvq_run(["quantize", kimi, "--algorithm", "rtn", *FAST, "--no-stream", "--memory-budget-gib",
                              0.5 * EXPERT_BYTES / 2**30, "-o", tmp_path / "out", "--json"], capsys)
    assert code == 0, err
    assert "memory plan" not in err and json.loads(out)["memory_plan"] is None


def test_fused_and_listed_experts_count_alike():
    """A layer's experts as transformers fuses them (3-D parameters) and as a list of modules: one count."""
    from types import SimpleNamespace

    spec = SimpleNamespace(moe=SimpleNamespace(experts="experts"))
    fused = torch.nn.Module()
    fused.experts = torch.nn.Module()
    fused.experts.gate_up_proj = torch.nn.Parameter(torch.empty(4, 64, 16, device="meta"))
    fused.experts.down_proj = torch.nn.Parameter(torch.empty(4, 16, 32, device="meta"))
    listed = torch.nn.Module()
    listed.experts = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(16, 64, bias=False, device="meta"),
                                                              torch.nn.Linear(32, 16, bias=False, device="meta"))
                                          for _ in range(4)])
    assert qm._experts(spec, fused) == qm._experts(spec, listed) == (4, 64 * 16 + 16 * 32)


def _child_peak(q) -> None:
    from compressor.activations import peak_rss_mib

    q.put(peak_rss_mib())


def test_a_spawned_process_reports_its_own_peak():
    """peak_rss_mib (the summaries' and --workers' worker_reads figure) is the process's own VmHWM: a worker
    started by spawn from a parent that held 300 MiB more does not report the parent's peak (ru_maxrss would)."""
    import multiprocessing

    from compressor.activations import peak_rss_mib

    held = torch.ones(300 * 2**20 // 4)  # touched: resident
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child_peak, args=(q,))
    p.start()
    child = q.get(timeout=120)
    p.join(timeout=60)
    assert held.sum() > 0 and child < peak_rss_mib() - 250
