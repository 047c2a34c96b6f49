"""``kvscope verify``: every committed chunk of a trace read, checked, and its values tested.

    1. the checks on open (``kvscope.storage.integrity``): attributes, schema, the small arrays —
       a store that fails them is reported with that one problem (nothing else can be trusted);
    2. every chunk the committed steps need: present, its CRC32C matching, decodable;
    3. its values (``CHECKS``):
         attention rows      probabilities in [0, 1], finite up to the query, NaN beyond it,
                             each row summing to 1 within the tolerance of its dtype
                             (window resolution: window sums and sinks together) — to 1 − σ
                             under learned sinks, σ the sink's share stored beside the row
         learned sinks       shares in [0, 1] where a row is, NaN elsewhere; their prompt sum in [0, P]
         prefill_colsum      finite, ≥ 0 on the prompt, NaN beyond; each head's sums add up to P
         q, k, v             finite on the positions recorded, NaN beyond
         rope parameters     finite; inverse frequencies ≥ 0, scalings > 0
         policy arrays       tier codes −1/0/1/2, bytes ≥ 0
    4. ``deep``: rows of a sample of steps recomputed from the recorded q/k with the model's
       attention rule (``kvscope.model.attention``) and compared with the stored rows.

Each problem is one line naming the array and the chunk (its block index along every dim).
A replay result (``kvscope replay --out``) is checked by ``kvscope.replay.check.verify_result``.

Row-sum tolerance of ``n`` stored values: ``T(n) = 2^-10 + n·2^-24`` for fp16 (each value rounded
to 11 significant bits, subnormals to 2^-24), ``10^-5 + n·2^-23`` for fp32; rows of a lossy row
format (``kvscope.storage.rowformat``, relative error ``ρ``) add ``ρ·(1 + T(n) + n·m)``, ``m`` the
dtype's smallest normal.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import KvscopeError, StoreError
from ..tiers import valid_codes
from .integrity import DamagedStore
from .rowformat import RowFormat
from .schema import schema

MAX_PROBLEMS = 200  # lines reported; the count says how many more


@dataclass
class Problem:
    """One problem of a store: an array, its chunk, and what is wrong."""

    array: str
    chunk: str  # block index along every dim, or "-" for the store as a whole
    what: str

    def line(self) -> str:
        return f"{self.array} chunk {self.chunk}: {self.what}" if self.chunk != "-" else self.what


@dataclass
class Report:
    """What [`verify`][kvscope.storage.verify.verify] found.

    Attributes:
        path: The store.
        kind: ``trace`` or ``replay result``.
        problems: The first problems found (at most 50), each naming its array and chunk.
        n_problems: Problems found in all.
        chunks: Chunks read.
        rows: Attention rows checked.
        deep_rows: Rows recomputed from q/k (``deep``).
        seconds: Wall time.
    """

    path: str
    kind: str
    problems: list[Problem] = field(default_factory=list)
    n_problems: int = 0
    chunks: int = 0
    rows: int = 0
    deep_rows: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No problem was found."""
        return self.n_problems == 0

    def add(self, array: str, chunk: str | tuple, what: str) -> None:
        """Record a problem.

        Args:
            array: The array.
            chunk: Its block index along every dim, or ``"-"`` for the store as a whole.
            what: What is wrong.
        """
        self.n_problems += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(Problem(array, chunk if isinstance(chunk, str) else _index(chunk), what))

    def doc(self) -> dict:
        """The report as JSON (``kvscope verify --json``)."""
        return {**{k: v for k, v in asdict(self).items() if k != "problems"}, "ok": self.ok,
                "problems": [p.line() for p in self.problems]}  # fmt: skip


def _index(index) -> str:
    return "(" + ", ".join(str(int(i)) for i in index) + ")"


# -- value checks of one chunk ---------------------------------------------------------------


