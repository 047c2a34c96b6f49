"""``kvscope.trace``: decode prompts with attention capture and write a trace store.

    trace(prompts, "out.zarr", max_new_tokens=64)           load the model, then trace_loaded
    trace_loaded(model, tokenizer, source, prompts, out=out, settings=s)  with a model already loaded

The store is created under a temporary name and renamed into place (``out`` is either absent
or an openable store); the decode loop (``kvscope.tracing.decode``) hands blocks of steps
to a background writer that commits each block once it is durable. ``resume=True`` continues
a partial store made with the same settings.

``shard=Shard(i, n)`` (``trace --shard i/n``) decodes only the batches of shard ``i``
(``kvscope.tracing.shard``) into a store that ``n`` shards write together: the first shard
to arrive creates it (under a temporary name, renamed into place: a shard that loses the race
opens the winner's), every shard commits its own samples, and the shard that commits the last
sample marks the store complete (``finalize`` does it later if that shard died first).

A *cache factory* (``cache=``) decides the KV cache each batch decodes with: by default a
cache the model makes itself (a ``DynamicCache`` for most); ``kvscope.live.LivePolicy`` makes a recording policy cache, whose
tiers and bytes are written with each block (``trace --policy``). A factory is called as
``factory(model, layout, batch)`` (``batch``: the sample indices it decodes) and has ``settings()`` (compared on resume) and ``describe(model)``.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .. import __version__
from ..errors import KvscopeError, StoreError, first_line
from ..model.loading import ModelSource, load, load_tokenizer, resolve
from ..model.prompts import (
    Prompt,
    as_prompts,
    check_context,
    continuations,
    encode_continuations,
    encode_prompts,
    eos_ids,
    with_continuations,
)
from ..model.rope import Rope
from ..model.spec import ModelSpec
from ..storage.integrity import is_int
from ..storage.paths import block_size, disk_full, no_space, output_path
from ..storage.schema import SCHEMA_VERSION, Layout, store_bytes
from ..storage.store import check_store, consolidate, create, read_attrs
from .architecture import inspect
from .capture import implementation_name, register
from .decode import decode_all
from .settings import TraceSettings
from .shard import Shard, batches, owner
from .staging import HostStaging
from .writer import StoreLock, StoreWriter, commit_lock


def check_kernel(settings: TraceSettings, spec: ModelSpec, encoded: list[list[int]], mine: list[list[int]]) -> None:
    """Capture sees what a kernel attends to through transformers' mask. flash_attention_2 is
    handed none that says it — a 2D padding mask, the sliding window as a layer parameter — so
    kvscope traces with it only where no mask is needed: no sliding-window layer, and in each
    of the batches ``mine`` prompts of one length (no left padding)."""
    if settings.attn != "flash_attention_2":
        return
    if not spec.global_only:
        raise KvscopeError(
            "--attn flash_attention_2: capture cannot see this model's sliding windows through that kernel; "
            "trace it with --attn sdpa"
        )
    for batch in mine:
        if len({len(encoded[s]) for s in batch}) > 1:
            raise KvscopeError(
                f"--attn flash_attention_2 with --batch-size {settings.batch_size}: the prompts of samples "
                f"{batch[0]}–{batch[-1]} differ in length, and capture cannot see their padding through that "
                "kernel; use --batch-size 1 or --attn sdpa"
            )


def check_cache(settings: TraceSettings, cache) -> None:
    """What a recording cache (``trace --policy``) needs of the trace."""
    if cache is None:
        return
    if settings.batch_size != 1:
        raise KvscopeError("--policy decodes one sample at a time (--batch-size 1)")
    if settings.resolution != "token":
        raise KvscopeError("--policy records token-resolution rows (--resolution token)")


@dataclass
class Progress:
    """What a progress callback receives after every decode step.

    Attributes:
        steps_done: Decode steps done so far (all samples).
        steps_total: Decode steps at most.
        tokens_per_s: Decoded tokens per second so far.
        bytes_written: Bytes written to the store so far.
    """

    steps_done: int
    steps_total: int
    tokens_per_s: float
    bytes_written: int


@dataclass
class Waits:
    """The decode loop's waits on the way out of the device.

    Attributes:
        writer_s: Seconds it waited for the writer (back-pressure: a block was still queued when
            the next was handed over).
        writer_times: How many times it waited for the writer.
        copies_s: Seconds it waited for the rows' copies off the device, at each block's hand-over.
    """

    writer_s: float = 0.0
    writer_times: int = 0
    copies_s: float = 0.0


@dataclass
class TraceResult:
    """What a trace decoded.

    Attributes:
        path: The store.
        n_samples: The store's samples.
        steps: Decode steps of each sample decoded here.
        seconds: Wall time.
        bytes_written: Bytes written to the store.
        texts: The generated text of each sample decoded here.
        samples: The samples decoded here (all of the store's, or a shard's).
        complete: The store is complete now.
        waits: Where the decode loop waited on the way out of the device (``Waits``).
    """

    path: Path
    n_samples: int
    steps: list[int]
    seconds: float
    bytes_written: int
    texts: list[str] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    complete: bool = True
    waits: Waits = field(default_factory=Waits)


def trace(
    prompts: list[Prompt] | list[str] | str,
    out: str | Path,
    settings: TraceSettings | None = None,
    *,
    resume: bool = False,
    force: bool = False,
    progress: Callable[[Progress], None] | None = None,
    cache=None,
    shard: Shard | None = None,
    continuation: str | list[str] | None = None,
    **overrides,
) -> TraceResult:
    """Decode ``prompts`` with attention capture and write a trace store at ``out``.

    ``overrides`` set fields of [`TraceSettings`][kvscope.TraceSettings] (e.g. ``max_new_tokens=64``);
    ``cache``: a cache factory; ``shard``: decode that shard's samples only (module docstring);
    ``continuation``: a text (one prompt) or one per prompt, forced as the decode steps instead
    of the model's own tokens (``Prompt.continuation``; ``check_continuations``)."""
    settings = settings or TraceSettings()
    for key, value in overrides.items():
        if not hasattr(settings, key):
            raise KvscopeError(f"unknown trace setting {key!r}")
        setattr(settings, key, value)
    settings.check()
    check_cache(settings, cache)
    prompts = with_continuations(as_prompts(prompts), continuation)
    out = output_path(out, "--out")
    source = resolve(settings.model)
    check_continuations(settings, prompts, source=source)
    doc = settings_doc(settings, source, prompts, cache)
    prepare_out(out, doc, resume, force, shard=shard)  # refuse early, before loading
    model, tokenizer = load(source, settings.device, settings.model_dtype, settings.trust_remote_code)
    return trace_loaded(
        model, tokenizer, source, prompts, out=out, settings=settings, resume=resume, force=force, progress=progress,
        cache=cache, shard=shard,
    )  # fmt: skip


