"""``kvscope run``: generate under a policy cache and measure how far it strays from full KV.

Three decodes of the same prompt, greedy, ``S`` forwards each (no stop at EOS, so every
metric compares the same steps):

    full       DynamicCache                      tokens y*_t, logits z*_t          [S], [S, vocab]
    free       PolicyCache, own greedy tokens    tokens y_t (the text, the score)  [S]
    forced     PolicyCache, fed y*_t             logits z_t                        [S, vocab]

    agreement   = mean_t [y_t = y*_t]
    kl          = mean_t KL(softmax z*_t ‖ softmax z_t)             nats per token
    perplexity  = exp(mean_t −log softmax(z_t)[y*_t])               of the full-KV continuation
                  (``perplexity_full`` = the same under full KV, for reference)

Forward ``t`` of the forced decode sees the same tokens as forward ``t`` of the full
decode, so ``kl`` isolates what the cache changed. ``question_agnostic``: the prompt's context
is prefilled alone (the policy compresses it there), the question's tokens are then fed one
forward each, and the ``S`` steps above are those after the question; prompts whose contexts are the
same tokens (a context's questions) share one budget, ``β · FP_bytes(P + max_q (Q_q + S_q))``
(``context_forwards``). Bytes are the policy cache's own (free decode): the peak of ``bytes_actual`` and
of the byte model (docs/concepts.md#budget), against the budget.

A prompt with answers (``Prompt.answers``: ``run --dataset``, a workload's) is graded on the
free decode's text and on full KV's: ``score`` / ``score_full``, its task's metric
(``kvscope.workloads.metrics.metric_for(task)(text, answers)``), and ``answer_exact`` /
``answer_exact_full``, 1 where the greedy tokens begin with the gold answer's
(``kvscope.model.prompts.answer_ids``), else 0. A prompt whose ``meta`` gives
``max_new_tokens`` (a dataset row's) decodes that many steps instead of the run's.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .. import defaults
from ..errors import KvscopeError
from ..model.loading import DEFAULT_MODEL, check_model_dtype, load, resolve
from ..model.prompts import as_prompts, check_context, encode_answers, encode_prompts, eos_ids, task_of
from ..model.spec import ModelSpec, cache_keyword, last_logits_only, returned_cache
from ..policies import check_budget
from ..policies.allocation import check_allocatable
from .cache import PolicyCache, parse_kv_dtype, prepare
from .inputs import live_allocation, live_policy


@dataclass
class Decoded:
    tokens: list[int]  # [S] greedy choice of every forward
    logits: object  # torch [S, vocab] float32
    seconds: float


def decode(
    model, prompt_ids: list[int], cache, steps: int, forced: list[int] | None = None, on_step=None, question=()
) -> Decoded:
    """``steps`` greedy forwards (the prompt, then one token each) with ``cache``; with
    ``forced`` the next input is ``forced[t]`` instead of the greedy token. ``question``: tokens
    fed one forward each after the prompt, before the ``steps`` (whose logits alone are kept).
    ``on_step()`` is called after every forward."""
    import torch

    device = next(model.parameters()).device
    tokens, logits = [], []
    inputs = torch.tensor([prompt_ids], device=device)
    last_only = last_logits_only(model)
    keyword = cache_keyword(model)
    started = time.perf_counter()
    with torch.no_grad():
        for t in range(len(question) + steps):
            out = model(input_ids=inputs, use_cache=True, **{keyword: cache}, **last_only)
            cache = returned_cache(out)
            if hasattr(cache, "end_step"):
                cache.end_step()
            if t < len(question):
                nxt = int(question[t])
            else:
                last = out.logits[0, -1].float()
                logits.append(last.cpu())
                tokens.append(int(last.argmax()))
                nxt = tokens[-1] if forced is None else int(forced[t - len(question)])
            inputs = torch.tensor([[nxt]], device=device)
            if on_step is not None:
                on_step()
    return Decoded(tokens, torch.stack(logits), time.perf_counter() - started)


def agreement(full: Decoded, free: Decoded, forced: Decoded) -> dict:
    """The metrics of the module docstring."""
    import torch

    ref_logp = torch.log_softmax(full.logits, -1)  # [S, vocab]
    logp = torch.log_softmax(forced.logits, -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # [S]
    target = torch.tensor(full.tokens)[:, None]
    nll = -logp.gather(-1, target)[:, 0]
    nll_full = -ref_logp.gather(-1, target)[:, 0]
    same = np.mean([a == b for a, b in zip(free.tokens, full.tokens)])
    return {
        "agreement": float(same),
        "first_divergence": next((t for t, (a, b) in enumerate(zip(free.tokens, full.tokens)) if a != b), None),
        "kl": float(kl.mean()),
        "kl_max": float(kl.max()),
        "perplexity": float(math.exp(nll.mean())),
        "perplexity_full": float(math.exp(nll_full.mean())),
    }


@dataclass
class RunResult:
    policy: str
    budget: float
    prompt_tokens: int
    new_tokens: int
    text: str
    text_full: str
    agreement: float
    first_divergence: int | None
    kl: float
    kl_max: float
    perplexity: float
    perplexity_full: float
    tokens_per_s: float
    tokens_per_s_full: float
    bytes_actual_peak: int
    bytes_index_peak: int
    bytes_model_peak: float
    budget_bytes: float
    full_bytes: float
    budget_reached: bool
    kv_dtype: str
    question_tokens: int = 0  # question-agnostic: forced question steps between the context and the answer
    allocation: str = "uniform"
    layer_bytes: list[float] = field(default_factory=list)  # [layer] bytes the allocation gave, × uniform
    score: float | None = None
    score_full: float | None = None
    answer_exact: int | None = None  # 1: the policy's greedy tokens begin with the gold answer's (prompts with answers)
    answer_exact_full: int | None = None  # the same under full KV
    bytes_actual: list[int] = field(default_factory=list)  # [step]

    def doc(self) -> dict:
        return asdict(self)


def run_loaded(
    model,
    tokenizer,
    prompt_ids: list[int],
    policy,
    budget: float,
    max_new_tokens: int,
    *,
    kv_dtype=None,
    n_sink: int = defaults.N_SINK,
    w: int = defaults.W,
    scorer=None,
    expected=None,
    on_step=None,
    question: list[int] = (),
    allocation=None,
    full: Decoded | None = None,
    answers: list[str] | None = None,
    answer: list[int] | None = None,
    task: str | None = None,
    sized_for: int | None = None,
) -> RunResult:
    """Run the three decodes of the module docstring with a loaded, prepared model
    (``on_step()`` after every forward of each); ``prompt_ids`` is the context alone when
    ``question`` holds the question's tokens (question-agnostic). ``full``: the full-KV decode
    of this prompt already made (``full_decode``), shared by every policy run on it.
    ``answers`` (with ``task``): the accepted answers, graded by the task's metric instead of
    ``scorer``; ``answer``: the gold answer's token ids (``answer_exact``). ``sized_for``: the
    forwards after the prompt's the budget is sized for (default ``len(question) + max_new_tokens``;
    ``run`` gives a context's questions their longest, ``context_forwards``)."""
    n_forwards = sized_for or len(question) + max_new_tokens

    def make():
        return PolicyCache(
            model, policy, budget, n_forwards, kv_dtype=kv_dtype, n_sink=n_sink, w=w, allocation=allocation
        )

    probe = make()  # refuse bad input before decoding anything
    steps = {"steps": max_new_tokens, "on_step": on_step, "question": question}
    if full is None:
        full = full_decode(model, prompt_ids, max_new_tokens, on_step=on_step, question=question)
    free = decode(model, prompt_ids, probe, **steps)
    forced = decode(model, prompt_ids, make(), forced=full.tokens, **steps)
    metrics = agreement(full, free, forced)
    text = _text(tokenizer, model, free.tokens)
    text_full = _text(tokenizer, model, full.tokens)
    result = RunResult(
        policy=probe.policy.label(),
        budget=float(budget),
        prompt_tokens=len(prompt_ids),
        new_tokens=max_new_tokens,
        text=text,
        text_full=text_full,
        tokens_per_s=max_new_tokens / free.seconds,
        tokens_per_s_full=max_new_tokens / full.seconds,
        bytes_actual_peak=max(probe.bytes_actual),
        bytes_index_peak=max(probe.bytes_index),
        bytes_model_peak=max(probe.bytes_model),
        budget_bytes=probe.budget_bytes,
        full_bytes=probe.full_bytes,
        budget_reached=bool(probe.state.reached),
        kv_dtype=str(probe.kv_dtype).removeprefix("torch."),
        question_tokens=len(question),
        allocation=probe.allocation.label(),
        layer_bytes=_layer_shares(probe.state.spec),
        bytes_actual=list(probe.bytes_actual),
        **metrics,
    )
    if answers is not None:
        from ..workloads.metrics import metric_for

        metric = metric_for(task)
        result.score, result.score_full = float(metric(text, answers)), float(metric(text_full, answers))
    elif scorer is not None and expected is not None:
        result.score = float(scorer(text, expected))
        result.score_full = float(scorer(text_full, expected))
    if answer is not None:
        result.answer_exact = int(free.tokens[: len(answer)] == list(answer))
        result.answer_exact_full = int(full.tokens[: len(answer)] == list(answer))
    return result


