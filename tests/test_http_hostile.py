"""Hostile HTTP clients against the real server on loopback (issue #20, "The HTTP server").

Each test starts the server on a tiny artifact built here, sends what an attacker would,
and checks for a 4xx in OpenAI's error shape, a server that keeps serving, and no
traceback in the log. Counts and times are bounded; no test asserts a wall-clock speed.
"""

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from compressor.commands.options import QuantizeOptions
from compressor.commands.quantize import run_quantize
from compressor.runtime.server import Engine, Server

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def art(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("hostile") / "w4"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, algorithm="rtn", group_size=32,
                                 calib_samples=4, calib_seqlen=32))
    return out


@pytest.fixture
def log(caplog):
    """Every record of the server's loggers (uvicorn's, kvq's), whatever their propagation."""
    names = ("uvicorn", "uvicorn.error", "uvicorn.asgi", "kvq.serve")
    for n in names:
        logging.getLogger(n).addHandler(caplog.handler)
    yield caplog
    for n in names:
        logging.getLogger(n).removeHandler(caplog.handler)


def assert_clean(caplog, capfd=None):
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]
    assert "Traceback" not in caplog.text
    if capfd is not None:
        assert "Traceback" not in capfd.readouterr().err


@contextlib.contextmanager
def serving(art, host="127.0.0.1", generate=None, **kw):
    """Engine + server on a free port; ``generate`` wraps the runtime's generate (a test hook);
    ``kw``: Engine options (max_batch, max_queue) and Server's request_timeout."""
    from transformers import AutoTokenizer

    from compressor.runtime import Runtime

    rt = Runtime.from_artifact(art, kv="artifact")
    if generate is not None:
        rt.generate = generate(rt.generate)
    srv_kw = {k: kw.pop(k) for k in ("request_timeout",) if k in kw}
    eng = Engine(rt, AutoTokenizer.from_pretrained(str(art)), "tiny", **kw)
    srv = Server(eng, host, **srv_kw).start()
    try:
        yield eng, srv
    finally:
        srv.stop()
        eng.close()


