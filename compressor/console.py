"""What the commands print on stderr: progress bars, notes, warnings and result tables (rich).

Every function takes the command's ``console`` (a ``rich.console.Console``; ``None`` on
torchrun ranks other than 0 and from the Python API by default, where nothing is printed) and the
command's result dict: the commands compute, this module only renders. Progress bars show
on a terminal only; elsewhere (CI logs) quantization prints one plain line per layer. In
``--json`` mode the console prints the progress lines only (:func:`make_console`, :func:`step`).
"""

from __future__ import annotations

import json

from .gates import gate
from .manifest import SIGNATURE_NAME


def make_console(progress_only: bool = False):
    """The console of the ``kvq`` command line: rich, on stderr.

    ``progress_only`` (``--json``, where stdout is the JSON and the notes, warnings and tables
    are in it): a console that prints only the progress lines (:func:`step`, a line per layer or
    window), plain, never a live bar, so a long run in a script still shows it is moving."""
    from rich.console import Console

    if not progress_only:
        return Console(stderr=True)

    class ProgressOnly(Console):
        def print(self, *objects, **kw) -> None:  # notes, warnings, tables: in the JSON instead
            pass

        def step(self, text: str) -> None:
            super().print(text, highlight=False, markup=False, soft_wrap=True)

    return ProgressOnly(stderr=True, force_terminal=False)


def step(console, text: str) -> None:
    """One plain progress line (no markup): a long step starting or a unit of it done. Printed
    by every console, the ``--json`` one included (:func:`make_console`); nothing without one."""
    if console is None:
        return
    if hasattr(console, "step"):
        console.step(text)
    else:
        console.print(text, highlight=False, markup=False, soft_wrap=True)


def note(console, text: str, **kw) -> None:
    """Print one line (rich markup allowed) unless ``console`` is ``None``; ``kw`` go to ``print``."""
    if console is not None:
        console.print(text, **kw)


def warnings(console, items: list[str], label: str = "warning") -> None:
    """One ``warning:`` (or ``label:``) line per item, never wrapped (grep-able)."""
    for w in items:
        note(console, f"[yellow]{label}:[/] {w}", highlight=False, soft_wrap=True)


#: how the quantize summary names each way of choosing static KV scales
_SEARCH = {"attention": "searched on the attention output", "absmax": "from the calibration absmax"}

#: items of a list of differences printed one per line before the rest are only counted
LIST_LIMIT = 20


def capped_list(console, label: str, items: list[str], limit: int = LIST_LIMIT) -> None:
    """One ``label: item`` line (``label`` in red) for each of the first ``limit`` items,
    then ``label: ... and K more`` for the rest: a manifest of a million entries must not
    take a million lines (the JSON report keeps every item)."""
    for item in items[:limit]:
        note(console, f"[red]{label}[/]: {item}", highlight=False)
    if len(items) > limit:
        note(console, f"[red]{label}[/]: ... and {len(items) - limit:,} more", highlight=False)


def as_typed(x: float) -> str:
    """A float flag as the user typed it, as far as the float holds it (``0.001``, ``1048576``): the
    memory plans echo ``--memory-budget-gib`` with this, never a rounded form of it."""
    r = repr(float(x))
    return r[:-2] if r.endswith(".0") else r


def capped_names(line: str, limit: int = LIST_LIMIT) -> str:
    """``what: a, b, c, ...`` with at most ``limit`` names, then ``... and K more``."""
    head, sep, names = line.partition(": ")
    parts = names.split(", ") if sep else []
    if len(parts) <= limit:
        return line
    return f"{head}: {', '.join(parts[:limit])}, ... and {len(parts) - limit:,} more"


