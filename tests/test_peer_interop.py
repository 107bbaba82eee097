"""What the peer benchmark (issue #8) relies on: pre-tokenized calibration files and
`kvq verify --no-manifest` for artifacts another tool wrote."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from compressor.calib import load_text, sample_windows, tokenize
from compressor.manifest import load_manifest

from conftest import kvq_run as run

EVAL = ["--seqlen", "64", "--max-windows", "3", "--max-new-tokens", "4", "--hidden-batches", "1"]


@pytest.fixture(scope="module")
def calib_ids(tokenizer):
    """The windows `--calib embedded --calib-samples 4 --calib-seqlen 32 --seed 0` draws."""
    return sample_windows(tokenize(tokenizer, load_text("embedded").text), 4, 32, 0)


@pytest.fixture(scope="module")
def gptq_pair(tmp_path_factory, tiny_model_dir, calib_ids):
    """The same GPTQ quantization fed text (kvq samples the windows) and the same windows as token ids."""
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize

    d = tmp_path_factory.mktemp("peer")
    ids_file = d / "calib.safetensors"
    save_file({"input_ids": calib_ids.to(torch.int32).contiguous()}, str(ids_file))  # any integer dtype
    common = dict(model=str(tiny_model_dir), algorithm="gptq", group_size=32, calib_samples=4, calib_seqlen=32)
    run_quantize(QuantizeOptions(output=d / "from-text", calib="embedded", **common))
    run_quantize(QuantizeOptions(output=d / "from-ids", calib=str(ids_file), **common))
    return d, ids_file


def test_token_file_calibration_equals_text_calibration(gptq_pair):
    d, ids_file = gptq_pair
    a, b = load_manifest(d / "from-text"), load_manifest(d / "from-ids")
    assert {n: t.digest for n, t in a.tensors.items()} == {n: t.digest for n, t in b.tensors.items()}
    cal = b.calibration
    assert (cal["samples"], cal["seqlen"], cal["note"]) == (4, 32, "pre-tokenized input_ids")
    assert cal["source"] == str(ids_file)
    import hashlib

    assert cal["sha256"] == hashlib.sha256(ids_file.read_bytes()).hexdigest()


@pytest.mark.parametrize("tensors, words", [
    ({"input_ids": torch.full((2, 8), 10**6, dtype=torch.int64)}, "outside the model's vocabulary"),
    ({"input_ids": torch.full((2, 8), -1, dtype=torch.int64)}, "negative token id -1"),
    ({"input_ids": torch.zeros(2, 8)}, "must be an integer"),
    ({"input_ids": torch.zeros(16, dtype=torch.int64)}, "must be an integer [n_samples >= 1, seqlen >= 2]"),
    ({"input_ids": torch.zeros(2, 8, dtype=torch.int64), "labels": torch.zeros(2, 8, dtype=torch.int64)}, "one tensor 'input_ids'"),
    ({"tokens": torch.zeros(2, 8, dtype=torch.int64)}, "found: tokens"),
])
def test_bad_token_files(tmp_path, tiny_model_dir, capsys, tensors, words):
    f = tmp_path / "ids.safetensors"
    save_file(tensors, str(f))
    out = tmp_path / "out"
    code, _, err = run(["quantize", tiny_model_dir, "--algorithm", "gptq", "--group-size", "32", "--calib", f, "-o", out], capsys)
    assert code == 2
    assert words in err and "Traceback" not in err
    assert len([x for x in err.splitlines() if x.startswith("kvq: error")]) == 1
    assert not out.exists() and not list(tmp_path.glob(".out.kvq-tmp*"))


def test_token_file_missing_or_garbage(tmp_path, tiny_model_dir, capsys):
    code, _, err = run(["quantize", tiny_model_dir, "--algorithm", "gptq", "--calib", tmp_path / "nope.safetensors",
                        "-o", tmp_path / "o"], capsys)
    assert code == 2 and "not found" in err
    g = tmp_path / "garbage.safetensors"
    g.write_bytes(b"\xff" * 40)
    code, _, err = run(["quantize", tiny_model_dir, "--algorithm", "gptq", "--calib", g, "-o", tmp_path / "o"], capsys)
    assert code == 2 and "cannot read calibration token file" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def foreign(gptq_pair):
    """A kvq artifact with its manifest removed: what llm-compressor's output looks like to kvq."""
    d, _ = gptq_pair
    f = d / "foreign"
    if not f.exists():
        shutil.copytree(d / "from-ids", f)
        (f / "kvq-manifest.json").unlink()
    return f


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_verify_foreign_artifact_matches_manifest_verify(gptq_pair, foreign, tiny_model_dir, capsys):
    d, _ = gptq_pair
    code, out, _ = run(["verify", d / "from-ids", "--reference", tiny_model_dir, "--eval", "embedded", *EVAL, "--json"], capsys)
    assert code in (0, 1)
    own = json.loads(out)
    code2, out2, _ = run(["verify", foreign, "--no-manifest", "--reference", tiny_model_dir, "--eval", "embedded", *EVAL,
                          "--json"], capsys)
    assert code2 == code
    rep = json.loads(out2)
    assert rep["hashes"]["checked"] is False and rep["hashes"]["tensors_checked"] == 0
    assert rep["reference_matches_source"] is None
    assert rep["perplexity"]["artifact"] == own["perplexity"]["artifact"]
    assert rep["distribution"]["kl"]["mean"] == own["distribution"]["kl"]["mean"]
    assert rep["weights"]["min_sqnr_db"] == pytest.approx(own["weights"]["min_sqnr_db"])
    assert any("foreign artifact" in w for w in rep["warnings"])


