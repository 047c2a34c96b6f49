"""``kvscope.trace``: decode prompts with attention capture and write a trace store.

The decode loop is driven here (not by ``generate``) so that each forward pass is known
to the recorder: step ``t`` is the forward whose query sits at ``prompt_len − 1 + t``
(step 0 = the last prefill row), and the sampled token of step ``t`` is
``tokens[prompt_len + t]`` (SPEC §1). Greedy decoding by default; ``temperature > 0``
samples with a seeded ``torch.Generator``.

``resume=True`` continues a partial store: each unfinished batch is decoded again from
its prompt with capture switched off for the committed steps (a bit-identical replay of
the same operations, whose tokens are checked against the stored ones), then capture
resumes at the first uncommitted step.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .. import __version__
from ..errors import KvscopeError, StoreError
from ..models import DEFAULT_MODEL, ModelSource, load, resolve
from ..store import SCHEMA_VERSION, Layout, create, read_attrs, validate
from .capture import HEAD_MODES, KERNELS, AttentionRecorder, ForwardContext, implementation_name, register
from .writer import LOCK_NAME, Block, StoreLock, StoreWriter


@dataclass
class TraceSettings:
    """Everything that determines a trace's contents (compared on ``--resume``)."""

    model: str = DEFAULT_MODEL
    max_new_tokens: int = 64
    heads: str = "kv"  # all | kv | mean
    resolution: str = "token"  # token | window
    window: int = 8  # w, a multiple of 4
    n_sink: int = 4
    obs_window: int = 32
    record_qkv: bool = False
    dtype: str = "float16"  # storage dtype of attention rows and q/k/v
    device: str = "cpu"
    attn: str = "sdpa"
    model_dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    seed: int = 0
    temperature: float = 0.0  # 0 = greedy
    batch_size: int = 1
    block_steps: int = 32
    stop_at_eos: bool = True
    chat: bool = False
    trust_remote_code: bool = False
    policy: str | None = None  # decode under this live policy cache (kvscope.live)
    budget: float | None = None  # its budget β
    kv_dtype: str = "model"  # its storage of FP entries

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise KvscopeError(f"--max-new-tokens must be at least 1 (got {self.max_new_tokens})")
        if self.heads not in HEAD_MODES:
            raise KvscopeError(f"--heads must be one of {', '.join(HEAD_MODES)} (got {self.heads!r})")
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
        if self.policy is not None:
            from ..live.cache import live_policy
            from ..live.run import parse_kv_dtype
            from ..replay import check_budget

            if self.budget is None:
                raise KvscopeError("--policy needs --budget")
            self.budget = check_budget(self.budget)
            live_policy(self.policy)
            if self.batch_size != 1:
                raise KvscopeError("--policy decodes one sample at a time (--batch-size 1)")
            if self.resolution != "token":
                raise KvscopeError("--policy records token-resolution rows (--resolution token)")
            parse_kv_dtype(self.kv_dtype)
        elif self.budget is not None:
            raise KvscopeError("--budget goes with --policy")
        if self.attn == "flash_attention_2":
            import importlib.util

            if not self.device.startswith("cuda") or importlib.util.find_spec("flash_attn") is None:
                raise KvscopeError("--attn flash_attention_2 needs a CUDA device and the flash-attn package")


@dataclass
class Prompt:
    text: str
    source: str = "cli"
    expected: object = None  # a workload's answer (what its scorer grades against)
    meta: dict = field(default_factory=dict)

    def doc(self) -> dict:
        """What the store's ``prompts`` attribute holds for this prompt."""
        out = {"text": self.text, "source": self.source}
        if self.expected is not None:
            out["expected"] = self.expected
        if self.meta:
            out["meta"] = self.meta
        return out


@dataclass
class Progress:
    """What a progress callback receives after every decode step."""

    steps_done: int
    steps_total: int
    tokens_per_s: float
    bytes_written: int
    sample: int = 0


@dataclass
class TraceResult:
    path: Path
    n_samples: int
    steps: list[int]
    seconds: float
    bytes_written: int
    texts: list[str] = field(default_factory=list)


