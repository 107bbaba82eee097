"""Hostile input and faults, round two (issue #20), the cases outside the HTTP server and
config.json: calibration memory, huge manifests, symlinked output and artifact paths,
certificates without a signing usage, staging folders killed before their first
checkpoint, the missing-signature note, interruptions while a resumed run loads."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from compressor.manifest import MANIFEST_NAME, SIGNATURE_NAME, load_manifest
from conftest import assert_clean_error, copy_folder, run_probe, unwrap
from conftest import kvq_run as run

RTN = ["--algorithm", "rtn", "--group-size", "32"]
FAST_GPTQ = ["--algorithm", "gptq", "--group-size", "32", "--calib-samples", "4", "--calib-seqlen", "32"]


@pytest.fixture(scope="module")
def signed(tmp_path_factory, src, keys):
    """A tiny RTN artifact signed during quantize."""
    from compressor.cli import main

    out = tmp_path_factory.mktemp("round2-art") / "w4"
    with pytest.raises(SystemExit) as e:
        main(["quantize", str(src), "-o", str(out), *RTN, "--sign-key", str(keys[0]), "--json"])
    assert e.value.code == 0
    return out


def _no_loading(monkeypatch):
    """Make loading the source model fail loudly: a refusal must come before it."""
    import compressor.commands.quantize as q

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(q, "open_lazy", boom)
    monkeypatch.setattr(q, "load_model", boom)


# --- 1. calibration memory --------------------------------------------------------------

def test_huge_calibration_is_refused_before_loading(src, tmp_path, monkeypatch, capsys):
    """1,000,000 samples (inside the accepted range) x the longest seqlen: far beyond any
    machine's memory and disk; refused in one line, naming what the activations need."""
    _no_loading(monkeypatch)
    out = tmp_path / "o"
    code, _, err = run(["quantize", src, "-o", out, *FAST_GPTQ[:4], "--calib-samples", "1000000",
                        "--calib-seqlen", "1048576"], capsys)
    assert_clean_error(code, err, 2, "calibration activations of 1,000,000 x 1,048,576 tokens", tmp_path)
    assert "lower --calib-samples" in err and not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("memory_gib, disk_gib, pattern", [
    (8, 10**6, "of memory"),  # spilled or not, one copy (122 GiB) cannot be held
    (10**6, 100, "of disk"),  # memory enough, but the checkpoints need 2 copies on disk
])
def test_calibration_memory_and_disk_bounds(src, tmp_path, monkeypatch, capsys, memory_gib, disk_gib, pattern):
    import compressor.activations as st

    _no_loading(monkeypatch)
    monkeypatch.setattr(st, "available_memory", lambda: memory_gib * 2**30)
    monkeypatch.setattr(st, "free_disk", lambda folder: disk_gib * 2**30)
    code, _, err = run(["quantize", src, "-o", tmp_path / "o", *FAST_GPTQ[:4], "--calib-samples", "1000000"], capsys)
    assert_clean_error(code, err, 2, pattern, tmp_path)
    assert "122.1 GiB a copy" in err  # 1e6 x 512 x 64 x 4 bytes


def test_float_target_counts_its_second_stream(src, tmp_path, monkeypatch, capsys):
    """``gptq.gptaq_alpha`` keeps the float model's activations beside the quantized model's:
    the plan counts two streams (244 GiB a copy where one stream is 122 GiB)."""
    import compressor.activations as st

    _no_loading(monkeypatch)
    monkeypatch.setattr(st, "available_memory", lambda: 8 * 2**30)
    code, _, err = run(["quantize", src, "-o", tmp_path / "o", *FAST_GPTQ[:4], "--calib-samples", "1000000",
                        "--set", "gptq.gptaq_alpha=0.25"], capsys)
    assert_clean_error(code, err, 2, "of memory", tmp_path)
    assert "244.1 GiB a copy, the float and the quantized stream" in unwrap(err)


