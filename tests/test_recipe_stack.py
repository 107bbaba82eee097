"""A stack of recipes (several ``--recipe``) with ``--set`` and the flags: only the final recipe is checked."""

import pytest
import yaml

from compressor.errors import InputError
from compressor.recipe import load_recipe, load_recipes, parse_recipe
from compressor.recipe_mixed import by_pair
from conftest import assert_clean_error, kvq_run, quantize_cli

FP8_TOKEN = {"type": "float", "num_bits": 8, "strategy": "token"}


def _quantize(model, out, capsys, *args):
    return kvq_run(["quantize", model, "-o", out, "--calib-samples", "4", "--calib-seqlen", "32", *args], capsys)


@pytest.mark.parametrize("fix", [("--set", "weights.symmetric=true"), ("--symmetric",)])
def test_set_and_flags_fix_a_stack(wide_llama, tmp_path, capsys, fix):
    """W4A8's activations under W4A16's asymmetric weights: refused as stacked, run once --set or the flag makes
    the weights symmetric (the check is on the final recipe)."""
    stack = ("--recipe", "w4a8-gptq", "--recipe", "w4a16-gptq")
    code, _, err = _quantize(wide_llama, tmp_path / "bad", capsys, *stack)
    assert_clean_error(code, err, 2, "w4a8-gptq + w4a16-gptq: integer weights with fp8 activations are symmetric")
    quantize_cli(wide_llama, tmp_path / "ok", capsys, *stack, *fix)
    manifest = (tmp_path / "ok" / "kvq-manifest.json").read_text()
    assert '"symmetric": true' in manifest


def test_set_activations_null_fixes_a_stack(wide_llama, tmp_path, capsys):
    """MXFP4 weights stacked on FP8 W8A8's inputs: the refusal names the recipe the inputs come from and the fix,
    which then runs."""
    stack = ("--recipe", "w8a8-fp8", "--recipe", "w4a16-mxfp4")
    code, _, err = _quantize(wide_llama, tmp_path / "bad", capsys, *stack)
    assert_clean_error(code, err, 2, "MXFP4 weights with fp8 activations are not implemented")
    assert "the activations come from w8a8-fp8: give it `activations: null` (--set activations=null)" in err
    quantize_cli(wide_llama, tmp_path / "ok", capsys, *stack, "--set", "activations=null")


def test_refusal_names_the_options(wide_llama, tmp_path, capsys):
    """A final recipe still invalid after --set and the flags is refused in one line naming them."""
    code, _, err = _quantize(wide_llama, tmp_path / "bad", capsys, "--recipe", "w4a8-gptq", "--recipe",
                             "w4a16-gptq", "--set", "gptq.damp=0.02", "--bits", "4")
    assert_clean_error(code, err, 2, "w4a8-gptq + w4a16-gptq with --set gptq.damp, --bits: integer weights with")


def test_stacked_file_is_checked_merged(tmp_path):
    """A file holding only an FP8 W8A8 attention override, stacked on a GPTQ recipe, is GPTQ's (FP8 modules RTN),
    not checked alone under the default algorithm."""
    extra = tmp_path / "extra.yaml"
    extra.write_text(yaml.safe_dump({"overrides": [{
        "targets": ["re:.*self_attn.*"], "activations": FP8_TOKEN,
        "weights": {"type": "float", "num_bits": 8, "group_size": -1, "symmetric": True}}]}))
    recipe = load_recipes(["w4a16-gptq", str(extra)])
    assert recipe.algorithm == "gptq" and len(recipe.overrides) == 1
    with pytest.raises(InputError, match=r"overrides\[0\]: algorithm awq is not implemented on FP8 modules"):
        load_recipe(str(extra))  # alone it is AWQ's (the default algorithm)


def test_fp4_inheriting_an_earlier_overrides_inputs_gets_the_hint():
    """MXFP4 weights from a later override on modules an earlier one gave fp8 inputs: the hint names both."""
    recipe = parse_recipe({"algorithm": "rtn", "weights": {"num_bits": 4, "group_size": 32, "symmetric": True},
                           "overrides": [{"targets": ["re:.*mlp.*"], "activations": FP8_TOKEN},
                                         {"targets": ["re:.*down_proj"], "weights": {
                                             "type": "float", "num_bits": 4, "group_size": 32, "symmetric": True}}]})
    with pytest.raises(InputError) as e:
        by_pair(recipe, {"model.layers.0.mlp.down_proj": 64})
    assert "MXFP4 weights with fp8 activations are not implemented" in str(e.value)
    assert "overrides[1] inherits overrides[0]'s activations: give it `activations: null`" in str(e.value)


def test_key_inside_null_activations_suggests_set(tiny_model_dir, tmp_path, capsys):
    """A key inside the null activations section: the hint is a --set of the whole section (YAML, quoted), which
    --set reads as a mapping."""
    code, _, err = _quantize(tiny_model_dir, tmp_path / "bad", capsys, "--recipe", "w4a16-mxfp4",
                             "--set", "activations.type=float")
    assert_clean_error(code, err, 2, "the recipe has no activations section (null); set it whole first "
                                     "(--set 'activations={type: float, num_bits: 8, strategy: token}')")
    assert "--kv-scheme" not in err
    from compressor.cli_options import parse_settings
    assert parse_settings(["activations={type: float, num_bits: 8, strategy: token}"]) == \
        (("activations", FP8_TOKEN),)