def load_prompts_file(path: str | Path) -> list[Prompt]:
    """JSONL with one object per line: ``{"prompt" | "text": str, "source"?: str}``."""
    p = Path(path)
    if not p.is_file():
        raise KvscopeError(f"prompts file not found: {p}")
    prompts = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise KvscopeError(f"{p}:{n}: not a JSON object") from None
        text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
        if not isinstance(text, str) or not text:
            raise KvscopeError(f"{p}:{n}: needs a non-empty string field 'prompt' or 'text'")
        prompts.append(Prompt(text, str(obj.get("source", f"{p.name}:{n}"))))
    if not prompts:
        raise KvscopeError(f"{p} holds no prompts")
    return prompts


def _model_facts(model) -> dict:
    cfg = model.config.get_text_config()
    n_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    scaling = {}
    for module in model.modules():  # attention modules carry layer_idx and their softmax scaling
        value = getattr(module, "scaling", None)
        if hasattr(module, "layer_idx") and isinstance(value, (int, float)):
            scaling[int(module.layer_idx)] = float(value)
    return {
        "attention_scaling": [scaling.get(layer) for layer in range(cfg.num_hidden_layers)],
        "architecture": (model.config.architectures or [type(model).__name__])[0],
        "model_type": cfg.model_type,
        "n_layers": cfg.num_hidden_layers,
        "n_heads": n_heads,
        "n_kv_heads": getattr(cfg, "num_key_value_heads", None) or n_heads,
        "head_dim": head_dim,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "rope_parameters": json.loads(json.dumps(rope, default=str)),
        "sliding_window": getattr(cfg, "sliding_window", None),
        "layer_types": list(getattr(cfg, "layer_types", None) or []),
        "attn_logit_softcapping": getattr(cfg, "attn_logit_softcapping", None),
    }


