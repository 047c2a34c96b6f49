"""A replay result store is checked before a number is read from it: `kvscope verify` names each
problem, `compare` and `open_result` refuse in one line (docs/replay.md, "Result stores:
guarantees")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr

import kvscope
from kvscope.errors import KvscopeError
from kvscope.replay.check import COORDINATES, VARIABLES
from kvscope.replay.store import CHECKSUM_ATTR, attributes_checksum

from .conftest import run_cli, run_main, tree_digest
from .test_verify import clean, copy, one_line  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def result(clean, tmp_path_factory) -> Path:  # noqa: F811
    """Two policies at one budget on the small real trace, with the output errors (q/k/v)."""
    out = tmp_path_factory.mktemp("result") / "r.zarr"
    kvscope.replay(clean, ["h2o", "kivi"], [0.5], n_boot=20, out=out)
    return out


def compare_doc(store: Path) -> dict:
    ran = run_main("compare", store, "--json")
    assert ran.returncode == 0, ran.stderr
    return {k: v for k, v in json.loads(ran.stdout).items() if k != "replay_seconds"}


def edit_attrs(store: Path, edit, resign: bool) -> None:
    """Edit the group's attributes (``resign``: with a checksum that matches, as a writer would)."""
    doc = json.loads((store / "zarr.json").read_text())
    edit(doc["attributes"])
    if resign:
        doc["attributes"][CHECKSUM_ATTR] = attributes_checksum(doc["attributes"])
    (store / "zarr.json").write_text(json.dumps(doc))


def write_values(store: Path, name: str, index, value) -> None:
    """Store ``value`` at ``index`` of ``name`` through zarr: valid codecs and CRC32C."""
    array = zarr.open_group(str(store), mode="r+", use_consolidated=False)[name]
    array[index] = value


