"""Models larger than memory (issue #9): streamed source layers, sharded output, spilled
activations, resume after an interruption."""

import json
from pathlib import Path

import pytest
import torch

from compressor.commands.options import QuantizeOptions
from compressor.commands.quantize import run_quantize
from compressor.artifact import load_artifact
from compressor.errors import InputError
from compressor.manifest import load_manifest
from compressor.safetensors_io import read_header, write_shards

from conftest import FAST, digests, make_model_dir
from conftest import kvq_run as run
from tiny_models import make_dir


@pytest.fixture(scope="module")
def whole(tmp_path_factory, deep_dir):
    """GPTQ and AWQ artifacts from the whole-model path (--no-stream): the reference."""
    d = tmp_path_factory.mktemp("whole")
    out = {}
    for alg in ("gptq", "awq"):
        s = run_quantize(QuantizeOptions(model=str(deep_dir), output=d / alg, algorithm=alg, stream=False, **FAST))
        assert s["source_loading"].startswith("whole model")
        out[alg] = d / alg
    return out


@pytest.mark.parametrize("alg", ["gptq", "awq"])
def test_streamed_equals_whole_model(alg, tmp_path, deep_dir, whole):
    s = run_quantize(QuantizeOptions(model=str(deep_dir), output=tmp_path / "o", algorithm=alg, **FAST))
    assert s["source_loading"] == "streamed: one decoder layer at a time"
    assert digests(tmp_path / "o") == digests(whole[alg])
    assert not list(tmp_path.glob(".o.kvq-*"))  # the staging folder became the artifact


def test_at_most_one_decoder_layer_is_materialized(tmp_path, deep_dir, monkeypatch):
    """Whenever a layer is loaded, every other decoder layer holds no weights (meta)."""
    import compressor.staging as st  # the LayerWriter's loads

    seen, outer = [], []
    real = st.load_into

    def spy(model, ckpt, arch, names, *dtype):
        layers = model.get_submodule(arch.layers)
        if all(n.startswith(arch.layers + ".") for n in names):
            seen.append([i for i, layer in enumerate(layers) if any(not p.is_meta for p in layer.parameters())])
            # the embedding and head were released once layer 0's inputs were captured
            outer.append([model.get_submodule(m).weight.is_meta for m in (arch.embed_tokens, arch.lm_head)])
        real(model, ckpt, arch, names, *dtype)

    monkeypatch.setattr(st, "load_into", spy)
    run_quantize(QuantizeOptions(model=str(deep_dir), output=tmp_path / "o", algorithm="gptq", **FAST))
    assert seen == [[], [], [], []]  # 4 loads, each with nothing else resident
    assert outer == [[True, True]] * 4


@pytest.mark.parametrize("tie", [True, False])
def test_embedding_and_head_are_read_again_for_the_write(tmp_path, tokenizer, tie):
    """Released during the layers, the embedding and head are read again in the storage dtype
    at the write: the same tensors as the whole-model run (tied and untied heads)."""
    src = make_model_dir(tmp_path / "m", tokenizer, num_hidden_layers=2, tie_word_embeddings=tie)
    floats = {}
    for name, stream in (("s", True), ("w", False)):
        floats[name] = run_quantize(QuantizeOptions(model=str(src), output=tmp_path / name, algorithm="rtn",
                                                    stream=stream, **FAST))["float32_bytes"]
    assert digests(tmp_path / "s") == digests(tmp_path / "w")
    # the summary's float32 size counts a tied head once, streamed or not (a fresh user saw 621 vs 513 MiB)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(src)
    assert floats["s"] == floats["w"] == 4 * sum(p.numel() for p in ref.parameters())  # parameters() dedups tied
    names = set(digests(tmp_path / "s"))
    assert "model.embed_tokens.weight" in names and ("lm_head.weight" in names) == (not tie)


@pytest.mark.parametrize("tie", [False, True])
def test_embedding_rows_of_the_calibration_tokens_only(tmp_path, tokenizer, monkeypatch, tie):
    """A streamed quantize reads only the calibration tokens' rows of the embedding (tied to the head
    or not) before the layers (not the table: Kimi K2's is 4.7 GB of float32 on every rank), and the
    artifact is the whole-model run's."""
    import compressor.layer_inputs as li
    from compressor.source.lazy import LazyCheckpoint

    src = make_model_dir(tmp_path / "m", tokenizer, num_hidden_layers=2, tie_word_embeddings=tie)
    asked, whole_reads, real_rows, real_get = [], [], li.read_rows, LazyCheckpoint.get

    def rows(ckpt, name, index, dtype=torch.float32):
        asked.append(index.clone())
        return real_rows(ckpt, name, index, dtype)

    def get(self, name, *a, **k):
        whole_reads.append((name, bool(asked)))
        return real_get(self, name, *a, **k)

    monkeypatch.setattr(li, "read_rows", rows)
    monkeypatch.setattr(LazyCheckpoint, "get", get)
    run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "s", algorithm="gptq", **FAST))
    monkeypatch.undo()
    run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "w", algorithm="gptq", stream=False, **FAST))
    assert digests(tmp_path / "s") == digests(tmp_path / "w")
    assert len(asked) == 1 and 0 < asked[0].numel() < 4 * 32 and bool((asked[0].diff() > 0).all())
    assert ("model.embed_tokens.weight", False) not in whole_reads  # the table: only for the write
    assert ("model.embed_tokens.weight", True) in whole_reads