def _rope_parameters(model, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """Rotary inverse frequencies [layer, rope_freq] and attention scaling [layer]."""
    rotary = None
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            rotary = module
            break
    layer_types = list(getattr(model.config.get_text_config(), "layer_types", None) or [])
    freqs, scales = [], []
    for layer in range(n_layers):
        prefix = (
            f"{layer_types[layer]}_" if layer_types and rotary is not None and not hasattr(rotary, "inv_freq") else ""
        )
        inv = getattr(rotary, f"{prefix}inv_freq", None) if rotary is not None else None
        scale = getattr(rotary, f"{prefix}attention_scaling", getattr(rotary, "attention_scaling", 1.0))
        freqs.append(inv.detach().float().cpu().numpy() if inv is not None else None)
        scales.append(float(scale) if scale is not None else 1.0)
    width = max((len(f) for f in freqs if f is not None), default=0)
    out = np.full((n_layers, width), np.nan, dtype=np.float32)
    for layer, f in enumerate(freqs):
        if f is not None:
            out[layer, : len(f)] = f
    return out, np.asarray(scales, dtype=np.float32)


def _eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _encode(tokenizer, prompts: list[Prompt], chat: bool) -> list[list[int]]:
    out = []
    for prompt in prompts:
        if chat:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(prompt.text, add_special_tokens=True)["input_ids"]
        if not ids:
            raise KvscopeError(f"prompt from {prompt.source} is empty after tokenization")
        out.append([int(i) for i in ids])
    return out


def _prepare_out(out: Path, settings_doc: dict, resume: bool, force: bool) -> dict | None:
    """Decide what to do with ``out``; returns the existing attrs when resuming."""
    if not out.exists():
        if resume:
            raise KvscopeError(f"--resume: no store at {out}")
        return None
    if _locked_by_other(out):
        raise StoreError(f"{out} is being written by another kvscope process")
    if not (out / "zarr.json").is_file():
        if out.is_dir() and not any(out.iterdir()):
            return None
        raise KvscopeError(f"--out {out} exists and is not a kvscope store; refusing to overwrite it")
    attrs = read_attrs(out)
    status = attrs.get("status")
    if force:
        return None
    if resume:
        if status == "complete":
            raise KvscopeError(f"{out} is already complete; nothing to resume")
        validate(out)
        theirs = attrs.get("settings", {})
        diff = sorted(k for k in set(theirs) | set(settings_doc) if theirs.get(k) != settings_doc.get(k))
        if diff:
            raise KvscopeError(f"--resume: {out} was traced with different {', '.join(diff)}")
        return attrs
    if status == "complete":
        raise KvscopeError(f"--out {out} holds a complete trace; pass --force to overwrite it or choose another path")
    raise KvscopeError(f"--out {out} holds a partial trace; pass --resume to continue it or --force to start over")


def _locked_by_other(out: Path) -> bool:
    import fcntl

    lock = out / LOCK_NAME
    if not lock.is_file():
        return False
    with open(lock) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False


def trace(
    prompts: list[Prompt] | list[str] | str,
    out: str | Path,
    settings: TraceSettings | None = None,
    *,
    resume: bool = False,
    force: bool = False,
    progress: Callable[[Progress], None] | None = None,
    **overrides,
) -> TraceResult:
    """Decode ``prompts`` with attention capture and write a trace store at ``out``.

    ``overrides`` set fields of :class:`TraceSettings` (e.g. ``max_new_tokens=64``).
    """

    settings = settings or TraceSettings()
    for key, value in overrides.items():
        if not hasattr(settings, key):
            raise KvscopeError(f"unknown trace setting {key!r}")
        setattr(settings, key, value)
    settings.check()
    prompts = as_prompts(prompts)
    out = Path(out)

    source = resolve(settings.model)
    _prepare_out(out, _settings_doc(settings, source, prompts), resume, force)  # refuse early, before loading
    model, tokenizer = load(source, settings.device, settings.model_dtype, settings.trust_remote_code)
    return trace_loaded(model, tokenizer, source, prompts, out, settings, resume=resume, force=force, progress=progress)


def as_prompts(prompts) -> list[Prompt]:
    """One text, texts or :class:`Prompt` objects → a non-empty list of prompts."""
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = [p if isinstance(p, Prompt) else Prompt(str(p)) for p in prompts]
    if not prompts:
        raise KvscopeError("no prompts given")
    return prompts


def check_context(encoded: list[list[int]], max_new_tokens: int, context: int | None) -> None:
    """Refuse a prompt whose tokens plus ``max_new_tokens`` exceed the model context."""
    for n, ids in enumerate(encoded):
        if context and len(ids) + max_new_tokens > context:
            raise KvscopeError(
                f"prompt {n} has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} "
                f"it exceeds the model context of {context}"
            )


def _settings_doc(settings: TraceSettings, source, prompts: list[Prompt]) -> dict:
    return {**asdict(settings), "model_sha256": source.weights_sha256, "prompts": [p.text for p in prompts]}


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
) -> TraceResult:
    """:func:`trace` with a model that is already loaded (benchmarks reuse one model)."""
    out = Path(out)
    settings_doc = _settings_doc(settings, source, prompts)
    existing = _prepare_out(out, settings_doc, resume, force)
    register()
    model.set_attn_implementation(implementation_name(settings.attn))
    facts = _model_facts(model)
    encoded = _encode(tokenizer, prompts, settings.chat)
    check_context(encoded, settings.max_new_tokens, facts["max_position_embeddings"])
    S = settings.max_new_tokens
    layout = Layout(
        n_samples=len(prompts),
        n_steps=S,
        n_layers=facts["n_layers"],
        n_heads=facts["n_heads"],
        n_kv_heads=facts["n_kv_heads"],
        head_dim=facts["head_dim"],
        heads=settings.heads,
        resolution=settings.resolution,
        n_pos=max(len(ids) for ids in encoded) + S,
        obs_window=settings.obs_window,
        n_sink=settings.n_sink,
        window=settings.window,
        block_steps=min(settings.block_steps, S),
        record_qkv=settings.record_qkv,
        dtype=settings.dtype,
        rope_freqs=_rope_parameters(model, facts["n_layers"])[0].shape[1] if settings.record_qkv else 0,
        policy_events=len(range(0, S, settings.window)) if settings.policy else 0,
    )

    if existing is None:
        attrs = _store_attrs(source, facts, model, tokenizer, settings, layout, prompts, settings_doc)
        lock = _create_store(out, layout, attrs, encoded, model, settings)
        committed, done = [0] * len(prompts), [False] * len(prompts)
    else:
        lock = StoreLock(out).acquire()
        committed, done = list(existing["steps_committed"]), list(existing["samples_done"])
    try:
        writer = StoreWriter(out, committed, done)
        result = _decode_all(model, tokenizer, encoded, layout, settings, writer, out, progress)
        writer.close()
        import zarr

        group = zarr.open_group(str(out), mode="r+")
        group.attrs.update({"status": "complete", "completed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        zarr.consolidate_metadata(str(out))
        result.bytes_written = writer.bytes_written
        return result
    finally:
        lock.release()


def _store_attrs(source, facts, model, tokenizer, settings, layout, prompts, settings_doc) -> dict:
    """Group attributes of a new store (SPEC §3)."""
    import torch

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
            "config": facts,
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
            "eos_token_ids": _eos_ids(model, tokenizer),
            "chat_template": settings.chat,
            "batch_size": settings.batch_size,
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
        **({"policy": _policy_doc(settings, model)} if settings.policy else {}),
        "versions": {"torch": torch.__version__, "transformers": _transformers_version()},
    }


def _policy_doc(settings: TraceSettings, model) -> dict:
    """What a trace recorded under a live policy cache says about it."""
    from ..live.run import kv_storage_dtype
    from ..policies import parse

    policy = parse(settings.policy)
    dtype = kv_storage_dtype(model, settings.kv_dtype)
    return {
        "label": policy.label(),
        "name": policy.name,
        "params": policy.params(),
        "budget": settings.budget,
        "kv_dtype": str(dtype).removeprefix("torch."),
        "kv_itemsize": dtype.itemsize,
        "every": settings.window,
    }


def _create_store(out: Path, layout: Layout, attrs: dict, encoded, model, settings) -> StoreLock:
    """Create the store under a temporary name and rename it into place, so that ``out`` is
    either absent or an openable store (status ``partial``); returns the held writer lock."""
    if out.exists():  # --force over a store, or an empty folder
        old = StoreLock(out).acquire()
        shutil.rmtree(out)
        old.release()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.creating-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    create(tmp, layout, attrs)
    _write_static(tmp, layout, encoded, model, settings)
    lock = StoreLock(tmp).acquire()
    try:
        os.rename(tmp, out)
    except OSError as exc:
        lock.release()
        shutil.rmtree(tmp, ignore_errors=True)
        raise StoreError(f"cannot create {out}: {exc.strerror}") from exc
    lock.path = out
    return lock


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _write_static(out: Path, layout: Layout, encoded: list[list[int]], model, settings: TraceSettings) -> None:
    import zarr

    group = zarr.open_group(str(out), mode="r+")
    prompt_len = np.array([len(ids) for ids in encoded], dtype=np.int32)
    group["prompt_len"][:] = prompt_len
    tokens = np.full((len(encoded), layout.n_pos), -1, dtype=np.int32)
    for s, ids in enumerate(encoded):
        tokens[s, : len(ids)] = ids
    group["tokens"][:] = tokens
    if settings.record_qkv:
        inv_freq, scaling = _rope_parameters(model, layout.n_layers)
        group["rope_inv_freq"][:] = inv_freq
        group["rope_attention_scaling"][:] = scaling


def _decode_all(model, tokenizer, encoded, layout, settings, writer, out, progress) -> TraceResult:
    t_start = time.perf_counter()
    steps_total = sum(layout.n_steps - c for c, d in zip(writer.committed, writer.done) if not d)
    counter = {"done": 0, "t0": time.perf_counter(), "tokens": 0}
    texts = []
    for b0 in range(0, len(encoded), settings.batch_size):
        batch = list(range(b0, min(len(encoded), b0 + settings.batch_size)))
        if all(writer.done[s] for s in batch):
            continue
        _decode_batch(model, tokenizer, encoded, batch, layout, settings, writer, progress, counter, steps_total)
    writer.flush()
    import zarr

    group = zarr.open_group(str(out), mode="r")
    tokens = group["tokens"][:]
    prompt_len = group["prompt_len"][:]
    n_steps = group["n_steps"][:]
    for s in range(len(encoded)):
        gen = tokens[s, prompt_len[s] : prompt_len[s] + n_steps[s]]
        texts.append(tokenizer.decode([int(t) for t in gen if t >= 0]))
    return TraceResult(out, len(encoded), [int(n) for n in n_steps], time.perf_counter() - t_start, 0, texts)


def _decode_batch(model, tokenizer, encoded, batch, layout, settings, writer, progress, counter, steps_total) -> None:
    import torch
    from transformers import DynamicCache

    device = settings.device
    S, blk = layout.n_steps, layout.block_steps
    lens = [len(encoded[s]) for s in batch]
    p_max = max(lens)
    B = len(batch)
    pad_id = 0
    input_ids = torch.full((B, p_max), pad_id, dtype=torch.long)
    mask = torch.zeros((B, p_max), dtype=torch.long)
    for i, s in enumerate(batch):
        input_ids[i, p_max - lens[i] :] = torch.tensor(encoded[s])
        mask[i, p_max - lens[i] :] = 1
    pad = torch.tensor([p_max - n for n in lens], dtype=torch.long)
    input_ids, mask = input_ids.to(device), mask.to(device)
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)

    padded = bool((pad > 0).any())
    committed = min(writer.committed[s] for s in batch)
    eos = set(_eos_ids(model, tokenizer)) if settings.stop_at_eos else set()
    generator = torch.Generator(device="cpu").manual_seed(settings.seed + batch[0])
    stored_tokens = None
    if committed > 0:
        import zarr

        group = zarr.open_group(str(writer.path), mode="r")
        stored_tokens = group["tokens"][batch[0] : batch[-1] + 1]

    recorder = AttentionRecorder(
        n_layers=layout.n_layers,
        n_stored_heads=layout.n_stored_heads,
        heads=settings.heads,
        obs_window=layout.obs_window,
        record_qkv=settings.record_qkv,
    )
    if settings.policy is not None:
        from ..live import PolicyCache
        from ..live.run import parse_kv_dtype

        cache = PolicyCache(
            model, settings.policy, settings.budget, S, kv_dtype=parse_kv_dtype(settings.kv_dtype),
            n_sink=settings.n_sink, w=settings.window, obs_window=settings.obs_window, every=settings.window,
            keep_tiers=True,
        )  # fmt: skip
        policy_buffers = _PolicyBuffers(layout)
    else:
        cache = DynamicCache(config=model.config)
        policy_buffers = None
    dtype = np.float16 if settings.dtype == "float16" else np.float32
    n_steps = np.full(B, S, dtype=np.int64)  # final number of steps per sample
    finished = np.zeros(B, dtype=bool)
    generated = np.full((B, S), -1, dtype=np.int64)
    buffers = _BlockBuffers(layout, B, dtype)

    def sample(logits):  # [B, vocab] fp32
        if settings.temperature > 0:
            probs = torch.softmax(logits.float() / settings.temperature, dim=-1).cpu()
            return torch.multinomial(probs, 1, generator=generator)[:, 0]
        return logits.float().argmax(-1).cpu()

    with torch.no_grad(), recorder.active():
        next_input = input_ids
        seq_len = p_max
        for t in range(S):
            recorder.enabled = t >= committed
            recorder.begin(ForwardContext(seq_len=seq_len, pad=pad))
            out = model(
                input_ids=next_input,
                attention_mask=mask if padded else None,  # all ones: let transformers skip the mask
                position_ids=position_ids if t == 0 else (position_ids[:, -1:] + t),
                cache=cache,
                use_cache=True,
            )
            cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
            if policy_buffers is not None:
                cache.end_step()
                policy_buffers.add_step(t, cache)
            token = sample(out.logits[:, -1])
            if stored_tokens is not None and t < committed:
                for i in range(B):
                    expected = stored_tokens[i, lens[i] + t]
                    if not finished[i] and expected >= 0 and int(token[i]) != int(expected):
                        raise StoreError(
                            f"--resume: replay produced token {int(token[i])} at step {t} of sample {batch[i]}, "
                            f"the store has {int(expected)}; the model or environment differs"
                        )
            live = ~finished
            generated[live, t] = token.numpy()[live]
            if t >= committed:
                buffers.add_step(t, recorder, live, lens, pad, seq_len, p_max)
            if t == 0 and recorder.enabled:
                _write_prefill(writer, batch, recorder, layout, lens, pad, dtype)
            for i in range(B):
                if live[i] and int(token[i]) in eos:
                    finished[i] = True
                    n_steps[i] = t + 1
            end_of_block = (t + 1) % blk == 0 or t == S - 1 or finished.all()
            if end_of_block and t >= committed:
                prompt_ids = [encoded[s] for s in batch]
                block = buffers.block(batch, t + 1, prompt_ids, generated, n_steps, finished, S)
                if policy_buffers is not None:
                    policy_buffers.flush_into(block, batch[0])
                writer.submit(block)
                buffers.reset()
            if t >= committed:
                counter["done"] += 1
                counter["tokens"] += int(live.sum())
                if progress is not None:
                    elapsed = time.perf_counter() - counter["t0"]
                    progress(
                        Progress(
                            counter["done"],
                            steps_total,
                            counter["tokens"] / elapsed if elapsed > 0 else 0.0,
                            writer.bytes_written,
                            batch[0],
                        )
                    )
            if finished.all():
                break
            next_input = token.to(device)[:, None]
            if padded:
                mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
            seq_len += 1


