"""What a trace store must be before any number is read from it (docs/trace-format.md,
"Guarantees").

On open (``check_store``), in order, each failure one [`StoreError`][kvscope.errors.StoreError]
line naming what and where:

1. the group's attributes: types and ranges (status, committed steps per sample, heads,
   resolution, dtype, ``w``, sinks, observation window, block of steps, the model's sizes,
   the number of shards of a store written by shards);
2. every array of the schema that the attributes imply (``kvscope.storage.store.schema``): present,
   with its dims, dtype, shape, chunks, fill value, and a CRC32C checksum on every data array;
3. the small arrays that say which rows exist: coordinates are their indices, prompt lengths
   fit the store, ``n_steps`` equals the committed steps of a complete store, ``query_pos`` is
   ``P − 1 + t`` and ``token_id`` is ``tokens[P + t]`` for every committed step, token ids lie
   in the vocabulary.

Every read then goes through ``TraceStore``: a chunk is decoded only after its CRC32C
matched, and a chunk missing where the committed steps need it is an error, never fill
values. A failing chunk raises ``DamagedStore``, naming the array, the chunk and
``kvscope verify``. Values inside the rows (NaN where a probability belongs, probabilities
outside [0, 1], rows that do not sum to 1) are checked by the readers that decode them
(``kvscope.analysis.kernels``, replay's reader) and by ``kvscope verify``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from zarr.storage import LocalStore

from ..errors import JSONTooDeep, KvscopeError, StoreError, first_line, parse_json
from .rowformat import RowFormat
from .schema import Layout, schema

CRC_BYTES = 4


class DamagedStore(StoreError):
    """A chunk fails its checksum or is missing where committed steps need it."""

    def __init__(self, root, key: str, array: str, problem: str):
        self.root, self.key, self.array, self.problem = root, key, array, problem
        super().__init__(f"{root}: chunk {key} of array {array} {problem}; run kvscope verify {root}")

    def __reduce__(self):  # raised inside dask.distributed workers: pickled with its fields
        return type(self), (self.root, self.key, self.array, self.problem)


# -- 1. attributes --------------------------------------------------------------------------


def is_int(v, low: int = 0) -> bool:
    """``v`` is an integer (not a bool) ≥ ``low``."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def check_attrs(path, attrs) -> None:
    """Types and ranges of the attributes every reader relies on."""

    def need(ok: bool, name: str, want: str, value) -> None:
        if not ok:
            raise StoreError(f"{path}: attribute {name} must be {want} (got {value!r})")

    if not isinstance(attrs, dict):
        raise StoreError(f"{path}: the group's attributes are not a JSON object")
    need(attrs.get("status") in ("partial", "complete"), "status", "partial or complete", attrs.get("status"))
    need(attrs.get("heads") in ("all", "kv", "mean"), "heads", "all, kv or mean", attrs.get("heads"))
    need(attrs.get("resolution") in ("token", "window"), "resolution", "token or window", attrs.get("resolution"))
    need(attrs.get("dtype") in ("float16", "float32"), "dtype", "float16 or float32", attrs.get("dtype"))
    w = attrs.get("w")
    need(is_int(w, 4) and w % 4 == 0, "w", "a positive multiple of 4", w)
    for name, low in (("n_sink", 0), ("obs_window", 1), ("block_steps", 1)):
        need(is_int(attrs.get(name), low), name, f"an integer ≥ {low}", attrs.get(name))
    need(isinstance(attrs.get("record_qkv"), bool), "record_qkv", "true or false", attrs.get("record_qkv"))
    committed, done = attrs.get("steps_committed"), attrs.get("samples_done")
    need(
        isinstance(committed, list) and len(committed) > 0 and all(is_int(c) for c in committed),
        "steps_committed", "a list of counts ≥ 0, one per sample", committed,
    )  # fmt: skip
    if done is not None:
        ok = isinstance(done, list) and len(done) == len(committed) and all(isinstance(d, bool) for d in done)
        need(ok, "samples_done", f"a list of {len(committed)} true/false", done)
    model = attrs.get("model")
    config = model.get("config") if isinstance(model, dict) else None
    need(isinstance(config, dict), "model.config", "an object", config)
    for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim"):
        need(is_int(config.get(name), 1), f"model.config.{name}", "an integer ≥ 1", config.get(name))
    need(config["n_heads"] % config["n_kv_heads"] == 0, "model.config.n_heads", "a multiple of n_kv_heads", config)
    _check_geometry(config, need)
    vocab = config.get("vocab_size")
    need(vocab is None or is_int(vocab, 1), "model.config.vocab_size", "an integer ≥ 1", vocab)
    policy = attrs.get("policy")
    if policy is not None:
        need(isinstance(policy, dict) and is_int(policy.get("every"), 1), "policy.every", "an integer ≥ 1", policy)
    shards = attrs.get("shards")  # a store begun by trace --shard / --dask
    need(shards is None or is_int(shards, 1), "shards", "an integer ≥ 1", shards)
    for name in ("question_tokens", "continuation_tokens"):  # forced steps per sample
        counts = attrs.get(name)
        if counts is not None:
            ok = isinstance(counts, list) and len(counts) == len(committed) and all(is_int(c, 1) for c in counts)
            need(ok, name, f"a list of {len(committed)} counts ≥ 1", counts)
    try:
        RowFormat.of(attrs)
    except KvscopeError as exc:
        raise StoreError(f"{path}: {exc}") from None
    prompts = attrs.get("prompts")
    if prompts is not None:
        ok = isinstance(prompts, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in prompts)
        need(ok and len(prompts) == len(committed), "prompts", "one {text: …} per sample", prompts)