def progress(console, total_label: str):
    """A rich progress bar (description, bar, done/total ``total_label``, elapsed, ETA),
    disabled without a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(total_label),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        console=console, disable=console is None or not console.is_terminal, transient=False,
    )


def layer_done(console, bar, task, i: int, n: int, fig: dict) -> None:
    """Advance the bar; where there is no terminal (CI logs) print one plain line per layer."""
    bar.update(task, completed=i + 1)
    if console is not None and not console.is_terminal:
        err = fig.get("output_rel_error")
        step(console, f"layer {i + 1}/{n} done in {fig['seconds']:.1f} s"
                      + ("" if err is None else f", relative output error {err:.4f}"))


def window_done(console, bar, task, i: int, n: int, seconds: float) -> None:
    """Advance verify's bar; where there is no terminal (CI logs, ``make demo``) print one plain
    line per evaluated window, so a long evaluation shows it is moving."""
    bar.update(task, completed=i)
    if console is not None and not console.is_terminal:
        step(console, f"window {i}/{n} evaluated ({seconds:.0f} s)")


# ---------------------------------------------------------------------------------------
# kvq quantize

def layer_table(console, layers: list[dict]) -> None:
    """The per-layer quantization table: bits, group, modules, weight and output error, seconds."""
    from rich.table import Table

    t = Table(title="per-layer quantization", show_lines=False)
    for col in ("layer", "bits", "group", "modules", "mean rel. weight error", "rel. output error", "seconds"):
        t.add_column(col, justify="right")
    for f in layers:
        out_err = "-" if f["output_rel_error"] is None else f"{f['output_rel_error']:.4f}"
        w_err = "-" if f["mean_rel_error"] is None else f"{f['mean_rel_error']:.4f}"
        t.add_row(str(f["layer"]), str(f["num_bits"] or "float"), str(f["group_size"] or "-"), str(f["modules"]),
                  w_err, out_err, f"{f['seconds']:.1f}")
    seqs = sorted({f["output_error_sequences"] for f in layers if f.get("output_error_sequences")})
    missing = any(f["output_rel_error"] is None for f in layers)
    if seqs:
        t.caption = (f"rel. output error: the layer's output against the float layer's on the first "
                     f"{'/'.join(map(str, seqs))} calibration sequence(s)" + ("; -: not measured" if missing else ""))
    elif missing:
        t.caption = ("rel. output error -: not measured (this algorithm runs no float reference layer; "
                     "kvq verify compares the whole model with the float one)")
    console.print(t)


def quantize_done(console, summary: dict, layers: list[dict], moe_layers: list[dict]) -> None:
    """After ``kvq quantize``: the per-layer table, routed tokens per MoE layer, and where
    the artifact was written."""
    if console is None:
        return
    if layers:
        layer_table(console, layers)
    for m in moe_layers:
        toks = m["expert_tokens"]
        console.print(f"MoE layer {m['layer']}: {m['experts']} experts, routed calibration tokens "
                      + ("not counted (no calibration pass)" if toks is None else
                         f"min {min(toks)} / median {sorted(toks)[len(toks) // 2]} / max {max(toks)}"
                         + (f", {len(m['below_min_tokens'])} below {summary['moe']['min_tokens']}"
                            if m["below_min_tokens"] else "")),
                      highlight=False)
    if summary.get("head"):
        h = summary["head"]
        console.print(f"lm_head: {h['num_bits']} bit, " + ("per channel" if h["group_size"] == -1 else f"group {h['group_size']}")
                      + f", {'symmetric' if h['symmetric'] else 'asymmetric'}, rel. weight error {h['relative_error']:.4f}"
                      + ("; untied from the embedding (kept float)" if h["untied"] else ""), highlight=False)
    if summary.get("embedding"):
        e = summary["embedding"]
        console.print(f"embedding: {e['num_bits']} bit, " + ("per row" if e["group_size"] == -1 else f"group {e['group_size']}")
                      + f", rel. weight error {e['relative_error']:.4f}, {e['bytes'] / 1e6:,.2f} MB instead of "
                      f"{e['float_bytes'] / 1e6:,.2f} MB" + ("; also the tied LM head" if e["tied"] and not summary.get("head") else ""),
                      highlight=False)
    if summary.get("kv_cache"):
        k = summary["kv_cache"]
        strategy = {"kivi": "KIVI"}.get(k["strategy"], f"per {k['strategy']}")
        console.print(f"KV cache: {k['scheme']} {strategy}"
                      + (f", static scales {_SEARCH.get(k['scale_search'], k['scale_search'])}" if k["scale_search"] != "none" else "")
                      + (", key pairs changed in q_proj/k_proj (key_rotation pairs)" if k["key_rotation"] == "pairs" else ""),
                      highlight=False)
    if summary.get("source_bytes_read"):
        n, b = summary.get("workers") or 1, summary["source_bytes_read"]
        what = "the GGUF's float32 cache" if summary.get("source_kind") == "gguf" else "the source"
        console.print(f"read {f'{b / 1e9:,.3f} GB' if b >= 1e8 else f'{b / 1e6:,.3f} MB'} of {what} in "
                      f"{summary['wall_seconds']:.1f} s: {summary['source_gb_per_s']:.4g} GB/s"
                      + (f" ({n} workers)" if n > 1 else ""), highlight=False)
    size, float_bytes = summary["artifact_bytes"], summary["float32_bytes"]
    console.print(
        f"[green]wrote[/] {summary['output']} ({size / 2**20:.1f} MiB; float32 model {float_bytes / 2**20:.1f} MiB) "
        f"in {summary['wall_seconds']:.0f} s, peak RSS {summary['peak_rss_mib']:.0f} MiB"
        + (f", signed ({summary['signed']}) into {SIGNATURE_NAME}" if summary["signed"] is not None else "")
    )


# ---------------------------------------------------------------------------------------
# kvq verify

def kv_cache_line(k: dict) -> str:
    """The KV cache's memory in one line, quantized against fp16 (the report's ``kv_cache``: bytes per token,
    the tokens ``budget_gib`` GiB holds, the batch each context length allows); the console's and report.md's."""
    return (f"KV cache {k['scheme']} ({k['source']}): {k['bytes_per_token']:.0f} B/token vs fp16 "
            f"{k['fp16_bytes_per_token']:.0f} B/token; {k['budget_gib']:g} GiB holds {k['max_tokens']:,} tokens "
            f"(fp16: {k['fp16_max_tokens']:,}); "
            + ", ".join(f"context {c}: batch {b} (fp16 {k['fp16_max_batch'][c]})" for c, b in k["max_batch"].items()))


def activations_line(evaluated_in: dict | None) -> str | None:
    """The note that verify simulated quantized activations (W4A8, FP8 W8A8: ``evaluated_in.activations``),
    ``None`` for 16-bit activations; the console's and report.md's."""
    acts = (evaluated_in or {}).get("activations")
    if not acts:
        return None
    return (f"activations: each linear's input quantized {', '.join(acts)} (dynamic) and dequantized before its "
            "matmul, simulated as the serving kernel quantizes it")


def verify_table(console, report: dict, results: dict) -> None:
    """The verify result: warnings, the table of statistics and gates, the eval and KV
    accounting lines, one line per failed gate."""
    from rich.table import Table

    warnings(console, report["warnings"])
    t = Table(title=f"kvq verify {report['artifact']} ({report['mode']})")
    for c in ("check", "value", "threshold", "result"):
        t.add_column(c, overflow="fold")  # a narrow console (a CI log's 80 columns) wraps a tensor name, never cuts it
    if report["hashes"].get("checked", True):
        t.add_row("tensor/file digests", f"{report['hashes']['tensors_checked']} tensors", "all equal", "[green]pass")
    else:
        t.add_row("tensor/file digests", "no kvq manifest", "", "[yellow]not checked")
    _verify_rows(t, report, results)
    console.print(t)
    _verify_footer(console, report)


def _verify_rows(t, report: dict, results: dict) -> None:
    gates = {x["name"]: x for x in report["gates"]}

    def row(label, value, gate_name=None):
        gt = gates.get(gate_name)
        if gt is None:
            t.add_row(label, value, "", "")
        else:
            spec = gate(gate_name)
            t.add_row(label, value, f"{spec.symbol} {gt['threshold'] * spec.scale:g}{spec.unit}",
                      "[green]pass" if gt["passed"] else "[red]FAIL")

    if "perplexity" in report:
        ref = results["reference"]
        for label, r in results.items():
            if label == "seconds":
                continue
            rel = "" if label == "reference" else f"({(r['ppl'] / ref['ppl'] - 1) * 100:+.2f} %)"
            t.add_row(f"perplexity {label}", f"{r['ppl']:.4f} {rel}", "", "")
        p, d = report["perplexity"], report["distribution"]
        served = p["measured_on"]
        row(f"perplexity increase ({served})", f"{p['increase_pct']:+.2f} %", "max_ppl_increase_pct")
        k = d["kl"]
        row(f"KL mean ({served}), nats", f"{k['mean']:.4g}", "max_mean_kl")
        row("KL median / p99 / max, nats", f"{k['median']:.4g} / {k['p99']:.4g} / {k['max']:.4g}", "max_p99_kl")
        row(f"top-1 agreement ({served})", f"{d['top1_agreement_pct']:.2f} %", "min_top1_agreement_pct")
        dr = report["drift"]
        if dr:  # a streamed verify skips it (evaluated_in.streamed says why)
            row("greedy drift: first differing generated token",
                drift_text(dr["first_divergence"], dr["median"], dr["max_new_tokens"]), "min_median_divergence")
        else:
            row("greedy drift", "not measured (streamed)")
        lg = report.get("long_generation")
        if lg:
            row(f"long generation, KV only: top-1 ({lg['tokens']} tokens)",
                f"{lg['top1_agreement_pct']:.2f} %, first divergence {divergence_text(lg['first_divergence'])}",
                "min_long_agreement_pct")
        for turn in (report.get("multi_turn") or {}).get("turns", []):
            row(f"multi-turn, KV only: turn {turn['turn']} reply top-1", f"{turn['reply']['top1_pct']:.2f} %")
        us = (report.get("kv_cache") or {}).get("unit_scale")
        if us:  # the fp8 cache at k_scale = v_scale = 1.0: what an engine runs without the scales
            c, u = us["calibrated"], us["unit"]
            row("KV only at unit scales (scales missing or not read): ppl, KL mean, top-1",
                f"{u['increase_pct']:+.2f} %, {u['kl_mean']:.4g}, {u['top1_pct']:.2f} % (calibrated "
                f"{c['increase_pct']:+.2f} %, {c['kl_mean']:.4g}, {c['top1_pct']:.2f} %)")
        if report.get("hidden_state_error"):
            row("hidden-state error, last layer", f"{100 * report['hidden_state_error']['last']:.4g} %", "max_hidden_error")
    w = report.get("weights")
    if w and w["tensors"]:
        row(f"weight SQNR, min over {len(w['tensors'])} tensors", f"{w['min_sqnr_db']:.2f} dB ({w['min_sqnr_tensor']})",
            "min_sqnr_db")
    if "finite_weights" in gates:
        row("NaN/Inf in artifact tensors", f"{gates['finite_weights']['value']:g} tensors", "finite_weights")


def _verify_footer(console, report: dict) -> None:
    if "eval" in report:
        e = report["eval"]
        console.print(f"eval: {e['windows']} windows x {e['seqlen']} tokens ({e['predicted_tokens']} predicted) from {e['source']}",
                      highlight=False)
    acts = activations_line(report.get("evaluated_in"))
    if acts:
        console.print(acts, highlight=False)
    if report.get("kv_cache"):
        k = report["kv_cache"]
        console.print(kv_cache_line(k), highlight=False)
        if (k.get("unit_scale") or {}).get("engines"):
            console.print(f"KV cache scales: {k['unit_scale']['engines']}", highlight=False)
    for gt in report["gates"]:
        if not gt["passed"]:
            console.print(f"[red]gate failed[/]: {gt['name']} = "
                          f"{'n/a' if gt['value'] is None else format(gt['value'], '.4g')} (threshold {gt['threshold']:g})"
                          + (f"; {gt['detail']}" if gt.get("detail") else ""), highlight=False)


# ---------------------------------------------------------------------------------------
# kvq serve-smoke

def drift_text(firsts: list, median: float, generated: int) -> str:
    """Greedy drift for people, from each prompt's first divergence (``None``: never diverged): ``none of N
    prompts diverged in G generated tokens``, or how many did, the earliest among them and the median of all
    (a prompt that never diverged counted as ``generated``, as the gate on the median reads it)."""
    diverged = [f for f in firsts if f is not None]
    if not diverged:
        return f"none of {len(firsts)} prompts diverged in {generated} generated tokens"
    never = len(firsts) - len(diverged)
    return (f"{len(diverged)} of {len(firsts)} prompts diverged, the first at token {min(diverged)}; median "
            f"{median:g} of {generated} generated" + (f" (the {never} that never did count as {generated})"
                                                      if never else ""))


def divergence_text(token: int | None) -> str:
    """A first divergence for people: the generated token's index (from 0), or ``none`` when none differed."""
    return "none" if token is None else f"at token {token}"


