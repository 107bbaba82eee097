"""``kvq serve``: the bundled runtime behind an OpenAI-compatible HTTP API.

HTTP (Starlette app, served by uvicorn's h11 protocol, checked with an httpx client):

* ``GET /health`` -> ``{"status": "ok", "model": NAME, ...}``; ``GET /v1/models``
* ``POST /v1/completions`` (OpenAI Completions: ``prompt`` string or list of strings,
  ``max_tokens``, ``temperature`` (0 = greedy), ``seed``, ``stop``)
* ``POST /v1/chat/completions`` (OpenAI Chat Completions: ``messages``, rendered with the
  tokenizer's chat template)

Request bodies are validated by the pydantic models :class:`CompletionRequest` and
:class:`ChatCompletionRequest`. Every refused request gets OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``): 400 for a malformed one (bad JSON,
nesting deeper than the JSON parser allows, a field out of bounds, text with a lone
surrogate), 404/405 for a bad route, 429 when the queue is full.

Concurrent requests are batched: one worker thread (:class:`Engine`) takes what is
waiting, groups up to ``max_batch`` greedy requests into one
:meth:`~compressor.runtime.Runtime.generate` call (prefill and decode together; a sampled
request runs alone so its ``seed`` reproduces its text), and answers each with its own
tokens. At most ``max_queue`` sequences wait; a request that does not fit is refused with
429. A client that disconnects has its sequences dropped: taken out of the queue, or
stopped at the next decode step. A connection whose request (headers and body) has not
fully arrived ``request_timeout`` seconds after it opened (or after its previous response)
is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError,
                      field_validator)
from pydantic_core import PydanticCustomError

from ..errors import InputError
from .engine import CHAT_FALLBACK_NOTE, MAX_QUEUE, Engine, QueueFull

MAX_TOKENS_LIMIT = 4096
MAX_BODY_BYTES = 4 << 20  # 4 MiB of JSON per request
MAX_PROMPTS = 64  # prompts in one completions request
REQUEST_TIMEOUT_S = 30.0  # for a request's headers and body to arrive
_log = logging.getLogger("kvq.serve")


# ---------------------------------------------------------------------------------------
# request models

def _utf8(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("invalid_unicode", "text with a lone surrogate") from None
    return s


Text = Annotated[StrictStr, AfterValidator(_utf8)]  # a JSON string that is valid Unicode (no lone surrogate)


class _Sampling(BaseModel):
    """Fields shared by both endpoints; unknown fields are ignored (as OpenAI clients send many)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, validate_default=True)

    model: Optional[Text] = None
    max_tokens: Optional[Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)]] = None
    temperature: Optional[Annotated[float, Field(strict=True, ge=0.0, le=10.0)]] = None
    seed: Optional[Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]] = None
    stop: Union[Text, list[Text], None] = None
    stream: Any = None
    n: Any = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v):
        return 16 if v is None else v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        """As vLLM does: below 1e-5 greedy, below 0.01 raised to 0.01 (``logits / t`` would
        overflow to inf and the sampling probabilities to NaN)."""
        if v is None or v < 1e-5:
            return 0.0
        return max(float(v), 0.01)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stop = [] if not v else [v] if isinstance(v, str) else v
        if len(stop) > 4 or not all(stop):
            raise ValueError("up to 4 non-empty strings")
        return stop

    @field_validator("stream")
    @classmethod
    def _stream(cls, v):
        if v:
            raise ValueError("streaming is not supported")
        return False

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v not in (1, None):
            raise ValueError("n must be 1")
        return 1


class CompletionRequest(_Sampling):
    """Body of ``POST /v1/completions``: ``prompt`` (a string or 1 to 64 strings) plus sampling."""

    prompt: Union[Text, Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]]


class ChatMessage(BaseModel):
    """One chat message (``name`` and other extra fields are ignored)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: Text

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v):
        """OpenAI's list-of-parts form: ``[{"type": "text", "text": ...}, ...]``, joined (text parts only)."""
        if isinstance(v, list) and v and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in v):
            return "".join(p["text"] for p in v)
        return v


