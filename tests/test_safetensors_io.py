import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compressor.errors import InputError
from compressor.safetensors_io import read_header, tensor_digests


def _write(path, header: dict | str, data: bytes = b""):
    raw = header if isinstance(header, str) else json.dumps(header)
    raw = raw.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_valid_file_and_digests(tmp_path):
    from safetensors.torch import save_file

    f = tmp_path / "ok.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 2, dtype=torch.int32)}, str(f))
    h = read_header(f)
    assert h["a"].shape == (6,) and h["b"].dtype == "I32"
    import hashlib

    assert tensor_digests(f)["a"] == hashlib.sha256(torch.arange(6, dtype=torch.float32).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize(
    "header,data,msg",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "past the end"),
        ({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "do not match"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}, b"\0" * 8, "bad shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlap"),
        ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4, "duplicate"),
        ("{not json", b"", "invalid JSON"),
    ],
)
def test_hostile_headers(tmp_path, header, data, msg):
    f = _write(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(InputError, match=msg):
        read_header(f)


def test_header_length_beyond_file_and_truncated(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(InputError, match="exceeds"):
        read_header(f)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(InputError, match="shorter than 8 bytes"):
        read_header(f)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_never_crashes_unexpectedly(tmp_path_factory, blob):
    f = tmp_path_factory.mktemp("fz") / "f.safetensors"
    f.write_bytes(struct.pack("<Q", len(blob)) + blob)
    try:
        read_header(f)
    except InputError:
        pass


def test_a_sources_fingerprint_is_each_shards_plain_sha256(tmp_path):
    """The source's provenance (ModelSource.fingerprint, hashed by parallel threads) keeps each
    weight file's plain SHA-256, as one streaming hashlib pass gives it, so the manifests and
    resume keys of runs made before are unchanged."""
    import hashlib

    from safetensors.torch import save_file

    from compressor.source.resolve import ModelSource

    for k in range(3):
        save_file({f"w{k}": torch.randn(64, 33 + k)}, str(tmp_path / f"model-0000{k + 1}-of-00003.safetensors"))
    (tmp_path / "notes.txt").write_text("not a weight file")
    fp = ModelSource(str(tmp_path), "hf", tmp_path).fingerprint()
    want = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp_path.glob("*.safetensors"))}
    assert fp == {"spec": str(tmp_path), "kind": "hf", "files": want} and list(fp["files"]) == sorted(want)
    # under ranks each hashes its share of the files: together, every file once, the same digests
    parts = [ModelSource(str(tmp_path), "hf", tmp_path).fingerprint(r, 2)["files"] for r in range(2)]
    assert parts[0] and parts[1] and not set(parts[0]) & set(parts[1]) and {**parts[0], **parts[1]} == want


def test_files_are_dealt_largest_first_to_the_rank_with_the_fewest_bytes():
    from compressor.source.resolve import deal_files

    sizes = {"a": 10, "b": 7, "c": 6, "d": 4, "e": 1}
    assert deal_files(sizes, 2) == [["a", "d"], ["b", "c", "e"]]  # 14 bytes each
    assert deal_files({"x": 3, "y": 3}, 2) == [["x"], ["y"]]  # a tie: the lower rank
    assert deal_files({"only": 5}, 3) == [["only"], [], []]  # a rank may hash nothing