def _write_prefill(writer, batch, recorder, layout, lens, pad, dtype) -> None:
    """Prefill column sums, tail rows (and q/k/v of the prompt), handed to the writer ahead
    of the first block of steps (the queue keeps order, so they are durable before any
    step is committed)."""
    import torch

    L, T, obs = layout.n_layers, layout.n_pos, layout.obs_window
    caps = [recorder.layers[layer] for layer in range(L)]
    colsum = torch.stack([c.colsum for c in caps], 1).cpu().numpy()  # [B, layer, Hs, p_max]
    tail = torch.stack([c.tail for c in caps], 1).cpu().numpy()  # [B, layer, Hs, obs, p_max]
    block = Block()
    for i, s in enumerate(batch):
        P = lens[i]
        cs = np.full((1, L, colsum.shape[2], T), np.nan, dtype=np.float32)
        cs[0, :, :, :P] = colsum[i, :, :, :P]
        tl = np.full((1, L, tail.shape[2], obs, T), np.nan, dtype=dtype)
        qpos = np.arange(P - obs, P, dtype=np.int32)
        for o in range(obs):
            if qpos[o] >= 0:
                tl[0, :, :, o, : qpos[o] + 1] = tail[i, :, :, o, : qpos[o] + 1]
        block.writes.append(("prefill_colsum", (slice(s, s + 1),), cs))
        block.writes.append(("prefill_tail", (slice(s, s + 1),), tl))
        block.writes.append(("prefill_tail_qpos", (slice(s, s + 1),), np.where(qpos >= 0, qpos, -1)[None]))
        if layout.record_qkv:
            p0 = int(pad[i])
            q = torch.stack([c.q[i, :, p0:] for c in caps], 0).permute(2, 0, 1, 3).cpu().numpy()  # [P, L, H, D]
            k = torch.stack([c.k[i, :, p0:] for c in caps], 0).cpu().numpy()  # [L, Hkv, P, D]
            v = torch.stack([c.v[i, :, p0:] for c in caps], 0).cpu().numpy()
            block.writes.append(("q", (slice(s, s + 1), slice(0, P)), q[None].astype(dtype)))
            block.writes.append(("k", (slice(s, s + 1), slice(None), slice(None), slice(0, P)), k[None].astype(dtype)))
            block.writes.append(("v", (slice(s, s + 1), slice(None), slice(None), slice(0, P)), v[None].astype(dtype)))
    writer.submit(block)


