"""Integrity (issue #5): manifest digests, signatures through model_signing, hostile input."""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compressor.commands.options import QuantizeOptions
from compressor.commands.quantize import run_quantize
from compressor.artifact import check_hashes
from compressor.cli import main
from compressor.errors import InputError
from compressor.manifest import MANIFEST_NAME, SIGNATURE_NAME, json_schema, load_manifest
from compressor.safetensors_io import file_digest, read_header
from conftest import copy_folder, keypair, kvq_run as run

REPO = Path(__file__).resolve().parents[1]


def one_line_error(code, err, expected, pattern):
    assert code == expected, err
    assert "Traceback" not in err
    assert pattern in err, err


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    return {"a": keypair(d, "a"), "b": keypair(d, "b"), "dir": d}


@pytest.fixture(scope="module")
def signed(tmp_path_factory, tiny_model_dir, keys):
    """A tiny RTN artifact, signed during quantize (--sign-key)."""
    out = tmp_path_factory.mktemp("signed") / "w4"
    code = None
    try:
        main(["quantize", str(tiny_model_dir), "-o", str(out), "--algorithm", "rtn", "--group-size", "32",
              "--sign-key", str(keys["a"][0]), "--json"])
    except SystemExit as e:
        code = e.code
    assert code == 0
    return out


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


# --- manifest digests -------------------------------------------------------------------

@pytest.mark.parametrize("seed,k", [(0, 1), (1, 3), (2, 7)])
def test_flip_one_byte_in_k_random_tensors_names_exactly_those(signed, tmp_path, seed, k, capsys):
    art = copy_folder(signed, tmp_path / "a")
    entries = [e for e in read_header(art / "model.safetensors").values() if e.end > e.start]
    rng = random.Random(seed)
    chosen = rng.sample(entries, k)
    for e in chosen:
        _flip(art / "model.safetensors", rng.randrange(e.start, e.end))
    rep = check_hashes(art)
    assert rep["modified_tensors"] == sorted(e.name for e in chosen)
    assert rep["modified_files"] == ["model.safetensors"]
    assert not rep["missing_tensors"] and not rep["extra_tensors"] and not rep["ok"]
    code, out, err = run(["verify", art, "--hashes-only", "--json"], capsys)
    assert code == 1
    assert json.loads(out)["hashes"]["modified_tensors"] == sorted(e.name for e in chosen)


def test_clean_artifact_hashes_ok_and_reports_throughput(signed):
    rep = check_hashes(signed)
    assert rep["ok"] and rep["digest_algorithm"] == "sha256"
    m = load_manifest(signed)
    assert rep["tensors_checked"] == len(m.tensors)
    assert rep["bytes_hashed"] == sum(f.size for f in m.files.values())
    assert m.files["model.safetensors"].covers == "header"
    assert m.files["config.json"].covers == "file"
    assert m.files["config.json"].digest == file_digest(signed / "config.json")
    assert SIGNATURE_NAME not in m.files


def test_header_edit_is_a_modified_file(signed, tmp_path):
    art = copy_folder(signed, tmp_path / "a")
    raw = (art / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b'"format":"pt"', b'"format":"PT"')
    assert header != raw[8:8 + n]
    (art / "model.safetensors").write_bytes(raw[:8] + header + raw[8 + n:])
    rep = check_hashes(art)
    assert rep["modified_files"] == ["model.safetensors"] and rep["modified_tensors"] == []


def test_added_removed_renamed_files(signed, tmp_path):
    art = copy_folder(signed, tmp_path / "a")
    (art / "notes.txt").write_text("added later")
    os.rename(art / "tokenizer.json", art / "tok.json")
    (art / "generation_config.json").unlink()
    rep = check_hashes(art)
    assert rep["extra_files"] == ["notes.txt"]
    assert rep["renamed_files"] == ["tokenizer.json -> tok.json"]
    assert rep["missing_files"] == ["generation_config.json"]
    assert not rep["ok"]


def test_renamed_weights_file_is_reported_as_a_rename_not_as_modified_tensors(signed, tmp_path):
    art = copy_folder(signed, tmp_path / "a")
    os.rename(art / "model.safetensors", art / "weights.safetensors")
    rep = check_hashes(art)
    assert rep["renamed_files"] == ["model.safetensors -> weights.safetensors"]
    assert rep["modified_tensors"] == [] and rep["missing_tensors"] == [] and not rep["ok"]


def test_symlink_pointing_outside_is_refused_and_not_followed(signed, tmp_path):
    art = copy_folder(signed, tmp_path / "a")
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    (art / "config.json").unlink()
    os.symlink(secret, art / "config.json")
    rep = check_hashes(art)
    assert not rep["ok"]
    assert rep["unsafe_files"] and "outside the artifact" in rep["unsafe_files"][0]
    assert "config.json" not in rep["missing_files"]