class ChatCompletionRequest(_Sampling):
    """Body of ``POST /v1/chat/completions``: a non-empty list of ``messages`` plus sampling."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]


_MESSAGES = {  # field -> the error text a client sees (one per field, whatever pydantic found)
    "model": "'model' must be a string naming the served model",
    "prompt": f"'prompt' must be a string or a list of 1 to {MAX_PROMPTS} strings",
    "messages": "'messages' must be a non-empty list of {role: system|user|assistant, content: string or list of "
                "text parts}",
    "max_tokens": f"'max_tokens' must be an integer in [1, {MAX_TOKENS_LIMIT}]",
    "temperature": "'temperature' must be a number in [0, 10] (0 = greedy)",
    "seed": f"'seed' must be an integer in [0, {2**31 - 1}]",
    "stop": "'stop' must be a non-empty string or a list of up to 4 non-empty strings",
    "stream": "streaming is not supported by this server; send \"stream\": false",
    "n": "'n' must be 1 (one choice per prompt)",
}
_ORDER = list(_MESSAGES)


class _BadRequest(Exception):
    """A refused request: its HTTP status and the fields of OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code


def parse_request(model: type[_Sampling], body: Any) -> _Sampling:
    """Validate a decoded JSON body against ``model``.

    Raises:
        _BadRequest: not an object, or the first field at fault (in :data:`_MESSAGES`
            order) with its fixed message; a lone surrogate is named as such.
    """
    if not isinstance(body, dict):
        raise _BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_context=False, include_input=False)

    def rank(err):
        loc = err["loc"][0] if err["loc"] else None
        return (_ORDER.index(loc) if loc in _ORDER else len(_ORDER), err["type"] != "invalid_unicode")

    err = min(errors, key=rank)
    param = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "invalid_unicode":
        raise _BadRequest(f"'{param}' is not valid Unicode text (it holds a lone surrogate such as \\ud800)", param)
    raise _BadRequest(_MESSAGES.get(param, f"{param}: {err['msg']}"), param)


# ---------------------------------------------------------------------------------------
# HTTP