class _BlockBuffers:
    """Accumulates one block of steps for a batch, at the stored resolution."""

    def __init__(self, layout: Layout, B: int, dtype):
        self.layout = layout
        self.B = B
        self.dtype = dtype
        self.reset()

    def reset(self) -> None:
        L = self.layout
        blk, Hs = L.block_steps, L.n_stored_heads
        last = L.n_windows if L.resolution == "window" else L.n_pos
        self.t0 = None
        self.attn = np.full((self.B, blk, L.n_layers, Hs, last), np.nan, dtype=self.dtype)
        self.sink = np.full((self.B, blk, L.n_layers, Hs, L.n_sink), np.nan, dtype=self.dtype)
        self.qkv: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]] = []  # (i, pos, q, k, v)

    def add_step(self, t, recorder, live, lens, pad, seq_len, p_max) -> None:
        import torch

        L = self.layout
        if self.t0 is None:
            self.t0 = t - t % L.block_steps
        j = t - self.t0
        rows = recorder.rows
        if L.resolution == "token":  # torch converts to fp16 much faster than numpy
            rows = rows.to(torch.float16 if self.dtype == np.float16 else torch.float32)
        rows = rows.cpu().numpy()  # [B, layer, Hs, seq]
        for i in range(self.B):
            if not live[i]:
                continue
            qpos = lens[i] - 1 + t
            row = rows[i, :, :, : qpos + 1]  # [layer, Hs, qpos+1]
            if L.resolution == "token":
                self.attn[i, j, :, :, : qpos + 1] = row
            else:
                self.sink[i, j] = _pad_last(row[:, :, : L.n_sink], L.n_sink)
                self.attn[i, j] = window_sums(row, L.n_sink, L.window, L.n_windows)
            if L.record_qkv and t > 0:
                caps = [recorder.layers[layer] for layer in range(L.n_layers)]
                q = torch.stack([c.q[i, :, -1] for c in caps], 0).cpu().numpy()  # [L, H, D]
                k = torch.stack([c.k[i, :, -1] for c in caps], 0).cpu().numpy()  # [L, Hkv, D]
                v = torch.stack([c.v[i, :, -1] for c in caps], 0).cpu().numpy()
                self.qkv.append((i, qpos, q, k, v))

    def block(self, batch, t_end, prompt_ids, generated, n_steps, finished, S) -> Block:
        L = self.layout
        blk = Block()
        t0 = self.t0 if self.t0 is not None else t_end - 1
        n = t_end - t0
        sl = slice(batch[0], batch[-1] + 1)
        if L.resolution == "token":
            blk.writes.append(("attn", (sl, slice(t0, t_end)), self.attn[:, :n]))
        else:
            blk.writes.append(("attn", (sl, slice(t0, t_end)), self.attn[:, :n]))
            blk.writes.append(("attn_sink", (sl, slice(t0, t_end)), self.sink[:, :n]))
        by_sample: dict[int, list] = {}
        for i, qpos, q, k, v in self.qkv:
            by_sample.setdefault(i, []).append((qpos, q, k, v))
        for i, items in by_sample.items():  # one region per sample and block: each chunk written once
            s = batch[i]
            items.sort(key=lambda item: item[0])
            p0, p1 = items[0][0], items[-1][0] + 1
            if p1 - p0 != len(items):
                raise RuntimeError("q/k/v of a block must cover consecutive positions")
            q = np.stack([item[1] for item in items])  # [n, L, H, D]
            k = np.stack([item[2] for item in items], axis=2)  # [L, Hkv, n, D]
            v = np.stack([item[3] for item in items], axis=2)
            blk.writes.append(("q", (slice(s, s + 1), slice(p0, p1)), q[None].astype(self.dtype)))
            region = (slice(s, s + 1), slice(None), slice(None), slice(p0, p1))
            blk.writes.append(("k", region, k[None].astype(self.dtype)))
            blk.writes.append(("v", region, v[None].astype(self.dtype)))
        B = len(batch)
        tokens = np.full((B, L.n_pos), -1, dtype=np.int32)
        query_pos = np.full((B, S), -1, dtype=np.int32)
        token_id = np.full((B, S), -1, dtype=np.int32)
        counts = []
        for i in range(B):
            P = len(prompt_ids[i])
            valid = int(min(t_end, n_steps[i]))
            counts.append(valid)
            tokens[i, :P] = prompt_ids[i]
            gen = generated[i, :valid]
            tokens[i, P : P + valid] = gen
            query_pos[i, :valid] = P - 1 + np.arange(valid)
            token_id[i, :valid] = gen
        blk.writes.append(("tokens", (sl,), tokens))
        blk.writes.append(("query_pos", (sl,), query_pos))
        blk.writes.append(("token_id", (sl,), token_id))
        blk.writes.append(("n_steps", (sl,), np.asarray(counts, dtype=np.int32)))
        for i, s in enumerate(batch):
            blk.commit[s] = counts[i]
            blk.done[s] = bool(finished[i] or t_end >= S)
        return blk