def _kv_cache(d: dict) -> str:
    """The runtime's KV cache in words (``Runtime.describe()``'s): its scheme, or the dtype it is kept in."""
    return d["kv_scheme"] if d["kv_scheme"] != "none" else f"{d.get('dtype', 'float')}, not quantized"


def runtime_line(console, d: dict) -> None:
    """The runtime serve-smoke loaded: device, dtype, kernels (``kernels: aten-int4 x14, float x1``: layers each
    serves), KV scheme (``Runtime.describe()``)."""
    fused = f" ({d['fused_decode_sets']} q/k/v or gate/up sets share one decode call)" if "fused_decode_sets" in d else ""
    kernels = ", ".join(f"{k} x{n}" for k, n in d["kernels"].items()) or "none"
    note(console, f"runtime: {d['device']} {d['dtype']}; kernels: {kernels}{fused}; KV {_kv_cache(d)} "
                  f"({d['kv_bytes_per_token']:.0f} B/token)", highlight=False)


def http_line(console, http: dict, seconds: float, offline_batch: int) -> None:
    """The HTTP smoke's result in one line (``seconds``: its unrounded duration)."""
    note(console, f"http: {http['ok']}/{http['requests']} concurrent requests answered on {http['url']} in "
                  f"{seconds:.1f} s (batches of {', '.join(map(str, http['batch_sizes'])) or 'none'}); "
                  f"{http['matched_offline']}/"
                  f"{http['completions']} greedy completions identical to the offline batch-{offline_batch} run "
                  f"(batch composition changes rounding; not gated); bad request -> {http['bad_request_status']}; "
                  "server stopped", highlight=False)


