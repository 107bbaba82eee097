"""Packaging: the built wheel, installed without the editable checkout, carries the bundled
recipes and runs `kvq recipes` and a tiny quantize (issue #17).

The wheel is built offline (`pip wheel --no-build-isolation`, the running venv's setuptools)
from a copy of the sources, so no `build/` or `*.egg-info` lands in the checkout and no stale
`build/lib` leaks into the wheel. It is installed with `pip install --target SITE --no-deps`
and run with `PYTHONPATH=SITE` from a folder outside the repository: the dependencies come
from the running venv, `compressor` from the wheel (asserted).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
#: what the build reads besides the package (pyproject's `readme`)
BUILD_FILES = ("pyproject.toml", "README.md")


def _env(site: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PYTHONNOUSERSITE="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return env


def _check(cmd: list, cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd[:4]}... exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(site folder holding the installed wheel, a working folder outside the repository)."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    shutil.copytree(REPO / "compressor", src / "compressor", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in BUILD_FILES:
        shutil.copy2(REPO / name, src / name)
    _check([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", work / "dist", src],
           work, _env())
    wheels = sorted((work / "dist").glob("kvq_compressor-*.whl"))
    assert len(wheels) == 1, wheels
    site = work / "site"
    _check([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, wheels[0]], work, _env())
    run_dir = work / "run"
    run_dir.mkdir()
    return site, run_dir


def test_wheel_lists_every_bundled_recipe_as_package_data(installed):
    site, _ = installed
    shipped = sorted(p.name for p in (site / "compressor" / "recipes").glob("*.yaml"))
    assert shipped == sorted(p.name for p in (REPO / "compressor" / "recipes").glob("*.yaml"))
    assert "w4a16-awq.yaml" in shipped  # the default recipe
    wheel = next((site.parent / "dist").glob("*.whl"))
    with zipfile.ZipFile(wheel) as z:
        assert {f"compressor/recipes/{n}" for n in shipped} <= set(z.namelist())


def test_installed_wheel_runs_kvq_recipes(installed):
    site, run_dir = installed
    p = _check([sys.executable, "-c", "import compressor; print(compressor.__file__)"], run_dir, _env(site))
    assert Path(p.stdout.strip()).resolve().is_relative_to(site.resolve()), p.stdout  # not the editable checkout
    kvq = site / "bin" / "kvq"  # the console script the wheel declares
    cmd = [kvq] if kvq.exists() else [sys.executable, "-m", "compressor"]
    p = _check([*cmd, "recipes"], run_dir, _env(site))
    names = [line.split()[0] for line in p.stdout.splitlines() if line.strip()]
    assert names == sorted(p.stem for p in (REPO / "compressor" / "recipes").glob("*.yaml")), p.stdout


def test_installed_wheel_quantizes_a_tiny_model(installed, tiny_model_dir):
    site, run_dir = installed
    out = run_dir / "tiny-w4-rtn"
    p = _check([sys.executable, "-m", "compressor", "quantize", tiny_model_dir, "--recipe", "w4a16-rtn-g64", "-o", out,
                "--calib", "embedded", "--calib-samples", "4", "--calib-seqlen", "32", "--json"], run_dir, _env(site))
    summary = json.loads(p.stdout)
    assert summary["quantization"]["algorithm"] == "rtn", summary
    manifest = json.loads((out / "kvq-manifest.json").read_text())
    assert manifest["recipe"]["name"] == "w4a16-rtn-g64"
    assert manifest["recipe"]["weights"]["group_size"] == 64
    assert (out / "config.json").is_file()
