"""``kvscope.trace``: decode prompts with attention capture and write a trace store.

    trace(prompts, "out.zarr", max_new_tokens=64)           load the model, then trace_loaded
    trace_loaded(model, tokenizer, source, prompts, out, s)  with a model already loaded

The store is created under a temporary name and renamed into place (``out`` is either absent
or an openable store); the decode loop (:mod:`kvscope.tracing.decode`) hands blocks of steps
to a background writer that commits each block once it is durable. ``resume=True`` continues
a partial store made with the same settings.

A *cache factory* (``cache=``) decides the KV cache each batch decodes with: by default a
plain ``DynamicCache``; :class:`kvscope.live.LivePolicy` makes a recording policy cache, whose
tiers and bytes are written with each block (``trace --policy``). A factory is called as
``factory(model, layout, batch)`` (``batch``: the sample indices it decodes) and has ``settings()`` (compared on resume) and ``describe(model)``.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from .. import __version__, defaults
from ..errors import KvscopeError, StoreError
from ..model_spec import ModelSpec
from ..models import DEFAULT_MODEL, ModelSource, load, resolve
from ..params import ParamSpec, check_value
from ..paths import output_path
from ..prompts import Prompt, as_prompts, check_context, encode_prompts, eos_ids
from ..rope import Rope
from ..schema import SCHEMA_VERSION, Layout
from ..store import check_store, consolidate, create, read_attrs
from .capture import HEAD_MODES, KERNELS, implementation_name, register
from .decode import decode_all
from .writer import StoreLock, StoreWriter


@dataclass
class TraceSettings:
    """Everything that determines a trace's contents (compared on ``--resume``)."""

    model: str = DEFAULT_MODEL
    max_new_tokens: int = defaults.MAX_NEW_TOKENS
    heads: str = "kv"  # all | kv | mean
    resolution: str = "token"  # token | window
    window: int = defaults.W  # w, a multiple of 4
    n_sink: int = defaults.N_SINK
    obs_window: int = defaults.OBS_WINDOW
    record_qkv: bool = False
    dtype: str = "float16"  # storage dtype of attention rows and q/k/v
    device: str = "cpu"
    attn: str = "sdpa"
    model_dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    seed: int = 0
    temperature: float = 0.0  # 0 = greedy
    batch_size: int = 1
    block_steps: int = defaults.BLOCK_STEPS
    stop_at_eos: bool = True
    chat: bool = False
    trust_remote_code: bool = False
    question_agnostic: bool = False  # prefill the context only; the question's tokens are forced steps

    def check(self) -> None:
        self._check_kinds()
        if self.max_new_tokens < 1:
            raise KvscopeError(f"--max-new-tokens must be at least 1 (got {self.max_new_tokens})")
        if self.heads not in HEAD_MODES:
            raise KvscopeError(f"--heads must be one of {', '.join(HEAD_MODES)} (got {self.heads!r})")
        if self.heads == "mean" and self.record_qkv:
            raise KvscopeError(
                "--heads mean keeps one 'head' row, but --record qkv stores every head: use --heads kv or all"
            )
        if self.resolution not in ("token", "window"):
            raise KvscopeError(f"--resolution must be token or window (got {self.resolution!r})")
        if self.window < 4 or self.window % 4:
            raise KvscopeError(f"--window must be a positive multiple of 4 (got {self.window})")
        if self.n_sink < 0:
            raise KvscopeError(f"--sinks must be ≥ 0 (got {self.n_sink})")
        if self.obs_window < 1:
            raise KvscopeError(f"--obs-window must be at least 1 (got {self.obs_window})")
        if self.dtype not in ("float16", "float32"):
            raise KvscopeError(f"--dtype must be float16 or float32 (got {self.dtype!r})")
        if self.attn not in KERNELS:
            raise KvscopeError(f"--attn must be one of {', '.join(KERNELS)} (got {self.attn!r})")
        if self.batch_size < 1:
            raise KvscopeError(f"--batch-size must be at least 1 (got {self.batch_size})")
        if self.block_steps < 1:
            raise KvscopeError(f"--block-steps must be at least 1 (got {self.block_steps})")
        if self.temperature < 0:
            raise KvscopeError(f"--temperature must be ≥ 0 (got {self.temperature})")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise KvscopeError("--device cuda asked for, but torch sees no CUDA device")
        elif self.device != "cpu":
            raise KvscopeError(f"--device must be cpu or cuda[:N] (got {self.device!r})")
        if self.attn == "flash_attention_2":
            import importlib.util

            if not self.device.startswith("cuda") or importlib.util.find_spec("flash_attn") is None:
                raise KvscopeError("--attn flash_attention_2 needs a CUDA device and the flash-attn package")

    def _check_kinds(self) -> None:
        """Integer settings hold integers, float settings finite numbers (``nan``, ``inf`` refused)."""
        kinds = {"int": int, "float": float}
        for f in fields(self):
            if f.type in kinds:
                spec = ParamSpec(flag=_FLAGS.get(f.name))
                value = check_value("trace", f.name, getattr(self, f.name), spec, kinds[f.type], False, by_flag=True)
                setattr(self, f.name, value)


