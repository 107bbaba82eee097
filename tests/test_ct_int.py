"""compressed-tensors ``int-quantized`` artifacts (llm-compressor's W4AFP8 / W8A8 layout): kvq's reader gives
what compressed-tensors' own decompressor gives, and the same weights as the ``pack-quantized`` artifact holding
the same values."""

import json

import pytest
import torch
from conftest import decompress_as_kvq_reads, packed_tensors, quantize_tiny
from safetensors.torch import load_file, save_file

from compressor.errors import InputError
from compressor.formats.compressed_tensors import read_module
from compressor.formats import read_quant_weight


def _as_int_quantized(src, dst):
    """``src`` (a kvq pack-quantized artifact) rewritten as int-quantized: each module's values one per int8."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg["quantization_config"]
    bits = qc["config_groups"]["group_0"]["weights"]["num_bits"]
    tensors = load_file(str(dst / "model.safetensors"))
    for module, t in packed_tensors(src).items():
        q, scale, zp = read_module(t, bits)
        for leaf in ("weight_packed", "weight_shape", "weight_zero_point"):
            tensors.pop(f"{module}.{leaf}", None)
        tensors[f"{module}.weight"] = q.to(torch.int8).contiguous()
        if zp is not None:
            tensors[f"{module}.weight_zero_point"] = zp.to(torch.int8).contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "int-quantized"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("symmetric", [True, False])
def test_int_quantized_reads_as_compressed_tensors_and_as_the_packed_artifact(tmp_path, tiny_model_dir, symmetric):
    from compressor.artifact import load_artifact

    packed = quantize_tiny(tmp_path / "packed", tiny_model_dir, symmetric=symmetric)
    unpacked = _as_int_quantized(packed, tmp_path / "int")
    qc, modules = decompress_as_kvq_reads(unpacked)  # compressed-tensors' IntQuantizationCompressor == kvq's reader
    assert qc["format"] == "int-quantized" and all(t["weight"].dtype == torch.int8 for t in modules.values())
    assert all(("weight_zero_point" in t) != symmetric for t in modules.values())
    a, _ = load_artifact(packed)
    b, _ = load_artifact(unpacked)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_int_quantized_values_by_hand_and_refusals():
    """(q - zero_point) * scale per group of 2 columns; values outside the width, int8 of 3 dimensions, a scale
    of the wrong shape and an asymmetric module without its zero point are one-line InputErrors."""
    group = {"targets": ["Linear"], "format": "int-quantized",
             "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 2}}
    q = torch.tensor([[-8, 7, 1, -1]], dtype=torch.int8)
    scale = torch.tensor([[0.5, 2.0]])
    zp = torch.tensor([[1, -1]], dtype=torch.int8)
    qc = {"config_groups": {"group_0": group}}
    module = "model.layers.0.mlp.up_proj"
    w = read_quant_weight("compressed-tensors", qc, module, {"weight": q, "weight_scale": scale, "weight_zero_point": zp})
    assert torch.equal(w.dequantize(torch.float32), torch.tensor([[-4.5, 3.0, 4.0, 0.0]]))
    bad = [({"weight": torch.tensor([[8, 0, 0, 0]], dtype=torch.int8), "weight_scale": scale, "weight_zero_point": zp},
            "outside -8..7"),
           ({"weight": q, "weight_scale": torch.ones(1, 4), "weight_zero_point": zp}, "does not match weight"),
           ({"weight": q[None], "weight_scale": scale, "weight_zero_point": zp}, "not an int-quantized weight"),
           ({"weight": q, "weight_scale": scale}, "asymmetric weights .* but no weight_zero_point")]
    for t, msg in bad:
        with pytest.raises(InputError, match=msg) as e:
            read_quant_weight("compressed-tensors", qc, module, t)
        assert "\n" not in str(e.value)


def test_a_packed_asymmetric_module_without_its_zero_point_is_refused(tmp_path, tiny_model_dir):
    """pack-quantized too: a deleted weight_zero_point is not read as 0 (it would shift the whole module)."""
    packed = quantize_tiny(tmp_path / "packed", tiny_model_dir, symmetric=False)
    qc = json.loads((packed / "config.json").read_text())["quantization_config"]
    module, t = next(iter(packed_tensors(packed).items()))
    read_quant_weight("compressed-tensors", qc, module, t)
    del t["weight_zero_point"]
    with pytest.raises(InputError, match="no weight_zero_point"):
        read_quant_weight("compressed-tensors", qc, module, t)