@dataclass
class Context:
    """What the value checks of a trace need besides the chunk."""

    checked: object  # kvscope.storage.store.CheckedStore
    n_sink: int
    w: int

    @property
    def query_pos(self) -> np.ndarray:  # [sample, step], −1 past the committed steps
        return self.checked.small["query_pos"]

    @property
    def slack(self) -> float:
        """The relative error of the rows' format (``kvscope.storage.rowformat``; 0: exact)."""
        return RowFormat.of(self.checked.attrs).slack


def _rows(report: Report, ctx: Context, array: str, index, rows: np.ndarray, qpos: np.ndarray, shares=None) -> None:
    """Probability rows ``rows [a, b, pos]`` whose queries sit at ``qpos [a]`` (−1: no row),
    checked in the compiled pass every reader uses (``kvscope.analysis.kernels.block_stats``),
    with the tolerance of the store's row format; ``shares [a, b]``: their learned sink's."""
    from ..analysis.kernels import row_checks, row_totals, rows_problem

    problem = rows_problem(row_checks(rows, qpos, ctx.slack, row_totals(shares)))
    if problem is not None:
        report.add(array, index, problem)
    report.rows += int((qpos >= 0).sum()) * rows.shape[1]


def check_attn(report: Report, ctx: Context, index, origin, data: np.ndarray, shares=None) -> None:
    """Token rows ``[1, step, 1, Hs, pos]`` of one block of steps starting at ``origin[1]``
    (``shares [1, step, 1, Hs]``: their learned sink's)."""
    s, t0 = origin[0], origin[1]
    qpos = ctx.query_pos[s, t0 : t0 + data.shape[1]]  # [step]
    _rows(report, ctx, "attn", index, rows=data[0, :, 0], qpos=qpos, shares=None if shares is None else shares[0, :, 0])


def check_windows(report: Report, ctx: Context, index, origin, data: np.ndarray, sinks: np.ndarray, shares=None):
    """Window sums ``[1, step, 1, Hs, window]`` and sinks ``[…, sink]`` of one block of steps:
    together they are the row (``kvscope.windows.window_rows``), checked over units with the
    last existing unit standing in for the query position."""
    from ..windows import window_rows

    s, t0 = origin[0], origin[1]
    qpos = ctx.query_pos[s, t0 : t0 + data.shape[1]]  # [step]
    # rows [step, Hs, unit], last [step]
    rows, last = window_rows(data[0, :, 0], sinks[0, :, 0], qpos, n_sink=ctx.n_sink, w=ctx.w)
    _rows(report, ctx, "attn", index, rows=rows, qpos=last, shares=None if shares is None else shares[0, :, 0])


def check_tail(report: Report, ctx: Context, index, origin, data: np.ndarray, shares=None) -> None:
    """The last prefill rows ``[1, 1, Hs, obs, pos]`` of a sample and layer (``shares [1, 1, Hs,
    obs]``: their learned sink's)."""
    qpos = ctx.checked.small["prefill_tail_qpos"][index[0]]  # [obs]
    rows = np.moveaxis(data[0, 0], 1, 0)  # [obs, Hs, pos]
    _rows(report, ctx, "prefill_tail", index, rows=rows, qpos=qpos, shares=None if shares is None else shares[0, 0].T)


def check_colsum(report: Report, ctx: Context, index, origin, data: np.ndarray, sink_sum=None) -> None:
    """Column sums ``[1, 1, Hs, pos]``: finite ≥ 0 on the prompt, NaN beyond, adding up to P
    (less the learned sink's ``sink_sum [1, 1, Hs]`` over the prompt's rows)."""
    P = int(ctx.checked.prompt_len[index[0]])
    x = data[0, 0].astype(np.float64)  # [Hs, pos]
    prompt, rest = x[:, :P], x[:, P:]
    want = P - (0.0 if sink_sum is None else np.asarray(sink_sum[0, 0], dtype=np.float64))
    if not np.isfinite(prompt).all() or (prompt < 0).any():
        report.add("prefill_colsum", index, "non-finite or negative column sums on the prompt")
    elif not np.isnan(rest).all():
        report.add("prefill_colsum", index, "values beyond the prompt (must be NaN)")
    elif not np.all(np.abs(prompt.sum(-1) - want) <= 1e-4 * P + 1e-3):
        less = "" if sink_sum is None else ", less their learned sink's shares,"
        report.add("prefill_colsum", index, f"column sums do not add up to the {P} prompt rows{less}")


