"""Hostile input and faults, round three (issue #46): a cache that vouches for what it never
checked, manifests that prove nothing, certificates outside their validity, inputs accepted at
quantize time that failed later as internal errors, resources that run out, a silent AWQ skip;
and the corpus of all of them, which must reach no internal error and no HTTP 500."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from compressor.manifest import MANIFEST_NAME, SIGNATURE_NAME, load_manifest
from conftest import assert_clean_error, copy_folder, make_model_dir, quantize_tiny, run_probe, unwrap
from tiny_models import tiny_gguf
from conftest import kvq_run as run

RTN = ["--algorithm", "rtn", "--group-size", "32"]


@pytest.fixture(scope="module")
def art(tmp_path_factory, src):
    """A tiny RTN artifact (unsigned)."""
    return quantize_tiny(tmp_path_factory.mktemp("round3-art") / "w4", src)


@contextlib.contextmanager
def _address_space_cap(extra: int = 1 << 30):
    """This process may map at most ``extra`` bytes more while the block runs (``RLIMIT_AS``'s
    soft limit, raised back after): a kvq that read ``/dev/zero`` without bound would stop at a
    MemoryError here, not take the machine's memory."""
    import resource

    from compressor.activations import address_space_left

    before = resource.getrlimit(resource.RLIMIT_AS)
    if address_space_left() is not None:  # already limited: leave it
        yield
        return
    used = int(Path("/proc/self/status").read_text().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (used + extra, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, before)


def _no_internal_error(code, err) -> None:
    assert code in (0, 1, 2) and "internal error" not in err and "Traceback" not in err, (code, err)


# --- 2. a manifest that lists nothing proves nothing -----------------------------------

def _rewrite_manifest(art: Path, edit) -> None:
    data = json.loads((art / MANIFEST_NAME).read_text())
    edit(data)
    (art / MANIFEST_NAME).write_text(json.dumps(data))


def _empty_lists(art: Path) -> None:
    """config.json and a manifest listing no file and no tensor."""
    for p in art.iterdir():
        if p.name not in ("config.json", MANIFEST_NAME):
            p.unlink()
    _rewrite_manifest(art, lambda d: (d["files"].clear(), d["tensors"].clear()))


def _only_manifest(art: Path) -> None:
    _empty_lists(art)
    (art / "config.json").unlink()


def _weights_removed(art: Path) -> None:
    """The weight files removed along with their entries (and their tensors')."""
    weights = [p.name for p in art.iterdir() if p.suffix == ".safetensors"]
    for name in weights:
        (art / name).unlink()

    def edit(d):
        for name in weights:
            d["files"].pop(name)
        d["tensors"] = {k: v for k, v in d["tensors"].items() if v["file"] not in weights}
    _rewrite_manifest(art, edit)


def _layer_removed(art: Path) -> None:
    """Decoder layer 1's tensors cut from the weight file and from the manifest: what is left
    matches the manifest, but is not the model config.json describes."""
    from safetensors.torch import load_file, save_file

    from compressor.integrity import build_manifest

    weights = art / "model.safetensors"
    kept = {k: v for k, v in load_file(str(weights)).items() if ".layers.1." not in k}
    save_file(kept, str(weights), metadata={"format": "pt"})
    old = load_manifest(art)
    fields = {k: getattr(old, k) for k in ("tool", "source", "recipe", "calibration", "quantization", "quality",
                                           "kv_cache", "format")}
    (art / MANIFEST_NAME).write_text(build_manifest(art, fields, digest_algorithm=old.digest_algorithm).to_json())


@pytest.mark.parametrize("damage, pattern", [
    (_empty_lists, "does not list config.json"),
    (_only_manifest, "does not list config.json"),
    (_weights_removed, "lists no weight file"),
    (_layer_removed, "lists no tensor of decoder layer 1"),
])
def test_a_manifest_that_covers_no_model_is_refused_by_verify_and_sign(art, keys, tmp_path, capsys, damage, pattern):
    a = copy_folder(art, tmp_path / "a")
    damage(a)
    code, _, err = run(["verify", a, "--hashes-only"], capsys)
    assert_clean_error(code, err, 1, pattern)
    assert "hashes ok" not in err and "is not a complete artifact" in err
    code, _, err = run(["sign", a, "--private-key", keys[0]], capsys)
    assert_clean_error(code, err, 1, pattern)
    assert "refusing to sign it" in err and not (a / SIGNATURE_NAME).exists()
    from compressor.errors import CheckFailed
    from compressor.load_integrity import open_for_serving

    if damage is not _layer_removed:  # the load refuses what the manifest lists before anything is read
        with pytest.raises(CheckFailed, match=pattern):
            open_for_serving(a)


def test_a_complete_artifact_still_verifies_and_signs(art, keys, tmp_path, capsys):
    a = copy_folder(art, tmp_path / "a")
    code, _, err = run(["sign", a, "--private-key", keys[0]], capsys)
    assert code == 0, err
    code, _, err = run(["verify", a, "--hashes-only", "--public-key", keys[1]], capsys)
    assert code == 0 and "hashes ok" in err and "signature ok" in err, err


# --- 3. certificates outside their validity ---------------------------------------------

def _ec_key(path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return key


def _certificate(path: Path, key, name: str, days: tuple[float, float], issuer=None, ca: bool = False) -> Path:
    """A certificate for ``key`` valid from now + ``days[0]`` to now + ``days[1]`` days, issued by
    ``issuer`` (``(key, name)``) or self-signed; a CA certificate, or a code-signing leaf."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer_key, signer_name = issuer if issuer is not None else (key, name)
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(subject)
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, signer_name)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now + datetime.timedelta(days=days[0])).not_valid_after(now + datetime.timedelta(days=days[1]))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                          crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
    path.write_bytes(b.sign(signer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    return path


def _signed_anyway(art: Path, monkeypatch, **sign) -> None:
    """Sign ``art`` with the validity check switched off: a model.sig another tool (or an older
    kvq) made with a certificate outside its validity."""
    import compressor.signing as sg

    with monkeypatch.context() as m:
        m.setattr(sg, "validity_problem", lambda *a, **k: None)
        sg.sign_folder(art, sg.SignOptions(**sign))


@pytest.mark.parametrize("days, pattern", [((-30, -1), "expired on"), ((10, 40), "is not valid yet")])
def test_a_leaf_certificate_outside_its_validity(src, art, tmp_path, monkeypatch, capsys, days, pattern):
    key_pem = tmp_path / "key.pem"
    leaf = _certificate(tmp_path / "leaf.pem", _ec_key(key_pem), "round3 leaf", days)
    a = copy_folder(art, tmp_path / "a")
    code, _, err = run(["sign", a, "--private-key", key_pem, "--signing-certificate", leaf], capsys)
    assert_clean_error(code, err, 2, pattern)
    assert f"signing certificate {leaf}" in err and not (a / SIGNATURE_NAME).exists()
    out = tmp_path / "never"
    import compressor.commands.quantize as q

    monkeypatch.setattr(q, "open_lazy", lambda *a, **k: pytest.fail("loaded before the refusal"))
    code, _, err = run(["quantize", src, "-o", out, *RTN, "--sign-key", key_pem, "--sign-certificate", leaf], capsys)
    assert_clean_error(code, err, 2, pattern, tmp_path)
    assert not out.exists()
    monkeypatch.undo()
    _signed_anyway(a, monkeypatch, private_key=key_pem, signing_certificate=leaf)
    code, out_, err = run(["verify", a, "--hashes-only", "--certificate-chain", leaf, "--json"], capsys)
    sig = json.loads(out_)["signature"]
    assert code == 1 and sig["ok"] is False and pattern in sig["error"] and "the signing certificate (CN=round3 leaf)" \
        in sig["error"], (code, err)
    code, _, err = run(["verify", a, "--hashes-only", "--certificate-chain", leaf], capsys)
    assert code == 1 and "signature FAILED" in err and "signature ok" not in err and pattern in unwrap(err), err


def test_a_chain_certificate_not_valid_yet_is_named(art, tmp_path, monkeypatch, capsys):
    ca_key = _ec_key(tmp_path / "ca-key.pem")
    ca = _certificate(tmp_path / "ca.pem", ca_key, "round3 CA", (10, 400), ca=True)
    key_pem = tmp_path / "key.pem"
    leaf = _certificate(tmp_path / "leaf.pem", _ec_key(key_pem), "round3 leaf", (-1, 30), issuer=(ca_key, "round3 CA"))
    a = copy_folder(art, tmp_path / "a")
    code, _, err = run(["sign", a, "--private-key", key_pem, "--signing-certificate", leaf, "--certificate-chain", ca],
                       capsys)
    assert_clean_error(code, err, 2, "certificate CN=round3 CA in")
    assert "is not valid yet" in err and not (a / SIGNATURE_NAME).exists()
    _signed_anyway(a, monkeypatch, private_key=key_pem, signing_certificate=leaf, certificate_chain=(ca,))
    code, _, err = run(["verify", a, "--hashes-only", "--certificate-chain", ca], capsys)
    flat = unwrap(err)
    assert code == 1 and "certificate 2 of model.sig's chain (CN=round3 CA) is not valid yet" in flat, err


def test_certificates_within_their_validity_sign_and_verify(art, tmp_path, capsys):
    ca_key = _ec_key(tmp_path / "ca-key.pem")
    ca = _certificate(tmp_path / "ca.pem", ca_key, "round3 CA", (-10, 400), ca=True)
    key_pem = tmp_path / "key.pem"
    leaf = _certificate(tmp_path / "leaf.pem", _ec_key(key_pem), "round3 leaf", (-1, 30), issuer=(ca_key, "round3 CA"))
    a = copy_folder(art, tmp_path / "a")
    code, _, err = run(["sign", a, "--private-key", key_pem, "--signing-certificate", leaf, "--certificate-chain", ca],
                       capsys)
    assert code == 0, err
    code, _, err = run(["verify", a, "--hashes-only", "--certificate-chain", ca], capsys)
    assert code == 0 and "signature ok (certificate)" in err, err


# --- 4. inputs accepted at quantize time that failed later as internal errors ------------

@pytest.fixture(scope="module")
def moe_src(tmp_path_factory, tokenizer):
    from tiny_models import make_dir

    return make_dir(tmp_path_factory.mktemp("round3-moe") / "deepseek", tokenizer, "deepseek_v3")


@pytest.fixture(scope="module")
def mistral_src(tmp_path_factory, tokenizer):
    from tiny_models import make_dir

    return make_dir(tmp_path_factory.mktemp("round3-mistral") / "mistral", tokenizer, "mistral")


@pytest.mark.parametrize("fields, pattern", [
    ({"n_group": 3}, "n_group = 3 does not divide the 4 experts"),
    ({"n_group": 4}, "n_group = 4 does not divide the 4 experts into groups of at least two"),
    ({"topk_group": 3}, "topk_group = 3 is out of range (1 .. 2: n_group = 2)"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok = 9 is out of range (1 .. 4: the 4 experts)"),
    ({"num_experts_per_tok": 3}, "num_experts_per_tok = 3 but the topk_group = 1 groups kept hold 2 experts"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok must be a whole number (1 .. 4), got null"),
])
def test_router_fields_that_contradict_the_experts_are_refused(moe_src, tmp_path, monkeypatch, capsys, fields, pattern):
    bad = copy_folder(moe_src, tmp_path / "m", **fields)
    import compressor.commands.quantize as q

    monkeypatch.setattr(q, "open_lazy", lambda *a, **k: pytest.fail("loaded before the refusal"))
    code, _, err = run(["quantize", bad, "-o", tmp_path / "o", *RTN], capsys)
    assert_clean_error(code, err, 2, pattern, tmp_path)
    assert "config.json" in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("window", [-1, 0, 2.5])
def test_a_sliding_window_that_is_no_window_is_refused(mistral_src, tmp_path, capsys, window):
    bad = copy_folder(mistral_src, tmp_path / "m", sliding_window=window)
    code, _, err = run(["quantize", bad, "-o", tmp_path / "o", *RTN], capsys)
    assert_clean_error(code, err, 2, "sliding_window", tmp_path)
    assert not (tmp_path / "o").exists()


def test_the_routing_check_runs_on_transformers_defaults_and_at_load(moe_src, tmp_path):
    """A config that leaves n_group to transformers (DeepSeek-V3's default is 8 groups) is
    checked as the model is built; an artifact whose config contradicts its experts is refused
    by verify's and the runtime's loaders (one line, not a RuntimeError inside the router)."""
    from transformers import AutoConfig

    from compressor.errors import InputError
    from compressor.source.resolve import check_buildable
    from compressor.runtime.model import DecoderSpec

    bad = copy_folder(moe_src, tmp_path / "m")
    cfg = json.loads((bad / "config.json").read_text())
    cfg.pop("n_group")
    (bad / "config.json").write_text(json.dumps(cfg))
    built = AutoConfig.from_pretrained(bad)
    with pytest.raises(InputError, match="n_group = 8"):
        check_buildable(built, str(bad))
    with pytest.raises(InputError, match="n_group = 8"):
        DecoderSpec.from_config(built, kv="mla")


def _with_added_token(folder: Path, token: str = "<round3-extra>") -> int:
    """Add ``token`` to the tokenizer saved in ``folder`` (its id: one past the embedding)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens([token])
    tok.save_pretrained(str(folder))
    return tok.convert_tokens_to_ids(token)


def test_a_tokenizer_beyond_the_embedding_is_refused_at_quantize_time(src, tmp_path, capsys):
    bad = copy_folder(src, tmp_path / "m")
    rows = json.loads((bad / "config.json").read_text())["vocab_size"]
    assert _with_added_token(bad) == rows
    code, _, err = run(["quantize", bad, "-o", tmp_path / "o", *RTN], capsys)
    assert_clean_error(code, err, 2, f"token '<round3-extra>' has id {rows}, beyond the model's embedding of {rows} rows",
                       tmp_path)
    assert "tokenizer" in err and not (tmp_path / "o").exists()


def test_a_served_tokenizer_beyond_the_embedding_is_refused_before_the_port_opens(art, tmp_path, monkeypatch, capsys):
    import compressor.runtime.server as server

    nm = copy_folder(art, tmp_path / "nm")
    (nm / MANIFEST_NAME).unlink()
    _with_added_token(nm)
    monkeypatch.setattr(server, "Server", lambda *a, **k: pytest.fail("the port opened"))
    code, _, err = run(["serve", nm, "--port", "0", "--no-manifest"], capsys)
    assert_clean_error(code, err, 2, "beyond the model's embedding")
    code, _, err = run(["verify", nm, "--no-manifest", "--reference", art, "--weights-only"], capsys)
    assert_clean_error(code, err, 2, "beyond the model's embedding")
    code, _, err = run(["quantize", nm, "--recipe", "kv-int8", "-o", tmp_path / "kv"], capsys)  # a KV-only run on it
    assert_clean_error(code, err, 2, "beyond the model's embedding", tmp_path)


def test_a_request_beyond_the_vocabulary_is_a_400_not_a_500(art, tmp_path):
    """Whatever the tokenizer in front of the engine produces, an id beyond the embedding is the
    request's problem: 400 in OpenAI's shape, and the server keeps serving."""
    import httpx
    from transformers import AutoTokenizer

    from compressor.runtime import Runtime
    from compressor.runtime.server import Engine, Server

    tok = AutoTokenizer.from_pretrained(str(art))
    tok.add_tokens(["<round3-extra>"])
    eng = Engine(Runtime.from_artifact(art, kv="artifact"), tok, "tiny")
    srv = Server(eng, "127.0.0.1").start()
    try:
        for path, body in (("/v1/completions", {"prompt": "a <round3-extra> b", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "<round3-extra>"}],
                                                     "max_tokens": 2})):
            r = httpx.post(srv.url + path, json=body, timeout=60)
            assert r.status_code == 400 and "beyond the model's" in r.json()["error"]["message"], r.text
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a b", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
        eng.close()


# --- 6. a silent skip ----------------------------------------------------------------------

def test_awq_says_and_records_the_gqa_group_it_leaves_unscaled(src, tmp_path, capsys):
    """The tiny model has 4 query heads over 2 KV heads: AWQ does not scale v_proj -> o_proj
    there (GQA_V_TO_O); each layer's figures name the group and why, the run warns, and the
    manifest keeps both."""
    from compressor.quant import awq_layer

    assert awq_layer.GQA_V_TO_O is False
    out = tmp_path / "awq"
    code, stdout, err = run(["quantize", src, "-o", out, "--algorithm", "awq", "--group-size", "32",
                             "--calib-samples", "4", "--calib-seqlen", "32", "--json"], capsys)
    assert code == 0, err
    warned = [w for w in json.loads(stdout)["warnings"] if "unscaled" in w]
    assert len(warned) == 1 and "self_attn.v_proj -> self_attn.o_proj unscaled in 2 of 2 layer(s) (layers 0-1)" in \
        warned[0] and "2 query heads read each of the 2 KV heads" in warned[0], warned
    quality = load_manifest(out).quality
    assert warned[0] in quality["warnings"]
    for f in quality["layers"]:
        assert list(f["awq_skipped"]) == ["self_attn.v_proj -> self_attn.o_proj"]
        assert "self_attn.v_proj" not in f["awq_ratios"] and "post_attention_layernorm" in f["awq_ratios"]
    code, _, err = run(["quantize", src, "-o", tmp_path / "awq2", "--algorithm", "awq", "--group-size", "32",
                        "--calib-samples", "4", "--calib-seqlen", "32"], capsys)
    assert code == 0 and "self_attn.v_proj -> self_attn.o_proj unscaled" in unwrap(err), err


def test_awq_on_full_attention_scales_every_group_and_says_nothing(tmp_path, tokenizer, capsys):
    mha = make_model_dir(tmp_path / "mha", tokenizer, num_key_value_heads=4)
    out = tmp_path / "awq"
    code, stdout, err = run(["quantize", mha, "-o", out, "--algorithm", "awq", "--group-size", "32",
                             "--calib-samples", "4", "--calib-seqlen", "32", "--json"], capsys)
    assert code == 0, err
    assert not [w for w in json.loads(stdout)["warnings"] if "unscaled" in w]
    assert all("awq_skipped" not in f and "self_attn.v_proj" in f["awq_ratios"] for f in load_manifest(out).quality["layers"])


# --- 1. a second copy of the source is trusted as the source ----------------------------

@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, tokenizer):
    return tiny_gguf(tmp_path_factory.mktemp("round3-gguf") / "tiny.gguf", tokenizer)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """kvq's GGUF cache, and the key outside it, in this test's folder."""
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVQ_CACHE_KEY_FILE", str(tmp_path / "config" / "cache-key"))
    return tmp_path / "cache"


