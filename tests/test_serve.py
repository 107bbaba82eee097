"""kvq serve-smoke and the HTTP server (issue #6), on tiny random models."""

import asyncio
import json
import shutil

import httpx
import pytest

from compressor.runtime.server import Engine, Server, check_host
from compressor.errors import InputError
from conftest import kvq_run as run
from conftest import quantize_tiny

FAST = ["--max-new-tokens", "6"]


@pytest.fixture(scope="module")
def art(tmp_path_factory, tiny_model_dir):
    return quantize_tiny(tmp_path_factory.mktemp("srv") / "w4-fp8", tiny_model_dir, kv_scheme="fp8")


def test_serve_smoke_json_report_and_gates(art, capsys):
    code, out, err = run(["serve-smoke", art, *FAST, "--json"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["passed"] and rep["prompts"] == 8
    rt = rep["runtime"]
    assert rt["kv_scheme"].startswith("fp8") and rt["kv_bytes_per_token"] > 0 and rt["peak_rss_mib"] > 0
    assert rt["batch_1"]["decode_tokens_per_s"] > 0 and rt["batch_8"]["sequences"] == 8
    assert rt["kernels"]  # which weight kernels ran
    c = rep["comparison"]
    assert c["generated_positions"] == 8 * 6 and c["top1_agreement_pct"] >= 80
    assert c["prompt_kl"]["mean"] < 0.05
    assert {g["name"] for g in rep["gates"]} == {"serve_min_top1_pct", "serve_max_prompt_kl"}
    assert json.loads((art / "config.json").read_text())["dtype"] == "bfloat16"
    assert rt["dtype"] == "bfloat16"  # --dtype auto: the artifact's declared dtype


def test_serve_smoke_json_carries_the_busy_note(art, capsys, monkeypatch):
    """CI runs use --json: a decode figure taken on a busy machine says so in the report."""
    import os

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
        monkeypatch.setattr("compressor.commands.common.runnable_now", lambda: 9)
        code, out, err = run(["serve-smoke", art, *FAST, "--json"], capsys)
        assert code == 0, err
        rep = json.loads(out)
        assert "the machine is busy (load 9.0" in rep["busy_note"] and not any("busy" in w for w in rep["warnings"])
        monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        code, out, err = run(["serve-smoke", art, *FAST, "--json", "--threads", "1"], capsys)
        assert code == 0 and json.loads(out)["busy_note"] is None
    finally:
        torch.set_num_threads(before)


def test_serve_smoke_float32_compute(art, capsys):
    import torch

    before = torch.get_num_threads()
    code, out, err = run(["serve-smoke", art, *FAST, "--dtype", "float32", "--threads", "1", "--json"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["runtime"]["dtype"] == "float32" and rep["comparison"]["prompt_kl"]["mean"] < 0.05
    assert rep["runtime"]["threads"] == 1 and torch.get_num_threads() == before  # this run's, then restored
    code, _out, err = run(["serve-smoke", art, *FAST, "--dtype", "float8"], capsys)
    assert code == 2 and "float8" in err and "Traceback" not in err


def test_compute_dtype_rule():
    import torch

    from compressor.runtime.loader import compute_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compute_dtype({"dtype": "bfloat16"}, cpu) == torch.bfloat16
    assert compute_dtype({"torch_dtype": "bfloat16"}, cuda) == torch.bfloat16
    assert compute_dtype({"dtype": "float16"}, cpu) == torch.float32  # CPU half matmuls are slow
    assert compute_dtype({"dtype": "float16"}, cuda) == torch.float16
    assert compute_dtype({}, cpu) == torch.float32
    assert compute_dtype({"dtype": "bfloat16"}, cpu, "float32") == torch.float32
    with pytest.raises(InputError, match="unknown compute dtype"):
        compute_dtype({}, cpu, "int4")


def test_serve_smoke_disagreement_exits_1(art, tmp_path, tokenizer, capsys):
    """Against another model as reference the runtime disagrees: the gates fail and are named."""
    from conftest import make_model_dir

    other = make_model_dir(tmp_path / "other", tokenizer, seed=7)
    code, out, err = run(["serve-smoke", art, *FAST, "--json"], capsys)
    own = json.loads(out)["comparison"]
    code, out, err = run(["serve-smoke", art, *FAST, "--reference", other, "--json"], capsys)
    rep = json.loads(out)
    # random tiny models are near-uniform, so the absolute KL stays small; it is still far above its own reference's
    assert rep["comparison"]["prompt_kl"]["mean"] > 20 * own["prompt_kl"]["mean"]
    limit = 5 * own["prompt_kl"]["mean"]
    code, out, err = run(["serve-smoke", art, *FAST, "--reference", other, "--max-kl", limit, "--json"], capsys)
    rep = json.loads(out)
    assert code == 1 and not rep["passed"] and rep["failed_gates"] == ["serve_max_prompt_kl"]
    code, out, err = run(["serve-smoke", art, *FAST, "--reference", other, "--max-kl", limit], capsys)
    assert code == 1 and "FAIL" in err


def test_serve_smoke_http(art, capsys):
    code, out, err = run(["serve-smoke", art, *FAST, "--http", "--http-requests", "6", "--json"], capsys)
    assert code == 0, err
    assert "http: 6 concurrent requests to the server on http://127.0.0.1:" in err  # a step line, under --json too
    h = json.loads(out)["http"]
    assert h["ok"] == 6 and h["completions"] == 3 and 0 <= h["matched_offline"] <= 3
    assert h["health"] and h["bad_request_status"] == 400 and not h["problems"]


def test_serve_smoke_bad_inputs(art, tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text("not json\n")
    code, _, err = run(["serve-smoke", art, "--prompts", bad], capsys)
    assert code == 2 and "p.jsonl:1" in err and "Traceback" not in err
    code, _, err = run(["serve-smoke", tmp_path / "missing"], capsys)
    assert code == 2 and "not found" in err
    tampered = shutil.copytree(art, tmp_path / "t")
    with open(tampered / "model.safetensors", "r+b") as f:
        f.seek(-3, 2)
        f.write(b"\x00\x01\x02")
    code, out, err = run(["serve-smoke", tampered, *FAST, "--json"], capsys)
    assert code == 1 and json.loads(out)["failed_gates"] == ["digests"]


def test_check_host_refuses_remote_without_flag():
    check_host("127.0.0.1", False)
    check_host("::1", False)
    with pytest.raises(InputError, match="not a loopback"):
        check_host("0.0.0.0", False)
    check_host("0.0.0.0", True)
    with pytest.raises(InputError, match="not an IP"):
        check_host("example.com", False)


def test_serve_command_refuses_remote_host(art, capsys):
    code, _, err = run(["serve", art, "--host", "0.0.0.0"], capsys)
    assert code == 2 and "loopback" in err


def test_http_api_contract_and_batching(art):
    from transformers import AutoTokenizer

    from compressor.runtime import Runtime

    rt = Runtime.from_artifact(art, kv="artifact")
    eng = Engine(rt, AutoTokenizer.from_pretrained(str(art)), "tiny")
    srv = Server(eng).start()
    try:
        async def go():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                h = await c.get("/health")
                one = await c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 4})
                many = await c.post("/v1/completions", json={"prompt": ["a b", "c d e"], "max_tokens": 3,
                                                             "stop": ["zzz"]})
                chat = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 3, "temperature": 0})
                parts = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
                    {"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}], "max_tokens": 3, "temperature": 0})
                conc = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": f"x {i}", "max_tokens": 5})
                                              for i in range(6)))
                bads = [await c.post("/v1/completions", content=b"{nope"),
                        await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}),
                        await c.post("/v1/completions", json={"prompt": "x", "temperature": -1}),
                        await c.post("/v1/completions", json={"prompt": "x", "model": "other"}),
                        await c.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}),
                        await c.post("/v1/completions", json=[1, 2]),
                        await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
                            {"type": "image_url", "image_url": {"url": "x"}}]}]})]
                missing = await c.get("/v1/models/none")
                return h, one, many, chat, parts, conc, bads, missing

        h, one, many, chat, parts, conc, bads, missing = asyncio.run(go())
    finally:
        srv.stop()
        eng.close()
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["model"] == "tiny"
    b = one.json()
    assert one.status_code == 200 and b["object"] == "text_completion" and b["usage"]["completion_tokens"] <= 4
    assert b["choices"][0]["finish_reason"] in ("stop", "length")
    assert [ch["index"] for ch in many.json()["choices"]] == [0, 1]
    cb = chat.json()
    assert chat.status_code == 200 and cb["object"] == "chat.completion" and cb["choices"][0]["message"]["role"] == "assistant"
    assert parts.status_code == 200 and parts.json()["choices"][0]["message"] == cb["choices"][0]["message"]  # text parts joined
    assert all(r.status_code == 200 for r in conc)
    assert max(eng.batches) > 1, eng.batches  # concurrent requests were batched together
    for r in bads:
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert missing.status_code == 404
    assert not srv.thread.is_alive()  # stopped cleanly


