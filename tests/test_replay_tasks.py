"""Replay as tasks of one sample and some layers (kvscope.replay.plan, run and tasks): the same numbers
whatever the blocks, in this process, on a LocalCluster and on a scheduler the CLI did not start."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import xarray as xr

from .conftest import one_line_error, run_cli, run_main

POLICIES = ["streaming", "h2o", "snapkv", "kivi", "logquant", "qevict", "oracle", "press:KnormPress"]
LOCAL = POLICIES[:-1]  # the press splits its budget itself: it runs whole
ALLOCATIONS = ["uniform", "pyramid", "adakv", "oracle"]


def assert_same(a: xr.Dataset, b: xr.Dataset) -> None:
    """Every variable and coordinate equal (NaN where NaN), attributes but the timing; ``a``
    may hold more policies and allocations than ``b`` (compared on ``b``'s)."""
    a = a.sel(policy=b["policy"].values, allocation=b["allocation"].values)
    assert set(a.data_vars) == set(b.data_vars)
    for name in a.variables:
        x, y = np.asarray(a[name].values), np.asarray(b[name].values)
        assert x.shape == y.shape, name
        if x.dtype.kind == "f":
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:
            assert (x == y).all(), name
    drop = {"replay_seconds", "replay_workers", "trace", "policies", "allocations"}
    assert {k: v for k, v in a.attrs.items() if k not in drop} == {k: v for k, v in b.attrs.items() if k not in drop}


@pytest.fixture(scope="module")
def whole(small_qkv_trace):
    from kvscope.replay import replay

    return replay(small_qkv_trace, POLICIES, [0.3], allocations=["uniform"]).load()


@pytest.fixture(scope="module")
def whole_allocated(small_qkv_trace):
    from kvscope.replay import replay

    return replay(small_qkv_trace, ["h2o", "qevict"], [0.3], allocations=ALLOCATIONS).load()


def test_blocks_of_layers_give_the_whole_replay(small_qkv_trace, whole):
    """Every policy (the press whole, the others by blocks of 7 of 30 layers, the last 2):
    tiers, metrics, bytes, errors identical."""
    from kvscope.replay import replay

    assert_same(whole, replay(small_qkv_trace, POLICIES, [0.3], layers_per_task=7).load())


def test_allocations_by_blocks_of_three_layers(small_qkv_trace, whole_allocated):
    """Pyramid (the model's schedule at the task's layer), adakv (per layer), and the oracle
    (probes per task, one knapsack over all units) split exactly as the whole replay does."""
    from kvscope.replay import replay

    parts = replay(small_qkv_trace, ["h2o", "qevict"], [0.3], allocations=ALLOCATIONS, layers_per_task=3)
    assert_same(whole_allocated, parts.load())
    allocated = whole_allocated["allocated"].sel(budget=0.3).isel(sample=0)  # [policy, allocation, layer, kv_head]
    assert not np.allclose(allocated.sel(allocation="pyramid"), allocated.sel(allocation="uniform"))
    assert not np.allclose(allocated.sel(allocation="oracle"), allocated.sel(allocation="uniform"))


def test_tasks_of_some_kv_heads_give_the_whole_replay(small_qkv_trace, whole, whole_allocated):
    """Tasks of 4 layers × 1 of SmolLM2's 3 KV heads (the press whole), and of 2 layers × 2 KV
    heads (blocks 0–1, 2) under the allocations that decide per head: every variable identical."""
    from kvscope.replay import replay

    assert_same(whole, replay(small_qkv_trace, POLICIES, [0.3], layers_per_task=4, kv_heads_per_task=1).load())
    per_head = ["uniform", "pyramid"]
    parts = replay(
        small_qkv_trace, ["h2o", "qevict"], [0.3], allocations=per_head, layers_per_task=2, kv_heads_per_task=2
    )
    assert_same(whole_allocated, parts.load())


def test_kv_head_tasks_of_a_window_store(tmp_path):
    """A window-resolution store (rows recomputed from each task's q heads and k): tasks of one
    layer and one KV head give the whole replay; tiers chunked by (layer, KV head)."""
    import zarr

    from kvscope.replay import replay
    from kvscope.storage.synthetic import write_geometry_store

    store = write_geometry_store(
        tmp_path / "w.zarr", prompt_len=192, n_steps=24, n_layers=2, n_heads=4, n_kv=2, head_dim=16, block_steps=8
    )
    policies = ["h2o", "kivi", "qevict", "oracle"]
    whole = replay(store, policies, [0.3, 0.5]).load()
    out = tmp_path / "r.zarr"
    parts = replay(store, policies, [0.3, 0.5], layers_per_task=1, kv_heads_per_task=1, out=out)
    assert_same(whole, parts.load())
    assert zarr.open_array(str(out / "tiers"), mode="r").chunks[5:7] == (1, 1)
    assert whole["output_rel_l2_mean"].sel(policy="kivi", budget=0.3).item() > 0  # errors computed, per task


def test_kv_head_tasks_refused_under_adakv(small_qkv_trace):
    from kvscope.errors import KvscopeError
    from kvscope.replay import replay

    with pytest.raises(KvscopeError, match="the adakv allocation splits each layer's budget across its KV heads"):
        replay(small_qkv_trace, ["h2o"], [0.3], allocations=["adakv"], kv_heads_per_task=1)


def test_local_cluster_gives_the_same(small_qkv_trace, whole):
    """Two worker processes of kvscope's own cluster (``--dask local:N``: glibc's allocator left
    at its defaults, not dask's trim setting), tasks of some layers each (the press whole),
    snapshots written by the workers."""
    import os

    from distributed import Client

    from kvscope.cluster import local_cluster
    from kvscope.replay import replay

    with local_cluster(2) as cluster, Client(cluster) as client:
        environ = client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_"))
        result = replay(small_qkv_trace, ["h2o", "qevict", "press:KnormPress"], [0.3], client=client).load()
    assert list(environ.values()) == [None, None]
    assert_same(whole, result)


def test_forked_workers_give_the_same(small_qkv_trace, whole, whole_allocated):
    """Two worker processes forked from this one (``processes=2``): tasks of 15 layers each (the
    press whole), the oracle's probes in the workers too — every variable identical, and the
    result says where it ran."""
    from kvscope.replay import replay

    result = replay(small_qkv_trace, POLICIES, [0.3], processes=2)
    assert result.attrs["replay_workers"] == "forked:2" and whole.attrs["replay_workers"] == "threads:2"
    assert_same(whole, result.load())
    allocated = replay(small_qkv_trace, ["h2o", "qevict"], [0.3], allocations=ALLOCATIONS, processes=2)
    assert_same(whole_allocated, allocated.load())


FORK_AFTER_TORCH = """
import sys, numpy as np, torch
from kvscope.replay import replay
torch.set_num_threads(2)
torch.rand(1 << 22).to(torch.float16)  # this process's OpenMP team has run
forked = replay(sys.argv[1], ["h2o", "qevict"], [0.3], errors=False, processes=2).load()
threaded = replay(sys.argv[1], ["h2o", "qevict"], [0.3], errors=False, processes=0).load()
same = all(np.array_equal(forked[v].values, threaded[v].values, equal_nan=True) for v in forked.data_vars)
print(forked.attrs["replay_workers"], same)
"""


def test_forked_workers_after_torch_ran_here(small_qkv_trace):
    """A replay that computes nothing with torch (no errors), forked from a process whose torch
    ran on two threads: the workers' float16 conversions still go through torch, which must run
    on one thread there (a fork's child hangs in libgomp's first parallel region otherwise)."""
    import os
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-c", FORK_AFTER_TORCH, str(small_qkv_trace)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the forked workers hung")
    assert proc.returncode == 0, err
    assert out.split() == ["forked:2", "True"]


