"""``kvq quantize --workers N`` (compressor/data_free.py): a data-free recipe converted by N processes
writes the single process's artifact, digest for digest, on a tiny llama and on a tiny DeepSeek-V3
row stored block-FP8 whose MoE layers are read in groups of one expert; calibrated recipes are
refused; a worker killed stops the run in one line."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compressor.commands.options import QuantizeOptions
from compressor.commands.quantize import run_quantize
from compressor.data_free import Unit, assign
from compressor.errors import InputError
from compressor.manifest import load_manifest

from conftest import digests
from tiny_models import make_model_dir, make_published, to_block_fp8

REPO = Path(__file__).resolve().parents[1]
#: the memory budget of one routed expert of the tiny rows (3 linears of 64 x 32 weights, 5 bytes each, and a half)
ONE_EXPERT_GIB = 1.5 * 3 * 64 * 32 * 5 / 2**30


def _run(src, out, workers, **kw):
    return run_quantize(QuantizeOptions(model=str(src), output=out, recipe=("w4a16-rtn-g64",), group_size=32,
                                        threads=2, workers=workers, **kw))


def _same(runs: list[dict]) -> None:
    """Every run's artifact is the first one's: tensor digests, file digests, the manifest's content digest."""
    first = Path(runs[0]["output"])
    files = {n: f.digest for n, f in load_manifest(first).files.items()}
    for r in runs[1:]:
        assert digests(r["output"]) == digests(first)
        assert {n: f.digest for n, f in load_manifest(r["output"]).files.items()} == files
        assert r["content_digest"] == runs[0]["content_digest"]


def test_assign_deals_contiguous_runs_of_about_equal_size():
    units = [Unit(i, None, s) for i, s in enumerate([10, 10, 10, 10, 40, 10, 10])]
    got = assign(units, 3)
    assert [[u.layer for u in s] for s in got] == [[0, 1, 2], [3, 4], [5, 6]]
    assert assign(units, 3) == got and sum(map(len, assign(units, 9))) == len(units)


@pytest.mark.slow  # starts worker processes
def test_llama_one_two_three_workers_write_one_artifact(tokenizer, tmp_path):
    src = make_model_dir(tmp_path / "llama", tokenizer, num_hidden_layers=3)
    runs = [_run(src, tmp_path / f"w{n}", n) for n in (1, 2, 3)]
    _same(runs)
    assert [r["workers"] for r in runs] == [1, 2, 3] and runs[0]["worker_reads"] is None
    assert [w["worker"] for w in runs[2]["worker_reads"]] == [0, 1, 2]
    read = [r["source_bytes_read"] for r in runs]
    assert read[0] > 0 and all(r["source_gb_per_s"] > 0 for r in runs)
    outer = read[0] - sum(w["bytes_read"] for w in runs[1]["worker_reads"])  # the main process reads the embedding
    assert read[1] == read[2] == read[0] and outer > 0


@pytest.mark.slow
def test_block_fp8_deepseek_v3_in_expert_groups(tokenizer, tmp_path):
    """Layer 0 dense, layers 1-2 of 4 routed experts read in groups of one: 11 units dealt among the
    workers (a layer's non-expert part and its experts in different processes), the MTP layer (a
    third of the routed experts' bytes) copied by the main process; the same artifact and manifest
    as one process."""
    fp8 = tmp_path / "fp8"
    to_block_fp8(make_published(tmp_path / "bf16", tokenizer, "deepseek_v3", num_hidden_layers=3), fp8)
    runs = [_run(fp8, tmp_path / f"w{n}", n, memory_budget_gib=ONE_EXPERT_GIB) for n in (1, 2, 3)]
    _same(runs)
    layers = load_manifest(runs[2]["output"]).quality["layers"]
    assert [f.get("weight_groups") for f in layers] == [None, 5, 5]
    assert [r["routed_expert_bytes_read"] for r in runs[1:]] == [runs[0]["routed_expert_bytes_read"]] * 2
    assert all(w["units"] and w["bytes_read"] for w in runs[2]["worker_reads"])
    assert sum(w["expert_bytes_read"] for w in runs[2]["worker_reads"]) == 2 / 3 * runs[0]["routed_expert_bytes_read"]


@pytest.mark.parametrize("flags,why", [
    ({"recipe": ("w4a16-gptq",)}, "GPTQ needs a calibration forward pass"),
    ({"recipe": ("w4a16-rtn-g64", "kv-fp8")}, "static KV-cache scales"),
    ({"recipe": ("w4a16-rtn-g64",), "stream": False}, "--no-stream"),
])
def test_calibrated_recipes_are_refused(tiny_model_dir, tmp_path, flags, why):
    with pytest.raises(InputError, match=f"--workers 2: {why}") as e:
        run_quantize(QuantizeOptions(model=str(tiny_model_dir), output=tmp_path / "o", workers=2, **flags))
    assert "\n" not in str(e.value) and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_killed_worker_stops_the_run_in_one_line(tokenizer, tmp_path):
    src = make_model_dir(tmp_path / "llama", tokenizer, num_hidden_layers=3)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-m", "compressor", "quantize", str(src), "-o", str(tmp_path / "o"),
                          "--recipe", "w4a16-rtn-g64", "--group-size", "32", "--workers", "2", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    killed = None
    deadline = time.monotonic() + 60
    while killed is None and time.monotonic() < deadline and p.poll() is None:
        killed = next((c for c in _children(p.pid) if "multiprocessing-fork" in _cmdline(c)), None)
        time.sleep(0.05)
    assert killed is not None, "no worker process seen"
    os.kill(killed, 9)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, err
    lines = [line for line in err.splitlines() if line.startswith("kvq")]  # the others: progress steps
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kvq: error: worker ") and " of 2 died (killed by SIGKILL) while converting " in lines[0]
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.kvq-partial").exists()


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class Crash(Exception):
    pass


@pytest.mark.slow
def test_a_run_interrupted_in_one_process_resumes_with_two_workers(tokenizer, tmp_path, monkeypatch):
    """Layers 0-1 checkpointed by one process, layers 2-3 converted by two workers on --resume: the
    uninterrupted run's artifact, the finished layers kept as they were."""
    import compressor.pipeline as pipeline

    src = make_model_dir(tmp_path / "llama", tokenizer, num_hidden_layers=4)
    ref = _run(src, tmp_path / "ref", 1)
    real = pipeline._quantize_layer

    def crash_at_2(i, *a, **k):
        if i == 2:
            raise Crash
        return real(i, *a, **k)

    monkeypatch.setattr(pipeline, "_quantize_layer", crash_at_2)
    with pytest.raises(Crash):
        _run(src, tmp_path / "r", 1)
    monkeypatch.setattr(pipeline, "_quantize_layer", real)
    assert json.loads((tmp_path / ".r.kvq-partial" / "resume.json").read_text())["layers_done"] == 2
    got = _run(src, tmp_path / "r", 2, resume=True)
    assert got["resumed_from_layer"] == 2 and [w["units"] for w in got["worker_reads"]] == [1, 1]
    _same([ref, got])
    assert [f["layer"] for f in load_manifest(got["output"]).quality["layers"]] == [0, 1, 2, 3]