def test_read_rows(tmp_path):
    """Rows of a bfloat16 table as float32, each read on its own; NaN rows and ids outside the table refused."""
    from safetensors.torch import save_file

    from compressor.layer_inputs import read_rows
    from compressor.source.lazy import LazyCheckpoint

    table = torch.randn(50, 24).to(torch.bfloat16)
    table[7, 3] = float("nan")
    save_file({"emb": table, "f8": torch.zeros(4, 4).to(torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    ckpt = LazyCheckpoint(tmp_path, block_fp8=None)
    idx = torch.tensor([0, 3, 4, 49])
    assert torch.equal(read_rows(ckpt, "emb", idx), table[idx].float())
    assert ckpt.bytes_read == 4 * 24 * 2
    with pytest.raises(InputError, match="NaN or Inf"):
        read_rows(ckpt, "emb", torch.tensor([7]))
    with pytest.raises(InputError, match="token id 50 is outside emb"):
        read_rows(ckpt, "emb", torch.tensor([1, 50]))
    with pytest.raises(InputError, match="no block scale"):  # not a plain float table: read whole, as before
        read_rows(ckpt, "f8", torch.tensor([1]))


def test_moe_source_is_streamed(tmp_path, tokenizer):
    src = make_dir(tmp_path / "moe", tokenizer, "qwen3_moe")
    a = run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "s", algorithm="gptq", **FAST))
    b = run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "w", algorithm="gptq", stream=False, **FAST))
    assert a["source_loading"].startswith("streamed") and b["source_loading"].startswith("whole")
    assert digests(tmp_path / "s") == digests(tmp_path / "w")
    assert a["moe"] == b["moe"]