def test_calibration_that_fits_once_but_not_twice_is_spilled(src, tmp_path, monkeypatch, capsys):
    """Within --activation-budget-gib, but two copies exceed the memory available: the run
    spills (budget 0, said in a note) instead of running out of memory; same artifact."""
    import compressor.activations as st

    samples, seqlen, hidden = 4, 32, 64
    copy, ids = samples * seqlen * hidden * 4, samples * seqlen * 8
    monkeypatch.setattr(st, "available_memory", lambda: copy + ids + copy // 2)
    budgets = []
    real_spill = st.spill
    monkeypatch.setattr(st, "spill", lambda h, folder, tag, budget: (budgets.append(budget), real_spill(h, folder, tag, budget))[1])
    code, _, err = run(["quantize", src, "-o", tmp_path / "spilled", *FAST_GPTQ], capsys)
    assert code == 0, err
    assert "two copies do not fit" in unwrap(err) and budgets and set(budgets) == {0}
    monkeypatch.setattr(st, "available_memory", lambda: None)
    budgets.clear()
    code, _, err = run(["quantize", src, "-o", tmp_path / "plain", *FAST_GPTQ], capsys)
    assert code == 0 and "two copies do not fit" not in unwrap(err) and set(budgets) == {8 * 2**30}
    assert load_manifest(tmp_path / "spilled").tensors == load_manifest(tmp_path / "plain").tensors


def test_samples_beyond_the_text_say_the_windows_repeat(src, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("A short calibration text about quantization, repeated a little. " * 8)
    code, out, err = run(["quantize", src, "-o", tmp_path / "o", *FAST_GPTQ[:4], "--calib", text,
                          "--calib-samples", "16", "--calib-seqlen", "32", "--json"], capsys)
    assert code == 0, err
    warned = [w for w in json.loads(out)["warnings"] if "repeat the text" in w]
    assert len(warned) == 1 and "16 x 32 = 512 tokens" in warned[0]
    assert warned == [w for w in load_manifest(tmp_path / "o").quality["warnings"] if "repeat the text" in w]
    code, out, err = run(["quantize", src, "-o", tmp_path / "o2", *FAST_GPTQ[:4], "--calib", text,
                          "--calib-samples", "2", "--calib-seqlen", "32", "--json"], capsys)
    assert code == 0 and not [w for w in json.loads(out)["warnings"] if "repeat the text" in w]


# --- 2. manifests with a huge number of entries -----------------------------------------

def _add_tensors(art: Path, n: int) -> None:
    data = json.loads((art / MANIFEST_NAME).read_text())
    rec = next(iter(data["tensors"].values()))
    for i in range(n):
        data["tensors"][f"ghost.{i:07d}.weight"] = rec
    (art / MANIFEST_NAME).write_text(json.dumps(data))


def test_long_lists_of_differences_are_summarised(signed, tmp_path, capsys):
    art = copy_folder(signed, tmp_path / "a")
    _add_tensors(art, 1000)
    code, out, err = run(["verify", art, "--hashes-only"], capsys)
    lines = [ln for ln in err.splitlines() if ln.startswith("missing tensor")]
    assert code == 1 and len(lines) == 21, err
    assert lines[-1] == "missing tensor: ... and 980 more"
    code, out, _ = run(["verify", art, "--hashes-only", "--json"], capsys)
    assert len(json.loads(out)["hashes"]["missing_tensors"]) == 1000  # the JSON report keeps every name


def test_signature_differences_are_summarised(signed, keys, tmp_path, capsys):
    art = copy_folder(signed, tmp_path / "a")
    for i in range(50):
        (art / f"extra-{i:02d}.txt").write_text("x")
    code, _, err = run(["verify", art, "--hashes-only", "--public-key", keys[1]], capsys)
    flat = unwrap(err)
    names = ", ".join(f"extra-{i:02d}.txt" for i in range(20))
    assert code == 1 and f"added since signing: {names}, ... and 30 more" in flat, err
    assert flat.count("added since signing") == 1 and "extra-20.txt" not in flat.split("added since signing")[1]
    assert len([ln for ln in err.splitlines() if ln.startswith("extra file")]) == 21


def test_manifest_entry_count_and_size_are_bounded(signed, tmp_path, monkeypatch, capsys):
    import compressor.manifest as mf

    art = copy_folder(signed, tmp_path / "a")
    n = len(load_manifest(art).tensors) + len(load_manifest(art).files)
    monkeypatch.setattr(mf, "MAX_MANIFEST_ENTRIES", n + 10)
    assert run(["verify", art, "--hashes-only"], capsys)[0] == 0
    _add_tensors(art, 11)
    code, _, err = run(["verify", art, "--hashes-only"], capsys)
    assert_clean_error(code, err, 2, f"{n + 11:,} files and tensors listed, above the {n + 10:,}")
    monkeypatch.undo()
    big = copy_folder(signed, tmp_path / "big")
    with open(big / MANIFEST_NAME, "r+b") as f:  # sparse: past the real bound without writing 512 MiB
        f.truncate(mf.MAX_MANIFEST_BYTES + 1)
    for argv in (["verify", big, "--hashes-only"], ["sign", big, "--private-key", tmp_path / "none.pem"]):
        code, _, err = run(argv, capsys)
        assert code == 2 and "Traceback" not in err, err
    code, _, err = run(["verify", big, "--hashes-only"], capsys)
    assert_clean_error(code, err, 2, "above the 512 MiB a kvq manifest may take")


# --- 3. output path that is a symlink ---------------------------------------------------

@pytest.mark.parametrize("dangling", [True, False])
def test_symlinked_output_is_refused_up_front(src, signed, tmp_path, monkeypatch, capsys, dangling):
    _no_loading(monkeypatch)
    target = tmp_path / "nowhere" if dangling else copy_folder(signed, tmp_path / "existing")
    before = None if dangling else sorted(p.name for p in target.iterdir())
    link = tmp_path / "out"
    os.symlink(target, link)
    code, _, err = run(["quantize", src, "-o", link, *RTN, "--overwrite"], capsys)
    assert_clean_error(code, err, 2, "symlink", tmp_path)
    assert ("dangling" in err) == dangling and link.is_symlink()
    assert (not target.exists()) if dangling else sorted(p.name for p in target.iterdir()) == before


# --- 4. an artifact path given through a symlink ----------------------------------------

def test_artifact_through_a_symlink_verifies_and_signs(signed, keys, tmp_path, capsys):
    art = copy_folder(signed, tmp_path / "real")
    link = tmp_path / "link"
    os.symlink(art, link)
    for given in (link, f"{link}/"):
        code, out, err = run(["verify", given, "--hashes-only", "--public-key", keys[1], "--json"], capsys)
        assert code == 0 and json.loads(out)["signature"]["ok"] is True, err
    code, _, err = run(["verify", link, "--hashes-only", "--public-key", keys[1]], capsys)
    assert code == 0 and "signature ok" in err and "FAILED" not in err, err
    before = (art / SIGNATURE_NAME).read_bytes()
    code, _, err = run(["sign", link, "--private-key", keys[0]], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert (art / SIGNATURE_NAME).read_bytes() != before and not (link / SIGNATURE_NAME).is_symlink()
    code, out, err = run(["verify", art, "--hashes-only", "--public-key", keys[1], "--json"], capsys)
    assert code == 0 and json.loads(out)["signature"]["ok"] is True, err


# --- 5. certificates without a signing usage --------------------------------------------

def _cert(path: Path, key, digital_signature: bool | None, code_signing: bool | None, ca: bool) -> Path:
    """A self-signed certificate; ``digital_signature`` None: no KeyUsage at all,
    ``code_signing`` None: no ExtendedKeyUsage at all."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvq round2")])
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
         .not_valid_after(now + datetime.timedelta(days=30))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if digital_signature is not None:
        b = b.add_extension(x509.KeyUsage(digital_signature=digital_signature, content_commitment=False,
                                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                                          key_cert_sign=ca, crl_sign=ca, encipher_only=False, decipher_only=False),
                            critical=True)
    if code_signing is not None:
        usages = [ExtendedKeyUsageOID.CODE_SIGNING] if code_signing else [ExtendedKeyUsageOID.SERVER_AUTH]
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    path.write_bytes(b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    return path


@pytest.mark.parametrize("digital_signature, code_signing, ca", [
    (False, None, True),  # a CA certificate: keyCertSign and cRLSign only
    (False, False, False),  # a TLS server certificate
    (None, None, False),  # no usage extensions at all
])
def test_certificate_without_a_signing_usage_is_refused_at_sign_time(src, signed, tmp_path, monkeypatch, capsys,
                                                                      digital_signature, code_signing, ca):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    key_pem = tmp_path / "key.pem"
    key_pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    cert = _cert(tmp_path / "cert.pem", key, digital_signature, code_signing, ca)
    art = copy_folder(signed, tmp_path / "a")
    before = (art / SIGNATURE_NAME).read_bytes()
    code, _, err = run(["sign", art, "--private-key", key_pem, "--signing-certificate", cert], capsys)
    assert_clean_error(code, err, 2, "is not for signing")
    assert (art / SIGNATURE_NAME).read_bytes() == before
    _no_loading(monkeypatch)
    out = tmp_path / "never"
    code, _, err = run(["quantize", src, "-o", out, *RTN, "--sign-key", key_pem, "--sign-certificate", cert], capsys)
    assert_clean_error(code, err, 2, "codeSigning", tmp_path)
    assert not out.exists()
    # the rule is model_signing's: code signing alone (no KeyUsage) signs, and verifies
    ok = _cert(tmp_path / "ok.pem", key, None, True, False)
    code, _, err = run(["sign", art, "--private-key", key_pem, "--signing-certificate", ok], capsys)
    assert code == 0, err
    code, _, err = run(["verify", art, "--hashes-only", "--certificate-chain", ok], capsys)
    assert code == 0 and "signature ok" in err, err


# --- 6. a staging folder killed before its first checkpoint -----------------------------

def _killed_before_first_checkpoint(src, out: Path, monkeypatch) -> Path:
    """The state a kill -9 leaves after layer 0's part file is written and before the first
    checkpoint: the part, no resume.json, and no clean-up (a SIGKILL runs none)."""
    import compressor.staging as st
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize

    class Killed(BaseException):
        pass

    def killed(self, *a, **k):
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(st.Staging, "checkpoint", killed)
        m.setattr(st.shutil, "rmtree", lambda *a, **k: None)  # kill -9: nothing is cleaned up
        with pytest.raises(Killed):
            run_quantize(QuantizeOptions(model=str(src), output=out, algorithm="rtn", group_size=32))
    staging = out.parent / f".{out.name}.kvq-partial"
    assert sorted(p.name for p in staging.iterdir()) == [st.MARKER_NAME, "part-layer-00000.safetensors"]
    return staging


@pytest.mark.parametrize("resume", [False, True])
def test_staging_killed_before_the_first_checkpoint_starts_over(src, signed, tmp_path, monkeypatch, capsys, resume):
    out = tmp_path / "r"
    staging = _killed_before_first_checkpoint(src, out, monkeypatch)
    code, _, err = run(["quantize", src, "-o", out, *RTN, *(["--resume"] if resume else [])], capsys)
    assert code == 0, err
    err = unwrap(err)
    assert ("nothing to resume; starting over" in err) == resume
    assert ("an interrupted run that finished no layer" in err) == (not resume)
    assert not staging.exists() and load_manifest(out).tensors == load_manifest(signed).tensors
    assert run(["verify", out, "--hashes-only"], capsys)[0] == 0


def test_a_folder_kvq_did_not_write_is_still_refused(src, tmp_path, capsys):
    staging = tmp_path / ".r.kvq-partial"
    staging.mkdir()
    (staging / "notes.txt").write_text("mine")
    for extra in ([], ["--resume"]):
        code, _, err = run(["quantize", src, "-o", tmp_path / "r", *RTN, *extra], capsys)
        assert code == 2 and "Traceback" not in err, err
    assert (staging / "notes.txt").read_text() == "mine"


# --- 7. no signature, no key material ---------------------------------------------------

def test_missing_signature_is_noted_without_key_material(signed, tmp_path, capsys):
    art = copy_folder(signed, tmp_path / "a")
    (art / SIGNATURE_NAME).unlink()
    code, out, err = run(["verify", art, "--hashes-only"], capsys)
    assert code == 0 and f"no signature ({SIGNATURE_NAME} is missing)" in unwrap(err), err
    code, _, err = run(["verify", signed, "--hashes-only"], capsys)
    assert code == 0 and "no signature" not in err and "present but not checked" in unwrap(err)


# --- 8. an interruption while a resumed run loads ---------------------------------------

def test_interruption_while_a_resumed_run_loads_names_the_staging_folder(src, tmp_path, monkeypatch, capsys):
    import compressor.commands.quantize as q
    import compressor.quant.algorithms as alg

    class Crash(Exception):
        pass

    out = tmp_path / "r"
    real = alg.rtn_layer
    with monkeypatch.context() as m:
        m.setattr(alg, "rtn_layer", lambda i, *a: (_ for _ in ()).throw(Crash()) if i == 1 else real(i, *a))
        code, _, err = run(["quantize", src, "-o", out, *RTN], capsys)
    assert code == 1 and "stopped after 1 of 2 layers" in err, err
    staging = tmp_path / ".r.kvq-partial"
    state = json.loads((staging / "resume.json").read_text())

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(q, "open_lazy", interrupted)
        code, _, err = run(["quantize", src, "-o", out, *RTN, "--resume"], capsys)
    assert code == 130 and f"kept in {staging}" in err and "--resume to continue" in err, err
    assert json.loads((staging / "resume.json").read_text()) == state  # untouched
    code, _, err = run(["quantize", src, "-o", out, *RTN, "--resume"], capsys)
    assert code == 0 and "resuming: 1 layer(s) already done" in unwrap(err), err


# --- 8b. signals that were lost, or that land inside torch's import ---------------------

def test_an_interruption_whose_exception_was_lost_stops_the_run(src, tmp_path, monkeypatch, capsys):
    """CPython drops an exception raised in a ``__del__`` (the signal handler can run there);
    the run must still stop at its next safe point, not finish with later signals ignored."""
    import signal

    import compressor.commands.quantize as q

    real = q.open_lazy

    def lost(*a, **k):
        try:
            signal.raise_signal(signal.SIGTERM)
        except KeyboardInterrupt:
            pass  # what CPython does with an exception raised inside a finalizer
        return real(*a, **k)

    monkeypatch.setattr(q, "open_lazy", lost)
    out = tmp_path / "o"
    code, _, err = run(["quantize", src, "-o", out, *RTN], capsys)
    assert code == 143 and "terminated; no artifact was written" in err, err
    assert not list(tmp_path.iterdir())  # no artifact, no staging folder


def test_an_interruption_raised_inside_pyrun_code_keeps_kvqs_exit_code(tmp_path):
    """An exact KeyboardInterrupt leaving code run through PyRun_* (pybind11's py::exec in
    torch's import) makes a ``python -m`` process kill itself with SIGINT at exit, whatever
    exit code it chose; kvq raises a subclass, so ``python -m compressor`` exits 143."""
    r = run_probe(tmp_path, (
        "import ctypes, signal, sys\n"
        "from compressor import interrupts\n"
        "interrupts.install()\n"
        "ctypes.pythonapi.PyRun_SimpleString(b'import signal; signal.raise_signal(signal.SIGTERM)')\n"
        "sys.exit(143 if interrupts.received() == signal.SIGTERM else 1)\n"), module=True)
    assert r.returncode == 143, (r.returncode, r.stderr)


def test_a_signal_during_the_torch_import_is_held_until_it_is_done(tmp_path):
    """SIGTERM while torch is being imported: raised only once torch (and transformers) are
    imported, never inside torch's initialisation (where it can abort the process)."""
    r = run_probe(tmp_path, (
        "import signal, sys\n"
        "from compressor import cli, interrupts\n"
        "class Hook:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            signal.raise_signal(signal.SIGTERM)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Hook())\n"
        "interrupts.install()\n"
        "try:\n"
        "    cli._quiet_libraries()\n"
        "except KeyboardInterrupt:\n"
        "    print('raised after import', 'torch' in sys.modules and 'transformers' in sys.modules)\n"
        "    sys.exit(0)\n"
        "sys.exit(1)\n"))
    assert r.returncode == 0 and r.stdout.strip() == "raised after import True", (r.returncode, r.stdout, r.stderr)


def test_a_signal_while_the_cli_is_imported_ends_in_one_line(tmp_path):
    """Ctrl-C (or SIGTERM) while ``compressor.cli`` is still importing click/rich/pydantic,
    before the command runs: kvq's handler is already installed by the entry point, so the
    process prints one line and exits 130 (143), no traceback."""
    for sig, code, word in (("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")):
        r = run_probe(tmp_path, (
            "import signal, sys\n"
            "class Hook:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'click':\n"
            f"            signal.raise_signal(signal.{sig})\n"
            "        return None\n"
            "sys.meta_path.insert(0, Hook())\n"
            "sys.argv = ['kvq', 'quantize', 'x', '-o', 'y']\n"
            "from compressor.entry import main\n"
            "main()\n"))
        assert r.returncode == code, (sig, r.returncode, r.stderr)
        assert r.stderr.strip() == (f"kvq: {word}; no artifact was written and no layer was finished (nothing to "
                                    "resume: rerun without --resume)"), (sig, r.stderr)
        assert "compressor.cli" not in r.stdout


def test_the_entry_point_runs_the_cli(tmp_path):
    """``compressor.entry:main`` (the console script) hands over to the CLI: usage errors keep exit 2."""
    r = run_probe(tmp_path, "import sys\nsys.argv = ['kvq', 'nosuch']\nfrom compressor.entry import main\nmain()\n")
    assert r.returncode == 2 and r.stderr.startswith("kvq: error:"), (r.returncode, r.stderr)
