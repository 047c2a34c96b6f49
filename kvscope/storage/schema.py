"""The trace store's schema (docs/trace-format.md#arrays): every array a store holds, with its
dims, dtype, shape, chunks and fill value, from the sizes of one store (``Layout``).
``kvscope.storage.store.create`` makes exactly these arrays; ``kvscope.storage.integrity`` checks a
store against them before anything is read."""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Layout:
    """Sizes of every dim of one store, and how arrays are chunked."""

    n_samples: int
    n_steps: int  # max_new_tokens
    n_layers: int
    n_heads: int  # query heads of the model
    n_kv_heads: int
    head_dim: int
    heads: str  # all | kv | mean
    resolution: str  # token | window
    n_pos: int  # T = max prompt length + max_new_tokens
    obs_window: int
    n_sink: int
    window: int
    block_steps: int
    record_qkv: bool
    dtype: str  # float16 | float32
    rope_freqs: int = 0
    policy_events: int = 0  # > 0: traced under a live policy cache (tier snapshots)
    # the cache geometry (kvscope.model.spec): defaults are a GQA model whose every layer attends
    key_heads: int = 0  # heads of the recorded k/v (0: n_kv_heads; MLA: every query head)
    v_dim: int = 0  # values per value head (0: head_dim)
    learned_sinks: bool = False  # the sink's share of every row is stored beside it
    layer_index: tuple[int, ...] = ()  # the model's index of each stored layer (() = 0..n_layers−1)
    from_weights: bool = False  # rows from the model's output_attentions (it attends in its own modules)

    @classmethod
    def geometry(cls, config: dict) -> dict:
        """The geometry fields of a layout from a store's model config (``ModelSpec.config``)."""
        n_kv = config["n_kv_heads"]
        key_heads = config.get("key_heads") or n_kv
        return {
            "key_heads": 0 if key_heads == n_kv else key_heads,
            "v_dim": config.get("v_head_dim") or 0,
            "learned_sinks": any(s is not None for s in config.get("learned_sinks") or ()),
            "layer_index": tuple(config.get("attention_layers") or ()),
            "from_weights": config.get("capture") == "output_attentions",
        }

    @property
    def n_key_heads(self) -> int:
        return self.key_heads or self.n_kv_heads

    @property
    def key_head_dim_name(self) -> str:
        """The head dim of k/v: ``kv_head``, or ``head`` where every query head has its own (MLA)."""
        return "kv_head" if self.n_key_heads == self.n_kv_heads else "head"

    def coordinate(self, name: str, n: int):
        """The values of coordinate ``name`` (``n`` long): the model's layer indices for ``layer``,
        else ``0..n−1``."""
        import numpy as np

        if name == "layer" and self.layer_index:
            return np.asarray(self.layer_index, dtype=np.int32)
        return np.arange(n, dtype=np.int32)

    @property
    def head_dim_name(self) -> str:
        return "kv_head" if self.heads == "kv" else "head"

    @property
    def n_stored_heads(self) -> int:
        return {"all": self.n_heads, "kv": self.n_kv_heads, "mean": 1}[self.heads]

    @property
    def n_windows(self) -> int:
        return max(0, -(-(self.n_pos - self.n_sink) // self.window))

    @property
    def pos_block(self) -> int:
        return 256


@dataclass(frozen=True)
class ArraySpec:
    """One array of the schema: what ``create`` makes and what a reader may expect."""

    name: str
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    dtype: str
    chunks: tuple[int, ...]
    fill: float | int
    written: str  # which chunks exist once steps are committed (kvscope.storage.integrity.ChunkRules)

    @property
    def transpose(self) -> tuple[int, ...] | None:
        """The order of the transpose codec that lays each chunk out with ``step`` fastest
        (arrays of rows: the same key's value at consecutive steps side by side, which
        bit-shuffle compresses better); None for arrays stored as they are."""
        if "step" not in self.dims or len(self.dims) <= 2:
            return None
        return (*(i for i, d in enumerate(self.dims) if d != "step"), self.dims.index("step"))


def _spec(name, dims, dtype, sizes: dict, *, chunks: dict, written: str, fill=float("nan")) -> ArraySpec:
    """An array over ``dims`` whose chunk is the whole dim except where ``chunks`` says."""
    return ArraySpec(
        name=name,
        shape=tuple(sizes[d] for d in dims),
        dims=dims,
        dtype=dtype,
        chunks=tuple(max(1, chunks.get(d, sizes[d])) for d in dims),
        fill=fill,
        written=written,
    )


def schema(L: Layout) -> tuple[list[tuple[str, int]], list[ArraySpec]]:
    """``(coordinates, arrays)`` of a store with layout ``L`` (docs/trace-format.md#arrays; the module docstring).
    Rows and prefill arrays are chunked per sample, block of steps and layer; q/k/v per
    sample, layer and block of positions."""
    hs, f = L.head_dim_name, L.dtype
    sizes = {
        "sample": L.n_samples, "step": L.n_steps, "layer": L.n_layers, "pos": L.n_pos, "obs": L.obs_window,
        "window": L.n_windows, "sink": L.n_sink, "qpos": L.n_pos, "head": L.n_heads, "kv_head": L.n_kv_heads,
        "dim": L.head_dim, "vdim": L.v_dim, "rope_freq": L.rope_freqs, "event": L.policy_events,
        hs: L.n_stored_heads,  # the stored head dim (one "head" for --heads mean)
    }  # fmt: skip
    rows = {"sample": 1, "step": L.block_steps, "layer": 1}
    per_layer = {"sample": 1, "layer": 1}
    per_sample = {"sample": 1}
    coords = ["sample", "step", "layer", hs, "pos", "obs"]
    last = "pos" if L.resolution == "token" else "window"
    arrays = [_spec("attn", ("sample", "step", "layer", hs, last), f, sizes, chunks=rows, written="steps")]
    if L.resolution == "window":
        coords += ["window", "sink"]
        arrays.append(
            _spec("attn_sink", ("sample", "step", "layer", hs, "sink"), f, sizes, chunks=rows, written="steps")
        )
    arrays += [
        _spec("prefill_colsum", ("sample", "layer", hs, "pos"), "float32", sizes, chunks=per_layer, written="sample"),
        _spec("prefill_tail", ("sample", "layer", hs, "obs", "pos"), f, sizes, chunks=per_layer, written="sample"),
        _spec("prefill_tail_qpos", ("sample", "obs"), "int32", sizes, chunks=per_sample, written="sample", fill=-1),
        *_sink_arrays(L, hs, sizes, rows=rows, per_layer=per_layer),
        _spec("tokens", ("sample", "pos"), "int32", sizes, chunks=per_sample, written="static", fill=-1),
        _spec("prompt_len", ("sample",), "int32", sizes, chunks={}, written="static", fill=0),
        _spec("n_steps", ("sample",), "int32", sizes, chunks={}, written="any", fill=0),
        _spec("query_pos", ("sample", "step"), "int32", sizes, chunks=per_sample, written="sample", fill=-1),
        _spec("token_id", ("sample", "step"), "int32", sizes, chunks=per_sample, written="sample", fill=-1),
    ]
    if L.record_qkv:
        kh, vd = L.key_head_dim_name, "vdim" if L.v_dim else "dim"
        coords += ["qpos"] + [d for d in ("head", "kv_head") if d != hs] + ["dim"] + (["vdim"] if L.v_dim else [])
        coords += ["rope_freq"]
        pb = L.pos_block
        q_chunks, kv_chunks = {"sample": 1, "qpos": pb, "layer": 1}, {"sample": 1, "layer": 1, "pos": pb}
        arrays += [
            _spec("q", ("sample", "qpos", "layer", "head", "dim"), f, sizes, chunks=q_chunks, written="positions"),
            _spec("k", ("sample", "layer", kh, "pos", "dim"), f, sizes, chunks=kv_chunks, written="positions"),
            _spec("v", ("sample", "layer", kh, "pos", vd), f, sizes, chunks=kv_chunks, written="positions"),
            _spec("rope_inv_freq", ("layer", "rope_freq"), "float32", sizes, chunks={}, written="static"),
            _spec("rope_attention_scaling", ("layer",), "float32", sizes, chunks={}, written="static"),
        ]
    if L.policy_events:
        coords += ["event"] + (["kv_head"] if hs != "kv_head" and not L.record_qkv else [])
        tiers = ("sample", "event", "layer", "kv_head", "pos")
        arrays += [
            _spec("policy_tiers", tiers, "int8", sizes, chunks={"sample": 1, "event": 1}, written="events", fill=-1),
            _spec("policy_bytes", ("sample", "step"), "float64", sizes, chunks=per_sample, written="sample"),
            _spec(
                "policy_cache_bytes", ("sample", "step"), "int64", sizes, chunks=per_sample, written="sample", fill=-1
            ),
        ]
    return [(name, sizes[name]) for name in coords], arrays


def _sink_arrays(L: Layout, hs: str, sizes: dict, rows: dict, per_layer: dict) -> list[ArraySpec]:
    """A model with learned sinks: the sink's share ``σ`` of every stored row (``1 − Σ row``, in
    float32: each row of ``attn`` and ``prefill_tail`` sums to ``1 − σ``) and, beside the column
    sums, ``Σ σ`` over the prompt's rows (the column sums then add up to ``P − Σ σ``)."""
    if not L.learned_sinks:
        return []
    return [
        _spec("attn_learned_sink", ("sample", "step", "layer", hs), "float32", sizes, chunks=rows, written="steps"),
        _spec("prefill_learned_sink", ("sample", "layer", hs), "float32", sizes, chunks=per_layer, written="sample"),
        _spec(
            "prefill_tail_learned_sink",
            ("sample", "layer", hs, "obs"),
            "float32",
            sizes,
            chunks=per_layer,
            written="sample",
        ),
    ]


CHUNK_OVERHEAD = 32  # bytes a chunk may take beyond its data: blosc's header (16 at most), the CRC32C (4)
METADATA_BYTES = 2048  # an array's zarr.json, at most (the group's also holds the prompts)


def on_disk(n: int, block: int = 1) -> int:
    """``n`` bytes of a file rounded up to whole blocks of ``block`` bytes (the file system's allocation unit)."""
    return -(-n // block) * block


def chunked_bytes(shape, chunks, itemsize: int, block: int = 1) -> int:
    """The most an array of ``shape`` in ``chunks`` takes on disk, every chunk written uncompressed
    (``on_disk``, with its ``CHUNK_OVERHEAD``)."""
    import math

    n_chunks = math.prod(-(-n // c) for n, c in zip(shape, chunks, strict=True))
    return n_chunks * on_disk(math.prod(chunks) * itemsize + CHUNK_OVERHEAD, block)


def store_bytes(layout: Layout, block: int = 1) -> int:
    """The most a store with ``layout`` takes on disk: every chunk of every array uncompressed
    (compression shrinks attention rows about twofold) in whole blocks of ``block`` bytes, and
    the arrays' metadata."""
    import numpy as np

    coords, arrays = schema(layout)
    total = sum(chunked_bytes((n,), (n,), 4, block) for _, n in coords)
    total += sum(chunked_bytes(a.shape, a.chunks, np.dtype(a.dtype).itemsize, block) for a in arrays)
    return total + (len(coords) + len(arrays) + 1) * on_disk(METADATA_BYTES, block)
