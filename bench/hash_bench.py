"""Hashing throughput of `kvq verify --hashes-only` against the usual tools (issue #5).

Two artifacts: the SmolLM2-135M W4 artifact (ARTIFACT, default the `make demo` output)
and a synthetic ~2 GB artifact shaped like a small llama in fp16 (random bytes, written
once into SYNTH_DIR). For each, same run, warm page cache, median of REPEATS:

* kvq verify --hashes-only (sha256 manifest and blake3 manifest): the hashing phase as
  kvq reports it (`hashes.seconds`) and the command's wall time (includes imports);
* sha256sum over the same files (coreutils);
* Python hashlib.sha256 on one core (mmap, one thread: the baseline of the 1.8x target);
* blake3 package, multithreaded mmap (`blake3(max_threads=AUTO).update_mmap`);
* model_signing verify (stock CLI, key mode, on the same folder signed by kvq sign).

MB = 10^6 bytes. Usage: python bench/hash_bench.py  (env ARTIFACT, SYNTH_DIR, REPEATS)
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent
REPEATS = int(os.environ.get("REPEATS", "3"))


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name != "model.sig")


def total_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in files_of(folder))


def timed(fn) -> float:
    runs = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def warm(folder: Path) -> None:
    for p in files_of(folder):
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def hashlib_one_core(folder: Path) -> None:
    for p in files_of(folder):
        h = hashlib.sha256()
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            h.update(mm)
        h.hexdigest()


def blake3_mt(folder: Path) -> None:
    import blake3

    for p in files_of(folder):
        blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(str(p)).hexdigest()


def sha256sum(folder: Path) -> None:
    subprocess.run(["sha256sum", *map(str, files_of(folder))], check=True, stdout=subprocess.DEVNULL)


def kvq_hashes(folder: Path) -> tuple[float, float]:
    """(hashing seconds as kvq reports them, command wall seconds), medians."""
    inner, wall = [], []
    for _ in range(REPEATS):
        t = time.perf_counter()
        p = subprocess.run([str(BIN / "kvq"), "verify", str(folder), "--hashes-only", "--json"],
                           capture_output=True, text=True)
        wall.append(time.perf_counter() - t)
        if p.returncode != 0:
            raise SystemExit(f"kvq verify failed on {folder}: {p.stderr.strip()}")
        inner.append(json.loads(p.stdout)["hashes"]["seconds"])
    return statistics.median(inner), statistics.median(wall)


def kvq_hashes_in_process(folder: Path) -> float:
    from compressor.artifact import check_hashes

    return timed(lambda: check_hashes(folder))


def model_signing_verify(folder: Path, pub: Path) -> float:
    exe = BIN / "model_signing"

    def go():
        p = subprocess.run([str(exe), "verify", "key", "--signature", str(folder / "model.sig"),
                            "--public_key", str(pub), str(folder)], capture_output=True, text=True)
        if "Verification succeeded" not in p.stdout + p.stderr:
            raise SystemExit(f"model_signing verify failed: {p.stdout} {p.stderr}")

    return timed(go)


def make_synthetic(folder: Path, digest: str) -> None:
    """~2.05 GB fp16 safetensors shaped like a 19-layer llama (hidden 2048, MLP 5632, vocab 32000)."""
    from compressor.artifact import build_manifest, tool_info

    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / "model.safetensors"
    if not weights.exists():
        shapes = {"model.embed_tokens.weight": (32000, 2048)}
        for i in range(19):
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                shapes[f"model.layers.{i}.self_attn.{n}.weight"] = (2048, 2048)
            shapes[f"model.layers.{i}.mlp.gate_proj.weight"] = (5632, 2048)
            shapes[f"model.layers.{i}.mlp.up_proj.weight"] = (5632, 2048)
            shapes[f"model.layers.{i}.mlp.down_proj.weight"] = (2048, 5632)
            shapes[f"model.layers.{i}.input_layernorm.weight"] = (2048,)
            shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (2048,)
        header, off = {}, 0
        for name, shape in shapes.items():
            n = int(np.prod(shape)) * 2
            header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        rng = np.random.default_rng(0)
        tmp = weights.with_suffix(".partial")
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape in shapes.items():
                f.write(rng.integers(0, 256, size=int(np.prod(shape)) * 2, dtype=np.uint8).tobytes())
        os.replace(tmp, weights)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "note": "synthetic hashing benchmark"}))
    m = build_manifest(folder, {"tool": tool_info(), "source": {"spec": "synthetic"}, "recipe": {},
                                "quantization": {}}, digest_algorithm=digest)
    (folder / "kvq-manifest.json").write_text(m.to_json())


def bench_folder(label: str, folder: Path, folder_b3: Path, pub: Path) -> dict:
    warm(folder)
    size = total_bytes(folder)
    mb = size / 1e6
    row = {"artifact": label, "bytes": size}
    t_kvq, wall_kvq = kvq_hashes(folder)
    t_b3, wall_b3 = kvq_hashes(folder_b3)
    row["kvq_sha256_mb_s"] = mb / t_kvq
    row["kvq_sha256_wall_s"] = wall_kvq
    row["kvq_sha256_one_worker_mb_s"] = mb / timed(lambda: _check_hashes_workers(folder, 1))
    row["kvq_blake3_mb_s"] = mb / t_b3
    row["kvq_blake3_wall_s"] = wall_b3
    row["hashlib_sha256_1core_mb_s"] = mb / timed(lambda: hashlib_one_core(folder))
    row["sha256sum_mb_s"] = mb / timed(lambda: sha256sum(folder))
    row["blake3_mt_mmap_mb_s"] = mb / timed(lambda: blake3_mt(folder))
    row["model_signing_verify_wall_s"] = model_signing_verify(folder, pub)
    row["model_signing_verify_mb_s"] = mb / row["model_signing_verify_wall_s"]
    row["kvq_vs_hashlib"] = row["kvq_sha256_mb_s"] / row["hashlib_sha256_1core_mb_s"]
    row["kvq_blake3_vs_blake3_mt"] = row["kvq_blake3_mb_s"] / row["blake3_mt_mmap_mb_s"]
    return row


def _check_hashes_workers(folder: Path, workers: int):
    from compressor.artifact import check_hashes

    return check_hashes(folder, workers=workers)


def signed_copy_b3(src: Path, dst: Path) -> None:
    """Hard-link the files of ``src`` into ``dst`` (same page cache) and write a blake3 manifest."""
    from compressor.artifact import build_manifest
    from compressor.manifest import load_manifest

    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for p in files_of(src):
        if p.name != "kvq-manifest.json":
            os.link(p, dst / p.name)
    m = load_manifest(src)
    fields = {k: v for k, v in m.model_dump().items()
              if k not in ("files", "tensors", "provenance", "digest_algorithm", "schema_version")}
    (dst / "kvq-manifest.json").write_text(build_manifest(dst, fields, digest_algorithm="blake3").to_json())


def main() -> None:
    from compressor.commands.sign import run_sign
    from compressor.signing import SignOptions

    art = Path(os.environ.get("ARTIFACT", ROOT / ".kvq-demo" / "smollm2-w4a16-awq"))
    synth = Path(os.environ.get("SYNTH_DIR", "/tmp/kvq-hash-bench"))
    if not (art / "kvq-manifest.json").exists():
        raise SystemExit(f"{art} is not a kvq artifact: run `make demo` first or set ARTIFACT")
    work = synth / "work"
    work.mkdir(parents=True, exist_ok=True)
    keydir = work / "keys"
    keydir.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-c", os.environ.get("KEYGEN") or _KEYGEN, str(keydir)], check=True)
    pub = keydir / "pub.pem"

    # the SmolLM2 artifact: a private copy (hard links), re-signed with the bench key
    small = work / "smollm2"
    if small.exists():
        shutil.rmtree(small)
    small.mkdir()
    for p in files_of(art):
        os.link(p, small / p.name) if os.stat(p).st_dev == os.stat(work).st_dev else shutil.copy(p, small / p.name)
    make_synthetic(synth / "synthetic-2gb", "sha256")
    rows = []
    for label, folder in (("SmolLM2-135M W4 (kvq artifact)", small), ("synthetic 2 GB fp16", synth / "synthetic-2gb")):
        run_sign(folder, SignOptions(private_key=keydir / "key.pem"))
        b3 = work / (folder.name + "-blake3")
        signed_copy_b3(folder, b3)
        rows.append(bench_folder(label, folder, b3, pub))
        print(json.dumps(rows[-1], indent=1), flush=True)
    out = {"machine": _machine(), "repeats": REPEATS, "rows": rows}
    res = ROOT / "bench" / "results" / "hash_bench.json"
    res.parent.mkdir(exist_ok=True)
    res.write_text(json.dumps(out, indent=2) + "\n")
    print(table(rows))


def table(rows) -> str:
    lines = ["| artifact | size (MB) | kvq sha256 (MB/s) | kvq sha256, 1 worker | hashlib sha256 1 core | sha256sum "
             "| kvq blake3 | blake3 pkg MT mmap | model_signing verify (wall) | kvq / hashlib |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['artifact']} | {r['bytes'] / 1e6:,.0f} | {r['kvq_sha256_mb_s']:,.0f} | {r['kvq_sha256_one_worker_mb_s']:,.0f} "
            f"| {r['hashlib_sha256_1core_mb_s']:,.0f} | {r['sha256sum_mb_s']:,.0f} | {r['kvq_blake3_mb_s']:,.0f} "
            f"| {r['blake3_mt_mmap_mb_s']:,.0f} | {r['model_signing_verify_mb_s']:,.0f} MB/s ({r['model_signing_verify_wall_s']:.2f} s) "
            f"| {r['kvq_vs_hashlib']:.2f}x |")
    return "\n".join(lines)


def _machine() -> str:
    import platform

    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}"


_KEYGEN = """
import sys
from cryptography.hazmat.primitives import serialization as s
from cryptography.hazmat.primitives.asymmetric import ec
k = ec.generate_private_key(ec.SECP256R1())
open(sys.argv[1] + "/key.pem", "wb").write(k.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption()))
open(sys.argv[1] + "/pub.pem", "wb").write(k.public_key().public_bytes(s.Encoding.PEM, s.PublicFormat.SubjectPublicKeyInfo))
"""

if __name__ == "__main__":
    main()
