"""`kvscope verify` and the checks every reader makes: damaged chunks, uncommitted rows and
values a trace cannot hold end in one line naming what and where, never in numbers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

import kvscope
from kvscope.errors import StoreError

from .conftest import ROOT, Ran, run_cli, run_main, tree_digest
from .test_capture import PROMPT


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_models) -> Path:
    """Two samples, 12 steps in blocks of 4, q/k/v recorded: a small real trace."""
    out = tmp_path_factory.mktemp("verify") / "clean.zarr"
    kvscope.trace(
        [PROMPT, "Kiwis are birds that cannot fly."], out, model=str(tiny_models["llama"]), max_new_tokens=12,
        block_steps=4, record_qkv=True, stop_at_eos=False,
    )  # fmt: skip
    return out


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def one_line(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvscope: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def rewrite(store: Path, array: str, index: tuple, edit) -> None:
    """Rewrite one chunk through zarr (valid codecs and CRC): values a writer could store."""
    a = zarr.open_group(str(store), mode="r+")[array]
    data = a.get_block_selection(index)
    edit(data)
    a.set_block_selection(index, data)


def test_a_clean_trace_verifies(clean):
    proc = run_cli("verify", clean, "--deep", "--json", check=True)
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["problems"] == [] and doc["kind"] == "trace"
    # every committed chunk: attn (2 samples × 3 blocks × 2 layers), prefill_colsum and prefill_tail
    # (2 samples × 2 layers each), q, k, v (2 samples × 2 layers × 1 block of positions), rope (2)
    assert doc["chunks"] == 12 + 4 + 4 + 3 * 4 + 2
    prompt = kvscope.open_trace(clean).prompt_len.values
    decode_rows = 2 * 12 * 2 * 2  # sample × step × layer × kv head
    tail_rows = int(np.minimum(prompt, 32).sum()) * 2 * 2  # the last prompt rows × layer × kv head
    assert doc["rows"] == decode_rows + tail_rows
    assert doc["deep_rows"] == decode_rows


ALL = {"fmm", "peaks", "replay"}


@pytest.mark.parametrize(
    "damage,needles,readers",
    [
        ("flip", ["attn chunk (0, 1, 1, 0, 0): fails its CRC32C checksum"], ALL),
        ("truncate", ["k chunk (1, 0, 0, 0, 0): fails its CRC32C checksum"], {"replay"}),  # errors read k/v
        ("delete", ["prefill_colsum chunk (1, 1, 0, 0): is missing inside the committed steps"], {"fmm", "replay"}),
        ("garbage-tokens", ["tokens/c/1/0 of array tokens fails its CRC32C checksum"], ALL),  # read on open
        ("nan", ["attn chunk (0, 2, 0, 0, 0): 1 row(s) with NaN where a probability belongs"], ALL),
        ("negative", ["attn chunk (1, 0, 1, 0, 0): probabilities outside [0, 1]"], ALL),
        ("fifty", ["attn chunk (0, 0, 0, 0, 0): probabilities outside [0, 1]"], ALL),
    ],
)
def test_damage_is_named_by_verify_and_refused_by_every_reader(
    tmp_path, clean, clean_outputs, damage, needles, readers
):
    """verify names the chunk; every other command either refuses in one line or, when it never
    reads the damaged chunk, prints exactly the numbers of the undamaged store."""
    store = copy(clean, tmp_path / f"{damage}.zarr")
    if damage == "flip":
        chunk = store / "attn/c/0/1/1/0/0"
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0x40
        chunk.write_bytes(bytes(data))
    elif damage == "truncate":
        chunk = store / "k/c/1/0/0/0/0"
        chunk.write_bytes(chunk.read_bytes()[:-7])
    elif damage == "delete":
        (store / "prefill_colsum/c/1/1/0/0").unlink()
    elif damage == "garbage-tokens":
        chunk = store / "tokens/c/1/0"
        chunk.write_bytes(np.random.default_rng(0).bytes(len(chunk.read_bytes())))
    elif damage == "nan":
        rewrite(store, "attn", (0, 2, 0, 0, 0), lambda x: x.__setitem__((0, 1, 0, 0, 3), np.nan))
    elif damage == "negative":
        rewrite(store, "attn", (1, 0, 1, 0, 0), lambda x: x.__setitem__((0, 2, 0, 1, 0), -0.25))
    else:
        rewrite(store, "attn", (0, 0, 0, 0, 0), lambda x: np.multiply(x, 50, out=x))
    before = tree_digest(store)
    report = run_main("verify", store)
    assert report.returncode == 2 and all(n in report.stdout for n in needles), report.stdout
    one_line(run_main("info", store))
    for args, clean_doc in clean_outputs.items():
        proc = run_main(*[store if a == "STORE" else a for a in args])
        if {args[0], args[1]} & readers:  # the command reads the damaged chunk: one line
            one_line(proc)
        else:  # it never reads it: the very same numbers as the undamaged store
            assert proc.returncode == 0 and comparable(json.loads(proc.stdout)) == clean_doc, args
    assert tree_digest(store) == before  # nothing a command does changes its input


# `kvscope ARGV` in RUNS children forked after one import, side by side; each exits as the CLI
# does (the interpreter's shutdown: atexit, zarr closing its event loop). Prints [[code, stderr], …].
FORKED_RUNS = """
import gc, json, os, sys, threading
from kvscope.cli import main
import kvscope.replay  # noqa: F401
argv, runs = json.loads(sys.argv[1]), int(sys.argv[2])
assert threading.active_count() == 1, threading.enumerate()
gc.freeze()  # the children's collections copy none of the parent's pages (~1 s each)
children = []
for _ in range(runs):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        raise SystemExit(main(argv))
    os.close(w)
    children.append((pid, os.fdopen(r)))
