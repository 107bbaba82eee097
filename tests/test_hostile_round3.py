"""Hostile input and faults, round three (issue #46): a cache that vouches for what it never
checked, manifests that prove nothing, certificates outside their validity, inputs accepted at
quantize time that failed later as internal errors, resources that run out, a silent AWQ skip;
and the corpus of all of them, which must reach no internal error and no HTTP 500."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compressor.manifest import MANIFEST_NAME, SIGNATURE_NAME, load_manifest
from conftest import assert_clean_error, make_model_dir, quantize_tiny
from conftest import kvq_run as run
from test_hostile_round2 import _copy, _flat, keys, src  # noqa: F401 (fixtures: a tiny model, a key pair)
from test_runtime import _copy_model

RTN = ["--algorithm", "rtn", "--group-size", "32"]


@pytest.fixture(scope="module")
def art(tmp_path_factory, src):
    """A tiny RTN artifact (unsigned)."""
    return quantize_tiny(tmp_path_factory.mktemp("round3-art") / "w4", src)


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
    a = _copy(art, tmp_path / "a")
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
    a = _copy(art, tmp_path / "a")
    code, _, err = run(["sign", a, "--private-key", keys[0]], capsys)
    assert code == 0, err
    code, _, err = run(["verify", a, "--hashes-only", "--public-key", keys[1]], capsys)
    assert code == 0 and "hashes ok" in err and "signature ok" in err, err