def full_decode(model, prompt_ids: list[int], max_new_tokens: int, on_step=None, question=()) -> Decoded:
    """The full-KV decode of ``run_loaded`` (a ``DynamicCache``)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    return decode(model, prompt_ids, cache, max_new_tokens, on_step=on_step, question=question)


def _layer_shares(spec) -> list[float]:
    """``[layer]`` the bytes each layer held room for, as a multiple of the uniform split."""
    shape = (spec.n_layers, spec.n_kv)
    capacity, uniform = np.broadcast_to(spec.capacity, shape), np.broadcast_to(spec.uniform_capacity, shape)
    return [round(float(x), 4) for x in capacity.mean(1) / uniform.mean(1)]


def _text(tokenizer, model, tokens: list[int]) -> str:
    """The generated text up to the first end-of-sequence token."""
    eos = set(eos_ids(model, tokenizer))
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokenizer.decode(tokens[:cut])


def run(
    prompts,
    policy,
    budget: float,
    *,
    model: str = DEFAULT_MODEL,
    max_new_tokens: int = defaults.MAX_NEW_TOKENS,
    kv_dtype: str | None = None,
    device: str = "cpu",
    model_dtype: str = "auto",
    attn: str = "sdpa",
    chat: bool = False,
    n_sink: int = defaults.N_SINK,
    w: int = defaults.W,
    scorer=None,
    trust_remote_code: bool = False,
    question_agnostic: bool = False,
    allocation: str = "uniform",
    progress=None,
) -> list[RunResult]:
    """Generate every prompt (text or [`Prompt`][kvscope.model.prompts.Prompt]) under
    ``policy`` at ``budget`` and compare with full KV (module docstring). ``progress(done,
    total)`` is called after every forward (3 decodes × (question + ``max_new_tokens``) per
    prompt). A prompt's own ``meta["max_new_tokens"]`` (a dataset row's) replaces
    ``max_new_tokens`` for it; a gold answer longer than its decode is refused."""
    check_budget(budget)
    policy = live_policy(policy)
    allocation = live_allocation(allocation)
    check_allocatable([policy], [allocation])
    if max_new_tokens < 1:
        raise KvscopeError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    dtype = parse_kv_dtype(kv_dtype)
    check_model_dtype(model_dtype)
    prompts = as_prompts(prompts)
    source = resolve(model)
    loaded, tokenizer = load(source, device, model_dtype, trust_remote_code)
    return run_prompts(
        loaded, tokenizer, prompts, policy=policy, budget=budget, max_new_tokens=max_new_tokens, kv_dtype=dtype, attn=attn,
        chat=chat, n_sink=n_sink, w=w, scorer=scorer, question_agnostic=question_agnostic, allocation=allocation,
        progress=progress,
    )  # fmt: skip


def run_prompts(
    loaded,
    tokenizer,
    prompts: list,
    *,
    policy,
    budget: float,
    max_new_tokens: int = defaults.MAX_NEW_TOKENS,
    kv_dtype=None,
    attn: str = "sdpa",
    chat: bool = False,
    n_sink: int = defaults.N_SINK,
    w: int = defaults.W,
    scorer=None,
    question_agnostic: bool = False,
    allocation=None,
    progress=None,
) -> list[RunResult]:
    """``run``'s work with a loaded model (benchmarks run a grid of policies and budgets on one):
    ``prompts`` as [`Prompt`][kvscope.model.prompts.Prompt]s, ``policy`` and
    ``allocation`` as ``live_policy`` / ``live_allocation`` give them, ``kv_dtype`` as
    ``parse_kv_dtype`` does."""
    encoded, questions = encode_prompts(tokenizer, prompts, chat, question_agnostic)
    steps = [int(p.meta.get("max_new_tokens") or max_new_tokens) for p in prompts]
    answers = encode_answers(tokenizer, prompts)
    for n, (prompt, ids, s) in enumerate(zip(prompts, answers, steps)):
        if ids is not None and len(ids) > s:
            what = "its max_new_tokens" if prompt.meta.get("max_new_tokens") else "--max-new-tokens"
            raise KvscopeError(
                f"the answer of prompt {n} ({prompt.source}) has {len(ids)} tokens, more than {what} {s}: the output "
                "could never begin with it; decode more tokens"
            )
    context = ModelSpec.from_model(loaded).max_position_embeddings
    check_context(encoded, max_new_tokens, context, questions, prompts=prompts, steps=steps)
    prepare(loaded, attn)
    results = []
    done, total = [0], 3 * sum(len(q) + s for q, s in zip(questions, steps))

    def on_step():
        done[0] += 1
        if progress is not None:
            progress(done[0], total)

    forwards = [len(q) + s for q, s in zip(questions, steps)]
    sized = context_forwards(encoded, forwards) if question_agnostic else forwards
    for n, (prompt, ids, question, s, answer) in enumerate(zip(prompts, encoded, questions, steps, answers)):
        results.append(
            run_loaded(
                loaded, tokenizer, ids, policy, budget=budget, max_new_tokens=s, kv_dtype=kv_dtype,
                n_sink=n_sink, w=w, scorer=scorer, expected=prompt.expected, on_step=on_step, question=question,
                allocation=allocation, answers=prompt.answers, answer=answer, task=task_of(prompt.doc()) or None,
                sized_for=sized[n],
            )
        )  # fmt: skip
    return results


def context_forwards(encoded: list[list[int]], forwards: list[int]) -> list[int]:
    """``[prompt]`` the forwards each prompt's budget is sized for: its own ``forwards``, the most of
    any prompt with the same prefill (a context with several questions, question-agnostic: each
    question is answered over the same compressed context, as ``ds.kvscope.final_len`` sizes it offline)."""
    longest: dict[tuple[int, ...], int] = {}
    for ids, n in zip(encoded, forwards):
        longest[tuple(ids)] = max(longest.get(tuple(ids), 0), n)
    return [longest[tuple(ids)] for ids in encoded]
