"""The CLI as a user runs it (subprocesses): happy paths and bad input → one line, exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvscope

from .conftest import ROOT, one_line_error, run_cli, tree_digest

PROMPT = "Write one sentence about the sea."


@pytest.fixture(scope="module")
def complete_store(tmp_path_factory, tiny_models):
    out = tmp_path_factory.mktemp("cli") / "done.zarr"
    kvscope.trace(PROMPT, out, model=str(tiny_models["llama"]), max_new_tokens=8, block_steps=4, stop_at_eos=False)
    return out


@pytest.mark.slow
def test_trace_info_models_on_smollm2(tmp_path):
    out = tmp_path / "smol.zarr"
    proc = run_cli("trace", "--prompt", PROMPT, "--max-new-tokens", "12", "--out", out, "--block-steps", "8")
    assert proc.returncode == 0, proc.stderr
    assert "traced 1 sample(s)" in proc.stdout and str(out) in proc.stdout
    info = run_cli("info", out, "--json", check=True)
    doc = json.loads(info.stdout)
    assert doc["status"] == "complete"
    assert doc["model"] == "smollm2-135m"
    assert doc["dims"]["layer"] == 30 and doc["dims"]["kv_head"] == 3
    assert doc["steps_committed"][0] == len(
        kvscope.open_trace(out).step.where(kvscope.open_trace(out).query_pos[0] >= 0, drop=True)
    )
    assert doc["compression_ratio"] > 1
    table = run_cli("info", out, check=True)
    assert "status complete" in table.stdout and "attn" in table.stdout
    models = json.loads(run_cli("models", "--json", check=True).stdout)
    smol = next(m for m in models["models"] if m["name"] == "smollm2-135m")
    assert smol["installed"] and smol["gguf"].endswith(".gguf")


def test_window_resolution_and_mean_heads_via_cli(tmp_path, tiny_models):
    out = tmp_path / "w.zarr"
    run_cli(
        "trace",
        "--model",
        tiny_models["llama"],
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "5",
        "--out",
        out,
        "--resolution",
        "window",
        "--window",
        "4",
        "--heads",
        "mean",
        "--quiet",
        check=True,
    )
    ds = kvscope.open_trace(out)
    assert ds.attn.dims == ("sample", "step", "layer", "head", "window")
    assert ds.sizes["head"] == 1 and ds.attrs["w"] == 4


def test_prompt_longer_than_context(tmp_path, tiny_models):
    out = tmp_path / "never.zarr"
    proc = run_cli(
        "trace", "--model", tiny_models["llama_short"], "--prompt", PROMPT * 8, "--max-new-tokens", "4", "--out", out
    )
    one_line_error(proc, "exceeds the model context of 48")
    assert not out.exists()


def test_existing_complete_store_is_not_overwritten(complete_store, tiny_models):
    before = tree_digest(complete_store)
    proc = run_cli(
        "trace", "--model", tiny_models["llama"], "--prompt", "Other.", "--max-new-tokens", "4", "--out", complete_store
    )
    one_line_error(proc, "holds a complete trace; pass --force")
    assert tree_digest(complete_store) == before


def test_force_overwrites(tmp_path, complete_store, tiny_models):
    copy = tmp_path / "copy.zarr"
    shutil.copytree(complete_store, copy)
    run_cli(
        "trace",
        "--model",
        tiny_models["llama"],
        "--prompt",
        "Other.",
        "--max-new-tokens",
        "3",
        "--out",
        copy,
        "--force",
        "--quiet",
        check=True,
    )
    assert kvscope.open_trace(copy).attrs["prompts"][0]["text"] == "Other."


def _broken_copy(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    if how == "garbage":
        (dst / "zarr.json").write_bytes(b"\x00\x13garbage{{{")
    elif how == "truncated-meta":
        text = (dst / "zarr.json").read_text()
        (dst / "zarr.json").write_text(text[: len(text) // 2])
    elif how == "truncated-chunk":
        chunk = dst / "attn" / "c" / "0" / "1" / "0" / "0" / "0"
        chunk.write_bytes(chunk.read_bytes()[:20])
    elif how == "missing-chunk":
        (dst / "attn" / "c" / "0" / "1" / "1" / "0" / "0").unlink()
    elif how == "newer":
        doc = json.loads((dst / "zarr.json").read_text())
        doc["attributes"]["schema_version"] = 99
        (dst / "zarr.json").write_text(json.dumps(doc))
    return dst


@pytest.mark.parametrize(
    "how,needle",
    [
        ("garbage", "zarr.json is unreadable or truncated"),
        ("truncated-meta", "zarr.json is unreadable or truncated"),
        ("truncated-chunk", "attn chunk (0, 1, 0, 0, 0): fails its CRC32C checksum"),
        ("missing-chunk", "attn chunk (0, 1, 1, 0, 0): is missing inside the committed steps"),
        ("newer", "schema version 99, newer than this kvscope supports (1)"),
    ],
)
def test_info_on_broken_stores(tmp_path, complete_store, how, needle):
    broken = _broken_copy(complete_store, tmp_path / f"{how}.zarr", how)
    before = tree_digest(broken)
    one_line_error(run_cli("info", broken), needle)
    assert tree_digest(broken) == before


def test_info_on_missing_and_non_store(tmp_path):
    one_line_error(run_cli("info", tmp_path / "nope.zarr"), "no trace store at")
    plain = tmp_path / "plain.txt"
    plain.write_text("hello")
    one_line_error(run_cli("info", plain), "is not a Zarr v3 store")


def test_unknown_command_and_missing_flag():
    one_line_error(run_cli("frobnicate"), "invalid choice")
    one_line_error(run_cli("trace", "--prompt", "x", "--out", "y.zarr"), "--max-new-tokens")


def test_a_refused_option_loads_no_heavy_library():
    """A trace or run option out of range (``--model-dtype`` too) is refused before torch,
    transformers, xarray or dask is imported (each costs seconds), ``kvscope --help`` (which lists
    the metrics) before torch and transformers; ``kvscope.replay`` stays the function after its subpackage's modules load, and a
    subpackage is there by its name after a plain ``import kvscope``."""
    probe = (
        "import contextlib, io, sys\n"
        "from kvscope.cli import main\n"
        "heavy = lambda: sorted(m for m in ('torch', 'transformers', 'xarray', 'dask', 'zarr') if m in sys.modules)\n"
        "with contextlib.redirect_stderr(io.StringIO()) as err:\n"
        "    code = main(['trace', '--prompt', 'x', '--max-new-tokens', '2', '--temperature', 'nan', '--out', 'n.zarr'])\n"
        "assert code == 2 and 'finite number' in err.getvalue(), (code, err.getvalue())\n"
        "with contextlib.redirect_stderr(io.StringIO()) as err:\n"
        "    code = main(['run', '--prompt', 'x', '--policy', 'h2o', '--budget', '0.3', '--kv-dtype', 'int3'])\n"
        "assert code == 2 and '--kv-dtype' in err.getvalue(), (code, err.getvalue())\n"
        "for command in (['trace', '--max-new-tokens', '2', '--out', 'n.zarr'], ['run', '--policy', 'h2o', '--budget', '0.3']):\n"
        "    with contextlib.redirect_stderr(io.StringIO()) as err:\n"
        "        code = main([*command, '--prompt', 'x', '--model-dtype', 'float7'])\n"
        "    assert code == 2 and '--model-dtype must be one of' in err.getvalue(), (code, err.getvalue())\n"
        "print(heavy())\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "print(heavy())\n"
        "import kvscope, kvscope.replay.check\n"
        "print(callable(kvscope.replay), kvscope.replay is kvscope.replay.__globals__['replay'])\n"
        "print(sorted(kvscope.analysis.available()) == sorted(kvscope.analysis.METRICS))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    after_refusal, after_help, replay, submodule = proc.stdout.splitlines()
    assert after_refusal == "[]" and replay == "True True" and submodule == "True"  # kvscope.analysis on first use
    assert "torch" not in after_help and "transformers" not in after_help
