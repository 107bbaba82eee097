"""What kvq says to people: ``kvq verify``'s reports carry the console's lines (the KV cache's bytes per
token, the simulated activations, the unit-scale figures by position) in the console's words; greedy drift
says when no prompt diverged; no Python repr (a dict, a list) is printed; docs/recipes.md lists every gate.
Rendered from report dicts made by hand: no model runs."""

from __future__ import annotations

import html

from rich.console import Console

from compressor.console import verify_table
from compressor.report import html_page, markdown

#: the figures of one position bucket, a configuration of ``kv_cache.unit_scale.by_position``
_BUCKET = {"ppl": 310.548, "kl_mean": 9.83188e-06, "kl_p99": 1.80506e-05, "top1_pct": 99.6063}

KV_CACHE = {
    "scheme": "fp8 (tensor)", "source": "artifact", "budget_gib": 16.0, "bytes_per_token": 256.0,
    "fp16_bytes_per_token": 512.0, "max_tokens": 67108864, "fp16_max_tokens": 33554432,
    "max_batch": {"256": 262144}, "fp16_max_batch": {"256": 131072},
    "unit_scale": {
        "row": "KV only", "scales_all_unit": False, "engines": None,
        "scales": {"k_min": 0.0028, "k_max": 0.0034, "v_min": 0.0020, "v_max": 0.0031},
        "calibrated": {"ppl": 310.5478, "increase_pct": -0.028, "kl_mean": 9.83e-06, "kl_p99": 1.8e-05,
                       "top1_pct": 99.6063},
        "unit": {"ppl": 310.7257, "increase_pct": 0.0292, "kl_mean": 1.21e-05, "kl_p99": 1.76e-05, "top1_pct": 100.0},
        "by_position": [{"bucket": "0-512", "tokens": 254, "calibrated": _BUCKET,
                         "unit": {**_BUCKET, "ppl": 312.5, "kl_mean": 0.0123, "top1_pct": 97.25}},
                        {"bucket": "512-2k", "tokens": 1536, "calibrated": _BUCKET,
                         "unit": {**_BUCKET, "ppl": 401.0, "kl_mean": 0.25, "top1_pct": 81.5}}],
    },
}


def _report(**sections) -> dict:
    return {"artifact": "out/a", "mode": "full", "passed": True, "warnings": [], "gates": [], "failed_gates": [],
            "signature": {"checked": False, "present": False},
            "hashes": {"checked": True, "ok": True, "tensors_checked": 3, "files_checked": 2},
            "eval": {"windows": 2, "seqlen": 128, "predicted_tokens": 254, "source": "embedded:eval"}, **sections}


def _console_lines(report: dict) -> list[str]:
    console = Console(width=1000, record=True, force_terminal=False)
    verify_table(console, report, {})
    return [line.strip() for line in console.export_text().splitlines() if line.strip()]


def _assert_in_both_reports(report: dict, text: str) -> None:
    md = markdown(report)
    assert text in md, (text, md)
    assert html.escape(text) in html_page(report, md, []), text


def test_the_reports_carry_the_console_kv_cache_line():
    report = _report(kv_cache=KV_CACHE)
    line = next(x for x in _console_lines(report) if x.startswith("KV cache fp8"))
    assert "256 B/token vs fp16 512 B/token" in line and "16 GiB holds 67,108,864 tokens" in line
    _assert_in_both_reports(report, line)


def test_the_reports_say_activations_were_simulated_as_the_console_does():
    for acts in (["fp8-token"], ["fp8-group 128"]):  # W4A8 / FP8 W8A8; FP8 block
        report = _report(evaluated_in={"dtype": "bfloat16", "declared": "bfloat16", "why": "x", "activations": acts})
        line = next(x for x in _console_lines(report) if x.startswith("activations:"))
        assert acts[0] in line and "simulated as the serving kernel" in line
        _assert_in_both_reports(report, line)
    plain = _report(evaluated_in={"dtype": "bfloat16", "declared": "bfloat16", "why": "x"})
    assert not [x for x in _console_lines(plain) if x.startswith("activations")]
    assert "activations" not in markdown(plain)


def test_the_reports_give_the_unit_scale_figures_by_position():
    report = _report(kv_cache=KV_CACHE)
    _assert_in_both_reports(report, "calibrated: ppl / KL mean / top-1")
    for b in KV_CACHE["unit_scale"]["by_position"]:
        u = b["unit"]
        _assert_in_both_reports(report, f"{u['ppl']:.4f} / {u['kl_mean']:.4g} / {u['top1_pct']:.2f} %")
        assert f"| {b['bucket']} | {b['tokens']:,} |" in markdown(report)


