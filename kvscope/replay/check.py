"""What a replay result store must be before any number is read from it (docs/replay.md,
"Result stores: guarantees"), and ``kvscope verify`` of one.

On open (``check_result``), each failure one [`StoreError`][kvscope.errors.StoreError] line:

1. the group: a Zarr v3 group whose attributes say ``kind = "kvscope replay"``, carry their
   CRC32C (a result is written once: any later edit shows) and have the types of
   ``ATTRIBUTES``; ``policies`` and ``allocations`` name exactly the ``policy`` and
   ``allocation`` labels;
2. every array: one of ``VARIABLES`` or ``COORDINATES`` (the optional ones all or
   none), with its dims and dtype, a regular chunk grid no larger than the array, the codec
   pipeline kvscope writes (bytes, blosc, CRC32C) and no attributes but xarray's; every dim
   one size in every array;
3. the coordinates, read through the checked store: their rules (``COORDINATES``).

Every read goes through ``kvscope.storage.integrity.TraceStore`` with every chunk required (a
result is written whole) and CRC32C-checked; every variable's values then pass its rule
(``VALUE_RULES``) before a number is shown — the tiers, read lazily, chunk by chunk as
they are computed. ``kvscope verify`` reads every chunk and reports each problem.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xarray as xr

from ..errors import StoreError, first_line, parse_json
from ..storage.integrity import (
    ChunkRules,
    DamagedStore,
    TraceStore,
    check_encoding,
    chunk_shape,
    group_attributes,
    is_int,
    read_metas,
)
from ..tiers import TIER_CODES_RULE, valid_codes
from .store import CHECKSUM_ATTR, RUN, TIER_DIMS, attributes_checksum

KIND = "kvscope replay"
TIERS = ("FP", "Q", "EVICTED")
SHARE_SLACK = 1e-9  # shares summed in float64 may pass 1 by rounding


@dataclass(frozen=True)
class Variable:
    dims: tuple[str, ...]
    dtypes: tuple[str, ...]  # numpy dtype strings; "U": any unicode string
    rule: str  # a key of VALUE_RULES (data variables) or COORDINATE_RULES
    optional: str = ""  # the group of optional variables it belongs to, present all or none:
    # "errors" (attn_l1, output_rel_l2 and their means: q/k/v recorded), "forced" (replay --forced),
    # "answers" (replay --forced of a trace whose samples carry answers: trace --dataset), "tasks"
    # (beside "answers" in results written since 2026-12-07: each sample's task, context and question
    # index, full KV's answer_exact)


SAMPLE = RUN + ("sample",)
EVENT = SAMPLE + ("event", "layer", "kv_head")
UNIT = SAMPLE + ("layer", "kv_head")
F8, I8, INT, TEXT = ("float64",), ("int64",), ("int32", "int64"), ("U",)

VARIABLES = {
    "tiers": Variable(TIER_DIMS, ("int8",), "codes"),
    "tier_mass": Variable(EVENT + ("tier",), F8, "share"),
    "tier_mean": Variable(RUN + ("tier",), F8, "share"),
    "fmm": Variable(EVENT, F8, "share"),
    "fmm_fp": Variable(EVENT, F8, "share"),
    "fmm_curve": Variable(RUN + ("horizon",), F8, "share"),
    "fmm_fp_curve": Variable(RUN + ("horizon",), F8, "share"),
    "churn": Variable(SAMPLE + ("event_pair", "layer", "kv_head"), F8, "share"),
    "churn_mean": Variable(RUN, F8, "share"),
    "lir_eligible": Variable(UNIT, I8, "count"),
    "lir_reactivated": Variable(UNIT, I8, "count"),
    "lir": Variable(RUN, F8, "share"),
    "p01": Variable(RUN, F8, "share"),
    "p10": Variable(RUN, F8, "share"),
    "bytes_used": Variable(SAMPLE + ("step",), F8, "bytes"),
    "allocated": Variable(UNIT, F8, "bytes"),
    "budget_bytes": Variable(("budget", "sample"), F8, "bytes"),
    "full_bytes": Variable(("sample",), F8, "bytes"),
    "byte_ratio": Variable(SAMPLE, F8, "bytes"),
    "byte_ratio_used": Variable(RUN, F8, "bytes"),
    "budget_reached": Variable(RUN, ("bool",), "flag"),
    "n_quantized": Variable(SAMPLE, I8, "count"),
    **{
        f"{name}_{part}": Variable(RUN, F8, "share")
        for name in ("fmm", "fmm_fp")
        for part in ("mean", "ci_low", "ci_high")
    },
    "attn_l1": Variable(EVENT, F8, "l1", optional="errors"),
    "output_rel_l2": Variable(EVENT, F8, "bytes", optional="errors"),
    "attn_l1_mean": Variable(RUN, F8, "l1", optional="errors"),
    "output_rel_l2_mean": Variable(RUN, F8, "bytes", optional="errors"),
    "forced_kl": Variable(SAMPLE + ("step",), F8, "divergence", optional="forced"),
    "forced_nll": Variable(SAMPLE + ("step",), F8, "bytes", optional="forced"),
    "forced_top1": Variable(SAMPLE + ("step",), F8, "share", optional="forced"),
    "forced_rounds": Variable(SAMPLE, I8, "count", optional="forced"),
    "forced_converged": Variable(SAMPLE, ("bool",), "flag", optional="forced"),
    "forced_perplexity_full": Variable(("sample",), F8, "bytes", optional="forced"),
    **{
        f"{name}{part}": Variable(RUN, F8, rule, optional="forced")
        for name, rule, mean in (("forced_kl", "divergence", "_mean"), ("forced_perplexity", "bytes", ""),
                                 ("forced_agreement", "share", ""))
        for part in (mean, "_ci_low", "_ci_high")
    },  # fmt: skip
    "answer_exact": Variable(SAMPLE, F8, "share", optional="answers"),
    "answer_nll": Variable(SAMPLE, F8, "bytes", optional="answers"),
    "answer_rank": Variable(SAMPLE, F8, "bytes", optional="answers"),
    **{f"accuracy{part}": Variable(RUN, F8, "share", optional="answers") for part in ("", "_ci_low", "_ci_high")},
    "answer_exact_full": Variable(("sample",), F8, "share", optional="tasks"),
}

COORDINATES = {
    "policy": Variable(("policy",), TEXT, "labels"),
    "policy_name": Variable(("policy",), TEXT, "text"),
    "policy_kind": Variable(("policy",), TEXT, "text"),
    "allocation": Variable(("allocation",), TEXT, "labels"),
    "budget": Variable(("budget",), F8, "budgets"),
    "sample": Variable(("sample",), INT, "ids"),
    "event": Variable(("event",), INT, "range"),
    "event_step": Variable(("event",), INT, "steps"),
    "event_pair": Variable(("event_pair",), INT, "pairs"),
    "layer": Variable(("layer",), INT, "ids"),
    "kv_head": Variable(("kv_head",), INT, "range"),
    "pos": Variable(("pos",), INT, "range"),
    "step": Variable(("step",), INT, "range"),
    "horizon": Variable(("horizon",), INT, "horizons"),
    "tier": Variable(("tier",), TEXT, "tiers"),
    "task": Variable(("sample",), TEXT, "text", optional="tasks"),  # "" for a sample without a task
    "context": Variable(("sample",), INT, "indices", optional="tasks"),  # samples sharing a context share it
    "question": Variable(("sample",), INT, "indices", optional="tasks"),  # its index among its context's questions
}
NON_INDEX = ("policy_name", "policy_kind", "event_step", "task", "context", "question")
ARRAY_ATTRIBUTES = frozenset({"coordinates", "_FillValue"})  # what xarray writes beside an array
MAX_TEXT_BYTES = 4096  # a label's fixed-length string type, at most


# -- value rules: each elementwise, so that a chunk is checked like the whole ---------------


def _nan_or(ok):
    return lambda x: bool((np.isnan(x) | ok(x)).all())


VALUE_RULES = {
    "share": ("shares must be NaN or in [0, 1]", _nan_or(lambda x: (x >= -SHARE_SLACK) & (x <= 1 + SHARE_SLACK))),
    "l1": ("L1 distances must be NaN or in [0, 2]", _nan_or(lambda x: (x >= 0) & (x <= 2 + SHARE_SLACK))),
    "bytes": ("values must be NaN or finite and ≥ 0", _nan_or(lambda x: np.isfinite(x) & (x >= 0))),
    # KL of float32 log-probabilities: ≥ 0 up to their rounding
    "divergence": ("divergences must be NaN or finite and ≥ −1e-6", _nan_or(lambda x: np.isfinite(x) & (x >= -1e-6))),
    "count": ("counts must be ≥ 0", lambda x: bool((x >= 0).all())),
    "flag": ("flags must be true or false", lambda x: True),
    "codes": (TIER_CODES_RULE, valid_codes),
}


def value_problem(name: str, data: np.ndarray) -> str | None:
    """What is wrong with values of the variable ``name`` (a chunk or all of it), or None."""
    problem, ok = VALUE_RULES[VARIABLES[name].rule]
    return None if ok(data) else problem


# -- 1. attributes --------------------------------------------------------------------------


def _int(low: int):
    return lambda v: is_int(v, low), f"an integer ≥ {low}"


def _one_of(*values):
    return lambda v: v in values, " or ".join(map(str, values))


_TEXT = (lambda v: isinstance(v, str), "a string")
PROTOCOLS = ("question-aware", "question-agnostic")  # where the policy first compressed (docs/replay.md)
ATTRIBUTES = {
    "observe": _one_of("renorm", "exact"),
    "horizon": _int(1),
    "every": _int(1),
    "n_sink": _int(0),
    "w": _int(1),
    "lir_m": _int(1),
    "lir_h": (lambda v: v == "none" or is_int(v, 1), "an integer ≥ 1 or none"),
    "delta": _int(1),
    "resample": _one_of("samples", "units"),
    "ci": _TEXT,
    "trace": _TEXT,
    "model": _TEXT,
    "policies": _TEXT,
    "allocations": _TEXT,
    "kv_itemsize": _int(1),
    "protocol": (lambda v: v in (None, *PROTOCOLS), "question-aware or question-agnostic"),  # absent before 0.3
    "replay_seconds": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, "a number ≥ 0"),
    "forced": (lambda v: v is None or (isinstance(v, str) and _json_object(v) is not None), "a JSON object"),
    "replay_workers": (
        lambda v: v is None or (isinstance(v, str) and re.fullmatch(r"(threads|forked|dask):[1-9]\d*", v) is not None),
        "threads:N, forked:N or dask:N",
    ),  # absent in results written before 2026-12-02
}


def is_result(path) -> bool:
    """Whether ``path`` holds a group that says it is a replay result (checked or not)."""
    try:
        return group_attributes(path, "replay result").get("kind") == KIND
    except StoreError:
        return False


def check_attrs(path, attrs: dict) -> dict:
    """The result's attributes, their checksum and types checked; returns the parsed policies."""
    if attrs.get("kind") != KIND:
        raise StoreError(f"{path} is not a kvscope replay result (no kind = {KIND!r} attribute)")
    stored = attrs.get(CHECKSUM_ATTR)
    if not isinstance(stored, str):
        raise StoreError(f"{path}: the attributes carry no {CHECKSUM_ATTR} (written by an older kvscope?)")
    try:
        matches = attributes_checksum(attrs) == stored
    except ValueError:  # NaN or infinity: not JSON kvscope writes
        matches = False
    if not matches:
        raise StoreError(f"{path}: the attributes fail their CRC32C checksum (changed after the result was written)")
    if "allocations" not in attrs:
        raise StoreError(f"{path} was written by a kvscope before allocations (no allocation dim): replay it again")
    for name, (ok, want) in ATTRIBUTES.items():
        if not ok(attrs.get(name)):
            raise StoreError(f"{path}: attribute {name} must be {want} (got {attrs.get(name)!r})")
    policies = _json_object(attrs["policies"])
    if policies is None or not all(isinstance(p, dict) for p in policies.values()):
        raise StoreError(f"{path}: attribute policies is not a JSON object of policy settings")
    return policies