def _entry(cache: Path) -> Path:
    (entry,) = [p for p in (cache / "gguf").iterdir() if not p.name.startswith(".")]
    return entry


def _poison(entry: Path) -> None:
    """What anyone who can write the cache can do: change a cached tensor and rewrite its BLAKE3
    in the entry's index."""
    from safetensors.torch import load_file, save_file

    from compressor.source.gguf_cache import GGUF_CACHE_INDEX
    from compressor.safetensors_io import file_digest

    weights = entry / "model.safetensors"
    state = load_file(str(weights))
    name = "model.layers.0.self_attn.o_proj.weight"
    state[name] = state[name] * 3
    save_file(state, str(weights), metadata={"format": "pt"})
    index = json.loads((entry / GGUF_CACHE_INDEX).read_text())
    index["files"]["model.safetensors"] = file_digest(weights, "blake3")
    (entry / GGUF_CACHE_INDEX).write_text(json.dumps(index))


def test_a_poisoned_gguf_cache_entry_is_never_read_as_the_gguf(gguf_file, cache, tmp_path, capsys):
    code, _, err = run(["quantize", gguf_file, "-o", tmp_path / "clean", *RTN], capsys)
    assert code == 0, err
    _poison(_entry(cache))
    code, out, err = run(["quantize", gguf_file, "-o", tmp_path / "again", *RTN, "--json"], capsys)
    assert code == 0, err
    warned = [w for w in json.loads(out)["warnings"] if "failed its check" in w]
    assert len(warned) == 1 and "not the one kvq wrote with this user's cache key" in warned[0], warned
    clean, again = load_manifest(tmp_path / "clean"), load_manifest(tmp_path / "again")
    assert again.tensors == clean.tensors and again.source == clean.source  # the GGUF's weights, as its SHA-256 claims
    _poison(_entry(cache))  # the run above converted again; poison the new entry too
    code, out, err = run(["verify", tmp_path / "clean", "--weights-only", "--json"], capsys)
    poisoned = json.loads(out)
    assert code == 0 and poisoned["reference_matches_source"] is True, err
    assert [w for w in poisoned["warnings"] if "failed its check" in w], poisoned["warnings"]
    code, out, err = run(["verify", tmp_path / "clean", "--weights-only", "--json"], capsys)  # the entry is sound now
    sound = json.loads(out)
    assert code == 0 and not [w for w in sound["warnings"] if "failed its check" in w]
    assert poisoned["weights"]["tensors"] == sound["weights"]["tensors"]  # the reference was the GGUF's both times