class _PolicyBuffers:
    """Tier snapshots and bytes of a live policy cache, written with each block."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.every = layout.window
        self.events: dict[int, np.ndarray] = {}  # event → tiers [layer, kv_head, pos]
        self.bytes: dict[int, tuple[float, int]] = {}  # step → (SPEC accounting, actual)

    def add_step(self, t: int, cache) -> None:
        self.bytes[t] = (cache.bytes_model[-1], cache.bytes_actual[-1])
        if t in cache.tier_events:
            tiers = cache.tier_events.pop(t)
            out = np.full(tiers.shape[:2] + (self.layout.n_pos,), -1, dtype=np.int8)
            n = min(tiers.shape[-1], self.layout.n_pos)
            out[..., :n] = tiers[..., :n]
            self.events[t // self.every] = out

    def flush_into(self, block: Block, s: int) -> None:
        for e, tiers in self.events.items():  # one chunk per event
            block.writes.append(("policy_tiers", (slice(s, s + 1), slice(e, e + 1)), tiers[None, None]))
        if self.bytes:  # the block's steps are consecutive: one region per array
            steps = sorted(self.bytes)
            region = (slice(s, s + 1), slice(steps[0], steps[-1] + 1))
            block.writes.append(("policy_bytes", region, np.array([[self.bytes[t][0] for t in steps]])))
            block.writes.append(("policy_cache_bytes", region, np.array([[self.bytes[t][1] for t in steps]])))
        self.events, self.bytes = {}, {}


def window_sums(row: np.ndarray, n_sink: int, w: int, n_windows: int) -> np.ndarray:
    """[.., n] row (NaN-free up to query_pos) -> [.., n_windows] window masses.

    Window ``j`` sums positions ``[n_sink + j·w, n_sink + (j+1)·w)`` that exist; a window
    whose first position lies beyond the row is NaN.
    """
    body = row[..., n_sink:]
    n = body.shape[-1]
    padded = np.zeros((*body.shape[:-1], n_windows * w), dtype=np.float32)
    padded[..., : min(n, n_windows * w)] = body[..., : n_windows * w]
    sums = padded.reshape(*body.shape[:-1], n_windows, w).sum(-1)
    exists = np.arange(n_windows) * w < n
    return np.where(exists, sums, np.nan)


def _pad_last(x: np.ndarray, n: int) -> np.ndarray:
    out = np.full((*x.shape[:-1], n), np.nan, dtype=np.float32)
    out[..., : x.shape[-1]] = x
    return out