print(json.dumps([[os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), err.read()] for pid, err in children]))
"""


def test_a_refused_read_leaves_nothing_running_at_exit(tmp_path):
    """zarr reads the chunks of a read side by side on its event loop; the first bad one fails
    the read and leaves the others under way there. The process exits on its one line: they are
    stopped first, else zarr closes the loop under them and each prints ``RuntimeError: Event
    loop is closed`` with its traceback (~1 run in 9 of a replay of a SmolLM2 trace; 9 in 10
    here, with 256 layers' chunks in one read)."""
    from kvscope.storage.synthetic import write_synthetic_store

    store = write_synthetic_store(
        tmp_path / "deep.zarr", n_samples=1, n_steps=4, n_layers=256, n_kv=1, prompt_len=64, block_steps=4
    )
    chunk = store / "attn/c/0/0/0/0/0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x40
    chunk.write_bytes(bytes(data))
    argv = ["replay", str(store), "--policies", "h2o,kivi", "--budgets", "0.5", "--json", "--quiet"]
    proc = subprocess.run(
        [sys.executable, "-c", FORKED_RUNS, json.dumps(argv), "4"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for code, err in json.loads(proc.stdout):
        one_line(Ran(code, "", err), "chunk attn/c/0/0/0/0/0 of array attn fails its CRC32C checksum")


COMMANDS = (
    ("analyze", "fmm", "STORE", "--bootstrap", "20", "--json"),
    ("analyze", "peaks", "STORE", "--bootstrap", "5", "--json"),
    ("replay", "STORE", "--policies", "h2o,kivi", "--budgets", "0.5", "--json", "--quiet"),
)


def comparable(doc: dict) -> dict:
    """A command's JSON without what names the store or times the run."""
    return {k: v for k, v in doc.items() if k not in ("trace", "replay_seconds", "plot", "out")}


@pytest.fixture(scope="module")
def clean_outputs(clean) -> dict:
    return {
        args: comparable(json.loads(run_main(*[clean if a == "STORE" else a for a in args]).stdout))
        for args in COMMANDS
    }


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda m: m.update(data_type="int16"), "array attn has dtype int16, the schema says float16"),
        (lambda m: m.update(data_type="float64"), "array attn has dtype float64"),
        (lambda m: m["shape"].__setitem__(4, m["shape"][4] + 3), "array attn has shape"),
        (lambda m: m.update(dimension_names=["sample", "step", "layer", "kv_head", "position"]), "array attn has dims"),
        (lambda m: m.update(codecs=m["codecs"][:-1]), "array attn carries no CRC32C checksum"),
        (lambda m: m.update(fill_value=0.0), "array attn has fill value 0.0"),
    ],
)
def test_metadata_a_trace_cannot_have_is_refused_on_open(tmp_path, clean, edit, needle):
    store = copy(clean, tmp_path / "meta.zarr")
    meta = json.loads((store / "attn/zarr.json").read_text())
    edit(meta)
    (store / "attn/zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError) as err:
        kvscope.open_trace(store)
    assert needle in str(err.value)
    one_line(run_main("analyze", "churn", store), needle)


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda a: a.update(steps_committed="all"), "attribute steps_committed must be a list of counts"),
        (lambda a: a.update(steps_committed=[12, 99]), "steps_committed [12, 99] outside 0..12"),
        (lambda a: a.update(w=6), "attribute w must be a positive multiple of 4 (got 6)"),
        (lambda a: a.update(heads="some"), "attribute heads must be all, kv or mean"),
        (lambda a: a["model"]["config"].update(n_layers=3), "the schema says"),
        (lambda a: a["model"]["config"].update(vocab_size=5), "tokens of sample 0 hold ids outside the vocabulary"),
        (lambda a: a.update(status="done"), "attribute status must be partial or complete"),
        (lambda a: a.update(block_steps=0), "attribute block_steps must be an integer ≥ 1"),
    ],
)
def test_attributes_a_trace_cannot_have_are_refused_on_open(tmp_path, clean, edit, needle):
    store = copy(clean, tmp_path / "attrs.zarr")
    doc = json.loads((store / "zarr.json").read_text())
    edit(doc["attributes"])
    (store / "zarr.json").write_text(json.dumps(doc))
    one_line(run_main("analyze", "fmm", store), needle)
    report = run_main("verify", store)
    assert report.returncode == 2 and needle in report.stdout