def test_the_cache_key_lives_outside_the_cache_and_is_checked(gguf_file, cache, tmp_path, monkeypatch):
    import os

    from compressor.source.gguf_cache import CACHE_KEY_BYTES, cache_key_file, cached_gguf_folder, take_cache_notes
    from compressor.source.open import load_model
    from compressor.source.resolve import resolve_source

    src = resolve_source(str(gguf_file))
    take_cache_notes()
    load_model(src)  # converted, stored, its index authenticated with a key made now
    key = cache_key_file()
    assert cache not in key.parents and key.stat().st_mode & 0o777 == 0o600 and key.stat().st_size == CACHE_KEY_BYTES
    assert cached_gguf_folder(src) is not None and take_cache_notes() == []
    other = tmp_path / "other-key"  # an entry made with another key: another user's or machine's cache, copied in
    other.write_bytes(os.urandom(CACHE_KEY_BYTES))
    other.chmod(0o600)
    monkeypatch.setenv("KVQ_CACHE_KEY_FILE", str(other))
    assert cached_gguf_folder(src) is None and "not the one kvq wrote" in take_cache_notes()[0]
    monkeypatch.setenv("KVQ_CACHE_KEY_FILE", str(key))
    key.chmod(0o644)  # a key others can read vouches for nothing
    assert cached_gguf_folder(src) is None and "open to others" in take_cache_notes()[0]
    key.chmod(0o600)
    assert cached_gguf_folder(src) is not None and take_cache_notes() == []


