"""``kvq serve-smoke``: the release smoke test that serves an artifact with the bundled
runtime and compares it with the original model.

The HTTP server itself (``kvq serve``: :class:`Engine`, :class:`Server`, :func:`make_app`,
:func:`check_host`) lives in :mod:`compressor.runtime.server`; the names are re-exported
here for existing callers.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import InputError
from .runtime.server import MAX_BODY_BYTES, MAX_TOKENS_LIMIT, Engine, Server, check_host, make_app  # noqa: F401


# ---------------------------------------------------------------------------------------
# serve-smoke

@dataclass
class SmokeOptions:
    """Options of ``kvq serve-smoke`` (see its ``--help``)."""

    artifact: Path
    prompts: Optional[str] = None
    max_new_tokens: int = 32
    reference: Optional[str] = None
    device: str = "cpu"
    backend: str = "auto"
    http: bool = False
    http_requests: int = 8
    min_top1: Optional[float] = None  # percent, over generated positions
    max_kl: Optional[float] = None  # nats, mean over prompt positions
    min_first_divergence: Optional[int] = None  # median first differing generated position


def _smoke_thresholds(manifest, opts: SmokeOptions) -> dict[str, float]:
    stored = dict((manifest.recipe or {}).get("gates") or {})
    out = {}
    for name, attr, default in (("serve_min_top1_pct", "min_top1", 70.0), ("serve_max_prompt_kl", "max_kl", 0.5),
                                ("serve_min_median_divergence", "min_first_divergence", None)):
        v = getattr(opts, attr)
        if v is None:
            v = stored.get(name)
        if v is None:
            v = default
        if v is not None:
            out[name] = float(v)
    return out


def run_serve_smoke(opts: SmokeOptions, console=None) -> dict:
    """Serve the artifact with the bundled runtime and compare it with the reference model.

    Steps: digests (refuses a tampered artifact); load the runtime (packed weights, the
    artifact's KV scheme); greedy generation of every prompt as one batch, and of the
    first prompt alone (batch 1), timing prefill and decode; the reference model (float,
    transformers) teacher-forced on each prompt plus the runtime's continuation: KL(ref ||
    runtime) over the prompt positions, top-1 agreement over the generated positions, and
    the first generated position where the reference's greedy choice differs (exactly
    where its own greedy generation would diverge); optionally the HTTP round trip.

    Raises:
        InputError: not an artifact, bad prompts file, unsupported model.
    """
    import resource

    import torch
    from transformers import AutoTokenizer

    from .integrity import check_hashes
    from .manifest import load_manifest
    from .models import resolve_source
    from .prompts import load_prompts
    from .runtime import Runtime
    from .stats import first_divergence, kl_and_top1, summarize

    t0 = time.perf_counter()
    from .integrity import check_artifact_folder

    folder = check_artifact_folder(opts.artifact)
    manifest = load_manifest(folder)
    from .runtime.model import check_servable_folder

    check_servable_folder(folder)  # MoE/MLA/Gemma/GLM: one line, exit 2, before hashing
    prompts = load_prompts(opts.prompts)
    thresholds = _smoke_thresholds(manifest, opts)
    hashes = check_hashes(folder)
    report: dict = {"artifact": str(folder), "hashes_ok": hashes["ok"], "prompts": len(prompts),
                    "max_new_tokens": opts.max_new_tokens, "gates": [], "failed_gates": [], "passed": False}
    if not hashes["ok"]:
        report["hashes"] = hashes
        report["failed_gates"] = ["digests"]
        if console:
            console.print("[red]digests FAILED[/]: the artifact does not match its manifest; run `kvq verify --hashes-only`",
                          highlight=False)
        report["seconds"] = round(time.perf_counter() - t0, 2)
        return report

    rt = Runtime.from_artifact(folder, device=opts.device, backend=opts.backend, kv="artifact")
    tok = AutoTokenizer.from_pretrained(str(folder))
    engine_name = folder.name
    eng = Engine(rt, tok, engine_name)
    try:
        ids = [eng.encode(p) for p in prompts]
        for i, x in enumerate(ids):
            try:
                eng.check_length(x, opts.max_new_tokens)
            except InputError as e:
                raise InputError(f"prompt {i + 1}: {e}") from None
        if console:
            d = rt.describe()
            console.print(f"runtime: {d['device']} {d['dtype']}, kernels {d['kernels']}, KV {d['kv_scheme']} "
                          f"({d['kv_bytes_per_token']:.0f} B/token)", highlight=False)
        rt.generate(ids[:1], max_new_tokens=2)  # warm-up (allocator, kernel selection)
        one = rt.generate(ids[:1], max_new_tokens=opts.max_new_tokens)
        batch = rt.generate(ids, max_new_tokens=opts.max_new_tokens, return_prompt_logits=True)
        peak_runtime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        report["runtime"] = {**rt.describe(), "batch_1": one.summary(), f"batch_{len(ids)}": batch.summary(),
                             "peak_rss_mib": round(peak_runtime, 1)}
        http = None
        if opts.http:
            http = _http_smoke(eng, prompts, ids, batch.tokens, opts, console)
            report["http"] = http
    finally:
        eng.close()

    ref_spec = opts.reference or manifest.source.get("spec")
    if not ref_spec:
        raise InputError("the manifest records no source model; pass --reference")
    from .api import load_reference

    ref_model = load_reference(ref_spec, resolve_source(ref_spec))
    ref_model.to(opts.device)
    kls, agree, total, firsts, per_prompt = [], 0, 0, [], []
    with torch.no_grad():
        for i, (p_ids, gen, plog) in enumerate(zip(ids, batch.tokens, batch.prompt_logits)):
            seq = torch.tensor([p_ids + gen], device=opts.device)
            logits = ref_model(seq).logits[0].float().cpu()
            n = len(p_ids)
            kl, _same = kl_and_top1(logits[: n - 1], plog[: n - 1]) if n > 1 else (torch.zeros(0, dtype=torch.float64), None)
            ref_next = logits[n - 1: n - 1 + len(gen)].argmax(-1).tolist()  # reference's choice at each generated position
            match = [int(a == b) for a, b in zip(ref_next, gen)]
            agree += sum(match)
            total += len(match)
            f = first_divergence(ref_next, gen)
            firsts.append(f)
            kls.append(kl)
            per_prompt.append({"prompt": prompts[i][:60], "prompt_tokens": n, "generated": tok.decode(gen),
                               "top1_pct": 100.0 * sum(match) / max(1, len(match)), "first_divergence": f,
                               "prompt_kl_mean": float(kl.mean()) if kl.numel() else None})
    del ref_model
    kl_all = torch.cat(kls).numpy() if kls else []
    eff = [opts.max_new_tokens if f is None else f for f in firsts]
    report["reference"] = ref_spec
    report["comparison"] = {
        "top1_agreement_pct": 100.0 * agree / max(1, total), "generated_positions": total,
        "prompt_kl": summarize(kl_all), "first_divergence": firsts, "median_first_divergence": summarize(eff)["median"],
        "min_first_divergence": summarize(eff)["min"], "per_prompt": per_prompt,
    }
    c = report["comparison"]
    gates = []
    if "serve_min_top1_pct" in thresholds:
        gates.append({"name": "serve_min_top1_pct", "threshold": thresholds["serve_min_top1_pct"],
                      "value": c["top1_agreement_pct"], "passed": c["top1_agreement_pct"] >= thresholds["serve_min_top1_pct"]})
    if "serve_max_prompt_kl" in thresholds and (c["prompt_kl"]["count"] or opts.max_kl is not None):
        v = c["prompt_kl"]["mean"]  # None when no prompt has 2 tokens: an explicit gate then fails
        gates.append({"name": "serve_max_prompt_kl", "threshold": thresholds["serve_max_prompt_kl"],
                      "value": v, "passed": v is not None and v <= thresholds["serve_max_prompt_kl"]})
    if "serve_min_median_divergence" in thresholds:
        gates.append({"name": "serve_min_median_divergence", "threshold": thresholds["serve_min_median_divergence"],
                      "value": c["median_first_divergence"],
                      "passed": c["median_first_divergence"] >= thresholds["serve_min_median_divergence"]})
    if http is not None:  # every request answered well-formed, /health ok, a malformed request refused with 400
        gates.append({"name": "http_answers", "threshold": http["requests"], "value": http["ok"],
                      "passed": http["ok"] == http["requests"] and not http["problems"]})
    report["gates"] = gates
    report["failed_gates"] = [g["name"] for g in gates if not g["passed"]]
    report["passed"] = not report["failed_gates"]
    report["seconds"] = round(time.perf_counter() - t0, 2)
    if console:
        _print_smoke(console, report, len(ids))
    return report


def _http_smoke(eng: Engine, prompts: list[str], ids: list[list[int]], offline: list[list[int]], opts: SmokeOptions,
                console) -> dict:
    """Start the server on a free loopback port, send ``http_requests`` concurrent requests
    (completions and chat, alternating), check them, stop the server."""
    import httpx

    srv = Server(eng).start()
    n = opts.http_requests
    max_tokens = opts.max_new_tokens
    expected = {}
    t0 = time.perf_counter()
    try:
        async def go():
            async with httpx.AsyncClient(base_url=srv.url, timeout=600) as client:
                health = await client.get("/health")
                calls = []
                for i in range(n):
                    p = prompts[i % len(prompts)]
                    if i % 2 == 0:
                        expected[i] = i % len(prompts)
                        calls.append(client.post("/v1/completions", json={"model": eng.name, "prompt": p,
                                                                          "max_tokens": max_tokens, "temperature": 0}))
                    else:
                        calls.append(client.post("/v1/chat/completions", json={
                            "model": eng.name, "messages": [{"role": "user", "content": p}],
                            "max_tokens": max_tokens, "temperature": 0}))
                bad = await client.post("/v1/completions", json={"prompt": 5})
                return health, await asyncio.gather(*calls), bad

        health, responses, bad = asyncio.run(go())
    finally:
        srv.stop()
    seconds = time.perf_counter() - t0
    ok, matched, completions, problems, prefix = 0, 0, 0, [], []
    for i, r in enumerate(responses):
        try:
            body = r.json()
            choice = body["choices"][0]
            text = choice["text"] if i in expected else choice["message"]["content"]
            good = r.status_code == 200 and isinstance(text, str) and body["usage"]["completion_tokens"] > 0
        except (ValueError, KeyError, IndexError, TypeError):
            good, text = False, None
        ok += int(good)
        if not good:
            problems.append(f"request {i}: status {r.status_code}: {r.text[:200]}")
        if i in expected:
            completions += 1
            off = offline[expected[i]][:max_tokens]
            if eng.eos is not None and eng.eos in off:  # the server stops at the end-of-sequence token
                off = off[: off.index(eng.eos) + 1]
            want = eng.finish(ids[expected[i]], off, max_tokens, [])[0]
            if good and text == want:
                matched += 1
            if good:
                prefix.append(len(os.path.commonprefix([text, want])))
    if bad.status_code != 400:
        problems.append(f"a malformed request got status {bad.status_code}, not 400")
    if health.status_code != 200:
        problems.append(f"/health answered {health.status_code}")
    out = {"url": srv.url, "requests": n, "ok": ok, "completions": completions, "matched_offline": matched,
           "mean_common_prefix_chars": round(sum(prefix) / len(prefix), 1) if prefix else None,
           "health": health.status_code == 200, "bad_request_status": bad.status_code,
           "seconds": round(seconds, 3), "requests_per_s": round(n / seconds, 2), "batch_sizes": list(eng.batches),
           "problems": problems}
    if console:
        console.print(f"http: {ok}/{n} concurrent requests answered on {srv.url} in {seconds:.1f} s "
                      f"(batches {eng.batches}); {matched}/{completions} greedy completions identical to the offline "
                      f"batch-{len(offline)} run (batch composition changes rounding; not gated); "
                      f"bad request -> {bad.status_code}; server stopped", highlight=False)
    return out


def _print_smoke(console, report: dict, n: int) -> None:
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
    t.add_row("KV cache", f"{rt['kv_scheme']}, {rt['kv_bytes_per_token']:.0f} bytes/token")
    t.add_row("peak RSS (runtime phase)", f"{rt['peak_rss_mib']:.0f} MiB")
    t.add_row("top-1 agreement (generated positions)", f"{c['top1_agreement_pct']:.1f} % of {c['generated_positions']}")
    k = c["prompt_kl"]
    if k["count"]:
        t.add_row("KL(ref || runtime) on prompts, mean / p99", f"{k['mean']:.4f} / {k['p99']:.4f} nats")
    t.add_row("first divergence, median / min", f"{c['median_first_divergence']:g} / {c['min_first_divergence']:g} "
              f"of {report['max_new_tokens']} generated tokens")
    for g in report["gates"]:
        val = "n/a" if g["value"] is None else format(g["value"], ".4g")
        t.add_row(f"gate {g['name']}", f"{val} vs {g['threshold']:g}: " + ("[green]pass" if g["passed"] else "[red]FAIL"))
    console.print(t)
    if report["failed_gates"]:
        console.print(f"[red]serve-smoke FAILED[/]: {', '.join(report['failed_gates'])}", highlight=False)
    for p in c["per_prompt"][:3]:
        console.print(f"  {p['prompt']!r} -> {p['generated'][:80]!r}", highlight=False)
