"""``kvq serve-smoke`` at sizes whose reference or runtime does not fit (issue #43): the reference
read one decoder layer at a time (``--stream``; an MoE layer in groups of routed experts) gives
the whole reference's figures; the runtime, the packed model whole, is estimated from the
safetensors headers before anything loads and refused above ``--memory-budget-gib``; the plan
is printed and in the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from compressor.commands.options import SmokeOptions
from compressor.commands.serve_smoke import run_serve_smoke
from compressor.errors import InputError
from conftest import close_figures, quantize_tiny
from tiny_models import make_dir

ROWS = ["llama", "deepseek_v3"]
LONG = 24  # long enough for the reference's own greedy continuation to leave the runtime's
PROMPTS = "The quick brown fox\nOnce upon a time there was\ndef add(a, b):\n"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tokenizer):
    """row -> tiny RTN W4 artifact with an fp8 KV cache (its manifest names its tiny source)."""
    root = tmp_path_factory.mktemp("smoke-stream")
    (root / "prompts.txt").write_text(PROMPTS)
    # every DeepSeek-V3 layer MoE: a dense first layer would be the plan's largest unit, grouping or not
    kw = {"deepseek_v3": {"first_k_dense_replace": 0}}
    return root / "prompts.txt", {row: quantize_tiny(root / f"{row}-art", make_dir(root / row, tokenizer, row,
                                                                                **kw.get(row, {})), kv_scheme="fp8")
                                  for row in ROWS}


def _smoke(art, prompts, **kw):
    return run_serve_smoke(SmokeOptions(artifact=art, prompts=str(prompts), max_new_tokens=6, long_tokens=LONG,
                                        min_top1=0.0, **kw))


@pytest.mark.parametrize("row", ["llama", pytest.param("deepseek_v3", marks=pytest.mark.slow)])  # MoE: ~60 s
def test_streamed_reference_gives_the_whole_reference_figures(row, artifacts):
    prompts, arts = artifacts
    whole = _smoke(arts[row], prompts)
    assert whole["memory_plan"]["reference"]["streamed"] is False
    kw = {"stream": True}
    if row == "deepseek_v3":  # a budget between one expert and the whole MoE layer: experts read in groups
        kw["memory_budget_gib"] = _group_budget(arts[row], prompts)
    streamed = _smoke(arts[row], prompts, **kw)
    plan = streamed["memory_plan"]
    assert plan["reference"]["streamed"] is True and plan["reference"]["why"] == "--stream"
    if row == "deepseek_v3":
        per_group = plan["reference"]["streamed_plan"]["experts_per_group"]
        assert 1 <= per_group < 4, per_group  # the tiny DeepSeek-V3 has 4 routed experts a layer
    else:
        assert plan["reference"]["streamed_plan"]["experts_per_group"] == 0
    close_figures(streamed["comparison"], whole["comparison"], "comparison", abs_tol=1e-7)  # KL ~1e-4 nats here
    close_figures(streamed["long_generation"], whole["long_generation"], "long_generation", abs_tol=1e-7)
    assert streamed["passed"] == whole["passed"]
    # the figures measure something: the W4 runtime differs from the float reference
    assert whole["comparison"]["prompt_kl"]["mean"] > 0 and whole["long_generation"]["kl"]["mean"] > 0


def _group_budget(art, prompts) -> float:
    """A ``--memory-budget-gib`` whose streamed plan reads the tiny MoE layers in groups of
    fewer than all experts: one expert's bytes below the plan with whole decoder layers."""
    from compressor.commands import smoke_memory
    from compressor.manifest import load_manifest
    from compressor.prompts import load_prompts
    from compressor.source.resolve import resolve_source
    from compressor.streamed_eval import BASELINE_BYTES, GIB

    spec = load_manifest(art).source["spec"]
    opts = SmokeOptions(artifact=art, prompts=str(prompts), max_new_tokens=6, long_tokens=LONG, stream=True)
    mem = smoke_memory.plan(art, load_prompts(str(prompts)), opts, spec, resolve_source(spec))
    assert mem.streamed.experts_per_group == 0  # the memory available holds whole layers
    one = sum(p.numel() * 4 for p in mem.lazy.experts(1)[0].parameters())
    room = mem.reference - one  # grouped: the other experts out, their recorded inputs in
    assert BASELINE_BYTES + mem.runtime.total < room
    return (room - BASELINE_BYTES) / GIB


def test_runtime_above_the_budget_is_refused_in_one_line(artifacts):
    prompts, arts = artifacts
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-m", "compressor", "serve-smoke", str(arts["llama"]), "--prompts",
                        str(prompts), "--memory-budget-gib", "0.00001", "--threads", "1"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--memory-budget-gib 1e-05" in lines[0] and "kvq verify" in lines[0] and "--stream" in lines[0]
    assert "the runtime" in lines[0] and "KiB" in lines[0]  # a tiny model's figure in a unit that shows it