# --- 5. resources that run out ------------------------------------------------------------

def test_a_full_disk_while_the_gguf_cache_is_written_falls_back(gguf_file, cache, tmp_path, monkeypatch, capsys):
    """The cache is best effort: safetensors' own error for a full disk (not an OSError) is a
    warning naming the folder, and the run loads the converted model whole."""
    from safetensors import SafetensorError
    from transformers import LlamaForCausalLM

    def full(self, *a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", full)
    code, out, err = run(["quantize", gguf_file, "-o", tmp_path / "o", *RTN, "--json"], capsys)
    _no_internal_error(code, err)
    assert code == 0, err
    warned = [w for w in json.loads(out)["warnings"] if "could not be stored in kvq's cache" in w]
    assert warned and "no space left on the device" in warned[0], json.loads(out)["warnings"]
    assert json.loads(out)["source_loading"].startswith("whole model")


def test_a_full_disk_during_the_artifact_write_is_one_line(src, tmp_path, monkeypatch, capsys):
    import safetensors.torch
    from safetensors import SafetensorError

    real = safetensors.torch.save_file

    def full(tensors, filename, *a, **k):
        if "part-final" in str(filename):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "o"
    code, _, err = run(["quantize", src, "-o", out, *RTN], capsys)
    assert_clean_error(code, err, 2, "no space left on the device", tmp_path)
    assert f"cannot write the artifact {out}" in unwrap(err) and "nothing was written" in err and not out.exists()
    assert "--resume" in err  # the finished layers are kept


def test_the_file_size_limit_during_the_write_is_one_line(src, tmp_path):
    """A real RLIMIT_FSIZE (SIGXFSZ ignored, as a shell's ``ulimit -f`` leaves it for a job that
    handles it): the first write past it fails with EFBIG inside safetensors' Rust code."""
    out = tmp_path / "o"
    r = run_probe(tmp_path, (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))\n"
        f"sys.argv = ['kvq', 'quantize', {str(src)!r}, '-o', {str(out)!r}, '--algorithm', 'rtn', '--group-size', '32']\n"
        "from compressor.entry import main\n"
        "main()\n"))
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("kvq: error:") and "file-size limit" in last, (r.returncode, r.stderr)
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr and not out.exists()