def test_blake3_manifest_round_trip_and_tamper(tiny_model_dir, tmp_path):
    out = tmp_path / "b3"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=out, algorithm="rtn", group_size=32,
                                 digest_algorithm="blake3"))
    m = load_manifest(out)
    assert m.digest_algorithm == "blake3"
    import blake3

    assert m.files["config.json"].digest == blake3.blake3((out / "config.json").read_bytes()).hexdigest()
    assert check_hashes(out)["ok"]
    e = read_header(out / "model.safetensors")["model.layers.0.mlp.down_proj.weight_scale"]
    _flip(out / "model.safetensors", e.start)
    assert check_hashes(out)["modified_tensors"] == ["model.layers.0.mlp.down_proj.weight_scale"]


def test_v1_manifest_is_read(signed, tmp_path):
    """Artifacts written before schema 2 (digests named sha256, whole-file digests) still verify."""
    art = copy_folder(signed, tmp_path / "a")
    (art / SIGNATURE_NAME).unlink()
    data = json.loads((art / MANIFEST_NAME).read_text())
    data["schema_version"] = "kvq.manifest/1"
    data.pop("digest_algorithm")
    for name, rec in data["files"].items():
        rec.pop("covers")
        rec.pop("digest")
        rec["sha256"] = file_digest(art / name)
    for rec in data["tensors"].values():
        rec["sha256"] = rec.pop("digest")
    (art / MANIFEST_NAME).write_text(json.dumps(data))
    assert check_hashes(art)["ok"]
    _flip(art / "tokenizer.json", 10)
    assert check_hashes(art)["modified_files"] == ["tokenizer.json"]


def test_json_schema_in_docs_is_current():
    committed = json.loads((REPO / "docs" / "manifest.schema.json").read_text())
    assert committed == json.loads(json.dumps(json_schema())), "regenerate: python -m compressor.manifest > docs/manifest.schema.json"


# --- hostile manifests ------------------------------------------------------------------

def _edit_manifest(art: Path, fn) -> None:
    data = json.loads((art / MANIFEST_NAME).read_text())
    fn(data)
    (art / MANIFEST_NAME).write_text(json.dumps(data))


def _rename_key(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


@pytest.mark.parametrize("edit,msg", [
    (lambda d: d.update(schema_version="kvq.manifest/3"), "unknown schema_version"),
    (lambda d: _rename_key(d["files"], "config.json", "../config.json"), "unsafe file name"),
    (lambda d: _rename_key(d["files"], "config.json", "/etc/passwd"), "unsafe file name"),
    (lambda d: d["tensors"][next(iter(d["tensors"]))].update(file="../model.safetensors"), "unsafe file name"),
    (lambda d: d["files"]["config.json"].update(digest="ab" * 31), "64 lowercase hex"),
    (lambda d: d["files"]["config.json"].update(digest="AB" * 32), "64 lowercase hex"),
    (lambda d: d["tensors"][next(iter(d["tensors"]))].update(digest="0" * 128), "64 lowercase hex"),
    (lambda d: d.update(digest_algorithm="md5"), "digest_algorithm"),
    (lambda d: d["files"].pop("model.safetensors"), "does not list"),
    (lambda d: d.update(unexpected=1), "unexpected"),
])
def test_hostile_manifest_is_a_one_line_input_error(signed, tmp_path, capsys, edit, msg):
    art = copy_folder(signed, tmp_path / "a")
    _edit_manifest(art, edit)
    with pytest.raises(InputError, match=msg):
        load_manifest(art)
    code, out, err = run(["verify", art, "--hashes-only"], capsys)
    one_line_error(code, err, 2, msg.split()[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"], "nothing written outside the artifact"


@pytest.mark.parametrize("text", ["", "[]", "{", "\x00\x01", '{"schema_version": "kvq.manifest/2"}', "1e999"])
def test_broken_manifest_text(signed, tmp_path, text):
    art = copy_folder(signed, tmp_path / "a")
    (art / MANIFEST_NAME).write_text(text)
    with pytest.raises(InputError):
        load_manifest(art)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.lists(st.sampled_from(["files", "tensors", "config.json", "model.safetensors", "digest", "size",
                                      "covers", "shape", "file", "dtype", "recipe", "schema_version"]), min_size=1, max_size=3),
       value=_json)
def test_fuzz_manifest_loader(signed, tmp_path_factory, path, value):
    """Any edit of any field of a valid manifest: a valid manifest or a one-line InputError, nothing else."""
    data = json.loads((signed / MANIFEST_NAME).read_text())
    node = data
    for key in path[:-1]:
        if isinstance(node, dict):
            if key not in node and node is not data:
                key = next(iter(node), key)
            node = node.setdefault(key, {}) if isinstance(node.get(key, {}), dict) else node.get(key)
        if not isinstance(node, dict):
            break
    if isinstance(node, dict):
        node[path[-1]] = value
    art = tmp_path_factory.mktemp("fz")
    (art / MANIFEST_NAME).write_text(json.dumps(data))
    try:
        load_manifest(art)
    except InputError as e:
        assert "\n" not in str(e)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["F32", "F16", "I8", "U8", "BF16", "X1"]),
                          st.lists(st.integers(0, 5), max_size=3),
                          st.integers(-4, 40), st.integers(-4, 40)), max_size=4),
       st.integers(0, 64))
