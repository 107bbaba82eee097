"""The ``kvq verify`` report: its JSON schema, and the Markdown / HTML / PNG renderings.

The JSON report (``kvq verify --json`` / ``--json-out``) follows :class:`VerifyReport`
(schema ``kvq.verify-report/1``, exported to ``docs/verify-report.schema.json``). Fields
are only ever added within a schema version; a rename or removal bumps it.
``--report DIR`` writes ``report.md`` (fit for a pull-request comment), ``report.html``
(self-contained, PNGs embedded) and the PNGs themselves, drawn with matplotlib.
"""

from __future__ import annotations

import base64
import html
import math
import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

from .errors import InputError
from . import report_service as service
from .console import activations_line, drift_text, kv_cache_line
from .gates import gate

REPORT_SCHEMA = "kvq.verify-report/1"


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Gate(_M):
    name: str
    threshold: Optional[float]
    value: Optional[float]
    passed: bool
    measured_on: str
    detail: Optional[str] = None


class Summary(_M):
    count: int
    mean: Optional[float]
    median: Optional[float]
    p99: Optional[float]
    max: Optional[float]
    min: Optional[float]


class Distribution(_M):
    measured_on: str
    kl: Summary
    top1_agreement_pct: Optional[float]
    breakdown: dict[str, dict[str, Any]]


class WindowRow(_M):
    window: int
    ppl_artifact: Optional[float]
    ppl_reference: Optional[float]
    kl_mean: Optional[float]
    top1_pct: Optional[float]


class WeightStats(_M):
    mean: Optional[float]
    std: Optional[float]
    absmax: Optional[float]
    kurtosis: Optional[float]


class TensorRow(_M):
    name: str
    layer: int
    rel_fro: Optional[float]
    sqnr_db: Optional[float]
    original: WeightStats
    artifact: WeightStats


class LayerRow(_M):
    layer: int
    mean_rel_fro: Optional[float]
    max_rel_fro: Optional[float]
    min_sqnr_db: Optional[float]


class Weights(_M):
    tensors: list[TensorRow]
    layers: list[LayerRow]
    min_sqnr_db: Optional[float]
    min_sqnr_tensor: Optional[str]
    awq_scales_undone: bool
    key_pairs_undone: bool = False  #: q_proj/k_proj per-RoPE-pair factors divided out (kv_cache.key_rotation: pairs)


class Hidden(_M):
    batches: int
    seqlen: int
    per_layer: list[Optional[float]]
    last: Optional[float]


class Drift(_M):
    prompts: int
    max_new_tokens: int
    first_divergence: list[Optional[int]]  #: generated-token index (from 0) per prompt; None: never diverged
    median: float  #: of first_divergence, a prompt that never diverged counted as max_new_tokens (the gate's)
    min: Optional[float]  #: the earliest first divergence of the prompts that diverged; None: none did
    identical: int  #: prompts that never diverged
    measured_on: str


class VerifyReport(_M):
    """The JSON report of ``kvq verify`` (schema ``kvq.verify-report/1``)."""

    schema_version: Literal["kvq.verify-report/1"] = REPORT_SCHEMA
    artifact: str
    mode: Literal["hashes-only", "weights-only", "full"]
    passed: bool
    signature: dict[str, Any]
    hashes: dict[str, Any]
    gates: list[Gate] = []
    failed_gates: list[str] = []
    warnings: list[str] = []
    #: the busy-machine or too-many-threads note of ``--threads`` (compressor.commands.common.cpu_threads)
    busy_note: Optional[str] = None
    nonfinite_tensors: list[str] = []
    reference: Optional[str] = None
    reference_matches_source: Optional[bool] = None
    #: the dtype the artifact was evaluated in: {"dtype", "declared", "why"} (issue #21)
    evaluated_in: Optional[dict[str, Any]] = None
    eval: Optional[dict[str, Any]] = None
    perplexity: Optional[dict[str, Any]] = None
    perplexity_breakdown: Optional[dict[str, Any]] = None
    distribution: Optional[Distribution] = None
    per_window: Optional[list[WindowRow]] = None
    weights: Optional[Weights] = None
    hidden_state_error: Optional[Hidden] = None
    drift: Optional[Drift] = None
    #: the window figures per bucket of query positions (issue #47; compressor.positions)
    by_position: Optional[service.ByPosition] = None
    #: long greedy generation, float vs quantized KV cache (compressor.service_eval)
    long_generation: Optional[service.LongGeneration] = None
    #: multi-turn chat through the chat template, caches kept across turns
    multi_turn: Optional[service.MultiTurn] = None
    kv_cache: Optional[dict[str, Any]] = None
    #: a multimodal wrapper's tensors carried untouched (Kimi K2.5's vision tower and projector):
    #: the manifest's quality.carried record plus "checked": "digest only"
    carried: Optional[dict[str, Any]] = None
    seconds: float