def test_sharded_output(tmp_path, deep_dir, whole, capsys):
    out = tmp_path / "sharded"
    s = run_quantize(QuantizeOptions(model=str(deep_dir), output=out, algorithm="gptq", shard_bytes=60_000, **FAST))
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert s["shards"] == len(files) > 1
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    for f in files:
        hdr = read_header(out / f)
        assert all(index["weight_map"][n] == f for n in hdr)
    assert index["metadata"]["total_size"] == sum(e.end - e.start for f in files for e in read_header(out / f).values())
    assert digests(out) == digests(whole["gptq"])  # same tensors, other files
    layer_shards = {f for f in files if {n.split(".")[2] for n in read_header(out / f) if n.startswith("model.layers.")} == {"0"}}
    assert len(layer_shards) == 1 and all(n.startswith("model.layers.0.") for n in read_header(out / layer_shards.pop()))  # a layer's part, linked whole
    code, _, _ = run(["verify", out, "--hashes-only"], capsys)
    assert code == 0
    m, _ = load_artifact(out)
    ref, _ = load_artifact(whole["gptq"])
    for (n, p), (_, q) in zip(m.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(p, q), n


def test_spilled_activations_give_the_same_artifact(tmp_path, deep_dir, whole):
    run_quantize(QuantizeOptions(model=str(deep_dir), output=tmp_path / "o", algorithm="awq", activation_budget_gib=0, **FAST))
    assert digests(tmp_path / "o") == digests(whole["awq"])


class Crash(Exception):
    pass


def crash_gptq_at(monkeypatch, layer: int):
    """Make GPTQ raise :class:`Crash` when it reaches decoder layer ``layer``; returns the real function."""
    import compressor.quant.gptq_layer as pl

    real = pl.gptq_layer

    def crash(i, *a, **k):
        if i == layer:
            raise Crash(f"simulated crash in layer {layer}")
        return real(i, *a, **k)

    monkeypatch.setattr(pl, "gptq_layer", crash)
    return real


def test_static_kv_scales_survive_two_resumes(tmp_path, deep_dir, monkeypatch):
    """A run interrupted twice (after layer 1, then after layer 2) and resumed to the end keeps
    every layer's fp8 k_scale/v_scale: the second checkpoint must carry the first run's KV
    statistics too. The artifact equals an uninterrupted run's, tensor by tensor."""
    import compressor.quant.gptq_layer as pl

    opts = dict(model=str(deep_dir), algorithm="gptq", kv_scheme="fp8", **FAST)
    straight = tmp_path / "straight"
    run_quantize(QuantizeOptions(output=straight, **opts))
    out = tmp_path / "twice"
    real = crash_gptq_at(monkeypatch, 1)
    with pytest.raises(Crash):
        run_quantize(QuantizeOptions(output=out, **opts))
    monkeypatch.setattr(pl, "gptq_layer", real)
    crash_gptq_at(monkeypatch, 2)
    with pytest.raises(Crash):
        run_quantize(QuantizeOptions(output=out, resume=True, **opts))
    monkeypatch.setattr(pl, "gptq_layer", real)
    s = run_quantize(QuantizeOptions(output=out, resume=True, **opts))
    assert s["resumed_from_layer"] == 2
    scales = {n for n in digests(out) if n.endswith(("k_scale", "v_scale"))}
    assert len(scales) == 2 * 4
    assert digests(out) == digests(straight)


def test_static_kv_scheme_refuses_a_layer_without_statistics(tmp_path, deep_dir, monkeypatch):
    """Static KV scales missing for a layer (statistics lost) stop the run before anything is
    written: an artifact whose own verify would refuse it is never signed."""
    import compressor.pipeline as pipeline
    from compressor.errors import QuantizationError

    real = pipeline.observed_absmax
    monkeypatch.setattr(pipeline, "observed_absmax", lambda obs: {i: kv for i, kv in real(obs).items() if i != 0})
    out = tmp_path / "lost"
    with pytest.raises(QuantizationError, match="no KV-cache statistics for layer.s. 0 of 4"):
        run_quantize(QuantizeOptions(model=str(deep_dir), output=out, algorithm="gptq", kv_scheme="fp8", **FAST))
    assert not out.exists()


def test_resume_after_a_simulated_crash(tmp_path, deep_dir, whole, monkeypatch, capsys):
    import compressor.quant.gptq_layer as pl
    import compressor.staging as st  # the LayerWriter's loads

    out = tmp_path / "r"
    real = crash_gptq_at(monkeypatch, 2)
    with pytest.raises(Crash):
        run_quantize(QuantizeOptions(model=str(deep_dir), output=out, algorithm="gptq", **FAST))
    assert "rerun the same command with --resume" in capsys.readouterr().err
    staging = tmp_path / ".r.kvq-partial"
    state = json.loads((staging / "resume.json").read_text())
    assert state["layers_done"] == 2 and not out.exists()
    assert sorted(p.name for p in staging.glob("part-*.safetensors")) == ["part-layer-00000.safetensors",
                                                                          "part-layer-00001.safetensors"]
    assert [p.name for p in staging.glob("resume-hidden-*")] == ["resume-hidden-00002.safetensors"]  # older ones removed
    monkeypatch.setattr(pl, "gptq_layer", real)
    loaded = []
    real_load = st.load_into
    monkeypatch.setattr(st, "load_into", lambda model, ckpt, arch, names, *rest: (loaded.append(names[0]), real_load(model, ckpt, arch, names, *rest)))
    s = run_quantize(QuantizeOptions(model=str(deep_dir), output=out, algorithm="gptq", resume=True, **FAST))
    assert s["resumed_from_layer"] == 2
    assert [n.split(".")[2] for n in loaded if ".layers." in n] == ["2", "3"]  # finished layers are not loaded again
    timing = load_manifest(out).provenance["timing"]  # the whole job's time: the interrupted run's layers included
    assert len(timing["layer_seconds"]) == 4 and s["quantize_seconds"] >= sum(timing["layer_seconds"]) - 0.01
    assert digests(out) == digests(whole["gptq"])
    m = load_manifest(out)
    assert [f["layer"] for f in m.quality["layers"]] == [0, 1, 2, 3]
    assert not staging.exists() and not (out / "resume.json").exists()


@pytest.mark.slow  # a whole quantize -> verify / serve-smoke run (make test-fast leaves it out)
def test_resume_with_the_float_target_equals_an_uninterrupted_run(tmp_path, deep_dir, monkeypatch):
    """GPTQ's float target (``gptq.gptaq_alpha``) keeps a float stream beside the quantized one:
    the checkpoint holds both, so a resumed run writes the very tensors of an uninterrupted one."""
    import compressor.quant.gptq_layer as pl

    opts = dict(model=str(deep_dir), algorithm="gptq", settings=(("gptq.gptaq_alpha", 0.25),), **FAST)
    run_quantize(QuantizeOptions(output=tmp_path / "whole", **opts))
    out = tmp_path / "r"
    real = crash_gptq_at(monkeypatch, 2)
    with pytest.raises(Crash):
        run_quantize(QuantizeOptions(output=out, **opts))
    staging = tmp_path / ".r.kvq-partial"
    from safetensors import safe_open

    with safe_open(str(staging / "resume-hidden-00002.safetensors"), "pt") as f:
        keys = set(f.keys())
    n_b, n_f = sum(k.startswith("b") for k in keys), sum(k.startswith("f") for k in keys)
    assert n_b == n_f > 0 and len(keys) == n_b + n_f  # one float batch beside each quantized one
    monkeypatch.setattr(pl, "gptq_layer", real)
    s = run_quantize(QuantizeOptions(output=out, resume=True, **opts))
    assert s["resumed_from_layer"] == 2
    assert digests(out) == digests(tmp_path / "whole")
    assert load_manifest(out).recipe["gptq"]["gptaq_alpha"] == 0.25


def test_float_target_streams_are_spilled_within_the_budget(tmp_path, deep_dir, monkeypatch):
    """With ``gptq.gptaq_alpha`` the float stream and the float inputs of each reader set follow
    ``--activation-budget-gib`` as the quantized stream does: at 0 they are memory-mapped files,
    and the artifact is the one the in-memory run writes."""
    import compressor.activations as st

    opts = dict(model=str(deep_dir), algorithm="gptq", settings=(("gptq.gptaq_alpha", 0.25),), **FAST)
    run_quantize(QuantizeOptions(output=tmp_path / "mem", **opts))
    real, spilled = st.spill, []

    def record(hidden, folder, tag, budget):
        out = real(hidden, folder, tag, budget)
        spilled.append((tag, len(out), all(t.untyped_storage().filename is not None for t in out)))
        return out

    monkeypatch.setattr(st, "spill", record)
    run_quantize(QuantizeOptions(output=tmp_path / "disk", activation_budget_gib=0, **opts))
    assert digests(tmp_path / "disk") == digests(tmp_path / "mem")
    tags = {t for t, n, mapped in spilled if n and mapped}
    assert "float" in tags and any(t.startswith("float-in") for t in tags), spilled


def test_resume_refusals(tmp_path, deep_dir, monkeypatch, capsys):
    import compressor.quant.algorithms as pl

    out = tmp_path / "r"
    code, _, err = run(["quantize", deep_dir, "--algorithm", "rtn", "--group-size", "32", "-o", out, "--resume"], capsys)
    assert code == 2 and "no interrupted run to resume" in err
    real = pl.rtn_layer
    monkeypatch.setattr(pl, "rtn_layer", lambda i, *a: (_ for _ in ()).throw(Crash()) if i == 1 else real(i, *a))
    with pytest.raises(Crash):
        run_quantize(QuantizeOptions(model=str(deep_dir), output=out, algorithm="rtn", group_size=32,
                                     matmul_precision="bfloat16"))
    monkeypatch.setattr(pl, "rtn_layer", real)
    # other inputs (here the group size, then the calibration's matmul precision) cannot continue that run
    code, _, err = run(["quantize", deep_dir, "--algorithm", "rtn", "--group-size", "64", "-o", out, "--resume",
                        "--matmul-precision", "bfloat16"], capsys)  # only the group size differs (auto is float32 on some CPUs)
    assert code == 2 and "made from other inputs" in err
    code, _, err = run(["quantize", deep_dir, "--algorithm", "rtn", "--group-size", "32", "-o", out, "--resume",
                        "--matmul-precision", "float32"], capsys)
    assert code == 2 and "ran with --matmul-precision bfloat16 (this run: --matmul-precision float32)" in err
    # the thread count too: the last bits depend on it, and the manifest records one count
    code, _, err = run(["quantize", deep_dir, "--algorithm", "rtn", "--group-size", "32", "-o", out, "--resume",
                        "--matmul-precision", "bfloat16", "--threads", str(torch.get_num_threads() + 1)], capsys)
    assert code == 2 and f"ran with --threads {torch.get_num_threads()} (this run: --threads" in err
    # without --resume the stale run is replaced, and the result is complete
    s = run_quantize(QuantizeOptions(model=str(deep_dir), output=out, algorithm="rtn", group_size=32))
    assert s["resumed_from_layer"] is None and len(load_manifest(out).quality["layers"]) == 4


def test_input_error_leaves_no_staging_folder(tmp_path, deep_dir, capsys):
    code, _, err = run(["quantize", deep_dir, "--algorithm", "gptq", "--group-size", "48", "-o", tmp_path / "x"], capsys)
    assert code == 2
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value, ok", [("500MB", True), ("2GiB", True), ("5GB", True), ("1.5GB", True),
                                       ("12", False), ("five", False), ("3XB", False)])
