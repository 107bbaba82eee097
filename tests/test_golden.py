"""Golden bytes (issue #17): the manifest's canonical serialization and the recipes' round trip.

Every signed artifact's manifest was written by :meth:`Manifest.to_json`, and its
``content_digest`` and the effective recipe it embeds (``recipe.model_dump(mode="json")``)
are what identical runs are compared by. A change to key order, indentation, escaping,
float formatting, a default value or a field name changes these bytes for every artifact, so
the expected values below are literals, computed once from the code and pasted in (as
safetensors pins its format's bytes). If one of these tests fails, the change alters every
existing manifest: undo it, or bump ``schema_version`` and update the literals on purpose.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from compressor.manifest import MANIFEST_NAME, Manifest, load_manifest
from compressor.recipe import Recipe, bundled_recipes, load_recipes


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _canonical(data: dict) -> str:
    """The manifest's canonical JSON (see :meth:`Manifest.to_json`)."""
    return json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


# --- the manifest -------------------------------------------------------------------------

def fixed_manifest(**provenance) -> Manifest:
    """A small manifest exercising every field kind: nested maps, null, bool, int, float,
    non-ASCII text, both ``covers`` values, unsorted insertion order."""
    return Manifest(
        tool={"name": "kvq", "version": "0.1.0", "libraries": {"torch": "2.13.0"}},
        source={"model": "tiny-llama", "note": "café ✓"},
        recipe={"name": "w4a16-rtn-g64", "algorithm": "rtn", "weights": {"num_bits": 4, "group_size": 64, "symmetric": False}},
        calibration=None,
        quantization={"algorithm": "rtn", "num_bits": 4, "group_size": 64, "modules": 2},
        kv_cache={"scheme": "fp8", "strategy": "tensor", "bits": 8, "static_scales": True},
        quality={"min_sqnr_db": 19.25, "ppl": 1.0e-3},
        files={"config.json": {"size": 812, "digest": "1" * 64},
               "model.safetensors": {"size": 4096, "digest": "ab" * 32, "covers": "header"}},
        tensors={"model.layers.0.mlp.down_proj.weight_packed": {"file": "model.safetensors", "dtype": "I32",
                                                                 "shape": [64, 16], "digest": "0" * 63 + "f"},
                 "model.embed_tokens.weight": {"file": "model.safetensors", "dtype": "F16", "shape": [320, 64],
                                               "digest": "c" * 64}},
        provenance=provenance or {"created": "2026-12-01T00:00:00Z", "host": "h"},
    )


MANIFEST_JSON = """\
{
  "calibration": null,
  "digest_algorithm": "sha256",
  "files": {
    "config.json": {
      "covers": "file",
      "digest": "1111111111111111111111111111111111111111111111111111111111111111",
      "size": 812
    },
    "model.safetensors": {
      "covers": "header",
      "digest": "abababababababababababababababababababababababababababababababab",
      "size": 4096
    }
  },
  "format": "compressed-tensors",
  "kv_cache": {
    "bits": 8,
    "scheme": "fp8",
    "static_scales": true,
    "strategy": "tensor"
  },
  "provenance": {
    "created": "2026-12-01T00:00:00Z",
    "host": "h"
  },
  "quality": {
    "min_sqnr_db": 19.25,
    "ppl": 0.001
  },
  "quantization": {
    "algorithm": "rtn",
    "group_size": 64,
    "modules": 2,
    "num_bits": 4
  },
  "recipe": {
    "algorithm": "rtn",
    "name": "w4a16-rtn-g64",
    "weights": {
      "group_size": 64,
      "num_bits": 4,
      "symmetric": false
    }
  },
  "schema_version": "kvq.manifest/2",
  "source": {
    "model": "tiny-llama",
    "note": "café ✓"
  },
  "tensors": {
    "model.embed_tokens.weight": {
      "digest": "cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc",
      "dtype": "F16",
      "file": "model.safetensors",
      "shape": [
        320,
        64
      ]
    },
    "model.layers.0.mlp.down_proj.weight_packed": {
      "digest": "000000000000000000000000000000000000000000000000000000000000000f",
      "dtype": "I32",
      "file": "model.safetensors",
      "shape": [
        64,
        16
      ]
    }
  },
  "tool": {
    "libraries": {
      "torch": "2.13.0"
    },
    "name": "kvq",
    "version": "0.1.0"
  }
}
"""
MANIFEST_JSON_SHA256 = "e0f6060f982a52f2a41669023f4b0f3a3a12d5fe7835fa2a651abcd1457674e4"
#: SHA-256 of the compact JSON without ``provenance`` (sorted keys, ``,``/``:`` separators, ASCII escapes)
MANIFEST_CONTENT_DIGEST = "25ec65c199555bad21ed07a60e410040ef99d2e886e66b0e4d6779c0fce3d1e1"


