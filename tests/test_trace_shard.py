"""Issue "Scale", part 2: one trace store written by several processes. ``trace --dask local:2``
(a LocalCluster of worker processes) and two ``trace --shard i/2`` processes give stores
whose arrays equal a single-process trace's bit for bit; a shard interrupted and resumed
continues its own samples only; bad input is one line and exit 2, no store changed (the
corpus of tests/test_corpus.py runs the first trace case as a subprocess)."""

from __future__ import annotations

import json
import os

import pytest
import zarr

import kvscope
from kvscope.errors import KvscopeError, StoreError
from kvscope.tracing.distributed import worker_device
from kvscope.tracing.runner import _create_store, _device_kind, finalize
from kvscope.tracing.shard import Shard, batches, owner

from .conftest import ROOT, one_line_error, run_main, tree_digest

PROMPTS = [
    "Write one sentence about the sea.",
    "The capital of France is",
    "def fib(n):\n    return",
    "Once upon a time, there was",
    "Hello",
]
SETTINGS = {"max_new_tokens": 10, "block_steps": 4, "stop_at_eos": False}
FLAGS = ["--max-new-tokens", "10", "--block-steps", "4", "--ignore-eos", "--quiet"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("shard-prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_models):
    """The reference: the same five prompts traced by one process (this one)."""
    out = tmp_path_factory.mktemp("shard-single") / "single.zarr"
    kvscope.trace(PROMPTS, out, model=str(tiny_models["llama"]), **SETTINGS)
    return out


def assert_same_store(a, b) -> None:
    """Every array of ``a`` and ``b`` equal bit for bit (NaN where NaN), same dtypes and chunks;
    the same committed steps, both complete."""
    ga, gb = zarr.open_group(str(a), mode="r"), zarr.open_group(str(b), mode="r")
    names = sorted(name for name, _ in ga.arrays())
    assert names == sorted(name for name, _ in gb.arrays()) and "attn" in names
    for name in names:
        x, y = ga[name], gb[name]
        assert (x.dtype, x.shape, x.chunks) == (y.dtype, y.shape, y.chunks), name
        assert x[...].tobytes() == y[...].tobytes(), f"{name} differs"
    for key in ("status", "steps_committed", "samples_done", "settings"):
        assert ga.attrs[key] == gb.attrs[key], key
    assert ga.attrs["status"] == "complete"


def test_shards_take_batches_round_robin():
    assert batches(5, 1, Shard(1, 2)) == [[1], [3]]
    assert Shard(0, 2).samples(5, 1) == [0, 2, 4]
    assert batches(7, 2, Shard(1, 3)) == [[2, 3]]  # batches [0,1] [2,3] [4,5] [6]: batch b to shard b mod 3
    assert Shard(0, 3).samples(7, 2) == [0, 1, 6]
    assert sorted(s for i in range(3) for s in Shard(i, 3).samples(7, 2)) == list(range(7))
    assert Shard.parse("1/2") == Shard(1, 2)
    assert [owner(s, 2, 3) for s in range(7)] == [0, 0, 1, 1, 2, 2, 0]
    # --dask on a machine with GPUs: a worker that sees several spreads the shards over them
    assert [worker_device("cuda", Shard(i, 3), 2) for i in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert worker_device("cuda", Shard(1, 3), 1) == "cuda" and worker_device("cuda:1", Shard(0, 3), 4) == "cuda:1"
    assert worker_device("cpu", Shard(1, 2), 0) == "cpu"
    # shards on cuda:0 and cuda:1 join one store
    assert _device_kind({"device": "cuda:1", "seed": 0}) == {"device": "cuda", "seed": 0}


def test_local_cluster_equals_one_process(tmp_path, single, tiny_models, prompts_file):
    """Two worker processes, one shard each, bit for bit the single-process store."""
    out = tmp_path / "dask.zarr"
    ran = run_main("trace", "--model", tiny_models["llama"], "--prompts", prompts_file, *FLAGS,
                   "--out", out, "--dask", "local:2")  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr == ""
    assert "traced 2 shards on local:2: 5 sample(s), 50 steps" in ran.stdout
    assert [line.split(":")[0] for line in ran.stdout.splitlines()[1:]] == [f"  sample {s}" for s in range(5)]
    assert_same_store(out, single)
    assert kvscope.open_trace(out).attrs["shards"] == 2


def test_two_shard_processes_equal_one_process(tmp_path, single, tiny_models, prompts_file):
    """``--shard 0/2`` and ``--shard 1/2`` started together: one creates the store, both write
    it, the one that commits the last sample marks it complete; ``--finalize`` has nothing left."""
    import subprocess
    import sys

    out = tmp_path / "shards.zarr"
    args = ["trace", "--model", str(tiny_models["llama"]), "--prompts", str(prompts_file), *FLAGS, "--out", str(out)]
    import torch

    # the child runs torch with this process's thread count, as the reference did (dask's
    # LocalCluster, started by an earlier test, leaves OMP_NUM_THREADS=1 in os.environ)
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "cwd": ROOT, "env": env}
    child = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), *args, "--shard", "1/2"], **pipes)
    here = run_main(*args, "--shard", "0/2")  # meanwhile (one process fewer to start on a small machine)
    child_out, child_err = child.communicate(timeout=300)
    runs = [(here.returncode, here.stdout, here.stderr), (child.returncode, child_out, child_err)]
    for i, (code, stdout, stderr) in enumerate(runs):
        assert code == 0 and stderr == "", stderr
        samples = [int(line.split()[1].rstrip(":")) for line in stdout.splitlines()[1:]]
        assert samples == list(range(i, 5, 2)) and stdout.startswith(f"traced shard {i}/2: {len(samples)} sample(s)")
    assert_same_store(out, single)
    assert not list(tmp_path.glob(".*creating*"))  # the shard that lost the race removed its own
    assert run_main("trace", "--finalize", out).stdout.strip() == f"{out} was complete already"
    assert run_main("verify", out).returncode == 0