def test_shard_size_parsing(value, ok, tmp_path, deep_dir, capsys):
    code, _, err = run(["quantize", deep_dir, "--algorithm", "rtn", "--group-size", "32", "--shard-size", value,
                        "-o", tmp_path / "o", "--json"], capsys)
    assert (code == 0) == ok, err
    if not ok:
        assert code == 2 and "--shard-size" in err


def test_write_shards_unit(tmp_path):
    from safetensors.torch import load_file, save_file

    a = {"x": torch.arange(10, dtype=torch.float32), "big": torch.ones(100, dtype=torch.float16)}
    b = {"y": torch.arange(6, dtype=torch.int32).view(2, 3)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    wm = write_shards([tmp_path / "a.safetensors", tmp_path / "b.safetensors"], out, shard_bytes=64)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == 3 and set(wm.values()) == set(files)  # "big" (200 bytes) alone in its shard
    got = {}
    for f in files:
        read_header(out / f)  # valid: no holes, aligned header
        got.update(load_file(str(out / f)))
    for k, v in {**a, **b}.items():
        assert torch.equal(got[k], v)
    single = tmp_path / "single"
    single.mkdir()
    write_shards([tmp_path / "a.safetensors"], single, shard_bytes=10**9)
    assert [p.name for p in single.iterdir()] == ["model.safetensors"]
    with pytest.raises(InputError, match="written twice"):
        write_shards([tmp_path / "a.safetensors", tmp_path / "a.safetensors"], tmp_path / "out", 10**9)



@pytest.mark.parametrize("kernel", ["copy_file_range", "refused", "absent"])
def test_write_shards_copies_the_same_bytes_however_it_copies(tmp_path, monkeypatch, kernel):
    """A shard's data is copied in the kernel (os.copy_file_range) where the system allows, else read
    and written: the same file bytes either way; a part shorter than its header says is named."""
    import errno

    from safetensors.torch import save_file

    from compressor import safetensors_io as sio

    save_file({"x": torch.arange(1000, dtype=torch.float32), "y": torch.ones(7, dtype=torch.int8)},
              str(tmp_path / "a.safetensors"))
    save_file({"z": torch.arange(6, dtype=torch.int32)}, str(tmp_path / "b.safetensors"))
    parts = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    (tmp_path / "want").mkdir()
    write_shards(parts, tmp_path / "want", 10**9)
    if kernel == "refused":
        def refuse(*_a):
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(sio.os, "copy_file_range", refuse)
    elif kernel == "absent":
        monkeypatch.delattr(sio.os, "copy_file_range")
    (tmp_path / "got").mkdir()
    write_shards(parts, tmp_path / "got", 10**9)
    got, want = (tmp_path / d / "model.safetensors" for d in ("got", "want"))
    assert got.read_bytes() == want.read_bytes()
    data = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "a.safetensors").write_bytes(data[:-100])  # x's data cut short; the header still promises it
    with open(tmp_path / "a.safetensors", "rb") as src, open(tmp_path / "cut", "wb") as dst:
        with pytest.raises(InputError, match="truncated while assembling"):
            sio._copy_range(src.fileno(), dst.fileno(), 0, len(data), tmp_path / "a.safetensors")