def _drift(tokenizer, firsts: list, generated: int) -> dict:
    """``drift`` as :func:`compressor.quality.greedy_drift` makes it from each prompt's first divergence."""
    from compressor.quality import greedy_drift

    class Model:  # greedy_drift calls generate(); each prompt's continuations are made to differ at firsts[i]
        def __init__(self, artifact: bool):
            self.artifact, self.calls = artifact, 0

        def generate(self, ids, max_new_tokens, **kw):
            import torch

            out = torch.zeros(1, ids.shape[1] + max_new_tokens, dtype=torch.long)
            f = firsts[self.calls]
            self.calls += 1
            if self.artifact and f is not None:
                out[0, ids.shape[1] + f] = 1
            return out

    return greedy_drift(Model(False), Model(True), tokenizer, ["a"] * len(firsts), generated)


def test_prompts_that_never_diverge_are_not_a_divergence_at_the_last_token(tokenizer):
    """A prompt whose generations never differ is ``null`` in the JSON, left out of ``min`` (``null`` when no
    prompt diverged) and said in words ("none of N prompts diverged"); the gate's median still counts it as
    ``max_new_tokens``, so ``min_median_divergence`` passes it."""
    from compressor.gates import gate, statistic
    from compressor.report import Drift

    none = _drift(tokenizer, [None] * 8, 4)
    assert none["first_divergence"] == [None] * 8 and none["identical"] == 8 and none["min"] is None
    assert none["median"] == 4 and gate("min_median_divergence").passes(statistic({"drift": none},
                                                                               gate("min_median_divergence")), 4)
    Drift.model_validate({**none, "measured_on": "weights only"})
    some = _drift(tokenizer, [None, 3, None, 1, None], 4)
    assert some["min"] == 1 and some["identical"] == 3 and some["median"] == 4
    every = _drift(tokenizer, [2, 3, 1], 4)
    assert every["min"] == 1 and every["median"] == 2 and every["identical"] == 0

    for dr, words in ((none, "none of 8 prompts diverged in 4 generated tokens"),
                      (some, "2 of 5 prompts diverged, the first at token 1; median 4 of 4 generated "
                             "(the 3 that never did count as 4)"),
                      (every, "3 of 3 prompts diverged, the first at token 1; median 2 of 4 generated")):
        report = _report(drift={**dr, "measured_on": "weights only"}, perplexity={
            "artifact": 10.0, "reference": 10.0, "increase_pct": 0.0, "measured_on": "weights only"},
            distribution={"measured_on": "weights only", "top1_agreement_pct": 100.0, "kl": {
                "count": 1, "mean": 0.0, "median": 0.0, "p99": 0.0, "max": 0.0, "min": 0.0}})
        console = " ".join(" ".join(_console_lines_with(report)).split())
        assert words in console, (words, console)
        _assert_in_both_reports(report, words)
        assert f"of {dr['max_new_tokens']} generated ({dr['identical']}" not in markdown(report)


def _console_lines_with(report: dict) -> list[str]:
    """The console's lines of a report with a full evaluation (the table's rows need its results)."""
    console = Console(width=1000, record=True, force_terminal=False)
    verify_table(console, report, {"reference": {"ppl": 10.0}, "weights only": {"ppl": 10.0}})
    return [line.strip() for line in console.export_text().splitlines() if line.strip()]


