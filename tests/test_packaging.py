"""A package that installs anywhere: a wheel built from the checkout, installed (not editable)
into a fresh environment, runs ``python -m kvscope`` from another directory with its recipes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from .conftest import ROOT


def _run(args, **kwargs):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, check=False, **kwargs)
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory) -> Path:
    """A venv without kvscope's editable install: the dependencies come from the test
    environment's site-packages by a plain path entry (so its .pth files never run), kvscope
    from a wheel built out of the tracked files."""
    base = tmp_path_factory.mktemp("packaging")
    src = base / "src"
    files = _run(["git", "ls-files"], cwd=ROOT).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    dist = base / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)])
    fresh = base / "fresh"
    _run([sys.executable, "-m", "venv", "--without-pip", str(fresh)])
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(fresh), "platbase": str(fresh)}))
    deps = [p for p in sys.path if p.endswith("site-packages")]  # the venv's and the system's
    (purelib / "kvscope-test-deps.pth").write_text("\n".join(deps) + "\n")
    wheel = next(dist.glob("kvscope-*.whl"))
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(purelib), str(wheel)])
    return fresh / "bin" / "python"


def test_the_wheel_carries_the_recipes_and_one_version(fresh_python, tmp_path):
    where = _run(
        [str(fresh_python), "-c", "import kvscope; print(kvscope.__file__, kvscope.__version__)"], cwd=tmp_path
    )
    path, version = where.stdout.split()
    assert Path(path).is_relative_to(fresh_python.parents[1])  # the installed copy, not the checkout
    import kvscope

    assert version == kvscope.__version__
    rows = json.loads(_run([str(fresh_python), "-m", "kvscope", "workloads", "--json"], cwd=tmp_path).stdout)
    assert {r["name"] for r in rows} == set(kvscope.workloads.available())  # every recipe shipped
    assert all(Path(r["recipe"]).is_file() and str(fresh_python.parents[1]) in r["recipe"] for r in rows)


@pytest.mark.slow
def test_a_workload_traces_from_another_directory(fresh_python, tmp_path):
    _run(
        [str(fresh_python), "-m", "kvscope", "trace", "--workload", "niah", "--context", "256", "--samples", "1",
         "--max-new-tokens", "8", "--out", "niah.zarr", "--quiet"],
        cwd=tmp_path,
    )  # fmt: skip
    info = json.loads(_run([str(fresh_python), "-m", "kvscope", "info", "niah.zarr", "--json"], cwd=tmp_path).stdout)
    assert info["status"] == "complete" and info["steps_committed"] == [8]
    assert 250 <= info["dims"]["pos"] - 8 <= 262  # the prompt within 2% of 256 tokens