def test_write_shards_links_layer_parts(tmp_path):
    """Parts named in ``link`` become shards by hard link (no second copy on disk) once the
    tensors need several shards; the rest is packed as before; one shard copies as before."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for j in range(3):
        t = {f"model.layers.{j}.w": torch.full((40,), float(j)), f"model.layers.{j}.b": torch.arange(5.0) + j}
        save_file(t, str(tmp_path / f"part-{j}.safetensors"), metadata={"format": "pt"})
        tensors.update(t)
    final = {"model.embed_tokens.weight": torch.ones(30), "lm_head.weight": torch.zeros(30), "model.norm.weight": torch.ones(2)}
    save_file(final, str(tmp_path / "part-final.safetensors"))
    tensors.update(final)
    layer_parts = [tmp_path / f"part-{j}.safetensors" for j in range(3)]
    out = tmp_path / "out"
    out.mkdir()
    wm = write_shards([*layer_parts, tmp_path / "part-final.safetensors"], out, shard_bytes=150, link=layer_parts,
                      skip={layer_parts[1]: {"model.layers.1.b"}})
    files = sorted(out.glob("*.safetensors"))
    got = {}
    for f in files:
        read_header(f)
        got.update(load_file(str(f)))
    assert set(got) == set(tensors) - {"model.layers.1.b"}
    assert all(torch.equal(got[k], tensors[k]) for k in got)
    inodes = {f.stat().st_ino: f.name for f in files}
    assert layer_parts[0].stat().st_ino in inodes and layer_parts[2].stat().st_ino in inodes  # linked, not copied
    assert layer_parts[1].stat().st_ino not in inodes  # a tensor skipped from it: copied without it
    assert wm["model.layers.0.w"] == inodes[layer_parts[0].stat().st_ino]
    assert wm["model.layers.1.w"] != wm["model.layers.0.w"] and wm["lm_head.weight"] not in (wm["model.layers.0.w"],
                                                                                           wm["model.layers.2.w"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == dict(sorted(wm.items()))
    one = tmp_path / "one"
    one.mkdir()
    write_shards([*layer_parts, tmp_path / "part-final.safetensors"], one, shard_bytes=10**9, link=layer_parts)
    assert [f.name for f in one.iterdir()] == ["model.safetensors"]
    assert all(f.stat().st_ino != (one / "model.safetensors").stat().st_ino for f in layer_parts)


def _rank_main(rank, world, port, src, out, result_file):
    """One torchrun-like rank: the environment torchrun would set, then the CLI."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from compressor.commands.options import QuantizeOptions
    from compressor.commands.quantize import run_quantize
    import compressor.distributed as d
    import compressor.quant.gptq_layer as pl

    calls = []
    real = d.deal

    def spy(tasks, solve):
        calls.append(len(tasks))
        # t: (the linears solved together, their set, None or the slice of rows this rank solves)
        def tagged(t):
            calls.append(("solved", [f"{r}{'' if t[2] is None else '[slice]'}" for r in t[0]]))
            return solve(t)
        return real(tasks, tagged)

    pl.deal = spy
    s = run_quantize(QuantizeOptions(model=str(src), output=out, algorithm="gptq", **FAST))
    json.dump({"summary": {k: v for k, v in s.items() if k in ("rank", "world_size", "output")},
               "solved": [rel for c in calls if isinstance(c, tuple) for rel in c[1]]}, open(f"{result_file}.{rank}", "w"))