def test_serve_smoke_says_none_of_its_prompts_diverged():
    """serve-smoke's table words its first divergences as verify's do (``median_first_divergence`` counts a
    prompt that never diverged as all it generated: the gate's statistic)."""
    from compressor.console import smoke_table

    speed = {"prefill_tokens_per_s": 100.0, "decode_tokens_per_s": 50.0, "decode_tokens": 8}
    for firsts, median, words in (([None, None], 6, "none of 2 prompts diverged in 6 generated tokens"),
                                  ([None, 2], 4, "1 of 2 prompts diverged, the first at token 2; median 4 of 6")):
        report = {"artifact": "out/a", "max_new_tokens": 6, "gates": [], "failed_gates": [],
                  "runtime": {"batch_1": speed, "batch_2": speed, "kv_scheme": "none", "kv_bytes_per_token": 64.0,
                              "peak_rss_mib": 100.0},
                  "comparison": {"top1_agreement_pct": 100.0, "generated_positions": 12, "first_divergence": firsts,
                                 "prompt_kl": {"count": 0}, "median_first_divergence": median,
                                 "min_first_divergence": None, "per_prompt": []}}
        console = Console(width=1000, record=True, force_terminal=False)
        smoke_table(console, report, 2)
        text = console.export_text()
        assert words in text, text
        assert "float, not quantized, 64 bytes/token" in text  # never "KV cache  none"
        report["runtime"]["dtype"] = "bfloat16"
        console = Console(width=1000, record=True, force_terminal=False)
        smoke_table(console, report, 2)
        assert "bfloat16, not quantized, 64 bytes/token" in console.export_text()
    report["comparison"]["per_prompt"] = [{"prompt": "Q: [b]it's\nA:", "generated": "l'eau"}]
    console = Console(width=1000, record=True, force_terminal=False)
    smoke_table(console, report, 2)
    assert '"Q: [b]it\'s\\nA:" -> "l\'eau"' in console.export_text()  # JSON quoting, no markup read


def test_no_python_repr_reaches_the_console():
    """serve-smoke's runtime and HTTP lines and the one-line errors of group sizes and input quantization
    word their dicts and lists (``kernels: aten-int4 x14, float x1``), never ``{'float': 211}`` or ``[32]``."""
    import pytest

    from compressor.console import http_line, runtime_line
    from compressor.errors import InputError
    from compressor.formats.compressed_tensors import activation_scheme
    from compressor.recipe import load_recipe, resolve_group_size

    console = Console(width=1000, record=True, force_terminal=False)
    runtime_line(console, {"device": "cpu", "dtype": "bfloat16", "kernels": {"aten-int4": 14, "float": 1},
                           "fused_decode_sets": 4, "kv_scheme": "fp8 (tensor)", "kv_bytes_per_token": 256.0})
    http_line(console, {"ok": 4, "requests": 4, "url": "http://127.0.0.1:1", "batch_sizes": [1, 3],
                        "matched_offline": 2, "completions": 2, "bad_request_status": 400}, 0.4, 8)
    text = console.export_text()
    assert "kernels: aten-int4 x14, float x1 (4 q/k/v" in text and "(batches of 1, 3)" in text, text
    errors = []
    for gs, in_features in ((64, {"a": 32, "b": 128}), ("auto", {"a": 48, "b": 100})):
        recipe = load_recipe("w4a16-rtn-g64").model_copy(deep=True)
        recipe.weights.group_size = gs
        with pytest.raises(InputError) as e:
            resolve_group_size(recipe, in_features)
        errors.append(str(e.value))
    with pytest.raises(InputError) as e:
        activation_scheme({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False})
    errors.append(str(e.value))
    assert "(in_features 32)" in errors[0] and "in_features (48, 100)" in errors[1], errors
    assert "(num_bits 8, type float, strategy tensor, dynamic False)" in errors[-1], errors
    for line in [text, *errors]:
        assert not any(mark in line for mark in ("{'", "['", "[3", "[4", "[1")), line


def test_the_recipes_page_lists_every_gate_as_the_code_defines_it():
    """docs/recipes.md's Gates table has a row for every gate of compressor/gates.py (every key a recipe's
    ``gates:`` block accepts, plus the two that always run), with its command, direction, flag and default."""
    from pathlib import Path

    from compressor.gates import GATES
    from compressor.recipe import Gates

    text = (Path(__file__).resolve().parents[1] / "docs" / "recipes.md").read_text()
    section = text.split("\n## Gates\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.replace("\\|", "/").strip("|").split("|")]
            rows[cells[0].strip("`")] = cells
    assert set(Gates.model_fields) <= set(rows) and set(rows) == {g.name for g in GATES}, sorted(rows)
    for g in GATES:
        _, command, passes, unit, flag, default, meaning = rows[g.name]
        assert command == g.command and passes == f"value {g.symbol} threshold" and meaning, g.name
        assert unit.split(" ")[0] == (g.unit.strip() if g.scale == 1 else "fraction"), g.name
        assert flag == (f"`{g.flag}`" if g.flag else "-"), g.name
        stored = Gates.model_fields[g.name].default if g.name in Gates.model_fields else None
        want = g.default if g.default is not None else stored
        assert default.split(" ")[0] == ("-" if want is None else f"{want:g}") or g.option is None, g.name