def test_a_failure_in_a_forked_worker_is_one_line(small_qkv_trace, tmp_path):
    """A damaged chunk read only by a worker's task (the last block of rows): the CLI names it
    in one line, exit code 2, and leaves no result store behind."""
    import shutil

    trace = tmp_path / "trace.zarr"
    shutil.copytree(small_qkv_trace, trace)
    chunk = max((trace / "attn" / "c").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else -1)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    out = tmp_path / "result.zarr"
    proc = run_main("replay", trace, "--policies", "h2o,qevict", "--budgets", "0.3", "--processes", "2", "--out", out)
    one_line_error(proc, "attn")
    assert not out.exists() and not list(tmp_path.glob(".result.zarr.partial-*"))


def test_a_forked_worker_that_dies_fails_the_replay_in_one_line(small_qkv_trace):
    """A worker killed while its task runs (as the kernel's OOM killer would): the replay fails
    with one line naming it, instead of waiting for a result that never comes."""
    import multiprocessing
    import os
    import signal
    import threading

    from kvscope.errors import KvscopeError
    from kvscope.replay import replay

    def kill_a_worker():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            workers = multiprocessing.active_children()
            if workers:
                time.sleep(0.3)  # its task has started
                os.kill(workers[0].pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_a_worker)
    killer.start()
    try:
        with pytest.raises(KvscopeError, match="a replay worker process died before its task ended"):
            replay(small_qkv_trace, LOCAL, [0.2, 0.3, 0.5], processes=2)
    finally:
        killer.join()
    assert multiprocessing.active_children() == []


