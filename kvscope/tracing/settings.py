"""What determines a trace's contents: ``TraceSettings``, checked where they are defined.

A module of its own, light to import (no torch, transformers or zarr), so that the CLI refuses
an option out of range before it loads any of them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .. import defaults
from ..errors import KvscopeError
from ..model.loading import DEFAULT_MODEL, check_model_dtype
from ..params import ParamSpec, check_value

KERNELS = ("sdpa", "eager", "flash_attention_2")
# where a traced layer's output comes from: the chosen kernel (bit for bit the untraced model),
# or the probabilities the recorder computes anyway (``out = a·V``: one pass over K and V, not two)
ATTN_OUTPUTS = ("kernel", "probs")
HEAD_MODES = ("all", "kv", "mean")


@dataclass
class TraceSettings:
    """Everything that determines a trace's contents (compared on ``resume``).

    ``kvscope.trace(prompts, out, max_new_tokens=64)`` sets fields by name; the command line's
    ``kvscope trace`` options are the same (``--max-new-tokens``; ``--sinks`` for ``n_sink``,
    ``--record qkv`` for ``record_qkv``, ``--ignore-eos`` for ``stop_at_eos=False``). Checked
    by [`check`][kvscope.TraceSettings.check] before any model loads.

    Attributes:
        model: The model: a short name (``kvscope models``), a Hugging Face folder, a ``.gguf``
            file or a hub id.
        max_new_tokens: Decode steps per prompt at most (≥ 1). Prompts with a given continuation
            (``Prompt.continuation``) force ``min(its tokens, max_new_tokens)`` steps; None: all
            of each continuation (resolved with the tokenizer before the trace begins).
        heads: Which attention rows are stored: ``kv``, one row per KV head (the mean over its
            group of query heads); ``all``, every query head; ``mean``, one row per layer.
        resolution: ``token``, one value per key position; ``window``, one per window of ``w``
            positions after the sinks.
        window: The window size ``w``: positions per window after the sinks (a multiple of 4).
        n_sink: Sinks: the first positions, kept apart from the windows (≥ 0).
        obs_window: Prefill rows stored besides the column sums (SnapKV's observation window).
        record_qkv: Also store the post-RoPE queries, keys and values (needed by
            ``observe="exact"``, output errors and the presses).
        dtype: Storage dtype of the attention rows and of q/k/v: ``float16`` or ``float32``.
        device: ``cpu`` or ``cuda[:N]``.
        attn: The attention kernel: ``sdpa``, ``eager`` or ``flash_attention_2`` (CUDA, global
            attention only).
        attn_output: Where a traced layer's output comes from: ``kernel``, the chosen kernel
            (bit for bit the untraced model), or ``probs``, the probabilities the recorder computes
            anyway (``out = a·V``: one pass over K and V, not two; equal up to summation order).
        model_dtype: The model's dtype: ``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``,
            ``bfloat16`` or ``float16``.
        seed: Seed of the sampler (with ``temperature > 0``).
        temperature: Sampling temperature; 0 decodes greedily.
        batch_size: Prompts decoded together (left-padded).
        block_steps: Decode steps per written block (one chunk of rows).
        stop_at_eos: Stop a sample at its end-of-sequence token.
        chat: Wrap each prompt in the model's chat template.
        trust_remote_code: Let transformers run a model folder's own code.
        question_agnostic: Prefill the context only; the question's tokens are then forced decode
            steps (prompts with a question: ``niah``, ``vt``, JSONL with ``question``).
    """

    model: str = DEFAULT_MODEL
    max_new_tokens: int | None = defaults.MAX_NEW_TOKENS
    heads: str = "kv"  # one of HEAD_MODES
    resolution: str = "token"
    window: int = defaults.W
    n_sink: int = defaults.N_SINK
    obs_window: int = defaults.OBS_WINDOW
    record_qkv: bool = False
    dtype: str = "float16"
    device: str = "cpu"
    attn: str = "sdpa"  # one of KERNELS
    attn_output: str = "kernel"  # one of ATTN_OUTPUTS
    model_dtype: str = "auto"  # one of MODEL_DTYPES
    seed: int = 0
    temperature: float = 0.0
    batch_size: int = 1
    block_steps: int = defaults.BLOCK_STEPS
    stop_at_eos: bool = True
    chat: bool = False
    trust_remote_code: bool = False
    question_agnostic: bool = False

    def check(self) -> None:
        """Refuse a setting out of range, one line naming its option (``KvscopeError``)."""
        self._check_kinds()
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
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
        if self.attn_output not in ATTN_OUTPUTS:
            raise KvscopeError(f"--attn-output must be one of {', '.join(ATTN_OUTPUTS)} (got {self.attn_output!r})")
        check_model_dtype(self.model_dtype)
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
        kinds = {"int": int, "float": float, "int | None": int}
        for f in fields(self):
            if f.type in kinds:
                spec = ParamSpec(flag=_FLAGS.get(f.name))
                optional = f.type.endswith("| None")
                value = check_value("trace", f.name, getattr(self, f.name), spec=spec, kind=kinds[f.type],
                                    optional=optional, by_flag=True)  # fmt: skip
                setattr(self, f.name, value)


_FLAGS = {"n_sink": "--sinks"}  # the trace options whose flag is not the field's name
