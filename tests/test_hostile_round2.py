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