def json_schema() -> dict:
    """JSON Schema of :class:`VerifyReport` (``docs/verify-report.schema.json``)."""
    schema = VerifyReport.model_json_schema()
    schema["$id"] = "urn:kvq:verify-report:1"
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


def json_safe(obj):
    """``obj`` with every NaN/Inf float replaced by ``None`` (JSON has no such numbers; the
    report says why in ``nonfinite_tensors`` / the failed gates)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def validate(report: dict) -> dict:
    """Check ``report`` (as it will be written, non-finite numbers as null) against the
    schema; returns it unchanged (raises on a kvq bug)."""
    VerifyReport.model_validate(json_safe({k: v for k, v in report.items() if not k.startswith("_")}))
    return report


# ---------------------------------------------------------------------------------------
# renderings

def _fmt(v, spec=".4f") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return format(v, spec)


PNG_NAMES = ("perplexity_per_window.png", "kl_histogram.png", "layer_errors.png", service.PNG)


_figure = service.figure  # (figure, axes) on a private Agg canvas


def plots(report: dict, folder: Path) -> list[Path]:
    """Draw the report's PNGs into ``folder``; returns their paths (only those with data).

    Figures are drawn on their own Agg canvas (no pyplot): the process's matplotlib
    backend is left as it is.
    """
    name = Path(report["artifact"]).name
    gates = {g["name"]: g for g in report.get("gates", [])}
    out: list[Path] = []
    for png, draw in (("perplexity_per_window.png", _plot_perplexity), ("kl_histogram.png", _plot_kl),
                      ("layer_errors.png", _plot_layers), (service.PNG, service.plot)):
        fig = draw(report, name, gates)
        if fig is not None:
            fig.tight_layout()
            out.append(folder / png)
            fig.savefig(out[-1])
    return out


def _fin(v) -> float:
    return float(v) if v is not None and math.isfinite(v) else float("nan")


def _plot_perplexity(report: dict, name: str, gates: dict):
    """Perplexity per eval window, reference and artifact; ``None`` without windows."""
    from matplotlib.ticker import MaxNLocator

    pw = report.get("per_window")
    if not pw:
        return None
    fig, ax = _figure(figsize=(8, 3.6), dpi=110)
    xs = [r["window"] for r in pw]
    ax.plot(xs, [_fin(r["ppl_reference"]) for r in pw], "o-", label="reference (original model)", color="#555555")
    ax.plot(xs, [_fin(r["ppl_artifact"]) for r in pw], "o-", label=f"artifact ({report['distribution']['measured_on']})",
            color="#d62728")
    if len(xs) <= 12:  # a tick at each window (MaxNLocator falls back to fractions around a single one)
        ax.set_xticks(xs)
        if len(xs) == 1:
            ax.set_xlim(xs[0] - 1, xs[0] + 1)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("evaluation window (index into the eval text)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title(f"Perplexity per window: {name}")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def _plot_kl(report: dict, name: str, gates: dict):
    """Histogram of the per-token KL divergence (log-log), its mean/p99 and KL gates;
    ``None`` without finite values."""
    import numpy as np

    kl_values = report.get("_kl_values")
    if kl_values is None or not len(kl_values):
        return None
    v = np.asarray(kl_values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if not v.size:
        return None
    fig, ax = _figure(figsize=(8, 3.6), dpi=110)
    pos = v[v > 0]
    lo = max(float(pos.min()) if pos.size else 1e-7, 1e-7)
    hi = max(float(v.max()), lo * 10)
    bins = np.logspace(np.log10(lo), np.log10(hi), 60)
    n_low = int((v <= lo).sum())
    ax.hist(np.clip(v, lo, None), bins=bins, color="#1f77b4")
    ax.set_xscale("log")
    ax.set_yscale("log")
    d = report["distribution"]["kl"]
    for label, val, style in (("mean", d["mean"], "-"), ("p99", d["p99"], "--")):
        if val is not None and math.isfinite(val):
            ax.axvline(max(val, lo), color="#d62728", linestyle=style, label=f"{label} {val:.3g} nats")
    for gname, style in (("max_mean_kl", ":"), ("max_p99_kl", "-.")):
        if gname in gates and gates[gname]["threshold"]:
            ax.axvline(gates[gname]["threshold"], color="#2ca02c", linestyle=style,
                       label=f"gate {gname} {gates[gname]['threshold']:g}")
    ax.set_xlabel("KL(reference || artifact) per predicted token, nats (log scale)"
                  + (f"; first bin includes {n_low} tokens <= {lo:.1e}" if n_low > 1 else ""))
    ax.set_ylabel("tokens (log scale)")
    ax.set_title(f"Next-token KL divergence, {d['count']:,} tokens: {name}")
    ax.legend(fontsize=8)
    return fig


def _plot_layers(report: dict, name: str, gates: dict):
    """Weight SQNR per quantized tensor by layer and, below it, the hidden-state error per
    layer; ``None`` without weight statistics."""
    w = report.get("weights")
    hidden = report.get("hidden_state_error")
    if not (w and w["layers"]):
        return None
    rows = 2 if hidden else 1
    fig, axes = _figure(rows, 1, figsize=(10, 3.4 * rows), dpi=110, squeeze=False)
    _plot_sqnr(axes[0][0], w, name, gates)
    if hidden:
        _plot_hidden(axes[1][0], hidden, gates)
    return fig


def _plot_sqnr(ax, w: dict, name: str, gates: dict) -> None:
    from matplotlib.ticker import MaxNLocator

    kinds = sorted({t["name"].split(".")[-2] for t in w["tensors"]})
    finite = [t["sqnr_db"] for t in w["tensors"] if t["sqnr_db"] is not None and math.isfinite(t["sqnr_db"])]
    for kind in kinds:
        pts = sorted((t["layer"], _fin(t["sqnr_db"])) for t in w["tensors"] if t["name"].split(".")[-2] == kind)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, lw=1, label=kind)
    thr = gates.get("min_sqnr_db", {}).get("threshold")
    if thr is not None:
        ax.axhline(thr, color="#d62728", linestyle="--", lw=1, label=f"gate min_sqnr_db {thr:g}")
        finite.append(thr)
    if finite:
        ax.set_ylim(min(finite) - 1.0, max(finite) + 1.0)
    bad = [t["name"] for t in w["tensors"] if t["sqnr_db"] is None or not math.isfinite(t["sqnr_db"])]
    if bad:
        ax.text(0.01, 0.02, f"not drawn (NaN/Inf): {len(bad)} tensor(s)", transform=ax.transAxes, color="#d62728")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("weight SQNR, dB (higher is better)")
    ax.set_title(f"Weight SQNR per quantized tensor (artifact vs original): {name}")
    ax.legend(ncol=1, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.grid(alpha=0.3)


def _plot_hidden(ax, hidden: dict, gates: dict) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.bar(range(len(hidden["per_layer"])), [100 * _fin(e) for e in hidden["per_layer"]], color="#ff7f0e",
           label="relative error of the layer's output")
    thr = gates.get("max_hidden_error", {}).get("threshold")
    if thr is not None:
        ax.axhline(100 * thr, color="#d62728", linestyle="--", lw=1, label=f"gate (last layer) {100 * thr:g} %")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("relative error, % (lower is better)")
    ax.set_title(f"Hidden-state error after each layer ({hidden['batches']} x {hidden['seqlen']} tokens, "
                 "both models end to end)")
    ax.grid(axis="y", alpha=0.3)


def markdown(report: dict, images: list[Path] | None = None) -> str:
    """``report.md``: verdict, the KV cache and simulated-activations lines (worded as the console's), gates,
    headline statistics, the service sections, worst tensors (pull-request comment)."""
    lines = [f"## kvq verify: {'PASSED' if report['passed'] else 'FAILED'} — `{Path(report['artifact']).name}`", ""]
    sig = report["signature"]
    sig_text = ("not checked" + (" (present)" if sig.get("present") else " (none)")) if not sig.get("checked") else (
        f"ok ({sig.get('method')})" if sig.get("ok") else f"FAILED: {sig.get('error')}")
    h = report["hashes"]
    lines += [f"- signature: {sig_text}",
              (f"- digests: {'ok' if h['ok'] else 'FAILED'} ({h.get('tensors_checked', 0)} tensors, "
               f"{h.get('files_checked', 0)} files, {h.get('digest_algorithm', 'sha256')})") if h.get("checked", True)
              else f"- digests: not checked ({h.get('note', 'no kvq manifest')})"]
    if report.get("reference"):
        lines.append(f"- reference: `{report['reference']}`" + ("" if report.get("reference_matches_source") is not False
                                                              else " (not the recorded source)"))
    if report.get("eval"):
        e = report["eval"]
        lines.append(f"- eval: {e['windows']} windows x {e['seqlen']} tokens of `{e.get('source')}`"
                     + (f"; {e['bos_rule']}" if e.get("bos_rule") else ""))
    acts = activations_line(report.get("evaluated_in"))
    if acts:
        lines.append(f"- {acts}")
    if report.get("kv_cache"):
        lines.append(f"- {kv_cache_line(report['kv_cache'])}")
    for wmsg in report.get("warnings", []):
        lines.append(f"- warning: {wmsg}")
    if report["gates"]:
        lines += ["", "| gate | value | threshold | result |", "|---|---|---|---|"]
        for g in report["gates"]:
            op = gate(g["name"]).symbol
            lines.append(f"| {g['name']} ({g['measured_on']}) | {_fmt(g['value'], '.4g')} | {op} {_fmt(g['threshold'], 'g')} "
                         f"| {'pass' if g['passed'] else '**FAIL**'} |")
    if report.get("perplexity"):
        p = report["perplexity"]
        lines += ["", "| statistic | value |", "|---|---|",
                  f"| perplexity artifact / reference | {p['artifact']:.4f} / {p['reference']:.4f} ({p['increase_pct']:+.2f} %) |"]
        d = report.get("distribution")
        if d:
            k = d["kl"]
            lines += [f"| KL mean / median / p99 / max (nats) | {_fmt(k['mean'], '.4g')} / {_fmt(k['median'], '.4g')} / "
                      f"{_fmt(k['p99'], '.4g')} / {_fmt(k['max'], '.4g')} |",
                      f"| top-1 agreement | {d['top1_agreement_pct']:.2f} % |"]
        dr = report.get("drift")
        if dr:
            lines.append(f"| greedy drift: first differing generated token | "
                         f"{drift_text(dr['first_divergence'], dr['median'], dr['max_new_tokens'])} |")
        hs = report.get("hidden_state_error")
        if hs:
            lines.append(f"| hidden-state error after the last layer | {_fmt(None if hs['last'] is None else 100 * hs['last'], '.2f')} % |")
    lines += service.markdown_lines(report)
    w = report.get("weights")
    if w and w["tensors"]:
        worst = sorted(w["tensors"], key=lambda t: t["sqnr_db"] if t["sqnr_db"] is not None and not math.isnan(t["sqnr_db"]) else -math.inf)[:5]
        lines += ["", f"Weights: {len(w['tensors'])} quantized tensors, min SQNR {_fmt(w['min_sqnr_db'], '.2f')} dB "
                  f"({w['min_sqnr_tensor']}). Lowest SQNR:", "",
                  "| tensor | SQNR (dB) | rel. error | kurtosis orig → artifact |", "|---|---|---|---|"]
        for t in worst:
            lines.append(f"| `{t['name']}` | {_fmt(t['sqnr_db'], '.2f')} | {_fmt(t['rel_fro'], '.4f')} | "
                         f"{_fmt(t['original']['kurtosis'], '.2f')} → {_fmt(t['artifact']['kurtosis'], '.2f')} |")
    if images:
        lines += [""] + [f"![{p.stem}]({p.name})" for p in images]
    return "\n".join(lines) + "\n"


def _inline(text: str) -> str:
    """One Markdown line's text as HTML: escaped, then its inline marks (a span in backquotes as
    ``<code>``, ``**bold**`` as ``<strong>``)."""
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))
    return re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)


def html_page(report: dict, md_text: str, images: list[Path]) -> str:
    """``report.html``: the Markdown content as simple HTML (tables, headings, list items, inline
    code and bold; :func:`_inline`) with the PNGs embedded (base64)."""
    body = []
    in_table = False
    for line in md_text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-: "):
                continue
            if not in_table:
                body.append("<table>")
                in_table = True
                body.append("<tr>" + "".join(f"<th>{_inline(c)}</th>" for c in cells) + "</tr>")
            else:
                body.append("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in cells) + "</tr>")
            continue
        if in_table:
            body.append("</table>")
            in_table = False
        if line.startswith("## "):
            body.append(f"<h2>{_inline(line[3:])}</h2>")
        elif line.startswith("- "):
            body.append(f"<p>• {_inline(line[2:])}</p>")
        elif line.startswith("!["):
            continue
        elif line.strip():
            body.append(f"<p>{_inline(line)}</p>")
    if in_table:
        body.append("</table>")
    for p in images:
        data = base64.b64encode(p.read_bytes()).decode()
        body.append(f'<figure><img alt="{p.stem}" src="data:image/png;base64,{data}"><figcaption>{p.name}</figcaption></figure>')
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}"
             "img{max-width:100%}code{font-family:monospace;background:#f3f3f3;padding:0 .2em}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>kvq verify report</title><style>{style}</style>"
            f"</head><body>{''.join(body)}</body></html>\n")


def write_report(report: dict, folder: Path) -> list[Path]:
    """Write ``report.md``, ``report.html``, ``report.json`` and the PNGs into ``folder`` (created).

    Raises:
        InputError: the folder cannot be created or written.
    """
    import json

    try:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in PNG_NAMES:  # a reused folder must not show an earlier run's plots
            (folder / stale).unlink(missing_ok=True)
        images = plots(report, folder)
        md_text = markdown(report, images)
        (folder / "report.md").write_text(md_text, encoding="utf-8")
        (folder / "report.html").write_text(html_page(report, md_text, images), encoding="utf-8")
        public = json_safe({k: v for k, v in report.items() if not k.startswith("_")})
        (folder / "report.json").write_text(json.dumps(public, indent=2, sort_keys=True, allow_nan=False) + "\n",
                                            encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot write --report {folder}: {e.strerror}") from None
    return [folder / "report.md", folder / "report.html", folder / "report.json", *images]


if __name__ == "__main__":  # python -m compressor.report > docs/verify-report.schema.json
    import json

    print(json.dumps(json_schema(), indent=2, sort_keys=True))
