"""Integrity at load (issue #16): ``kvq serve`` and ``kvq serve-smoke`` check what they load as they load it.

Each tensor's digest is computed from the bytes the runtime builds it from, in one read;
a change names the tensor or file and exits 1 before any port opens; model.sig is checked
first with key material; a file changed in the middle of a load (the loader's test hook
``compressor.load_integrity.AFTER_READ``) is either not what is served or refused.
"""

import json
import os
import shutil
import threading

import pytest
import torch

from compressor import load_integrity
from compressor.artifact import check_hashes
from compressor.manifest import MANIFEST_NAME, load_manifest
from compressor.safetensors_io import read_header
from conftest import assert_clean_error, copy_folder, keypair, quantize_tiny
from conftest import kvq_run as run

FAST = ["--max-new-tokens", "4"]
PROMPT = [[5, 17, 42, 9, 120, 3]]
LAST_READ = "model.norm.weight"  # the final norm: read after every decoder layer


@pytest.fixture(scope="module")
def art(tmp_path_factory, tiny_model_dir):
    return quantize_tiny(tmp_path_factory.mktemp("si") / "w4-fp8", tiny_model_dir, kv_scheme="fp8")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    return {"a": keypair(d, "a"), "b": keypair(d, "b")}


@pytest.fixture(scope="module")
def signed(art, keys, tmp_path_factory):
    from compressor.commands.sign import run_sign
    from compressor.signing import SignOptions

    out = shutil.copytree(art, tmp_path_factory.mktemp("signed") / "w4")
    run_sign(out, SignOptions(private_key=keys["a"][0]))
    return out


@pytest.fixture(scope="module")
def clean_logits(art):
    from compressor.runtime import Runtime

    return Runtime.from_artifact(art).logits(PROMPT)


class FakeServer:
    """Stands in for the HTTP server: records that a port would have opened, returns at once."""

    started: list = []

    def __init__(self, engine, host="127.0.0.1", port=0, **kw):
        self.engine, self.url = engine, f"http://{host}:{port}"
        self.finished = threading.Event()
        self.finished.set()

    def start(self, timeout=30.0):
        FakeServer.started.append(self)
        return self

    def stop(self):
        pass


@pytest.fixture
def fake_server(monkeypatch):
    """``kvq serve`` and ``serve-smoke --http`` build this instead of the server; ``.started`` lists the starts."""
    import compressor.runtime.server as server

    FakeServer.started = []
    monkeypatch.setattr(server, "Server", FakeServer)
    return FakeServer


@pytest.fixture
def hook(monkeypatch):
    """Install ``AFTER_READ``; returns the list of ``(file, tensor)`` pieces read."""
    seen = []

    def install(action=None):
        def after_read(file, tensor):
            seen.append((file, tensor))
            if action is not None:
                action(file, tensor)
        monkeypatch.setattr(load_integrity, "AFTER_READ", after_read)
        return seen

    return install


def _flip_tensor(folder, name, value=None):
    """Change tensor ``name``'s stored bytes in place (same inode): xor its first byte, or fill it with ``value``."""
    e = read_header(folder / "model.safetensors")[name]
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek(e.start)
        if value is None:
            b = f.read(1)
            f.seek(e.start)
            f.write(bytes([b[0] ^ 0x40]))
        else:
            f.write(value * ((e.end - e.start) // len(value)))


def _change(kind, folder):
    """Apply one kind of change to the artifact ``folder``; the name the refusal must carry."""
    if kind == "tensor":
        name = "model.layers.1.self_attn.o_proj.weight_packed"
        _flip_tensor(folder, name)
        return f"modified tensor {name}"
    if kind == "header":  # the safetensors header edited: one tensor's dtype relabelled, its bytes untouched
        name = "model.norm.weight"
        path = folder / "model.safetensors"
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        hdr = json.loads(raw[8:8 + n])
        hdr[name]["dtype"] = {"F32": "I32", "F16": "BF16", "BF16": "F16"}[hdr[name]["dtype"]]
        new = json.dumps(hdr).encode()
        new += b" " * (-len(new) % 8)
        path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])
        return f"modified tensor {name}"
    if kind == "config":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["rms_norm_eps"] = 1e-3
        (folder / "config.json").write_text(json.dumps(cfg))
        return "modified file config.json"
    (folder / "extra.txt").write_text("not listed")
    return "extra file extra.txt"


