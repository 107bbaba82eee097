"""``kvq serve-smoke``: serve the artifact with the bundled runtime, compare with the original.

:func:`run_serve_smoke` reads as its steps:

1. :func:`_plan` -- every refusal up front: not an artifact, an architecture the runtime
   does not serve, the prompts, the gate thresholds (:mod:`compressor.gates`);
2. the reference model's spec, then the memory plan (:mod:`compressor.commands.smoke_memory`,
   printed and in the report): the runtime estimated from the safetensors headers and refused
   above the budget; the reference whole, or streamed (``--stream``, or whole it does not fit);
3. :func:`_serve` -- the signature (with key material), then the runtime loaded through
   one checked read (:func:`compressor.runtime.generate.load_checked`: each tensor's
   digest from the bytes it is built from; a failed check is the gate ``signature`` or
   ``digests``, exit 1, every difference named), with packed weights and the artifact's
   KV scheme: greedy generation of every prompt as one batch and of the first alone,
   timed; optionally the same engine behind the HTTP API (:func:`_http_smoke`);
4. the runtime released; :func:`_compare` -- the reference (float; whole in transformers or
   a decoder layer at a time, :mod:`compressor.streamed_logits`) teacher-forced on each prompt
   plus the runtime's continuation: KL on the prompt positions, top-1 agreement over the
   generated positions, first divergence;
5. :func:`_gates` -- the thresholds against those statistics; the report dict.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .. import console as show
from .. import gates
from ..errors import CheckFailed, InputError
from . import smoke_memory
from ..activations import peak_rss_mib
from .common import cpu_threads, load_reference, threads_restored
from .options import SmokeOptions
from ..service_eval import REPLY_TOKENS
from .smoke_service import (long_compare, long_runtime, streamed_reference, turn_users, turns_compare, turns_runtime,
                            whole_reference)


@dataclass
class _Plan:
    folder: Path
    manifest: object  # compressor.manifest.Manifest
    prompts: list[str]
    thresholds: dict[str, float]


@dataclass
class _Served:
    """What the runtime produced: token ids of each prompt, the batched generation
    (``compressor.runtime`` result with ``tokens`` and ``prompt_logits``), the tokenizer."""

    ids: list[list[int]]
    batch: object
    tokenizer: object
    runtime: object = None  # compressor.runtime.generate.Runtime (the long generation runs it again)


def run_serve_smoke(opts: SmokeOptions, console=None) -> dict:
    """Serve the artifact with the bundled runtime and compare it with the reference model.

    Steps: the signature (with key material) and the digests, checked as the runtime
    loads (one read: each tensor's digest from the bytes it is built from; a failed check
    is reported, failed gate ``signature`` or ``digests``, with every difference named);
    the runtime (packed weights, the artifact's KV scheme): greedy generation of every
    prompt as one batch, and of the first prompt alone (batch 1), timing prefill and
    decode; the runtime released, the reference model (float: whole, or one decoder layer at a
    time, ``opts.stream`` or when whole it exceeds ``opts.memory_budget_gib``) teacher-forced on each prompt plus
    the runtime's continuation: KL(ref || runtime) over the prompt positions, top-1
    agreement over the generated positions, and the first generated position where the
    reference's greedy choice differs (exactly where its own greedy generation would
    diverge); optionally the HTTP round trip.

    ``opts.threads``: torch's intra-op threads for the run (restored after it; the default,
    one per usable CPU, with a note when other jobs keep the CPUs busy).

    Raises:
        InputError: not an artifact, bad prompts file, unsupported model, no reference; the
            runtime's estimate above the budget (:func:`compressor.commands.smoke_memory.plan`).
    """
    with threads_restored():  # --threads is this run's
        return _run(opts, console)


def _run(opts: SmokeOptions, console) -> dict:
    from ..load_integrity import ArtifactMismatch, SignatureFailed
    from ..source.gguf_cache import take_cache_notes
    from ..source.resolve import resolve_source

    t0 = time.perf_counter()
    plan = _plan(opts)  # refusals first: a refused run's stderr is its one error line
    ref_spec = opts.reference or (plan.manifest.source.get("spec") if plan.manifest else None)
    if not ref_spec:
        raise InputError("the manifest records no source model; pass --reference")
    ref_source = resolve_source(ref_spec)
    memory = smoke_memory.plan(plan.folder, plan.prompts, opts, ref_spec, ref_source)  # before anything loads
    _, busy = cpu_threads(opts.threads, console)
    report: dict = {"artifact": str(plan.folder), "hashes_ok": None, "prompts": len(plan.prompts),
                    "max_new_tokens": opts.max_new_tokens, "gates": [], "failed_gates": [], "passed": False,
                    "busy_note": busy, "warnings": [], "memory_plan": memory.as_dict()}
    show.note(console, f"memory plan: {memory.describe()}", highlight=False)
    try:
        served = _serve(plan, opts, report, console)
    except (SignatureFailed, ArtifactMismatch) as e:
        return _refused(report, e, console, t0)
    long_run = long_runtime(served.runtime, served.ids[0], opts.long_tokens, console) if opts.long_tokens else None
    chat = (turns_runtime(served.runtime, served.tokenizer, turn_users(plan.prompts, opts.turns), REPLY_TOKENS,
                          console) if opts.turns else None)
    served.runtime = None
    gc.collect()  # the runtime released before the reference loads
    carried = plan.manifest.quality.get("carried") if plan.manifest else None
    if isinstance(carried, dict) and carried.get("tensors"):  # Kimi K2.5: the text model is what ran
        report["carried"] = f"{carried.get('what')} ({carried['tensors']} tensors): carried in the artifact, not served"
        show.note(console, f"served the text model with text prompts; {report['carried']}", highlight=False)
    report["reference"] = ref_spec
    forward, greedy = _reference(memory, ref_spec, ref_source, opts, console)
    report["comparison"] = _compare(forward, served, plan.prompts)
    if long_run is not None:
        report["long_generation"] = long_compare(long_run, forward, greedy, console)
    if chat is not None:
        report["multi_turn"] = turns_compare(chat, forward, REPLY_TOKENS, console)
        chat = None
        if report["multi_turn"]["note"]:
            report["tokenizer"]["warnings"].append(f"multi-turn: {report['multi_turn']['note']}")
    forward = greedy = None
    report["memory_plan"]["peak_rss_mib"] = peak_rss_mib()
    report["warnings"] = take_cache_notes() + report["tokenizer"].pop("warnings")  # + a missing chat template
    report["warnings"] += _carried_reference(plan, opts, ref_spec)
    show.warnings(console, report["warnings"])
    report["gates"] = _gates(report, plan.thresholds, opts)
    report["failed_gates"] = [g["name"] for g in report["gates"] if not g["passed"]]
    report["passed"] = not report["failed_gates"]
    report["seconds"] = round(time.perf_counter() - t0, 2)
    if console:
        show.smoke_table(console, report, len(served.ids))
    return report


def _carried_reference(plan: _Plan, opts: SmokeOptions, ref_spec: str) -> list[str]:
    """The warning of a KV-only artifact made from an already-quantized source compared with that
    source (no ``--reference``): the reference holds the same quantized weights, so the figures
    measure the KV cache and the runtime only (``kvq verify`` says the same)."""
    if plan.manifest is None or opts.reference is not None or not plan.manifest.quantization.get("carried_from"):
        return []
    return [f"the reference {ref_spec} is the quantized source this artifact's weights were carried from unchanged: "
            "the comparison measures the KV cache and the runtime only; pass --reference with the original float "
            "model to measure weights + KV"]


def _refused(report: dict, e, console, t0: float) -> dict:
    """The report of a failed signature or digest check (nothing ran): gate ``signature`` or ``digests``."""
    from ..integrity import print_hashes
    from ..load_integrity import SignatureFailed

    if isinstance(e, SignatureFailed):
        report["signature"] = e.signature
        report["failed_gates"] = ["signature"]
        from rich.markup import escape

        show.note(console, f"[red]{escape(str(e))}[/]", highlight=False)
    else:
        report["hashes_ok"] = False
        report["hashes"] = e.report
        report["failed_gates"] = ["digests"]
        if console:
            print_hashes(console, e.report)
        show.note(console, f"[red]digests FAILED[/]: {report['artifact']} does not match its manifest (checked as loaded; "
                           "nothing ran)", highlight=False)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    return report


def _plan(opts: SmokeOptions) -> _Plan:
    """Artifact folder and manifest (None with ``--no-manifest``), servable architecture,
    prompts, thresholds.

    Raises:
        InputError: a backend that cannot run on the device; not an artifact; an architecture
            the runtime does not serve (one line, exit 2, before hashing); a bad prompts file.
    """
    import torch

    from ..integrity import check_artifact_folder
    from ..manifest import load_manifest
    from ..prompts import load_prompts
    from ..runtime.linear import check_backend
    from ..runtime.model import check_servable_folder

    check_backend(opts.backend, torch.device(opts.device))  # before any note of the artifact's checks
    folder = check_artifact_folder(opts.artifact)
    manifest = None if opts.no_manifest else load_manifest(folder)
    check_servable_folder(folder)
    prompts = load_prompts(opts.prompts)
    return _Plan(folder, manifest, prompts, _smoke_thresholds(manifest, opts))


def _smoke_thresholds(manifest, opts: SmokeOptions) -> dict[str, float]:
    """Each serve-smoke gate's threshold: its flag, else the recipe's ``gates`` block, else
    the table's default; gates left without one are not evaluated."""
    stored = dict(((manifest.recipe if manifest is not None else None) or {}).get("gates") or {})
    chosen = gates.choose_thresholds(gates.SERVE_SMOKE, opts.gates.model_dump(), stored)
    return {name: float(v) for name, v in chosen.items() if v is not None}


