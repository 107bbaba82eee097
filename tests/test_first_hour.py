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


def test_a_torchrun_rank_after_the_first_leaves_what_was_kept_to_rank_0(monkeypatch):
    """Under torchrun only rank 0 holds the staging folder: another rank never says there is nothing to resume
    (rank 0 may have kept finished layers), it points to rank 0's line."""
    import signal

    from compressor import interrupts

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = interrupts.message(signal.SIGTERM, ["quantize", "m", "-o", "x"])
    assert line == ("kvq: rank 1 of 2 terminated; no artifact was written: rank 0 keeps the finished layers (its "
                    "line says whether --resume continues)"), line
    monkeypatch.setenv("RANK", "0")
    assert "nothing to resume" in interrupts.message(signal.SIGTERM, ["quantize", "m", "-o", "x"])


@pytest.fixture()
def no_loading(monkeypatch):
    """Loading a model (streamed or whole) fails the test: a refusal must come before it."""
    import compressor.commands.quantize as quantize

    def refuse(*a, **k):
        pytest.fail("the model was loaded before the refusal")

    monkeypatch.setattr(quantize, "open_lazy", refuse)
    monkeypatch.setattr(quantize, "load_model", refuse)


def test_group_size_is_refused_from_the_config_before_loading(tiny_model_dir, tmp_path, capsys, no_loading):
    """hidden 64, intermediate 128: --group-size 128 divides the MLP's down_proj only; one line, exit 2, and the
    model never loads (the README: refusals come before any work)."""
    code, out, err = kvq_run(["quantize", tiny_model_dir, "--group-size", "128", "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "group_size 128 does not divide in_features", tmp_path)
    assert "use --group-size 64" in err and "loading" not in out + err
    for setting, phrase in (("head={num_bits: 8, group_size: 48, untie: true}", "head.group_size 48 does not divide"),
                            ("embedding={num_bits: 8, group_size: 48}", "embedding.group_size 48 does not divide")):
        code, _, err = kvq_run(["quantize", tiny_model_dir, "--set", setting, "-o", tmp_path / "out"], capsys)
        assert_clean_error(code, err, 2, phrase, tmp_path)


def test_routed_experts_widths_are_checked_before_loading(tokenizer, tmp_path, capsys, no_loading):
    """qwen3_moe with hidden 64, a dense MLP of 128 and experts of 32: group 64 divides every width but the
    experts' down_proj (in 32), which transformers keeps fused in 3-D parameters until kvq unfuses them."""
    from tiny_models import make_dir

    model = make_dir(tmp_path / "moe", tokenizer, "qwen3_moe")
    code, _, err = kvq_run(["quantize", model, "--group-size", "64", "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "group_size 64 does not divide in_features of model.layers.1.mlp.experts.", tmp_path)
    assert "down_proj" in err and "in_features 32)" in err, err


def test_a_gguf_file_is_refused_from_its_metadata_before_its_conversion(tokenizer, tmp_path, monkeypatch, capsys):
    """A GGUF file not yet in kvq's cache would be converted whole first (tens of seconds on SmolLM2): the widths
    come from its metadata, and the refusal leaves the cache empty."""
    from tiny_models import tiny_gguf

    import compressor.source.open as source_open

    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVQ_CACHE_KEY_FILE", str(tmp_path / "config" / "cache-key"))
    monkeypatch.setattr(source_open, "_write_gguf_cache", lambda *a: pytest.fail("the GGUF file was converted"))
    gguf = tiny_gguf(tmp_path / "tiny.gguf", tokenizer)
    code, _, err = kvq_run(["quantize", gguf, "--group-size", "128", "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "group_size 128 does not divide in_features", tmp_path)
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_unknown_set_keys_and_recipe_names_get_a_did_you_mean(tiny_model_dir, tmp_path, capsys):
    cases = ((["--set", "gptq.dampp=0.05"], "gptq.dampp: unknown recipe key; did you mean 'gptq.damp'"),
             (["--set", "num_bits=3"], "num_bits: unknown recipe key; did you mean 'weights.num_bits'"),
             (["--set", "weights.foo.num_bits=3"], "unknown recipe key; did you mean 'weights.num_bits'"),
             (["--recipe", "w4a16-awk"], "nor a bundled recipe (kv-fp8, "),
             (["--recipe", "kv-fp9"], "; did you mean 'kv-fp8'?"))
    for extra, phrase in cases:
        code, _, err = kvq_run(["quantize", tiny_model_dir, *extra, "-o", tmp_path / "out"], capsys)
        assert_clean_error(code, err, 2, phrase, tmp_path)
    assert "did you mean 'w4a16-awq'" in kvq_run(["quantize", tiny_model_dir, "--recipe", "w4a16-awk", "-o",
                                                   tmp_path / "out"], capsys)[2]
    code, _, err = kvq_run(["quantize", tiny_model_dir, "--set", "zzz=1", "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "zzz: unknown recipe key", tmp_path)
    assert "did you mean" not in err  # nothing close: no guess


def test_recipes_marks_the_default(capsys):
    from compressor.commands.options import DEFAULT_RECIPE, QuantizeOptions
    from compressor.recipe import load_recipe

    code, out, _ = kvq_run(["recipes"], capsys)
    marked = [line.split()[0] for line in out.splitlines() if "(default)" in line]
    assert code == 0 and marked == [DEFAULT_RECIPE]
    assert QuantizeOptions(model="m", output="o").scheme.recipes == (DEFAULT_RECIPE,)
    assert load_recipe(None).name == DEFAULT_RECIPE  # the library's default is the command's
    code, out, _ = kvq_run(["quantize", "--help"], capsys)
    assert f"[default: {DEFAULT_RECIPE}]" in " ".join(out.split())  # click wraps to the terminal's width


def test_json_modes_keep_stdout_json_and_show_progress_on_stderr(artifact, tiny_model_dir, tmp_path, capsys):
    """--json: stdout is the JSON alone; stderr carries the progress lines (a line per layer, per window, per drift
    prompt, and one as each long step starts), not the notes, warnings and tables the JSON holds."""
    import json

    code, out, err = kvq_run(["quantize", tiny_model_dir, "--algorithm", "rtn", "--group-size", "32", "--json",
                              "-o", tmp_path / "q"], capsys)
    assert code == 0 and json.loads(out)["output"] == str(tmp_path / "q"), err
    assert "loading " in err and "layer 2/2 done" in err and f"writing {tmp_path / 'q'}" in err, err
    assert "warning:" not in err and "wrote" not in err  # the summary is the JSON's
    code, out, err = kvq_run(["verify", artifact, "--eval", "embedded", "--seqlen", "64", "--max-windows", "1",
                              "--max-new-tokens", "2", "--json"], capsys)
    assert code in (0, 1) and json.loads(out)["mode"] == "full", err
    for line in ("loading the artifact and the reference", "window 1/1 evaluated", "hidden-state error per layer",
                 "greedy drift:", "drift prompt 1/"):
        assert line in err, (line, err)
    assert "hashes ok" not in err  # a note: in the JSON
    code, out, err = kvq_run(["serve-smoke", artifact, "--max-new-tokens", "2", "--json"], capsys)
    assert code in (0, 1) and json.loads(out)["prompts"] > 0, err
    assert "into the runtime" in err and "generating 2 tokens" in err and "reference " in err, err


def test_serve_smoke_says_a_carried_reference_is_the_quantized_source():
    from types import SimpleNamespace

    from compressor.commands.serve_smoke import _carried_reference
    from compressor.commands.options import SmokeOptions

    carried = SimpleNamespace(manifest=SimpleNamespace(quantization={"carried_from": "/w4"}))
    opts = SmokeOptions(artifact="a")
    (line,) = _carried_reference(carried, opts, "/w4")
    assert "/w4 is the quantized source" in line and "KV cache and the runtime only" in line
    assert _carried_reference(carried, opts.model_copy(update={"reference": "float"}), "float") == []
    assert _carried_reference(SimpleNamespace(manifest=SimpleNamespace(quantization={})), opts, "/src") == []


def test_report_html_renders_inline_code_and_a_single_window_plot_ticks_windows():
    from compressor.report import _plot_perplexity, html_page

    md = "## kvq verify: PASSED — `art`\n- reference: `/m`\n\n| tensor | x |\n|---|---|\n| `model.layers.0.q` | **FAIL** |\n"
    page = html_page({}, md, [])
    assert "`" not in page and "**" not in page
    assert "<code>model.layers.0.q</code>" in page and "<strong>FAIL</strong>" in page and "<code>art</code>" in page
    one = {"per_window": [{"window": 0, "ppl_reference": 10.0, "ppl_artifact": 11.0}],
           "distribution": {"measured_on": "weights only"}}
    fig = _plot_perplexity(one, "art", {})
    assert list(fig.axes[0].get_xticks()) == [0]  # not -0.045 ... 0.045
    three = {**one, "per_window": [{**one["per_window"][0], "window": w} for w in (0, 5, 9)]}
    assert list(_plot_perplexity(three, "art", {}).axes[0].get_xticks()) == [0, 5, 9]


def test_verify_table_wraps_tensor_names_in_a_narrow_console():
    """A CI log is 80 columns wide: the lowest-SQNR tensor's name is wrapped in the table, never cut with '…'."""
    from rich.console import Console

    from compressor.console import verify_table

    name = "model.layers.11.self_attn.q_proj.weight"
    report = {"warnings": [], "artifact": "out/a-long-artifact-name", "mode": "weights-only",
              "hashes": {"checked": True, "tensors_checked": 211}, "gates": [],
              "weights": {"tensors": [{}] * 211, "min_sqnr_db": 10.12, "min_sqnr_tensor": name}}
    console = Console(width=80, record=True, force_terminal=False)
    verify_table(console, report, {})
    text = console.export_text()
    assert "…" not in text
    values = "".join(line.split("│")[2].strip() for line in text.splitlines() if line.count("│") == 5)
    assert name in values, text


def test_triton_is_installed_only_where_it_runs():
    """The [test] extra leaves Triton (about 1 GB) out; make install adds it with a CUDA torch or TRITON=1, and CI
    asks for it (the kernel tests run under its CPU interpreter there)."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")
    repo = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [d for d in extras["test"] if d.startswith("triton")] and extras["triton"] == ["triton>=3.0"]
    make = (repo / "Makefile").read_text()
    assert "TRITON ?= auto" in make and "'.[test,triton]'" in make and "torch.version.cuda" in make
    assert "make test TRITON=1" in (repo / ".ci" / "run").read_text()
