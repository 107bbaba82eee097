"""``kvq serve``: the bundled runtime behind an OpenAI-compatible HTTP API (the release smoke
test that compares it with the original model is :mod:`compressor.commands.serve_smoke`).

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
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

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
# serve-smoke moved to compressor.commands.serve_smoke; these names stay importable from here

from .commands.options import SmokeOptions  # noqa: E402,F401
from .commands.serve_smoke import run_serve_smoke  # noqa: E402,F401
