"""``kvq serve`` / ``kvq serve-smoke``: the bundled runtime behind an OpenAI-compatible HTTP API,
and the release smoke test that compares it with the original model.

HTTP (Starlette app, served by uvicorn, checked with an httpx client):

* ``GET /health`` -> ``{"status": "ok", "model": NAME, ...}``
* ``POST /v1/completions`` (OpenAI Completions: ``prompt`` string or list of strings,
  ``max_tokens``, ``temperature`` (0 = greedy), ``seed``, ``stop``)
* ``POST /v1/chat/completions`` (OpenAI Chat Completions: ``messages``, rendered with the
  tokenizer's chat template)

Concurrent requests are batched: a single worker thread drains the queue, groups up to
``max_batch`` requests with the same sampling settings into one
:meth:`~compressor.runtime.Runtime.generate` call (prefill and decode together), and
answers each with its own tokens. Errors follow OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``) with status 400.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .errors import InputError

MAX_TOKENS_LIMIT = 4096
MAX_BODY_BYTES = 4 << 20  # 4 MiB of JSON per request


@dataclass
class _Request:
    ids: list[int]
    max_tokens: int
    greedy: bool
    temperature: float
    seed: int
    future: Future = field(default_factory=Future)


class Engine:
    """A :class:`~compressor.runtime.Runtime` plus its tokenizer, serving one batch at a time.

    ``submit`` may be called from any thread; a worker thread batches what is queued.
    """

    def __init__(self, runtime, tokenizer, name: str, max_batch: int = 8):
        self.runtime, self.tokenizer, self.name, self.max_batch = runtime, tokenizer, name, max_batch
        self.eos = tokenizer.eos_token_id
        self.queue: queue.Queue = queue.Queue()
        self.batches: list[int] = []  # sizes of the batches run (for reports)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvq-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self.queue.put(None)
        self._thread.join(timeout=10)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            bos = self.tokenizer.bos_token_id
            if bos is None:
                raise InputError("the prompt is empty after tokenization")
            ids = [bos]
        return ids

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return list(ids)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)

    def submit(self, ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> Future:
        """Queue one generation; greedy (``temperature`` 0) requests are batched together,
        sampled ones run alone so a ``seed`` reproduces its text whatever else arrives
        (no seed: a fresh random one)."""
        if seed is None:
            import secrets

            seed = secrets.randbits(31)
        req = _Request(list(ids), int(max_tokens), temperature == 0.0, float(temperature) or 1.0, int(seed))
        self.queue.put(req)
        return req.future

    def check_length(self, ids: list[int], max_tokens: int) -> None:
        """Raise InputError when prompt + ``max_tokens`` exceed the model's context length."""
        limit = self.runtime.decoder.spec.max_position_embeddings
        if len(ids) + max_tokens > limit:
            raise InputError(f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the model's context "
                             f"length {limit}")

    def _loop(self) -> None:
        pending: list[_Request] = []
        while not self._stop.is_set():
            if not pending:
                item = self.queue.get()
                if item is None:
                    break
                pending.append(item)
            while True:  # drain what else is queued right now
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._stop.set()
                    break
                pending.append(item)
            key = (pending[0].greedy, pending[0].temperature, pending[0].seed)
            batch = ([r for r in pending if r.greedy][: self.max_batch] if key[0] else [pending[0]])
            pending = [r for r in pending if r not in batch]
            try:
                res = self.runtime.generate([r.ids for r in batch], max_new_tokens=max(r.max_tokens for r in batch),
                                            greedy=key[0], temperature=key[1], seed=key[2], eos_token_id=self.eos)
                self.batches.append(len(batch))
                for r, toks in zip(batch, res.tokens):
                    r.future.set_result((toks[: r.max_tokens], res))
            except BaseException as e:  # noqa: BLE001 - delivered to the waiting request
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
        for r in pending:
            r.future.set_exception(RuntimeError("server shutting down"))

    def used_tokens(self, toks: list[int], text: str, stop: list[str]) -> int:
        """Completion tokens to bill: all generated ones, or, when a stop string cut the
        text, the tokens of the text returned."""
        if stop and any(s in self.tokenizer.decode(toks, skip_special_tokens=True) for s in stop):
            return len(self.tokenizer(text, add_special_tokens=False).input_ids)
        return len(toks)

    def finish(self, ids: list[int], toks: list[int], max_tokens: int, stop: list[str]) -> tuple[str, str]:
        """Decoded text and OpenAI ``finish_reason`` (``stop`` or ``length``)."""
        reason = "length"
        if self.eos is not None and toks and toks[-1] == self.eos:
            toks, reason = toks[:-1], "stop"
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        for s in stop:
            cut = text.find(s)
            if cut >= 0:
                text, reason = text[:cut], "stop"
        return text, reason


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _int(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _BadRequest(f"'{key}' must be an integer in [{lo}, {hi}]", key)
    return v


def _sampling(body: dict) -> tuple[int, float, int | None, list[str]]:
    max_tokens = _int(body, "max_tokens", 16, 1, MAX_TOKENS_LIMIT)
    t = body.get("temperature", 0.0)
    if t is None:
        t = 0.0
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 10.0:
        raise _BadRequest("'temperature' must be a number in [0, 10] (0 = greedy)", "temperature")
    seed = None if body.get("seed") is None else _int(body, "seed", 0, 0, 2**31 - 1)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 4):
        raise _BadRequest("'stop' must be a non-empty string or a list of up to 4 non-empty strings", "stop")
    if body.get("stream"):
        raise _BadRequest("streaming is not supported by this server; send \"stream\": false", "stream")
    if body.get("n", 1) not in (1, None):
        raise _BadRequest("'n' must be 1 (one choice per prompt)", "n")
    return max_tokens, float(t), seed, stop