def test_a_root_that_is_not_an_object_is_refused(tmp_path, clean):
    for name, text in (("list", "[1, 2]"), ("attrs-list", None)):
        store = copy(clean, tmp_path / f"{name}.zarr")
        if text is None:
            doc = json.loads((store / "zarr.json").read_text())
            doc["attributes"] = ["schema_version", 1]
            text = json.dumps(doc)
        (store / "zarr.json").write_text(text)
        one_line(run_main("info", store), "not a")
        one_line(run_main("analyze", "peaks", store), "not a")


def test_small_arrays_must_agree_with_the_committed_steps(tmp_path, clean):
    store = copy(clean, tmp_path / "qpos.zarr")
    rewrite(store, "query_pos", (1, 0), lambda x: x.__setitem__((0, 5), 999))
    one_line(run_cli("analyze", "fmm", store), "query_pos[1, 5] is 999, not prompt_len − 1 + step")
    store = copy(clean, tmp_path / "coord.zarr")
    (store / "layer/c/0").write_bytes(np.array([0, 7], dtype="<i4").tobytes())  # coordinates carry no CRC
    one_line(run_cli("analyze", "fmm", store), "coordinate array layer does not hold 0..1")


def test_readers_see_only_committed_steps(tmp_path, clean):
    """A writer killed after committing 5 steps of sample 0 (and none of sample 1): what was
    written beyond them is invisible, and a store with no committed step is refused."""
    store = copy(clean, tmp_path / "partial.zarr")
    doc = json.loads((store / "zarr.json").read_text())
    doc["attributes"].update(status="partial", steps_committed=[5, 0], samples_done=[False, False])
    (store / "zarr.json").write_text(json.dumps(doc))
    ds = kvscope.open_trace(store)
    assert ds.n_steps.values.tolist() == [5, 0]
    assert (ds.query_pos.values[0, 5:] == -1).all() and (ds.query_pos.values[1] == -1).all()
    attn = ds.attn.values
    assert np.isnan(attn[0, 5:]).all() and np.isnan(attn[1]).all() and not np.isnan(attn[0, :5, :, :, 0]).any()
    full = kvscope.open_trace(clean)
    np.testing.assert_array_equal(attn[0, :5], full.attn.values[0, :5])
    doc["attributes"]["steps_committed"] = [0, 0]
    (store / "zarr.json").write_text(json.dumps(doc))
    one_line(run_cli("analyze", "peaks", store), "no committed decode steps")
    one_line(run_cli("replay", store, "--policies", "h2o", "--budgets", "0.5"), "no committed decode steps")
    assert run_cli("info", store, "--quick", "--json", check=True).returncode == 0  # it still describes it
