"""config.json against the checkpoint (issue #20): a config that lies is refused in one line
naming the field (exit 2) before anything is built; a fuzz test of config values against a
real tiny checkpoint never gives a traceback."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compressor.source.config_check import check_folder
from compressor.errors import InputError
from compressor.source.resolve import resolve_source

from conftest import assert_clean_error, kvq_run as run


@pytest.fixture(scope="module")
def src(tmp_path_factory, tokenizer):
    from conftest import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("cfgcheck") / "model", tokenizer)


def _lie(src, tmp_path, **changes):
    d = tmp_path / "lying"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("changes,field", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(vocab_size=100), "vocab_size"),
    (dict(intermediate_size=10**12), "intermediate_size"),
    (dict(intermediate_size=1e3), "intermediate_size"),
    (dict(intermediate_size=96), "intermediate_size"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(num_key_value_heads=1), "num_key_value_heads"),
    (dict(num_attention_heads=8), "num_attention_heads"),
    (dict(num_hidden_layers=1_000_000_000), "num_hidden_layers"),
    (dict(num_hidden_layers=3), "num_hidden_layers"),
    (dict(num_hidden_layers=None), "num_hidden_layers"),
    (dict(hidden_size=True), "hidden_size"),
    # fields that are not sizes (found by a fresh-user try: accepted, or "cannot load model: 'bogus'")
    (dict(max_position_embeddings=0), "max_position_embeddings"),
    (dict(max_position_embeddings=-5), "max_position_embeddings"),
    (dict(max_position_embeddings=10**9), "max_position_embeddings"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps"),
    (dict(rms_norm_eps=-1e-5), "rms_norm_eps"),
    (dict(rope_theta=0), "rope_theta"),
    (dict(rope_theta=float("inf")), "rope_theta"),
    (dict(hidden_act="bogus"), "hidden_act 'bogus' is not an activation"),
    (dict(rope_scaling={"rope_type": "bogus", "factor": 2.0}), "rope_scaling.rope_type 'bogus'"),
    (dict(rope_scaling={"type": "linear", "factor": -2.0}), "factor"),
    (dict(rope_scaling="yarn"), "rope_scaling must be an object"),
])
def test_a_lying_config_is_refused_naming_the_field(src, tmp_path, changes, field):
    d = _lie(src, tmp_path, **changes)
    with pytest.raises(InputError, match=field):
        resolve_source(str(d))


def test_the_cli_refuses_before_loading(src, tmp_path, capsys):
    d = _lie(src, tmp_path, num_hidden_layers=1_000_000_000)
    code, _, err = run(["quantize", d, "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "num_hidden_layers = 1,000,000,000 is out of range", tmp_path)
    assert not (tmp_path / "out").exists()


def test_deeply_nested_config_is_an_input_error(src, tmp_path, capsys):
    d = tmp_path / "deep"
    shutil.copytree(src, d)
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = run(["quantize", d, "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "nested too deeply", tmp_path)


def test_mtp_layers_are_allowed(src, tmp_path):
    """DeepSeek-V3/GLM checkpoints store num_nextn_predict_layers extra layers after the decoder."""
    d = _lie(src, tmp_path, num_hidden_layers=1)
    with pytest.raises(InputError, match="stores 2 decoder layers"):
        check_folder(d)
    d2 = _lie(src, tmp_path / "b", num_hidden_layers=1, num_nextn_predict_layers=1)
    with pytest.raises(InputError, match="layer 1 is an ordinary decoder layer"):  # no MTP tensors: a wrong count
        check_folder(d2)
    from safetensors.torch import load_file, save_file

    f = d2 / "model.safetensors"
    state = load_file(f)
    h = state["model.embed_tokens.weight"].shape[1]
    state.update({"model.layers.1.enorm.weight": torch.ones(h), "model.layers.1.hnorm.weight": torch.ones(h),
                  "model.layers.1.eh_proj.weight": torch.zeros(h, 2 * h)})
    save_file(state, f, metadata={"format": "pt"})
    check_folder(d2)  # an MTP module (its own projection and norms) after the decoder layers


def test_the_honest_config_passes(src):
    assert check_folder(src)["hidden_size"] == 64


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**13), st.floats(allow_nan=True),
                    st.text(max_size=5), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_FIELDS = st.sampled_from(["hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                           "num_hidden_layers", "head_dim", "num_nextn_predict_layers", "text_config", "model_type"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(_FIELDS, _VALUES, min_size=1, max_size=3))
def test_fuzz_config_against_checkpoint(src, tmp_path_factory, changes):
    """Any values in the size fields: either accepted (and then consistent with the weights)
    or one InputError; never another exception."""
    d = _lie(src, tmp_path_factory.mktemp("fz"), **changes)
    try:
        cfg = check_folder(d)
    except InputError as e:
        assert "\n" not in str(e)
        return
    if cfg.get("model_type") == "llama" and not isinstance(cfg.get("text_config"), dict):
        assert cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 2


def test_published_rope_and_activation_fields_pass(src, tmp_path):
    """The forms today's releases use: DeepSeek-V3/Kimi's yarn ``type``, Gemma 3's per-layer-type
    ``rope_parameters``, Llama 3's ``rope_type``, gelu_pytorch_tanh."""
    check_folder(_lie(src, tmp_path / "a", rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1,
                                                           "original_max_position_embeddings": 4096}))
    check_folder(_lie(src, tmp_path / "b", rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}, hidden_activation="gelu_pytorch_tanh"))
    check_folder(_lie(src, tmp_path / "c", rope_scaling={"rope_type": "llama3", "factor": 8.0}, max_position_embeddings=131072))


