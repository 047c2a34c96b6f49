"""``kvscope run`` and ``kvscope validate``: a policy cache live, and replay checked against it."""

from __future__ import annotations

import json

from .. import defaults
from ..live.inputs import KV_DTYPES
from ..model.loading import DEFAULT_MODEL, MODEL_DTYPES, check_model_dtype
from ..report import print_table
from ..tracing.settings import KERNELS
from .common import (
    add_allocation,
    add_prompt_sources,
    add_protocol,
    human_bytes,
    policy_names,
    progress_bar,
    question_agnostic,
    read_prompts,
)


def add_run(sub) -> None:
    p = sub.add_parser("run", help="generate under a policy cache and compare with full-KV decoding")
    add_prompt_sources(p)
    p.add_argument(
        "--policy", required=True,
        help="a policy, name or name:key=value:… (e.g. qevict:q_frac=0.5 or press:KnormPress): " + policy_names(live=True),
    )  # fmt: skip
    p.add_argument("--budget", required=True, help="β: share of the full cache's bytes, in (0, 1]")
    add_allocation(p, several=False)
    p.add_argument("--model", default=DEFAULT_MODEL, help="short name, HF folder, .gguf file or hub id")
    p.add_argument(
        "--max-new-tokens", type=int, default=None,
        help="default 64, or the workload's (--dataset: a row's own max_new_tokens comes first)",
    )  # fmt: skip
    p.add_argument("--kv-dtype", default="model", help="storage of FP entries: " + " | ".join(("model", *KV_DTYPES)))
    p.add_argument("--window", type=int, default=defaults.W, help="window size w")
    p.add_argument("--sinks", type=int, default=defaults.N_SINK, dest="n_sink", help="sink positions")
    p.add_argument("--model-dtype", default="auto", help=" | ".join(MODEL_DTYPES))
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N]")
    p.add_argument("--attn", default="sdpa", help=" | ".join(KERNELS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--trust-remote-code", action="store_true")
    add_protocol(p, "compress the context before the question is fed (split prompts: niah, vt, JSONL)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_run)


def _live_inputs(args, clairvoyant_allocation: bool = False):
    """``(policy, budget, allocation)`` of ``--policy``/``--budget``/``--allocation``/``--kv-dtype``,
    checked before any work (the oracle allocation only where a trace gives it: validate)."""
    from ..live.inputs import kv_dtype_name, live_allocation, live_policy
    from ..policies import check_budget
    from ..policies.allocation import check_allocatable
    from ..policies.allocation import parse as parse_allocation

    budget = check_budget(args.budget)
    policy = live_policy(args.policy)
    allocation = parse_allocation(args.allocation) if clairvoyant_allocation else live_allocation(args.allocation)
    check_allocatable([policy], [allocation])
    kv_dtype_name(args.kv_dtype)
    return policy, budget, allocation


def cmd_run(args) -> int:
    policy, budget, allocation = _live_inputs(args)
    check_model_dtype(args.model_dtype)  # before torch loads with kvscope.live.run
    from ..live.run import run

    if args.workload is None and args.max_new_tokens is None:
        args.max_new_tokens = defaults.MAX_NEW_TOKENS
    prompts, workload = read_prompts(args)
    question_agnostic(args)
    bar, task = progress_bar("run", args.quiet, "forwards (full KV, policy, policy teacher-forced per prompt)")
    with bar:
        results = run(
            prompts, policy, budget, model=args.model, max_new_tokens=args.max_new_tokens, kv_dtype=args.kv_dtype,
            device=args.device, model_dtype=args.model_dtype, attn=args.attn, chat=args.chat, n_sink=args.n_sink,
            w=args.window, scorer=workload.scorer if workload is not None else None,
            trust_remote_code=args.trust_remote_code, question_agnostic=args.question_agnostic, allocation=allocation,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )  # fmt: skip
    if args.json:
        docs = [r.doc() for r in results]
        for d in docs:
            d.pop("bytes_actual")
        print(json.dumps({"model": args.model, "samples": docs}, indent=1))
        return 0
    from rich.table import Table

    r0 = results[0]
    exact = any(r.answer_exact is not None for r in results)
    table = Table(
        "sample", "agree", "KL", "ppl (full)", "tok/s (full)", "cache peak", "of full", "score (full)",
        *(["exact (full)"] if exact else []),
        title=f"run · {r0.policy} at β = {r0.budget}"
        + ("" if r0.allocation == "uniform" else f" under {r0.allocation}")
        + f" · {args.model} · kv {r0.kv_dtype}"
        + (" · question-agnostic" if args.question_agnostic else ""),
    )  # fmt: skip
    for n, r in enumerate(results):
        score = "" if r.score is None else f"{r.score:.2f} ({r.score_full:.2f})"
        table.add_row(
            str(n), f"{r.agreement:.3f}", f"{r.kl:.4f}", f"{r.perplexity:.3f} ({r.perplexity_full:.3f})",
            f"{r.tokens_per_s:.1f} ({r.tokens_per_s_full:.1f})", human_bytes(r.bytes_actual_peak),
            f"{r.bytes_actual_peak / r.full_bytes:.3f}" + ("" if r.budget_reached else " floor"), score,
            *([_exact(r)] if exact else []),
        )  # fmt: skip
    print_table(table, 126 if exact else 110)
    for n, r in enumerate(results):
        print(f"  sample {n}: {r.text[:120]!r}")
    return 0


def _exact(r) -> str:
    """``answer_exact (answer_exact_full)`` of one result (blank without a gold answer)."""
    return "" if r.answer_exact is None else f"{r.answer_exact} ({r.answer_exact_full})"


def add_validate(sub) -> None:
    p = sub.add_parser("validate", help="check that replay predicts a live policy cache (decisions, errors)")
    p.add_argument("store", help="a full-KV trace recorded with --record qkv")
    p.add_argument(
        "--policy", required=True,
        help="a policy, name or name:key=value:… (e.g. qevict:q_frac=0.5 or press:SnapKVPress): " + policy_names(live=True),
    )  # fmt: skip
    p.add_argument("--budget", required=True, help="β in (0, 1]")
    add_allocation(p, several=False)
    p.add_argument("--kv-dtype", default="model", help="storage of FP entries: " + " | ".join(("model", *KV_DTYPES)))
    p.add_argument("--live-out", default=None, help="keep the trace recorded under the live cache here")
    p.add_argument("--force", action="store_true", help="overwrite an existing --live-out")
    p.add_argument("--model", default=None, help="re-decode with this model instead of the one the store names")
    p.add_argument(
        "--question-agnostic", action="store_true", help="require a trace recorded with trace --question-agnostic"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_validate)


def cmd_validate(args) -> int:
    from rich.table import Table

    from ..storage.store import read_attrs

    policy, budget, allocation = _live_inputs(args, clairvoyant_allocation=True)
    read_attrs(args.store)
    from ..live.validate import validate

    report = validate(
        args.store, policy, budget, live_out=args.live_out, force=args.force, model=args.model,
        kv_dtype=args.kv_dtype, question_agnostic=args.question_agnostic, allocation=allocation,
    )  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
        return 0 if report["decisions_identical"] else 1
    table = Table("layer", "open-loop error (predicted)", "live error", "predicted / live",
                  title=f"validate · {report['policy']} at β = {budget} under {report['allocation']} · {args.store}")  # fmt: skip
    fmt = lambda x: "—" if x is None else f"{x:.4f}"
    for row in report["layers"]:
        table.add_row(str(row["layer"]), fmt(row["predicted"]), fmt(row["live"]), fmt(row["ratio"]))
    table.add_row("mean", fmt(report["predicted_mean"]), fmt(report["live_mean"]), "")
    print_table(table)
    verdict = "identical" if report["decisions_identical"] else "DIFFERENT"
    print(
        f"decisions: {verdict} — {report['decisions_agreeing']:,} of {report['decisions_compared']:,} "
        f"(event, layer, kv_head, position) tiers agree"
        + ("" if report["first_mismatch"] is None else f"; first mismatch {report['first_mismatch']}")
    )
    print(
        f"tokens: {report['token_agreement']:.3f} of the live decode's tokens equal the full-KV trace's; "
        f"correlation of per-layer errors {fmt(report['correlation'])}"
    )
    return 0 if report["decisions_identical"] else 1