def _json_object(text: str) -> dict | None:
    try:
        value = parse_json(text)
    except ValueError:  # not JSON, or nested too deep
        return None
    return value if isinstance(value, dict) else None


# -- 2. arrays --------------------------------------------------------------------------------


def _spec(name: str) -> Variable:
    return VARIABLES.get(name) or COORDINATES[name]


def check_arrays(path, metas: dict) -> dict[str, int]:
    """Every array known, present and as ``VARIABLES`` / ``COORDINATES`` say;
    returns the size of every dim."""
    unknown = sorted(set(metas) - set(VARIABLES) - set(COORDINATES))
    if unknown:
        raise StoreError(f"{path}: arrays {', '.join(unknown)} are not part of a replay result")
    groups: dict[str, set[str]] = {}
    for n, v in (VARIABLES | COORDINATES).items():
        if v.optional:
            groups.setdefault(v.optional, set()).add(n)
    required = (set(VARIABLES) | set(COORDINATES)) - set().union(*groups.values())
    for members in groups.values():
        required |= members if members & set(metas) else set()
    missing = sorted(required - set(metas))
    if missing:
        raise StoreError(f"{path} is missing arrays: {', '.join(missing)}")
    sizes: dict[str, tuple[int, str]] = {}
    for name, meta in sorted(metas.items()):
        spec = _spec(name)
        if meta.get("dimension_names") != list(spec.dims):
            raise StoreError(f"{path}: array {name} has dims {meta.get('dimension_names')}, expected {list(spec.dims)}")
        shape = meta.get("shape")
        if not (isinstance(shape, list) and all(is_int(n) for n in shape)):
            raise StoreError(f"{path}: array {name} has shape {shape!r}, not a list of sizes")
        chunks = chunk_shape(path, name, meta, len(shape))
        if any(c > max(n, 1) for c, n in zip(chunks, shape, strict=True)):
            raise StoreError(f"{path}: array {name} has chunks {chunks} larger than its shape {shape}")
        for dim, n in zip(spec.dims, shape, strict=True):
            first = sizes.setdefault(dim, (n, name))
            if first[0] != n:
                raise StoreError(f"{path}: dim {dim} has size {n} in array {name} but {first[0]} in {first[1]}")
        check_encoding(path, name, meta, None, crc=True, attributes=ARRAY_ATTRIBUTES)
    return {dim: n for dim, (n, _) in sizes.items()}