def _serve(plan: _Plan, opts: SmokeOptions, report: dict, console) -> _Served:
    """Load the runtime through one checked read, run it (warm-up, batch 1, every prompt
    as one batch) and optionally the HTTP smoke; fills ``report["signature"]``,
    ``report["hashes"]``, ``report["runtime"]``, ``report["tokenizer"]`` (the BOS rule the
    prompts were encoded by, whether a chat template exists; and ``report["http"]``).

    Raises:
        InputError: a prompt plus ``max_new_tokens`` exceeds the context length.
        SignatureFailed, ArtifactMismatch: a failed check (before anything runs).
    """
    import torch

    from ..runtime.generate import load_checked
    from ..runtime.engine import CHAT_FALLBACK_NOTE, Engine

    checked = "" if opts.no_manifest else ", each tensor's digest checked as it is read"
    show.step(console, f"loading {plan.folder} into the runtime{checked} ...")
    rt, tok, sig, manifest = load_checked(plan.folder, opts, lambda line: show.note(console, line, highlight=False))
    if manifest != plan.manifest:  # the plan's gates and reference came from the manifest the load checked against
        raise CheckFailed(f"{plan.folder}: its manifest changed while serve-smoke read it")
    report["signature"] = sig
    report["hashes_ok"] = None if rt.integrity is None else rt.integrity["ok"]
    report["hashes"] = rt.integrity if rt.integrity is not None else {"checked": False, "note": "--no-manifest"}
    eng = Engine(rt, tok, plan.folder.name)
    report["tokenizer"] = {**eng.bos_rule, "chat_template": eng.chat_template,
                           "warnings": [] if eng.chat_template else [CHAT_FALLBACK_NOTE]}
    try:
        ids = [eng.encode(p) for p in plan.prompts]
        for i, x in enumerate(ids):
            try:
                eng.check_length(x, opts.max_new_tokens, "--max-new-tokens")
                if i == 0 and opts.long_tokens:  # --long-tokens continues the first prompt
                    eng.check_length(x, opts.long_tokens, "--long-tokens")
            except InputError as e:
                raise InputError(f"prompt {i + 1}: {e}") from None
        if console:
            show.runtime_line(console, rt.describe())
        batched = f", then all {len(ids)} as one batch" if len(ids) > 1 else " (the only prompt: batch 1 is the batch)"
        show.step(console, f"generating {opts.max_new_tokens} tokens: the first prompt alone{batched} ...")
        rt.generate(ids[:1], max_new_tokens=2)  # warm-up (allocator, kernel selection)
        one = rt.generate(ids[:1], max_new_tokens=opts.max_new_tokens)
        batch = rt.generate(ids, max_new_tokens=opts.max_new_tokens, return_prompt_logits=True)
        report["runtime"] = {**rt.describe(), "batch_1": one.summary(), f"batch_{len(ids)}": batch.summary(),
                             "peak_rss_mib": peak_rss_mib(), "threads": torch.get_num_threads()}
        if opts.http:
            report["http"] = _http_smoke(eng, plan.prompts, ids, batch.tokens, opts, console)
    finally:
        eng.close()
    return _Served(ids, batch, tok, rt)