def smoke_table(console, report: dict, n: int) -> None:
    """The serve-smoke result: speed per batch size, KV cache, memory, agreement, gates,
    the first prompts' continuations."""
    from rich.table import Table

    rt, c = report["runtime"], report["comparison"]
    t = Table(title=f"kvq serve-smoke {report['artifact']}")
    for col in ("figure", "value"):
        t.add_column(col)
    for key in dict.fromkeys(("batch_1", f"batch_{n}")):
        s = rt[key]
        dec = s["decode_tokens_per_s"]
        dec = "n/a" if s["decode_tokens"] == 0 or dec != dec else f"{dec:.1f}"
        t.add_row(f"{key.replace('_', ' ')}: prefill / decode", f"{s['prefill_tokens_per_s']:.1f} / {dec} tokens/s")
    t.add_row("KV cache", f"{_kv_cache(rt)}, {rt['kv_bytes_per_token']:.0f} bytes/token")
    t.add_row("peak RSS (runtime phase)", f"{rt['peak_rss_mib']:.0f} MiB")
    t.add_row("top-1 agreement (generated positions)", f"{c['top1_agreement_pct']:.1f} % of {c['generated_positions']}")
    k = c["prompt_kl"]
    if k["count"]:
        t.add_row("KL(ref || runtime) on prompts, mean / p99", f"{k['mean']:.4f} / {k['p99']:.4f} nats")
    t.add_row("first divergence", drift_text(c["first_divergence"], c["median_first_divergence"],
                                             report["max_new_tokens"]))
    lg = report.get("long_generation")
    if lg:
        t.add_row(f"long generation: top-1 ({lg['tokens']} tokens), first divergence",
                  f"{lg['top1_agreement_pct']:.2f} %, {divergence_text(lg['first_divergence'])}")
    for turn in (report.get("multi_turn") or {}).get("turns", []):
        r = turn["reply"]
        t.add_row(f"multi-turn: turn {turn['turn']} reply top-1 / KL mean",
                  f"{r['top1_pct']:.2f} % / {r['kl_mean']:.4g} nats ({r['tokens']} tokens)")
    for g in report["gates"]:
        val = "n/a" if g["value"] is None else format(g["value"], ".4g")
        t.add_row(f"gate {g['name']}", f"{val} vs {g['threshold']:g}: " + ("[green]pass" if g["passed"] else "[red]FAIL"))
    console.print(t)
    if report["failed_gates"]:
        console.print(f"[red]serve-smoke FAILED[/]: {', '.join(report['failed_gates'])}", highlight=False)
    for p in c["per_prompt"][:3]:  # quoted as the JSON report quotes them (newlines shown as \n)
        console.print(f"  {json.dumps(p['prompt'], ensure_ascii=False)} -> "
                      f"{json.dumps(p['generated'][:80], ensure_ascii=False)}", highlight=False, markup=False)