def test_a_shard_that_loses_the_creation_race_leaves_the_store_as_it_is(tmp_path, tiny_models):
    """The race of two shards creating the store at once: the rename of the second one's
    temporary store fails (``out`` is not empty), it gets None, and no temporary is left."""
    out = tmp_path / "race.zarr"
    kvscope.trace(PROMPTS[:2], out, model=str(tiny_models["llama"]), shard=Shard(0, 2), **SETTINGS)
    before = tree_digest(out)
    from kvscope.storage.integrity import check_schema, read_metas

    checked = kvscope.storage.store.check_store(out)
    layout, _ = check_schema(out, checked.attrs, read_metas(out))
    encoded = [[1, 2, 3]] * layout.n_samples
    assert _create_store(out, layout, dict(checked.attrs), encoded=encoded, rope=None, shard=Shard(1, 2)) is None
    assert tree_digest(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["race.zarr"]


class Stop(Exception):
    pass


def stop_after(steps: int):
    """A progress callback that interrupts a trace after ``steps`` decode steps."""

    def progress(p):
        if p.steps_done > steps:
            raise Stop

    return progress


def test_resume_continues_the_shards_own_samples_only(tmp_path, single, tiny_models):
    out = tmp_path / "resumed.zarr"
    model = str(tiny_models["llama"])
    with pytest.raises(Stop):  # shard 0 (samples 0, 2, 4) stops inside sample 2's second block
        kvscope.trace(PROMPTS, out, model=model, shard=Shard(0, 2), progress=stop_after(14), **SETTINGS)
    attrs = kvscope.open_trace(out).attrs
    assert attrs["status"] == "partial" and attrs["steps_committed"] == [10, 0, 4, 0, 0]
    other = kvscope.trace(PROMPTS, out, model=model, shard=Shard(1, 2), **SETTINGS)
    assert other.samples == [1, 3] and other.steps == [10, 10] and not other.complete
    assert kvscope.open_trace(out).attrs["steps_committed"] == [10, 10, 4, 10, 0]
    with pytest.raises(KvscopeError, match=r"holds committed steps of its sample\(s\) 0, 2; pass --resume"):
        kvscope.trace(PROMPTS, out, model=model, shard=Shard(0, 2), **SETTINGS)
    with pytest.raises(KvscopeError, match=r"sample\(s\) 2, 4 not done \(shard 0/2; run it with --resume\)"):
        finalize(out)
    theirs = {p: p.stat().st_mtime_ns for p in out.glob("*/c/[13]/**/*") if p.is_file()}
    totals = []
    resumed = kvscope.trace(
        PROMPTS, out, model=model, shard=Shard(0, 2), resume=True, progress=lambda p: totals.append(p.steps_total),
        **SETTINGS,
    )  # fmt: skip
    assert resumed.samples == [0, 2, 4] and resumed.complete
    assert totals[0] == (10 - 4) + 10  # what was left of sample 2 and all of sample 4: shard 1's are not its own
    assert theirs and {p: p.stat().st_mtime_ns for p in theirs} == theirs  # shard 1's chunks untouched
    assert_same_store(out, single)


def test_bad_input(tmp_path, single, tiny_models, prompts_file):
    base = ["trace", "--model", tiny_models["llama"], "--prompts", prompts_file, *FLAGS]
    one_line_error(run_main(*base, "--out", tmp_path / "a.zarr", "--shard", "3/2"), "--shard takes i/n with 0 ≤ i < n")
    for bad in ("x", "1/0", "2/2", "1/-2", "1", "0/2/3", "a/2"):
        one_line_error(run_main(*base, "--out", tmp_path / "a.zarr", "--shard", bad), f"(got {bad!r})")
    one_line_error(
        run_main(*base, "--out", tmp_path / "a.zarr", "--shard", "0/2", "--dask", "local:2"),
        "--shard and --dask do not go together",
    )
    one_line_error(run_main(*base, "--out", tmp_path / "a.zarr", "--dask", "local:0"), "--dask local:N needs N ≥ 1")
    assert list(tmp_path.iterdir()) == []
    before = tree_digest(single)
    one_line_error(run_main(*base, "--out", single, "--shard", "0/2", "--force"), "--force cannot go with --shard")
    one_line_error(run_main(*base, "--out", single, "--shard", "0/2"), "is already complete")
    one_line_error(run_main(*base, "--out", single, "--dask", "local:2"), "holds a complete trace; pass --force")
    one_line_error(run_main("trace", "--finalize", single, "--prompt", "hi"), "--finalize STORE takes no other")
    one_line_error(run_main("trace", "--finalize", tmp_path / "none.zarr"), "no trace store at")
    one_line_error(run_main("trace", "--model", tiny_models["llama"], *FLAGS, "--out", tmp_path / "a.zarr"),
                   "one of the arguments --prompt --prompts --workload --dataset is required")  # fmt: skip
    one_line_error(run_main(*base), "the following arguments are required: --out")
    assert tree_digest(single) == before

    partial = tmp_path / "partial.zarr"  # begun by shard 0 of 2, stopped after its first block
    with pytest.raises(Stop):
        kvscope.trace(PROMPTS, partial, model=str(tiny_models["llama"]), shard=Shard(0, 2), progress=stop_after(4),
                      **SETTINGS)  # fmt: skip
    before = tree_digest(partial)
    one_line_error(run_main(*base, "--out", partial, "--shard", "1/3"), "was begun by 2 shards")
    one_line_error(run_main(*base, "--out", partial), "holds a partial trace; pass --resume")
    one_line_error(run_main(*base, "--out", partial, "--dask", "local:2"), "holds a partial trace; pass --resume")
    changed = [a if a != "10" else "9" for a in base]  # --max-new-tokens 9
    one_line_error(run_main(*changed, "--out", partial, "--shard", "1/2"), "was traced with different max_new_tokens")
    one_line_error(run_main("trace", "--finalize", partial), "sample(s) 0, 1, 2, 3, 4 not done (shard 0/2, 1/2;")
    assert tree_digest(partial) == before


def test_a_single_process_store_is_not_joined_by_a_shard(tmp_path, single, tiny_models):
    import shutil

    partial = tmp_path / "single-partial.zarr"
    shutil.copytree(single, partial)
    zarr.open_group(str(partial), mode="r+", use_consolidated=False).attrs.update({"status": "partial"})
    before = tree_digest(partial)
    for flags in ([], ["--resume"]):
        one_line_error(
            run_main("trace", "--model", tiny_models["llama"], "--prompt", PROMPTS[0], *FLAGS, "--out", partial,
                     "--shard", "0/2", *flags),
            "was begun by a single process (no --shard)",
        )  # fmt: skip
    assert tree_digest(partial) == before
    zarr.open_group(str(partial), mode="r+", use_consolidated=False).attrs.update({"shards": "two"})
    with pytest.raises(StoreError, match="attribute shards must be an integer ≥ 1"):
        kvscope.open_trace(partial)


def test_batches_and_sampling_equal_one_process(tmp_path, tiny_models):
    """With ``--batch-size 2`` a shard decodes whole batches (the same left padding and seeds
    as one process): shards 1/2 then 0/2, sampling at temperature 0.7, equal one process."""
    kwargs = {"model": str(tiny_models["llama"]), **SETTINGS, "batch_size": 2, "temperature": 0.7}
    prompts = PROMPTS[:3]  # batches [0, 1] and [2]
    kvscope.trace(prompts, tmp_path / "one.zarr", **kwargs)
    first = kvscope.trace(prompts, tmp_path / "two.zarr", shard=Shard(1, 2), **kwargs)
    assert first.samples == [2] and not first.complete
    assert kvscope.trace(prompts, tmp_path / "two.zarr", shard=Shard(0, 2), **kwargs).samples == [0, 1]
    assert_same_store(tmp_path / "two.zarr", tmp_path / "one.zarr")