def check_continuations(settings: TraceSettings, prompts: list[Prompt], tokenizer=None, source=None) -> None:
    """Prompts with given continuations or answers (every prompt or none) are decoded greedily —
    nothing is sampled, every step is forced — and ``max_new_tokens=None`` becomes the longest
    continuation's (or gold answer's) tokens (with ``tokenizer``, else the model's, loaded
    alone); None without continuations is refused. Gold answers are tokenized here, before
    anything is loaded or written: one that cannot be split from its answer prefix, or that is
    longer than ``max_new_tokens``, is refused."""
    if continuations(prompts) is None:
        if settings.max_new_tokens is None:
            raise KvscopeError("--max-new-tokens is required (it may be left out only with given continuations)")
        return
    if settings.temperature > 0:
        raise KvscopeError(
            "a given continuation forces every decode step and nothing is sampled: --temperature must be 0"
        )
    if settings.max_new_tokens is None or any(p.answers is not None for p in prompts):
        tokenizer = tokenizer or load_tokenizer(source or resolve(settings.model), settings.trust_remote_code)
        forced = encode_continuations(tokenizer, prompts, settings.max_new_tokens)
        if settings.max_new_tokens is None:
            settings.max_new_tokens = max(map(len, forced))


def settings_doc(settings: TraceSettings, source, prompts: list[Prompt], cache) -> dict:
    return {
        **asdict(settings),
        "cache": cache.settings() if cache is not None else None,
        "model_sha256": source.weights_sha256,
        "prompts": [p.text for p in prompts],
        "continuations": continuations(prompts),
    }