def test_a_million_calibration_samples_under_an_address_space_limit_are_refused_up_front(src, tmp_path):
    """--calib-samples 1000000 x 32 tokens on the tiny model: 7.6 GiB a copy. Under ``ulimit -v``
    the two copies a layer holds (a spilled one is mapped, which takes address space too) are
    refused by the plan, before any work, in one line naming the limit."""
    r = run_probe(tmp_path, (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
        f"sys.argv = ['kvq', 'quantize', {str(src)!r}, '-o', {str(tmp_path / 'o')!r}, '--algorithm', 'gptq',\n"
        "            '--group-size', '32', '--calib-samples', '1000000', '--calib-seqlen', '32']\n"
        "import compressor.commands.quantize as q\n"
        "q.open_lazy = q.load_model = lambda *a, **k: sys.exit('loaded before the refusal')\n"
        "from compressor.entry import main\n"
        "main()\n"))
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("kvq: error:") and "lower --calib-samples" in last, (r.returncode, r.stderr)
    assert "address space" in last or "of memory" in last  # a machine with less memory refuses it on memory first


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_a_recipe_that_is_no_file_is_refused_at_once(src, tmp_path, capsys, kind):
    import os
    import signal

    if kind == "fifo":
        recipe = tmp_path / "r.yaml"
        os.mkfifo(recipe)  # nobody writes to it: opening it to read would wait for ever
    elif kind == "device":
        recipe = Path("/dev/zero")
    else:
        recipe = tmp_path / "r.yaml"
        with open(recipe, "wb") as f:
            f.truncate(2 << 20)
    def waited(*_):
        raise TimeoutError("kvq waited on the recipe")

    previous = signal.signal(signal.SIGALRM, waited)
    signal.alarm(60)
    try:
        with _address_space_cap():
            code, _, err = run(["quantize", src, "-o", tmp_path / "o", "--recipe", recipe], capsys)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert_clean_error(code, err, 2, {"fifo": "is a FIFO", "device": "is a device", "huge": "above the"}[kind], tmp_path)
    assert "out of memory" not in err