def test_http_greedy_is_deterministic_and_equals_offline(art):
    from transformers import AutoTokenizer

    from compressor.runtime import Runtime

    rt = Runtime.from_artifact(art, kv="artifact")
    tok = AutoTokenizer.from_pretrained(str(art))
    eng = Engine(rt, tok, "tiny")
    ids = eng.encode("the quick brown fox")
    offline = rt.generate([ids], max_new_tokens=5, eos_token_id=tok.eos_token_id).tokens[0]
    srv = Server(eng).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            texts = [c.post("/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 5}).json()
                     ["choices"][0]["text"] for _ in range(2)]
    finally:
        srv.stop()
        eng.close()
    assert texts[0] == texts[1] == eng.finish(ids, offline, 5, [])[0]


def test_http_limits_sampling_and_openai_fields(art):
    from transformers import AutoTokenizer

    from compressor.runtime import Runtime
    from compressor.runtime.server import MAX_BODY_BYTES

    rt = Runtime.from_artifact(art, kv="artifact")
    eng = Engine(rt, AutoTokenizer.from_pretrained(str(art)), "tiny")
    srv = Server(eng).start()
    limit = rt.decoder.spec.max_position_embeddings
    try:
        async def go():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                big = await c.post("/v1/completions", content=b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 10) + b'"}')
                long = await c.post("/v1/completions", json={"prompt": "a b " * limit, "max_tokens": 4})
                stream = await c.post("/v1/completions", json={"prompt": "x", "stream": True})
                n3 = await c.post("/v1/completions", json={"prompt": "x", "n": 3})
                wrong_method = await c.get("/v1/completions")
                models = await c.get("/v1/models")
                req = {"prompt": "hello", "temperature": 1.0, "seed": 3, "max_tokens": 6}
                alone = await c.post("/v1/completions", json=req)
                together = await asyncio.gather(*(c.post("/v1/completions", json=req) for _ in range(4)))
                health = await c.get("/health")
                return big, long, stream, n3, wrong_method, models, alone, together, health

        big, long, stream, n3, wrong_method, models, alone, together, health = asyncio.run(go())
    finally:
        srv.stop()
        eng.close()
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error", big.text
    for r in (long, stream, n3):
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "context length" in long.json()["error"]["message"]
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert models.json()["data"][0]["id"] == "tiny"
    texts = {r.json()["choices"][0]["text"] for r in together}
    assert texts == {alone.json()["choices"][0]["text"]}  # a seed reproduces its text whatever else arrives
    assert health.status_code == 200


def test_serve_smoke_context_length_is_checked(art, tmp_path, capsys):
    long = tmp_path / "long.txt"
    long.write_text("a b " * 400 + "\n")
    code, _, err = run(["serve-smoke", art, "--prompts", long, "--max-new-tokens", "4"], capsys)
    assert code == 2 and "context length" in err and "Traceback" not in err