def test_fuzz_structured_safetensors_headers(tmp_path_factory, tensors, data_len):
    """Random but well-formed-looking headers: either refused with InputError or fully consistent."""
    import struct

    header = {f"t{i}": {"dtype": d, "shape": s, "data_offsets": [a, b]} for i, (d, s, a, b) in enumerate(tensors)}
    raw = json.dumps(header).encode()
    f = tmp_path_factory.mktemp("st") / "f.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_len)
    try:
        entries = read_header(f)
    except InputError as e:
        assert "\n" not in str(e)
        return
    spans = sorted((e.start, e.end) for e in entries.values() if e.end > e.start)
    pos = 8 + len(raw)
    for s, e in spans:  # accepted files tile the data buffer exactly: no overlap, no hole, no tail
        assert s == pos
        pos = e
    assert pos == f.stat().st_size


@pytest.mark.parametrize("extra,msg", [(b"\0" * 4, "unindexed bytes after"), (None, "unindexed bytes before")])
def test_safetensors_holes_are_refused(tmp_path, extra, msg):
    import struct

    if extra is not None:
        header = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
        data = b"\0" * 4 + extra
    else:
        header = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}
        data = b"\0" * 8
    raw = json.dumps(header).encode()
    f = tmp_path / "h.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    with pytest.raises(InputError, match=msg):
        read_header(f)


def test_appended_bytes_to_weights_fail_the_check(signed, tmp_path):
    art = copy_folder(signed, tmp_path / "a")
    with open(art / "model.safetensors", "ab") as f:
        f.write(b"hidden payload")
    rep = check_hashes(art)
    assert not rep["ok"] and rep["modified_files"] == ["model.safetensors"]
    assert "unindexed bytes" in rep["unreadable_files"][0]


# --- signatures -------------------------------------------------------------------------

def test_quantize_sign_key_then_verify_public_key(signed, keys, capsys):
    assert (signed / SIGNATURE_NAME).is_file()
    code, out, err = run(["verify", signed, "--hashes-only", "--public-key", keys["a"][1], "--json"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["signature"]["ok"] is True and rep["signature"]["method"] == "key" and rep["hashes"]["ok"]


def test_stock_model_signing_cli_verifies_kvq_signature(signed, keys, tmp_path):
    exe = Path(sys.executable).parent / "model_signing"
    cmd = [str(exe) if exe.exists() else "model_signing"]
    p = subprocess.run([*cmd, "verify", "key", "--signature", str(signed / SIGNATURE_NAME),
                        "--public_key", str(keys["a"][1]), str(signed)], capture_output=True, text=True)
    assert p.returncode == 0 and "Verification succeeded" in p.stdout + p.stderr, p.stdout + p.stderr
    art = copy_folder(signed, tmp_path / "a")
    (art / "extra.txt").write_text("x")
    p = subprocess.run([*cmd, "verify", "key", "--signature", str(art / SIGNATURE_NAME),
                        "--public_key", str(keys["a"][1]), str(art)], capture_output=True, text=True)
    assert "Verification succeeded" not in p.stdout + p.stderr and "extra.txt" in p.stdout + p.stderr


def test_signature_from_another_key_fails(signed, keys, capsys):
    code, out, err = run(["verify", signed, "--hashes-only", "--public-key", keys["b"][1], "--json"], capsys)
    assert code == 1
    sig = json.loads(out)["signature"]
    assert sig["ok"] is False and "does not verify" in sig["error"]


def test_missing_signature_fails_when_a_key_is_given(signed, keys, tmp_path, capsys):
    art = copy_folder(signed, tmp_path / "a")
    (art / SIGNATURE_NAME).unlink()
    code, out, err = run(["verify", art, "--hashes-only", "--public-key", keys["a"][1], "--json"], capsys)
    assert code == 1 and "missing" in json.loads(out)["signature"]["error"]
    code, out, err = run(["verify", art, "--hashes-only", "--json"], capsys)  # no key: integrity only
    assert code == 0 and json.loads(out)["signature"] == {"present": False, "checked": False, "ok": None}


def test_signature_over_a_different_manifest_fails(signed, keys, tmp_path, tiny_model_dir, capsys):
    other = tmp_path / "other"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=other, algorithm="rtn", group_size=64))
    shutil.copy(signed / SIGNATURE_NAME, other / SIGNATURE_NAME)
    code, out, err = run(["verify", other, "--hashes-only", "--public-key", keys["a"][1], "--json"], capsys)
    rep = json.loads(out)
    assert code == 1 and rep["signature"]["ok"] is False
    assert any(MANIFEST_NAME in d for d in rep["signature"]["differences"])
    assert rep["hashes"]["ok"]  # the manifest matches its own files; only the signature catches the swap


def test_file_added_after_signing_is_named(signed, keys, tmp_path, capsys):
    art = copy_folder(signed, tmp_path / "a")
    (art / "backdoor.py").write_text("import os\n")
    code, out, err = run(["verify", art, "--hashes-only", "--public-key", keys["a"][1]], capsys)
    assert code == 1
    assert "backdoor.py" in err and "signed files differ" in err