def check_out(out: str | Path, force: bool, flag: str = "--out") -> None:
    """Refuse now, before a model is loaded, an ``out`` where a new trace may not be written
    (``flag`` names the option in messages)."""
    prepare_out(Path(out), {}, resume=False, force=force, flag=flag)


def prepare_out(
    out: Path, settings_doc: dict, resume: bool, force: bool, flag: str = "--out", shard: Shard | None = None
) -> dict | None:
    """Decide what to do with ``out``; returns the existing attrs when resuming (or when
    ``shard`` joins a store another shard created)."""
    if shard is not None and force:
        raise KvscopeError("--force cannot go with --shard: it would remove the other shards' samples")
    if out.is_symlink():
        raise KvscopeError(f"{flag} {out} is a symbolic link; kvscope writes a store only at its real path")
    if not out.exists():
        if resume:
            raise KvscopeError(f"--resume: no store at {out}")
        return None
    if StoreLock.held_by_other(out, shared=shard is not None):
        raise StoreError(f"{out} is being written by another kvscope process")
    if not (out / "zarr.json").is_file():
        if out.is_dir() and not any(out.iterdir()):
            return None
        raise KvscopeError(f"{flag} {out} exists and is not a kvscope store; refusing to overwrite it")
    attrs = read_attrs(out)
    status = attrs.get("status")
    if force:
        return None
    if shard is not None:
        return _join(out, attrs, settings_doc=settings_doc, resume=resume, shard=shard)
    if resume:
        if status == "complete":
            raise KvscopeError(f"{out} is already complete; nothing to resume")
        _same_settings(out, attrs, settings_doc, "--resume")
        return attrs
    if status == "complete":
        raise KvscopeError(f"{flag} {out} holds a complete trace; pass --force to overwrite it or choose another path")
    raise KvscopeError(f"{flag} {out} holds a partial trace; pass --resume to continue it or --force to start over")


def _same_settings(out: Path, attrs: dict, settings_doc: dict, flag: str) -> None:
    """The store passes its checks and was traced with exactly ``settings_doc`` — but for the
    index of a CUDA device: shards run on ``cuda:0``, ``cuda:1``, …, and a resumed trace may
    continue on another GPU (it checks the tokens it regenerates). A setting the store does not
    name was added to kvscope after it was written: the store was traced with its default."""
    check_store(out)
    theirs = _device_kind({**asdict(TraceSettings()), **attrs.get("settings", {})})
    ours = _device_kind(settings_doc)
    diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    if diff:
        raise KvscopeError(f"{flag}: {out} was traced with different {', '.join(diff)}")


def _device_kind(doc: dict) -> dict:
    """``doc`` with its ``device`` as ``cpu`` or ``cuda`` (no index)."""
    device = doc.get("device")
    return {**doc, "device": device.split(":")[0]} if isinstance(device, str) else doc