def _serve_cmd(command, folder, *extra, http=True):
    if command == "serve":
        return ["serve", folder, "--port", "0", *extra]
    return ["serve-smoke", folder, *FAST, *(["--http"] if http else []), *extra]  # --http: the smoke would open a port


# --- refusals, naming what changed, before any port opens ----------------------------------

@pytest.mark.parametrize("command", ["serve", "serve-smoke"])
@pytest.mark.parametrize("kind", ["tensor", "header", "config", "extra"])
def test_a_change_is_refused_by_name_before_the_port_opens(art, tmp_path, command, kind, fake_server, capsys):
    bad = copy_folder(art, tmp_path / "a")
    named = _change(kind, bad)
    code, out, err = run(_serve_cmd(command, bad), capsys)
    if command == "serve":
        assert_clean_error(code, err, 1, named)  # one line: ... does not match its manifest: modified tensor NAME
    else:
        label, name = named.rsplit(" ", 1)
        assert code == 1 and f"{label}: {name}" in err and "digests FAILED" in err and "Traceback" not in err, err
    assert fake_server.started == []


def test_serve_smoke_json_names_every_difference(art, tmp_path, fake_server, capsys):
    bad = copy_folder(art, tmp_path / "a")
    _change("tensor", bad)
    _change("extra", bad)
    code, out, _err = run(["serve-smoke", bad, *FAST, "--json"], capsys)
    rep = json.loads(out)
    assert code == 1 and rep["failed_gates"] == ["digests"] and rep["hashes_ok"] is False
    assert rep["hashes"]["modified_tensors"] == ["model.layers.1.self_attn.o_proj.weight_packed"]
    assert rep["hashes"]["extra_files"] == ["extra.txt"]
    assert rep["hashes"] == {**check_hashes(bad), "seconds": rep["hashes"]["seconds"],
                             "mb_per_s": rep["hashes"]["mb_per_s"]}  # the report kvq verify gives


@pytest.mark.parametrize("command", ["serve", "serve-smoke"])
def test_a_tensor_overwritten_during_the_load_is_refused(art, tmp_path, command, hook, fake_server, capsys):
    """The hook overwrites (same inode) a tensor not yet read, once the first tensor is read."""
    bad = copy_folder(art, tmp_path / "a")

    def overwrite(file, tensor):
        if tensor is not None and tensor != LAST_READ and not overwrite.done:
            overwrite.done = True
            _flip_tensor(bad, LAST_READ)
    overwrite.done = False
    seen = hook(overwrite)
    code, out, err = run(_serve_cmd(command, bad), capsys)
    assert overwrite.done and seen.index(("model.safetensors", LAST_READ)) > 1
    assert code == 1 and (f"modified tensor {LAST_READ}" in err or f"modified tensor: {LAST_READ}" in err), err
    assert fake_server.started == []


# --- a file replaced during the load has no effect on what is served -----------------------

def _replace_by_rename(folder, name, edit):
    """Write an edited copy of ``folder/name`` beside it and rename it over the original (a new inode)."""
    tmp = folder / f".{name}.new"
    shutil.copyfile(folder / name, tmp)
    edit(tmp)
    os.replace(tmp, folder / name)


