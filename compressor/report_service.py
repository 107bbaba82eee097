"""The verify report's service sections (issue #47): figures by position, long generation,
multi-turn -- their schema, their ``report.md`` lines and their plot (``kv_by_position.png``).

The sections are filled by :mod:`compressor.commands.verify_service` (definitions in
:mod:`compressor.positions` and :mod:`compressor.service_eval`); :mod:`compressor.report`
includes them in :class:`~compressor.report.VerifyReport`, ``report.md`` and the PNGs.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict

from .console import divergence_text

PNG = "kv_by_position.png"


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BucketFigures(_M):
    ppl: Optional[float]
    kl_mean: Optional[float]
    kl_p99: Optional[float]
    top1_pct: Optional[float]


class WindowBucket(_M):
    bucket: str  #: "0-512", "512-2k", "2k-8k", "8k+" (compressor.positions)
    first: int  #: first query position of the bucket present in the windows
    last: int
    tokens: int  #: predicted tokens counted (positions x windows)
    ppl_reference: Optional[float]
    configurations: dict[str, BucketFigures]  #: per compared configuration (the breakdown's labels)


class ByPosition(_M):
    measured_on: str
    edges: list[int]
    seqlen: int
    windows: int
    buckets: list[WindowBucket]


class SequenceBucket(_M):
    bucket: str
    first: int
    last: int
    tokens: int
    kl_mean: Optional[float]
    top1_pct: Optional[float]


class LongGeneration(_M):
    measured_on: str
    prompt_tokens: int
    tokens: int
    first_position: int  #: query position of the first compared step (the prompt's last token)
    top1_agreement_pct: float
    first_divergence: Optional[int]  #: generated-token index where top-1 first differs; None: never
    kl: dict[str, Optional[float]]
    by_position: list[SequenceBucket]
    kl_per_token: list[Optional[float]]
    disagreements: list[int]
    repeated_4gram_pct: dict[Literal["float", "quantized"], Optional[float]]
    free_running_first_difference: Optional[int]


class TurnFigures(_M):
    tokens: int
    kl_mean: Optional[float]
    top1_pct: Optional[float]
    first_divergence: Optional[int]


class Turn(_M):
    turn: int
    context_tokens: int  #: tokens both caches held when the turn was appended
    prompt: TurnFigures
    reply: TurnFigures
    ended: Literal["eos", "length"]


class MultiTurn(_M):
    measured_on: str
    reply_tokens: int
    turns: list[Turn]
    note: Optional[str]  #: why it stopped early or did not run (no chat template)


def _f(v, spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def markdown_lines(report: dict) -> list[str]:
    """``report.md`` tables of the service sections present in ``report`` (the unit-scale figures
    are ``kv_cache.unit_scale``: overall and by position bucket)."""
    lines: list[str] = []
    bp = report.get("by_position")
    if bp and bp["buckets"]:
        labels = list(bp["buckets"][0]["configurations"])
        lines += ["", f"By position ({bp['windows']} windows x {bp['seqlen']} tokens; query position = tokens in "
                  "context - 1):", "",
                  "| positions | tokens | ppl reference | " + " | ".join(f"{x}: ppl / KL mean / top-1" for x in labels)
                  + " |", "|---|---|---|" + "---|" * len(labels)]
        for b in bp["buckets"]:
            cells = [f"{_f(c['ppl'], '.4f')} / {_f(c['kl_mean'], '.4g')} / {_f(c['top1_pct'], '.2f')} %"
                     for c in b["configurations"].values()]
            lines.append(f"| {b['bucket']} ({b['first']}-{b['last']}) | {b['tokens']:,} | "
                         f"{_f(b['ppl_reference'], '.4f')} | " + " | ".join(cells) + " |")
    lg = report.get("long_generation")
    if lg:
        rep = lg["repeated_4gram_pct"]
        lines += ["", f"Long generation ({lg['measured_on']}): {lg['tokens']} greedy tokens after "
                  f"{lg['prompt_tokens']} "
                  f"of the eval text; quantized cache teacher-forced on the float cache's tokens: top-1 agreement "
                  f"{lg['top1_agreement_pct']:.2f} %, first divergence {divergence_text(lg['first_divergence'])}, "
                  f"KL mean {_f(lg['kl']['mean'], '.4g')} nats; repeated 4-grams "
                  f"float {_f(rep['float'], '.1f')} % vs quantized (free-running) {_f(rep['quantized'], '.1f')} %.", "",
                  "| positions | tokens | KL mean | top-1 |", "|---|---|---|---|"]
        lines += [f"| {b['bucket']} ({b['first']}-{b['last']}) | {b['tokens']} | {_f(b['kl_mean'], '.4g')} | "
                  f"{_f(b['top1_pct'], '.2f')} % |" for b in lg["by_position"]]
    us = (report.get("kv_cache") or {}).get("unit_scale")
    if us:
        lines += ["", "fp8 KV cache at unit scales (k_scale = v_scale = 1.0, what an engine runs when the scales are "
                  "missing or not read) beside the calibrated scales "
                  f"(k_scale {us['scales']['k_min']:.4g}-{us['scales']['k_max']:.4g}), {us['row']} row:"
                  + (f" {us['engines']}." if us.get("engines") else ""), "",
                  "| scales | ppl (increase) | KL mean / p99 | top-1 |", "|---|---|---|---|"]
        lines += [f"| {name} | {f['ppl']:.4f} ({f['increase_pct']:+.2f} %) | {_f(f['kl_mean'], '.4g')} / "
                  f"{_f(f['kl_p99'], '.4g')} | {f['top1_pct']:.2f} % |"
                  for name, f in (("calibrated", us["calibrated"]), ("unit", us["unit"]))]
        if us.get("by_position"):
            lines += ["", "The same by position (query position = tokens in context - 1):", "",
                      "| positions | tokens | calibrated: ppl / KL mean / top-1 | unit: ppl / KL mean / top-1 |",
                      "|---|---|---|---|"]
            lines += [f"| {b['bucket']} | {b['tokens']:,} | " + " | ".join(
                f"{_f(c['ppl'], '.4f')} / {_f(c['kl_mean'], '.4g')} / {_f(c['top1_pct'], '.2f')} %"
                for c in (b["calibrated"], b["unit"])) + " |" for b in us["by_position"]]
    mt = report.get("multi_turn")
    if mt:
        lines += ["", f"Multi-turn ({mt['measured_on']}, caches kept across turns)"
                  + (f": **{mt['note']}**" if mt.get("note") else ":")]
        if mt["turns"]:
            lines += ["", "| turn | context | prompt tokens / KL mean / top-1 | reply tokens / KL mean / top-1 | "
                      "first divergence |", "|---|---|---|---|---|"]
            for t in mt["turns"]:
                p, r = t["prompt"], t["reply"]
                lines.append(f"| {t['turn']} | {t['context_tokens']} | {p['tokens']} / {_f(p['kl_mean'], '.4g')} / "
                             f"{_f(p['top1_pct'], '.2f')} % | {r['tokens']} / {_f(r['kl_mean'], '.4g')} / "
                             f"{_f(r['top1_pct'], '.2f')} % | {divergence_text(r['first_divergence'])} |")
    return lines


def figure(*grid, figsize, dpi, **kw):
    """``(figure, axes)`` like ``pyplot.subplots``, on a private Agg canvas (nothing global); every
    plot of the report draws on one."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(*grid, **kw)