def _join(out: Path, attrs: dict, *, settings_doc: dict, resume: bool, shard: Shard) -> dict:
    """The attrs of the partial store that ``shard`` joins: made for as many shards, with the
    same settings, and none of the shard's samples begun unless ``resume``."""
    flag = f"--shard {shard.label}"
    if attrs.get("status") == "complete":
        raise KvscopeError(f"{flag}: {out} is already complete")
    if attrs.get("shards") != shard.count:
        made = f"{attrs['shards']} shards" if "shards" in attrs else "a single process (no --shard)"
        raise KvscopeError(f"{flag}: {out} was begun by {made}; every shard of a store has the same n")
    _same_settings(out, attrs, settings_doc, flag)
    mine = shard.samples(len(attrs["steps_committed"]), settings_doc["batch_size"])
    begun = [s for s in mine if attrs["steps_committed"][s] > 0]
    if begun and not resume:
        raise KvscopeError(
            f"{flag}: {out} holds committed steps of its sample(s) {_listed(begun)}; pass --resume to continue them"
        )
    return attrs


def _listed(samples: list[int], at_most: int = 10) -> str:
    more = f" and {len(samples) - at_most} more" if len(samples) > at_most else ""
    return ", ".join(map(str, samples[:at_most])) + more


def trace_loaded(
    model,
    tokenizer,
    source: ModelSource,
    prompts: list[Prompt],
    out: Path,
    settings: TraceSettings,
    *,
    resume: bool = False,
    force: bool = False,
    progress: Callable[[Progress], None] | None = None,
    cache=None,
    shard: Shard | None = None,
) -> TraceResult:
    """``trace`` with a model that is already loaded (benchmarks reuse one model)."""
    started = time.perf_counter()
    out = Path(out)
    check_cache(settings, cache)
    check_continuations(settings, prompts, tokenizer)
    doc = settings_doc(settings, source, prompts, cache)
    existing = prepare_out(out, doc, resume, force, shard=shard)
    spec = traced_spec(model, settings.attn, settings.record_qkv)
    encoded, questions = encode_prompts(tokenizer, prompts, settings.chat, settings.question_agnostic)
    forced = encode_continuations(tokenizer, prompts, settings.max_new_tokens)
    check_context(
        encoded, settings.max_new_tokens, spec.max_position_embeddings, questions=questions, forced=forced,
        prompts=prompts,
    )  # fmt: skip
    mine = batches(len(encoded), settings.batch_size, shard)
    check_kernel(settings, spec, encoded, mine)
    if cache is not None and hasattr(cache, "check_model"):
        cache.check_model(model, spec)
    rope = Rope.from_model(model, spec.layer_index) if settings.record_qkv else None
    layout = _layout(settings, spec, encoded, rope=rope, cache=cache, S=_n_steps(settings, questions, forced))
    locks, create = None, None
    if existing is None:
        attrs = _store_attrs(
            source, spec, model, tokenizer=tokenizer, settings=settings, layout=layout, prompts=prompts,
            settings_doc=doc, cache=cache,
        )  # fmt: skip
        if settings.question_agnostic:
            attrs["question_tokens"] = [len(q) for q in questions]
        if forced is not None:
            attrs["continuation_tokens"] = [len(c) for c in forced]
        if shard is not None:
            attrs["shards"] = shard.count
            locks = _create_store(out, layout, attrs, encoded=encoded, rope=rope, shard=shard)
            if locks is None:  # another shard created the store first: join it
                existing = prepare_out(out, doc, resume, force, shard=shard)
        else:  # one process's new store: the writer creates it while the prompt prefills
            locks = []

            def create():
                return _create_store(out, layout, attrs, encoded=encoded, rope=rope)

    if locks is None:
        locks = _writer_locks(out, shard)
        existing = read_attrs(out) if shard is not None else existing  # read again under the locks
    committed = list(existing["steps_committed"]) if existing is not None else [0] * len(prompts)
    done = list(existing["samples_done"]) if existing is not None else [False] * len(prompts)
    writer = None
    try:
        writer = StoreWriter(out, committed, done, shared=shard is not None, create=create)
        eos = set(eos_ids(model, tokenizer)) if settings.stop_at_eos else set()

        def on_step(done_steps: int, total: int, tokens: int, seconds: float) -> None:
            if progress is not None:
                progress(Progress(done_steps, total, tokens / seconds if seconds > 0 else 0.0, writer.bytes_written))

        staging = HostStaging(settings.device)
        decode_all(
            model, encoded, mine, layout=layout, settings=settings, writer=writer, cache_factory=cache or _model_cache,
            eos=eos, progress=on_step, questions=questions, continuations=forced, staging=staging,
        )  # fmt: skip
        writer.close()
        complete = _complete(out) if shard is None else _complete_if_done(out)
        samples = [s for batch in mine for s in batch]
        texts, steps = _texts(out, tokenizer, [len(q) for q in questions], samples)
        seconds = time.perf_counter() - started
        waits = Waits(writer.waited_s, writer.waits, staging.waited_s)
        return TraceResult(
            path=out, n_samples=len(encoded), steps=steps, seconds=seconds, bytes_written=writer.bytes_written,
            texts=texts, samples=samples, complete=complete, waits=waits,
        )  # fmt: skip
    except BaseException as exc:
        if existing is None and shard is None:
            _discard_uncommitted(out, writer)
        elif writer is not None:
            writer.abandon()  # the blocks already handed over are written and committed
        if disk_full(exc):
            raise _no_space(out, layout) from exc
        raise
    finally:
        for lock in reversed(locks + (writer.locks if writer is not None else [])):
            lock.release()