def test_prompts_from_a_device_or_a_silent_pipe_are_bounded(art, tmp_path, monkeypatch, capsys):
    """Prompts may come through a pipe (``<(...)``), so a pipe is read, but bounded: /dev/zero
    stops at the size limit, and a FIFO nobody writes to is refused after a wait."""
    import os

    import compressor.files as files

    with _address_space_cap():
        code, _, err = run(["verify", art, "--prompts", "/dev/zero", "--max-windows", "1"], capsys)
    assert_clean_error(code, err, 2, "holds more than")
    fifo = tmp_path / "p.fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(files, "PIPE_WAIT_S", 1)
    code, _, err = run(["verify", art, "--prompts", fifo, "--max-windows", "1"], capsys)
    assert_clean_error(code, err, 2, "is a FIFO (named pipe) that nothing was written to in 1 s")


# --- the corpus: every hostile input of this round, no internal error, no HTTP 500 --------

def _corpus(tmp: Path, src: Path, art: Path, moe_src: Path, mistral_src: Path, keys) -> dict[str, list]:
    """Case name -> the kvq command lines it runs, each input built under ``tmp``. (The
    resource limits that need a process of their own -- ``ulimit -f``, ``ulimit -v`` -- and the
    GGUF cache cases are run by their own tests above, which assert the same.)"""
    import os

    cases: dict[str, list] = {}
    for damage in (_empty_lists, _only_manifest, _weights_removed, _layer_removed):
        a = copy_folder(art, tmp / damage.__name__)
        damage(a)
        cases[damage.__name__] = [["verify", a, "--hashes-only"], ["sign", a, "--private-key", keys[0]],
                                  ["serve", a, "--port", "0"]]
    for name, days in (("expired", (-30, -1)), ("not-yet", (10, 40))):
        key_pem = tmp / f"{name}-key.pem"
        leaf = _certificate(tmp / f"{name}.pem", _ec_key(key_pem), name, days)
        cases[f"leaf-{name}"] = [["sign", copy_folder(art, tmp / f"sign-{name}"), "--private-key", key_pem,
                                  "--signing-certificate", leaf],
                                 ["quantize", src, "-o", tmp / f"q-{name}", *RTN, "--sign-key", key_pem,
                                  "--sign-certificate", leaf]]
    for k, fields in enumerate(({"n_group": 3}, {"n_group": 4}, {"topk_group": 3}, {"num_experts_per_tok": 9},
                                {"num_experts_per_tok": 3})):
        cases[f"router-{k}"] = [["quantize", copy_folder(moe_src, tmp / f"router-{k}", **fields), "-o",
                                 tmp / f"router-{k}-o", *RTN]]
    cases["sliding-window"] = [["quantize", copy_folder(mistral_src, tmp / "window", sliding_window=-1), "-o",
                                tmp / "window-o", *RTN]]
    bad_tok = copy_folder(src, tmp / "tok")
    _with_added_token(bad_tok)
    nm = copy_folder(art, tmp / "nm")
    (nm / MANIFEST_NAME).unlink()
    _with_added_token(nm)
    nm_window = copy_folder(art, tmp / "nm-window", sliding_window=-1)
    (nm_window / MANIFEST_NAME).unlink()
    cases["tokenizer"] = [["quantize", bad_tok, "-o", tmp / "tok-o", *RTN], ["serve", nm, "--port", "0", "--no-manifest"],
                          ["verify", nm, "--no-manifest", "--reference", src, "--weights-only"],
                          ["serve-smoke", nm, "--no-manifest", "--reference", src],
                          ["quantize", nm, "--recipe", "kv-int8", "-o", tmp / "nm-kv"]]
    cases["artifact-window"] = [["verify", nm_window, "--no-manifest", "--reference", src, "--weights-only"],
                                ["serve", nm_window, "--port", "0", "--no-manifest"]]
    fifo = tmp / "fifo.yaml"
    os.mkfifo(fifo)
    huge = tmp / "huge.yaml"
    with open(huge, "wb") as f:
        f.truncate(2 << 20)
    cases["recipes"] = [["quantize", src, "-o", tmp / "r-o", "--recipe", r] for r in (fifo, "/dev/zero", huge)]
    cases["prompts"] = [["verify", art, "--prompts", "/dev/zero", "--max-windows", "1"]]
    return cases