def _reference(memory, ref_spec: str, ref_source, opts: SmokeOptions, console):
    """``(forward, greedy)`` of the reference (:mod:`compressor.commands.smoke_service`): whole,
    or a decoder layer at a time when the memory plan streams it."""
    if memory.lazy is None:
        show.step(console, f"reference {ref_spec}: loading it, then reading each prompt and the runtime's "
                           "continuation ...")
        return whole_reference(load_reference(ref_spec, ref_source), opts.device)
    if opts.device != "cpu":
        show.note(console, f"note: the streamed reference runs on the CPU (--device {opts.device} applies to the "
                           "runtime)", highlight=False)
    show.step(console, f"reference {ref_spec}: one decoder layer at a time over each prompt and the runtime's "
                       "continuation ...")
    n = len(memory.lazy.layers) + 1

    def progress(i, _n):
        if console is not None and not console.is_terminal:
            show.step(console, f"streamed reference: step {i}/{n} done")

    return streamed_reference(memory.lazy, memory.streamed.expert_group_limit, progress)


def _positions(at, n: int, gen: list[int], plog):
    """One sequence's figures from its reference logits ``at(a, b)`` (``n`` prompt tokens, then
    ``gen``), read a chunk of positions at a time: KL against the runtime's prompt logits ``plog``
    over the prompt positions, and the reference's choice at each generated position."""
    import torch

    from ..stats import kl_and_top1
    from .smoke_service import chunked

    kls, nxt = [], []
    for a, lg in chunked(at, 0, n - 1 + len(gen)):
        b = a + lg.shape[0]
        if a < n - 1:
            kls.append(kl_and_top1(lg[: min(b, n - 1) - a], plog[a:min(b, n - 1)])[0])
        if b > n - 1:
            nxt.extend(lg[max(a, n - 1) - a:].argmax(-1).tolist())
    return torch.cat(kls) if kls else torch.zeros(0, dtype=torch.float64), nxt