def test_rehashed_manifest_without_resigning_is_caught(signed, keys, tmp_path, capsys):
    """An attacker edits a tensor and rewrites the manifest's digests: hashes agree, the signature does not."""
    from compressor.artifact import build_manifest

    art = copy_folder(signed, tmp_path / "a")
    e = read_header(art / "model.safetensors")["model.layers.0.self_attn.q_proj.weight_scale"]
    _flip(art / "model.safetensors", e.start)
    old = load_manifest(art)
    fields = {k: v for k, v in old.model_dump().items()
              if k not in ("files", "tensors", "provenance", "digest_algorithm", "schema_version")}
    forged = build_manifest(art, fields)
    (art / MANIFEST_NAME).write_text(forged.to_json())
    assert check_hashes(art)["ok"]
    code, out, err = run(["verify", art, "--hashes-only", "--public-key", keys["a"][1], "--json"], capsys)
    rep = json.loads(out)
    assert code == 1 and rep["signature"]["ok"] is False
    diffs = " ".join(rep["signature"]["differences"])
    assert "model.safetensors" in diffs and MANIFEST_NAME in diffs


def test_kvq_sign_resigns_and_refuses_a_tampered_artifact(signed, keys, tmp_path, capsys):
    art = copy_folder(signed, tmp_path / "a")
    code, out, err = run(["sign", art, "--private-key", keys["b"][0], "--json"], capsys)
    assert code == 0, err
    assert not [p for p in art.iterdir() if p.name.startswith(".")], "temporary signature left behind"
    code, _, err = run(["verify", art, "--hashes-only", "--public-key", keys["b"][1]], capsys)
    assert code == 0, err
    code, _, _ = run(["verify", art, "--hashes-only", "--public-key", keys["a"][1]], capsys)
    assert code == 1
    before = (art / SIGNATURE_NAME).read_bytes()
    e = read_header(art / "model.safetensors")["model.norm.weight"]
    _flip(art / "model.safetensors", e.start)
    code, out, err = run(["sign", art, "--private-key", keys["b"][0]], capsys)
    one_line_error(code, err, 1, "refusing to sign")
    assert "model.norm.weight" in err
    assert (art / SIGNATURE_NAME).read_bytes() == before


@pytest.mark.parametrize("what", ["missing", "not_pem", "rsa", "public_as_private"])
def test_bad_key_files_are_usage_errors(signed, keys, tmp_path, capsys, tiny_model_dir, what):
    bad = tmp_path / "bad.pem"
    if what == "not_pem":
        bad.write_text("hello")
    elif what == "rsa":
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        k = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        bad.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))
    elif what == "public_as_private":
        shutil.copy(keys["a"][1], bad)
    art = copy_folder(signed, tmp_path / "a")
    before = (art / SIGNATURE_NAME).read_bytes()
    code, _, err = run(["sign", art, "--private-key", bad], capsys)
    one_line_error(code, err, 2, "bad.pem")
    assert (art / SIGNATURE_NAME).read_bytes() == before
    out = tmp_path / "never"
    code, _, err = run(["quantize", tiny_model_dir, "-o", out, "--algorithm", "rtn", "--sign-key", bad], capsys)
    one_line_error(code, err, 2, "bad.pem")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "kvq-tmp" in p.name]
    if what != "public_as_private":
        code, _, err = run(["verify", art, "--hashes-only", "--public-key", bad], capsys)
        one_line_error(code, err, 2, "bad.pem")