def test_verify_foreign_gates_still_fail(foreign, tiny_model_dir, capsys):
    code, out, _ = run(["verify", foreign, "--no-manifest", "--reference", tiny_model_dir, "--weights-only",
                        "--min-sqnr-db", "60", "--json"], capsys)
    assert code == 1
    assert json.loads(out)["failed_gates"] == ["min_sqnr_db"]


@pytest.mark.parametrize("extra, words", [
    ((), "--no-manifest needs --reference"),
    (("--reference", "X", "--hashes-only"), "--hashes-only does not apply"),
])
def test_no_manifest_usage_errors(foreign, capsys, extra, words):
    code, _, err = run(["verify", foreign, "--no-manifest", *extra], capsys)
    assert code == 2 and words in err


def test_no_manifest_refuses_a_kvq_artifact(gptq_pair, tiny_model_dir, capsys):
    """A kvq artifact keeps its digest check: --no-manifest cannot be used to skip it."""
    d, _ = gptq_pair
    code, _, err = run(["verify", d / "from-ids", "--no-manifest", "--reference", tiny_model_dir, "--weights-only"], capsys)
    assert code == 2 and "verify it without --no-manifest" in err


def test_foreign_kv_cache_scheme_read_from_config(foreign, tmp_path):
    from compressor.artifact import foreign_manifest
    from compressor.errors import InputError

    f = tmp_path / "kv"
    shutil.copytree(foreign, f)
    cfg = json.loads((f / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                                     "symmetric": True}
    (f / "config.json").write_text(json.dumps(cfg))
    m = foreign_manifest(f)
    assert m.kv_cache == {"scheme": "fp8", "strategy": "tensor"} and m.quantization["algorithm"] == "unknown"
    cfg["quantization_config"]["kv_cache_scheme"]["dynamic"] = True
    (f / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="not one kvq evaluates"):
        foreign_manifest(f)


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_foreign_awq_artifact_scales_inferred(tmp_path, tiny_model_dir, capsys):
    """An AWQ artifact without a manifest: verify sees the rescaled norms and undoes the folded scales."""
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize

    own = tmp_path / "awq"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=own, algorithm="awq", group_size=32,
                                 calib_samples=4, calib_seqlen=32))
    f = tmp_path / "awq-foreign"
    shutil.copytree(own, f)
    (f / "kvq-manifest.json").unlink()
    _, out, _ = run(["verify", own, "--reference", tiny_model_dir, "--weights-only", "--json"], capsys)
    _, out2, _ = run(["verify", f, "--no-manifest", "--reference", tiny_model_dir, "--weights-only", "--json"], capsys)
    a, b = json.loads(out), json.loads(out2)
    assert any("AWQ-folded" in w for w in b["warnings"])
    assert b["weights"]["min_sqnr_db"] == pytest.approx(a["weights"]["min_sqnr_db"], abs=1e-6)