def _check_dtype(path, name: str, array) -> None:
    spec, dtype = _spec(name), np.dtype(array.dtype)
    text = dtype.kind == "U" and "U" in spec.dtypes and dtype.itemsize <= MAX_TEXT_BYTES
    if not (text or dtype.str.lstrip("<>|=") in {np.dtype(d).str.lstrip("<>|=") for d in spec.dtypes if d != "U"}):
        raise StoreError(f"{path}: array {name} has dtype {dtype}, expected {' or '.join(spec.dtypes)}")


# -- 3. coordinates ---------------------------------------------------------------------------


def _increasing(x, low: int) -> bool:
    return x.size == 0 or (x[0] >= low and bool((np.diff(x) > 0).all()))


COORDINATE_RULES = {
    "labels": ("policy labels must be distinct, non-empty strings", lambda x, n: len(set(x)) == x.size and all(x)),
    "text": ("must be strings", lambda x, n: True),
    "budgets": ("budgets must be distinct and in (0, 1]", lambda x, n: len(set(x)) == x.size and bool(((x > 0) & (x <= 1)).all())),
    "ids": ("must be increasing integers ≥ 0", lambda x, n: _increasing(x, 0)),
    "indices": ("must be integers ≥ 0", lambda x, n: bool((x >= 0).all())),
    "range": ("must be 0, 1, …, n − 1", lambda x, n: np.array_equal(x, np.arange(x.size))),
    "pairs": ("must be 1, 2, …, n", lambda x, n: np.array_equal(x, np.arange(1, x.size + 1))),
    "steps": ("event steps must be increasing steps of the trace", lambda x, n: _increasing(x, 0) and (x.size == 0 or x[-1] < n["step"])),
    "horizons": ("horizons must be increasing integers ≥ 1", lambda x, n: _increasing(x, 1)),
    "tiers": (f"tiers must be {', '.join(TIERS)}", lambda x, n: list(x) == list(TIERS)),
}  # fmt: skip