def test_certificate_chain_signing(signed, tmp_path, capsys):
    """Sign with a leaf certificate issued by a private CA; verify with the CA as the chain."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_pem = _write_cert(tmp_path / "ca.pem", ca_key, ca_key, "kvq test CA", "kvq test CA", True)
    leaf_pem = _write_cert(tmp_path / "leaf.pem", leaf_key, ca_key, "kvq release", "kvq test CA", False)
    key_pem = tmp_path / "leaf.key"
    key_pem.write_bytes(leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    art = copy_folder(signed, tmp_path / "a")
    code, _, err = run(["sign", art, "--private-key", key_pem, "--signing-certificate", leaf_pem,
                        "--certificate-chain", ca_pem], capsys)
    assert code == 0, err
    code, out, err = run(["verify", art, "--hashes-only", "--certificate-chain", ca_pem, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["signature"]["method"] == "certificate"
    k2 = ec.generate_private_key(ec.SECP256R1())
    other_ca = _write_cert(tmp_path / "other_ca.pem", k2, k2, "other CA", "other CA", True)
    code, _, _ = run(["verify", art, "--hashes-only", "--certificate-chain", other_ca], capsys)
    assert code == 1


def test_sigstore_needs_identity_and_issuer(signed, capsys):
    code, _, err = run(["verify", signed, "--hashes-only", "--identity", "me@example.com"], capsys)
    one_line_error(code, err, 2, "--issuer")


# --- non-finite weights -----------------------------------------------------------------

def test_nan_in_source_model_is_refused_naming_the_tensor(tmp_path, tokenizer, capsys):
    from conftest import make_model_dir
    from safetensors.torch import load_file, save_file

    src = make_model_dir(tmp_path / "m", tokenizer)
    f = next(src.glob("*.safetensors"))
    t = load_file(str(f))
    t["model.layers.1.mlp.gate_proj.weight"][3, 5] = float("inf")
    save_file(t, str(f), metadata={"format": "pt"})
    code, _, err = run(["quantize", src, "-o", tmp_path / "o", "--algorithm", "rtn"], capsys)
    one_line_error(code, err, 2, "model.layers.1.mlp.gate_proj.weight")
    assert not (tmp_path / "o").exists()


def test_overflow_produced_by_quantization_is_refused(tmp_path, tokenizer, capsys):
    """A finite fp32 weight whose fp16 scale overflows: an input error (exit 2) naming the module and
    the dtypes that hold it, nothing is written."""
    from conftest import make_model_dir
    from safetensors.torch import load_file, save_file

    src = make_model_dir(tmp_path / "m", tokenizer)
    f = next(src.glob("*.safetensors"))
    t = load_file(str(f))
    t["model.layers.0.self_attn.o_proj.weight"][0, 0] = 1e30
    save_file(t, str(f), metadata={"format": "pt"})
    code, _, err = run(["quantize", src, "-o", tmp_path / "o", "--algorithm", "rtn", "--group-size", "32",
                        "--dtype", "float16"], capsys)
    one_line_error(code, err, 2, "model.layers.0.self_attn.o_proj")
    assert "bfloat16" in err
    assert not (tmp_path / "o").exists() and not [p for p in tmp_path.iterdir() if "kvq-tmp" in p.name]


# --- review fixes: passwords, certificates, signature messages ----------------------------

def _ec_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key, password: bytes | None = None, traditional: bool = False) -> Path:
    from cryptography.hazmat.primitives import serialization

    enc = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    fmt = serialization.PrivateFormat.TraditionalOpenSSL if traditional else serialization.PrivateFormat.PKCS8
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, fmt, enc))
    return path


def _write_pub(path: Path, key) -> Path:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def _write_cert(path: Path, subject_key, issuer_key, subject: str, issuer: str, ca: bool) -> Path:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
         .public_key(subject_key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
         .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                      data_encipherment=False, key_agreement=False, key_cert_sign=ca,
                                      crl_sign=ca, encipher_only=False, decipher_only=False), critical=True)
         .add_extension(x509.SubjectKeyIdentifier.from_public_key(subject_key.public_key()), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False))
    if not ca:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
    path.write_bytes(b.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    return path


@pytest.fixture(scope="module")
def cert_signed(tmp_path_factory, signed):
    """The signed artifact re-signed with a self-signed certificate (no --certificate-chain)."""
    d = tmp_path_factory.mktemp("cert")
    key = _ec_key()
    key_pem = _write_key(d / "leaf.key", key)
    cert = _write_cert(d / "self.pem", key, key, "kvq self-signed", "kvq self-signed", False)
    art = copy_folder(signed, d / "art")
    try:
        main(["sign", str(art), "--private-key", str(key_pem), "--signing-certificate", str(cert)])
    except SystemExit as e:
        assert e.code == 0
    return {"art": art, "cert": cert, "key": key_pem}


@pytest.mark.parametrize("traditional", [False, True], ids=["pkcs8", "openssl-traditional"])
def test_encrypted_private_key_signs_and_a_wrong_password_is_a_usage_error(signed, tmp_path, capsys, monkeypatch,
                                                                           traditional):
    monkeypatch.delenv("KVQ_SIGN_PASSWORD", raising=False)
    key = _ec_key()
    enc = _write_key(tmp_path / "enc.pem", key, b"s3cret", traditional)
    pub = _write_pub(tmp_path / "enc.pub.pem", key)
    art = copy_folder(signed, tmp_path / "a")
    code, _, err = run(["sign", art, "--private-key", enc, "--password", "s3cret"], capsys)
    assert code == 0, err
    code, out, err = run(["verify", art, "--hashes-only", "--public-key", pub, "--json"], capsys)
    assert code == 0 and json.loads(out)["signature"]["ok"] is True, err
    before = (art / SIGNATURE_NAME).read_bytes()
    for argv, pattern in ((["--password", "wrong"], "wrong password"), ([], "no password was given")):
        code, _, err = run(["sign", art, "--private-key", enc, *argv], capsys)
        one_line_error(code, err, 2, "password")
        assert pattern in err and "not a PEM" not in err and "internal error" not in err
    code, _, err = run(["sign", art, "--private-key", _write_key(tmp_path / "plain.pem", key), "--password", "x"], capsys)
    one_line_error(code, err, 2, "not encrypted")
    assert (art / SIGNATURE_NAME).read_bytes() == before


def test_certificate_signing_without_a_chain(cert_signed, signed, tmp_path, capsys):
    """Self-signed certificate, and a leaf issued directly by the verifier's CA: no chain needed."""
    code, out, err = run(["verify", cert_signed["art"], "--hashes-only", "--certificate-chain", cert_signed["cert"],
                          "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["signature"]["method"] == "certificate"
    ca_key, leaf_key = _ec_key(), _ec_key()
    ca = _write_cert(tmp_path / "ca.pem", ca_key, ca_key, "kvq CA", "kvq CA", True)
    leaf = _write_cert(tmp_path / "leaf.pem", leaf_key, ca_key, "kvq release", "kvq CA", False)
    art = copy_folder(signed, tmp_path / "a")
    code, _, err = run(["sign", art, "--private-key", _write_key(tmp_path / "leaf.key", leaf_key),
                        "--signing-certificate", leaf], capsys)
    assert code == 0, err
    code, _, err = run(["verify", art, "--hashes-only", "--certificate-chain", ca], capsys)
    assert code == 0, err
    code, out, _ = run(["verify", art, "--hashes-only", "--certificate-chain", cert_signed["cert"], "--json"], capsys)
    sig = json.loads(out)["signature"]
    assert code == 1 and "does not chain to --certificate-chain" in sig["error"]


def test_certificate_of_another_key_or_with_a_password_is_refused_up_front(signed, tiny_model_dir, tmp_path, capsys):
    key, other = _ec_key(), _ec_key()
    key_pem = _write_key(tmp_path / "k.pem", key)
    cert = _write_cert(tmp_path / "other.pem", other, other, "other", "other", False)
    art = copy_folder(signed, tmp_path / "a")
    before = (art / SIGNATURE_NAME).read_bytes()
    code, _, err = run(["sign", art, "--private-key", key_pem, "--signing-certificate", cert], capsys)
    one_line_error(code, err, 2, "does not match private key")
    out = tmp_path / "never"
    code, _, err = run(["quantize", tiny_model_dir, "-o", out, "--algorithm", "rtn", "--group-size", "32",
                        "--sign-key", key_pem, "--sign-certificate", cert], capsys)
    one_line_error(code, err, 2, "does not match private key")
    assert not out.exists()
    enc = _write_key(tmp_path / "enc.pem", key, b"pw")
    own = _write_cert(tmp_path / "own.pem", key, key, "own", "own", False)
    code, _, err = run(["sign", art, "--private-key", enc, "--password", "pw", "--signing-certificate", own], capsys)
    one_line_error(code, err, 2, "unencrypted private key")
    assert (art / SIGNATURE_NAME).read_bytes() == before


def test_signature_differences_are_short_lines(signed, keys, tmp_path, capsys):
    art = copy_folder(signed, tmp_path / "a")
    (art / "b.txt").write_text("b")
    (art / "a.txt").write_text("a")
    (art / "generation_config.json").unlink()
    _flip(art / "tokenizer.json", 5)
    code, out, err = run(["verify", art, "--hashes-only", "--public-key", keys["a"][1], "--json"], capsys)
    sig = json.loads(out)["signature"]
    assert code == 1 and sig["differences"] == ["added since signing: a.txt, b.txt",
                                                "removed since signing: generation_config.json",
                                                "changed since signing: tokenizer.json"]
    code, _, err = run(["verify", art, "--hashes-only", "--public-key", keys["a"][1]], capsys)
    assert "changed since signing: tokenizer.json" in err and "Digest(" not in err and "digest_value" not in err


def test_signature_checked_with_the_wrong_kind_of_key_material(signed, cert_signed, keys, capsys):
    for art, argv, pattern in ((cert_signed["art"], ["--public-key", keys["a"][1]], "made with a signing certificate"),
                               (signed, ["--certificate-chain", cert_signed["cert"]], "made with a private key")):
        code, out, err = run(["verify", art, "--hashes-only", *argv, "--json"], capsys)
        error = json.loads(out)["signature"]["error"]
        assert code == 1 and pattern in error and "key vs certificate" in error, error
        assert "NoneType" not in error and "certificates" not in error.split(":")[0]


@pytest.mark.parametrize("text", ["", "garbage", "[]", "{}", '{"mediaType": "x"}', '{"verificationMaterial": {}}',
                                  '{"verificationMaterial": {"publicKey": {}}, "dsseEnvelope": {}}',
                                  '{"verificationMaterial": {"publicKey": {"hint": 5}}, "dsseEnvelope": {"payload": 1}}',
                                  "[" * 100000])
def test_broken_model_sig_is_not_a_valid_bundle(signed, keys, tmp_path, capsys, text):
    art = copy_folder(signed, tmp_path / "a")
    (art / SIGNATURE_NAME).write_text(text)
    code, out, err = run(["verify", art, "--hashes-only", "--public-key", keys["a"][1], "--json"], capsys)
    assert code == 1 and "Traceback" not in err, err
    error = json.loads(out)["signature"]["error"]
    assert "is not a valid Sigstore bundle" in error, error
    for leak in ("Expecting value", "NoneType", "KeyError", "'verificationMaterial'", "object has no attribute"):
        assert leak not in error


def test_tampered_bundle_signature_does_not_verify_with_this_key(signed, keys, tmp_path, capsys):
    import base64

    art = copy_folder(signed, tmp_path / "a")
    bundle = json.loads((art / SIGNATURE_NAME).read_text())
    sig = bytearray(base64.b64decode(bundle["dsseEnvelope"]["signatures"][0]["sig"]))
    sig[10] ^= 1
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
    (art / SIGNATURE_NAME).write_text(json.dumps(bundle))
    code, out, _ = run(["verify", art, "--hashes-only", "--public-key", keys["a"][1], "--json"], capsys)
    assert code == 1 and json.loads(out)["signature"]["error"] == "signature does not verify with this public key"


def test_symlinked_model_sig_is_refused_not_missing(signed, keys, tmp_path, capsys):
    art = copy_folder(signed, tmp_path / "a")
    shutil.copy(art / SIGNATURE_NAME, tmp_path / "elsewhere.sig")
    (art / SIGNATURE_NAME).unlink()
    os.symlink(tmp_path / "elsewhere.sig", art / SIGNATURE_NAME)
    code, out, _ = run(["verify", art, "--hashes-only", "--public-key", keys["a"][1], "--json"], capsys)
    assert code == 1 and json.loads(out)["signature"]["error"] == f"{SIGNATURE_NAME} is a symlink (refused)"


def test_sigstore_offline_is_one_clear_line(signed, tmp_path, capsys, monkeypatch):
    import model_signing
    from sigstore.errors import TUFError

    def offline(self, **kwargs):
        raise TUFError("Failed to refresh TUF metadata")

    monkeypatch.setattr(model_signing.verifying.Config, "use_sigstore_verifier", offline)
    monkeypatch.setattr(model_signing.signing.Config, "use_sigstore_signer", offline)
    art = copy_folder(signed, tmp_path / "a")
    (art / SIGNATURE_NAME).write_text(json.dumps({"verificationMaterial": {"certificate": {"rawBytes": ""}},
                                                  "dsseEnvelope": {}}))
    code, out, err = run(["verify", art, "--hashes-only", "--identity", "me@example.com",
                          "--issuer", "https://accounts.example.com", "--json"], capsys)
    assert code == 1 and "Traceback" not in err
    assert json.loads(out)["signature"]["error"].startswith("cannot reach Sigstore (offline?): ")
    code, _, err = run(["sign", art, "--sigstore"], capsys)
    one_line_error(code, err, 1, "cannot reach Sigstore (offline?)")


# --- review fixes: manifest strictness ----------------------------------------------------

@pytest.mark.parametrize("edit", [
    lambda d: d["files"]["config.json"].update(size=str(d["files"]["config.json"]["size"])),
    lambda d: d["files"]["config.json"].update(size=float(d["files"]["config.json"]["size"])),
    lambda d: d["files"]["config.json"].update(size=True),
    lambda d: d["tensors"][next(iter(d["tensors"]))].update(shape=[float(x) for x in d["tensors"][next(iter(d["tensors"]))]["shape"]]),
    lambda d: d["tensors"][next(iter(d["tensors"]))].update(shape=["4"]),
    lambda d: d["tensors"][next(iter(d["tensors"]))].update(shape=[-1]),
], ids=["size-str", "size-float", "size-bool", "shape-float", "shape-str", "shape-negative"])
def test_manifest_sizes_and_shapes_must_be_non_negative_integers(signed, tmp_path, capsys, edit):
    art = copy_folder(signed, tmp_path / "a")
    _edit_manifest(art, edit)
    with pytest.raises(InputError, match=r"size|shape"):
        load_manifest(art)
    code, _, err = run(["verify", art, "--hashes-only"], capsys)
    one_line_error(code, err, 2, MANIFEST_NAME)


def test_duplicate_key_in_manifest_is_refused(signed, tmp_path, capsys):
    art = copy_folder(signed, tmp_path / "a")
    text = (signed / MANIFEST_NAME).read_text()
    assert '"digest_algorithm": "sha256"' in text
    (art / MANIFEST_NAME).write_text(text.replace('"digest_algorithm": "sha256"',
                                                  '"digest_algorithm": "blake3", "digest_algorithm": "sha256"', 1))
    with pytest.raises(InputError, match="duplicate key 'digest_algorithm'"):
        load_manifest(art)
    code, _, err = run(["verify", art, "--hashes-only"], capsys)
    one_line_error(code, err, 2, "duplicate key 'digest_algorithm'")


@pytest.mark.parametrize("text", ["[" * 100000, '{"a": ' * 100000])
def test_deeply_nested_manifest_or_header_is_an_input_error(signed, tmp_path, capsys, text):
    import struct

    art = copy_folder(signed, tmp_path / "a")
    (art / MANIFEST_NAME).write_text(text)
    with pytest.raises(InputError, match="nested too deeply"):
        load_manifest(art)
    code, _, err = run(["verify", art, "--hashes-only"], capsys)
    one_line_error(code, err, 2, "nested too deeply")
    f = tmp_path / "deep.safetensors"
    f.write_bytes(struct.pack("<Q", len(text)) + text.encode())
    with pytest.raises(InputError, match="nested too deeply"):
        read_header(f)


def test_unknown_version_names_the_versions_read(signed, tmp_path):
    art = copy_folder(signed, tmp_path / "a")
    _edit_manifest(art, lambda d: d.update(schema_version="kvq.manifest/3"))
    with pytest.raises(InputError, match="reads kvq.manifest/1 and kvq.manifest/2"):
        load_manifest(art)


def test_json_schema_has_digest_pattern_and_non_negative_integers():
    defs = json_schema()["$defs"]
    for rec in ("FileRecord", "TensorRecord"):
        assert defs[rec]["properties"]["digest"]["pattern"] == "^[0-9a-f]{64}$"
    assert defs["FileRecord"]["properties"]["size"] == {"minimum": 0, "title": "Size", "type": "integer"}
    assert defs["TensorRecord"]["properties"]["shape"]["items"] == {"minimum": 0, "type": "integer"}


# --- review fixes: tensor headers, overwrite, paths ---------------------------------------

def _edit_header(path: Path, fn) -> None:
    """Rewrite a safetensors header (offsets are relative to the data buffer, so its length may change)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    fn(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def _two_dim_tensor(header: dict, dtype: str) -> str:
    return next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == dtype
                and len(v["shape"]) == 2 and v["shape"][0] != v["shape"][1])


@pytest.mark.parametrize("what", ["dtype", "shape"])
def test_header_dtype_or_shape_edit_names_the_tensor(signed, tmp_path, capsys, what):
    art = copy_folder(signed, tmp_path / "a")
    f = art / "model.safetensors"
    name = _two_dim_tensor(json.loads(f.read_bytes()[8:8 + int.from_bytes(f.read_bytes()[:8], "little")]), "BF16")

    def edit(h):
        if what == "dtype":
            h[name]["dtype"] = "F16"  # same size: the data offsets still fit
        else:
            h[name]["shape"] = h[name]["shape"][::-1]
    _edit_header(f, edit)
    rep = check_hashes(art)
    assert rep["modified_tensors"] == [name] and rep["modified_files"] == ["model.safetensors"] and not rep["ok"]
    code, _, err = run(["verify", art, "--hashes-only"], capsys)
    assert code == 1 and f"modified tensor: {name}" in err


def test_tensor_renamed_in_header_is_a_rename(signed, tmp_path, capsys):
    art = copy_folder(signed, tmp_path / "a")
    old, new = "model.norm.weight", "model.norm.weight_renamed"
    _edit_header(art / "model.safetensors", lambda h: h.__setitem__(new, h.pop(old)))
    rep = check_hashes(art)
    assert rep["renamed_tensors"] == [f"{old} -> {new}"]
    assert rep["missing_tensors"] == [] and rep["extra_tensors"] == [] and not rep["ok"]
    code, out, err = run(["verify", art, "--hashes-only"], capsys)
    assert code == 1 and f"renamed tensor: {old} -> {new}" in err
    code, _, err = run(["sign", art, "--private-key", _write_key(tmp_path / "k.pem", _ec_key())], capsys)
    one_line_error(code, err, 1, "refusing to sign")


def test_overwrite_refuses_a_folder_that_is_not_a_kvq_artifact(signed, tiny_model_dir, tmp_path, capsys):
    from compressor.artifact import check_output

    out = tmp_path / "precious"
    out.mkdir()
    (out / "important.txt").write_text("keep me")
    code, _, err = run(["quantize", tiny_model_dir, "-o", out, "--algorithm", "rtn", "--group-size", "32",
                        "--overwrite"], capsys)
    one_line_error(code, err, 2, "is not a kvq artifact; refusing to overwrite it")
    assert (out / "important.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", overwrite=True)  # an empty folder may be replaced
    check_output(copy_folder(signed, tmp_path / "old-artifact"), overwrite=True)  # so may an earlier artifact


def test_artifact_path_that_is_a_file_is_named_as_such(signed, keys, tmp_path, capsys):
    f = tmp_path / "not-a-folder"
    f.write_text("x")
    code, _, err = run(["verify", f, "--hashes-only"], capsys)
    one_line_error(code, err, 2, "is not a folder")
    code, _, err = run(["sign", f, "--private-key", keys["a"][0]], capsys)
    one_line_error(code, err, 2, "is not a folder")
    code, _, err = run(["verify", tmp_path / "nowhere", "--hashes-only"], capsys)
    one_line_error(code, err, 2, "not found")


def test_key_paths_that_are_not_files(tmp_path):
    """A key path that exists but is no file (a folder, /dev/null) is named as such, not 'not found'."""
    from pathlib import Path

    from compressor.errors import InputError
    from compressor.signing import _readable

    with pytest.raises(InputError, match="not found"):
        _readable(tmp_path / "missing.pem", "private key")
    for p in (tmp_path, Path(os.devnull)):
        with pytest.raises(InputError, match="is not a file"):
            _readable(p, "private key")
