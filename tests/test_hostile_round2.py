"""Hostile input and faults, round two (issue #20), the cases outside the HTTP server and
config.json: calibration memory, huge manifests, symlinked output and artifact paths,
certificates without a signing usage, staging folders killed before their first
checkpoint, the missing-signature note, interruptions while a resumed run loads."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from compressor.manifest import MANIFEST_NAME, SIGNATURE_NAME, load_manifest
from conftest import assert_clean_error, make_model_dir
from conftest import kvq_run as run
from test_integrity import _keypair

RTN = ["--algorithm", "rtn", "--group-size", "32"]
FAST_GPTQ = ["--algorithm", "gptq", "--group-size", "32", "--calib-samples", "4", "--calib-seqlen", "32"]


@pytest.fixture(scope="module")
def src(tmp_path_factory, tokenizer):
    return make_model_dir(tmp_path_factory.mktemp("round2") / "model", tokenizer)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return _keypair(tmp_path_factory.mktemp("round2-keys"), "k")


@pytest.fixture(scope="module")
def signed(tmp_path_factory, src, keys):
    """A tiny RTN artifact signed during quantize."""
    from compressor.cli import main

    out = tmp_path_factory.mktemp("round2-art") / "w4"
    with pytest.raises(SystemExit) as e:
        main(["quantize", str(src), "-o", str(out), *RTN, "--sign-key", str(keys[0]), "--json"])
    assert e.value.code == 0
    return out


def _copy(art: Path, dst: Path) -> Path:
    shutil.copytree(art, dst)
    return dst


def _flat(err: str) -> str:
    """stderr with rich's line wrapping undone (it wraps at the console's width)."""
    return " ".join(err.split())


def _no_loading(monkeypatch):
    """Make loading the source model fail loudly: a refusal must come before it."""
    import compressor.commands.quantize as q

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(q, "open_lazy", boom)
    monkeypatch.setattr(q, "load_model", boom)


# --- 3. output path that is a symlink ---------------------------------------------------

@pytest.mark.parametrize("dangling", [True, False])
def test_symlinked_output_is_refused_up_front(src, signed, tmp_path, monkeypatch, capsys, dangling):
    _no_loading(monkeypatch)
    target = tmp_path / "nowhere" if dangling else _copy(signed, tmp_path / "existing")
    before = None if dangling else sorted(p.name for p in target.iterdir())
    link = tmp_path / "out"
    os.symlink(target, link)
    code, _, err = run(["quantize", src, "-o", link, *RTN, "--overwrite"], capsys)
    assert_clean_error(code, err, 2, "symlink", tmp_path)
    assert ("dangling" in err) == dangling and link.is_symlink()
    assert (not target.exists()) if dangling else sorted(p.name for p in target.iterdir()) == before


# --- 4. an artifact path given through a symlink ----------------------------------------

def test_artifact_through_a_symlink_verifies_and_signs(signed, keys, tmp_path, capsys):
    art = _copy(signed, tmp_path / "real")
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
    art = _copy(signed, tmp_path / "a")
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