def make_app(engine: Engine):
    """The Starlette application (routes: ``/health``, ``/v1/completions``, ``/v1/chat/completions``)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def error(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                       "code": None}}, status_code=status)

    async def body_of(request) -> dict:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise _BadRequest(f"request body of {int(size)} bytes exceeds the limit of {MAX_BODY_BYTES}")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise _BadRequest(f"request body exceeds the limit of {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _BadRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != engine.name:
            raise _BadRequest(f"model '{model}' is not served here (this server serves '{engine.name}')", "model")
        return body

    async def run(ids_list: list[list[int]], max_tokens: int, t: float, seed: int):
        futs = [engine.submit(ids, max_tokens, t, seed) for ids in ids_list]
        return await asyncio.gather(*(asyncio.wrap_future(f) for f in futs))

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def health(request):
        return JSONResponse({"status": "ok", "model": engine.name, **engine.runtime.describe()})

    async def completions(request):
        try:
            body = await body_of(request)
            prompt = body.get("prompt")
            prompts = [prompt] if isinstance(prompt, str) else prompt
            if not (isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts) and len(prompts) <= 64):
                raise _BadRequest("'prompt' must be a string or a list of 1 to 64 strings", "prompt")
            max_tokens, t, seed, stop = _sampling(body)
            try:
                ids = await asyncio.to_thread(lambda: [engine.encode(p) for p in prompts])
                for x in ids:
                    engine.check_length(x, max_tokens)
            except InputError as e:
                raise _BadRequest(str(e), "prompt") from None
        except _BadRequest as e:
            return error(str(e), e.param)
        results = await run(ids, max_tokens, t, seed)
        choices, completion = [], 0
        for i, (p_ids, (toks, _res)) in enumerate(zip(ids, results)):
            text, reason = engine.finish(p_ids, toks, max_tokens, stop)
            completion += engine.used_tokens(toks, text, stop)
            choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": None})
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion",
                             "created": int(time.time()), "model": engine.name, "choices": choices,
                             "usage": usage(sum(len(x) for x in ids), completion)})

    async def chat(request):
        try:
            body = await body_of(request)
            messages = body.get("messages")
            if not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                    and isinstance(m.get("content"), str) for m in messages)):
                raise _BadRequest("'messages' must be a non-empty list of {role: system|user|assistant, content: string}",
                                  "messages")
            max_tokens, t, seed, stop = _sampling(body)
            try:
                ids = await asyncio.to_thread(engine.encode_chat,
                                              [{"role": m["role"], "content": m["content"]} for m in messages])
                engine.check_length(ids, max_tokens)
            except InputError as e:
                raise _BadRequest(str(e), "messages") from None
        except _BadRequest as e:
            return error(str(e), e.param)
        ((toks, _res),) = await run([ids], max_tokens, t, seed)
        text, reason = engine.finish(ids, toks, max_tokens, stop)
        return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
                             "created": int(time.time()), "model": engine.name,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "finish_reason": reason}],
                             "usage": usage(len(ids), engine.used_tokens(toks, text, stop))})

    async def not_found(request, exc):
        return error(f"no route {request.method} {request.url.path}", status=404)

    async def not_allowed(request, exc):
        return error(f"method {request.method} not allowed on {request.url.path}", status=405)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": engine.name, "object": "model", "owned_by": "kvq"}]})

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat, methods=["POST"])],
                     exception_handlers={404: not_found, 405: not_allowed})


class Server:
    """uvicorn serving :func:`make_app` on ``host:port`` in a background thread (``port`` 0: any free port)."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise InputError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(make_app(engine), log_level="warning", lifespan="off", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "Server":
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if not self.thread.is_alive() or time.time() - t0 > timeout:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse a non-loopback address unless ``allow_remote`` (the runtime has no authentication).

    Raises:
        InputError: ``host`` is not a loopback address and ``allow_remote`` is false.
    """
    import ipaddress

    try:
        loop = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise InputError(f"--host {host!r} is not an IP address") from None
    if not loop and not allow_remote:
        raise InputError(f"--host {host} is not a loopback address; the server has no authentication "
                         "(pass --allow-remote to listen there anyway)")


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