def traced_spec(model, attn: str, record_qkv: bool = False) -> ModelSpec:
    """Route ``model``'s attention through kvscope's function for kernel ``attn`` and return the
    spec of what it computes (``kvscope.tracing.architecture.inspect``: refused in one line
    where kvscope cannot trace it exactly)."""
    register()
    name = (model.config.architectures or [type(model).__name__])[0]
    try:
        model.set_attn_implementation(implementation_name(attn))
    except (ValueError, NotImplementedError) as exc:
        raise KvscopeError(f"{name} does not take a custom attention function: {first_line(exc)}") from None
    return inspect(model, attn, record_qkv)


def _writer_locks(out: Path, shard: Shard | None) -> list[StoreLock]:
    """The locks a writer of an existing store holds: the store's (exclusive; shared by shards)
    and a shard's own (module docstring of ``kvscope.tracing.writer``)."""
    if shard is None:
        return [StoreLock(out).acquire()]
    store = StoreLock(out, shared=True).acquire()
    try:
        return [store, StoreLock(out, shard.lock_name).acquire()]
    except StoreError:
        store.release()
        raise StoreError(f"shard {shard.label} of {out} is being written by another kvscope process") from None


def finalize(out: str | Path) -> bool:
    """Mark a partial store whose samples are all done complete (what the shard that commits
    the last sample does itself); False if it was complete already. A sample not done is one
    line naming it (and its shard)."""
    out = Path(out)
    checked = check_store(out)
    if checked.attrs["status"] == "complete":
        return False
    if StoreLock.held_by_other(out, shared=True):
        raise StoreError(f"{out} is being written by another kvscope process")
    _refuse_undone(out, checked.attrs)
    return _complete_if_done(out)


def _refuse_undone(out: Path, attrs: dict) -> None:
    done = attrs.get("samples_done") or [False] * len(attrs["steps_committed"])
    undone = [s for s, d in enumerate(done) if not d]
    if not undone:
        return
    where = ""
    if is_int(attrs.get("shards"), 1):
        n, size = attrs["shards"], attrs.get("generation", {}).get("batch_size", 1)
        owners = sorted({owner(s, size, n) for s in undone})
        where = f" (shard {', '.join(f'{i}/{n}' for i in owners)}; run it with --resume)"
    raise KvscopeError(f"cannot finalize {out}: sample(s) {_listed(undone)} not done{where}")


def _complete_if_done(out: Path) -> bool:
    """Under the commit lock: mark the store complete if every sample is done; whether it is."""
    with commit_lock(out):
        attrs = read_attrs(out)
        if attrs["status"] != "complete" and all(attrs["samples_done"]):
            _complete(out)
        return all(attrs["samples_done"])


