"""Damage drawn by hypothesis on a small real trace (complete and partial) and on a replay
result of it: bytes flipped, chunks truncated, extended or deleted, metadata values replaced
by other JSON or removed. Whatever the damage:

* every command ends with exit 0 or 2 — never an internal error, never a traceback;
* a command that refuses says one line; one that answers prints the numbers of the
  undamaged store, digit for digit;
* ``kvscope verify`` finds whatever any reader finds (a reader refusing means verify fails),
  and a store verify passes gives every command the undamaged numbers;
* no command changes the store.

Runs through the CLI's ``main`` in this process (tests/test_verify.py's commands on a trace;
``compare`` and :func:`kvscope.open_result` with every tier read on a result). More examples:
``KVSCOPE_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz.py``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvscope
from kvscope.errors import KvscopeError

from .conftest import Ran, run_main, tree_digest
from .test_verify import COMMANDS, clean, comparable  # noqa: F401 - a fixture

EXAMPLES = int(os.environ.get("KVSCOPE_FUZZ_EXAMPLES", "30"))  # per store
JSON_VALUES = [None, -1, 0, 0.5, 10**12, "x", [], {}, True, float("nan")]


def files(store: Path, metadata: bool) -> list[str]:
    """The store's files (relative), chunks or ``zarr.json`` metadata."""
    return sorted(
        str(p.relative_to(store))
        for p in store.rglob("*")
        if p.is_file() and (p.name == "zarr.json") == metadata and p.name != ".kvscope-lock"
    )


def json_paths(doc, prefix=()) -> list[tuple]:
    """Every key path inside a JSON document (dict keys and list indices)."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    out = []
    for key, value in items:
        out.append((*prefix, key))
        out.extend(json_paths(value, (*prefix, key)))
    return out


@st.composite
def damages(draw, store: Path):
    """One damage: ``(description, function applying it to a copy of the store)``."""
    kind = draw(st.sampled_from(["flip", "truncate", "append", "delete", "json-value", "json-delete"]))
    if kind.startswith("json"):
        name = draw(st.sampled_from(files(store, metadata=True)))
        doc = json.loads((store / name).read_text())
        if "consolidated_metadata" in doc:  # a copy no reader uses: damage the group itself
            doc = {k: v for k, v in doc.items() if k != "consolidated_metadata"}
        path = draw(st.sampled_from(json_paths(doc)))
        value = draw(st.sampled_from(JSON_VALUES))

        def apply(copy: Path):
            doc = json.loads((copy / name).read_text())
            parent = doc
            for key in path[:-1]:
                parent = parent[key]
            if kind == "json-delete":
                del parent[path[-1]]
            else:
                parent[path[-1]] = value
            (copy / name).write_text(json.dumps(doc))

        return f"{kind} {name} {'/'.join(map(str, path))}" + (f" = {value!r}" if kind == "json-value" else ""), apply
    name = draw(st.sampled_from(files(store, metadata=False)))
    size = (store / name).stat().st_size
    offset = draw(st.integers(0, max(size - 1, 0)))
    extra = draw(st.binary(min_size=1, max_size=8))
    flip = draw(st.integers(1, 255))

    def apply(copy: Path):
        target = copy / name
        data = bytearray(target.read_bytes())
        if kind == "flip" and data:
            data[offset] ^= flip
        elif kind == "truncate":
            data = data[:offset]
        elif kind == "append":
            data += extra
        elif kind == "delete":
            target.unlink()
            return
        target.write_bytes(bytes(data))

    return f"{kind} {name} @{offset}", apply


RESULT_COMMANDS = (("compare", "STORE", "--json"), ("open_result", "STORE"))


def run(args: tuple, store: Path):
    if args[0] == "open_result":  # the API: every variable, the lazy tiers read whole
        try:
            result = kvscope.open_result(store)
            tiers = result["tiers"].values
        except KvscopeError as exc:
            return Ran(2, "", f"kvscope: error: {exc}\n")
        doc = {"tiers": hashlib.sha256(tiers.tobytes()).hexdigest(), "shape": list(tiers.shape)}
        return Ran(0, json.dumps(doc | {"vars": sorted(result.data_vars)}), "")
    return run_main(*[store if a == "STORE" else a for a in args])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module", params=["complete", "partial", "result"])
def subject(request, clean, scratch) -> tuple[Path, dict]:  # noqa: F811
    """A store and each command's JSON on it: the complete two-sample trace, the same store as
    a writer killed after 8 and 4 steps leaves it (no consolidated metadata), and a replay
    result of two policies (with the output errors) on the complete one."""
    store, commands = clean, COMMANDS
    if request.param == "result":
        store, commands = scratch / "result.zarr", RESULT_COMMANDS
        kvscope.replay(clean, ["h2o", "kivi"], [0.5], n_boot=20, out=store)
    if request.param == "partial":
        store = scratch / "partial.zarr"
        shutil.copytree(clean, store)
        doc = json.loads((store / "zarr.json").read_text())
        doc.pop("consolidated_metadata", None)
        doc["attributes"].update(status="partial", steps_committed=[8, 4], samples_done=[False, False])
        (store / "zarr.json").write_text(json.dumps(doc))
    outputs = {}
    for args in commands:
        ran = run(args, store)
        assert ran.returncode == 0, ran.stderr
        outputs[args] = comparable(json.loads(ran.stdout))
    return store, outputs


def test_any_damage_is_refused_in_one_line_or_changes_no_number(subject, scratch):
    store, outputs = subject

    @settings(
        max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 40, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )  # fmt: skip
    @given(damage=damages(store))
    def check(damage):
        what, apply = damage
        copy = scratch / "damaged.zarr"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(store, copy)
        apply(copy)
        before = tree_digest(copy)
        verified = run_main("verify", copy)
        assert verified.returncode in (0, 2), (what, verified.stderr)
        for args, clean_doc in outputs.items():
            proc = run(args, copy)
            lines = proc.stderr.strip().splitlines()
            if proc.returncode == 0:
                assert comparable(json.loads(proc.stdout)) == clean_doc, (what, args)
            else:
                assert proc.returncode == 2, (what, args, proc.stderr)
                assert len(lines) == 1 and lines[0].startswith("kvscope: error: "), (what, args, proc.stderr)
                assert verified.returncode == 2, (what, args, "a reader refused what verify passed", lines[0])
        assert tree_digest(copy) == before, what

    check()