def test_the_hostile_corpus_reaches_no_internal_error(src, art, moe_src, mistral_src, keys, tmp_path, monkeypatch,
                                                      capsys):
    import signal

    import compressor.runtime.server as server

    monkeypatch.setattr(server, "Server", lambda *a, **k: pytest.fail("a hostile input opened the port"))

    def waited(*_):
        raise TimeoutError("kvq waited on an input")

    previous = signal.signal(signal.SIGALRM, waited)
    try:
        for name, argvs in _corpus(tmp_path, src, art, moe_src, mistral_src, keys).items():
            for argv in argvs:
                signal.alarm(120)
                with _address_space_cap(4 << 30):
                    code, _, err = run(argv, capsys)
                signal.alarm(0)
                assert code in (1, 2), (name, argv, code, err)
                assert_clean_error(code, err, code, "")
                assert "internal error" not in err, (name, argv, err)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_the_hostile_requests_reach_no_http_500(art):
    """Requests about the model's own vocabulary, through a tokenizer that gives ids past the
    embedding: every answer is a 4xx or a 200, none a 500, and the server keeps serving."""
    import httpx
    from transformers import AutoTokenizer

    from compressor.runtime import Runtime
    from compressor.runtime.server import Engine, Server

    tok = AutoTokenizer.from_pretrained(str(art))
    tok.add_tokens(["<round3-a>", "<round3-b>"])
    eng = Engine(Runtime.from_artifact(art, kv="artifact"), tok, "tiny")
    srv = Server(eng, "127.0.0.1").start()
    bodies = [("/v1/completions", {"prompt": p, "max_tokens": 2})
              for p in ("<round3-a>", ["ok", "<round3-b> x"], "x" * 10 + "<round3-a>", "", "plain")]
    bodies += [("/v1/chat/completions", {"messages": [{"role": r, "content": c}], "max_tokens": 2})
               for r, c in (("user", "<round3-b>"), ("system", "<round3-a><round3-b>"), ("user", "fine"))]
    try:
        for path, body in bodies:
            r = httpx.post(srv.url + path, json=body, timeout=60)
            assert r.status_code != 500 and r.status_code < 500, (body, r.status_code, r.text)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        srv.stop()
        eng.close()