def test_the_runtime_alone_is_compared_with_the_budget_besides_the_process(artifacts, monkeypatch):
    """--memory-budget-gib is what serve-smoke may use besides the process (its help): a runtime just under it
    runs, one just over it is refused, and the refusal compares the runtime's figure with the budget's, neither
    counting the process; without the flag, the memory available less the process."""
    from compressor import console as show
    from compressor.commands import smoke_memory, verify_streamed
    from compressor.manifest import load_manifest
    from compressor.prompts import load_prompts
    from compressor.source.resolve import resolve_source
    from compressor.streamed_eval import BASELINE_BYTES, GIB

    prompts, arts = artifacts
    art, texts = arts["llama"], load_prompts(str(prompts))
    spec = load_manifest(art).source["spec"]
    opts = SmokeOptions(artifact=art, prompts=str(prompts), max_new_tokens=6)
    total = smoke_memory.runtime_estimate(art, smoke_memory._token_counts(art, texts), opts).total
    gib = smoke_memory._gib

    def refusal(**kw):
        with pytest.raises(InputError) as e:
            smoke_memory.plan(art, texts, opts.model_copy(update=kw), spec, resolve_source(spec))
        return str(e.value)

    smoke_memory.plan(art, texts, opts.model_copy(update={"memory_budget_gib": 1.01 * total / GIB}), spec,
                      resolve_source(spec))
    budget = 0.99 * total / GIB
    line = refusal(memory_budget_gib=budget)
    assert (f"the runtime {gib(total)} (" in line and f"more than --memory-budget-gib {show.as_typed(budget)} "
            f"({gib(int(budget * GIB))}, the process's own {gib(BASELINE_BYTES)} not counted)" in line), line
    assert "with the process" not in line
    monkeypatch.setattr(verify_streamed, "_available_bytes", lambda: BASELINE_BYTES + total // 2)
    line = refusal()
    assert (f"the runtime {gib(total)} (" in line and f"more than the {gib(total // 2)} this machine has available "
            f"besides the process's own {gib(BASELINE_BYTES)}" in line), line


def test_plan_is_printed_first_and_in_the_json(artifacts):
    from compressor.cli import cli

    prompts, arts = artifacts
    r = CliRunner().invoke(cli, ["serve-smoke", str(arts["llama"]), "--prompts", str(prompts), "--max-new-tokens",
                                 "3", "--min-top1", "0", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    plan = report["memory_plan"]
    assert plan["runtime"]["stored_mib"] > 0 and plan["runtime"]["weights_mib"] >= plan["runtime"]["stored_mib"]
    assert plan["peak_mib"] >= plan["runtime"]["total_mib"] + plan["process_mib"] and plan["peak_rss_mib"] > 0
    assert plan["reference"]["streamed"] is False
    r = CliRunner().invoke(cli, ["serve-smoke", str(arts["llama"]), "--prompts", str(prompts), "--max-new-tokens",
                                 "3", "--min-top1", "0"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.stderr.split())  # the console wraps lines
    assert text.index("memory plan:") < text.index("into the runtime"), text  # printed before anything loads
    assert "the reference whole in float32" in text
    help_text = CliRunner().invoke(cli, ["serve-smoke", "--help"]).output
    assert "--stream" in help_text and "--memory-budget-gib" in help_text


def test_greedy_by_passes_is_the_reference_greedy_continuation():
    """The streamed reference's own greedy continuation, from teacher-forced passes only, equals
    generating token by token; one pass per token at most, none when the guess is already greedy."""
    import torch

    from compressor.commands.smoke_service import argmax_pass, greedy_by_passes

    vocab = 11
    calls = [0]

    def forward(seqs, consume):  # a toy causal model: the next token is a function of the prefix
        calls[0] += 1
        for k, seq in enumerate(seqs):
            nxt = [(3 * sum(seq[:p + 1]) + p * p) % vocab for p in range(len(seq))]
            logits = torch.nn.functional.one_hot(torch.tensor(nxt), vocab).float()
            consume(k, lambda a, b, lg=logits: lg[a:b])

    prompt = [1, 4, 2]
    want = []
    for _ in range(12):
        seq = prompt + want
        want.append((3 * sum(seq) + (len(seq) - 1) ** 2) % vocab)
    for guess in ([0] * 12, want[:5] + [0] * 7, list(want)):
        choices = argmax_pass(forward, prompt, guess)
        calls[0] = 0
        assert greedy_by_passes(forward, prompt, guess, choices) == want
        assert calls[0] <= 12 and (calls[0] == 0) == (guess == want)