def assert_openai_error(r, status=400, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err
    if param is not None:
        assert err["param"] == param, err


def wait_for(cond, what, limit=120.0):
    """Poll ``cond`` (a bound for a hung test, not a speed check)."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, f"gave up waiting for {what}"
        time.sleep(0.01)


def test_lone_surrogates_are_400(art, log, capfd):
    ok_pair = b'{"prompt": "a\\ud83d\\ude00b", "max_tokens": 2}'  # a valid surrogate pair (an emoji) is text
    bodies = {
        "/v1/completions": [(b'{"prompt": "a\\ud800b", "max_tokens": 4}', "prompt"),
                            (b'{"prompt": ["ok", "a\\udfffb"], "max_tokens": 4}', "prompt"),
                            (b'{"prompt": "ok", "stop": ["\\ud800"], "max_tokens": 4}', "stop"),
                            (b'{"prompt": "ok", "model": "\\ud800", "max_tokens": 4}', "model")],
        "/v1/chat/completions": [(b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 4}',
                                  "messages")],
    }
    with serving(art) as (eng, srv), httpx.Client(base_url=srv.url, timeout=120) as c:
        for path, cases in bodies.items():
            for body, param in cases:
                r = c.post(path, content=body, headers={"content-type": "application/json"})
                assert_openai_error(r, 400, param)
                assert "surrogate" in r.json()["error"]["message"] or param == "model"
        assert c.post("/v1/completions", content=ok_pair).status_code == 200
    assert_clean(log, capfd)


def test_deep_json_is_400(art, log, capfd):
    deep = 5000
    bodies = [b"[" * deep + b"]" * deep,
              b'{"prompt": ' + b"[" * deep + b"]" * deep + b"}",
              b'{"a": ' * deep + b"1" + b"}" * deep,
              b'{"prompt": "x", "extra": ' + b'{"a": ' * deep + b"1" + b"}" * deep + b"}"]
    with serving(art) as (eng, srv), httpx.Client(base_url=srv.url, timeout=120) as c:
        for body in bodies:
            for path in ("/v1/completions", "/v1/chat/completions"):
                assert_openai_error(c.post(path, content=body), 400)
        shallow = b'{"prompt": "x", "max_tokens": 2, "extra": ' + b"[" * 200 + b"]" * 200 + b"}"  # ignored field
        assert c.post("/v1/completions", content=shallow).status_code == 200
        assert c.get("/health").status_code == 200
    assert_clean(log, capfd)


def test_tiny_temperature_is_not_a_500(art, log, capfd):
    """``logits / 5e-324`` overflows; such temperatures are greedy or raised to 0.01 (as vLLM)."""
    with serving(art) as (eng, srv), httpx.Client(base_url=srv.url, timeout=120) as c:
        for t in (5e-324, 1e-6, 1e-4, 0.005):
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": t, "seed": 1})
            assert r.status_code == 200, (t, r.text)
    assert_clean(log, capfd)


def _send_raw(port, body: bytes, path="/v1/completions", family=socket.AF_INET, host="127.0.0.1"):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.connect((host, port))
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def test_disconnected_client_is_cancelled(art, log, capfd):
    steps = []  # decode-step checks made by each generate call

    def hold(real):
        """The first batch waits at its first decode step until its client has left (a test
        hook through generate's ``cancelled``; no timing involved)."""
        def generate(*args, cancelled, **kw):
            n = [0]
            steps.append(n)

            def check():
                n[0] += 1
                if len(steps) == 1:
                    wait_for(lambda: any(cancelled()), "the engine to see the client leave")
                return cancelled()

            return real(*args, cancelled=check, **kw)

        return generate

    big = json.dumps({"prompt": [f"word {i}" for i in range(64)], "max_tokens": 200}).encode()
    with serving(art, generate=hold) as (eng, srv):
        s = _send_raw(srv.port, big)
        wait_for(lambda: eng.running, "the big request to start")
        dropped = eng.running + eng.waiting
        assert (len(eng.running), len(eng.waiting)) == (8, 56)  # --max-batch 8
        s.close()  # the client leaves
        wait_for(lambda: not eng.running and not eng.waiting, "the engine to drop the request")
        assert eng.dropped == 64 and all(r.future.cancelled() for r in dropped)
        assert steps[0][0] == 1  # the running batch stopped at the next step (a full run checks 199 times)
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
        assert len(steps) == 2  # the 56 queued sequences never ran; the small request did
        assert not eng.running and not eng.waiting
    assert_clean(log, capfd)


def test_full_queue_is_429(art, log, capfd):
    gate = threading.Event()

    def gated(real):
        def generate(*args, **kw):
            assert gate.wait(120), "test gate never opened"
            return real(*args, **kw)

        return generate

    with serving(art, generate=gated, max_queue=4) as (eng, srv):
        async def go():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                first = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))
                while not eng.running:
                    await asyncio.sleep(0.01)
                queued = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": ["b", "c", "d", "e"],
                                                                               "max_tokens": 2}))
                while len(eng.waiting) < 4:
                    await asyncio.sleep(0.01)
                full = await c.post("/v1/completions", json={"prompt": "f", "max_tokens": 2})
                chat_full = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "g"}]})
                gate.set()
                done = await asyncio.gather(first, queued)
                again = await c.post("/v1/completions", json={"prompt": "f", "max_tokens": 2})
                return full, chat_full, done, again

        full, chat_full, done, again = asyncio.run(go())
    for r in (full, chat_full):
        assert_openai_error(r, 429)
        assert r.json()["error"]["code"] == "queue_full" and "queue is full" in r.json()["error"]["message"]
        assert r.headers.get("retry-after") == "1"
    assert [r.status_code for r in done] == [200, 200] and again.status_code == 200
    assert_clean(log, capfd)


def _closed_within(s: socket.socket, limit: float, trickle: bytes = b"") -> bool:
    """True when the server closes ``s`` (EOF or reset) within ``limit`` seconds; with
    ``trickle``, one more byte of it is sent every 0.2 s meanwhile (a slowloris client)."""
    s.settimeout(0.2)
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < limit:
        try:
            if i < len(trickle):
                s.send(trickle[i:i + 1])
                i += 1
            if s.recv(4096) == b"":
                return True
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def test_slow_clients_time_out(art, log, capfd):
    with serving(art, request_timeout=1.0) as (eng, srv):
        body = b'{"prompt": "hello", "max_tokens": 2}'
        partial_body = socket.create_connection(("127.0.0.1", srv.port))  # 10 of the 100 bytes announced
        partial_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n" + body[:10])
        idle = socket.create_connection(("127.0.0.1", srv.port))
        slowloris = socket.create_connection(("127.0.0.1", srv.port))
        headers = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n" + b"X-Pad: y\r\n" * 200
        with httpx.Client(base_url=srv.url, timeout=120) as c:  # served while those hang
            assert c.post("/v1/completions", content=body).status_code == 200
        for s, trickle in ((partial_body, b""), (idle, b""), (slowloris, headers)):
            assert _closed_within(s, 30.0, trickle), "the server kept a stalled connection open"
            s.close()
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            assert c.post("/v1/completions", content=body).status_code == 200
            assert c.get("/health").status_code == 200
    assert_clean(log, capfd)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")