def test_foreign_artifact_served_with_its_kv_cache_scheme(tmp_path, tiny_model_dir):
    """An artifact without a kvq manifest (llm-compressor's layout: config.json's kv_cache_scheme
    plus k_scale/v_scale tensors) is served with its static KV scheme and scales, the ones the
    manifest would give, never silently with a float cache; a dynamic kv_cache_scheme is refused."""
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize
    from compressor.errors import InputError
    from compressor.runtime.generate import Runtime

    own = tmp_path / "fp8"
    run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=own, algorithm="rtn", group_size=32, kv_scheme="fp8",
                                 calib="embedded", calib_samples=2, calib_seqlen=32))
    f = tmp_path / "fp8-foreign"
    shutil.copytree(own, f)
    (f / "kvq-manifest.json").unlink()
    a, b = Runtime.from_artifact(own, kv="artifact"), Runtime.from_artifact(f, kv="artifact")
    assert b.kv_spec is not None and b.kv_spec.describe() == a.kv_spec.describe()
    assert set(b.kv_scales) == set(a.kv_scales) == set(range(len(a.kv_scales))) and len(a.kv_scales) >= 1
    for i, (k, v) in a.kv_scales.items():
        assert torch.equal(b.kv_scales[i][0], k) and torch.equal(b.kv_scales[i][1], v)
    cfg = json.loads((f / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"]["dynamic"] = True
    (f / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="not one kvq evaluates"):
        Runtime.from_artifact(f, kv="artifact")


def test_foreign_kv_cache_scheme_that_contradicts_its_scales_is_refused(tmp_path, tiny_model_dir):
    """A kv_cache_scheme that is not an object, that is asymmetric or grouped, or whose strategy disagrees with
    the stored k_scale/v_scale (per-head values under 'tensor', one value under 'attn_head') is refused in one
    line, never served under the wrong label."""
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize
    from compressor.errors import InputError
    from compressor.runtime.generate import Runtime

    arts = {}
    for strategy in ("tensor", "head"):
        own = tmp_path / strategy
        run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=own, algorithm="rtn", group_size=32,
                                     kv_scheme="fp8", calib="embedded", calib_samples=2, calib_seqlen=32,
                                     settings=(("kv_cache.strategy", strategy),)))
        arts[strategy] = tmp_path / f"{strategy}-foreign"
        shutil.copytree(own, arts[strategy])
        (arts[strategy] / "kvq-manifest.json").unlink()
        assert Runtime.from_artifact(arts[strategy], kv="artifact").kv_spec.describe() == f"fp8 ({strategy})"

    def served_with(folder, **change):
        cfg = json.loads((folder / "config.json").read_text())
        kv = cfg["quantization_config"]["kv_cache_scheme"]
        cfg["quantization_config"]["kv_cache_scheme"] = change.pop("whole") if "whole" in change else {**kv, **change}
        (folder / "config.json").write_text(json.dumps(cfg))
        try:
            return Runtime.from_artifact(folder, kv="artifact")
        finally:
            cfg["quantization_config"]["kv_cache_scheme"] = kv
            (folder / "config.json").write_text(json.dumps(cfg))

    for folder, change, words in [(arts["head"], {"strategy": "tensor"}, "hold 2 values a layer, not one"),
                                  (arts["tensor"], {"strategy": "attn_head"}, "holds one value: the declared strategy"),
                                  (arts["tensor"], {"symmetric": False}, "kv_cache_scheme's symmetric"),
                                  (arts["tensor"], {"group_size": 64}, "kv_cache_scheme's group_size"),
                                  (arts["tensor"], {"whole": "fp8"}, "must be an object")]:
        with pytest.raises(InputError, match=words):
            served_with(folder, **change)