def _discard_uncommitted(out: Path, writer: StoreWriter | None) -> None:
    """A new store whose run failed before committing a step is removed, so that a re-run starts
    afresh; once a step is committed it stays (``partial``) for ``--resume``. Only a store the
    writer created is removed (not one that a failed creation found at ``out``)."""
    if writer is None:
        return
    writer.abandon()  # the store is created and the blocks already handed over are written first
    if writer.created and not any(writer.committed):
        shutil.rmtree(out, ignore_errors=True)


def _model_cache(model, layout: Layout, batch: list[int]) -> None:
    """No cache of kvscope's: the model makes its own at the prefill (a ``DynamicCache`` for most,
    a cache of its own for a hybrid such as MiniMax), as ``generate`` lets it."""


def _n_steps(settings: TraceSettings, questions: list[list[int]], forced: list[list[int]] | None) -> int:
    """The store's steps: each sample's forced question steps, then ``max_new_tokens`` generated
    ones — or, with given continuations, the continuation's forced tokens (at most as many)."""
    if forced is None:
        return settings.max_new_tokens + max(map(len, questions))
    return max(len(q) + len(c) for q, c in zip(questions, forced))


def _layout(settings: TraceSettings, spec: ModelSpec, encoded, *, rope: Rope | None, cache, S: int) -> Layout:
    return Layout(
        n_samples=len(encoded),
        n_steps=S,
        n_layers=spec.n_layers,
        n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads,
        head_dim=spec.head_dim,
        heads=settings.heads,
        resolution=settings.resolution,
        n_pos=max(len(ids) for ids in encoded) + S,
        obs_window=settings.obs_window,
        n_sink=settings.n_sink,
        window=settings.window,
        block_steps=min(settings.block_steps, S),
        record_qkv=settings.record_qkv,
        dtype=settings.dtype,
        rope_freqs=rope.inv_freq.shape[1] if rope is not None else 0,
        policy_events=len(range(0, S, settings.window)) if cache is not None else 0,
        **Layout.geometry(spec.config()),
    )