def _replay_in_a_daemon(trace, answers) -> None:
    from kvscope.replay import replay

    try:
        replay(trace, ["h2o"], [0.3], processes=2)
        answers.put("ran")
    except Exception as exc:  # noqa: BLE001 - sent back to the test
        answers.put(f"{type(exc).__name__}: {exc}")


def test_a_daemonic_process_does_not_fork(small_qkv_trace):
    """A daemonic process (a dask worker runs so) may not have children: asked for forked
    workers there, the replay says so in one line (and never forks by default)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    process = context.Process(target=_replay_in_a_daemon, args=(str(small_qkv_trace), answers), daemon=True)
    process.start()
    answer = answers.get(timeout=120)
    process.join(timeout=30)
    assert answer.startswith("KvscopeError: this is a daemonic process"), answer


def test_a_scheduler_the_cli_did_not_start(small_qkv_trace, whole_allocated, tmp_path):
    """``kvscope replay --dask tcp://…`` against a scheduler and worker started apart: the result
    store equals the in-process one."""
    from kvscope.replay import open_result

    port = 8786 + (time.time_ns() // 1000) % 1000
    address = f"tcp://127.0.0.1:{port}"
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port),
         "--dashboard-address", ":0", "--no-show"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    worker = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nworkers", "2", "--nthreads", "1",
         "--no-dashboard"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        out = tmp_path / "result.zarr"
        run_cli(
            "replay", small_qkv_trace, "--policies", "h2o", "--budgets", "0.3", "--allocation", "pyramid,oracle",
            "--dask", address, "--layers-per-task", "4", "--out", out,
            "--quiet", check=True,
        )  # fmt: skip
        assert_same(whole_allocated, open_result(out).load())
    finally:
        for process in (worker, scheduler):
            process.terminate()
            process.wait(timeout=30)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--layers-per-task", "0"], "layers per task must be an integer in 1..30 (got 0)"),
        (["--layers-per-task", "31"], "layers per task must be an integer in 1..30 (got 31)"),
        (["--kv-heads-per-task", "4"], "KV heads per task must be an integer in 1..3 (got 4)"),
        (["--kv-heads-per-task", "1", "--allocation", "oracle"], "the oracle allocation splits each layer's"),
        (["--dask", "local:x"], "--dask local:N needs a worker count"),
        (["--dask", "ftp://x"], "--dask takes local:N or tcp://host:port"),
        (["--processes", "-1"], "processes must be an integer ≥ 0 (got -1)"),
        (["--processes", "2", "--dask", "local:2"], "runs on a dask cluster or in forked processes, not both"),
    ],
)
def test_bad_task_options(small_qkv_trace, args, needle):
    proc = run_main("replay", small_qkv_trace, "--policies", "h2o", "--budgets", "0.3", *args)
    one_line_error(proc, needle)


def test_a_cluster_needs_the_trace_by_path(small_qkv_trace):
    from kvscope.errors import KvscopeError
    from kvscope.replay import replay
    from kvscope.storage.store import open_trace

    with pytest.raises(KvscopeError, match="takes the trace as a store path"):
        replay(open_trace(small_qkv_trace), ["h2o"], [0.3], client=object())
    with pytest.raises(KvscopeError, match="in forked processes takes the trace as a store path"):
        replay(open_trace(small_qkv_trace), ["h2o"], [0.3], processes=2)


def test_pyramid_split_of_some_layers_is_the_whole_split_there():
    from kvscope.policies import CacheSpec
    from kvscope.policies.allocation import AdaKV, Oracle, Pyramid

    whole = CacheSpec(12, 2, 64, 300, 364, 0.3)
    floor = 1000.0
    for first, n in [(0, 5), (5, 4), (9, 3)]:
        part = CacheSpec(n, 2, 64, 300, 364, 0.3, first_layer=first, model_layers=12)
        np.testing.assert_array_equal(
            Pyramid(beta=5).split(part, floor), Pyramid(beta=5).split(whole, floor)[first : first + n]
        )
        scores = np.random.default_rng(first).random((12, 2, 300))
        np.testing.assert_array_equal(
            AdaKV().split(part, floor, scores=scores[first : first + n]),
            AdaKV().split(whole, floor, scores=scores)[first : first + n],
        )
        np.testing.assert_array_equal(
            Oracle().candidates(part, floor, []), Oracle().candidates(whole, floor, [])[:, first : first + n]
        )
    assert Pyramid(beta=5).split(whole, floor).sum() == pytest.approx(whole.total_capacity)


def test_a_failed_tier_write_is_raised_when_the_task_completes(tmp_path):
    """A task's snapshots are written by its writer thread; a write that fails (here: a file
    where the chunks' folder goes) is raised by complete(), and nothing is marked taken."""
    from kvscope.replay.plan import Piece
    from kvscope.replay.store import TierStore
    from kvscope.replay.tasks import TierWindow

    store = TierStore(tmp_path / "result", (1, 1, 1, 1, 2, 2, 1, 5))
    (tmp_path / "result" / "tiers" / "c").write_text("not a folder")
    window = TierWindow(store, Piece(0, 0, 2, 0, 1, (0,)))
    window.write((0, 0, 0, 0, 0), np.zeros((2, 1, 5), np.int8))  # the task's only run: the event is written
    with pytest.raises(OSError):
        window.complete()
    assert not store.taken.any() and window.taken == []