@pytest.mark.slow  # spawns two quantizing processes (make test-fast leaves it out)
def test_gloo_two_processes_split_the_gptq_solves(tmp_path, deep_dir, whole):
    """2 processes (gloo, CPU) quantize together: each solves a slice of the rows of every linear
    (one task each under several ranks, a reader set's factor divided once; a single process stacks
    a reader set's linears into one solve), rank 0 writes, and the artifact is bit-identical to the
    single-process one."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    out = tmp_path / "dist"
    res = tmp_path / "res"
    mp.spawn(_rank_main, args=(2, port, str(deep_dir), str(out), str(res)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"res.{r}").read_text()) for r in (0, 1))
    assert r0["summary"]["world_size"] == 2 and r0["summary"]["output"] == str(out)
    assert r1["summary"] == {"rank": 1, "world_size": 2, "output": None}
    linears = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
    for r in (r0, r1):  # one slice of every linear on each rank, in each of the 4 layers
        assert sorted(r["solved"]) == sorted(f"{rel}[slice]" for rel in linears * 4)
    assert digests(out) == digests(whole["gptq"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dist", "res.0", "res.1"]


def test_resume_refuses_a_damaged_checkpoint(tmp_path, deep_dir, monkeypatch, capsys):
    """A part or the saved activations changed after the checkpoint: --resume refuses (it
    would otherwise bake the damage into a manifest that then verifies)."""
    import compressor.quant.gptq_layer as pl

    real = crash_gptq_at(monkeypatch, 2)
    with pytest.raises(Crash):
        run_quantize(QuantizeOptions(model=str(deep_dir), output=tmp_path / "r", algorithm="gptq", **FAST))
    monkeypatch.setattr(pl, "gptq_layer", real)
    staging = tmp_path / ".r.kvq-partial"
    for name in ("part-layer-00000.safetensors", "resume-hidden-00002.safetensors"):
        f = staging / name
        data = bytearray(f.read_bytes())
        data[-1] ^= 1
        f.write_bytes(bytes(data))
        code, _, err = run(["quantize", deep_dir, "--algorithm", "gptq", "--group-size", "32", "--calib-samples", "4",
                            "--calib-seqlen", "32", "-o", tmp_path / "r", "--resume"], capsys)
        assert code == 2 and f"{name} changed since it was checkpointed" in err, err
        data[-1] ^= 1
        f.write_bytes(bytes(data))
    s = run_quantize(QuantizeOptions(model=str(deep_dir), output=tmp_path / "r", algorithm="gptq", resume=True, **FAST))
    assert s["resumed_from_layer"] == 2


def test_json_only_from_rank_0(tmp_path, deep_dir, monkeypatch, capsys):
    import compressor.commands.quantize as quantize_command

    monkeypatch.setattr(quantize_command, "run_quantize", lambda opts, console=None, **kw: {"rank": 1, "world_size": 2, "output": None})
    code, out, _ = run(["quantize", deep_dir, "-o", tmp_path / "o", "--json"], capsys)
    assert code == 0 and out == ""


def test_verify_refuses_a_reference_of_another_architecture(tmp_path, deep_dir, whole, tokenizer, capsys):
    other = make_model_dir(tmp_path / "two-layers", tokenizer)  # 2 layers instead of 4
    code, _, err = run(["verify", whole["gptq"], "--reference", other, "--weights-only"], capsys)
    assert code == 2 and "does not have the artifact's architecture" in err and "model.layers.2" in err


def test_interrupted_final_write_keeps_the_checkpoint(tmp_path, deep_dir, whole, monkeypatch, capsys):
    """Every layer done, then the final write (joining parts, hashing, signing) fails: the
    checkpoint survives, is named on stderr, and --resume writes the same artifact."""
    import compressor.safetensors_io as sio

    real = sio.write_shards

    def broken(*a, **k):
        raise Crash("simulated crash while writing the shards")

    monkeypatch.setattr(sio, "write_shards", broken)
    out = tmp_path / "r"
    with pytest.raises(Crash):
        run_quantize(QuantizeOptions(model=str(deep_dir), output=out, algorithm="gptq", **FAST))
    assert "stopped after 4 of 4 layers" in capsys.readouterr().err
    staging = tmp_path / ".r.kvq-partial"
    assert json.loads((staging / "resume.json").read_text())["layers_done"] == 4 and not out.exists()
    assert not (staging / "artifact").exists() and not (staging / "part-final.safetensors").exists()
    monkeypatch.setattr(sio, "write_shards", real)
    s = run_quantize(QuantizeOptions(model=str(deep_dir), output=out, algorithm="gptq", resume=True, **FAST))
    assert s["resumed_from_layer"] == 4 and digests(out) == digests(whole["gptq"]) and not staging.exists()


def test_checkpoint_is_crash_consistent(tmp_path, deep_dir, whole, monkeypatch):
    """A crash after layer 2's activations are saved but before resume.json names them: the
    checkpoint of layer 1 is still whole, and --resume continues from it."""
    import compressor.staging as st

    real = st._atomic_write
    calls = []

    def crash_second(path):
        calls.append(path)
        if len(calls) == 2:
            raise Crash("simulated crash before resume.json is replaced")
        return real(path)

    monkeypatch.setattr(st, "_atomic_write", crash_second)
    out = tmp_path / "r"
    with pytest.raises(Crash):
        run_quantize(QuantizeOptions(model=str(deep_dir), output=out, algorithm="gptq", **FAST))
    monkeypatch.setattr(st, "_atomic_write", real)
    staging = tmp_path / ".r.kvq-partial"
    assert json.loads((staging / "resume.json").read_text())["layers_done"] == 1
    assert (staging / "resume-hidden-00002.safetensors").exists()  # written, not yet named: ignored
    s = run_quantize(QuantizeOptions(model=str(deep_dir), output=out, algorithm="gptq", resume=True, **FAST))
    assert s["resumed_from_layer"] == 1 and digests(out) == digests(whole["gptq"]) and not staging.exists()


def test_signal_while_the_artifact_is_put_in_place(tmp_path, deep_dir, monkeypatch, capsys):
    """SIGTERM between moving the old artifact aside and renaming the new one in: the rename
    completes first (OUT is never missing), the exit is 143 and the message says the artifact
    was written; nothing is left beside it."""
    import os
    import signal

    import compressor.artifact as art

    out = tmp_path / "o"
    args = ["quantize", deep_dir, "--algorithm", "rtn", "--group-size", "32", "-o", out]
    assert run(args, capsys)[0] == 0
    real = os.replace

    def replace(src, dst):
        if str(dst).endswith("artifact"):  # the old artifact moved aside: the signal lands now
            signal.raise_signal(signal.SIGTERM)
        return real(src, dst)

    monkeypatch.setattr(art.os, "replace", replace)
    code, _, err = run([*args, "--group-size", "64", "--overwrite"], capsys)
    monkeypatch.setattr(art.os, "replace", real)
    assert code == 143 and f"terminated after the artifact was written to {out}" in err, err
    assert load_manifest(out).quantization["group_size"] == 64
    assert [p.name for p in tmp_path.iterdir()] == ["o"]
    assert run(["verify", out, "--hashes-only"], capsys)[0] == 0


def test_a_second_signal_does_not_cut_the_clean_up_short():
    import signal

    from compressor import interrupts

    previous = interrupts.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts.deferred():
                signal.raise_signal(signal.SIGTERM)  # held inside the block
                signal.raise_signal(signal.SIGINT)  # ignored: already unwinding
                cleaned = True
        assert cleaned and interrupts.received() == signal.SIGTERM
        signal.raise_signal(signal.SIGTERM)  # a later signal while unwinding: no new exception
    finally:
        interrupts.restore(previous)
    assert interrupts.received() is None
    with interrupts.deferred():  # nothing pending after restore: a later block completes
        pass


def test_gguf_conversion_for_streaming_needs_a_writable_cache(tmp_path, monkeypatch):
    """``open_lazy(convert_gguf=True)`` converts a GGUF file not cached yet only when kvq's cache
    can hold the result (else it is loaded whole, converted once, as before); a conversion whose
    cache entry still fails its check is not streamed either."""
    import compressor.source.open as cm
    from compressor.source.gguf_cache import cache_writable
    from compressor.source.resolve import ModelSource
    from compressor.source.open import open_lazy

    calls = []
    monkeypatch.setattr(cm, "load_model", lambda source, *a, **k: calls.append(source))
    monkeypatch.setattr(cm, "cached_gguf_folder", lambda source: None)
    src = ModelSource("x.gguf", "gguf", tmp_path / "x.gguf")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "file" / "cache"))  # under a file: cannot be made
    assert not cache_writable()
    model, reason = open_lazy(src, convert_gguf=True)
    assert model is None and calls == [] and f"kvq's cache folder {tmp_path / 'file' / 'cache'} cannot be written" in reason
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    assert cache_writable()
    model, reason = open_lazy(src, convert_gguf=True)
    assert model is None and "GGUF" in reason and calls == [src]
    assert open_lazy(src)[0] is None and calls == [src]  # without convert_gguf: never converted here


def test_a_second_run_of_the_same_output_is_refused_while_the_first_holds_it(tmp_path):
    """Two ``kvq quantize`` runs of one output: the second is refused with a clear error instead of
    replacing the first one's staging folder under it; once the first lets go, it may proceed."""
    from compressor.errors import InputError
    from compressor.staging import _release, open_staging, staging_path

    out = tmp_path / "art"
    first = open_staging(out, "k1", resume=False)
    assert first.lock is not None and staging_path(out).is_dir()
    with pytest.raises(InputError, match="another kvq quantize is writing"):
        open_staging(out, "k2", resume=False)
    assert staging_path(out).is_dir() and first.path.exists()  # the first run's folder is untouched
    _release(first)
    second = open_staging(out, "k2", resume=False)  # an abandoned folder is replaced as before
    assert second.lock is not None
    _release(second)


