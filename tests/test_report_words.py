"""What ``kvq verify`` says in its console, report.md and report.html: the reports carry the console's
lines (the KV cache's bytes per token, the simulated activations, the unit-scale figures by position),
in the console's words. Rendered from report dicts made by hand: no model runs."""

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