@pytest.mark.parametrize("flag", ["--calib", "--eval"])
def test_a_text_source_that_is_no_file_is_named_as_what_it_is(src, art, tmp_path, capsys, flag):
    """A FIFO or a device as the calibration or evaluation text: named as what it is (it exists),
    never "not found", and never read."""
    import os

    fifo = tmp_path / "text.txt"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "is a FIFO"), (Path("/dev/zero"), "is a device")):
        argv = (["quantize", src, "-o", tmp_path / "o", *RTN, "--recipe", "kv-fp8", "--calib", path] if flag == "--calib"
                else ["verify", art, "--eval", path, "--max-windows", "1", "--seqlen", "64"])
        code, _, err = run(argv, capsys)
        assert_clean_error(code, err, 2, kind, tmp_path)
        assert "not found" not in err


def test_a_missing_output_parent_is_created(src, tmp_path, capsys):
    """``-o out/model`` in a fresh checkout (the README's examples): the parent folder is made."""
    out = tmp_path / "out" / "nested" / "model"
    code, _, err = run(["quantize", src, "-o", out, *RTN], capsys)
    assert code == 0, err
    assert (out / "kvq-manifest.json").is_file()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = run(["quantize", src, "-o", blocker / "model", *RTN], capsys)
    assert_clean_error(code, err, 2, "is not a folder")