def test_resume_holds_the_claim_from_the_check_to_the_end_and_lets_go_when_refused(tmp_path):
    """``--resume`` claims the interrupted run's folder once and keeps it (no window between the
    check and the resumed run); a refused resume (other inputs) releases it for the next run."""
    import json

    from compressor.errors import InputError
    from compressor.staging import RESUME_NAME, _release, open_staging, staging_path

    out = tmp_path / "art"
    first = open_staging(out, "k1", resume=False)
    (staging_path(out) / RESUME_NAME).write_text(json.dumps({"key": "k1", "parts": [], "digests": {}, "layers_done": 0}))
    _release(first)
    with pytest.raises(InputError, match="other inputs"):
        open_staging(out, "k2", resume=True)
    resumed = open_staging(out, "k1", resume=True)  # the refused attempt let go of its claim
    assert resumed.lock is not None
    with pytest.raises(InputError, match="another kvq quantize is writing"):
        open_staging(out, "k1", resume=True)
    _release(resumed)


def test_no_second_run_slips_in_while_the_checkpoint_is_read(tmp_path, monkeypatch):
    """A second run that starts while ``--resume`` reads the interrupted run's checkpoint is refused."""
    import json

    from compressor import staging as st
    from compressor.errors import InputError

    out = tmp_path / "art"
    first = st.open_staging(out, "k1", resume=False)
    (st.staging_path(out) / st.RESUME_NAME).write_text(json.dumps({"key": "k1", "parts": [], "digests": {}, "layers_done": 0}))
    st._release(first)
    real, seen = st._resume, []

    def resume_with_a_rival(*a, **kw):
        try:
            st._release(st.open_staging(out, "k1", resume=False))
            seen.append("rival got in")
        except InputError as e:
            seen.append(str(e))
        return real(*a, **kw)

    monkeypatch.setattr(st, "_resume", resume_with_a_rival)
    resumed = st.open_staging(out, "k1", resume=True)
    assert len(seen) == 1 and "another kvq quantize is writing" in seen[0]
    st._release(resumed)