class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _error(e: _BadRequest):
    """OpenAI's error shape; ASCII JSON so that no text a client sent can break the encoding."""
    from starlette.responses import Response

    body = {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": e.code}}
    headers = {"retry-after": "1"} if e.status == 429 else None
    return Response(json.dumps(body), status_code=e.status, media_type="application/json", headers=headers)


async def _read_json(request) -> Any:
    """The decoded JSON body (at most :data:`MAX_BODY_BYTES`).

    Raises:
        _BadRequest: too large, not JSON, nested deeper than the parser allows.
        _ClientGone: the connection closed before the body arrived (or timed out).
    """
    from starlette.requests import ClientDisconnect

    size = request.headers.get("content-length")
    if size is not None and size.isascii() and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise _BadRequest(f"request body of {int(size)} bytes exceeds the limit of {MAX_BODY_BYTES}", status=413)
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise _BadRequest(f"request body exceeds the limit of {MAX_BODY_BYTES} bytes", status=413)
    except ClientDisconnect:
        raise _ClientGone() from None
    try:
        return json.loads(raw)
    except RecursionError:
        raise _BadRequest("the request body is nested too deeply") from None
    except ValueError:  # bad JSON, not UTF-8, an integer longer than Python converts
        raise _BadRequest("the request body is not valid JSON") from None


async def _disconnected(request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Api:
    """The route handlers of :func:`make_app` over one :class:`Engine`."""

    def __init__(self, engine: Engine):
        self.engine = engine

    async def parse(self, request, model: type[_Sampling]) -> _Sampling:
        req = parse_request(model, await _read_json(request))
        if req.model is not None and req.model != self.engine.name:
            raise _BadRequest(f"model '{req.model}' is not served here (this server serves '{self.engine.name}')",
                              "model")
        return req

    async def encode(self, fn: Callable[[], Any], param: str):
        """Run the tokenizer off the event loop; what it refuses is the client's error."""
        try:
            return await asyncio.to_thread(fn)
        except InputError as e:
            raise _BadRequest(str(e), param) from None
        except Exception as e:  # noqa: BLE001 - e.g. a chat template that raises on the messages given
            raise _BadRequest(f"the tokenizer refused the {param}: {type(e).__name__}: {e}", param) from None

    async def generate(self, request, ids: list[list[int]], req: _Sampling, param: str) -> list:
        """Queue every prompt, wait for all; drop them all if the client leaves first.

        Raises:
            _BadRequest: context length exceeded or a token id beyond the embedding (400), queue
                full (429), engine failure (5xx).
            _ClientGone: the client disconnected (its sequences were cancelled).
        """
        vocab = self.engine.runtime.vocab_size
        for x in ids:
            try:
                self.engine.check_length(x, req.max_tokens)
            except InputError as e:
                raise _BadRequest(str(e), param) from None
            beyond = next((i for i in x if not 0 <= i < vocab), None)
            if beyond is not None:  # the model's own vocabulary is the request's business, never a 500
                raise _BadRequest(f"the {param} encodes to token id {beyond}, beyond the model's {vocab} embedding "
                                  "rows", param)
        try:
            futs = self.engine.submit_many(ids, req.max_tokens, req.temperature, req.seed)
        except QueueFull as e:
            raise _BadRequest(str(e), status=429, kind="rate_limit_error", code="queue_full") from None
        except RuntimeError as e:
            raise _BadRequest(str(e), status=503, kind="server_error") from None
        work = asyncio.gather(*(asyncio.wrap_future(f) for f in futs))
        work.add_done_callback(lambda w: w.cancelled() or w.exception())  # retrieved, also when dropped
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():  # the client left (or this handler was cancelled): drop its sequences
                work.cancel()
                for f in reversed(futs):  # the queued ones first: the engine must not start them once the running batch stops
                    f.cancel()
        if work.cancelled() or not work.done():
            raise _ClientGone()
        e = work.exception()
        if isinstance(e, InputError):  # the runtime refused the request itself
            raise _BadRequest(str(e), param)
        if e is not None:
            _log.error("generation failed: %s: %s", type(e).__name__, e)
            raise _BadRequest(f"generation failed: {type(e).__name__}: {e}", status=500, kind="server_error")
        return work.result()

    async def completions(self, request):
        from starlette.responses import JSONResponse, Response

        try:
            req = await self.parse(request, CompletionRequest)
            prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
            ids = await self.encode(lambda: [self.engine.encode(p) for p in prompts], "prompt")
            results = await self.generate(request, ids, req, "prompt")
        except _BadRequest as e:
            return _error(e)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        eng, choices, completion = self.engine, [], 0
        for i, (p_ids, (toks, _res)) in enumerate(zip(ids, results)):
            text, reason = eng.finish(p_ids, toks, req.max_tokens, req.stop)
            completion += eng.used_tokens(toks, text, req.stop)
            choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": None})
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion",
                             "created": int(time.time()), "model": eng.name, "choices": choices,
                             "usage": _usage(sum(len(x) for x in ids), completion)})

    async def chat(self, request):
        from starlette.responses import JSONResponse, Response

        try:
            req = await self.parse(request, ChatCompletionRequest)
            messages = [{"role": m.role, "content": m.content} for m in req.messages]
            ids = await self.encode(lambda: self.engine.encode_chat(messages), "messages")
            ((toks, _res),) = await self.generate(request, [ids], req, "messages")
        except _BadRequest as e:
            return _error(e)
        except _ClientGone:
            return Response(status_code=499)
        eng = self.engine
        text, reason = eng.finish(ids, toks, req.max_tokens, req.stop)
        return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
                             "created": int(time.time()), "model": eng.name,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "finish_reason": reason}],
                             "usage": _usage(len(ids), eng.used_tokens(toks, text, req.stop))})

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok", "model": self.engine.name, **self.engine.runtime.describe()})

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [{"id": self.engine.name, "object": "model", "owned_by": "kvq"}]})

    async def not_found(self, request, exc):
        return _error(_BadRequest(f"no route {request.method} {request.url.path}", status=404))

    async def not_allowed(self, request, exc):
        return _error(_BadRequest(f"method {request.method} not allowed on {request.url.path}", status=405))


def make_app(engine: Engine):
    """The Starlette application (routes: ``/health``, ``/v1/models``, ``/v1/completions``,
    ``/v1/chat/completions``) serving ``engine``."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    api = _Api(engine)
    return Starlette(routes=[Route("/health", api.health), Route("/v1/models", api.models),
                             Route("/v1/completions", api.completions, methods=["POST"]),
                             Route("/v1/chat/completions", api.chat, methods=["POST"])],
                     exception_handlers={404: api.not_found, 405: api.not_allowed})


# ---------------------------------------------------------------------------------------
# transport

def _deadline_protocol(timeout: float):
    """uvicorn's h11 protocol plus a deadline: a connection whose request (headers and body)
    has not fully arrived ``timeout`` seconds after the connection opened, or after its
    previous response, is closed (uvicorn alone waits forever for a slow client)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    arrived = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)

    class DeadlineH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state in arrived:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state not in arrived:
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return DeadlineH11Protocol