_FLAGS = {"n_sink": "--sinks"}  # the trace options whose flag is not the field's name


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
    """What a progress callback receives after every decode step."""

    steps_done: int
    steps_total: int
    tokens_per_s: float
    bytes_written: int


@dataclass
class TraceResult:
    path: Path
    n_samples: int
    steps: list[int]
    seconds: float
    bytes_written: int
    texts: list[str] = field(default_factory=list)


def trace(
    prompts: list[Prompt] | list[str] | str,
    out: str | Path,
    settings: TraceSettings | None = None,
    *,
    resume: bool = False,
    force: bool = False,
    progress: Callable[[Progress], None] | None = None,
    cache=None,
    **overrides,
) -> TraceResult:
    """Decode ``prompts`` with attention capture and write a trace store at ``out``.

    ``overrides`` set fields of :class:`TraceSettings` (e.g. ``max_new_tokens=64``);
    ``cache``: a cache factory (module docstring)."""
    settings = settings or TraceSettings()
    for key, value in overrides.items():
        if not hasattr(settings, key):
            raise KvscopeError(f"unknown trace setting {key!r}")
        setattr(settings, key, value)
    settings.check()
    check_cache(settings, cache)
    prompts = as_prompts(prompts)
    out = output_path(out, "--out")
    source = resolve(settings.model)
    _prepare_out(out, _settings_doc(settings, source, prompts, cache), resume, force)  # refuse early, before loading
    model, tokenizer = load(source, settings.device, settings.model_dtype, settings.trust_remote_code)
    return trace_loaded(
        model, tokenizer, source, prompts, out, settings, resume=resume, force=force, progress=progress, cache=cache
    )


def _settings_doc(settings: TraceSettings, source, prompts: list[Prompt], cache) -> dict:
    return {
        **asdict(settings),
        "cache": cache.settings() if cache is not None else None,
        "model_sha256": source.weights_sha256,
        "prompts": [p.text for p in prompts],
    }


def check_out(out: str | Path, force: bool, flag: str = "--out") -> None:
    """Refuse now, before a model is loaded, an ``out`` where a new trace may not be written
    (``flag`` names the option in messages)."""
    _prepare_out(Path(out), {}, resume=False, force=force, flag=flag)