def test_the_pool_gives_the_serial_numbers_and_leaves_torch_threads(small_qkv_trace):
    """The runs advanced by a pool of 2 threads (torch at one thread meanwhile) give the serial
    replay's numbers (errors included), and torch's thread count is what it was before."""
    import torch

    from kvscope.replay import replay

    before = torch.get_num_threads()
    pooled = replay(small_qkv_trace, ["h2o", "kivi", "qevict"], [0.3], threads=2).load()
    assert torch.get_num_threads() == before
    assert_same(pooled, replay(small_qkv_trace, ["h2o", "kivi", "qevict"], [0.3], threads=1).load())


def test_snapshots_of_an_event_written_in_one_call(tmp_path):
    """TierStore.write_runs (a task's snapshots of one event together) puts each snapshot where
    write puts it, for policies that are not contiguous (a press between them runs whole) and a
    sample shorter than the store (the rest −1); nothing else is written or marked taken."""
    from kvscope.replay.store import TierStore

    shape = (3, 2, 2, 2, 3, 2, 1, 5)  # [policy, allocation, budget, sample, event, layer, kv_head, pos]
    one, block = TierStore(tmp_path / "one", shape), TierStore(tmp_path / "block", shape)
    rng = np.random.default_rng(0)
    snaps = rng.integers(0, 3, (2, 2, 2, 2, 1, 4)).astype(np.int8)  # policies 0 and 2, 4 positions
    for j, p in enumerate((0, 2)):
        for a in range(2):
            for b in range(2):
                one.write((p, a, b, 1, 2), snaps[j, a, b])
    block.write_runs((0, 2), 1, 2, snaps)
    np.testing.assert_array_equal(block.array[...], one.array[...])
    np.testing.assert_array_equal(block.taken, one.taken)
    assert (block.array[0, 1, 0, 1, 2, :, :, 4] == -1).all() and block.taken.sum() == 8
    assert (block.array[1] == -1).all() and (block.array[:, :, :, 0] == -1).all()
