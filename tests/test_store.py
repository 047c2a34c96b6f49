"""Store round trip, crash safety (SIGKILL at random points), --resume, the writer lock."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kvscope
from kvscope.errors import StoreError

from .conftest import ROOT, run_main

PROMPT = "In the beginning the Universe was created. This has made a lot of people very angry."
LONG_STEPS = 300  # SmolLM2 still decoding while a second writer is refused
KILL_STEPS = 100  # the tiny model's crash tests: 25 blocks to kill within, each test decodes them twice
BLOCK = 4


def test_round_trip_named_dims_and_rows_sum_to_one(tmp_path, tiny_models):
    out = tmp_path / "t.zarr"
    kvscope.trace(
        [PROMPT, "Short one."], out, model=str(tiny_models["qwen2"]), max_new_tokens=9, block_steps=4, stop_at_eos=False
    )
    ds = kvscope.open_trace(out)
    assert ds.attn.dims == ("sample", "step", "layer", "kv_head", "pos")
    assert ds.prefill_tail.dims == ("sample", "layer", "kv_head", "obs", "pos")
    assert ds.attn.dtype == np.float16
    layer1 = ds.attn.sel(layer=1)
    sums = layer1.sum("pos", skipna=True).values  # [sample, step, kv_head]
    np.testing.assert_allclose(sums, 1.0, atol=3e-3)
    # coordinates travel with the data
    np.testing.assert_array_equal(ds.query_pos.values[0], ds.prompt_len.values[0] - 1 + np.arange(9))
    assert ds.token_id.values[1, 0] == ds.tokens.values[1, ds.prompt_len.values[1]]
    # dask-backed with the store's chunks: one block of steps × one layer
    lazy = kvscope.open_trace(out, chunks={})
    assert lazy.attn.chunks[1] == (4, 4, 1) and lazy.attn.chunks[2] == (1, 1)
    np.testing.assert_array_equal(lazy.attn.sel(layer=1).values, layer1.values)
    attrs = ds.attrs
    assert attrs["schema_version"] == 1 and attrs["status"] == "complete"
    assert attrs["steps_committed"] == [9, 9]
    assert attrs["model"]["config"]["n_kv_heads"] == 2


def _trace_cmd(model: Path, out: Path, *extra, steps: int = KILL_STEPS) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "cli.py"),
        "trace",
        "--model",
        str(model),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        str(steps),
        "--block-steps",
        str(BLOCK),
        "--out",
        str(out),
        "--ignore-eos",
        "--quiet",
        "--dtype",
        "float32",
        *extra,
    ]


def _committed(out: Path) -> int:
    try:
        return json.loads((out / "zarr.json").read_text())["attributes"]["steps_committed"][0]
    except (OSError, ValueError, KeyError):
        return -1


def _attn_blocks_on_disk(out: Path) -> set[int]:
    folder = out / "attn" / "c" / "0"
    return {int(p.name) for p in folder.iterdir()} if folder.exists() else set()


@pytest.fixture(scope="module")
def reference_store(tmp_path_factory, tiny_models):
    out = tmp_path_factory.mktemp("ref") / "ref.zarr"
    proc = subprocess.run(_trace_cmd(tiny_models["llama"], out), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_loses_at_most_one_block_and_resume_matches(tmp_path, tiny_models, reference_store, seed):
    rng = random.Random(seed)
    target = rng.randrange(1, KILL_STEPS // BLOCK - 2) * BLOCK  # kill right after this many steps committed
    out = tmp_path / "killed.zarr"
    proc = subprocess.Popen(
        _trace_cmd(tiny_models["llama"], out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 300
    while _committed(out) < target and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    time.sleep(rng.random() * 0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()

    ds = kvscope.open_trace(out)  # opens, validated
    assert ds.attrs["status"] == "partial"
    committed = ds.attrs["steps_committed"][0]
    assert committed >= target and committed % BLOCK == 0
    # at most one block was written past the committed counter (the block in flight)
    beyond = {b for b in _attn_blocks_on_disk(out) if b * BLOCK >= committed}
    assert len(beyond) <= 1
    ref = kvscope.open_trace(reference_store)
    np.testing.assert_array_equal(ds.attn.values[0, :committed], ref.attn.values[0, :committed])
    assert int(ds.n_steps[0]) == committed

    resumed = subprocess.run(
        _trace_cmd(tiny_models["llama"], out, "--resume"), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr
    done = kvscope.open_trace(out)
    assert done.attrs["status"] == "complete"
    np.testing.assert_array_equal(done.tokens.values, ref.tokens.values)
    np.testing.assert_array_equal(done.attn.values, ref.attn.values)
    np.testing.assert_array_equal(done.prefill_colsum.values, ref.prefill_colsum.values)
    np.testing.assert_array_equal(done.query_pos.values, ref.query_pos.values)


def test_second_writer_is_refused(tmp_path, smollm2_dir):
    out = tmp_path / "busy.zarr"
    # the real model decodes slowly enough to still be writing when the second writer starts
    first = subprocess.Popen(
        _trace_cmd("smollm2-135m", out, steps=LONG_STEPS), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 300
        while _committed(out) < BLOCK and time.time() < deadline:
            time.sleep(0.01)
        for flag in ("--resume", "--force"):  # the second writer runs in this process: a lock is per open file
            second = run_main(*_trace_cmd("smollm2-135m", out, flag, steps=LONG_STEPS)[2:])
            assert second.returncode == 2
            assert second.stderr.strip().count("\n") == 0
            assert "being written by another kvscope process" in second.stderr
        assert first.poll() is None  # the first writer is still running, unharmed
        assert _committed(out) >= BLOCK
    finally:
        first.kill()
        first.wait()


def test_a_failed_creation_is_raised_and_removes_nothing(tmp_path, tiny_models):
    """The writer creates a new store while the prompt prefills: a creation that fails is
    raised on the main thread as the store's error, and whatever is at the path stays."""
    from kvscope.model.loading import load, resolve
    from kvscope.model.prompts import Prompt
    from kvscope.tracing.runner import TraceSettings, _discard_uncommitted, trace_loaded
    from kvscope.tracing.writer import StoreWriter

    source = resolve(str(tiny_models["llama"]))
    model, tokenizer = load(source)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    settings = TraceSettings(model=str(tiny_models["llama"]), max_new_tokens=3)
    with pytest.raises(StoreError, match="cannot create"):
        trace_loaded(model, tokenizer, source, [Prompt(PROMPT, "test")], out=blocker / "t.zarr", settings=settings)
    assert blocker.read_text() == "not a folder"

    theirs = tmp_path / "theirs.zarr"  # what another process created first (the rename then fails)
    theirs.mkdir()
    (theirs / "zarr.json").write_text("{}")

    def create():
        raise StoreError(f"cannot create {theirs}: Directory not empty")

    writer = StoreWriter(theirs, [0], [False], create=create)
    _discard_uncommitted(theirs, writer)
    assert not writer.created and (theirs / "zarr.json").read_text() == "{}"
    with pytest.raises(StoreError, match="Directory not empty"):
        writer.flush()