def group_attributes(path, noun: str) -> dict:
    """The attributes of the Zarr v3 group at ``path`` (a ``noun``, e.g. "trace store"), or
    one line saying why there is none."""
    p = Path(path)
    if not p.exists():
        raise StoreError(f"no {noun} at {p}")
    meta = p / "zarr.json"
    if not p.is_dir() or not meta.is_file():
        raise StoreError(f"{p} is not a Zarr v3 store (no zarr.json)")
    doc = read_json(meta)
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise StoreError(f"{p} is not a Zarr v3 group")
    attrs = doc.get("attributes")
    if not isinstance(attrs, dict):
        raise StoreError(f"{p}: the group's attributes are not a JSON object")
    return attrs


def read_json(meta: Path):
    """The JSON document in the metadata file ``meta`` (a ``zarr.json``), or one line naming it:
    unreadable, truncated or not JSON, or nested too deep to be read."""
    try:
        return parse_json(meta.read_bytes().decode("utf-8"))
    except JSONTooDeep:
        raise StoreError(f"{meta} nests its JSON too deep to be read") from None
    except (ValueError, OSError) as exc:  # ValueError: not JSON, not UTF-8
        raise StoreError(f"{meta} is unreadable or truncated ({exc.__class__.__name__})") from None


# -- 2. the schema --------------------------------------------------------------------------


def read_metas(path: Path) -> dict[str, dict]:
    """``{array: zarr.json}`` of every array in the group (unreadable ones refused)."""
    metas = {}
    for entry in sorted(os.listdir(path)):
        meta = path / entry / "zarr.json"
        if not meta.is_file():
            continue
        doc = read_json(meta)
        if not isinstance(doc, dict):
            raise StoreError(f"{path}/{entry}/zarr.json is not a JSON object")
        if doc.get("node_type") == "array":
            metas[entry] = doc
    return metas


def _fill(value):
    """A zarr.json fill value as a comparable number (NaN as the string "NaN")."""
    if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
        return float(value)
    return value