def _compare(forward, served: _Served, prompts: list[str]) -> dict:
    """The reference teacher-forced on each prompt plus the runtime's continuation (``forward``:
    :data:`compressor.commands.smoke_service.Forward`): the report's ``comparison`` section (KL on
    prompt positions, top-1 agreement and first divergence over generated positions, per prompt).
    ``median_first_divergence`` counts a prompt that never diverged as all it generated (the statistic of
    the gate ``serve_min_median_divergence``); ``min_first_divergence`` is the earliest first divergence of
    the prompts that diverged, ``None`` when none did."""
    import torch

    from ..stats import first_divergence, summarize

    batch = served.batch
    got: dict[int, tuple] = {}
    forward([p + g for p, g in zip(served.ids, batch.tokens)],
            lambda k, at: got.__setitem__(k, _positions(at, len(served.ids[k]), batch.tokens[k],
                                                        batch.prompt_logits[k])))
    kls, agree, total, firsts, per_prompt = [], 0, 0, [], []
    for i, (p_ids, gen) in enumerate(zip(served.ids, batch.tokens)):
        kl, ref_next = got[i]
        n = len(p_ids)
        match = [int(a == b) for a, b in zip(ref_next, gen)]
        agree += sum(match)
        total += len(match)
        f = first_divergence(ref_next, gen)
        firsts.append(f)
        kls.append(kl)
        per_prompt.append({"prompt": prompts[i][:60], "prompt_tokens": n, "generated": served.tokenizer.decode(gen),
                           "top1_pct": 100.0 * sum(match) / max(1, len(match)), "first_divergence": f,
                           "prompt_kl_mean": float(kl.mean()) if kl.numel() else None})
    kl_all = torch.cat(kls).numpy() if kls else []
    eff = [len(g) if f is None else f for f, g in zip(firsts, batch.tokens)]  # never diverged: all it generated
    diverged = [f for f in firsts if f is not None]
    return {
        "top1_agreement_pct": 100.0 * agree / max(1, total), "generated_positions": total,
        "prompt_kl": summarize(kl_all), "first_divergence": firsts, "median_first_divergence": summarize(eff)["median"],
        "min_first_divergence": float(min(diverged)) if diverged else None,  # None: no prompt diverged
        "per_prompt": per_prompt,
    }


def _gates(report: dict, thresholds: dict[str, float], opts: SmokeOptions) -> list[dict]:
    """Every serve-smoke gate with a threshold (:mod:`compressor.gates`); with ``--http``,
    ``http_answers``: every request answered well-formed, ``/health`` ok, a malformed
    request refused with 400."""
    c = report["comparison"]
    out = []
    for spec in gates.gates_of(gates.SERVE_SMOKE, configurable=True):
        if spec.name not in thresholds:
            continue
        if spec.name == "serve_max_prompt_kl" and not (c["prompt_kl"]["count"] or opts.gates.max_kl is not None):
            continue  # no prompt has 2 tokens: only an explicit --max-kl is evaluated (and fails, value None)
        out.append(gates.result(spec.name, thresholds[spec.name], gates.statistic(report, spec)))
    http = report.get("http")
    if http is not None:
        g = gates.result("http_answers", http["requests"], http["ok"])
        g["passed"] = g["passed"] and not http["problems"]
        out.append(g)
    return out


def _http_smoke(eng, prompts: list[str], ids: list[list[int]], offline: list[list[int]], opts: SmokeOptions,
                console) -> dict:
    """Start the server on a free loopback port, send ``http_requests`` concurrent requests
    (completions and chat, alternating), check them, stop the server."""
    import httpx

    from ..runtime.server import Server

    srv = Server(eng).start()
    n = opts.http_requests
    show.step(console, f"http: {n} concurrent requests to the server on {srv.url} ...")
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
    show.http_line(console, out, seconds, len(offline))
    return out