def test_a_clean_result_verifies_and_every_chunk_exists(result):
    proc = run_cli("verify", result, "--json", check=True)
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["kind"] == "replay result" and doc["problems"] == []
    forced = {n for n, v in VARIABLES.items() if v.optional in ("forced", "answers", "tasks")}  # replay --forced only
    names = set(VARIABLES) - forced | {n for n, v in COORDINATES.items() if not v.optional}
    assert {p.name for p in result.iterdir() if p.is_dir()} == names  # the optional output errors too
    chunks = [p for p in result.rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert doc["chunks"] == len(chunks)
    # every chunk written, those holding only fill values too: a missing chunk is never an all-NaN block
    group = zarr.open_group(str(result), mode="r", use_consolidated=False)
    for name, array in group.arrays():
        files = list((result / name / "c").rglob("*")) if array.nchunks else []
        assert len([f for f in files if f.is_file()]) == array.nchunks, name
    opened = kvscope.open_result(result)
    assert CHECKSUM_ATTR not in opened.attrs and opened.attrs["kind"] == "kvscope replay"
    assert set(opened.data_vars) == set(VARIABLES) - forced
    assert opened["tiers"].chunks is not None  # lazy
    assert np.isin(opened["tiers"].values, (-1, 0, 1, 2)).all()


@pytest.mark.parametrize(
    "damage,where,problem",
    [
        ("delete", "tier_mean/c/0/0/0/0", "is missing"),  # all NaN here: written all the same
        ("flip", "fmm_mean/c/0/0/0", "fails its CRC32C checksum"),
        ("truncate", "budget/c/0", "fails its CRC32C checksum"),
        ("flip", "policy/c/0", "fails its CRC32C checksum"),
    ],
)
def test_a_damaged_chunk_is_named_and_refused(tmp_path, result, damage, where, problem):
    store = copy(result, tmp_path / "r.zarr")
    chunk = store / where
    data = bytearray(chunk.read_bytes())
    if damage == "delete":
        chunk.unlink()
    elif damage == "flip":
        data[len(data) // 2] ^= 0x10
        chunk.write_bytes(bytes(data))
    else:
        chunk.write_bytes(bytes(data[:-3]))
    before = tree_digest(store)
    array, _, index = where.split("/", 2)
    report = run_main("verify", store)
    needle = f"chunk {where} of array {array} {problem}"
    named = f"{array} chunk ({index.replace('/', ', ')}): {problem}"  # coordinates: read on open, the reader's line
    assert report.returncode == 2 and (named in report.stdout or needle in report.stdout), report.stdout
    one_line(run_main("compare", store), needle, "kvscope verify")
    with pytest.raises(KvscopeError, match=needle):
        kvscope.open_result(store)
    assert tree_digest(store) == before


def test_a_damaged_tiers_chunk_fails_when_read(tmp_path, result):
    """compare never reads the tiers: it prints the same table; reading them refuses the chunk."""
    store = copy(result, tmp_path / "r.zarr")
    chunk = store / "tiers/c/1/0/0/0/1/0/0/0"
    chunk.write_bytes(chunk.read_bytes()[:-1] + b"?")
    report = run_main("verify", store)
    assert report.returncode == 2 and "tiers chunk (1, 0, 0, 0, 1, 0, 0, 0)" in report.stdout, report.stdout
    assert compare_doc(store) == compare_doc(result)
    tiers = kvscope.open_result(store)["tiers"]
    tiers.isel(policy=0).load()  # other chunks read fine
    with pytest.raises(KvscopeError, match="chunk tiers/c/1/0/0/0/1/0/0/0 of array tiers fails its CRC32C"):
        tiers.load()


@pytest.mark.parametrize(
    "name,index,value,needle",
    [
        ("fmm_mean", (0, 0, 0), 1.5, "shares must be NaN or in [0, 1]"),
        ("tier_mass", (1, 0, 0, 0, 0, 0, 0, 2), -0.1, "shares must be NaN or in [0, 1]"),
        ("bytes_used", (0, 0, 0, 1, 3), np.inf, "values must be NaN or finite and ≥ 0"),
        ("attn_l1_mean", (1, 0, 0), 2.5, "L1 distances must be NaN or in [0, 2]"),
        ("lir_eligible", (0, 0, 0, 0, 0, 0), -3, "counts must be ≥ 0"),
        ("budget", 0, 0.0, "coordinate budget: budgets must be distinct and in (0, 1]"),
        ("event", 0, 5, "coordinate event: must be 0, 1, …, n − 1"),
        ("horizon", 0, 0, "coordinate horizon: horizons must be increasing integers ≥ 1"),
        ("tier", 1, "X", "coordinate tier: tiers must be FP, Q, EVICTED"),
        ("policy", 1, "h2o", "coordinate policy: policy labels must be distinct"),
    ],
)
def test_values_a_result_cannot_hold_are_refused(tmp_path, result, name, index, value, needle):
    store = copy(result, tmp_path / "r.zarr")
    write_values(store, name, index, value)
    report = run_main("verify", store)
    line = report.stdout.splitlines()[0]
    assert report.returncode == 2 and name in line and needle in line, report.stdout
    one_line(run_main("compare", store), name, needle)


def test_tier_codes_are_checked_in_every_chunk_read(tmp_path, result):
    store = copy(result, tmp_path / "r.zarr")
    write_values(store, "tiers", (0, 0, 0, 1, 0, 1, 0, 5), 7)
    report = run_main("verify", store)
    assert "tiers chunk (0, 0, 0, 1, 0, 0, 0, 0): tier codes must be" in report.stdout, report.stdout
    with pytest.raises(KvscopeError, match=r"array tiers chunk \(0, 0, 0, 1, 0, 0, 0, 0\): tier codes must be"):
        kvscope.open_result(store)["tiers"].load()


@pytest.mark.parametrize(
    "edit,resign,needle",
    [
        (lambda a: a.update(horizon=5), False, "the attributes fail their CRC32C checksum"),
        (lambda a: a.update(model="other"), False, "the attributes fail their CRC32C checksum"),
        (lambda a: a.pop(CHECKSUM_ATTR), False, f"the attributes carry no {CHECKSUM_ATTR}"),
        (lambda a: a.update(horizon="x"), True, "attribute horizon must be an integer ≥ 1 (got 'x')"),
        (lambda a: a.update(observe="both"), True, "attribute observe must be renorm or exact"),
        (lambda a: a.update(lir_h=0), True, "attribute lir_h must be an integer ≥ 1 or none"),
        (lambda a: a.update(policies="[1]"), True, "attribute policies is not a JSON object"),
        (lambda a: a.update(policies=json.dumps({"h2o": {}})), True, "attribute policies does not describe"),
    ],
)
def test_attributes_are_checksummed_and_typed(tmp_path, result, edit, resign, needle):
    store = copy(result, tmp_path / "r.zarr")
    edit_attrs(store, edit, resign)
    report = run_main("verify", store)
    assert report.returncode == 2 and needle in report.stdout, report.stdout
    one_line(run_main("compare", store), needle)


@pytest.mark.parametrize(
    "name,edit,needle",
    [
        ("fmm", lambda m: m.update(dimension_names=["policy", "allocation", "budget", "sample", "t", "layer", "kv_head"]), "array fmm has dims"),
        ("fmm", lambda m: m.update(data_type="float32"), "array fmm has dtype float32, expected float64"),
        ("fmm", lambda m: m["shape"].__setitem__(4, m["shape"][4] + 1), "dim event has size"),
        ("fmm", lambda m: m.update(codecs=m["codecs"][:-1]), "array fmm carries no CRC32C checksum"),
        ("fmm", lambda m: m["attributes"].update(scale_factor=2), "array fmm has attributes kvscope never writes"),
        ("lir", lambda m: m["chunk_grid"]["configuration"].update(chunk_shape=[9, 9, 9]), "larger than its shape"),
        ("tier", lambda m: m["data_type"]["configuration"].update(length_bytes=10**8), "array tier has dtype"),
    ],
)  # fmt: skip
def test_array_metadata_is_checked(tmp_path, result, name, edit, needle):
    store = copy(result, tmp_path / "r.zarr")
    meta = json.loads((store / name / "zarr.json").read_text())
    edit(meta)
    (store / name / "zarr.json").write_text(json.dumps(meta))
    report = run_main("verify", store)
    assert report.returncode == 2 and needle in report.stdout, report.stdout
    one_line(run_main("compare", store), needle)


def test_arrays_missing_or_unknown_are_refused(tmp_path, result):
    store = copy(result, tmp_path / "missing.zarr")
    (store / "lir" / "zarr.json").unlink()
    one_line(run_main("compare", store), "is missing arrays: lir")
    store = copy(result, tmp_path / "optional.zarr")
    (store / "attn_l1" / "zarr.json").unlink()  # the output errors come all together or not at all
    one_line(run_main("compare", store), "is missing arrays: attn_l1")
    store = copy(result, tmp_path / "unknown.zarr")
    copy(store / "lir", store / "lir2")
    one_line(run_main("compare", store), "arrays lir2 are not part of a replay result")


def test_the_consolidated_copy_must_match(tmp_path, result):
    """Other readers (xarray's default) read the consolidated copy: verify reports a copy that differs."""
    store = copy(result, tmp_path / "r.zarr")
    doc = json.loads((store / "zarr.json").read_text())
    doc["consolidated_metadata"]["metadata"]["fmm"]["fill_value"] = 0.0
    (store / "zarr.json").write_text(json.dumps(doc))
    report = run_main("verify", store)
    assert report.returncode == 2 and "consolidated metadata of fmm differs" in report.stdout
    assert compare_doc(store) == compare_doc(result)  # kvscope itself reads the arrays' own