def check_learned(report: Report, ctx: Context, array: str, index, origin, data: np.ndarray, dims) -> None:
    """Learned sinks' shares: in [0, 1] where a row is, NaN where none (the prompt's sum in [0, P])."""
    s = index[0]
    if array == "prefill_learned_sink":
        P = int(ctx.checked.prompt_len[s])
        ok = np.isfinite(data).all() and (data >= 0).all() and (data <= P).all()
        if not ok:
            report.add(array, index, f"the sink's share summed over the prompt must lie in [0, {P}]")
        return
    if array == "attn_learned_sink":  # [1, step, 1, Hs]
        present = ctx.query_pos[s, origin[1] : origin[1] + data.shape[1]] >= 0  # [step]
        x = np.moveaxis(data[0, :, 0], 0, 0)  # [step, Hs]
    else:  # prefill_tail_learned_sink [1, 1, Hs, obs]
        present = ctx.checked.small["prefill_tail_qpos"][s] >= 0  # [obs]
        x = data[0, 0].T  # [obs, Hs]
    rows, rest = x[present], x[~present]
    if not (np.isfinite(rows).all() and (rows >= 0).all() and (rows <= 1).all()):
        report.add(array, index, "learned sink shares must lie in [0, 1] where a row is")
    elif not np.isnan(rest).all():
        report.add(array, index, "learned sink shares where no row is (must be NaN)")


def check_recorded(report: Report, ctx: Context, array: str, index, origin, data: np.ndarray, dims) -> None:
    """q/k/v ``[…, pos, …]``: finite on the recorded positions (``< P + committed − 1``), NaN beyond."""
    axis = dims.index("qpos" if "qpos" in dims else "pos")
    s = index[0]
    end = int(ctx.checked.prompt_len[s] + ctx.checked.committed[s] - 1)
    n_recorded = min(max(end - origin[axis], 0), data.shape[axis])  # positions are contiguous in a chunk
    x = np.moveaxis(data, axis, 0)  # a view
    if not _all_finite(x[:n_recorded]):
        report.add(array, index, "non-finite values on recorded positions")
    elif not _all_nan(x[n_recorded:]):
        report.add(array, index, "values on positions that were never recorded (must be NaN)")


def _all_finite(x: np.ndarray) -> bool:
    """``np.isfinite(x).all()``; for fp16 on the bits (exponent not all ones), ~10× faster."""
    if x.dtype == np.float16:
        return bool(((x.view(np.uint16) & 0x7C00) != 0x7C00).all())
    return bool(np.isfinite(x).all())


def _all_nan(x: np.ndarray) -> bool:
    """``np.isnan(x).all()``; for fp16 on the bits (exponent all ones, mantissa not zero)."""
    if x.dtype == np.float16:
        bits = x.view(np.uint16)
        return bool((((bits & 0x7C00) == 0x7C00) & ((bits & 0x03FF) != 0)).all())
    return bool(np.isnan(x).all())


def check_rope(report: Report, ctx: Context, array: str, index, origin, data: np.ndarray, dims) -> None:
    """Scalings finite and > 0; inverse frequencies finite and ≥ 0 (0: a channel pair the model
    leaves unrotated, as LFM3's full-attention layers do), NaN where a layer has fewer."""
    if array == "rope_inv_freq":
        x = data[np.isfinite(data)]
        bad = (x < 0).any() or x.size == 0
    else:
        bad = not np.isfinite(data).all() or (data <= 0).any()
    if bad:
        report.add(array, index, "rotary parameters must be finite (inverse frequencies ≥ 0, scalings > 0)")