@needs_ipv6
def test_server_listens_on_ipv6_loopback(art, log):
    with serving(art, host="::1") as (eng, srv):
        assert srv.url == f"http://[::1]:{srv.port}"
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            assert c.get("/health").status_code == 200
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200
    assert_clean(log)


@needs_ipv6
def test_kvq_serve_host_ipv6(art):
    """``kvq serve --host ::1`` (a subprocess, as a user runs it), then SIGTERM."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "compressor", "serve", str(art), "--host", "::1", "--port", "0",
                             "--device", "cpu"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        url = None
        t0 = time.monotonic()
        while url is None and time.monotonic() - t0 < 300:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"on (http://\[::1\]:\d+)", line)
            url = m and m.group(1)
        assert url, "".join(lines)
        assert "bfloat16 compute" in lines[-1], lines[-1]  # --dtype auto on a bfloat16 artifact, said at start-up
        with httpx.Client(base_url=url, timeout=120) as c:
            assert c.get("/health").json()["status"] == "ok"
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + rest
    assert proc.returncode == 143 and "Traceback" not in out, out


# -- fuzz ---------------------------------------------------------------------------------

_surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
_text = st.one_of(st.text(max_size=12), st.text(max_size=12), st.text(st.characters() | _surrogates, max_size=6))
_scalar = st.none() | st.booleans() | st.integers() | st.floats() | _text
_json = st.recursive(_scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(_text, c, max_size=4),
                     max_leaves=12)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": _text},
                                 optional={"name": _text})
_sampling = {"model": st.just("tiny"), "max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2),
             "seed": st.integers(0, 2**31 - 1), "stop": _text | st.lists(_text, max_size=4), "stream": st.just(False),
             "n": st.just(1), "user": _json}
_valid = {"/v1/completions": st.fixed_dictionaries({"prompt": _text | st.lists(_text, min_size=1, max_size=3)},
                                                    optional=_sampling),
          "/v1/chat/completions": st.fixed_dictionaries({"messages": st.lists(_message, min_size=1, max_size=3)},
                                                         optional=_sampling)}
_fields = ["model", "prompt", "messages", "max_tokens", "temperature", "seed", "stop", "stream", "n"]


@st.composite
def _request(draw, path):
    """A body for ``path``: a well-formed request, the same with one field replaced by any
    JSON value (or one message's field), any JSON value, or random bytes."""
    kind = draw(st.sampled_from(["valid", "mutated", "mutated", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "json":
        return json.dumps(draw(_json)).encode()
    body = draw(_valid[path])
    if kind == "mutated":
        key = draw(st.sampled_from(_fields + ["message"]))
        if key == "message" and "messages" in body:
            body["messages"][0][draw(st.sampled_from(["role", "content"]))] = draw(_json)
        else:
            body[key] = draw(_json)
    return json.dumps(body).encode()  # json.dumps writes NaN/Infinity and \udXXX escapes as they come


@pytest.fixture(scope="module")
def fuzz_server(art):
    def short(real):  # at most 2 generated tokens per request: the parser is under test, not the model
        def generate(*args, max_new_tokens=32, **kw):
            return real(*args, max_new_tokens=min(max_new_tokens, 2), **kw)

        return generate

    with serving(art, generate=short) as (eng, srv), httpx.Client(base_url=srv.url, timeout=120) as client:
        yield client


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_request_parser(fuzz_server, log, data):
    path = data.draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), label="path")
    body = data.draw(_request(path), label="body")
    r = fuzz_server.post(path, content=body, headers={"content-type": "application/json"})
    event(f"status {r.status_code}")
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)
    else:
        assert r.json()["choices"]
    assert_clean(log)