def plot(report: dict, name: str, gates: dict):
    """KL mean by position bucket of the windows (top) and, below it, the long generation's
    KL per generated token and its running top-1 agreement; ``None`` without either."""
    bp, lg = report.get("by_position"), report.get("long_generation")
    has_windows = bool(bp and bp["buckets"] and bp["buckets"][0]["configurations"])
    if not has_windows and not lg:
        return None
    rows = int(has_windows) + int(bool(lg))
    fig, axes = figure(rows, 1, figsize=(9, 3.4 * rows), dpi=110, squeeze=False)
    if has_windows:
        _plot_buckets(axes[0][0], bp, name)
    if lg:
        _plot_long(axes[rows - 1][0], lg, gates)
    return fig


def _plot_buckets(ax, bp: dict, name: str) -> None:
    labels = list(bp["buckets"][0]["configurations"])
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        ys = [b["configurations"][label]["kl_mean"] for b in bp["buckets"]]
        ax.bar([i + j * width for i in range(len(ys))], [float("nan") if y is None else y for y in ys], width,
               label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(bp["buckets"]))],
                  [f"{b['bucket']}\n{b['tokens']:,} tokens" for b in bp["buckets"]])
    ax.set_ylabel("KL mean, nats")
    ax.set_title(f"KL(reference || configuration) by query position, {bp['seqlen']}-token windows: {name}")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _plot_long(ax, lg: dict, gates: dict) -> None:
    import numpy as np

    kl = np.array([np.nan if v is None else v for v in lg["kl_per_token"]], dtype=np.float64)
    xs = np.arange(kl.size) + lg["first_position"]
    ax.plot(xs, np.clip(kl, 1e-7, None), lw=0.8, color="#1f77b4", label="KL per token")
    ax.set_yscale("log")
    finite = kl[np.isfinite(kl)]
    if finite.size:
        ax.set_ylim(max(float(finite.min()), 1e-7) / 2, max(float(finite.max()), 1e-6) * 2)
    ax.set_xlabel("query position (prompt + generated tokens)")
    ax.set_ylabel("KL(float cache || quantized), nats")
    if lg["first_divergence"] is not None:
        ax.axvline(lg["first_position"] + lg["first_divergence"], color="#d62728", ls="--",
                   label=f"first divergence (token {lg['first_divergence']})")
    same = np.ones(kl.size)
    same[lg["disagreements"]] = 0
    k = max(1, min(32, kl.size))
    running = np.convolve(same, np.ones(k) / k, mode="valid") * 100
    twin = ax.twinx()
    twin.plot(xs[k - 1:], running, color="#2ca02c", lw=1, label=f"top-1 agreement, last {k} tokens")
    thr = gates.get("min_long_agreement_pct", {}).get("threshold")
    if thr is not None:
        twin.axhline(thr, color="#2ca02c", ls=":", label=f"gate min_long_agreement_pct {thr:g} %")
    twin.set_ylim(0, 105)
    twin.set_ylabel("top-1 agreement, %")
    ax.set_title(f"Long generation ({lg['measured_on']}): {lg['tokens']} greedy tokens, quantized cache teacher-forced")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="best")
    ax.grid(alpha=0.3)