def check_policy(report: Report, ctx: Context, array: str, index, origin, data: np.ndarray, dims) -> None:
    if array == "policy_tiers" and not valid_codes(data):
        report.add(array, index, "tier codes outside −1 (none), 0 EVICTED, 1 Q, 2 FP")
    elif array != "policy_tiers":
        c = int(ctx.checked.committed[index[0]])
        x = data[0, :c]
        if not np.isfinite(x).all() or (x < 0).any():
            report.add(array, index, "bytes must be finite and ≥ 0 on committed steps")


# -- the passes -------------------------------------------------------------------------------


def verify(path: str | os.PathLike, deep: bool = False, deep_rows: int = 64) -> Report:
    """The report of a trace store: every committed chunk read, checked, and its values tested
    (``kvscope verify``; the module docstring); a replay result's is
    ``kvscope.replay.check.verify_result``.

    Args:
        path: The store.
        deep: Also recompute rows of a sample of steps from the recorded q/k and compare.
        deep_rows: Rows recomputed with ``deep``.

    Returns:
        The problems found (none: ``report.ok``).
    """
    from .store import check_store, read_attrs

    started = time.perf_counter()
    report = Report(str(path), "trace")
    attrs = read_attrs(path)
    try:
        checked = check_store(path)
    except StoreError as exc:
        report.add("store", "-", str(exc))
        return report
    ctx = Context(checked, attrs["n_sink"], attrs["w"])
    check_consolidated(report, Path(path))
    _chunks(report, ctx)
    if deep and report.ok:
        _deep(report, checked, deep_rows)
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def check_consolidated(report: Report, path: Path) -> None:
    """The consolidated copy of the metadata (a complete store's ``zarr.json``) equals each
    array's own: kvscope reads the arrays' own, other readers (xarray's default) the copy."""
    from .integrity import read_json, read_metas

    copy = read_json(path / "zarr.json").get("consolidated_metadata")
    if copy is None:
        return
    entries = copy.get("metadata") if isinstance(copy, dict) else None
    if not isinstance(entries, dict):
        report.add("zarr.json", "-", "consolidated metadata is not an object of array metadata")
        return
    for name, meta in read_metas(path).items():
        if entries.get(name) != meta:
            report.add("zarr.json", "-", f"consolidated metadata of {name} differs from {name}/zarr.json")


def _required_blocks(rules, spec):
    """Block indices of ``spec`` that the committed steps need, in storage order."""
    grid = [math.ceil(n / c) for n, c in zip(spec.shape, spec.chunks, strict=True)]
    for index in itertools.product(*(range(g) for g in grid)):
        if rules.required(spec.name, index):
            yield index


ON_OPEN = ("tokens", "prompt_len", "n_steps", "query_pos", "token_id", "prefill_tail_qpos")
SLAB_BYTES = 64 * 2**20  # chunks read together (zarr decodes them concurrently), at most this much