def test_a_bogus_activation_is_refused_by_the_cli(src, tmp_path, capsys):
    d = _lie(src, tmp_path, hidden_act="bogus")
    code, _, err = run(["quantize", d, "-o", tmp_path / "out"], capsys)
    assert_clean_error(code, err, 2, "hidden_act 'bogus' is not an activation", tmp_path)


# --- configs that describe another layout than the tensors stored (a fresh-user try) ----------

@pytest.fixture(scope="module")
def layouts(tmp_path_factory, tokenizer):
    from tiny_models import make_dir

    root = tmp_path_factory.mktemp("layouts")
    return {mt: make_dir(root / mt, tokenizer, mt) for mt in ("qwen3_moe", "deepseek_v3", "llama")}


@pytest.mark.parametrize("model_type,changes,pattern", [
    # fewer experts than stored: the router's rows disagree (experts 2, 3 would be dropped)
    ("qwen3_moe", dict(num_local_experts=2), r"mlp.gate.weight as \[2, 64\] but the checkpoint stores \[4, 64\]"),
    # which layers are dense: a dense MLP the checkpoint never stored would keep its random init
    ("qwen3_moe", dict(mlp_only_layers=[0, 1]), "does not describe the checkpoint's layers"),
    ("deepseek_v3", dict(first_k_dense_replace=2), "does not describe the checkpoint's layers"),
    ("deepseek_v3", dict(first_k_dense_replace=0), "does not describe the checkpoint's layers"),
    ("deepseek_v3", dict(q_lora_rank=None), "does not describe the checkpoint's layers"),
    # MLA head sizes against q_b_proj / kv_b_proj rows
    ("deepseek_v3", dict(qk_rope_head_dim=4), "q_b_proj.weight as"),
    ("deepseek_v3", dict(v_head_dim=8), "kv_b_proj.weight as"),
    # a separate head under tie_word_embeddings would be dropped
    ("llama", dict(tie_word_embeddings=True), "sets tie_word_embeddings but the checkpoint stores its own lm_head.weight"),
])
def test_a_config_of_another_layout_is_refused_before_any_weight(layouts, tmp_path, capsys, model_type, changes, pattern):
    d = _lie(layouts[model_type], tmp_path, **changes)
    for extra in ([], ["--no-stream"]):
        code, _, err = run(["quantize", d, "-o", tmp_path / "out", "--algorithm", "rtn", "--group-size", "32", *extra], capsys)
        assert code == 2 and "Traceback" not in err and not (tmp_path / "out").exists(), err
        if not extra:
            assert re.search(pattern, err), err


def test_a_tied_head_stored_as_a_copy_is_accepted(src, tmp_path):
    """Some releases store lm_head.weight although it is tied: the embedding's own bytes pass."""
    from safetensors.torch import load_file, save_file

    d = _lie(src, tmp_path, tie_word_embeddings=True)
    f = d / "model.safetensors"
    state = load_file(f)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, f)
    check_folder(d)
    resolve_source(str(d))