def test_manifest_canonical_bytes_are_pinned():
    text = fixed_manifest().to_json()
    assert text == MANIFEST_JSON
    assert _sha256(text) == MANIFEST_JSON_SHA256
    assert text.encode("utf-8") == MANIFEST_JSON.encode("utf-8")  # UTF-8, not \\u escapes, in the file


def test_manifest_content_digest_is_pinned_and_ignores_provenance():
    m = fixed_manifest()
    data = m.model_dump(mode="json")
    data.pop("provenance")
    assert m.content_digest() == MANIFEST_CONTENT_DIGEST, json.dumps(data, sort_keys=True, separators=(",", ":"))
    assert fixed_manifest(created="2030-01-01T00:00:00Z", host="elsewhere").content_digest() == MANIFEST_CONTENT_DIGEST


def test_manifest_round_trips_through_the_file(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text(MANIFEST_JSON, encoding="utf-8")
    loaded = load_manifest(tmp_path)
    assert loaded == fixed_manifest()
    assert loaded.to_json() == MANIFEST_JSON


# --- the recipes ----------------------------------------------------------------------------

#: the default recipe as ``kvq quantize --recipe w4a16-awq`` loads it and the manifest embeds it
W4A16_AWQ_JSON = """\
{
  "algorithm": "awq",
  "awq": {
    "clip": true,
    "clip_grid": 20,
    "clip_max_shrink": 0.5,
    "clip_tokens": 512,
    "duo_scaling": true,
    "loss_samples": 8,
    "n_grid": 20
  },
  "description": "AWQ W4A16, asymmetric, group 64, weight clipping search on",
  "gates": {
    "max_hidden_error": null,
    "max_mean_kl": null,
    "max_p99_kl": null,
    "max_ppl_increase_pct": 20.0,
    "min_median_divergence": null,
    "min_sqnr_db": null,
    "min_top1_agreement_pct": null,
    "serve_max_prompt_kl": null,
    "serve_min_median_divergence": null,
    "serve_min_top1_pct": null
  },
  "gptq": {
    "act_order": false,
    "block_size": 128,
    "damp": 0.01,
    "damp_increment": 0.01,
    "static_groups": false,
    "true_sequential": true
  },
  "ignore": [],
  "kv_cache": null,
  "moe": {
    "min_tokens": 128
  },
  "name": "w4a16-awq",
  "overrides": [],
  "targets": [
    "re:.*"
  ],
  "weights": {
    "group_size": 64,
    "num_bits": 4,
    "symmetric": false
  }
}
"""

#: SHA-256 of each bundled recipe's canonical JSON (``load_recipes([name]).model_dump(mode="json")``)
RECIPE_SHA256 = {
    "kv-fp8": "baf1d66b3692c451a56b9b425978e56b8ebc746d504ae9af5a59038a47172565",
    "kv-int4": "052ccbef43d9ee3f8b07056d70110526740bb60e6cd59e452a1356d41c22a048",
    "kv-int8": "303b880f892f889096203aa1699d479e90d098e1bfa073b867637ff5a522cbc2",
    "w3a16-best": "e293785d04294bdbed3ccc9e5aff799b14ea8c32227527b8f7eda5e43a1b42b1",
    "w3a16-gptaq-g64": "8c82331a9cb29c4825349db0f66392959bd7123d1df333dbbf2b0e6d17d2eff5",
    "w3a16-gptq-g64": "9a8c7c71118eafc6f229aae5e2d9b29083784258cb1c78cfd500363072d4aa0e",
    "w4a8-gptq": "48b8d2fc7573ef75fdd55bac4030edf6760ae428aedceca2f7fa6ed8b95eb635",
    "w4a4-nvfp4": "1c57823f4669aafb81e5961e22b79c71b3288fd0d07ae13d97bcac309db633cc",
    "w4a4-nvfp4-gptq": "f6e0cab88d934f71251a435fe171a15660a7e91769b49961f81eddda442d0db3",
    "w4a16-nvfp4": "edba8805cf9a1d92c3638bd2830aa1fba821c34e90a68af53607bd84287e3830",
    "w4a16-mxfp4": "2c0c6b1370974e10b41545c397c013c4de53cf4da27b79edeaf7de477cc900f5",
    "w4a16-nvfp4-gptq": "309484c337ebe9f227bfc21f64586a73697877a070b7b09b2c8e0ac5c23ed5aa",
    "w4a16-mxfp4-gptq": "fbacf4b63c5f847a1ff948dbf7a94bd6cd540e71894c5ef950a2222b4626eeab",
    "w4a16-nvfp4-awq": "e01667689ebb149b94d5262ae279044e18b2230a39873058e8be3fb52963ea2b",
    "w4a16-mxfp4-awq": "f77537951671a639647e384165dfca6602ec19a6dcbb3763bded09d967726db5",
    "w4a16-awq": "8226cc45b8dec99a241e5c3ec17cc18721c0c1738b0379c043264c6aafbd4ab9",
    "w4a16-awq-gptq": "acc88f3dd7e528818db5b7cb039c19694907bed086f0f0990cc07a28e423970a",
    "w4a16-best": "566ae193461e26158544c7a0408ef6fab6b15e098cd2c64e6a5c9fbce8b16642",
    "w4a16-gptaq": "4364c8bca009af5340531d7bcd38c3dd3e415b0353daeebb45148642fa894c10",
    "w4a16-gptq": "afaa00d666a51106aaa9f8d0e4abe8a9f7adfe71a45bc91aaf93da4c213c80b7",
    "w4a16-mixed": "d9eade6dc38ff3a9d45321b1a7835700bbf102ea5985930622322d8ae2635fd4",
    "w4a16-rtn-g64": "a9e8d9a8a1e87e77bc9d31b8f4b7789201c6c515ea5424a243d6a5f353f23c7f",
    "w8a16-rtn": "4b3f27c2452bd0c061d5cfbdfaff54109d4e4ebbc429dfd23a20d2e606887d04",
    "w8a8-fp8": "62a7faaab1ec0fb8000b0ea9feeb46a98828a25bfc0583fcef1eae011ebedfea",
    "w8a8-fp8-block": "fdcc88c7229e1d94516801818d9d37d57535a8d2997771ca96fe433990e9feef",
    # mixed formats per module (issue #49): routed experts W4A8, the rest FP8 W8A8; new recipe, new pin
    "w4a8-experts-fp8-attn": "f2b99b24bc8f6bf19a8a1cf281285e8a3037148fa3b924d1e808610df0a1efee",
}


def test_default_recipe_round_trip_bytes_are_pinned():
    recipe = load_recipes(["w4a16-awq"])
    text = _canonical(recipe.model_dump(mode="json"))
    assert text == W4A16_AWQ_JSON
    assert _sha256(text) == RECIPE_SHA256["w4a16-awq"]
    again = Recipe.model_validate(json.loads(text))  # YAML -> Recipe -> JSON -> Recipe is the identity
    assert again == recipe and _canonical(again.model_dump(mode="json")) == text


def test_every_bundled_recipe_is_pinned():
    assert sorted(bundled_recipes()) == sorted(RECIPE_SHA256), "a bundled recipe was added or removed: pin its digest"


@pytest.mark.parametrize("name", sorted(RECIPE_SHA256))
def test_bundled_recipe_digest(name):
    text = _canonical(load_recipes([name]).model_dump(mode="json"))
    assert _sha256(text) == RECIPE_SHA256[name], text
    assert Recipe.model_validate(json.loads(text)).model_dump(mode="json") == json.loads(text)