def _same_fill(a, b) -> bool:
    a, b = _fill(a), _fill(b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def check_array(
    path, name: str, meta: dict, shape, dims, dtype: str, chunks=None, fill=None, *, transpose=None, crc: bool = True
) -> None:
    """One array's metadata against what the schema says (one line naming the difference):
    its dims, shape, dtype, chunks and fill value, then how its chunks are encoded."""

    def differs(what: str, got, want) -> StoreError:
        return StoreError(f"{path}: array {name} has {what} {got}, the schema says {want}")

    if meta.get("dimension_names") != list(dims):
        raise differs("dims", meta.get("dimension_names"), list(dims))
    if meta.get("shape") != list(shape):
        raise differs("shape", meta.get("shape"), list(shape))
    if meta.get("data_type") != dtype:
        raise differs("dtype", meta.get("data_type"), dtype)
    grid_shape = chunk_shape(path, name, meta, len(shape))
    if chunks is not None and grid_shape != list(chunks):
        raise differs("chunks", grid_shape, list(chunks))
    if fill is not None and not _same_fill(meta.get("fill_value"), fill):
        raise differs("fill value", meta.get("fill_value"), fill)
    check_encoding(path, name, meta, transpose=transpose, crc=crc)


def chunk_shape(path, name: str, meta: dict, rank: int) -> list[int]:
    """The chunk shape of a regular chunk grid of ``rank`` positive integers (else one line)."""
    grid = meta.get("chunk_grid")
    shape = _config(grid).get("chunk_shape")
    regular = isinstance(grid, dict) and grid.get("name") == "regular"
    if not (regular and isinstance(shape, list) and len(shape) == rank and all(is_int(n, 1) for n in shape)):
        raise StoreError(f"{path}: array {name} has chunk grid {grid}, not a regular grid of {rank} chunk sizes")
    return shape


CODECS = ["bytes", "blosc", "crc32c"]  # kvscope.storage.store.compressors() after the bytes serializer


def check_encoding(path, name: str, meta: dict, transpose, crc: bool, attributes: frozenset = frozenset()) -> None:
    """How the chunks of one array decode: the codec pipeline kvscope writes (an optional
    transpose, little-endian bytes, blosc, CRC32C last) and nothing else that changes what a
    chunk decodes to — then zarr's own parse of the whole document. Blosc's settings are not
    compared: a blosc frame carries its own. ``attributes``: the array attributes allowed
    (their keys; xarray's ``coordinates`` and ``_FillValue`` in a replay result)."""
    codecs = meta.get("codecs")
    if not isinstance(codecs, list) or not all(isinstance(c, dict) for c in codecs):
        raise StoreError(f"{path}: array {name} has codecs {codecs!r}, not a list of codecs")
    names = [c.get("name") for c in codecs]
    want = (["transpose"] if transpose else []) + (CODECS if crc else ["bytes"])
    if crc and names[-1:] != ["crc32c"]:
        raise StoreError(f"{path}: array {name} carries no CRC32C checksum (codecs {names})")
    if names != want:
        raise StoreError(f"{path}: array {name} has codecs {names}, the schema says {want}")
    if transpose and _config(codecs[0]).get("order") != list(transpose):
        raise StoreError(f"{path}: array {name} has a transpose codec other than the schema's {list(transpose)}")
    endian = _config(codecs[names.index("bytes")]).get("endian", "little")
    if endian != "little":
        raise StoreError(f"{path}: array {name} has codec bytes with endian {endian!r}, the schema says 'little'")
    encoding = meta.get("chunk_key_encoding")
    if encoding != {"name": "default", "configuration": {"separator": "/"}}:
        raise StoreError(f"{path}: array {name} has chunk key encoding {encoding}, the schema says default with /")
    attrs = meta.get("attributes", {})
    if (
        not isinstance(attrs, dict)
        or not set(attrs) <= attributes
        or not all(isinstance(v, str) for v in attrs.values())
    ):
        raise StoreError(f"{path}: array {name} has attributes kvscope never writes ({attrs!r})")
    if meta.get("storage_transformers") not in (None, []):
        raise StoreError(f"{path}: array {name} has storage transformers kvscope never writes")
    _zarr_parses(path, name, meta)


def _config(part) -> dict:
    """The ``configuration`` object of a metadata part (a codec, the chunk grid), or {}."""
    config = part.get("configuration") if isinstance(part, dict) else None
    return config if isinstance(config, dict) else {}


def _zarr_parses(path, name: str, meta: dict) -> None:
    from zarr.core.metadata.v3 import ArrayV3Metadata

    try:
        ArrayV3Metadata.from_dict(dict(meta))
    except Exception as exc:  # noqa: BLE001 - whatever zarr refuses, one line
        raise StoreError(f"{path}: array {name} has metadata zarr cannot read ({first_line(exc)})") from None


def _check_geometry(config: dict, need) -> None:
    """The cache-geometry keys of a model config (``kvscope.model.spec.ModelSpec``), where given."""
    n_layers, n_heads = config["n_layers"], config["n_heads"]
    layers = config.get("attention_layers") or []
    ok = isinstance(layers, list) and all(is_int(x) for x in layers) and layers == sorted(set(layers))
    need(
        ok and len(layers) in (0, n_layers),
        "model.config.attention_layers",
        f"{n_layers} increasing layer indices",
        layers,
    )
    for name in ("key_heads", "v_head_dim", "kv_latent_dim", "model_layers"):
        need(
            config.get(name) is None or is_int(config.get(name), 1),
            f"model.config.{name}",
            "an integer ≥ 1",
            config.get(name),
        )
    windows = config.get("layer_windows") or []
    ok = isinstance(windows, list) and all(w is None or is_int(w, 1) for w in windows)
    need(ok, "model.config.layer_windows", "per layer null or a window ≥ 1", windows)
    sinks = config.get("learned_sinks") or []
    ok = isinstance(sinks, list) and all(
        s is None or (isinstance(s, list) and len(s) == n_heads and all(_finite(x) for x in s)) for s in sinks
    )
    need(ok, "model.config.learned_sinks", f"per layer null or {n_heads} finite numbers", "…")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def expected_layout(path, attrs: dict, metas: dict):
    """The ``Layout`` the attributes describe (positions from ``tokens``,
    steps from ``attn``: the schema then checks that every array agrees)."""
    for name in ("attn", "tokens"):
        if name not in metas:
            raise StoreError(f"{path} is missing arrays: {name}")
    attn, tokens = _shape(metas["attn"]), _shape(metas["tokens"])
    if len(attn) != 5 or len(tokens) != 2:
        shapes = metas["attn"].get("shape"), metas["tokens"].get("shape")
        raise StoreError(f"{path}: arrays attn {shapes[0]} and tokens {shapes[1]} do not have the shape of a trace")
    config = attrs["model"]["config"]
    rope = _shape(metas.get("rope_inv_freq", {})) or [0, 0]
    policy = attrs.get("policy")
    return Layout(
        n_samples=len(attrs["steps_committed"]), n_steps=attn[1], n_layers=config["n_layers"],
        n_heads=config["n_heads"], n_kv_heads=config["n_kv_heads"], head_dim=config["head_dim"],
        heads=attrs["heads"], resolution=attrs["resolution"], n_pos=tokens[1], obs_window=attrs["obs_window"],
        n_sink=attrs["n_sink"], window=attrs["w"], block_steps=attrs["block_steps"], record_qkv=attrs["record_qkv"],
        dtype=attrs["dtype"], rope_freqs=int(rope[1]) if attrs["record_qkv"] and len(rope) == 2 else 0,
        policy_events=len(range(0, attn[1], policy["every"])) if policy else 0, **Layout.geometry(config),
    )  # fmt: skip


def _shape(meta: dict) -> list[int]:
    """An array's shape if it is a list of positive integers, else []."""
    shape = meta.get("shape")
    return shape if isinstance(shape, list) and all(is_int(n, 1) for n in shape) else []


def check_schema(path, attrs: dict, metas: dict):
    """Every array of the schema present and as the schema says; returns the layout and specs."""
    layout = expected_layout(path, attrs, metas)
    if layout.block_steps > layout.n_steps:
        raise StoreError(f"{path}: attribute block_steps {layout.block_steps} exceeds the {layout.n_steps} steps")
    if any(c > layout.n_steps for c in attrs["steps_committed"]):
        raise StoreError(f"{path}: steps_committed {attrs['steps_committed']} outside 0..{layout.n_steps}")
    coords, arrays = schema(layout)
    missing = [a.name for a in arrays if a.name not in metas] + [n for n, _ in coords if n not in metas]
    if missing:
        raise StoreError(f"{path} is missing arrays: {', '.join(missing)}")
    for name, n in coords:
        check_array(path, name, metas[name], shape=(n,), dims=(name,), dtype="int32", crc=False)
    for a in arrays:
        check_array(
            path,
            a.name,
            metas[a.name],
            shape=a.shape,
            dims=a.dims,
            dtype=a.dtype,
            chunks=a.chunks,
            fill=a.fill,
            transpose=a.transpose,
        )
    return layout, arrays


# -- 3. the small arrays ----------------------------------------------------------------------

SMALL = ("prompt_len", "n_steps", "query_pos", "token_id", "tokens", "prefill_tail_qpos")


def check_small_arrays(path, attrs: dict, layout, arrays):
    """``(store, committed, prompt_len, small)``: a ``TraceStore`` with the committed
    region's rules, and the small arrays read through it and checked (module docstring, 3)."""
    import zarr

    committed = np.asarray(attrs["steps_committed"], dtype=np.int64)  # [sample]
    rules = ChunkRules.of(arrays, committed, attrs)
    store = TraceStore(path, rules=rules)
    group = zarr.open_group(store=store, mode="r", zarr_format=3, use_consolidated=False)
    for name, n in _coordinates(layout):
        want = layout.coordinate(name, n)
        if not np.array_equal(group[name][...], want):
            held = f"0..{n - 1}" if np.array_equal(want, np.arange(n)) else want.tolist()
            raise StoreError(f"{path}: coordinate array {name} does not hold {held}")
    small = {name: np.asarray(group[name][...]) for name in SMALL}
    prompt_len = small["prompt_len"].astype(np.int64)
    S, T = layout.n_steps, layout.n_pos
    if (prompt_len < 1).any() or (prompt_len + S > T).any() or prompt_len.max() + S != T:
        raise StoreError(f"{path}: prompt_len {prompt_len.tolist()} does not fit {T} positions and {S} steps")
    store.rules = rules.with_prompt_len(prompt_len)
    if attrs["status"] == "complete" and not np.array_equal(small["n_steps"], committed):
        raise StoreError(
            f"{path}: n_steps {small['n_steps'].tolist()} of a complete store ≠ steps_committed {committed.tolist()}"
        )
    _check_positions(path, small, committed, prompt_len=prompt_len, layout=layout, attrs=attrs)
    return store, committed, prompt_len, small


def _coordinates(layout):
    return schema(layout)[0]


def _check_positions(path, small: dict, committed, prompt_len, layout, attrs) -> None:
    """``query_pos``, ``token_id``, ``tokens`` and the tail rows' positions agree with the
    committed steps; uncommitted entries are set to −1 (nothing) in ``small``."""
    steps = np.arange(layout.n_steps)[None, :]  # [1, step]
    inside = steps < committed[:, None]  # [sample, step]
    want = prompt_len[:, None] - 1 + steps
    if (small["query_pos"][inside] != want[inside]).any():
        s, t = np.argwhere(inside & (small["query_pos"] != want))[0]
        raise StoreError(
            f"{path}: query_pos[{s}, {t}] is {small['query_pos'][s, t]}, not prompt_len − 1 + step = {want[s, t]}"
        )
    tokens = small["tokens"]
    vocab = attrs["model"]["config"].get("vocab_size")
    for s in range(len(committed)):
        ids = tokens[s, : prompt_len[s] + committed[s]]
        if (ids < 0).any() or (vocab and (ids >= vocab).any()):
            raise StoreError(f"{path}: tokens of sample {s} hold ids outside the vocabulary 0..{(vocab or 0) - 1}")
        if (small["token_id"][s, : committed[s]] != tokens[s, prompt_len[s] : prompt_len[s] + committed[s]]).any():
            raise StoreError(f"{path}: token_id of sample {s} disagrees with tokens after the prompt")
        obs = small["prefill_tail_qpos"][s]
        expected = np.arange(prompt_len[s] - len(obs), prompt_len[s])
        if committed[s] and not np.array_equal(obs, np.where(expected >= 0, expected, -1)):
            raise StoreError(f"{path}: prefill_tail_qpos of sample {s} is not the last {len(obs)} prompt positions")
    small["query_pos"] = np.where(inside, small["query_pos"], -1).astype(np.int32)
    small["token_id"] = np.where(inside, small["token_id"], -1).astype(np.int32)


# -- reading through checks -----------------------------------------------------------------


@dataclass(frozen=True)
class ChunkRules:
    """Which chunks of which arrays the committed steps need, and which carry a CRC32C.

    ``written`` per array (``kvscope.storage.store.ArraySpec.written``): ``static`` (always),
    ``sample`` (samples with a committed step), ``any`` (once any step is committed), ``steps``
    (blocks of committed steps), ``events`` (events at committed steps), ``positions`` (blocks
    of positions that have q/k/v: ``< P + committed − 1``)."""

    written: dict  # array → rule
    chunks: dict  # array → chunk shape
    dims: dict  # array → dims
    committed: tuple[int, ...]  # [sample]
    prompt_len: tuple[int, ...] | None  # [sample], known after the first read
    every: int  # steps between policy events
    crc: frozenset  # arrays whose chunks end with a CRC32C
    missing: str = "is missing inside the committed steps"  # the problem a missing required chunk is

    @classmethod
    def of(cls, arrays, committed, attrs: dict) -> ChunkRules:
        """The rules of the schema's ``arrays`` (every one of them carries a CRC32C)."""
        return cls(
            {a.name: a.written for a in arrays},
            {a.name: a.chunks for a in arrays},
            {a.name: a.dims for a in arrays},
            tuple(int(c) for c in committed),
            None,
            int((attrs.get("policy") or {}).get("every", 1)),
            frozenset(a.name for a in arrays),
        )

    @classmethod
    def every_chunk(cls, arrays) -> ChunkRules:
        """Every chunk of ``arrays`` required and checksummed (a replay result: written whole)."""
        return cls({a: "static" for a in arrays}, {}, {}, (), None, 1, frozenset(arrays), "is missing")

    def with_prompt_len(self, prompt_len) -> ChunkRules:
        from dataclasses import replace

        return replace(self, prompt_len=tuple(int(p) for p in prompt_len))

    def required(self, array: str, index: tuple[int, ...]) -> bool:
        rule = self.written.get(array, "unknown")
        if rule in ("static", "unknown"):
            return rule == "static"
        if rule == "any":
            return any(self.committed)
        if len(index) != len(self.dims[array]):
            return False
        at = dict(zip(self.dims[array], (i * c for i, c in zip(index, self.chunks[array])), strict=True))
        c = self.committed[at["sample"]] if at["sample"] < len(self.committed) else 0
        if rule == "sample" or c == 0:
            return c > 0
        if rule == "steps":
            return at["step"] < c
        if rule == "events":
            return at["event"] * self.every < c
        if self.prompt_len is None:  # positions before the prompt lengths are known: not required yet
            return False
        return at.get("qpos", at.get("pos")) < self.prompt_len[at["sample"]] + c - 1


class TraceStore(LocalStore):
    """A read-only ``zarr.storage.LocalStore`` that refuses damaged chunks (module docstring)."""

    def __init__(self, root, *, read_only: bool = True, rules: ChunkRules | None = None):
        super().__init__(root, read_only=True)
        self.rules = rules

    def with_read_only(self, read_only: bool = False):
        return type(self)(self.root, rules=self.rules)

    async def get(self, key, prototype=None, byte_range=None):
        buf = await super().get(key, prototype, byte_range)
        chunk = _chunk_of(key)
        if chunk is None or self.rules is None:
            return buf
        array, index = chunk
        if buf is None:
            if self.rules.required(array, index):
                raise DamagedStore(self.root, key, array, self.rules.missing)
            return None
        if byte_range is None and array in self.rules.crc and not crc_matches(buf.as_numpy_array()):
            raise DamagedStore(self.root, key, array, "fails its CRC32C checksum (damaged or truncated)")
        return buf


def _chunk_of(key: str) -> tuple[str, tuple[int, ...]] | None:
    """``attn/c/0/1/3/0/0`` → ``("attn", (0, 1, 3, 0, 0))``; None for metadata keys."""
    array, sep, rest = key.partition("/c/")
    if not sep or "/" in array:
        return None
    try:
        return array, tuple(int(x) for x in rest.split("/"))
    except ValueError:
        return None


def crc_matches(data) -> bool:
    """The last four bytes of ``data`` (uint8, any buffer) are the CRC32C (little endian) of the
    rest, as zarr's crc32c codec writes them."""
    import google_crc32c

    data = np.frombuffer(data, dtype=np.uint8)
    if data.size < CRC_BYTES:
        return False
    return google_crc32c.value(data[:-CRC_BYTES]) == int.from_bytes(data[-CRC_BYTES:].tobytes(), "little")