def test_resume_refuses_different_settings(tmp_path, tiny_models):
    out = tmp_path / "p.zarr"
    proc = subprocess.Popen(_trace_cmd(tiny_models["llama"], out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while _committed(out) < BLOCK and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    cmd = _trace_cmd(tiny_models["llama"], out, "--resume")
    cmd[cmd.index("--max-new-tokens") + 1] = "200"
    bad = run_main(*cmd[2:])  # the CLI's main in process: the refusal, not the process, is the point
    assert bad.returncode == 2
    assert "different max_new_tokens" in bad.stderr
    after = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert before == after


def test_validate_rejects_newer_schema_and_missing_arrays(tmp_path, tiny_models):
    out = tmp_path / "t.zarr"
    kvscope.trace(PROMPT, out, model=str(tiny_models["llama"]), max_new_tokens=3)
    meta = json.loads((out / "zarr.json").read_text())
    meta["attributes"]["schema_version"] = 2
    newer = tmp_path / "newer.zarr"
    os.system(f"cp -r {out} {newer}")
    (newer / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="schema version 2, newer"):
        kvscope.open_trace(newer)
    missing = tmp_path / "missing.zarr"
    os.system(f"cp -r {out} {missing}")
    os.system(f"rm -r {missing}/prefill_colsum")
    with pytest.raises(StoreError, match="missing arrays: prefill_colsum"):
        kvscope.open_trace(missing)


def test_the_writer_times_back_pressure_and_releases_each_written_block(tmp_path):
    """A block handed over while another still waits for the writer (here behind the store's
    creation, 0.3 s) makes the decode loop wait: that wait is timed and counted, a hand-over into
    an empty queue is not. Each block's ``release`` runs once, after its data is in the store."""
    import zarr

    from kvscope.tracing.writer import Block, StoreWriter

    out = tmp_path / "s.zarr"

    def create():
        time.sleep(0.3)
        zarr.open_group(str(out), mode="w").create_array("x", shape=(2, 3), dtype="float32", chunks=(1, 3))
        return []

    released = []
    writer = StoreWriter(out, [0], [False], create=create)
    data = [np.full((1, 3), i + 0.5, dtype=np.float32) for i in range(2)]
    blocks = [Block(writes=[("x", (slice(i, i + 1),), data[i])]) for i in range(2)]
    for i, block in enumerate(blocks):
        block.release = lambda i=i: released.append((i, zarr.open_array(str(out / "x"), mode="r")[i].tolist()))
    writer.submit(blocks[0])
    assert (writer.waits, writer.waited_s) == (0, 0.0)
    writer.submit(blocks[1])  # the first still waits behind the creation
    assert writer.waits == 1 and 0.2 < writer.waited_s < 5
    writer.close()
    assert released == [(0, [0.5] * 3), (1, [1.5] * 3)]