def _slabs(rules, spec):
    """Runs of required blocks that differ only along one dim (the one with the most blocks after
    ``sample``), of at most ``SLAB_BYTES``: ``(first block index, dim, count)``."""
    grid = [math.ceil(n / c) for n, c in zip(spec.shape, spec.chunks, strict=True)]
    dim = max(range(1, len(grid)), key=lambda d: grid[d], default=0)
    per_chunk = math.prod(spec.chunks) * np.dtype(spec.dtype).itemsize
    run_max = max(1, SLAB_BYTES // per_chunk)
    runs: dict[tuple, list[int]] = {}
    for index in _required_blocks(rules, spec):
        runs.setdefault(index[:dim] + index[dim + 1 :], []).append(index[dim])
    for rest, along in runs.items():
        along.sort()
        start = 0
        for i in range(1, len(along) + 1):  # consecutive blocks, cut at run_max
            if i == len(along) or along[i] != along[i - 1] + 1 or i - start == run_max:
                yield rest[:dim] + (along[start],) + rest[dim:], dim, i - start
                start = i


def _chunks(report: Report, ctx: Context) -> None:
    """Every required chunk of every array read through the checked store, slab by slab (zarr
    decodes a slab's chunks concurrently), then each chunk's values — checked while the next
    slab is being read (one slab ahead: at most two in memory)."""
    from concurrent.futures import ThreadPoolExecutor

    import zarr

    checked = ctx.checked
    group = zarr.open_group(store=checked.store, mode="r", zarr_format=3, use_consolidated=False)
    specs = [s for s in schema(checked.layout)[1] if s.name not in ON_OPEN and s.name != "attn_sink"]  # sink: with attn
    names = [spec.name for spec in specs] + (["attn_sink"] if "attn_sink" in group else [])
    arrays = {name: group[name] for name in names}  # each opened once
    slabs = [
        (arrays[spec.name], spec, first, dim, count)
        for spec in specs
        for first, dim, count in _slabs(checked.store.rules, spec)
    ]
    with ThreadPoolExecutor(1, thread_name_prefix="kvscope-verify-read") as pool:
        ahead = pool.submit(_read_slab, *slabs[0]) if slabs else None
        for i, (_, spec, *_) in enumerate(slabs):
            blocks = ahead.result()
            ahead = pool.submit(_read_slab, *slabs[i + 1]) if i + 1 < len(slabs) else None
            for index, data in blocks:
                if isinstance(data, str):
                    report.add(spec.name, index, data)
                    continue
                report.chunks += 1
                _values(report, ctx, arrays, spec=spec, index=index, data=data)


def _read_slab(array, spec, first: tuple, dim: int, count: int) -> list[tuple[tuple, np.ndarray | str]]:
    """``(block index, data or what is wrong with it)`` of ``count`` blocks from ``first`` along
    ``dim``; a slab that fails is read again block by block, so that each bad chunk is named."""
    blocks = [first[:dim] + (first[dim] + i,) + first[dim + 1 :] for i in range(count)]
    selection = first[:dim] + (slice(first[dim], first[dim] + count),) + first[dim + 1 :]
    try:
        slab = array.get_block_selection(selection)
    except Exception:  # noqa: BLE001 - located below, chunk by chunk
        return [(index, _block_or_problem(array, index)) for index in blocks]
    size = spec.chunks[dim]
    return [(index, slab[(slice(None),) * dim + (slice(i * size, (i + 1) * size),)]) for i, index in enumerate(blocks)]


def _block_or_problem(array, index) -> np.ndarray | str:
    try:
        return array.get_block_selection(index)
    except DamagedStore as exc:
        return exc.problem
    except Exception as exc:  # noqa: BLE001 - a codec that cannot decode the chunk
        return f"cannot be decoded ({type(exc).__name__}: {str(exc)[:80]})"


def read_block(report: Report, array, name: str, index):
    """One block of ``array``, or None with its problem reported."""
    data = _block_or_problem(array, index)
    if isinstance(data, str):
        report.add(name, index, data)
        return None
    return data


def _values(report: Report, ctx: Context, arrays: dict, spec, index, data: np.ndarray) -> None:
    name = spec.name
    origin = tuple(i * c for i, c in zip(index, spec.chunks, strict=True))
    shares = _shares(arrays, name, index)
    if shares is _DAMAGED:
        return
    if name == "attn" and ctx.checked.attrs["resolution"] == "window":
        sinks = read_block(report, arrays["attn_sink"], "attn_sink", index)
        if sinks is not None:
            check_windows(report, ctx, index, origin=origin, data=data, sinks=sinks, shares=shares)
    elif name == "attn":
        check_attn(report, ctx, index, origin=origin, data=data, shares=shares)
    elif name == "prefill_tail":
        check_tail(report, ctx, index, origin=origin, data=data, shares=shares)
    elif name == "prefill_colsum":
        check_colsum(report, ctx, index, origin=origin, data=data, sink_sum=shares)
    elif name in LEARNED_SINKS.values():
        check_learned(report, ctx, name, index, origin=origin, data=data, dims=spec.dims)
    elif name in ("q", "k", "v"):
        check_recorded(report, ctx, name, index, origin=origin, data=data, dims=spec.dims)
    elif name.startswith("rope_"):
        check_rope(report, ctx, name, index, origin=origin, data=data, dims=spec.dims)
    elif name.startswith("policy_"):
        check_policy(report, ctx, name, index, origin=origin, data=data, dims=spec.dims)


# each row array and the array of its learned sink's shares (same chunks along their common dims)
LEARNED_SINKS = {
    "attn": "attn_learned_sink",
    "prefill_tail": "prefill_tail_learned_sink",
    "prefill_colsum": "prefill_learned_sink",
}
_DAMAGED = object()


def _shares(arrays: dict, name: str, index):
    """The learned sink's shares of the rows in chunk ``index`` of ``name`` (None without learned
    sinks; ``_DAMAGED`` when their own chunk cannot be read: its own pass reports it)."""
    partner = LEARNED_SINKS.get(name)
    if partner is None or partner not in arrays:
        return None
    block = _block_or_problem(arrays[partner], index[: len(arrays[partner].shape)])
    return _DAMAGED if isinstance(block, str) else block


def _deep(report: Report, checked, n_rows: int) -> None:
    """Rows of up to ``n_rows`` steps per sample recomputed from q/k (every layer) and compared
    with the stored ones (token resolution): max |Δ| within what the stored dtype allows."""
    from ..analysis.recompute import layer_rows
    from .store import open_trace

    if not checked.attrs["record_qkv"]:
        report.add("store", "-", "deep verification needs q/k/v (the trace was recorded without --record qkv)")
        return
    if checked.attrs["resolution"] != "token":
        return
    ds = open_trace(checked.path)
    model, heads = ds.kvscope.model, checked.attrs["heads"]
    tolerance = 0.05 if checked.attrs["dtype"] == "float16" else 1e-4  # q/k rounded to fp16 move the logits
    for s, c in enumerate(checked.committed):
        steps = np.unique(np.linspace(0, c - 1, min(n_rows, c)).astype(int)) if c else np.zeros(0, int)
        qpos = checked.small["query_pos"][s, steps]
        for layer in range(checked.layout.n_layers):
            q = ds["q"].isel(sample=s, layer=layer).values  # [qpos, head, D]
            k = ds["k"].isel(sample=s, layer=layer).values  # [key_head, pos, D]
            mode = "all" if heads == "all" else "kv"
            per_unit = model.n_key_heads // model.n_kv_heads
            again = layer_rows(q, k, qpos, model.rule(layer), heads=mode, per_unit=per_unit)[0, :, 0]
            if heads == "mean":
                again = again.mean(1, keepdims=True)
            stored = ds["attn"].isel(sample=s, layer=layer, step=steps).values.astype(np.float32)
            worst = np.nanmax(np.abs(np.nan_to_num(stored) - np.nan_to_num(again)))
            report.deep_rows += again.shape[0] * again.shape[1]
            if worst > tolerance:
                report.add("attn", (s, layer), f"rows differ from q/k by up to {worst:.3g} (tolerance {tolerance})")


def refuse_if_damaged(report: Report) -> None:
    """Turn a report into the one-line error of a command that needs a sound store."""
    if not report.ok:
        first = report.problems[0].line()
        more = f" (and {report.n_problems - 1} more: kvscope verify {report.path})" if report.n_problems > 1 else ""
        raise KvscopeError(f"{report.path}: {first}{more}")