def test_a_second_quantize_of_a_busy_output_is_refused_before_any_work(tiny_model_dir, tmp_path, capsys):
    """The refusal comes from the plan (before the source loads or calibration is read): one line on stderr."""
    from conftest import kvq_run

    from compressor.staging import _release, open_staging

    out = tmp_path / "art"
    first = open_staging(out, "k1", resume=False)
    try:
        code, _, err = kvq_run(["quantize", str(tiny_model_dir), "-o", str(out), "--algorithm", "rtn"], capsys)
    finally:
        _release(first)
    assert code == 2 and err.strip().splitlines() == [err.strip()] and "another kvq quantize is writing" in err


def test_only_rank_0_checks_the_staging_claim_early(tmp_path, monkeypatch):
    """Under torchrun the other ranks write no staging folder and may plan after rank 0 claimed
    it: they must not refuse their own run."""
    from compressor.errors import InputError
    from compressor.staging import _release, open_staging, refuse_if_in_use

    out = tmp_path / "art"
    held = open_staging(out, "k1", resume=False)
    try:
        monkeypatch.setenv("RANK", "1")
        refuse_if_in_use(out)
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(InputError, match="another kvq quantize is writing"):
            refuse_if_in_use(out)
    finally:
        _release(held)


def test_a_refused_resume_names_the_inputs_that_changed(tmp_path):
    import json

    from compressor.errors import InputError
    from compressor.staging import RESUME_NAME, _release, input_digests, open_staging, resume_key, staging_path

    out = tmp_path / "art"
    before = {"source": {"a": "1"}, "recipe": {"bits": 4}, "calibration": {"samples": 8}, "format": "ct", "dtype": "bf16"}
    first = open_staging(out, resume_key(before), resume=False, inputs=input_digests(before))
    (staging_path(out) / RESUME_NAME).write_text(json.dumps({"key": resume_key(before), "parts": [], "digests": {},
                                                            "layers_done": 0, "inputs": input_digests(before)}))
    _release(first)
    now = {**before, "calibration": {"samples": 9}}
    with pytest.raises(InputError, match=r"other inputs \(the calibration input differs\)"):
        open_staging(out, resume_key(now), resume=True, inputs=input_digests(now))
    now = {**now, "recipe": {"bits": 3}}
    with pytest.raises(InputError, match=r"the recipe \(with its flag overrides\) and the calibration input differ\)"):
        open_staging(out, resume_key(now), resume=True, inputs=input_digests(now))
    _release(open_staging(out, resume_key(before), resume=True, inputs=input_digests(before)))


def test_gguf_cache_entry_damaged_or_blocked_by_a_file_is_named_and_replaced(tmp_path, monkeypatch):
    """A cache entry that fails its check (a file where the folder belongs, a file whose BLAKE3
    changed) is not used and is named in a note the commands print as a warning; the next
    conversion replaces it; a cache that cannot be stored is named too."""
    from compressor.source.gguf_cache import (
        _gguf_key, _write_gguf_cache, cache_root, cached_gguf_folder, stale_cache_notes, take_cache_notes,
    )
    from compressor.source.resolve import ModelSource

    class Saved:  # stands for the converted model and tokenizer
        def save_pretrained(self, folder, **kw):
            Path(folder, "config.json").write_text("{}")
            Path(folder, "model.safetensors").write_bytes(b"weights")

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF, as far as the cache knows")
    src = ModelSource("m.gguf", "gguf", gguf)
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVQ_CACHE_KEY_FILE", str(tmp_path / "config" / "cache-key"))
    take_cache_notes()
    assert cached_gguf_folder(src) is None and take_cache_notes() == []  # no entry: nothing to say
    entry = cache_root() / "gguf" / _gguf_key(src)
    entry.parent.mkdir(parents=True)
    entry.write_text("x")  # a file where the entry belongs
    assert cached_gguf_folder(src) is None
    notes = take_cache_notes()
    assert len(notes) == 1 and "failed its check: its index cannot be read" in notes[0] and "converted again" in notes[0]
    _write_gguf_cache(src, Saved(), Saved())
    assert cached_gguf_folder(src) == entry and take_cache_notes() == []
    import compressor.source.gguf_cache as gc_mod

    hashed = []
    real = gc_mod.file_digest
    monkeypatch.setattr(gc_mod, "file_digest", lambda *a: hashed.append(a) or real(*a))
    assert cached_gguf_folder(src) == entry and hashed == []  # checked before, unchanged: nothing hashed again
    monkeypatch.setattr(gc_mod, "file_digest", real)
    (entry / "model.safetensors").write_bytes(b"weightz")
    assert cached_gguf_folder(src) is None
    assert "model.safetensors does not match its BLAKE3 digest" in take_cache_notes()[0]
    (entry / "model.safetensors").unlink()
    assert cached_gguf_folder(src) is None and "model.safetensors is missing" in take_cache_notes()[0]
    (entry / "model.safetensors").mkdir()
    assert cached_gguf_folder(src) is None and "model.safetensors is not a file" in take_cache_notes()[0]
    assert stale_cache_notes(src) and take_cache_notes() == []  # said once, before a conversion
    monkeypatch.setenv("KVQ_CACHE_DIR", str(gguf / "cache"))  # under a file: cannot be made
    _write_gguf_cache(src, Saved(), Saved())
    assert "could not be stored in kvq's cache" in take_cache_notes()[0]