def _complete(out: Path) -> bool:
    """Mark the store complete and consolidate its metadata (only now: docs/trace-format.md#capture)."""
    import zarr

    group = zarr.open_group(str(out), mode="r+")
    group.attrs.update({"status": "complete", "completed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    consolidate(out)
    return True


def _texts(out: Path, tokenizer, n_question: list[int], samples: list[int]) -> tuple[list[str], list[int]]:
    """The generated text (after any forced question) and the number of steps of each of ``samples``."""
    import zarr

    group = zarr.open_group(str(out), mode="r")
    tokens, prompt_len, n_steps = group["tokens"], group["prompt_len"][:], group["n_steps"][:]
    texts = []
    for s in samples:
        gen = tokens[s, prompt_len[s] + n_question[s] : prompt_len[s] + n_steps[s]]
        texts.append(tokenizer.decode([int(t) for t in gen if t >= 0]))
    return texts, [int(n_steps[s]) for s in samples]


def _store_attrs(source, spec: ModelSpec, model, *, tokenizer, settings, layout, prompts, settings_doc, cache) -> dict:
    """Group attributes of a new store (docs/trace-format.md#arrays)."""
    import torch
    import transformers

    S = settings.max_new_tokens
    return {
        "schema_version": SCHEMA_VERSION,
        "kvscope_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "status": "partial",
        "steps_committed": [0] * len(prompts),
        "samples_done": [False] * len(prompts),
        "model": {
            "name": source.spec,
            "kind": source.kind,
            "source": source.origin,
            "sha256": source.weights_sha256,
            "config": spec.config(),
            "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        },
        "dtype": settings.dtype,
        "device": settings.device,
        "attn_kernel": "eager" if spec.from_weights else settings.attn,  # what computed the layers' outputs
        "attn_output": settings.attn_output,
        "generation": {
            "max_new_tokens": S,
            "sampling": settings.temperature > 0,
            "temperature": settings.temperature,
            "seed": settings.seed,
            "stop_at_eos": settings.stop_at_eos,
            "eos_token_ids": eos_ids(model, tokenizer),
            "chat_template": settings.chat,
            "batch_size": settings.batch_size,
            "question_agnostic": settings.question_agnostic,
            "continuation": continuations(prompts) is not None,
        },
        "heads": settings.heads,
        "head_dim_name": layout.head_dim_name,
        "resolution": settings.resolution,
        "n_sink": settings.n_sink,
        "w": settings.window,
        "obs_window": settings.obs_window,
        "block_steps": layout.block_steps,
        "record_qkv": settings.record_qkv,
        "prompts": [p.doc() for p in prompts],
        "settings": settings_doc,
        **({"policy": {**cache.describe(model), "every": settings.window}} if cache is not None else {}),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def _create_store(out: Path, layout: Layout, attrs: dict, *, encoded, rope: Rope | None, shard: Shard | None = None):
    """Create the store under a temporary name and rename it into place, so that ``out`` is
    either absent or an openable store (status ``partial``); returns the held writer locks.
    A shard that finds ``out`` made by another shard meanwhile (the rename fails: ``out`` is not
    empty) gets None and joins that store."""
    if out.exists() and shard is None:  # --force over a store, or an empty folder
        remove_store(out)
    tmp = out.with_name(f".{out.name}.creating-{os.getpid()}")
    locks = [StoreLock(tmp)] if shard is None else [StoreLock(tmp, shared=True), StoreLock(tmp, shard.lock_name)]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        create(tmp, layout, attrs)
        _write_static(tmp, layout, encoded, rope)
        for lock in locks:
            lock.acquire()
        os.rename(tmp, out)
    except BaseException as exc:
        for lock in locks:
            lock.release()
        shutil.rmtree(tmp, ignore_errors=True)
        if shard is not None and isinstance(exc, OSError) and exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return None
        if disk_full(exc):
            raise _no_space(out, layout) from exc
        if isinstance(exc, OSError):
            raise StoreError(f"cannot create {out}: {exc.strerror or exc}") from exc
        raise
    for lock in locks:
        lock.path = out
    return locks


def _no_space(out: Path, layout: Layout) -> StoreError:
    """A trace that filled the disk (``kvscope.storage.paths.no_space``), once what it
    wrote is cleaned up: the steps it committed are kept, and ``--resume`` continues them; the
    block it was writing is not committed (its rows stay hidden until it is written again)."""
    try:
        attrs = read_attrs(out)
    except KvscopeError:
        attrs = None
    if attrs is None:
        then = "nothing was kept: free space and run it again"
    elif attrs["status"] == "complete":
        then = "every step is written and the store is complete, but its consolidated metadata is missing"
    else:
        steps = sum(attrs["steps_committed"])
        then = f"its {steps} committed steps are kept: free space, then run the same command with --resume"
    return no_space(out, "the trace store", store_bytes(layout, block_size(out)), then)


def remove_store(out: Path) -> None:
    """Remove the store at ``out`` (``--force``), refused while another process writes it."""
    lock = StoreLock(out).acquire()
    shutil.rmtree(out)
    lock.release()


def _write_static(out: Path, layout: Layout, encoded: list[list[int]], rope: Rope | None) -> None:
    """What is known before decoding: prompt lengths and tokens, rotary parameters."""
    import zarr

    group = zarr.open_group(str(out), mode="r+")
    group["prompt_len"][:] = np.array([len(ids) for ids in encoded], dtype=np.int32)
    tokens = np.full((len(encoded), layout.n_pos), -1, dtype=np.int32)
    for s, ids in enumerate(encoded):
        tokens[s, : len(ids)] = ids
    group["tokens"][:] = tokens
    if rope is not None:
        group["rope_inv_freq"][:] = rope.inv_freq
        group["rope_attention_scaling"][:] = rope.scaling