@dataclass
class CheckedResult:
    """A replay result that passed the checks on open: its group (every read checked), the
    parsed attributes, the dim sizes and the coordinates' values."""

    path: Path
    group: object  # zarr.Group over a TraceStore
    attrs: dict
    sizes: dict[str, int]
    coords: dict[str, np.ndarray]

    @property
    def variables(self) -> list[str]:
        return [name for name in VARIABLES if name in self.group]

    def read(self, name: str) -> np.ndarray:
        """A whole array, its chunks checked (one line naming the chunk otherwise)."""
        return read_array(self.path, self.group[name], name)


def read_array(path, array, name: str) -> np.ndarray:
    """The whole ``array`` through the checked store; a chunk that does not decode → one line."""
    try:
        return np.asarray(array[...])
    except DamagedStore:
        raise
    except Exception as exc:  # noqa: BLE001 - a chunk whose bytes are right but metadata is not
        raise StoreError(f"{path}: array {name} cannot be decoded ({first_line(exc, named=True)}); "
                         f"run kvscope verify {path}") from None  # fmt: skip


def check_result(path) -> CheckedResult:
    """Steps 1–3 of the module docstring."""
    import zarr

    path = Path(path)
    attrs = group_attributes(path, "replay result")
    policies = check_attrs(path, attrs)
    metas = read_metas(path)
    sizes = check_arrays(path, metas)
    store = TraceStore(path, rules=ChunkRules.every_chunk(metas))
    group = zarr.open_group(store=store, mode="r", zarr_format=3, use_consolidated=False)
    for name in metas:
        _check_dtype(path, name, group[name])
    coords = {}
    for name, spec in COORDINATES.items():
        if spec.optional and name not in metas:
            continue
        values = read_array(path, group[name], name)
        problem, ok = COORDINATE_RULES[spec.rule]
        if not ok(values, sizes):
            raise StoreError(f"{path}: coordinate {name}: {problem}")
        coords[name] = values
    labels = [str(p) for p in coords["policy"]]
    if sorted(policies) != sorted(labels) or any(
        policies[p].get("name") != n or policies[p].get("kind") != k
        for p, n, k in zip(labels, coords["policy_name"], coords["policy_kind"], strict=True)
    ):
        raise StoreError(f"{path}: attribute policies does not describe the policies {labels}")
    allocations = [str(a) for a in coords["allocation"]]
    if sorted(_json_object(attrs["allocations"]) or {}) != sorted(allocations):
        raise StoreError(f"{path}: attribute allocations does not describe the allocations {allocations}")
    return CheckedResult(path, group, attrs, sizes, coords=coords)