def _prepare_out(out: Path, settings_doc: dict, resume: bool, force: bool, flag: str = "--out") -> dict | None:
    """Decide what to do with ``out``; returns the existing attrs when resuming."""
    if out.is_symlink():
        raise KvscopeError(f"{flag} {out} is a symbolic link; kvscope writes a store only at its real path")
    if not out.exists():
        if resume:
            raise KvscopeError(f"--resume: no store at {out}")
        return None
    if StoreLock.held_by_other(out):
        raise StoreError(f"{out} is being written by another kvscope process")
    if not (out / "zarr.json").is_file():
        if out.is_dir() and not any(out.iterdir()):
            return None
        raise KvscopeError(f"{flag} {out} exists and is not a kvscope store; refusing to overwrite it")
    attrs = read_attrs(out)
    status = attrs.get("status")
    if force:
        return None
    if resume:
        if status == "complete":
            raise KvscopeError(f"{out} is already complete; nothing to resume")
        check_store(out)
        theirs = attrs.get("settings", {})
        diff = sorted(k for k in set(theirs) | set(settings_doc) if theirs.get(k) != settings_doc.get(k))
        if diff:
            raise KvscopeError(f"--resume: {out} was traced with different {', '.join(diff)}")
        return attrs
    if status == "complete":
        raise KvscopeError(f"{flag} {out} holds a complete trace; pass --force to overwrite it or choose another path")
    raise KvscopeError(f"{flag} {out} holds a partial trace; pass --resume to continue it or --force to start over")


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
) -> TraceResult:
    """:func:`trace` with a model that is already loaded (benchmarks reuse one model)."""
    started = time.perf_counter()
    out = Path(out)
    check_cache(settings, cache)
    settings_doc = _settings_doc(settings, source, prompts, cache)
    existing = _prepare_out(out, settings_doc, resume, force)
    register()
    model.set_attn_implementation(implementation_name(settings.attn))
    spec = ModelSpec.from_model(model)
    encoded, questions = encode_prompts(tokenizer, prompts, settings.chat, settings.question_agnostic)
    check_context(encoded, settings.max_new_tokens, spec.max_position_embeddings, questions)
    rope = Rope.from_model(model, spec.n_layers) if settings.record_qkv else None
    layout = _layout(settings, spec, encoded, rope, cache, max(map(len, questions)))
    if existing is None:
        attrs = _store_attrs(source, spec, model, tokenizer, settings, layout, prompts, settings_doc, cache)
        if settings.question_agnostic:
            attrs["question_tokens"] = [len(q) for q in questions]
        lock = _create_store(out, layout, attrs, encoded, rope)
        committed, done = [0] * len(prompts), [False] * len(prompts)
    else:
        lock = StoreLock(out).acquire()
        committed, done = list(existing["steps_committed"]), list(existing["samples_done"])
    writer = None
    try:
        writer = StoreWriter(out, committed, done)
        eos = set(eos_ids(model, tokenizer)) if settings.stop_at_eos else set()

        def on_step(done_steps: int, total: int, tokens: int, seconds: float) -> None:
            if progress is not None:
                progress(Progress(done_steps, total, tokens / seconds if seconds > 0 else 0.0, writer.bytes_written))

        decode_all(model, encoded, layout, settings, writer, cache or _dynamic_cache, eos, on_step, questions)
        writer.close()
        _complete(out)
        texts, steps = _texts(out, tokenizer, [len(q) for q in questions])
        return TraceResult(out, len(encoded), steps, time.perf_counter() - started, writer.bytes_written, texts)
    except BaseException:
        if existing is None:
            _discard_uncommitted(out, writer)
        raise
    finally:
        lock.release()


def _discard_uncommitted(out: Path, writer: StoreWriter | None) -> None:
    """A new store whose run failed before committing a step is removed, so that a re-run starts
    afresh; once a step is committed it stays (``partial``) for ``--resume``."""
    if writer is not None:
        writer.abandon()  # the blocks already handed over are written first
        if any(writer.committed):
            return
    shutil.rmtree(out, ignore_errors=True)


def _dynamic_cache(model, layout: Layout, batch: list[int]):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _layout(settings: TraceSettings, spec: ModelSpec, encoded, rope: Rope | None, cache, n_question: int = 0) -> Layout:
    S = settings.max_new_tokens + n_question  # forced question steps, then the generated ones
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
    )


def _complete(out: Path) -> None:
    """Mark the store complete and consolidate its metadata (only now: SPEC §2)."""
    import zarr

    group = zarr.open_group(str(out), mode="r+")
    group.attrs.update({"status": "complete", "completed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    consolidate(out)


def _texts(out: Path, tokenizer, n_question: list[int]) -> tuple[list[str], list[int]]:
    """The generated text (after any forced question) and the number of steps of every sample."""
    import zarr

    group = zarr.open_group(str(out), mode="r")
    tokens, prompt_len, n_steps = group["tokens"][:], group["prompt_len"][:], group["n_steps"][:]
    texts = []
    for s in range(len(n_steps)):
        gen = tokens[s, prompt_len[s] + n_question[s] : prompt_len[s] + n_steps[s]]
        texts.append(tokenizer.decode([int(t) for t in gen if t >= 0]))
    return texts, [int(n) for n in n_steps]


def _store_attrs(source, spec: ModelSpec, model, tokenizer, settings, layout, prompts, settings_doc, cache) -> dict:
    """Group attributes of a new store (SPEC §3)."""
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
        "attn_kernel": settings.attn,
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


def _create_store(out: Path, layout: Layout, attrs: dict, encoded, rope: Rope | None) -> StoreLock:
    """Create the store under a temporary name and rename it into place, so that ``out`` is
    either absent or an openable store (status ``partial``); returns the held writer lock."""
    if out.exists():  # --force over a store, or an empty folder
        old = StoreLock(out).acquire()
        shutil.rmtree(out)
        old.release()
    tmp = out.with_name(f".{out.name}.creating-{os.getpid()}")
    lock = StoreLock(tmp)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        create(tmp, layout, attrs)
        _write_static(tmp, layout, encoded, rope)
        lock.acquire()
        os.rename(tmp, out)
    except BaseException as exc:
        lock.release()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise StoreError(f"cannot create {out}: {exc.strerror or exc}") from exc
        raise
    lock.path = out
    return lock


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
