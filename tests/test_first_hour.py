"""What a new user meets in the first hour (issue #45): refusals made before any model loads,
messages that name the real problem, and the same options on every command that runs a model."""

from __future__ import annotations

import pytest

from conftest import assert_clean_error, kvq_run, quantize_tiny


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_model_dir):
    return quantize_tiny(tmp_path_factory.mktemp("first-hour") / "a", tiny_model_dir)


def test_verify_refuses_windows_beyond_the_context_before_loading(artifact, tmp_path, capsys, monkeypatch):
    """The tiny model's context is 256 positions: --seqlen 257 is refused in one line, and no model is loaded."""
    import compressor.commands.verify as verify

    monkeypatch.setattr(verify, "_load", lambda *a, **k: pytest.fail("a model was loaded before the refusal"))
    code, _, err = kvq_run(["verify", artifact, "--eval", "embedded", "--seqlen", "257"], capsys)
    assert_clean_error(code, err, 2, "--seqlen 257 exceeds the model's context (max_position_embeddings 256)")
    assert "use --seqlen 256 or less" in err


def test_the_default_seqlen_beyond_a_short_context_is_a_warning(artifact, tmp_path, capsys):
    """The default 2048 on the tiny model (context 256) is evaluated, and the report says so."""
    import json

    code, _, err = kvq_run(["verify", artifact, "--eval", "embedded", "--max-windows", "1", "--max-new-tokens", "2",
                            "--json-out", tmp_path / "r.json"], capsys)
    assert code in (0, 1) and "Traceback" not in err, err
    warnings = json.loads((tmp_path / "r.json").read_text())["warnings"]
    assert any("--seqlen 2048 (the default) exceeds the model's max_position_embeddings 256" in w for w in warnings)


def test_output_path_that_is_a_file_is_named_first(tiny_model_dir, tmp_path, capsys):
    """A file at -o is named as such, with or without --overwrite (not 'pass --overwrite', which cannot help)."""
    f = tmp_path / "file"
    f.write_text("x")
    for extra in ([], ["--overwrite"]):
        code, _, err = kvq_run(["quantize", tiny_model_dir, "--algorithm", "rtn", "-o", f, *extra], capsys)
        assert_clean_error(code, err, 2, "exists and is not a folder")
        assert "--overwrite" not in err.splitlines()[-1]
    assert f.read_text() == "x"


def test_every_command_that_runs_a_model_takes_threads(capsys):
    for command in ("quantize", "verify", "serve-smoke", "serve"):
        code, out, _ = kvq_run([command, "--help"], capsys)
        assert code == 0 and "--threads" in out, command
    code, _, err = kvq_run(["serve", "nowhere", "--threads", "0"], capsys)
    assert code == 2 and "--threads" in err


def test_interrupt_before_the_first_layer_says_there_is_nothing_to_resume():
    import signal

    from compressor import interrupts

    line = interrupts.message(signal.SIGINT, ["quantize", "m", "-o", "x"])
    assert line.endswith("no layer was finished (nothing to resume: rerun without --resume)"), line
    assert "resume" not in interrupts.message(signal.SIGINT, ["sign", "a"])