def _boost_norm(path):
    e = read_header(path)[LAST_READ]
    with open(path, "r+b") as f:
        f.seek(e.start)
        f.write(b"\x00\x40" * ((e.end - e.start) // 2))  # bf16 2.0 everywhere


def _one_layer(path):
    cfg = json.loads(path.read_text())
    cfg["num_hidden_layers"] = 1
    path.write_text(json.dumps(cfg))


SWAPS = {"model.safetensors": _boost_norm, "config.json": _one_layer}


@pytest.mark.parametrize("swapped", list(SWAPS))
def test_serve_a_file_replaced_after_it_was_read_is_not_what_is_served(art, tmp_path, swapped, hook, fake_server,
                                                                         clean_logits, capsys):
    folder = copy_folder(art, tmp_path / "a")

    def swap(file, tensor):
        if file == swapped and not swap.done:
            swap.done = True
            _replace_by_rename(folder, swapped, SWAPS[swapped])
    swap.done = False
    hook(swap)
    code, _out, err = run(["serve", folder, "--port", "0"], capsys)
    assert code == 0 and swap.done and "hashes ok, checked as loaded" in err, err
    assert not check_hashes(folder)["ok"]  # the folder on disk now differs from the manifest
    rt = fake_server.started[0].engine.runtime
    assert rt.decoder.spec.n_layers == 2
    assert torch.equal(rt.logits(PROMPT), clean_logits)  # what was read and checked is what is served
    from compressor.runtime import Runtime

    swapped_rt = Runtime.from_artifact(folder)  # what a second read of the folder would have served
    assert not torch.equal(swapped_rt.logits(PROMPT), clean_logits)


def test_serve_smoke_a_shard_replaced_after_it_was_opened_is_not_what_is_served(art, tmp_path, hook, clean_logits,
                                                                                 capsys):
    code, out, err = run(["serve-smoke", art, *FAST, "--json"], capsys)
    assert code == 0, err
    clean = [p["generated"] for p in json.loads(out)["comparison"]["per_prompt"]]
    folder = copy_folder(art, tmp_path / "a")

    def swap(file, tensor):
        if file == "model.safetensors" and tensor is None and not swap.done:
            swap.done = True  # right after the header: every tensor is still to be read
            _replace_by_rename(folder, "model.safetensors", _boost_norm)
    swap.done = False
    hook(swap)
    code, out, err = run(["serve-smoke", folder, *FAST, "--json"], capsys)
    rep = json.loads(out)
    assert code == 0 and swap.done and rep["hashes_ok"] is True, err
    assert [p["generated"] for p in rep["comparison"]["per_prompt"]] == clean
    from compressor.runtime import Runtime

    assert not torch.equal(Runtime.from_artifact(folder).logits(PROMPT), clean_logits)  # the swap matters


# --- one read --------------------------------------------------------------------------------

def test_serving_reads_every_byte_once_and_runs_no_separate_hash_pass(art, fake_server, hook, monkeypatch, capsys):
    import compressor.integrity as integrity
    import compressor.safetensors_io as sio

    def no_pass(*a, **k):
        raise AssertionError("a separate hashing pass ran")
    monkeypatch.setattr(integrity, "digest_files", no_pass)
    monkeypatch.setattr(sio, "digest_files", no_pass)
    monkeypatch.setattr(load_integrity, "digest_files", no_pass)
    seen = hook()
    code, _out, err = run(["serve", art, "--port", "0"], capsys)
    assert code == 0, err
    rt = fake_server.started[0].engine.runtime
    listed = load_manifest(art).files
    assert rt.integrity["ok"] and rt.integrity["bytes_hashed"] == sum(r.size for r in listed.values())
    assert rt.integrity["tensors_checked"] == len(load_manifest(art).tensors)
    assert len(seen) == len(set(seen))  # no piece read twice
    assert {f for f, _t in seen} == set(listed)


@pytest.mark.parametrize("digest", ["sha256", "blake3"])
def test_the_load_report_equals_kvq_verify(tmp_path, tiny_model_dir, digest):
    from compressor.load_integrity import ArtifactReader
    from compressor.runtime import Runtime

    out = quantize_tiny(tmp_path / "a", tiny_model_dir, digest_algorithm=digest)
    with ArtifactReader(out, load_manifest(out)) as reads:
        rt = Runtime.from_artifact(out, reads=reads)
    want = check_hashes(out)
    for key in ("seconds", "mb_per_s"):
        want.pop(key), rt.integrity.pop(key)
    assert rt.integrity == want and want["ok"] and want["digest_algorithm"] == digest


# --- signature and --no-manifest ---------------------------------------------------------------

@pytest.mark.parametrize("command", ["serve", "serve-smoke"])
def test_a_wrong_public_key_is_refused_before_anything_is_loaded(signed, keys, command, hook, fake_server, capsys):
    seen = hook()
    code, out, err = run(_serve_cmd(command, signed, "--public-key", keys["b"][1]), capsys)
    assert code == 1 and "signature FAILED" in err and "another key" in err, err
    assert fake_server.started == [] and seen == []  # not a byte of the artifact was loaded
    code, out, err = run(_serve_cmd(command, signed, "--public-key", keys["a"][1], http=False), capsys)
    assert code == 0 and "signature ok (key)" in err, err
    assert len(fake_server.started) == (command == "serve")


def test_signature_binds_the_manifest_that_is_used(signed, keys, tmp_path, monkeypatch, fake_server, capsys):
    """The manifest is read once; bytes other than those model.sig signed are refused, even when
    the signed file is back on disk by the time the signature is checked."""
    import compressor.load_integrity as li

    folder = copy_folder(signed, tmp_path / "a")
    signed_bytes = (folder / MANIFEST_NAME).read_bytes()
    m = json.loads(signed_bytes)
    m["recipe"]["description"] = "not the signed manifest"
    (folder / MANIFEST_NAME).write_text(json.dumps(m))
    real_read = li.Path.read_bytes

    def read_then_put_back(self):
        data = real_read(self)
        if self.name == MANIFEST_NAME:
            (folder / MANIFEST_NAME).write_bytes(signed_bytes)  # the signature check will see the signed file
        return data
    monkeypatch.setattr(li.Path, "read_bytes", read_then_put_back)
    code, _out, err = run(["serve", folder, "--port", "0", "--public-key", keys["a"][1]], capsys)
    assert_clean_error(code, err, 1, "kvq-manifest.json is not the file model.sig signed")
    assert fake_server.started == []


def test_no_manifest_says_nothing_was_checked(art, tmp_path, fake_server, capsys):
    nm = copy_folder(art, tmp_path / "nm")
    (nm / MANIFEST_NAME).unlink()
    code, _out, err = run(["serve", nm, "--port", "0", "--no-manifest"], capsys)
    assert code == 0, err
    notes = [ln for ln in err.splitlines() if "checked" in ln]
    assert notes == ["kvq: no kvq manifest (--no-manifest): nothing was checked"]
    code, _out, err = run(["serve", nm, "--port", "0"], capsys)
    assert_clean_error(code, err, 2, "pass --no-manifest")
    code, _out, err = run(["serve", art, "--port", "0", "--no-manifest"], capsys)
    assert_clean_error(code, err, 2, "drop --no-manifest")
    code, _out, err = run(["serve-smoke", nm, *FAST, "--no-manifest"], capsys)
    assert_clean_error(code, err, 2, "--no-manifest needs --reference")
    assert len(fake_server.started) == 1


# --- stopping the server -----------------------------------------------------------------------

def test_sigterm_stops_serve_with_its_own_message(art, monkeypatch, capsys):
    """SIGTERM while ``kvq serve`` serves: exit 143, "the server stopped", not quantize's
    "no artifact was written" (a fresh-user try found that line on every stopped server)."""
    import signal

    import compressor.runtime.server as server

    class Stopped(FakeServer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.finished = self

        def wait(self, timeout=None):
            signal.raise_signal(signal.SIGTERM)  # the handler kvq installs turns it into KeyboardInterrupt
            return True

    monkeypatch.setattr(server, "Server", Stopped)
    code, out, err = run(["serve", art, "--port", "0"], capsys)
    assert code == 143 and "kvq: terminated; the server stopped" in err and "artifact was written" not in err, err


@pytest.mark.parametrize("argv,line", [
    (["serve", "a"], "kvq: interrupted; the server stopped"),
    (["verify", "a", "--hashes-only"], "kvq: interrupted"),
    (["--verbose", "quantize", "m", "-o", "x"], "kvq: interrupted; no artifact was written and no layer was finished (nothing to resume: rerun without --resume)"),
    (["sign", "a", "--private-key", "k"], "kvq: interrupted; no artifact was written"),
])
def test_the_interruption_line_follows_the_command(argv, line):
    from compressor.interrupts import message

    assert message(None, argv) == line