class Server:
    """uvicorn serving :func:`make_app` on ``host:port`` in a background thread.

    Args:
        engine: what the app serves.
        host: an IPv4 or IPv6 address (``::1`` binds an IPv6 socket) or ``localhost``.
        port: TCP port; 0 picks a free one (read it from :attr:`port` / :attr:`url`).
        request_timeout: seconds for a request's headers and body to arrive.
        log_config: uvicorn's logging configuration; None leaves the process's logging
            as it is (uvicorn's records propagate to the root logger).

    Raises:
        InputError: the address cannot be bound.
    """

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, *,
                 request_timeout: float = REQUEST_TIMEOUT_S, log_config: dict | None = None):
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            raise InputError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise InputError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(make_app(engine), log_level="warning", lifespan="off", access_log=False,
                                http=_deadline_protocol(request_timeout), log_config=log_config)
        self.server = uvicorn.Server(config)
        self.finished = threading.Event()  # set when uvicorn has returned
        self.thread = threading.Thread(target=self._serve, name="kvq-http", daemon=True)

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.finished.set()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "Server":
        """Start serving; return once uvicorn listens.

        Raises:
            RuntimeError: uvicorn did not start within ``timeout`` seconds.
        """
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if self.finished.is_set() or time.time() - t0 > timeout:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Ask uvicorn to exit, wait for it (15 s at most), close the socket."""
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
# kvq serve

@dataclass
class ServeOptions:
    """Options of ``kvq serve`` (see its ``--help``); ``device`` is ``cpu`` or ``cuda[:i]``;
    ``keys`` (:class:`~compressor.signing.VerifyKeys`) check ``model.sig`` first;
    ``no_manifest`` serves another tool's artifact unchecked."""

    artifact: Path
    host: str = "127.0.0.1"
    port: int = 8000
    allow_remote: bool = False
    backend: str = "auto"
    device: str = "cpu"
    max_batch: int = 8
    max_queue: int = MAX_QUEUE
    request_timeout: float = REQUEST_TIMEOUT_S
    keys: Any = None
    no_manifest: bool = False
    dtype: str = "auto"  # compute dtype (compressor.runtime.loader.compute_dtype)


def run_server(opts: ServeOptions, announce: Callable[[str], None] = print) -> None:
    """``kvq serve``: check the host, load the artifact through one checked read (the
    signature first when ``opts.keys`` are given; every tensor hashed from the bytes
    served and compared with the manifest, :func:`~compressor.runtime.generate.load_checked`), serve until the server
    thread ends or Ctrl-C (KeyboardInterrupt propagates after the server and engine
    stopped). ``announce`` receives the lines saying what was checked and the one
    naming the URL.

    Raises:
        InputError: a non-loopback host without ``allow_remote``, no artifact folder, an
            address that cannot be bound, an artifact the runtime cannot serve.
        CheckFailed: a signature or digest check failed (the tensor or file is named);
            the port is never opened.
    """
    check_host(opts.host, opts.allow_remote)
    from uvicorn.config import LOGGING_CONFIG

    from .generate import load_checked

    artifact = Path(opts.artifact)
    rt, tok, _sig, _manifest = load_checked(artifact, opts, lambda line: announce(f"kvq: {line}"))
    eng = Engine(rt, tok, artifact.name, opts.max_batch, opts.max_queue)
    announce(f"kvq: prompts: {eng.bos_rule['rule']}")
    if not eng.chat_template:
        announce(f"kvq: warning: {CHAT_FALLBACK_NOTE}")
    try:
        srv = Server(eng, opts.host, opts.port, request_timeout=opts.request_timeout,
                     log_config=LOGGING_CONFIG).start()
    except BaseException:
        eng.close()
        raise
    d = rt.describe()
    announce(f"kvq: serving {artifact.name} on {srv.url} ({d['dtype']} compute, KV {d['kv_scheme']}; Ctrl-C to stop)")
    try:  # not Thread.join: a KeyboardInterrupt inside it can mark the thread stopped while it runs (CPython 3.11)
        while not srv.finished.wait(0.5):
            pass
    finally:
        srv.stop()
        eng.close()