# -- reading ----------------------------------------------------------------------------------


def open_result(path: str | os.PathLike) -> xr.Dataset:
    """The Dataset of a saved replay result, checked: ``tiers`` lazy (dask; each chunk's codes
    checked when read), every other variable read now and its values checked.

    Args:
        path: A store written by ``replay(out=…)``, ``save_result`` or ``kvscope replay --out``.

    Raises:
        StoreError: Not a replay result, or a damaged one (one line naming the problem).
    """
    checked = check_result(path)
    data = {}
    for name in checked.variables:
        dims = VARIABLES[name].dims
        if name == "tiers":
            data[name] = (dims, _lazy_tiers(checked))
            continue
        values = checked.read(name)
        problem = value_problem(name, values)
        if problem is not None:
            raise StoreError(f"{path}: array {name}: {problem}; run kvscope verify {path}")
        data[name] = (dims, values)
    coords = {name: (COORDINATES[name].dims, values) for name, values in checked.coords.items()}
    attrs = {k: v for k, v in checked.attrs.items() if k != CHECKSUM_ATTR}
    return xr.Dataset(data, coords=coords, attrs=attrs)


def _lazy_tiers(checked: CheckedResult):
    import dask.array as da

    tiers = da.from_zarr(checked.group["tiers"])
    return tiers.map_blocks(_checked_codes, str(checked.path), dtype=np.int8)


def _checked_codes(block: np.ndarray, path: str, block_info=None) -> np.ndarray:
    problem = value_problem("tiers", block)
    if problem is not None:
        where = tuple((block_info or {}).get(0, {}).get("chunk-location", ()))
        raise StoreError(f"{path}: array tiers chunk {where}: {problem}; run kvscope verify {path}")
    return block


# -- kvscope verify -----------------------------------------------------------------------------


def verify_result(path):
    """The [`kvscope.storage.verify.Report`][kvscope.storage.verify.Report] of a replay result: the checks on open, the
    consolidated metadata, then every chunk of every variable read and its values checked."""
    from ..storage.verify import Report, check_consolidated, read_block

    started = time.perf_counter()
    report = Report(str(path), "replay result")
    try:
        checked = check_result(path)
    except StoreError as exc:
        report.add("store", "-", str(exc))
        return report
    check_consolidated(report, Path(path))
    report.chunks += sum(checked.group[name].nchunks for name in checked.coords)  # read and checked on open
    for name in checked.variables:
        array = checked.group[name]
        grid = (range(math.ceil(n / c)) for n, c in zip(array.shape, array.chunks, strict=True))
        for index in itertools.product(*grid):
            data = read_block(report, array, name, index)
            if data is None:
                continue
            report.chunks += 1
            problem = value_problem(name, data)
            if problem is not None:
                report.add(name, index, problem)
    report.seconds = round(time.perf_counter() - started, 3)
    return report
